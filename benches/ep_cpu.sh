#!/usr/bin/env bash
# Expert parallelism on CPU ranks: EP 2 against data parallelism 2 with every expert replicated,
# at the same global batch (2 ranks × batch 4 × 256 tokens a step, qwen3-moe-tiny with EXPERTS
# experts of 256 per layer (default 32: the experts then hold 25M of the model's 40M parameters),
# top 2, 4 layers, fp32, 1 thread a rank), at zero stages STAGES (default 0, 2 and 3), interleaved
# ROUNDS times (this machine is shared and noisy): the median tokens/s of steps 4.. of each run,
# the verbose timing line's split, and rank 0's peak RSS.
# usage: benches/ep_cpu.sh [steps=12] [rounds=3] [experts=32] [stages="0 2 3"]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/timing_lib.sh"
cd "$ROOT"
steps=${1:-12}
rounds=${2:-3}
experts=${3:-32}
stages=${4:-0 2 3}
cargo build --release --bin lockstep 2>/dev/null
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cd "$work"
bin="$ROOT/target/release/lockstep"
common=(--preset qwen3-moe-tiny --max-steps "$steps" --set training.context_length=256
        --set training.batch_size=4 --set logging.verbose=true --set logging.interval=1
        --set training.eval_batches=0 --set checkpoint.interval=0 --set logging.memory_interval=0
        --set logging.tensorboard=false --set system.num_threads=1 --set model.num_experts="$experts")
for r in $(seq "$rounds"); do
  for stage in $stages; do
    for ep in 1 2; do
      k="s${stage}ep$ep-$r"
      "$bin" run --nproc 2 --cpu "${common[@]}" --set system.zero_stage="$stage" \
        --set system.expert_parallel="$ep" --set logging.run_name="$k" >"$k.log" 2>&1
      rss=$(grep -a "GPU0\|CPU0\|\[0\]" "$k.log" | grep -o "Peak memory: RSS [0-9.]* GB" | head -1 || true)
      echo "round $r stage $stage EP $ep: $(median_tps "runs/$k/metrics.jsonl" 4) tok/s | ${rss:-?} | $(grep -a "Timing" "$k.log" | tail -1 | sed 's/.*Timing per step: //')"
    done
  done
done
