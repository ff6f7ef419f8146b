#!/usr/bin/env bash
# Muon against AdamW to the same validation loss, on the embedded Shakespeare corpus: the tiny
# preset (4 layers, d 256, 50257 ids, batch 4 × 128 tokens, fp32) on one rank of THREADS
# threads, STEPS steps (warmup 10, cosine to a tenth), each optimizer at the learning rates LRS
# (Muon with match_rms_adamw, so one rate serves both), the validation loss every 25 steps over
# 8 batches. The target is the best AdamW run's last validation loss; for each run: its last
# validation loss, and the first evaluated step (and the training time up to it: the steps'
# tokens over their tokens/s, evaluation excluded) at which it reaches the target.
# usage: benches/muon_time_to_loss.sh [steps=300] [threads=2] ["lrs"="1e-3 3e-3 1e-2"]
# LOCKSTEP_BIN: the binary to time (default: target/release/lockstep, built here).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
steps=${1:-300}
threads=${2:-2}
lrs=${3:-1e-3 3e-3 1e-2}
bin=${LOCKSTEP_BIN:-}
if [ -z "$bin" ]; then
  cargo build --release --bin lockstep 2>/dev/null
  bin="$ROOT/target/release/lockstep"
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cd "$work"
runs=()
for lr in $lrs; do
  for opt in adamw muon; do
    k="$opt-$lr"
    min=$(python3 -c "print($lr / 10)")
    "$bin" train --preset tiny --max-steps "$steps" --set training.optimizer="$opt" \
      --set training.learning_rate="$lr" --set training.min_lr="$min" \
      --set training.eval_interval=25 --set training.eval_batches=8 --set checkpoint.interval=0 \
      --set logging.tensorboard=false --set logging.memory_interval=0 \
      --set system.num_threads="$threads" --set logging.run_name="$k" >"$k.log" 2>&1
    runs+=("$k")
  done
done
python3 - "${runs[@]}" <<'PY'
import json, sys
runs = {}
for k in sys.argv[1:]:
    recs = [json.loads(l) for l in open(f"runs/{k}/metrics.jsonl")]
    evals, clock = [], 0.0
    for r in recs:
        clock += 512 / r["tokens_per_s"]  # batch 4 x 128 tokens a step
        if r.get("val_loss") is not None:
            evals.append((r["step"], r["val_loss"], clock))
    runs[k] = evals
target = min(e[-1][1] for k, e in runs.items() if k.startswith("adamw"))
print(f"target: the best AdamW run's last validation loss, {target:.4f}")
for k, e in runs.items():
    hit = next(((s, c) for s, v, c in e if v <= target), None)
    reach = f"step {hit[0]}, {hit[1]:.0f} s of training" if hit else "not reached"
    print(f"{k}: last validation loss {e[-1][1]:.4f} at step {e[-1][0]} ({e[-1][2]:.0f} s); target: {reach}")
    print("  curve: " + ", ".join(f"{s} {v:.3f}" for s, v, _ in e))
PY
