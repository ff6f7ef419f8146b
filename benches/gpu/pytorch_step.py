"""PyTorch on the same shapes as a lockstep config, for the GPU comparison (benches/gpu/accept.sh,
check 5): transformers LlamaForCausalLM (sdpa), bf16 autocast with fp32 master weights, fused
AdamW, clip 1.0, full logits + cross-entropy in fp32 — eager, or the model under
`torch.compile` (default mode; the optimizer step stays eager and fused).

Prints median tokens/s and MFU over the timed steps: 6·N·tokens (LM head counted, embedding not)
plus causal attention 6·L·s·d per token, lockstep's count, over the device's dense bf16 peak
(--peak, else by GPU name as lockstep's telemetry/mfu.rs does). With --json, one JSON object
last; an out-of-memory step gives {"status": "oom"} instead of a traceback.

With --profile, two more steps run under torch.profiler and the GPU kernel time per step is
summed by kind (matrix products, attention, cross-entropy, optimizer, norms and reductions,
elementwise, copies, other) into "kernels_ms": where eager's time goes and what compile's
fused kernels take off it (benches/gpu/accept.sh, c7-kernels).

usage: pytorch_step.py CONFIG.json [--batch-size B] [--steps N] [--warmup W] [--vocab V]
                       [--device cuda|cpu] [--compile] [--profile] [--json]
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("config")
ap.add_argument("--steps", type=int, default=10, help="timed steps")
ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
ap.add_argument("--batch-size", type=int, default=None, help="default: training.batch_size of the config")
ap.add_argument("--vocab", type=int, default=None, help="default: model.vocab_size of the config, else 50257")
ap.add_argument("--device", default="cuda")
ap.add_argument("--compile", action="store_true", help="torch.compile the model")
ap.add_argument("--peak", type=float, default=None, help="dense bf16 FLOP/s of the device")
ap.add_argument("--profile", action="store_true", help="kernel time by kind over 2 more steps")
ap.add_argument("--json", action="store_true")
a = ap.parse_args()


def peak_bf16(name):
    """lockstep's table (src/telemetry/mfu.rs)."""
    n = name.upper()
    if "H100" in n and ("PCIE" in n or "PCI" in n):
        return 756e12
    if any(k in n for k in ("H100", "H200", "H800", "GH200")):
        return 989e12
    for key, tflops in (("B200", 2250), ("A100", 312), ("L40S", 362), ("A10G", 70)):
        if key in n:
            return tflops * 1e12
    return None


c = json.load(open(a.config))
m, t = c["model"], c["training"]
vocab = a.vocab or m.get("vocab_size") or 50257
b = a.batch_size or t["batch_size"]
s = t["context_length"]
device = torch.device(a.device)
label = "pytorch compile" if a.compile else "pytorch eager"
result = {"impl": label, "batch": b, "seq": s, "device": a.device, "status": "ok"}

cfg = LlamaConfig(
    vocab_size=vocab,
    hidden_size=m["hidden_size"],
    intermediate_size=m["intermediate_size"],
    num_hidden_layers=m["num_layers"],
    num_attention_heads=m["num_attention_heads"],
    num_key_value_heads=m["num_key_value_heads"],
    max_position_embeddings=m.get("max_position_embeddings", s),
    rope_parameters={"rope_type": "default", "rope_theta": m.get("rope_theta", 10000.0)},
    attn_implementation="sdpa",
)
with device:
    model = LlamaForCausalLM(cfg).train()
n = sum(p.numel() for p in model.parameters())
d, L = m["hidden_size"], m["num_layers"]
flops_per_token = 6 * (n - vocab * d) + 6 * L * s * d
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                        fused=device.type == "cuda")
fwd = torch.compile(model) if a.compile else model
g = torch.Generator(device=device).manual_seed(0)
tokens = torch.randint(0, vocab, (b, s + 1), device=device, generator=g)
x, y = tokens[:, :-1], tokens[:, 1:]
amp_dtype = torch.bfloat16


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


def step():
    with torch.autocast(device.type, dtype=amp_dtype):
        logits = fwd(input_ids=x).logits
    loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


try:
    t0 = time.perf_counter()
    for _ in range(a.warmup):
        step()
    sync()
    result["warmup_s"] = time.perf_counter() - t0
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
except torch.OutOfMemoryError as e:
    result.update(status="oom", error=str(e).splitlines()[0])
    times = []

# Kernel names → kinds, first match wins: Inductor's triton_* kernels first (fused pointwise:
# poi; reductions: red, per), whose names list the ops they fused (an RoPE or transpose fused
# beside SDPA is named after it: in the 2026-11-28 run that put ~37 ms of compile's pointwise
# work under attention); then cuBLAS/CUTLASS GEMMs, cuDNN/flash attention and ATen's kernels.
KINDS = (
    ("elementwise", ("triton_poi",)),
    ("norm_reduce", ("triton_red", "triton_per")),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa", "mha")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_")),
    ("cross_entropy", ("log_softmax", "nll_loss", "softmax", "cross_entropy")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("norm_reduce", ("reduce", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise")),
    ("copy", ("copy", "memcpy", "memset", "cat", "index")),
)


def kind_of(name):
    n = name.lower()
    return next((k for k, keys in KINDS if any(x in n for x in keys)), "other")


if times and a.profile and device.type == "cuda":
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        sync()
    by_kind, top = {}, {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        us = e.device_time_total  # a kernel's own duration
        by_kind[kind_of(e.name)] = by_kind.get(kind_of(e.name), 0.0) + us / 2e3
        top[e.name] = top.get(e.name, 0.0) + us / 2e3
    result["kernels_ms"] = {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    result["kernels_total_ms"] = round(sum(by_kind.values()), 2)
    result["kernels_top"] = [[n[:80], round(v, 2)] for n, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]]
    print(f"{label}: GPU kernel time per step by kind (ms): {result['kernels_ms']}"
          f" total {result['kernels_total_ms']}", flush=True)

if times:
    times.sort()
    tok_s = b * s / times[len(times) // 2]
    peak = a.peak or (peak_bf16(torch.cuda.get_device_name()) if device.type == "cuda" else None)
    result.update(
        params=n,
        step_ms=1e3 * times[len(times) // 2],
        tok_s=tok_s,
        mfu=tok_s * flops_per_token / peak if peak else None,
        flops_per_token=flops_per_token,
    )
    mfu = f"MFU {100 * result['mfu']:.1f}%" if peak else "MFU n/a"
    print(f"{label}: {n / 1e6:.0f}M params, batch {b} x {s}: median {tok_s:.0f} tok/s, {mfu}"
          f" (warm-up {result['warmup_s']:.1f} s)", flush=True)
else:
    print(f"{label}: batch {b} x {s}: {result.get('error', 'no step timed')}", flush=True)
if device.type == "cuda":
    result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
if a.json:
    print(json.dumps(result), flush=True)
