#!/usr/bin/env bash
# Context parallelism on CPU ranks: CP 2 against data parallelism 2 and one rank, at the same
# tokens per step (2 sequences of 2,048 tokens, tiny preset, fp32), interleaved ROUNDS times
# (this machine is shared and noisy): the median tokens/s of steps 3.. of each run and the
# verbose timing line's split.
# usage: benches/cp_cpu.sh [steps=8] [rounds=3] [context=2048]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/timing_lib.sh"
cd "$ROOT"
steps=${1:-8}
rounds=${2:-3}
context=${3:-2048}
cargo build --release --bin lockstep 2>/dev/null
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
ln -s "$ROOT/data" "$work/data"
cd "$work"
bin="$ROOT/target/release/lockstep"
common=(--preset tiny --max-steps "$steps" --set logging.verbose=true --set logging.interval=1
        --set training.eval_batches=0 --set checkpoint.interval=0 --set logging.memory_interval=0
        --set logging.tensorboard=false --set training.context_length="$context"
        --set model.max_position_embeddings="$context")
for r in $(seq "$rounds"); do
  "$bin" train "${common[@]}" --set training.batch_size=2 --set logging.run_name="one$r" >"one$r.log" 2>&1
  "$bin" run --nproc 2 --cpu "${common[@]}" --set training.batch_size=1 \
    --set logging.run_name="dp$r" >"dp$r.log" 2>&1
  "$bin" run --nproc 2 --cpu "${common[@]}" --set training.batch_size=2 \
    --set system.context_parallel=2 --set logging.run_name="cp$r" >"cp$r.log" 2>&1
  for k in one dp cp; do
    echo "round $r $k: $(median_tps "runs/$k$r/metrics.jsonl" 3) tok/s | $(grep -a "Timing" "$k$r.log" | tail -1 | sed 's/.*Timing per step: //')"
  done
done
