#!/usr/bin/env bash
# Trains the `tiny` model on the shipped Shakespeare corpus with the embedded GPT-2 tokenizer,
# then generates a short sample from the run's newest checkpoint. Extra arguments go to
# `lockstep train` (e.g. --max-steps 20). The run lands in ./runs/demo-<time> of the directory
# it is started from; LOCKSTEP_BIN uses that binary instead of building one.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bin="${LOCKSTEP_BIN:-}"
if [ -z "$bin" ]; then
  (cd "$ROOT" && cargo build --release --bin lockstep)
  bin="$ROOT/target/release/lockstep"
fi
run="demo-$(date +%Y%m%d-%H%M%S)"
"$bin" train --preset tiny --set "logging.run_name=$run" "$@"
echo
echo "A sample from runs/$run (its newest checkpoint):"
"$bin" generate --model "runs/$run" --prompt "ROMEO:" --max-new-tokens 64 --seed 1
