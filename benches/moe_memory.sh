#!/usr/bin/env bash
# Peak memory of the mixture of experts against `lockstep plan`: 4-step `lockstep train` runs of
# qwen3-moe-tiny (8 experts of 256, top 2, every layer sparse) at batch 8 x 256 in each
# activation-checkpointing mode, and of qwen3-tiny (the same model, its dense FFN 688) for the
# difference the experts make; each run's `Peak memory: RSS` line beside the plan's total for the
# same flags. A checkpoint at step 2: steps 3 and 4 run beside its staging copy, as the plan
# assumes (checkpoint.async keeps it from the first save on).
# usage: benches/moe_memory.sh [threads=2]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
threads=${1:-2}
cargo build --release --bin lockstep 2>/dev/null
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cd "$work"
shape=(--set training.batch_size=8 --set training.context_length=256 --set training.eval_batches=0
  --set system.num_threads="$threads")
for run in "qwen3-tiny none" "qwen3-moe-tiny none" "qwen3-moe-tiny selective" "qwen3-moe-tiny full"; do
  set -- $run
  flags=(--preset "$1" "${shape[@]}" --set training.activation_checkpointing="$2")
  peak=$("$ROOT/target/release/lockstep" train "${flags[@]}" --max-steps 4 --set checkpoint.interval=2 --set logging.run_name="$1-$2" 2>&1 |
    grep -o "Peak memory: RSS [0-9.]* GB" | grep -o "[0-9.]* GB")
  plan=$("$ROOT/target/release/lockstep" plan --device cpu "${flags[@]}")
  est=$(grep -o "total *[0-9.]* GB" <<<"$plan" | grep -o "[0-9.]* GB")
  act=$(grep -o "activations *[0-9.]* GB" <<<"$plan" | grep -o "[0-9.]* GB")
  echo "$1 $2: peak RSS $peak, plan $est (activations $act)"
done
