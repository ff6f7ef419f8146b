"""How far torch.optim.Muon lands from itself when its gradients differ in their last bits: the
3-step Muon + AdamW reference of tests/hf_parity.rs (tests/reference/hf_llama.py: a 2-layer
Llama, hidden 64, lr 1e-3, clipping) run twice, once with each clipped gradient scaled by
1 + NOISE·N(0, 1); per tensor, the relative L2 difference of the two runs' 3-step changes. The
spread lockstep's parity test meets against torch is this one (BENCHMARKS.md §22).

usage: .venv/bin/python benches/muon_spread.py [NOISE=1e-7] [ADJUST=match_rms_adamw]
"""
import subprocess
import sys
import tempfile

from safetensors.torch import load_file

noise = sys.argv[1] if len(sys.argv) > 1 else "1e-7"
adjust = sys.argv[2] if len(sys.argv) > 2 else "match_rms_adamw"
with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
    ref = "tests/reference/hf_llama.py"
    subprocess.run([sys.executable, ref, a, "--muon", adjust], check=True, capture_output=True)
    subprocess.run([sys.executable, ref, b, "--muon", adjust, "--grad-noise", noise], check=True,
                   capture_output=True)
    before, x, y = (load_file(f"{d}/{f}") for d, f in
                    ((a, "before.safetensors"), (a, "after.safetensors"), (b, "after.safetensors")))
    muon = set(load_file(f"{a}/momentum.safetensors"))
    for name in sorted(x):
        dx, dy = x[name] - before[name], y[name] - before[name]
        kind = "Muon " if name in muon else "AdamW"
        print(f"{kind} {name}: {((dy - dx).norm() / dx.norm()).item():.2e}")
