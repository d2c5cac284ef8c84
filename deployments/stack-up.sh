#!/usr/bin/env bash
# Start the local needle stack on 127.0.0.1 only:
#   a Prefect server, an MLflow tracking server with its UI (SQLite store, local artifact folder),
#   the process work pool `needle-pool`, the deployments of prefect.yaml, and a worker;
#   with NEEDLE_RAY=1 also a Ray head and one Ray worker node (one CPU each), whose address the
#   flow runs get as RAY_ADDRESS, so `cluster: {"workers": 2}` trains on both.
# Each service runs in its own process group (setsid) so deployments/stack-down.sh can stop it
# and everything it spawned. Pids, logs and all state live under $NEEDLE_STACK_DIR.
#
#   deployments/stack-up.sh
#   source .state/stack/env.sh && prefect deployment run needle/finetune --watch
#   deployments/stack-down.sh
#
# Environment (all optional):
#   NEEDLE_STACK_DIR   state, pids and logs          (default: <checkout>/.state/stack)
#   PREFECT_PORT       Prefect API and UI port       (default: 4200)
#   MLFLOW_PORT        MLflow tracking server and UI (default: 5000)
#   NEEDLE_BIN         folder with python/prefect/mlflow (default: <checkout>/.venv/bin)
#   JAX_PLATFORMS      passed to flow runs (empty: JAX picks the best backend)
#   STACK_TIMEOUT      seconds to wait for each service (default: 120)
#   NEEDLE_RAY         1: start the local Ray cluster too          (default: 0)
#   RAY_PORT           the Ray head's port (GCS)                   (default: 6379)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK="${NEEDLE_STACK_DIR:-$ROOT/.state/stack}"
PREFECT_PORT="${PREFECT_PORT:-4200}"
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
BIN="${NEEDLE_BIN:-$ROOT/.venv/bin}"
TIMEOUT="${STACK_TIMEOUT:-120}"
WITH_RAY="${NEEDLE_RAY:-0}"
RAY_PORT="${RAY_PORT:-6379}"
mkdir -p "$STACK/logs" "$STACK/pids" "$STACK/prefect" "$STACK/mlartifacts"
STACK="$(cd "$STACK" && pwd)"

# Everything below (and the flow runs the worker starts) sees these.
export PREFECT_HOME="$STACK/prefect"
export PREFECT_API_URL="http://127.0.0.1:$PREFECT_PORT/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export DO_NOT_TRACK=1
export MLFLOW_TRACKING_URI="http://127.0.0.1:$MLFLOW_PORT"
export JAX_PLATFORMS="${JAX_PLATFORMS-}"
export PATH="$BIN:$PATH"
cat >"$STACK/env.sh" <<ENV
export PREFECT_HOME="$PREFECT_HOME" PREFECT_API_URL="$PREFECT_API_URL" MLFLOW_TRACKING_URI="$MLFLOW_TRACKING_URI"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 PATH="$BIN:\$PATH"
ENV
if [[ "$WITH_RAY" == 1 ]]; then
    # Ray 2.60 has no loopback-only mode for more than one node: its ports listen on every
    # interface, so token authentication is on for the nodes and every client (the token is
    # ~/.ray/auth_token, made here when missing).
    export RAY_ADDRESS="127.0.0.1:$RAY_PORT" RAY_AUTH_MODE=token
    echo "export RAY_ADDRESS=\"$RAY_ADDRESS\" RAY_AUTH_MODE=token" >>"$STACK/env.sh"
fi

# start NAME CMD...: run CMD in a new session (its own process group) in the background.
start() {
    local name=$1
    shift
    if [[ -f "$STACK/pids/$name.pid" ]] && kill -0 "$(cat "$STACK/pids/$name.pid")" 2>/dev/null; then
        echo "$name already running (pid $(cat "$STACK/pids/$name.pid"))"
        return
    fi
    setsid "$@" >"$STACK/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$STACK/pids/$name.pid"
}

# wait_for NAME CHECK-CMD...: poll until CHECK succeeds, failing early if the service died.
wait_for() {
    local name=$1 deadline=$((SECONDS + TIMEOUT))
    shift
    until "$@" >/dev/null 2>&1; do
        if ! kill -0 "$(cat "$STACK/pids/$name.pid")" 2>/dev/null; then
            echo "$name exited; last log lines:" >&2
            tail -n 30 "$STACK/logs/$name.log" >&2
            exit 1
        fi
        if ((SECONDS > deadline)); then
            echo "$name not healthy after ${TIMEOUT}s; see $STACK/logs/$name.log" >&2
            exit 1
        fi
        sleep 1
    done
    echo "$name ready"
}

http_ok() { "$BIN/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=3)' "$1"; }

start prefect-server prefect server start --host 127.0.0.1 --port "$PREFECT_PORT"
start mlflow-server mlflow server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
    --backend-store-uri "sqlite:///$STACK/mlflow.db" --artifacts-destination "$STACK/mlartifacts"
wait_for prefect-server http_ok "$PREFECT_API_URL/health"
wait_for mlflow-server http_ok "$MLFLOW_TRACKING_URI/health"

if [[ "$WITH_RAY" == 1 ]]; then
    # --block keeps each node's processes in its group (stack-down.sh stops the group); one CPU
    # a node, so two workers of a fine-tune land one on each. No dashboard.
    RAY_OPTS=(--block --num-cpus 1 --node-ip-address 127.0.0.1 --disable-usage-stats)
    [[ -s "$HOME/.ray/auth_token" ]] || ray get-auth-token --generate >/dev/null
    start ray-head ray start --head --port "$RAY_PORT" --include-dashboard false "${RAY_OPTS[@]}"
    wait_for ray-head ray status --address "$RAY_ADDRESS"
    start ray-worker ray start --address "$RAY_ADDRESS" "${RAY_OPTS[@]}"
    nodes() { "$BIN/python" -c 'import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
sys.exit(0 if sum(n["Alive"] for n in ray.nodes()) >= 2 else 1)' "$RAY_ADDRESS"; }
    wait_for ray-worker nodes
fi

cd "$ROOT"  # prefect deploy records this directory as where flow runs start (prefect.yaml)
prefect work-pool create needle-pool --type process --overwrite >"$STACK/logs/work-pool.log" 2>&1
prefect --no-prompt deploy --all >"$STACK/logs/deploy.log" 2>&1 || { cat "$STACK/logs/deploy.log" >&2; exit 1; }
echo "deployed: $(grep -o "needle/[a-z_-]*" "$STACK/logs/deploy.log" | sort -u | tr '\n' ' ')"

start worker prefect worker start --pool needle-pool --type process --name "needle-worker-$PREFECT_PORT"
wait_for worker grep -q "started" "$STACK/logs/worker.log"

echo "Prefect UI: http://127.0.0.1:$PREFECT_PORT   MLflow UI: $MLFLOW_TRACKING_URI"
if [[ "$WITH_RAY" == 1 ]]; then echo "Ray: $RAY_ADDRESS (a head and one worker node)"; fi
echo "Use it: source $STACK/env.sh && prefect deployment run needle/finetune --watch"
