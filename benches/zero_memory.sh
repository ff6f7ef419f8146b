#!/usr/bin/env bash
# Per-rank peak RSS and training-state bytes of 2 CPU ranks at system.zero_stage 0-3, from
# each rank's memory line at the last step (logs/<run>/rank_N.log), for the tiny preset (fp32
# and bf16) and a 200M-parameter shape.
# usage: benches/zero_memory.sh [steps=4]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
steps=${1:-4}
cargo build --release --bin lockstep 2>/dev/null
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cd "$work"
common=(--preset tiny --max-steps "$steps" --set training.batch_size=8 --set training.context_length=256
        --set training.eval_batches=0 --set checkpoint.interval=0
        --set logging.memory_interval="$steps")
medium=(--set model.hidden_size=1024 --set model.num_layers=8 --set model.num_attention_heads=16
        --set model.num_key_value_heads=8 --set model.intermediate_size=2816 --set training.batch_size=2)
run() { # name, extra args...
  local name=$1; shift
  "$ROOT/target/release/lockstep" run --nproc 2 --cpu "${common[@]}" "$@" --set logging.run_name="$name" \
    > "$name.out" 2>&1 || { echo "$name failed"; tail -5 "$name.out"; return; }
  local dir; dir=$(sed -n 's/.*logs in \(.*\)$/\1/p' "$name.out" | tail -1)
  for r in 0 1; do
    printf '%-14s rank %s: %s\n' "$name" "$r" "$(grep 'Memory |' "$dir/rank_$r.log" | tail -1 | sed 's/^\[CPU.\] Memory | //')"
  done
}
for stage in 0 1 2 3; do run "tiny-s$stage" --set system.zero_stage=$stage; done
for stage in 0 2 3; do run "tiny-bf16-s$stage" --set system.zero_stage=$stage --set training.dtype=bf16; done
for stage in 0 1 2 3; do run "200m-s$stage" "${medium[@]}" --set system.zero_stage=$stage; done
# Full activation checkpointing: the mode in which stage 3 holds no layer's full parameters
# between its forward and its backward.
for stage in 0 2 3; do
  run "200m-full-s$stage" "${medium[@]}" --set system.zero_stage=$stage --set training.activation_checkpointing=full
done
