"""Writes a byte-level tokenizer.json (256 byte tokens + `</s>`, no merges) for the throughput
check: lockstep's model vocabulary must cover the tokenizer's, so a 257-id tokenizer lets the
1B config keep vocab 32000 (Llama 2's) with gpt2's 50257 out of the way. Which ids the text
becomes does not change the FLOPs of a step.

usage: byte_tokenizer.py OUT.json
"""
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

alphabet = pre_tokenizers.ByteLevel.alphabet()
vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
vocab["</s>"] = len(vocab)
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
tok.decoder = decoders.ByteLevel()
tok.add_special_tokens(["</s>"])
tok.save(sys.argv[1])
assert Tokenizer.from_file(sys.argv[1]).decode(Tokenizer.from_file(sys.argv[1]).encode("Hi, there").ids) == "Hi, there"
