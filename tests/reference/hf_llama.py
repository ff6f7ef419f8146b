"""Reference numbers from transformers for tests/hf_parity.rs.

Builds a small random LlamaForCausalLM (GQA, RMSNorm weights that are not all ones), saves it
as a Hugging Face directory, and records on a fixed batch: the loss, every parameter's gradient
norm, then the losses, pre-clip gradient norms (summed in fp64) and parameters after 3 AdamW steps with clipping.

With --qwen3 the model is a Qwen3ForCausalLM instead: Llama's layers with q_norm/k_norm, and a
head_dim (16) apart from hidden_size / heads (8). With --qwen3-moe it is a Qwen3MoeForCausalLM of
3 layers, the middle one dense (mlp_only_layers), the others 8 experts of width 32 with top-2
routing renormalised; with --mixtral a MixtralForCausalLM of 2 layers of 4 experts, top 2. For
those two the objective is the cross-entropy plus router_aux_loss_coef (0.02) x transformers'
aux_loss, and the reference also holds aux_loss and each MoE layer's top-k experts per token.

With --muon ADJUST (original | match_rms_adamw) the 3 steps are torch.optim.Muon's (its defaults:
momentum 0.95, Nesterov, 5 Newton-Schulz steps; adjust_lr_fn ADJUST; weight decay 0.1) on every
2-D weight inside the decoder layers and AdamW on the rest; transformers holds a layer's experts
fused in 3-D tensors, so each expert's matrices get torch.optim.Muon's own update function
(torch.optim._muon.muon) on their views. The parameters before the steps and the momentum
buffers after them are saved too (before.safetensors, momentum.safetensors), and each step's
clipped gradients (gradsK.safetensors, K = 0, 1, 2).

With --grad-noise X each clipped gradient is scaled by 1 + X·N(0, 1) (a seeded draw) before the
update: torch against itself with gradients that differ in their last bits (BENCHMARKS.md §22).

usage: hf_llama.py OUT_DIR [--tied] [--llama3-rope] [--qwen3 | --qwen3-moe | --mixtral]
                   [--muon ADJUST] [--grad-noise X]
"""
import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

out = sys.argv[1]
tied = "--tied" in sys.argv
# Llama 3.1 frequency scaling, with original_max_position_embeddings chosen so that the 4
# frequencies of head_dim 8 fall in all three bands (kept, interpolated, divided).
rope = {"rope_type": "default", "rope_theta": 10000.0}
if "--llama3-rope" in sys.argv:
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
torch.manual_seed(0)
Config, Model = LlamaConfig, LlamaForCausalLM
extra = {"num_hidden_layers": 2}
moe = False
if "--qwen3" in sys.argv:
    Config, Model = Qwen3Config, Qwen3ForCausalLM
    extra.update(head_dim=16, use_sliding_window=False)
elif "--qwen3-moe" in sys.argv:
    Config, Model, moe = Qwen3MoeConfig, Qwen3MoeForCausalLM, True
    extra.update(head_dim=16, use_sliding_window=False, num_hidden_layers=3, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                 norm_topk_prob=True)
elif "--mixtral" in sys.argv:
    Config, Model, moe = MixtralConfig, MixtralForCausalLM, True
    extra.update(num_local_experts=4, num_experts_per_tok=2)
if moe:
    extra.update(router_aux_loss_coef=0.02, output_router_logits=True)
config = Config(
    **extra,
    vocab_size=384,
    hidden_size=64,
    intermediate_size=176,
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


def objective():
    """(cross-entropy, what training minimises, the model's outputs)."""
    outputs = model(input_ids=inputs)
    logits = outputs.logits
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    total = ce + config.router_aux_loss_coef * outputs.aux_loss if moe else ce
    return ce, total, outputs


def loss_fn():
    ce, total, _ = objective()
    loss_fn.ce = ce.item()
    return total


mixtral = "--mixtral" in sys.argv


def checkpoint_named(pairs):
    """(name, tensor) as a checkpoint names them: transformers 5 holds each MoE layer's
    experts fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) and writes them one tensor
    per expert and matrix (`mlp.experts.E.gate_proj.weight`; Mixtral's
    `block_sparse_moe.experts.E.w1.weight`, its router `block_sparse_moe.gate.weight`)."""
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if mixtral else "mlp"
    for name, t in pairs:
        prefix, _, leaf = name.rpartition(".mlp.")
        if leaf == "experts.gate_up_proj":
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}.{block}.experts.{e}.{names[0]}.weight", t[e, :half]
                yield f"{prefix}.{block}.experts.{e}.{names[1]}.weight", t[e, half:]
        elif leaf == "experts.down_proj":
            for e in range(t.shape[0]):
                yield f"{prefix}.{block}.experts.{e}.{names[2]}.weight", t[e]
        elif leaf == "gate.weight":
            yield f"{prefix}.{block}.gate.weight", t
        else:
            yield name, t


