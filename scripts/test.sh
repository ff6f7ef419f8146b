#!/usr/bin/env bash
# The whole test suite. First run installs the venv (torch 2.11.0 + transformers) and builds;
# later runs reuse both.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
cargo test --release "$@"
