#!/usr/bin/env bash
# lockstep vs PyTorch on the tiny shape, interleaved A/B rounds on the same threads, so machine
# noise hits both alike. Prints each round and the ratio of the medians.
# usage: benches/compare.sh [rounds=3] [threads=2] [steps=10]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
rounds=${1:-3}; threads=${2:-2}; steps=${3:-10}
cargo bench --bench train_step --no-run 2>/dev/null
bench=$(ls -t target/release/deps/train_step-* | grep -v '\.d$' | head -1)
ours=(); theirs=()
for r in $(seq "$rounds"); do
  a=$("$bench" --steps "$steps" --threads "$threads"); echo "round $r: $a"
  b=$(python benches/train_step.py --steps "$steps" --threads "$threads"); echo "round $r: $b"
  ours+=("$(sed -E 's/.*median ([0-9]+) tok.*/\1/' <<<"$a")")
  theirs+=("$(sed -E 's/.*median ([0-9]+) tok.*/\1/' <<<"$b")")
done
python - "${ours[*]}" "${theirs[*]}" <<'PY'
import statistics, sys
o = [float(v) for v in sys.argv[1].split()]; t = [float(v) for v in sys.argv[2].split()]
print(f"median of rounds: lockstep {statistics.median(o):.0f} tok/s, pytorch {statistics.median(t):.0f} tok/s, "
      f"ratio {statistics.median(o) / statistics.median(t):.3f}x")
PY
