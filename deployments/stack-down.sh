#!/usr/bin/env bash
# Stop what deployments/stack-up.sh started: each service's whole process group, worker first.
#   deployments/stack-down.sh        (NEEDLE_STACK_DIR as for stack-up; state is kept)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK="${NEEDLE_STACK_DIR:-$ROOT/.state/stack}"
GRACE="${STACK_GRACE:-15}"

stop() {
    local name=$1 pidfile="$STACK/pids/$1.pid"
    [[ -f "$pidfile" ]] || return 0
    local pgid
    pgid="$(cat "$pidfile")"
    # The worker turns SIGTERM into SIGINT and may linger: signal the group, then insist.
    kill -TERM -- "-$pgid" 2>/dev/null
    for _ in $(seq "$GRACE"); do
        kill -0 -- "-$pgid" 2>/dev/null || break
        sleep 1
    done
    if kill -0 -- "-$pgid" 2>/dev/null; then
        kill -KILL -- "-$pgid" 2>/dev/null
        echo "$name: killed after ${GRACE}s"
    else
        echo "$name: stopped"
    fi
    rm -f "$pidfile"
}

stop worker
stop mlflow-server
stop prefect-server
