"""PyTorch eager on the same shapes as a lockstep config (for the GPU comparison in
BENCHMARKS.md): transformers LlamaForCausalLM (sdpa), bf16 autocast with fp32 master weights,
fused AdamW, clip 1.0. Prints median tokens/s and MFU (989 TFLOP/s dense bf16 peak).

usage: pytorch_step.py CONFIG.json [--steps N] [--vocab V]
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("config")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--vocab", type=int, default=50257)
ap.add_argument("--peak", type=float, default=989e12)
a = ap.parse_args()
c = json.load(open(a.config))
m, t = c["model"], c["training"]
cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"],
                  num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
                  num_key_value_heads=m["num_key_value_heads"], max_position_embeddings=m["max_position_embeddings"],
                  rope_theta=m["rope_theta"], attn_implementation="sdpa")
model = LlamaForCausalLM(cfg).cuda().train()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
b, s = t["batch_size"], t["context_length"]
tokens = torch.randint(0, a.vocab, (b, s + 1), device="cuda")
x, y = tokens[:, :-1], tokens[:, 1:]
n = sum(p.numel() for p in model.parameters())
d, L = m["hidden_size"], m["num_layers"]
flops_per_token = 6 * (n - a.vocab * d) + 6 * L * s * d  # 6N (LM head counted, embedding not) + causal attention


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(3):
    step()
torch.cuda.synchronize()
times = []
for _ in range(a.steps):
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
times.sort()
tok_s = b * s / times[len(times) // 2]
print(f"pytorch eager: {n / 1e6:.0f}M params, batch {b} x {s}: median {tok_s:.0f} tok/s, "
      f"MFU {100 * tok_s * flops_per_token / a.peak:.1f}%, peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
