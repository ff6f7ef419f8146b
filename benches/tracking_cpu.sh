#!/usr/bin/env bash
# What experiment tracking costs the step loop, on one CPU rank with one thread (the second
# core left to the trackers, as a GPU node's host cores mostly are): the tiny preset at a short
# context (fast steps, so a per-step cost would show), a record every step (logging.interval=1,
# the most a tracker is sent), for tracking off | W&B (offline: the official SDK in its sidecar,
# writing its run files) | MLflow (a local `mlflow server`) | both, interleaved REPS times.
# Per run: the median tokens/s of steps 6..STEPS (from metrics.jsonl) and the wall time of the
# whole command (start-up and the end's wait for the trackers included).
# usage: benches/tracking_cpu.sh [reps=5] [steps=60]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
reps=${1:-5}
steps=${2:-60}
cargo build --release --bin lockstep 2>/dev/null
work=$(mktemp -d -p "${BENCH_TMP:-/tmp}")
# A copy of the binary: a build during the benchmark does not change what it times.
cp "$ROOT/target/release/lockstep" "$work/lockstep"
L="$work/lockstep"
cd "$work"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$VENV/bin/mlflow" server --host 127.0.0.1 --port "$port" --workers 1 \
  --backend-store-uri "sqlite:///$work/mlflow.db" --default-artifact-root "$work/artifacts" \
  >"$work/mlflow.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; pkill -P $server 2>/dev/null; rm -rf "$work"' EXIT
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 0.5; done
shape=(--preset tiny --set training.context_length=128 --set training.batch_size=4
  --set training.eval_batches=0 --set logging.interval=1 --set logging.memory_interval=0
  --set checkpoint.interval=0 --set system.num_threads=1 --max-steps "$steps")
wandb=(--set logging.wandb.project=bench --set logging.wandb.mode=offline)
mlflow=(--set logging.mlflow.tracking_uri=http://127.0.0.1:$port)
source "$ROOT/benches/timing_lib.sh" # median
"$L" prepare "${shape[@]}" >/dev/null
echo "lockstep tracking benchmark: $(date -u +%F), $(nproc) cores, 1 rank x 1 thread, $steps steps, a record every step, $reps rounds"
declare -A tok wall
for r in $(seq "$reps"); do
  for mode in off wandb mlflow both; do
    case $mode in
      off) extra=() ;; wandb) extra=("${wandb[@]}") ;; mlflow) extra=("${mlflow[@]}") ;;
      both) extra=("${wandb[@]}" "${mlflow[@]}") ;;
    esac
    name="$mode-$r"
    t0=$(date +%s.%N)
    "$L" train "${shape[@]}" "${extra[@]}" --set logging.run_name="$name" >"$name.log" 2>&1 \
      || { echo "$mode failed:"; tail -5 "$name.log"; exit 1; }
    t1=$(date +%s.%N)
    grep -q Warning "$name.log" && { echo "$mode warned:"; grep Warning "$name.log"; }
    t=$(python3 -c 'import json,sys; v=[json.loads(l)["tokens_per_s"] for l in open(sys.argv[1])][5:]; v.sort(); print(v[len(v)//2])' "runs/$name/metrics.jsonl")
    tok[$mode]+="$t "; wall[$mode]+="$(echo "$t1 - $t0" | bc) "
  done
done
base=$(echo ${tok[off]} | tr ' ' '\n' | median)
printf "%-7s %12s %8s %10s   %s\n" mode "tokens/s" "vs off" "wall s" "per round (tokens/s)"
for mode in off wandb mlflow both; do
  m=$(echo ${tok[$mode]} | tr ' ' '\n' | median)
  w=$(echo ${wall[$mode]} | tr ' ' '\n' | median)
  printf "%-7s %12.0f %8.3f %10.1f   %s\n" "$mode" "$m" "$(echo "$m / $base" | bc -l)" "$w" "${tok[$mode]}"
done