loss, total, outputs = objective()
moe_ref = {}
if moe:
    moe_ref["aux_loss"] = outputs.aux_loss.item()
    # Each MoE layer's experts per token, as the router ranks them (descending probability).
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    moe_ref["choices"] = {
        str(i): torch.topk(F.softmax(logits.float(), -1), config.num_experts_per_tok, -1).indices.tolist()
        for i, logits in zip(sparse, outputs.router_logits)
    }
total.backward()
grad_norms = {n: g.norm().item()
              for n, g in checkpoint_named((n, p.grad) for n, p in model.named_parameters())}
model.zero_grad(set_to_none=True)

muon_adjust = sys.argv[sys.argv.index("--muon") + 1] if "--muon" in sys.argv else None
# Muon's matrices (with --muon): the decoder layers' 2-D weights, and each expert's matrices
# as views of the fused 3-D tensors (name, view, its gradient's view taken at each step).
in_layers = {id(p) for p in model.model.layers.parameters()} if muon_adjust else set()
muon_2d = [p for p in model.parameters() if id(p) in in_layers and p.dim() == 2]
fused = [(n, p) for n, p in model.named_parameters() if id(p) in in_layers and p.dim() == 3]
others = [p for p in model.parameters() if id(p) not in in_layers or p.dim() == 1]
decay = [p for p in others if p.dim() >= 2]
no_decay = [p for p in others if p.dim() < 2]
opt = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
    lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False,
)
before = {n: p.detach().clone().contiguous()
          for n, p in checkpoint_named(model.named_parameters())}
optimizers = [opt]
if muon_adjust:
    optimizers.append(torch.optim.Muon(muon_2d, lr=1e-3, weight_decay=0.1,
                                       adjust_lr_fn=muon_adjust))
# Each fused expert tensor's momentum buffers, one per expert matrix (zero at first).
expert_buffers = {n: torch.zeros_like(p) for n, p in fused}


def expert_views(name, t):
    """Each expert's matrices of the fused tensor `name`: [E, 2I, H] gate_up_proj (gate and up
    halves) or [E, H, I] down_proj."""
    if name.endswith("gate_up_proj"):
        half = t.shape[1] // 2
        return [v for e in range(t.shape[0]) for v in (t[e, :half], t[e, half:])]
    return [t[e] for e in range(t.shape[0])]


def step_experts():
    from torch.optim._muon import muon
    for n, p in fused:
        with torch.no_grad():
            muon(expert_views(n, p), expert_views(n, p.grad),
                 expert_views(n, expert_buffers[n]), lr=1e-3,
                 weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7,
                 adjust_lr_fn=muon_adjust, has_complex=False)


grad_noise = float(sys.argv[sys.argv.index("--grad-noise") + 1]) if "--grad-noise" in sys.argv else 0.0
noise = torch.Generator().manual_seed(2)
step_losses, step_norms = [], []
for step in range(3):
    model.zero_grad(set_to_none=True)
    l = loss_fn()
    l.backward()
    # clip_grad_norm_ with the norm summed in fp64: torch's fp32 norm kernel drifts on large
    # tensors on CPU, and lockstep computes the norm one accurate way at every zero stage.
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
    coef = torch.clamp(1.0 / (norm.float() + 1e-6), max=1.0)
    for p in model.parameters():
        p.grad.mul_(coef)
        if grad_noise:
            p.grad.mul_(1 + grad_noise * torch.randn(p.grad.shape, generator=noise))
    if muon_adjust:
        grads = checkpoint_named((n, p.grad) for n, p in model.named_parameters())
        save_file({n: g.contiguous() for n, g in grads}, f"{out}/grads{step}.safetensors")
    for o in optimizers:
        o.step()
    if fused:
        step_experts()
    step_losses.append(loss_fn.ce)
    step_norms.append(norm.item())

params = {n: p.detach().clone().contiguous()
          for n, p in checkpoint_named(model.named_parameters())}
save_file(params, f"{out}/after.safetensors")
if muon_adjust:
    save_file(before, f"{out}/before.safetensors")
    state = optimizers[1].state
    names = {id(p): n for n, p in model.named_parameters()}
    buffers = [(names[id(p)], state[p]["momentum_buffer"]) for p in muon_2d]
    buffers += list(expert_buffers.items())
    save_file({n: t.contiguous() for n, t in checkpoint_named(buffers)},
              f"{out}/momentum.safetensors")
with open(f"{out}/reference.json", "w") as f:
    json.dump({"loss": loss.item(), "grad_norms": grad_norms, "step_losses": step_losses,
               "step_grad_norms": step_norms, **moe_ref}, f)
