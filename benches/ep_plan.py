"""`lockstep plan` for Qwen3-30B-A3B and Mixtral-8x7B on 8 and 64 x 80 GB at each expert-parallel
degree E: the cheapest layout the advice finds at that E, applied, with its step time, all-to-all
time and bytes, data-parallel time, the EP group's link and tokens/s (BENCHMARKS.md section 21).
Usage: python3 benches/ep_plan.py (after cargo build --release), from the repository root."""
import json, subprocess, sys
B = "./target/release/lockstep"
for model in ["qwen3-30b-a3b", "mixtral-8x7b"]:
    for gpus in [8, 64]:
        for e in [1, 2, 4, 8, 16, 32, 64]:
            if e > gpus: continue
            if model == "mixtral-8x7b" and e > 8: continue
            r = subprocess.run([B, "plan", "--json", "--preset", model, "--gpus", str(gpus), "--device", "cuda",
                                "--gpu-memory-gb", "80", "--set", f"system.expert_parallel={e}"], capture_output=True, text=True)
            if r.returncode != 0:
                print(model, gpus, e, "ERR", r.stderr.strip()[:200]); continue
            j = json.loads(r.stdout)
            a = j["advice"]
            if a is None:
                sm = j["smallest"]
                print(f"| {model} | {gpus} | {e} | no layout fits (smallest {sm['total_bytes']/1e9:.1f} GB: stage {sm['layout']['zero_stage']}, {sm['layout']['activation_checkpointing']}) | | | | {j['expert_parallel_link']} |")
                continue
            # apply advice to get timing split
            sets = sum([["--set", s] for s in a["sets"]], [])
            q = json.loads(subprocess.run([B, "plan", "--json", "--preset", model, "--gpus", str(gpus), "--device", "cuda",
                                "--gpu-memory-gb", "80", "--set", f"system.expert_parallel={e}"] + sets, capture_output=True, text=True).stdout)
            c = q["configured"]; t = c["time"]; lay = c["layout"]
            print(f"| {model} | {gpus} | {e} | stage {lay['zero_stage']}, {lay['activation_checkpointing']}: {c['total_bytes']/1e9:.1f} GB | {q['step_seconds']:.2f} s | {t['expert_parallel_seconds']:.3f} s ({q['expert_parallel_bytes_per_step']/1e9:.1f} GB) | {t['data_parallel_seconds']:.3f} s | {q['expert_parallel_link']} | {q['tokens_per_second_total']:.0f} |")
