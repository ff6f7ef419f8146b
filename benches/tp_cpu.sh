#!/usr/bin/env bash
# Tensor parallelism on CPU ranks: TP 2 against data parallelism 2 and one rank, at the same
# global batch (8 sequences of 256 tokens a step, tiny preset), interleaved ROUNDS times (this
# machine is shared and noisy): the median tokens/s of steps 4.. of each run, the verbose
# timing line's split, and the bytes the ring sent per step.
# usage: benches/tp_cpu.sh [steps=12] [rounds=3]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/timing_lib.sh"
cd "$ROOT"
steps=${1:-12}
rounds=${2:-3}
cargo build --release --bin lockstep 2>/dev/null
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
ln -s "$ROOT/data" "$work/data"
cd "$work"
bin="$ROOT/target/release/lockstep"
common=(--preset tiny --max-steps "$steps" --set training.context_length=256
        --set logging.verbose=true --set logging.interval=1
        --set training.eval_batches=0 --set checkpoint.interval=0 --set logging.memory_interval=0
        --set logging.tensorboard=false)
for r in $(seq "$rounds"); do
  "$bin" train "${common[@]}" --set training.batch_size=8 --set logging.run_name="one$r" >"one$r.log" 2>&1
  "$bin" run --nproc 2 --cpu "${common[@]}" --set training.batch_size=4 \
    --set logging.run_name="dp$r" >"dp$r.log" 2>&1
  "$bin" run --nproc 2 --cpu "${common[@]}" --set training.batch_size=8 \
    --set system.tensor_parallel=2 --set logging.run_name="tp$r" >"tp$r.log" 2>&1
  "$bin" run --nproc 2 --cpu "${common[@]}" --set training.batch_size=8 \
    --set system.tensor_parallel=2 --set system.sequence_parallel=false \
    --set logging.run_name="tpn$r" >"tpn$r.log" 2>&1
  for k in one dp tp tpn; do
    echo "round $r $k: $(median_tps "runs/$k$r/metrics.jsonl" 4) tok/s | $(grep -a "Timing" "$k$r.log" | tail -1 | sed 's/.*Timing per step: //')"
  done
done
