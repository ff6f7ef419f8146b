#!/usr/bin/env bash
# Runs ON the GPU machine (which has torch 2.11 + transformers but no Rust): lockstep from a
# binary built here and carried in .carry/, then PyTorch eager on the same shapes, same call.
#
# Here:   source scripts/env.sh && cargo build --release && mkdir -p .carry &&
#         objcopy --strip-debug target/release/lockstep .carry/lockstep      # 110 MB -> 16 MB
#         and the unit tests, which exercise the NCCL group on a real GPU when one is visible:
#         objcopy --strip-debug $(cargo test --release --lib --no-run --message-format=json |
#           jq -r 'select(.profile.test and .target.kind == ["lib"]) | .executable') .carry/lockstep-unit
# There:  device run, carry [".carry"], command: bash benches/gpu/run.sh [CONFIG]
set -euo pipefail
config=${1:-benches/gpu/llama-1b.json}
torch_lib=$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -x .carry/lockstep-unit ]; then
  # NCCL through the embedded ProcessGroupNCCL shim (one GPU: a group of one rank), bucketed
  # collectives, and the CUDA paths of the model tests.
  ./.carry/lockstep-unit --test-threads 1 dist:: model:: 2>&1 | grep -E "^test |test result"
fi
./.carry/lockstep train --config "$config" --set logging.run_name=gpu-bench --set "logging.dir=${OUT:-/tmp}/runs" 2>&1 \
  | grep -E "Model:|Step \[|Timing|Memory|error" | tail -8
python3 benches/gpu/pytorch_step.py "$config"
