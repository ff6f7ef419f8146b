#!/usr/bin/env bash
# What downstream evaluation costs on CPU, against lm-evaluation-harness on the same work in the
# same run: the tiny preset (d 256, 4 layers, GPT-2's 50257 ids) trained 20 steps and exported,
# a HellaSwag-shaped task of ITEMS items × 4 choices written from the built-in corpus (a context
# of two to three lines, ~45 words; endings of half a line each), scored by `lockstep eval --task`
# (its scoring seconds: the model loaded, rows built) and by lm-eval 0.4 (benches/lm_eval_time.py:
# `simple_evaluate` with the model loaded), rounds interleaved; then the tiny preset's training
# step on the same machine, so that a 10,042-item HellaSwag pass can be put in steps; and what
# `lockstep plan` estimates for it here and for the same kind of task (10,042 items) on an 8B
# model and 8 GPUs.
# Both score in batches of BATCH rows with the machine's threads.
# usage: benches/downstream_cpu.sh [rounds=3] [items=400] [batch=32]
# LOCKSTEP_BIN: a built lockstep to time (default: cargo build --release).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
rounds=${1:-3}
items=${2:-400}
batch=${3:-32}
work=$(mktemp -d -p "${BENCH_TMP:-/tmp}")
trap 'rm -rf "$work"' EXIT
if [ -z "${LOCKSTEP_BIN:-}" ]; then
  cargo build --release --bin lockstep 2>/dev/null
  LOCKSTEP_BIN="$ROOT/target/release/lockstep"
fi
# A copy of the binary: a build during the benchmark does not change what it times.
cp "$LOCKSTEP_BIN" "$work/lockstep"
L="$work/lockstep"
cd "$work"
source "$ROOT/benches/timing_lib.sh" # median
write_task() { # FILE N: a HellaSwag-shaped task of N items from the built-in corpus
  python3 - "$1" "$2" "$ROOT/data/shakespeare" <<'PY'
import json, pathlib, random, sys
out, n, corpus = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
lines = [l.strip() for f in sorted(corpus.glob("*.txt"))
         for l in f.read_text(encoding="utf-8").splitlines() if len(l.split()) >= 6]
rnd = random.Random(0)
with open(out, "w") as f:
    for _ in range(n):
        i = rnd.randrange(len(lines) - 3)
        context = "Shakespeare: " + " ".join(lines[i:i + rnd.choice([2, 3])])
        endings = [" ".join(l.split()[len(l.split()) // 2:]) for l in rnd.sample(lines, 4)]
        f.write(json.dumps({"query": context, "choices": endings, "gold": rnd.randrange(4)}) + "\n")
PY
}
write_task bench_mc.jsonl "$items"
write_task hellaswag_like.jsonl 10042
mkdir -p lm_tasks
cat > lm_tasks/bench_mc.yaml <<YAML
task: bench_mc
dataset_path: json
dataset_kwargs:
  data_files: {test: $work/bench_mc.jsonl}
test_split: test
output_type: multiple_choice
doc_to_text: query
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
YAML
tiny=(--preset tiny --set training.eval_batches=0 --set logging.memory_interval=0
  --set checkpoint.interval=0)
"$L" train "${tiny[@]}" --max-steps 20 --set logging.run_name=model >model.log 2>&1
"$L" export --hf export --preset tiny --set logging.run_name=model >/dev/null
rows=$("$L" eval --model export --task bench_mc.jsonl 2>/dev/null | sed -n 's/^\[eval\] \([0-9]*\) rows.*/\1/p')
echo "lockstep downstream benchmark: $(date -u +%F), $(nproc) cores, tiny preset, $items items x 4 choices ($rows rows), batch $batch, $rounds rounds"
export HF_HOME="$work/hf" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ours="" theirs="" steps="" accs=""
for r in $(seq "$rounds"); do
  j=$("$L" eval --model export --task bench_mc.jsonl --batch-size "$batch" --json 2>/dev/null)
  ours+="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["seconds"])' "$j") "
  accs+="$(python3 -c 'import json,sys; v=json.loads(sys.argv[1]); print(v["acc"], v["acc_norm"])' "$j")|"
  line=$(python3 "$ROOT/benches/lm_eval_time.py" export lm_tasks 128 "$batch" 1 2>/dev/null | tail -1)
  theirs+="${line%% *} "
  accs+="lm-eval ${line#* }|"
  "$L" train "${tiny[@]}" --max-steps 12 --set logging.run_name="step-$r" >"step-$r.log" 2>&1
  steps+="$(python3 -c 'import json,sys; v=sorted(json.loads(l)["tokens_per_s"] for l in list(open(sys.argv[1]))[2:]); print(512 / v[len(v)//2])' "runs/step-$r/metrics.jsonl") "
done
o=$(echo $ours | tr ' ' '\n' | median)
t=$(echo $theirs | tr ' ' '\n' | median)
s=$(echo $steps | tr ' ' '\n' | median)
printf "scoring seconds   lockstep %s (median %.2f) | lm-eval %s (median %.2f) | ratio %.2fx\n" "$ours" "$o" "$theirs" "$t" "$(echo "$t / $o" | bc -l)"
printf "items/s           lockstep %.1f | lm-eval %.1f\n" "$(echo "$items / $o" | bc -l)" "$(echo "$items / $t" | bc -l)"
printf "acc, acc_norm     %s\n" "$accs"
printf "training step     %s s (median %.3f s; batch 4 x 128)\n" "$steps" "$s"
printf "10,042 items      lockstep %.0f s = %.0f steps | lm-eval %.0f s\n" \
  "$(echo "10042 * $o / $items" | bc -l)" "$(echo "10042 * $o / $items / $s" | bc -l)" "$(echo "10042 * $t / $items" | bc -l)"
echo "plan, this machine, the tiny preset and the $items-item task (measured above: $o s):"
"$L" plan --device cpu "${tiny[@]}" --set training.eval_tasks=bench_mc.jsonl | grep -E "Compute:|Downstream"
echo "plan, 8B on 8 x H100, the 10,042-item task every 500 steps:"
"$L" plan --set model.num_layers=32 --set model.vocab_size=128256 --gpus 8 --device cuda \
  --set training.activation_checkpointing=selective --set system.zero_stage=2 \
  --set training.eval_tasks=hellaswag_like.jsonl --set training.eval_interval=500 | grep -E "Compute:|Downstream"
"$L" plan --set model.num_layers=32 --set model.vocab_size=128256 --gpus 8 --device cuda \
  --set training.activation_checkpointing=selective --set system.zero_stage=2 \
  --set training.eval_tasks=hellaswag_like.jsonl --set training.eval_interval=500 --json |
  python3 -c 'import json,sys; d=json.load(sys.stdin)["downstream"]; print({k: d[k] for k in ("rows","padded_tokens","seconds","items_per_second","steps","share")})'
