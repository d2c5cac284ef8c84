#!/usr/bin/env bash
# Stop what deployments/stack-up.sh started: each service's whole process group.
# All groups are signalled at once, given $STACK_GRACE seconds together, then killed.
#   deployments/stack-down.sh        (NEEDLE_STACK_DIR as for stack-up; state is kept)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK="${NEEDLE_STACK_DIR:-$ROOT/.state/stack}"
GRACE="${STACK_GRACE:-20}"
SERVICES=(worker mlflow-server prefect-server)

alive() { kill -0 -- "-$1" 2>/dev/null; }

declare -A PGID
for name in "${SERVICES[@]}"; do
    pidfile="$STACK/pids/$name.pid"
    [[ -f "$pidfile" ]] || continue
    PGID[$name]="$(cat "$pidfile")"
    # Prefect's worker ignores SIGINT when started from a script and maps SIGTERM to SIGINT:
    # send both; the servers shut down on SIGTERM.
    kill -INT -- "-${PGID[$name]}" 2>/dev/null
    kill -TERM -- "-${PGID[$name]}" 2>/dev/null
done

for _ in $(seq "$GRACE"); do
    any=0
    for name in "${!PGID[@]}"; do alive "${PGID[$name]}" && any=1; done
    ((any)) || break
    sleep 1
done

for name in "${!PGID[@]}"; do
    if alive "${PGID[$name]}"; then
        kill -KILL -- "-${PGID[$name]}" 2>/dev/null
        echo "$name: killed after ${GRACE}s"
    else
        echo "$name: stopped"
    fi
    rm -f "$STACK/pids/$name.pid"
done
