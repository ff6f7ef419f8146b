#!/usr/bin/env bash
# The whole test suite. First run installs the venv (torch 2.11.0 + transformers) and the
# manylinux tools, and builds; later runs reuse them. The suite is built for manylinux_2_28 as
# the wheel's binary is (scripts/manylinux-env.sh), so it tests the very binary the wheel ships
# and CI builds it once; scripts/wheel_test.sh then packs and tests the wheel (CI runs both).
#
# Without arguments: builds every test target once, runs each (the library's unit tests,
# every tests/*.rs module of the one integration-test crate, the doc tests), goes on past a
# failing one, and ends with each target's wall and CPU time (slowest first) and the failures;
# exits 1 if any failed. With arguments they go to `cargo test` as they are (e.g.
# `bash scripts/test.sh --test suite plan::`, `… -- --ignored`, `--no-run` to build only).
#
# The targets run as the built executables (cargo lists them as it builds), from the repository
# root as `cargo test` runs them (this script works there); the doc tests through cargo, which
# compiles them then.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
source scripts/manylinux-env.sh
if [ $# -gt 0 ]; then
  zigcargo test --release "$@"
  exit
fi
# The build (every target: the bench is compiled too, so that it cannot rot, and CI's clippy
# lints all of them in this build, .ci/run), and each test executable from cargo's artifact
# messages: the library's unit tests and the integration-test crate. The binary is built for
# the integration tests; it has no unit tests and no harness (`test`/`bench = false` in
# Cargo.toml, which `--all-targets` would override).
exes=$(zigcargo test --release --no-run --tests --benches --message-format=json-render-diagnostics |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["profile"]["test"] and m.get("executable"):
        print(m["target"]["kind"][0], m["executable"])')
exe() { # KIND: the test executable of that target kind (lib, test)
  local path
  path=$(awk -v k="$1" '$1 == k { print $2 }' <<<"$exes")
  [ -n "$path" ] && [ "$(wc -l <<<"$path")" = 1 ] || {
    echo "scripts/test.sh: not one '$1' test executable in cargo's output: $exes" >&2
    exit 1
  }
  echo "$path"
}
lib_tests=$(exe lib)
suite=$(exe test)
# The integration tests are one crate (tests/suite.rs), a module per tests/NAME.rs; each module
# runs as a target of its own: its tests by their exact names, in a process of its own.
declare -A tests_of
while read -r name; do
  tests_of[${name%%::*}]+=" $name"
done < <("$suite" --list --format terse 2>/dev/null | sed -n 's/: test$//p')
for f in tests/*.rs; do
  t=$(basename "$f" .rs)
  if [ "$t" != suite ] && [ -z "${tests_of[$t]:-}" ]; then
    echo "scripts/test.sh: tests/$t.rs has no tests in the suite: add \`mod $t;\` to tests/suite.rs" >&2
    exit 1
  fi
done
# The longest first (in CI's run of d31426a, BENCHMARKS.md §18), so that with two lanes the last
# to start are short and the lanes end together; the rest in name order. A name missing here only
# runs later. labels[N] is how the table names target N (and how to run it alone with cargo);
# args[N] the command that runs it.
slow_first=(docs mlflow_sink tracking_mlflow export_eval_generate plan_memory zero tracking_wandb
  hf_parity crash_safety parallel_run)
labels=()
args=()
add_module() {
  labels+=("--test suite $1::")
  args+=("$suite --exact${tests_of[$1]}")
}
for t in "${slow_first[@]}"; do
  [ -n "${tests_of[$t]:-}" ] && add_module "$t"
done
labels+=("--lib")
args+=("$lib_tests")
for t in $(printf '%s\n' "${!tests_of[@]}" | sort); do
  [[ " ${slow_first[*]} " == *" $t "* ]] || add_module "$t"
done
# rustdoc compiles the doc tests when they run: through cargo.
labels+=("--doc")
args+=("zigcargo test --release --doc")
# Targets run LOCKSTEP_TEST_JOBS at a time (default: one per 4 cores, at least one: a target's
# tests already use every core, and several start two-rank jobs). CI runs two on its 2 cores
# (.ci/run): 15-19% faster in the same hour (BENCHMARKS.md §18), and the load it adds is what
# found a race in a two-rank resume; a target that fails only with two lanes is a finding too.
# Each target's output is printed whole when it ends, so lanes never interleave; with one
# lane it goes out as it comes.
lanes=${LOCKSTEP_TEST_JOBS:-$(($(nproc) / 4 > 1 ? $(nproc) / 4 : 1))}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
hz=$(getconf CLK_TCK)
# One target (run in a subshell): "wall CPU target" to $out/N.time (CPU: user + system of the
# subshell's waited-for children, fields 16-17 of /proc/PID/stat) and a marker $out/N.failed if
# it failed. With one lane its output goes out as it comes; with more it is printed whole at
# the end (under a lock, so that two lanes that end together do not interleave).
run_one() {
  local n=$1 start=$SECONDS st
  # shellcheck disable=SC2086 # the command is several words on purpose
  if [ "$lanes" -eq 1 ]; then
    echo "== ${labels[$n]}"
    ${args[$n]} || : >"$out/$n.failed"
  else
    { echo "== ${labels[$n]}"; ${args[$n]}; } >"$out/$n.log" 2>&1 || : >"$out/$n.failed"
    flock "$out/print.lock" cat "$out/$n.log"
  fi
  read -r -a st <"/proc/$BASHPID/stat"
  printf '%6d s %6d s  %s\n' $((SECONDS - start)) $(((st[15] + st[16]) / hz)) "${labels[$n]}" >"$out/$n.time"
}
suite_start=$SECONDS
running=0
for n in "${!args[@]}"; do
  if [ "$lanes" -eq 1 ]; then
    (run_one "$n") # in the foreground: Ctrl-C reaches it
    continue
  fi
  if [ "$running" -ge "$lanes" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  (run_one "$n") &
  running=$((running + 1))
done
wait
failed=()
for n in "${!args[@]}"; do
  [ -e "$out/$n.failed" ] && failed+=("${labels[$n]}")
done
echo
cpu_all=$(awk '{ c += $3 } END { print c + 0 }' "$out"/*.time)
echo "Test targets by wall time ($((SECONDS - suite_start)) s in all, $lanes at a time; $cpu_all s of CPU):"
echo "  wall    CPU  target"
sort -rn "$out"/*.time
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
