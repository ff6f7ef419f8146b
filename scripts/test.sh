#!/usr/bin/env bash
# The whole test suite. First run installs the venv (torch 2.11.0 + transformers) and builds;
# later runs reuse both. Arguments go to `cargo test`. The pip wheel has its own test,
# scripts/wheel_test.sh (CI runs both).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
cargo test --release "$@"
