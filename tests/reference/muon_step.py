"""Reference for tests/hf_parity.rs::muon_is_bitwise_torch_from_the_same_update: two steps of
torch.optim.Muon (its defaults, adjust_lr_fn ADJUST) on a tall 48 x 16 and a wide 16 x 48
matrix from given gradients, with its bf16 Newton-Schulz result of the first step's Nesterov
update.

usage: muon_step.py OUT_DIR ADJUST
"""
import sys

import torch
from safetensors.torch import save_file
from torch.optim._muon import _zeropower_via_newtonschulz

out, adjust = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(5)
tensors = {}
params = []
for name, shape in (("tall", (48, 16)), ("wide", (16, 48))):
    p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
    tensors[f"{name}.before"] = p.detach().clone()
    for step in range(2):
        tensors[f"{name}.grad{step}"] = torch.randn(shape, generator=g) * 1e-2
    params.append((name, p))
opt = torch.optim.Muon([p for _, p in params], lr=1e-2, weight_decay=0.1, adjust_lr_fn=adjust)
for step in range(2):
    for name, p in params:
        p.grad = tensors[f"{name}.grad{step}"].clone()
        if step == 0:
            # The first step's update, as torch.optim.Muon makes it from a zero buffer.
            buffer = torch.zeros_like(p.grad).lerp_(p.grad, 1 - 0.95)
            update = p.grad.lerp(buffer, 0.95)
            tensors[f"{name}.ns0"] = _zeropower_via_newtonschulz(
                update, (3.4445, -4.775, 2.0315), 5, 1e-7).contiguous()
    opt.step()
for name, p in params:
    tensors[f"{name}.after"] = p.detach().clone()
    tensors[f"{name}.momentum"] = opt.state[p]["momentum_buffer"].clone()
save_file(tensors, f"{out}/muon.safetensors")
