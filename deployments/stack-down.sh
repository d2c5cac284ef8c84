#!/usr/bin/env bash
# Stop what deployments/stack-up.sh started: each service's whole process group.
# All groups are signalled at once, given $STACK_GRACE seconds together, then killed.
#   deployments/stack-down.sh        (NEEDLE_STACK_DIR as for stack-up; state is kept)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK="${NEEDLE_STACK_DIR:-$ROOT/.state/stack}"
GRACE="${STACK_GRACE:-20}"
SERVICES=(worker ray-worker ray-head mlflow-server prefect-server)

alive() { kill -0 -- "-$1" 2>/dev/null; }

# Flow runs the worker started run in sessions of their own, outside the worker's group: stop
# those that talk to this stack's API (read from each process's environment) first.
API_URL="$(sed -n 's/.*PREFECT_API_URL="\([^"]*\)".*/\1/p' "$STACK/env.sh" 2>/dev/null | head -n 1)"
if [[ -n "$API_URL" ]]; then
    for pid in $(pgrep -f "prefect.engine" || true); do
        if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "PREFECT_API_URL=$API_URL"; then
            kill -TERM "$pid" 2>/dev/null && echo "flow run process $pid: stopped"
        fi
    done
fi

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
