"""Reference numbers from transformers for tests/doc_masking.rs: packed documents.

Builds the small random LlamaForCausalLM of hf_llama.py and two rows of packed documents (row 0
holds 3 documents, row 1 holds 2). Each row is ctx + 1 = 33 tokens; the inputs are its first 32,
the targets its last 32. The reference runs transformers on every document piece of the inputs
as a separate sequence (its own positions from 0, no attention to other documents), with the
row's targets for those positions, and records the mean cross-entropy over all 64 positions and
every parameter's gradient norm. It also records the loss of the plain causal packed rows.

usage: hf_packed.py OUT_DIR   (writes model/, documents.json, reference.json)
"""
import json
import sys

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

out = sys.argv[1]
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    attn_implementation="sdpa",
)
model = LlamaForCausalLM(config).float()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
model.save_pretrained(f"{out}/model")

EOS = 383
g = torch.Generator().manual_seed(2)


def document(n):
    """n tokens, the last one EOS, as `prepare` writes documents."""
    return torch.randint(0, EOS, (n - 1,), generator=g).tolist() + [EOS]


# Row 0: documents of 11, 14 and 8 tokens; row 1: 20 and 13. 33 tokens each.
rows = [[document(11), document(14), document(8)], [document(20), document(13)]]
with open(f"{out}/documents.json", "w") as f:
    json.dump(rows, f)

ctx = 32


def packed_loss():
    total, count = 0.0, 0
    for docs in rows:
        row = torch.tensor(sum(docs, []))
        inputs, targets = row[:ctx], row[1:]
        start = 0
        for d in docs:
            end = min(start + len(d), ctx)
            if end <= start:
                break
            # One document piece on its own: positions 0.., attending only to itself.
            logits = model(input_ids=inputs[start:end][None]).logits[0]
            total = total + F.cross_entropy(logits.float(), targets[start:end], reduction="sum")
            count += end - start
            start = end
    assert count == ctx * len(rows)
    return total / count


loss = packed_loss()
loss.backward()
grad_norms = {n: p.grad.norm().item() for n, p in model.named_parameters()}
model.zero_grad(set_to_none=True)

with torch.no_grad():
    batch = torch.tensor([sum(docs, []) for docs in rows])
    logits = model(input_ids=batch[:, :ctx]).logits
    unmasked = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

with open(f"{out}/reference.json", "w") as f:
    json.dump({"loss": loss.item(), "grad_norms": grad_norms, "unmasked_loss": unmasked.item()}, f)
