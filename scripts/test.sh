#!/usr/bin/env bash
# The whole test suite. First run installs the venv (torch 2.11.0 + transformers) and builds;
# later runs reuse both. The pip wheel has its own test, scripts/wheel_test.sh (CI runs both).
#
# Without arguments: builds every test target once, runs each (the unit tests, then every
# tests/*.rs), goes on past a failing one, and ends with each target's wall time (slowest
# first) and the failures; exits 1 if any failed. With arguments they go to `cargo test`
# as they are (e.g. `bash scripts/test.sh --test plan`, `… -- --ignored`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
if [ $# -gt 0 ]; then
  exec cargo test --release "$@"
fi
cargo test --release --no-run
targets=("--lib" "--bins")
for f in tests/*.rs; do
  targets+=("--test $(basename "$f" .rs)")
done
targets+=("--doc")
times=$(mktemp)
failed=()
suite_start=$SECONDS
for t in "${targets[@]}"; do
  start=$SECONDS
  # shellcheck disable=SC2086 # "--test NAME" is two words on purpose
  if ! cargo test --release $t; then
    failed+=("$t")
  fi
  printf '%6d s  %s\n' $((SECONDS - start)) "$t" >>"$times"
done
echo
echo "Test targets by wall time ($((SECONDS - suite_start)) s in all):"
sort -rn "$times"
rm -f "$times"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
