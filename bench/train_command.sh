#!/usr/bin/env bash
# The CPU training command of issue 30, side by side across checkouts, cold caches each:
# `needle train` of the first 400 rows of data/sample/new.jsonl, LoRA, --max-len 2048
# --batch-size 2 --steps 1 --on-error drop, on the 135M Llama-shaped base that
# `needle sample-model --arch llama --shape smollm2-135m` writes (once, into DIR/base).
# Prints a line per run: wall seconds, peak RSS, training and validation loss.
#
#   bench/train_command.sh DIR NAME=VENV [NAME=VENV ...]
#   bench/train_command.sh /tmp/crit old=/work/old/.venv new=$PWD/.venv
set -u
[ $# -ge 2 ] || { echo "usage: $0 DIR NAME=VENV [NAME=VENV ...]" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$1; shift
mkdir -p "$dir"
head -400 "$root/data/sample/new.jsonl" > "$dir/new400.jsonl"
first_venv=${1#*=}
[ -d "$dir/base" ] || "$first_venv/bin/needle" sample-model --arch llama --shape smollm2-135m \
  --data "$root/data/sample/new.jsonl" "$dir/base" > "$dir/sample.log" 2>&1 || { echo "sample-model failed: $dir/sample.log" >&2; exit 1; }
for spec in "$@"; do
  name=${spec%%=*}; venv=${spec#*=}
  rm -rf "${dir:?}/$name"; mkdir -p "$dir/$name/cwd"
  start=$(date +%s.%N)
  (cd "$dir/$name/cwd" && NEEDLE_CACHE_DIR="$dir/$name/cache" JAX_PLATFORMS=cpu /usr/bin/time -v \
    "$venv/bin/needle" train "$dir/new400.jsonl" --mode lora --base "$dir/base" --max-len 2048 --batch-size 2 \
    --steps 1 --on-error drop --out "$dir/$name/out" > "$dir/$name/log" 2>&1)
  rc=$?; end=$(date +%s.%N)
  rss_kb=$(grep 'Maximum resident' "$dir/$name/log" | awk '{print $NF}')
  losses=$(grep -o '"\(train\|val\)_loss": [0-9.]*' "$dir/$name/log" | tr '\n' ' ')
  printf '%s rc=%s wall_s=%.1f peak_rss_gb=%.2f %s\n' "$name" "$rc" "$(echo "$end - $start" | bc)" \
    "$(echo "${rss_kb:-0} / 1048576" | bc -l)" "$losses"
done
