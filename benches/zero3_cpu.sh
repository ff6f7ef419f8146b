#!/usr/bin/env bash
# Zero stage 3 against stage 2 on 2 CPU ranks over the TCP ring, with and without the
# prefetch of the next unit's all-gather (`system.prefetch_units` 1 / 0), interleaved REPS
# times on the shapes below; prints each run's per-step time (data + forward/backward +
# exposed reduction + optimizer, from the verbose timing line, after the first logged window),
# the bytes rank 0 sent per step, and the medians. Full activation checkpointing (where stage 3
# frees parameters between forward and backward).
# usage: benches/zero3_cpu.sh [reps=3] [steps=6]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
reps=${1:-3}
steps=${2:-6}
cargo build --release --bin lockstep 2>/dev/null
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
ln -s "$ROOT/data" "$work/data"
cd "$work"
# name | overrides
shapes=(
  "tiny_b4_ctx128|--set training.batch_size=4 --set training.context_length=128"
  "tiny_b1x4_ctx128|--set training.batch_size=1 --set training.grad_accum_nums=4 --set training.context_length=128"
)
# variant name | overrides
variants=(
  "stage2|--set system.zero_stage=2"
  "stage3_prefetch1|--set system.zero_stage=3 --set system.prefetch_units=1"
  "stage3_prefetch0|--set system.zero_stage=3 --set system.prefetch_units=0"
)
source "$ROOT/benches/timing_lib.sh"
sent_mb() { grep -ho 'sent [0-9.]* MB' "$@" | tail -1 | awk '{print $2}'; }
for shape in "${shapes[@]}"; do
  name=${shape%%|*}; extra=${shape#*|}
  for v in "${variants[@]}"; do : > "$work/$name.${v%%|*}"; done
  for rep in $(seq "$reps"); do
    for v in "${variants[@]}"; do
      vname=${v%%|*}; vsets=${v#*|}
      run="$name-$vname-$rep"
      # shellcheck disable=SC2086
      "$ROOT/target/release/lockstep" run --nproc 2 --cpu --preset tiny --max-steps "$steps" \
        --set logging.verbose=true --set logging.interval=2 --set training.eval_batches=0 \
        --set checkpoint.interval=0 --set logging.memory_interval=0 \
        --set training.activation_checkpointing=full \
        --set logging.run_name="$run" $extra $vsets >/dev/null 2>&1 \
        || { echo "run $run failed"; exit 1; }
      read -r ms fb red < <(step_ms logs/"$run"-*/rank_0.log)
      echo "$name $vname rep $rep: $ms ms/step (forward+backward $fb, exposed reduction $red), sent $(sent_mb logs/"$run"-*/rank_0.log) MB/step"
      echo "$ms" >> "$work/$name.$vname"
    done
  done
  for v in "${variants[@]}"; do
    vname=${v%%|*}
    echo "$name $vname median: $(median < "$work/$name.$vname") ms/step"
  done
done
