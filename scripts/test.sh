#!/usr/bin/env bash
# The whole test suite. First run installs the venv (torch 2.11.0 + transformers) and the
# manylinux tools, and builds; later runs reuse them. The suite is built for manylinux_2_28 as
# the wheel's binary is (scripts/manylinux-env.sh), so it tests the very binary the wheel ships
# and CI builds it once; scripts/wheel_test.sh then packs and tests the wheel (CI runs both).
#
# Without arguments: builds every test target once, runs each (the unit tests, then every
# tests/*.rs), goes on past a failing one, and ends with each target's wall and CPU time
# (slowest first) and the failures; exits 1 if any failed. With arguments they go to
# `cargo test` as they are (e.g. `bash scripts/test.sh --test plan`, `… -- --ignored`,
# `--no-run` to build only).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
source scripts/manylinux-env.sh
if [ $# -gt 0 ]; then
  zigcargo test --release "$@"
  exit
fi
zigcargo test --release --no-run
targets=("--lib" "--bins")
for f in tests/*.rs; do
  targets+=("--test $(basename "$f" .rs)")
done
targets+=("--doc")
# CPU seconds (user + system) of this shell's waited-for children so far: fields 16 and 17 of
# /proc/PID/stat, in clock ticks.
cpu() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%d", ($16 + $17) / hz }' "/proc/$$/stat"; }
times=$(mktemp)
failed=()
suite_start=$SECONDS
suite_cpu=$(cpu)
for t in "${targets[@]}"; do
  start=$SECONDS
  start_cpu=$(cpu)
  # shellcheck disable=SC2086 # "--test NAME" is two words on purpose
  if ! zigcargo test --release $t; then
    failed+=("$t")
  fi
  printf '%6d s %6d s  %s\n' $((SECONDS - start)) $(($(cpu) - start_cpu)) "$t" >>"$times"
done
echo
echo "Test targets by wall time ($((SECONDS - suite_start)) s in all, $(($(cpu) - suite_cpu)) s of CPU):"
echo "  wall    CPU  target"
sort -rn "$times"
rm -f "$times"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
