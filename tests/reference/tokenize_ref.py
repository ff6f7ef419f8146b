"""Reference token ids for tests/tokenizer_parity.rs, from the official Python packages.

usage: tokenize_ref.py TEXTS_DIR OUT_DIR RANKS_DIR ENCODING...

Every `TEXTS_DIR/<name>.txt` (UTF-8) is encoded with each ENCODING and written to
`OUT_DIR/<encoding>/<name>.u32` as little-endian u32 ids. An ENCODING is a tiktoken name
(r50k_base, p50k_base, cl100k_base, o200k_base: tiktoken's own `get_encoding`, whose rank files
come from RANKS_DIR/<name>.tiktoken through tiktoken's download cache, so tiktoken checks them
against OpenAI's published SHA-256) or `hf:<path to tokenizer.json>` (Hugging Face
`tokenizers`, special-token spellings encoded as text, no BOS/EOS added).
"""

import hashlib
import os
import shutil
import sys
from pathlib import Path

import numpy as np

texts_dir, out_dir, ranks_dir = (Path(p) for p in sys.argv[1:4])
encodings = sys.argv[4:]

cache = Path(out_dir) / "tiktoken-cache"
cache.mkdir(parents=True, exist_ok=True)
os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
BLOB = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"
for ranks in ranks_dir.glob("*.tiktoken"):
    key = hashlib.sha1(BLOB.format(ranks.stem).encode()).hexdigest()
    shutil.copyfile(ranks, cache / key)

texts = sorted(texts_dir.glob("*.txt"))
for enc in encodings:
    if enc.startswith("hf:"):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(enc[3:])
        tok.encode_special_tokens = True
        encode = lambda s: tok.encode(s, add_special_tokens=False).ids
        name = Path(enc[3:]).parent.name
    else:
        import tiktoken

        tik = tiktoken.get_encoding(enc)
        encode = tik.encode_ordinary
        name = enc
    dest = out_dir / name
    dest.mkdir(parents=True, exist_ok=True)
    for t in texts:
        # Bytes, not read_text: text mode would turn \r\n into \n.
        ids = np.asarray(encode(t.read_bytes().decode("utf-8")), dtype="<u4")
        ids.tofile(dest / (t.stem + ".u32"))
