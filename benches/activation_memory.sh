#!/usr/bin/env bash
# Activation memory settings on the tiny preset's model (vocab 50257, d 256, 4 layers, fp32) at
# the benchmark shape, batch 8 × 256 (the preset itself trains 4 × 128).
# 1. Step time of each setting with the trainer's own step (benches/train_step.rs), run
#    interleaved round by round (A, B, C, … then again) so that load on a shared machine hits
#    every setting alike; medians over rounds of the per-run medians (wall and CPU seconds).
# 2. Peak RSS of a 3-step `lockstep train --preset tiny` run of each setting.
# usage: benches/activation_memory.sh [rounds=5] [steps=6] [threads=2]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
rounds=${1:-5}; steps=${2:-6}; threads=${3:-2}
cargo build --release --bin lockstep 2>/dev/null
cargo bench --bench train_step --no-run 2>/dev/null
bench=$(ls -t target/release/deps/train_step-* | grep -v '\.d$' | head -1)
settings=("none 0" "none 1024" "none 256" "selective 1024" "full 1024" "full 256")
out=$(mktemp)
echo "== step time: $rounds interleaved rounds of $steps steps, $threads threads"
for r in $(seq "$rounds"); do
  for s in "${settings[@]}"; do
    set -- $s
    line=$("$bench" --steps "$steps" --threads "$threads" --vocab 50257 --checkpointing "$1" --chunk "$2")
    tok=$(sed -E 's/.*median ([0-9]+) tok.*/\1/' <<<"$line")
    cpu=$(sed -E 's/.*CPU ([0-9.]+) s\/step.*/\1/' <<<"$line")
    echo "$1-$2 $tok $cpu" | tee -a "$out"
  done
done
python3 - "$out" <<'PY'
import collections, statistics, sys
by = collections.defaultdict(list)
for line in open(sys.argv[1]):
    name, tok, cpu = line.split()
    by[name].append((2048 / float(tok), float(cpu)))
base = statistics.median(w for w, _ in by["none-0"])
base_cpu = statistics.median(c for _, c in by["none-0"])
print("setting          wall s/step        CPU s/step")
for k, v in by.items():
    w = statistics.median(x for x, _ in v); c = statistics.median(y for _, y in v)
    print(f"{k:<16} {w:.3f} ({(w / base - 1) * 100:+5.1f}%)   {c:.3f} ({(c / base_cpu - 1) * 100:+5.1f}%)")
PY
echo "== peak RSS of lockstep train --preset tiny (3 steps, checkpoint at the end)"
work=$(mktemp -d); trap 'rm -rf "$work" "$out"' EXIT
cd "$work"
tiny=(--preset tiny --set training.batch_size=8 --set training.context_length=256)
for s in "${settings[@]}"; do
  set -- $s
  peak=$("$ROOT/target/release/lockstep" train "${tiny[@]}" --max-steps 3 \
    --set system.num_threads="$threads" --set training.eval_batches=0 \
    --set training.activation_checkpointing="$1" --set training.loss_chunk_tokens="$2" \
    --set logging.run_name="$1-$2" 2>&1 | grep -o "Peak memory: RSS [0-9.]* GB")
  est=$("$ROOT/target/release/lockstep" plan --device cpu "${tiny[@]}" \
    --set system.num_threads="$threads" --set training.eval_batches=0 \
    --set training.activation_checkpointing="$1" --set training.loss_chunk_tokens="$2" \
    | grep -o "total *[0-9.]* GB" | grep -o "[0-9.]* GB")
  echo "$1-$2: $peak (plan: $est)"
done
