#!/usr/bin/env bash
# Trains the `tiny` model on the shipped Shakespeare corpus with the embedded GPT-2 tokenizer.
# Extra arguments go to `lockstep train` (e.g. --max-steps 20).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
cargo build --release --bin lockstep
exec ./target/release/lockstep train --preset tiny --set "logging.run_name=demo-$(date +%Y%m%d-%H%M%S)" "$@"
