"""transformers' loss and gradients on a device, for the parity test
src/model/device_tests.rs::matches_transformers_on_the_device.

DIR is what tests/reference/hf_llama.py wrote (DIR/model: a random GQA LlamaForCausalLM, DIR/
batch.safetensors: a fixed [3, 33] batch). This loads that model on DEVICE and writes
DIR/device_reference.safetensors with, for fp32 and for bf16 autocast (fp32 weights, the matmuls
and attention in bf16: what lockstep's training.dtype=bf16 computes), the mean next-token
cross-entropy (`{fp32,bf16}/loss`, shape [1], fp64) and every parameter's gradient
(`{fp32,bf16}/grad/<HF name>`, fp32).

usage: hf_parity_device.py DIR [--device cuda|cpu]
"""
import argparse

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--device", default="cuda")
a = ap.parse_args()

# fp32 means fp32: no TF32 anywhere (libtorch's defaults for the matmuls, stated here).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_float32_matmul_precision("highest")

device = torch.device(a.device)
model = LlamaForCausalLM.from_pretrained(f"{a.dir}/model", dtype=torch.float32, attn_implementation="sdpa")
model = model.to(device).train()
tokens = load_file(f"{a.dir}/batch.safetensors")["tokens"].to(device)
x, y = tokens[:, :-1], tokens[:, 1:]
vocab = model.config.vocab_size

out = {}
for label, bf16 in [("fp32", False), ("bf16", True)]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
    loss.backward()
    out[f"{label}/loss"] = loss.detach().double().reshape(1).cpu()
    for name, p in model.named_parameters():
        out[f"{label}/grad/{name}"] = p.grad.detach().float().contiguous().cpu()
    print(f"transformers {transformers.__version__} on {device} ({label}): loss {loss.item():.8f}")
save_file(out, f"{a.dir}/device_reference.safetensors")
