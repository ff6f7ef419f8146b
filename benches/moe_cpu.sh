#!/usr/bin/env bash
# The mixture-of-experts MLP on CPU, whole training steps of the tiny shape (benches/train_step.rs):
# lockstep dense (FFN 688), lockstep Qwen3-MoE (E experts of 344, top 2: the same FLOPs per token
# in the experts), transformers' Qwen3MoeForCausalLM with its eager experts loop and with
# grouped_mm, interleaved A/B/C/D rounds on the same threads. Prints each round and the medians.
# usage: benches/moe_cpu.sh [rounds=3] [threads=2] [steps=8] [experts=8]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
rounds=${1:-3}; threads=${2:-2}; steps=${3:-8}; experts=${4:-8}
cargo bench --bench train_step --no-run 2>/dev/null
bench=$(ls -t target/release/deps/train_step-* | grep -v '\.d$' | head -1)
declare -A runs=(
  [dense]="$bench --steps $steps --threads $threads"
  [ours]="$bench --steps $steps --threads $threads --experts $experts"
  [eager]="python benches/train_step.py --steps $steps --threads $threads --experts $experts --experts-impl eager"
  [grouped]="python benches/train_step.py --steps $steps --threads $threads --experts $experts --experts-impl grouped_mm"
)
declare -A tok
for r in $(seq "$rounds"); do
  for k in dense ours eager grouped; do
    line=$(${runs[$k]}); echo "round $r $k: $line"
    tok[$k]+=" $(sed -E 's/.*median ([0-9]+) tok.*/\1/' <<<"$line")"
  done
done
python - "${tok[dense]}" "${tok[ours]}" "${tok[eager]}" "${tok[grouped]}" <<'PY'
import statistics, sys
d, o, e, g = ([float(v) for v in a.split()] for a in sys.argv[1:])
m = statistics.median
print(f"median of rounds: lockstep dense {m(d):.0f}, lockstep MoE {m(o):.0f}, transformers MoE eager {m(e):.0f}, "
      f"grouped_mm {m(g):.0f} tok/s; lockstep MoE / eager {m(o) / m(e):.2f}x, / grouped_mm {m(o) / m(g):.2f}x, "
      f"/ lockstep dense {m(o) / m(d):.2f}x")
PY
