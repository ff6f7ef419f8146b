#!/usr/bin/env bash
# The release binary for manylinux_2_28, built on a newer machine with cargo-zigbuild (how, and
# why each flag: scripts/manylinux-env.sh), then checked by scripts/check-manylinux.sh. Extra
# arguments go to cargo (e.g. --bin lockstep). scripts/test.sh builds the same artifacts (the
# suite runs against the binary the wheel ships), so after it this is a no-op but the check.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
source scripts/manylinux-env.sh
zigcargo zigbuild --release "$@"
bash scripts/check-manylinux.sh
