"""Reference numbers from transformers for tests/hf_parity.rs.

Builds a small random LlamaForCausalLM (GQA, RMSNorm weights that are not all ones), saves it
as a Hugging Face directory, and records on a fixed batch: the loss, every parameter's gradient
norm, then the losses, pre-clip gradient norms (summed in fp64) and parameters after 3 AdamW steps with clipping.

With --qwen3 the model is a Qwen3ForCausalLM instead: Llama's layers with q_norm/k_norm, and a
head_dim (16) apart from hidden_size / heads (8).

usage: hf_llama.py OUT_DIR [--tied] [--llama3-rope] [--qwen3]
"""
import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

out = sys.argv[1]
tied = "--tied" in sys.argv
# Llama 3.1 frequency scaling, with original_max_position_embeddings chosen so that the 4
# frequencies of head_dim 8 fall in all three bands (kept, interpolated, divided).
rope = {"rope_type": "default", "rope_theta": 10000.0}
if "--llama3-rope" in sys.argv:
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
torch.manual_seed(0)
qwen3 = "--qwen3" in sys.argv
Config, Model = (Qwen3Config, Qwen3ForCausalLM) if qwen3 else (LlamaConfig, LlamaForCausalLM)
extra = {"head_dim": 16, "use_sliding_window": False} if qwen3 else {}
config = Config(
    **extra,
    vocab_size=384,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_parameters=rope,
    tie_word_embeddings=tied,
    attn_implementation="sdpa",
)
model = Model(config).float()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
model.save_pretrained(f"{out}/model")

g = torch.Generator().manual_seed(1)
tokens = torch.randint(0, config.vocab_size, (3, 33), generator=g)
save_file({"tokens": tokens}, f"{out}/batch.safetensors")
inputs, targets = tokens[:, :-1], tokens[:, 1:]


def loss_fn():
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


loss = loss_fn()
loss.backward()
grad_norms = {n: p.grad.norm().item() for n, p in model.named_parameters()}
model.zero_grad(set_to_none=True)

decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
    lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False,
)
step_losses, step_norms = [], []
for _ in range(3):
    opt.zero_grad(set_to_none=True)
    l = loss_fn()
    l.backward()
    # clip_grad_norm_ with the norm summed in fp64: torch's fp32 norm kernel drifts on large
    # tensors on CPU, and lockstep computes the norm one accurate way at every zero stage.
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
    coef = torch.clamp(1.0 / (norm.float() + 1e-6), max=1.0)
    for p in model.parameters():
        p.grad.mul_(coef)
    opt.step()
    step_losses.append(l.item())
    step_norms.append(norm.item())

params = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
save_file(params, f"{out}/after.safetensors")
with open(f"{out}/reference.json", "w") as f:
    json.dump({"loss": loss.item(), "grad_norms": grad_norms, "step_losses": step_losses, "step_grad_norms": step_norms}, f)
