#!/usr/bin/env bash
# What checkpoints cost, on CPU ranks (default `lockstep run --cpu --nproc 2`, zero stage 0,
# so every rank writes half of each checkpoint; BENCH_NPROC=1 trains one rank with one thread,
# which leaves the second core idle, as a GPU node's cores mostly are) with a 244M-parameter
# shape (12 layers, d 1024, 16/8 heads, FFN 2816, untied vocab 50257; 2.9 GB per checkpoint):
#  1. steps 1..STEPS with no save, a synchronous save and an asynchronous save every 10 steps,
#     interleaved REPS times. Per run: the median step time before the first save (steps
#     2-10), and each save's stall = the time of the 10 steps after it (the save included)
#     minus 10 median steps: the first save (step 10, which also allocates the staging
#     buffers) and the later ones separately. Also the in-loop times the trainer prints
#     (staging copy; synchronous save) and tokens/s relative to the run without saves;
#  2. a restart: kill -9 of the launcher right after a checkpoint is committed, then
#     `--resume auto`: seconds from the kill to the first resumed step's line, and the load
#     time the trainer prints;
#  3. load time of the same checkpoint at 1 and 2 ranks (the trainer's "loaded in" figure).
# usage: benches/checkpoint_cpu.sh [reps=3] [steps=31]   (BENCH_ONLY_LOOP=1: part 1 only;
# BENCH_SKIP_LOOP=1: parts 2 and 3 only)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
reps=${1:-3}
steps=${2:-31}
nproc=${BENCH_NPROC:-2}
cargo build --release --bin lockstep 2>/dev/null
work=$(mktemp -d -p "${BENCH_TMP:-/tmp}"); [ -n "${BENCH_KEEP:-}" ] || trap 'rm -rf "$work"' EXIT
# A copy of the binary: a build during the benchmark does not change what it times.
cp "$ROOT/target/release/lockstep" "$work/lockstep"
L="$work/lockstep"
ln -s "$ROOT/data" "$work/data"
cd "$work"
shape=(--preset tiny --set model.hidden_size=1024 --set model.num_layers=12
  --set model.num_attention_heads=16 --set model.num_key_value_heads=8
  --set model.intermediate_size=2816 --set training.batch_size=1
  --set training.context_length=64 --set training.eval_batches=0
  --set logging.memory_interval=0 --set checkpoint.keep_last=1 --set system.num_threads=1)
if [ "$nproc" = 1 ]; then launch=("$L" train); else launch=("$L" run --cpu --nproc "$nproc"); fi
source "$ROOT/benches/timing_lib.sh" # median
# Each output line with the wall-clock second it arrived.
stamp() { while IFS= read -r l; do printf '%s %s\n' "$(date +%s.%N)" "$l"; done; }
# Seconds between the lines of step 1 and step $2 of stamped log $1.
span() { awk -v n="$2" '/\] Step \[1\//{a=$1} index($0, "] Step [" n "/"){b=$1} END{printf "%.2f", b-a}' "$1"; }
# "base first later": the median step time over steps 2-10 of stamped log $1, the excess of
# steps 11-20 over 10 of those (the save at step 10), and the mean excess of each later
# window of 10 steps (the saves at 20, 30, ...) up to step $2.
stalls() {
  awk -v n="$2" 'match($0, /\] Step \[[0-9]+\//) { k = substr($0, RSTART + 8, RLENGTH - 9) + 0; t[k] = $1 }
    END {
      m = 0; for (k = 2; k <= 10; k++) d[++m] = t[k] - t[k - 1]
      for (i = 2; i <= m; i++) for (j = i; j > 1 && d[j - 1] > d[j]; j--) { x = d[j]; d[j] = d[j - 1]; d[j - 1] = x }
      base = (m % 2) ? d[(m + 1) / 2] : (d[m / 2] + d[m / 2 + 1]) / 2
      first = t[20] - t[10] - 10 * base
      w = 0; later = 0
      for (s = 20; s + 10 <= n; s += 10) { later += t[s + 10] - t[s] - 10 * base; w++ }
      printf "%.2f %.2f %.2f\n", base, first, (w ? later / w : 0) }' "$1"
}
"$L" prepare "${shape[@]}" >/dev/null
echo "lockstep checkpoint benchmark: $(date -u +%F), $(nproc) cores, $nproc rank(s), $steps steps, saves every 10 steps"

