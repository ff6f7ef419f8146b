#!/usr/bin/env bash
# Trains the `tiny` model on the shipped Shakespeare corpus with the embedded GPT-2 tokenizer,
# then generates a short sample from the checkpoint it just wrote. Extra arguments go to
# `lockstep train` (e.g. --max-steps 20).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
cargo build --release --bin lockstep
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
./target/release/lockstep train --preset tiny --set "logging.run_name=demo-$(date +%Y%m%d-%H%M%S)" "$@" | tee "$log"
ckpt="$(sed -n 's/.*Checkpoint saved: //p' "$log" | tail -1)"
if [ -n "$ckpt" ]; then
  echo
  echo "A sample from $ckpt:"
  ./target/release/lockstep generate --model "$ckpt" --prompt "ROMEO:" --max-new-tokens 64 --seed 1
fi
