#!/usr/bin/env bash
# Step time and all-reduce time for 1 vs 2 CPU ranks on the tiny preset (batch 8 per rank,
# context 256), from the verbose timing line, plus the bytes all-reduced per step.
# usage: benches/ddp_cpu.sh [steps=12]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
steps=${1:-12}
cargo build --release --bin lockstep 2>/dev/null
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
ln -s "$ROOT/data" "$work/data"
cd "$work"
common=(--preset tiny --max-steps "$steps" --set training.batch_size=8 --set training.context_length=256
        --set logging.verbose=true --set logging.interval=4
        --set training.eval_batches=0 --set checkpoint.interval=0 --set logging.memory_interval=0)
echo "== 1 rank (2 threads)"
"$ROOT/target/release/lockstep" train "${common[@]}" --set logging.run_name=one 2>&1 | grep -E "Step \[|Timing|Model:" | tail -4
echo "== 2 ranks (1 thread each)"
"$ROOT/target/release/lockstep" run --nproc 2 --cpu "${common[@]}" --set logging.run_name=two 2>&1 | grep -E "Step \[|Timing|Model:" | tail -4
