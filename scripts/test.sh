#!/usr/bin/env bash
# The whole test suite. First run installs the venv (torch 2.11.0 + transformers) and builds;
# later runs reuse both. Arguments go to `cargo test` (and skip the wheel test).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
cargo test --release "$@"
# The whole suite (no arguments): then the pip wheel as a user installs it (~5 min).
if [ $# -eq 0 ]; then
  bash scripts/wheel_test.sh
fi
