"""The Python references for benches/tokenize_cpu.sh: encode the `text` of every line of a
.jsonl with OpenAI's tiktoken or Hugging Face tokenizers and print MB/s of text.

usage: tokenize_ref.py CORPUS.jsonl ENCODING THREADS
ENCODING: a tiktoken name (rank files from $TIKTOKEN_CACHE_DIR) or hf:<tokenizer.json>.
Only encoding is timed (reading and JSON parsing are not), which favours the references: lockstep's
figures are end to end (start-up, reading, tokenizing, writing the token files).
"""

import json
import os
import sys
import time

corpus, enc, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
docs = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
size = sum(len(d.encode("utf-8")) for d in docs)
if enc.startswith("hf:"):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(enc[3:])
    tok.encode_special_tokens = True
    if threads == 1:
        run = lambda: [tok.encode(d, add_special_tokens=False) for d in docs]
    else:  # tokenizers' batch encoding on all cores (RAYON_NUM_THREADS set by the caller)
        run = lambda: tok.encode_batch(docs, add_special_tokens=False)
else:
    import tiktoken

    tik = tiktoken.get_encoding(enc)
    if threads == 1:
        run = lambda: [tik.encode_ordinary(d) for d in docs]
    else:
        run = lambda: tik.encode_ordinary_batch(docs, num_threads=threads)
start = time.perf_counter()
run()
print(f"{size / 1e6 / (time.perf_counter() - start):.1f}")
