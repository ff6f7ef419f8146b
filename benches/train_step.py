"""PyTorch eager on the same tiny shape as benches/train_step.rs: transformers' LlamaForCausalLM
(sdpa attention), torch.optim.AdamW (default implementation), clip_grad_norm_, fp32, batch 8 × 256.

With --experts E the model is transformers' Qwen3MoeForCausalLM of the same shape (heads of 32,
q/k norms), every MLP E experts of width --expert-size (344), top 2, with its load-balancing loss
added (router_aux_loss_coef 0.001), the experts computed by --experts-impl: eager (a loop over the
experts that got tokens, each finding its tokens with a mask) or grouped_mm.

usage: train_step.py [--steps N] [--threads T] [--experts E] [--expert-size F] [--experts-impl I]
"""
import argparse
import resource
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--threads", type=int, default=0)
ap.add_argument("--experts", type=int, default=0)
ap.add_argument("--expert-size", type=int, default=344)
ap.add_argument("--experts-impl", default="eager")
a = ap.parse_args()
if a.threads:
    torch.set_num_threads(a.threads)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="sdpa")
if a.experts:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                         max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, num_experts=a.experts, num_experts_per_tok=2,
                         moe_intermediate_size=a.expert_size, norm_topk_prob=True,
                         output_router_logits=True, router_aux_loss_coef=0.001,
                         attn_implementation="sdpa", experts_implementation=a.experts_impl)
    model = Qwen3MoeForCausalLM(cfg).float().train()
else:
    model = LlamaForCausalLM(cfg).float().train()
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
tokens = torch.randint(0, 4096, (8, 257))
x, y = tokens[:, :-1], tokens[:, 1:]


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


phases = []


def step():
    t0 = time.perf_counter()
    out = model(input_ids=x)
    loss = F.cross_entropy(out.logits.reshape(-1, 4096), y.reshape(-1))
    value = loss.item()
    if a.experts:
        loss = loss + cfg.router_aux_loss_coef * out.aux_loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    opt.step()
    opt.zero_grad(set_to_none=True)
    phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return value, norm


first, _ = step()
step()
tok_s, cpus = [], []
for _ in range(a.steps):
    t0, c0 = time.perf_counter(), cpu()
    step()
    tok_s.append(8 * 256 / (time.perf_counter() - t0))
    cpus.append(cpu() - c0)
def med(i):
    v = sorted(p[i] for p in phases[2:])
    return 1e3 * v[len(v) // 2]


split = f"forward {med(0):.0f} ms, backward {med(1):.0f} ms, clip+AdamW {med(2):.0f} ms"
tok_s.sort()
cpus.sort()
n = a.steps
kind = f"experts {a.experts} ({a.experts_impl})" if a.experts else "dense"
print(f"pytorch tiny step ({kind}): median {tok_s[n // 2]:.0f} tok/s over {n} steps (min {tok_s[0]:.0f}, max {tok_s[-1]:.0f}); "
      f"CPU {cpus[n // 2]:.3f} s/step; threads {torch.get_num_threads()}; first loss {first:.4f}; {split}")
