#!/usr/bin/env bash
# Overlapped vs deferred gradient reduction (`system.overlap_comm`) on 2 CPU ranks over the
# TCP ring: the two settings interleaved, REPS times each, on the shapes below; prints each
# run's per-step time (data + forward/backward + reduction + optimizer, from the verbose
# timing line, steps after the first logged window) and the medians.
# usage: benches/overlap_cpu.sh [reps=3] [steps=10]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
reps=${1:-3}
steps=${2:-10}
cargo build --release --bin lockstep 2>/dev/null
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
ln -s "$ROOT/data" "$work/data"
cd "$work"
# name | overrides
shapes=(
  "tiny_b8_ctx256|"
  "tiny_b2_ctx128|--set training.batch_size=2 --set training.context_length=128"
)
source "$ROOT/benches/timing_lib.sh"
for shape in "${shapes[@]}"; do
  name=${shape%%|*}; extra=${shape#*|}
  for overlap in true false; do : > "$work/$name.$overlap"; done
  for rep in $(seq "$reps"); do
    for overlap in true false; do
      run="$name-$overlap-$rep"
      # shellcheck disable=SC2086
      "$ROOT/target/release/lockstep" run --nproc 2 --cpu --preset tiny --max-steps "$steps" \
        --set logging.verbose=true --set logging.interval=2 --set training.eval_batches=0 \
        --set checkpoint.interval=0 --set logging.memory_interval=0 \
        --set system.overlap_comm=$overlap --set logging.run_name="$run" $extra >/dev/null 2>&1 \
        || { echo "run $run failed"; exit 1; }
      read -r ms fb red < <(step_ms logs/"$run"-*/rank_0.log)
      echo "$name overlap_comm=$overlap rep $rep: $ms ms/step (forward+backward $fb, exposed reduction $red)"
      echo "$ms" >> "$work/$name.$overlap"
    done
  done
  on=$(median < "$work/$name.true"); off=$(median < "$work/$name.false")
  echo "$name median: overlap $on ms, after backward $off ms, ratio $(awk "BEGIN{printf \"%.3f\", $off/$on}")"
done