# 1. Step loop with and without saves.
if [ -z "${BENCH_SKIP_LOOP:-}" ]; then
modes=("none|--set checkpoint.interval=0" "sync|--set checkpoint.interval=10 --set checkpoint.async=false"
  "async|--set checkpoint.interval=10 --set checkpoint.async=true")
for rep in $(seq "$reps"); do
  for m in "${modes[@]}"; do
    name=${m%%|*}; sets=${m#*|}
    # shellcheck disable=SC2086
    "${launch[@]}" "${shape[@]}" --max-steps "$steps" $sets \
      --set logging.run_name="loop-$name-$rep" 2>&1 | stamp > "loop-$name-$rep.log" \
      || { echo "run loop-$name-$rep failed:"; tail -5 "loop-$name-$rep.log"; exit 1; }
    t=$(span "loop-$name-$rep.log" "$steps")
    read -r base first later < <(stalls "loop-$name-$rep.log" "$steps")
    echo "$t" >> "loop-$name.t"; echo "$first" >> "first-$name.t"; echo "$later" >> "later-$name.t"
    inloop=$(grep -ho 'staged in [0-9.]* s\|step_[0-9]* ([0-9.]* s)' "loop-$name-$rep.log" | grep -o '[0-9.]* s' | tr -d ' s' | paste -sd, -)
    echo "rep $rep $name: steps 1 -> $steps in $t s; median step $base s; stall of the save at step 10 $first s, of each later one $later s; in-loop save times: ${inloop:-none}"
    rm -rf runs/"loop-$name-$rep"
  done
done
none=$(median < loop-none.t)
for name in none sync async; do
  t=$(median < "loop-$name.t")
  awk -v t="$t" -v n="$none" -v m="$name" -v f="$(median < "first-$name.t")" -v l="$(median < "later-$name.t")" 'BEGIN {
    printf "%s: medians: steps 1 -> end %.2f s (tokens/s %.3f of no saves); stall of the first save %.2f s, of each later save %.2f s\n",
      m, t, n / t, f, l }'
done
fi
[ -n "${BENCH_ONLY_LOOP:-}" ] && exit 0

# 2. Restart: kill -9 after a committed checkpoint, then resume.
"$L" run --cpu --nproc 2 "${shape[@]}" --max-steps 1000 --set checkpoint.interval=3 \
  --set logging.run_name=restart > >(stamp > restart-1.log) 2>&1 &
launcher=$!
until grep -q 'Checkpoint saved: .*step_3' restart-1.log 2>/dev/null; do sleep 0.1; done
workers=$(pgrep -P "$launcher" | paste -sd, -)
kill -9 "$launcher"; t0=$(date +%s.%N); wait "$launcher" 2>/dev/null || true
# The workers die with their launcher (parent-death signal); the run directory is theirs until then.
while [ -n "$workers" ] && ps -p "$workers" >/dev/null; do sleep 0.05; done
"$L" run --cpu --nproc 2 "${shape[@]}" --max-steps 4 --set checkpoint.interval=3 \
  --set logging.run_name=restart --resume auto 2>&1 | stamp > restart-2.log
first=$(awk '/\] Step \[4\//{print $1; exit}' restart-2.log)
loaded=$(grep -o 'loaded in [0-9.]* s' restart-2.log | head -1)
awk -v a="$t0" -v b="$first" -v l="$loaded" 'BEGIN { printf "restart: kill -9 -> first resumed step %.2f s (%s)\n", b - a, l }'

# 3. Load time of one checkpoint at 1 and 2 ranks (resume it, one more step).
ckpt=$(ls -d runs/restart/checkpoints/step_* | tail -1)
for rep in $(seq "$reps"); do
  for world in 1 2; do
    rm -rf runs/load; mkdir -p runs/load; cp -r "$ckpt" runs/load/ 2>/dev/null || true
    mkdir -p runs/load/checkpoints && mv runs/load/step_* runs/load/checkpoints/
    if [ "$world" = 1 ]; then
      "$L" train "${shape[@]}" --max-steps 4 --set logging.run_name=load --resume auto > load.log 2>&1
    else
      "$L" run --cpu --nproc 2 "${shape[@]}" --max-steps 4 --set logging.run_name=load --resume auto > load.log 2>&1
    fi
    s=$(grep -o 'loaded in [0-9.]* s' load.log | head -1 | awk '{print $3}')
    echo "$s" >> "load-$world.t"
    echo "rep $rep: load at $world rank(s): $s s"
  done
done
echo "load: median $(median < load-1.t) s at 1 rank, $(median < load-2.t) s at 2 ranks (rank 0's figure)"
