#!/usr/bin/env bash
# Muon's optimizer step against AdamW's on CPU ranks (tiny preset: 4 layers, d 256, batch 4 ×
# 128 tokens a rank, fp32, 1 thread a rank): one rank at zero stage 0, and 2 ranks at stage 2
# with Muon's owners and with the all-gather variant (debug.muon_all_gather), interleaved
# ROUNDS times (this machine is shared and noisy). Each run prints the median of the verbose
# timing line's optimizer part over steps 3.. (clip + update + zeroing: with Muon its momentum,
# the exchanges and Newton-Schulz), its forward+backward, and the median tokens/s.
# usage: benches/muon_cpu.sh [steps=12] [rounds=3]
# LOCKSTEP_BIN: the binary to time (default: target/release/lockstep, built here).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/timing_lib.sh"
cd "$ROOT"
steps=${1:-12}
rounds=${2:-3}
bin=${LOCKSTEP_BIN:-}
if [ -z "$bin" ]; then
  cargo build --release --bin lockstep 2>/dev/null
  bin="$ROOT/target/release/lockstep"
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cd "$work"
common=(--preset tiny --max-steps "$steps" --set logging.verbose=true --set logging.interval=1
        --set training.eval_batches=0 --set checkpoint.interval=0 --set logging.memory_interval=0
        --set logging.tensorboard=false --set system.num_threads=1)
# The median of the timing lines' "<what> N ms" from the third on.
part_ms() {
  grep -a "Timing per step" "$1" | tail -n +3 | grep -o "$2 [0-9.]* ms" | awk '{print $(NF-1)}' | median
}
for r in $(seq "$rounds"); do
  for case in "1 0 adamw" "1 0 muon" "2 2 adamw" "2 2 muon" "2 2 muon-gather"; do
    read -r world stage opt <<<"$case"
    k="w$world-s$stage-$opt-$r"
    flags=(--set system.zero_stage="$stage" --set logging.run_name="$k"
           --set training.optimizer="${opt%-gather}")
    [ "$opt" = muon-gather ] && flags+=(--set debug.muon_all_gather=true)
    if [ "$world" = 1 ]; then
      "$bin" train "${common[@]}" "${flags[@]}" >"$k.log" 2>&1
    else
      "$bin" run --nproc "$world" --cpu "${common[@]}" "${flags[@]}" >"$k.log" 2>&1
    fi
    echo "round $r: $world rank(s), stage $stage, $opt: optimizer $(part_ms "$k.log" optimizer) ms | forward+backward $(part_ms "$k.log" forward+backward) ms | $(median_tps "runs/$k/metrics.jsonl" 3) tok/s"
  done
done
