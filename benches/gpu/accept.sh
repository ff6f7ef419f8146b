#!/usr/bin/env bash
# The CUDA path, proven (issue 15): runs ON the GPU machine, from the binaries that
# benches/gpu/prepare.sh packed into .carry/ here. Every check prints
#   PASS|FAIL|SKIP <name>: <figure>
# and everything goes to $OUT/report.txt (the device tool returns $OUT), with $OUT/summary.txt
# (the result lines alone) and $OUT/logs.tar.gz (every command's full output).
#
# usage: bash benches/gpu/accept.sh [--dry-run] [GROUP|STEP]...   (default: lease)
#   lease        what one 15-minute GPU session runs in one device call, most needed first:
#                c1-nccl c1-model c2 c3-run c3-resume c4-nan c4-docmask c4-eval c5-speed
#                c7-phases c6-default c5-compile c9-wheel c4-tasks c4-muon c7-kernels (budget
#                420 s; c5 at micro-batches 8 and 16)
#   rest         every step lease leaves out: c1-all c3-auto-free c6-variants c8
#   correctness  c1 unit tests on CUDA: c1-nccl (the NCCL group of one rank), c1-model (the
#                   model on CUDA against the CPU), c1-all (the whole unit suite)
#                c2 parity with transformers on the GPU (fp32 and bf16)
#                c3 `lockstep run --gpus 0`: c3-run (bf16 debug preset, asynchronous
#                   checkpoint), c3-resume, c3-auto-free (--gpus auto-free)
#                c4 c4-nan (the NaN guard on CUDA), c4-docmask (packed documents: variable-
#                   length flash attention), c4-eval (eval and generate on CUDA against the CPU),
#                   c4-tasks (downstream evaluation in training and by eval --task on CUDA
#                   against the CPU), c4-muon (training.optimizer = muon on the device: bf16
#                   trains, fp32 against the CPU, Newton-Schulz's share of the step)
#                c9 c9-wheel: the pip wheel (scripts/wheel.sh's manylinux binary and launcher)
#                   installed beside this machine's torch, then env, train and generate on the
#                   GPU from a clean environment
#   perf         c5 throughput of the 1B config: c5-speed (lockstep and PyTorch eager),
#                   c5-compile (torch.compile; the goal)
#                c7 one step profiled: c7-phases (per-phase times, host synchronisations per
#                   step), c7-kernels (GPU kernel time by kind, PyTorch eager and compile)
#   scale        c6 the production preset (8B dims, 4 layers, context 8192): tokens/s, peak
#                   memory: c6-default, c6-variants (activation checkpointing / loss chunking /
#                   zero stage)
#   multi        c8 two ranks (NCCL on 2+ GPUs; SKIP with one) against one rank: the same losses
#                (data parallelism at every zero stage, tensor and context parallelism, expert
#                parallelism, Muon at stage 2: its bf16 all-to-alls on NCCL)
#                   for zero stages 0, 1, 2, 3, 3 with hybrid sharding (fp32) and bf16; tensor
#                   parallelism: TP 2, and TP 2 x data 2 at stage 3 (4+ GPUs; SKIP with fewer)
#   all          correctness perf scale multi (more than one device command's 10 minutes)
#   c1..c9, or one step by its name (c3-resume): that check alone; steps run in the order named
#                (c3-resume and c4-eval need c3-run earlier in the same call, c5-compile c5-speed)
#   --dry-run    here, on the CPU, with tiny shapes: every check's logic runs (the device
#                switched to the CPU; what needs a GPU is a SKIP that says so)
#
# Knobs (environment): OUT (report folder; default /tmp/lockstep-accept-out), ACCEPT_WORK
# (scratch, default a fresh /tmp/lockstep-accept.XXXXXX, removed at the end unless
# ACCEPT_KEEP=1), ACCEPT_BUDGET_S (default 420 with lease, else 540: checks that would start
# later are SKIPped, so the device command's limit never kills the report), ACCEPT_BATCHES
# (c5's micro-batch sizes, default "8 16" with lease, else "4 8 16"), ACCEPT_COMPILE=0 (no
# torch.compile), ACCEPT_IGNORE_BUILD=1 (go on with a torch that differs from the build's:
# expect crashes).
set -uo pipefail # no -e: a failing check is reported, and the next one runs
T0=$SECONDS
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
DRY=0
LEASE=0
# Every step, grouped by check, in the order `all` runs them.
C1=(c1-nccl c1-model c1-all) C2=(c2) C3=(c3-run c3-resume c3-auto-free)
C4=(c4-nan c4-docmask c4-muon c4-eval c4-tasks) C5=(c5-speed c5-compile) C6=(c6-default c6-variants) C7=(c7-phases c7-kernels) C8=(c8) C9=(c9-wheel)
ALL_STEPS=("${C1[@]}" "${C2[@]}" "${C3[@]}" "${C4[@]}" "${C9[@]}" "${C5[@]}" "${C7[@]}" "${C6[@]}" "${C8[@]}")
# A GPU session's one call (15 minutes of device time, the machine's start included): every
# figure the CUDA issue requires, cheapest first within what matters most.
LEASE_STEPS=(c1-nccl c1-model c2 c3-run c3-resume c4-nan c4-docmask c4-eval c5-speed c7-phases c6-default c5-compile c9-wheel c4-tasks c4-muon c7-kernels)
STEPS=()
among() { [[ " ${*:2} " == *" $1 "* ]]; } # among WORD LIST...: whether WORD is in LIST
add() {                                   # add STEP...: appended once each, in order
  local s
  for s in "$@"; do among "$s" "${STEPS[@]}" || STEPS+=("$s"); done
}
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    lease) LEASE=1 && add "${LEASE_STEPS[@]}" ;;
    rest) for s in "${ALL_STEPS[@]}"; do among "$s" "${LEASE_STEPS[@]}" || add "$s"; done ;;
    correctness) add "${C1[@]}" "${C2[@]}" "${C3[@]}" "${C4[@]}" "${C9[@]}" ;;
    perf) add "${C5[@]}" "${C7[@]}" ;;
    scale) add "${C6[@]}" ;;
    multi) add "${C8[@]}" ;;
    all) add "${ALL_STEPS[@]}" ;;
    c[1-9]) group="${arg^^}[@]" && add "${!group}" ;;
    -h | --help)
      sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      if among "$arg" "${ALL_STEPS[@]}"; then
        add "$arg"
      else
        echo "accept.sh: unknown argument '$arg' (lease|rest|correctness|perf|scale|multi|all|c1..c9|a step: ${ALL_STEPS[*]}; --dry-run)" >&2
        exit 2
      fi
      ;;
  esac
done
[ ${#STEPS[@]} -gt 0 ] || {
  LEASE=1
  add "${LEASE_STEPS[@]}"
}

OUT=${OUT:-/tmp/lockstep-accept-out}
mkdir -p "$OUT"
REPORT=$OUT/report.txt
SUMMARY=$OUT/summary.txt
: >"$REPORT"
: >"$SUMMARY"
WORK=${ACCEPT_WORK:-$(mktemp -d /tmp/lockstep-accept.XXXXXX)}
mkdir -p "$WORK/logs" "$WORK/bin"
LOGS=$WORK/logs
BUDGET=${ACCEPT_BUDGET_S:-$([ "$LEASE" = 1 ] && echo 420 || echo 540)}
NPASS=0 NFAIL=0 NSKIP=0
MEMPID=

say() { echo "$*" | tee -a "$REPORT"; }
section() { say ""; say "== $* ($((SECONDS - T0)) s)"; }
result() { # result PASS|FAIL|SKIP NAME FIGURE...
  local st=$1 name=$2
  shift 2
  case "$st" in PASS) NPASS=$((NPASS + 1)) ;; FAIL) NFAIL=$((NFAIL + 1)) ;; *) NSKIP=$((NSKIP + 1)) ;; esac
  echo "$st $name: $*" | tee -a "$REPORT" "$SUMMARY"
}
# time_for SECONDS NAME: whether a step of about SECONDS still fits the budget (else a SKIP).
# Each step's SECONDS is ~1.5x what it took on an H200 on 2026-11-28 (the report's section
# timestamps: preflight 26 s, c2 29, c3-run 23, c3-resume 54, c4-eval 47, c5-speed at b=8 and
# 16 48, c7-phases 12, c7-kernels 82 (eager and compile), c6 4 per variant, c5-compile 61 with
# its 41 s of compilation, c9 9). c4-tasks (added 2026-12-02) has not run on a GPU yet: its 60
# is a guess (a 4-step train of the small model and three evals of 800 short rows).
time_for() {
  local left=$((BUDGET - (SECONDS - T0)))
  if [ "$left" -lt "$1" ]; then
    result SKIP "$2" "out of time: ${left}s of ACCEPT_BUDGET_S=${BUDGET} left, needs ~$1s (run this check alone)"
    return 1
  fi
}
# A step's timeout, cut to what the budget has left (+30 s), so no step outlives the budget.
clamp() {
  local left=$((BUDGET + 30 - (SECONDS - T0)))
  [ "$left" -lt 10 ] && left=10
  echo $(($1 < left ? $1 : left))
}
# run_logged NAME TIMEOUT CMD...: the command's output to $LOGS/NAME.log; its exit code.
run_logged() {
  local name=$1 secs
  secs=$(clamp "$2")
  shift 2
  {
    echo "\$ $*"
    echo "# $(date -u +%FT%TZ), timeout ${secs}s"
  } >"$LOGS/$name.log"
  timeout -k 10 "$secs" "$@" >>"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "# exit code $rc" >>"$LOGS/$name.log"
  return $rc
}
# train_until NAME STEPS TIMEOUT CMD...: a training run stopped (SIGKILL) once its step line
# for STEPS appears, so no final checkpoint is written (a 1B one is ~11 GB with the moments).
# 0 when STEPS was reached, else the run's exit code (124: timeout).
train_until() {
  local name=$1 steps=$2 secs
  secs=$(clamp "$3")
  shift 3
  local log=$LOGS/$name.log
  {
    echo "\$ $*"
    echo "# $(date -u +%FT%TZ), stopped at step $steps, timeout ${secs}s"
  } >"$log"
  "$@" >>"$log" 2>&1 &
  local pid=$! ticks=0 rc
  while kill -0 "$pid" 2>/dev/null; do
    if grep -q "Step \[$steps/" "$log"; then
      kill -KILL "$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      echo "# stopped at step $steps" >>"$log"
      return 0
    fi
    if [ "$ticks" -ge $((secs * 4)) ]; then
      kill -KILL "$pid" 2>/dev/null
      wait "$pid" 2>/dev/null
      echo "# killed after ${secs}s" >>"$log"
      return 124
    fi
    sleep 0.25
    ticks=$((ticks + 1))
  done
  wait "$pid"
  rc=$?
  echo "# exit code $rc" >>"$log"
  grep -q "Step \[$steps/" "$log" && return 0
  [ "$rc" -eq 0 ] && rc=1
  return $rc
}
# GPU memory in use, sampled by nvidia-smi every 200 ms (NVML: the caching allocator's
# reserve plus the CUDA context), for runs that end by SIGKILL.
mem_start() {
  MEMLOG=$1
  : >"$MEMLOG"
  if [ "$DRY" = 0 ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$MEMLOG" 2>/dev/null &
    MEMPID=$!
  fi
}
mem_stop() { # sets PEAK: the peak in GiB, or n/a; PEAK_GB: in GB (10^9 bytes, plan's unit), or empty
  if [ -n "${MEMPID:-}" ]; then
    kill "$MEMPID" 2>/dev/null
    wait "$MEMPID" 2>/dev/null
    MEMPID=
  fi
  local mib
  mib=$($PY "$HERE/accept_lib.py" peak-mib "$MEMLOG")
  PEAK_GB=
  if [ -n "$mib" ]; then
    PEAK=$(awk -v m="$mib" 'BEGIN { printf "%.1f GiB", m / 1024 }')
    PEAK_GB=$(awk -v m="$mib" 'BEGIN { printf "%.2f", m * 1048576 / 1e9 }')
  else
    PEAK=n/a
  fi
}
# The last lines of a log that say what went wrong (for a FAIL's figure).
why() { grep -aE "error|Error|ERROR|panicked|FAILED|Killed|killed|out of memory|refus" "$LOGS/$1.log" | grep -v '^\$ ' | tail -2 | tr '\n' ' ' | cut -c1-400; }
tag_re() { if [ "$DRY" = 1 ]; then echo '\[CPU0\]'; else echo '\[GPU0\]'; fi; }

finish() {
  # Background runs and samplers of this script still alive (jobs -p: this shell's own children).
  for p in $(jobs -p); do kill -KILL "$p" 2>/dev/null; done
  section "summary: $NPASS PASS, $NFAIL FAIL, $NSKIP SKIP in $((SECONDS - T0)) s ($MODE)"
  cat "$SUMMARY"
  # At most 8 files come back from $OUT: the logs travel as one archive.
  tar -C "$WORK" -czf "$OUT/logs.tar.gz" logs 2>/dev/null
  if [ "$(stat -c %s "$OUT/logs.tar.gz" 2>/dev/null || echo 0)" -gt 15000000 ]; then
    for f in "$LOGS"/*.log; do tail -c 200000 "$f" >"$f.tail" && mv "$f.tail" "$f"; done
    tar -C "$WORK" -czf "$OUT/logs.tar.gz" logs
  fi
  echo "report: $REPORT, logs: $OUT/logs.tar.gz"
  if [ "${ACCEPT_KEEP:-0}" = 1 ]; then
    echo "kept $WORK"
  else
    rm -rf "$WORK"
  fi
}
MODE=$([ "$DRY" = 1 ] && echo "dry run on the CPU" || echo "GPU")
trap finish EXIT

# ---------------------------------------------------------------------------------------------
# Setup: python, torch's libraries, the binaries, device-dependent arguments.
if [ "$DRY" = 1 ]; then
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  [ -x "$PY" ] || PY=python3
  DEV=cpu
  RUNDEV=(--cpu --nproc 1)
  # Tiny shapes for every preset and config the checks use.
  SHRINK=(--set model.hidden_size=64 --set model.num_attention_heads=4 --set model.num_key_value_heads=2
    --set model.intermediate_size=128 --set training.context_length=64)
  SMALL=("${SHRINK[@]}")
  BATCHES=${ACCEPT_BATCHES:-"1 2"}
  PROFILE_BATCH=2
else
  PY=${PYTHON:-python3}
  DEV=cuda
  RUNDEV=(--gpus 0)
  SHRINK=()
  # A small model where the check is not about size (the NaN dump holds every parameter and
  # gradient; auto-free only picks the device).
  SMALL=(--set model.hidden_size=512 --set model.num_attention_heads=8 --set model.num_key_value_heads=4
    --set model.intermediate_size=1024)
  BATCHES=${ACCEPT_BATCHES:-$([ "$LEASE" = 1 ] && echo "8 16" || echo "4 8 16")}
  PROFILE_BATCH=${ACCEPT_PROFILE_BATCH:-8}
fi
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# The caller's library path, before torch's lib goes first on it (c9 runs the wheel without it).
LDP_CALLER=${LD_LIBRARY_PATH-unset}
TORCH_LIB=$($PY -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
BIN=$WORK/bin/lockstep
UNIT=$WORK/bin/lockstep-unit
CARRY=$ROOT/.carry
cd "$WORK" || exit 2

say "lockstep GPU acceptance ($MODE): ${STEPS[*]}; budget ${BUDGET} s; $(date -u +%FT%TZ)"
say "repo $ROOT, scratch $WORK, python $PY, torch lib $TORCH_LIB"

# ---------------------------------------------------------------------------------------------
section "preflight"
say "host: $(uname -srm), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo) RAM, $(df -h /tmp | awk 'NR == 2 {print $4}') free in /tmp"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi >"$LOGS/nvidia-smi.log" 2>&1
  say "GPU: $(nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | tr '\n' ';')"
elif [ "$DRY" = 1 ]; then
  say "GPU: none (dry run)"
else
  result FAIL gpu "nvidia-smi not found on the GPU machine"
fi
if [ ! -f "$CARRY/build-info.json" ] || [ ! -f "$CARRY/binaries.tar.xz" ]; then
  result FAIL carry "$CARRY is missing files: run bash benches/gpu/prepare.sh here and carry [\".carry\"]"
  exit 2
fi
say "built from: $(tr -d '\n' <"$CARRY/build-info.json" | tr -s ' ')"
eval "$($PY "$HERE/accept_lib.py" build-match "$CARRY/build-info.json" 2>>"$LOGS/preflight.log" || echo 'STATUS=FAIL; FIGURE="python/torch failed: see preflight.log"')"
result "$STATUS" build-match "$FIGURE"
if [ "$STATUS" != PASS ] && [ "${ACCEPT_IGNORE_BUILD:-0}" != 1 ]; then
  say "The binaries were built against another torch: ProcessGroupNCCL's options embed ncclConfig_t, so a different NCCL segfaults. Stopping (ACCEPT_IGNORE_BUILD=1 goes on)."
  exit 2
fi
ok=1
$PY "$HERE/accept_lib.py" unpack "$CARRY" "$WORK/bin" >>"$LOGS/preflight.log" 2>&1 || ok=0
missing=$(ldd "$BIN" 2>&1 | grep "not found" | tr '\n' ' ')
version=$("$BIN" --version 2>&1)
if [ "$ok" = 1 ] && [ -z "$missing" ] && [ -n "$version" ]; then
  result PASS binaries "$version; unpacked, checksums match, every library resolves (LD_LIBRARY_PATH=$TORCH_LIB)"
else
  result FAIL binaries "unpack/checksum ok=$ok ($(tail -1 "$LOGS/preflight.log")); unresolved: ${missing:-none}; --version: $version"
  exit 2
fi
# The unit tests that read the source tree find it at the path the build had.
manifest=$(sed -n 's/.*"unit_test_binary": "\(.*\)\/target\/.*/\1/p' "$CARRY/build-info.json")
if [ -n "$manifest" ] && [ ! -e "$manifest" ] && [ "$DRY" = 0 ]; then
  mkdir -p "$(dirname "$manifest")" && ln -s "$ROOT" "$manifest" && say "linked $manifest -> $ROOT (the unit tests' CARGO_MANIFEST_DIR)"
fi
# `lockstep env` reads the CUDA runtime, NCCL (and which libnccl) and the driver the way the
# ranks' version agreement does (src/sys/cuda.rs, src/dist/versions.rs): compare with torch's.
# env_agrees LOG: whether a `lockstep env` output on the GPU names torch's CUDA runtime and
# NCCL, a driver and GPU 0, and no PROBLEM (c9 asks it of the wheel's binary too).
want=$($PY -c 'import torch; print(torch.version.cuda, ".".join(map(str, torch.cuda.nccl.version())))' 2>>"$LOGS/preflight.log")
CUDA_WANT=${want% *} NCCL_WANT=${want#* }
env_agrees() {
  grep -q "^CUDA       runtime $CUDA_WANT," "$1" && grep -q "^NCCL       $NCCL_WANT from /.*libnccl" "$1" &&
    grep -q '^driver     [0-9]' "$1" && grep -q '^GPU        0: ' "$1" && ! grep -q PROBLEM "$1"
}
"$BIN" env >"$LOGS/env.log" 2>&1
if [ "$DRY" = 1 ]; then
  result SKIP env "no GPU (dry run): $(grep -E '^(lockstep|libtorch|CUDA) ' "$LOGS/env.log" | tr -s ' ' | tr '\n' ';' | cut -c1-300)"
elif env_agrees "$LOGS/env.log"; then
  result PASS env "lockstep env: $(grep -E '^(CUDA|NCCL|driver) ' "$LOGS/env.log" | tr -s ' ' | tr '\n' ';')"
else
  result FAIL env "lockstep env disagrees with torch (CUDA $CUDA_WANT, NCCL $NCCL_WANT): $(grep -E '^(libtorch|CUDA|NCCL|driver|GPU)' "$LOGS/env.log" | tr -s ' ' | tr '\n' ';' | cut -c1-400)"
fi
# Every config key the checks set exists in this build.
"$BIN" config --keys >"$LOGS/config-keys.log" 2>&1
absent=""
for k in model.num_layers model.hidden_size model.num_attention_heads model.num_key_value_heads \
  model.intermediate_size model.vocab_size training.context_length training.batch_size training.dtype \
  training.learning_rate training.min_lr training.max_steps training.eval_batches \
  training.activation_checkpointing training.loss_chunk_tokens system.device system.zero_stage \
  system.memory_check logging.interval logging.memory_interval logging.tensorboard logging.verbose \
  logging.dir logging.run_name checkpoint.interval data.tokenizer debug.inject_nan_at_step \
  debug.inject_nan_param data.document_masking data.reset_position_ids training.eval_interval \
  training.eval_tasks training.optimizer; do
  grep -q "^$k " "$LOGS/config-keys.log" || absent="$absent $k"
done
if [ -z "$absent" ]; then result PASS config-keys "every key the checks set exists (lockstep config --keys)"; else result FAIL config-keys "unknown in this build:$absent"; fi
# LOCKSTEP_CUDA_SYNC_DEBUG writes c10's sync-debug mode through its symbol (src/sys/cuda.rs):
# check here, with this torch, that the symbol is the int torch.cuda.set_sync_debug_mode sets.
if $PY - >"$LOGS/sync-debug-layout.log" 2>&1 <<'EOF'; then
import ctypes, os, torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10_cuda.so"))
mode = ctypes.c_int.from_address(ctypes.cast(lib["_ZZN3c104cuda13warning_stateEvE14warning_state_"], ctypes.c_void_p).value)
seen = []
for m in (1, 2, 0):
    torch._C._cuda_set_sync_debug_mode(m)
    seen.append(mode.value)
assert seen == [1, 2, 0], seen
print("c10::cuda::warning_state() is the int torch.cuda.set_sync_debug_mode writes:", seen)
EOF
  result PASS sync-debug-layout "$(tail -1 "$LOGS/sync-debug-layout.log")"
else
  result FAIL sync-debug-layout "$(tail -1 "$LOGS/sync-debug-layout.log") (LOCKSTEP_CUDA_SYNC_DEBUG cannot work with this torch)"
fi
# Which SDPA kernel libtorch picks for the shapes of c5/c6 (FACTS.md: cuDNN over flash on H100).
$PY - >>"$REPORT" 2>&1 <<EOF
import torch
from torch.nn.attention import SDPBackend
dev = "$DEV"
for (h, kv, s, d) in ((16, 8, 2048, 128), (32, 8, 8192, 128)):
    q = torch.randn(1, h, s, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, kv, s, d, device=dev, dtype=torch.bfloat16)
    try:
        c = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=True)
        print(f"SDPA choice for bf16 causal GQA {h}/{kv} heads, seq {s}, head_dim {d} on {dev}: {SDPBackend(c).name}")
    except Exception as e:
        print(f"SDPA choice on {dev}: {e}")
EOF

# ---------------------------------------------------------------------------------------------
# The checks: one function per step (check_<step>, the step's dashes as underscores), run in
# the order of STEPS by the loop at the end. A step that would outlast the budget is a SKIP.

# c1: unit tests on the device.
check_c1_nccl() {
  section "c1 the NCCL group of one rank on $DEV"
  time_for 15 c1-nccl || return 0
  LOCKSTEP_TEST_DEVICE=$DEV run_logged c1-nccl 120 "$UNIT" --test-threads 1 --nocapture dist::nccl::
  rc=$?
  line=$(grep -ao "NCCL [0-9.]* group of one rank on cuda.*" "$LOGS/c1-nccl.log" | tail -1)
  summary=$(grep -a "^test result" "$LOGS/c1-nccl.log" | tail -1)
  if [ $rc -eq 0 ] && [ "$DRY" = 1 ]; then
    result PASS c1-nccl "$summary (CPU: group_on_this_machine checks the no-GPU error path)"
  elif [ $rc -eq 0 ] && [ -n "$line" ]; then
    result PASS c1-nccl "$line; $summary"
  else
    result FAIL c1-nccl "exit $rc; $summary; $(why c1-nccl)"
  fi
}
check_c1_model() {
  section "c1 the model on $DEV against the CPU"
  time_for 45 c1-model || return 0
  LOCKSTEP_TEST_DEVICE=$DEV run_logged c1-model 240 "$UNIT" --test-threads 1 --nocapture model:: sys::cuda::
  rc=$?
  summary=$(grep -a "^test result" "$LOGS/c1-model.log" | tail -1)
  varlen=$(grep -ao "varlen flash vs masked SDPA.*\|the variable-length kernel does not apply.*" "$LOGS/c1-model.log" | tail -1)
  grads=$(grep -a "^BFloat16 tied=false on" "$LOGS/c1-model.log" | sed 's/.*worst gradient/worst bf16 gradient/' | tail -1)
  if [ $rc -eq 0 ]; then
    result PASS c1-model "$summary; $varlen; vs CPU fp32: $grads"
  else
    result FAIL c1-model "exit $rc; $summary; failed: $(grep -a '^test .* FAILED$' "$LOGS/c1-model.log" | awk '{print $2}' | tr '\n' ' ') $(why c1-model)"
  fi
}
# The whole unit suite on this machine: a GPU changes what some tests see.
check_c1_all() {
  section "c1 the whole unit suite on this machine"
  time_for 45 c1-all || return 0
  # dist::nccl and the device tests ran in processes of their own above: a process that
  # touched libtorch's device machinery before loading the CUDA backend never sees CUDA.
  run_logged c1-all 240 "$UNIT" --test-threads "$(nproc)" --skip dist::nccl:: --skip model::device_tests::
  rc=$?
  summary=$(grep -a "^test result" "$LOGS/c1-all.log" | tail -1)
  unexpected=$(grep -a '^test .* FAILED$' "$LOGS/c1-all.log" | awk '{print $2}' | sort)
  # A test that fails beside others but passes alone races on process-wide state: reported
  # as flaky (a defect to fix), not as a GPU failure.
  flaky="" still=""
  for t in $unexpected; do
    if "$UNIT" --exact "$t" --test-threads 1 >>"$LOGS/c1-all-rerun.log" 2>&1; then flaky="$flaky $t"; else still="$still $t"; fi
  done
  unexpected=${still# }
  if [ -n "$summary" ] && [ -z "$unexpected" ]; then
    result PASS c1-all "$summary${flaky:+ (failed in parallel, pass alone — flaky:$flaky)}"
  else
    result FAIL c1-all "exit $rc; ${summary:-no summary}; unexpected failures: $(echo "$unexpected" | tr '\n' ' ') $(why c1-all)"
  fi
}

# c2: parity with transformers on the device.
check_c2() {
  section "c2 parity with transformers on $DEV (fp32 and bf16)"
  time_for 45 c2-parity || return 0
  P=$WORK/parity
  rm -rf "$P" && mkdir -p "$P"
  if run_logged c2-reference 180 bash -c "'$PY' '$ROOT/tests/reference/hf_llama.py' '$P' && '$PY' '$HERE/hf_parity_device.py' '$P' --device $DEV"; then
    LOCKSTEP_TEST_DEVICE=$DEV LOCKSTEP_PARITY_DIR=$P run_logged c2-parity 120 "$UNIT" --test-threads 1 --nocapture \
      --ignored --exact model::device_tests::matches_transformers_on_the_device
    rc=$?
    line=$(grep -ao "PARITY on .*" "$LOGS/c2-parity.log" | tail -1)
    if [ $rc -eq 0 ] && grep -qa "1 passed" "$LOGS/c2-parity.log"; then
      result PASS c2-parity "$line"
    else
      result FAIL c2-parity "exit $rc; $line; $(grep -a 'panicked\|^\[' "$LOGS/c2-parity.log" | tail -2 | tr '\n' ' ')"
    fi
  else
    result FAIL c2-parity "the transformers reference failed: $(tail -2 "$LOGS/c2-reference.log" | tr '\n' ' ')"
  fi
}

# c3: `lockstep run` on the GPU: the debug preset in bf16, a checkpoint, a resume.
RUNS=$WORK/runs
CKPT=$RUNS/full/checkpoints/step_10
TAG=$(tag_re)
# lr 1e-4 (the preset's 1e-7 barely moves the weights, which would hide a bad resume).
COMMON=(--debug "${SHRINK[@]}" --set training.dtype=bf16 --set training.learning_rate=1e-4
  --set training.min_lr=1e-5 --set logging.interval=1 --set logging.memory_interval=5
  --set logging.tensorboard=false --set "logging.dir=$RUNS")
check_c3_run() {
  section "c3 lockstep run ${RUNDEV[*]}: debug preset, bf16, checkpoint"
  time_for 40 c3-run || return 0
  run_logged c3-full 300 "$BIN" run "${RUNDEV[@]}" -- "${COMMON[@]}" --set logging.run_name=full --set checkpoint.interval=0
  rc=$?
  L=$LOGS/c3-full.log
  memline=$(grep -a "$TAG Memory |" "$L" | tail -1 | sed 's/.*Memory | //')
  gpu_mem_ok=1
  [ "$DRY" = 0 ] && ! grep -qa "$TAG Memory |.*GPU used" "$L" && gpu_mem_ok=0
  # The records W&B, MLflow and TensorBoard get carry the GPU's memory (memory/gpu_used_gb).
  [ "$DRY" = 0 ] && ! grep -q '"gpu_used_gb"' "$RUNS/full/metrics.jsonl" 2>/dev/null && gpu_mem_ok=0
  if [ $rc -eq 0 ] && grep -qa "$TAG Step \[10/10\]" "$L" && [ -d "$CKPT" ] && [ $gpu_mem_ok = 1 ]; then
    eval "$($PY "$HERE/accept_lib.py" steplines "$L" --skip 2)"
    result PASS c3-run "10 bf16 steps, '$(grep -a "$TAG Run:" "$L" | head -1 | sed 's/.*| 1 rank | //')', median $TOKS tok/s${MFU:+, MFU $MFU%}; memory line: $memline; checkpoint step_10 written"
  else
    result FAIL c3-run "exit $rc; step 10 seen: $(grep -qa "$TAG Step \[10/10\]" "$L" && echo yes || echo no); memory line: ${memline:-none}; $(why c3-full)"
  fi
  # checkpoint.async (the default): the final save is copied into pinned host memory and
  # written by the background writer; the run waits for it before exiting.
  staged=$(grep -ao "Checkpoint step_10: staged in [0-9.]* s" "$L" | head -1)
  written=$(grep -ao "step_10 (written in the background in [0-9.]* s)" "$L" | head -1)
  if [ -n "$staged" ] && [ -n "$written" ] && [ -f "$CKPT/trainer.json" ]; then
    result PASS c3-async-save "$staged (pinned host staging), $written"
  else
    result FAIL c3-async-save "staging line: '${staged:-none}', writer line: '${written:-none}'; $(why c3-full)"
  fi
}
check_c3_resume() {
  section "c3 stop at step 5 and resume"
  time_for 80 c3-resume || return 0
  if [ ! -f "$RUNS/full/metrics.jsonl" ]; then
    result SKIP c3-resume "needs c3-run's uninterrupted run in the same call"
    return 0
  fi
  run_logged c3-stop 300 "$BIN" run "${RUNDEV[@]}" -- "${COMMON[@]}" --set logging.run_name=resumed --stop-at-step 5
  rc1=$?
  run_logged c3-resume 300 "$BIN" run "${RUNDEV[@]}" -- "${COMMON[@]}" --set logging.run_name=resumed --resume auto
  rc2=$?
  resumed=$(grep -a "Resumed from" "$LOGS/c3-resume.log" | head -1 | sed 's/.*Resumed from/resumed from/')
  if [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && [ -n "$resumed" ] && [ -f "$RUNS/full/metrics.jsonl" ]; then
    eval "$($PY "$HERE/accept_lib.py" losses "$RUNS/full/metrics.jsonl" "$RUNS/resumed/metrics.jsonl" 1 5)"
    fresh=$([ "$BITWISE" = 1 ] && echo bitwise || echo "max rel $MAXREL")
    eval "$($PY "$HERE/accept_lib.py" losses "$RUNS/full/metrics.jsonl" "$RUNS/resumed/metrics.jsonl" 6 10)"
    again=$([ "$BITWISE" = 1 ] && echo bitwise || echo "max rel $MAXREL")
    # Bitwise where the kernels are deterministic; otherwise within 1e-3 relative (bf16
    # resolution is 4e-3; atomics in attention/embedding backward reorder sums).
    if [ -z "$MISSING" ] && { [ "$BITWISE" = 1 ] || awk -v x="$MAXREL" 'BEGIN { exit !(x <= 1e-3) }'; }; then
      result PASS c3-resume "$resumed; losses of steps 6-10 vs the uninterrupted run: $again (steps 1-5 of two fresh runs: $fresh)"
    else
      result FAIL c3-resume "steps missing: ${MISSING:-none}; steps 6-10: $again (tolerance 1e-3); steps 1-5: $fresh"
    fi
  else
    result FAIL c3-resume "stop exit $rc1, resume exit $rc2, '${resumed:-no resume line}'; $(why c3-resume)"
  fi
  rm -rf "$RUNS/resumed/checkpoints"
}
check_c3_auto_free() {
  section "c3 --gpus auto-free"
  time_for 30 c3-auto-free || return 0
  run_logged c3-auto-free 180 "$BIN" run --gpus auto-free -- --debug "${SMALL[@]}" --max-steps 2 \
    --set "logging.dir=$RUNS" --set logging.run_name=autofree --set logging.tensorboard=false
  rc=$?
  if [ "$DRY" = 1 ]; then
    msg=$(grep -a "auto-free" "$LOGS/c3-auto-free.log" | grep -v '^\$' | tail -1)
    if [ $rc -ne 0 ] && grep -qa "no NVIDIA GPU found" "$LOGS/c3-auto-free.log"; then
      result SKIP c3-auto-free "no GPU (dry run); the flag parses and is refused as it should be: $msg"
    else
      result FAIL c3-auto-free "exit $rc on a machine without GPUs: $msg"
    fi
  elif [ $rc -eq 0 ] && grep -qa "\[GPU0\] Step \[2/2\]" "$LOGS/c3-auto-free.log"; then
    result PASS c3-auto-free "$(grep -a '^\[launcher\] .* workers' "$LOGS/c3-auto-free.log" | head -1); lines prefixed [GPU0]"
  else
    result FAIL c3-auto-free "exit $rc; $(why c3-auto-free)"
  fi
  rm -rf "$RUNS/autofree"
}

# c4: the NaN guard on the device; eval and generate on the device against the CPU.
UP=model.layers.0.mlp.up_proj.weight
check_c4_nan() {
  section "c4 the NaN guard on $DEV"
  time_for 20 c4-nan || return 0
  run_logged c4-nan 180 "$BIN" train --debug "${SMALL[@]}" --set system.device=$DEV --set training.dtype=bf16 \
    --max-steps 5 --set debug.inject_nan_at_step=3 --set "debug.inject_nan_param=$UP" \
    --set "logging.dir=$RUNS" --set logging.run_name=nan --set logging.tensorboard=false
  rc=$?
  banner=$([ "$DRY" = 1 ] && echo "CPU 0" || echo "GPU 0")
  dump=$RUNS/nan/debug/nan_step_3.safetensors
  nans=$([ -f "$dump" ] && $PY "$HERE/accept_lib.py" nan-dump "$dump" 2>&1)
  if [ $rc -eq 3 ] && grep -qa "NaN GRADIENT DETECTED \[$banner\]" "$LOGS/c4-nan.log" &&
    grep -qa "Gradients with NaN/Inf (1 tensors)" "$LOGS/c4-nan.log" &&
    [ "$nans" = "[('$UP.grad', 1)]" ] && [ -f "$RUNS/nan/checkpoints/nan_step_3/model.safetensors" ]; then
    result PASS c4-nan-grad "exit 3; '$(grep -a "DETECTED" "$LOGS/c4-nan.log" | head -1)'; $(grep -a "• $UP" "$LOGS/c4-nan.log" | head -1 | sed 's/^ *//' | cut -c1-100); dump: $nans; nan_step_3 checkpoint written"
  else
    result FAIL c4-nan-grad "exit $rc (want 3); dump: ${nans:-missing}; $(grep -a "DETECTED" "$LOGS/c4-nan.log" | head -1) $(why c4-nan)"
  fi
  run_logged c4-nan-loss 180 "$BIN" train --debug "${SMALL[@]}" --set system.device=$DEV --set training.dtype=bf16 \
    --max-steps 4 --set debug.inject_nan_at_step=2 --set "logging.dir=$RUNS" --set logging.run_name=nanloss \
    --set logging.tensorboard=false
  rc=$?
  if [ $rc -eq 3 ] && grep -qa "DETECTED \[$banner\]" "$LOGS/c4-nan-loss.log"; then
    result PASS c4-nan-loss "exit 3; '$(grep -a "DETECTED" "$LOGS/c4-nan-loss.log" | head -1)'"
  else
    result FAIL c4-nan-loss "exit $rc (want 3); $(why c4-nan-loss)"
  fi
  rm -rf "$RUNS/nan" "$RUNS/nanloss"
}
check_c4_docmask() {
  section "c4 packed documents on $DEV"
  time_for 15 c4-docmask || return 0
  # Packed documents: on CUDA bf16 attention takes variable-length flash attention (c1 compares
  # the kernel with the masked path); a failure would print a WARNING and fall back.
  run_logged c4-docmask 180 "$BIN" train --debug "${SMALL[@]}" --set system.device=$DEV --set training.dtype=bf16 \
    --max-steps 3 --set data.document_masking=true --set data.reset_position_ids=true \
    --set "logging.dir=$RUNS" --set logging.run_name=docmask --set logging.tensorboard=false
  rc=$?
  fallback=$(grep -a "variable-length flash attention failed" "$LOGS/c4-docmask.log" | head -1)
  if [ $rc -eq 0 ] && grep -qa "Step \[3/3\]" "$LOGS/c4-docmask.log" && [ -z "$fallback" ]; then
    eval "$($PY "$HERE/accept_lib.py" steplines "$LOGS/c4-docmask.log")"
    result PASS c4-docmask "3 bf16 steps with document masking + reset positions, $TOKS tok/s; $([ "$DRY" = 1 ] && echo "CPU: the block-diagonal mask path" || echo "variable-length flash attention ran (no fallback warning)")"
  else
    result FAIL c4-docmask "exit $rc; ${fallback:-} $(why c4-docmask)"
  fi
  rm -rf "$RUNS/docmask"
}
check_c4_eval() {
  section "c4 eval and generate on $DEV against the CPU"
  if [ ! -d "$CKPT" ]; then
    result SKIP c4-eval "needs c3-run's checkpoint ($CKPT) from earlier in the same call"
    result SKIP c4-generate "needs c3's checkpoint"
  elif time_for 70 c4-eval; then
    DATA=$ROOT/data/shakespeare/hamlet_gut.txt
    declare -A LOSS
    for v in cpu:fp32 $DEV:fp32 $DEV:bf16; do
      d=${v%%:*} t=${v##*:}
      run_logged "c4-eval-$d-$t" 240 "$BIN" eval --model "$CKPT" --data "$DATA" --max-batches 2 --batch-size 2 \
        --json --device "$d" --dtype "$t"
      LOSS[$v]=$($PY "$HERE/accept_lib.py" json-field "$LOGS/c4-eval-$d-$t.log" loss)
    done
    fig=$(awk -v c="${LOSS[cpu:fp32]}" -v f="${LOSS[$DEV:fp32]}" -v b="${LOSS[$DEV:bf16]}" -v d="$DEV" 'BEGIN {
      if (c == "" || f == "" || b == "") { print "missing"; exit }
      rf = (f - c) / c; if (rf < 0) rf = -rf; rb = (b - c) / c; if (rb < 0) rb = -rb
      printf "loss cpu fp32 %.6f | %s fp32 %.6f (rel %.1e, tol 1e-4) | %s bf16 %.6f (rel %.1e, tol 1e-2)%s", c, d, f, rf, d, b, rb, (rf < 1e-4 && rb < 1e-2) ? "" : " OUT OF TOLERANCE" }')
    if [[ "$fig" != missing && "$fig" != *"OUT OF"* ]]; then result PASS c4-eval "$fig (2 batches x 2 windows of the trained context)"; else result FAIL c4-eval "$fig; $(why c4-eval-$DEV-fp32)"; fi

    declare -A IDS
    for v in cpu:fp32:cache $DEV:fp32:cache $DEV:fp32:nocache $DEV:bf16:cache; do
      IFS=: read -r d t c <<<"$v"
      extra=()
      [ "$c" = nocache ] && extra=(--no-kv-cache)
      run_logged "c4-generate-$d-$t-$c" 240 "$BIN" generate --model "$CKPT" --prompt-ids 464,6515,286,257 \
        --max-new-tokens 16 --temperature 0 --ignore-eos --json --device "$d" --dtype "$t" "${extra[@]}"
      IDS[$v]=$($PY "$HERE/accept_lib.py" json-field "$LOGS/c4-generate-$d-$t-$c.log" new_ids)
    done
    cpu=${IDS[cpu:fp32:cache]} dev=${IDS[$DEV:fp32:cache]} nocache=${IDS[$DEV:fp32:nocache]} bf=${IDS[$DEV:bf16:cache]}
    same_bf=$($PY -c "import sys; a, b = sys.argv[1].split(','), sys.argv[2].split(','); n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))); print(n)" "$cpu" "$bf" 2>/dev/null)
    if [ -n "$cpu" ] && [ "$cpu" = "$dev" ] && [ "$dev" = "$nocache" ]; then
      result PASS c4-generate "16 greedy tokens identical on cpu fp32, $DEV fp32 (KV cache) and $DEV fp32 (no cache): $dev; $DEV bf16 agrees on the first ${same_bf:-?} of 16"
    else
      result FAIL c4-generate "cpu fp32 [$cpu] | $DEV fp32 [$dev] | $DEV no cache [$nocache] | $DEV bf16 [$bf]"
    fi
  fi
}

# c4-muon: Muon (docs/optimizers.md) on the device: the small model 6 steps with
# training.optimizer = muon in bf16 (its loss falls; the verbose timing line's optimizer part,
# Newton-Schulz included, against forward+backward), and in fp32 on the device against the CPU
# (4 steps at lr 1e-4: Newton-Schulz is bf16 on both, with other kernels, so the losses agree to
# the bf16 spread, not bitwise). Its time (~30 s) is a guess: it has not run on a GPU yet.
check_c4_muon() {
  section "c4 Muon on $DEV"
  time_for 30 c4-muon || return 0
  local m=(--debug "${SMALL[@]}" --set training.optimizer=muon --set logging.interval=1 --set logging.verbose=true
    --set logging.tensorboard=false --set "logging.dir=$RUNS" --set checkpoint.interval=0)
  run_logged c4-muon-bf16 180 "$BIN" train "${m[@]}" --set system.device=$DEV --set training.dtype=bf16 \
    --set training.learning_rate=3e-3 --max-steps 6 --set logging.run_name=muon-bf16
  rc=$?
  fall=$($PY -c 'import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
a, b = r[0]["loss"], r[-1]["loss"]
print(f"{a:.3f} -> {b:.3f}" if len(r) == 6 and b < a else "")' "$RUNS/muon-bf16/metrics.jsonl" 2>/dev/null)
  opt=$(grep -a "Timing per step" "$LOGS/c4-muon-bf16.log" | tail -1 | grep -o "forward+backward [0-9.]* ms.*optimizer [0-9.]* ms")
  if [ $rc -eq 0 ] && [ -n "$fall" ]; then
    result PASS c4-muon-bf16 "6 bf16 Muon steps on $DEV, loss $fall; last step: $opt"
  else
    result FAIL c4-muon-bf16 "exit $rc; loss ${fall:-did not fall}; $(why c4-muon-bf16)"
  fi
  for d in cpu $DEV; do
    run_logged "c4-muon-$d" 300 "$BIN" train "${m[@]}" --set system.device=$d --set training.dtype=fp32 \
      --set training.learning_rate=1e-4 --set training.min_lr=1e-5 --max-steps 4 --set logging.run_name="muon-$d"
  done
  eval "$($PY "$HERE/accept_lib.py" losses "$RUNS/muon-cpu/metrics.jsonl" "$RUNS/muon-$DEV/metrics.jsonl" 1 4 2>/dev/null || echo 'MISSING=all BITWISE=0 MAXREL=')"
  if [ -z "$MISSING" ] && awk -v x="${MAXREL:-1}" 'BEGIN { exit !(x <= 1e-3) }'; then
    result PASS c4-muon-fp32 "4 fp32 Muon steps, $DEV against the CPU: losses $([ "$BITWISE" = 1 ] && echo bitwise || echo "within $MAXREL (tol 1e-3: Newton-Schulz in bf16 on both)")"
  else
    result FAIL c4-muon-fp32 "missing steps: ${MISSING:-none}; max rel ${MAXREL:-?} (tol 1e-3); $(why c4-muon-$DEV)"
  fi
  rm -rf "$RUNS/muon-bf16" "$RUNS/muon-cpu" "$RUNS/muon-$DEV"
}

# c4-tasks: downstream evaluation (docs/evaluation.md) on the device. A small model trains 4
# steps with a task evaluated in training (data ranks together, the compute dtype); `eval
# --task` then scores its checkpoint on the CPU in fp32 and on the device in fp32 and bf16.
check_c4_tasks() {
  section "c4 downstream evaluation on $DEV against the CPU"
  time_for 60 c4-tasks || return 0
  local task=$WORK/hamlet_mc.jsonl name=hamlet_mc
  $PY "$HERE/accept_lib.py" mc-task "$ROOT/data/shakespeare/hamlet_gut.txt" "$task" 200 >"$LOGS/c4-tasks-file.log" 2>&1
  run_logged c4-tasks-train 240 "$BIN" train --debug "${SMALL[@]}" --set system.device=$DEV --set training.dtype=bf16 \
    --max-steps 4 --set training.eval_interval=2 --set "training.eval_tasks=$task" \
    --set "logging.dir=$RUNS" --set logging.run_name=tasks --set logging.tensorboard=false
  local rc=$? L=$LOGS/c4-tasks-train.log
  local line
  line=$(grep -a "Downstream | Step \[4/4\]" "$L" | tail -1 | sed 's/.*Downstream | //')
  local ck=$RUNS/tasks/checkpoints/step_4
  declare -A ACC
  for v in cpu:fp32 $DEV:fp32 $DEV:bf16; do
    d=${v%%:*} t=${v##*:}
    run_logged "c4-tasks-$d-$t" 240 "$BIN" eval --model "$ck" --task "$task" --json --device "$d" --dtype "$t" \
      --log-samples "$WORK/samples-$d-$t.jsonl"
    ACC[$v]=$($PY "$HERE/accept_lib.py" json-field "$LOGS/c4-tasks-$d-$t.log" acc acc_norm n)
  done
  # The training pass's own numbers for step 4, from metrics.jsonl.
  local trained
  trained=$($PY -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
m = [r for r in rows if r.get("step") == 4 and "eval" in r]
print("|".join(str(m[-1]["eval"][sys.argv[2]][k]) for k in ("acc", "acc_norm")) if m else "")' \
    "$RUNS/tasks/metrics.jsonl" "$name" 2>>"$L")
  if [ $rc -ne 0 ] || [ -z "$line" ] || [ -z "$trained" ] || [ -z "${ACC[cpu:fp32]}" ] || [ -z "${ACC[$DEV:fp32]}" ] || [ -z "${ACC[$DEV:bf16]}" ]; then
    result FAIL c4-tasks "train exit $rc, its Downstream line '${line:-missing}', metrics '${trained:-missing}'; eval cpu '${ACC[cpu:fp32]}' $DEV fp32 '${ACC[$DEV:fp32]}' bf16 '${ACC[$DEV:bf16]}'; $(why c4-tasks-train) $(why c4-tasks-$DEV-fp32)"
    rm -rf "$RUNS/tasks"
    return 0
  fi
  # mc_compare A B: N, MAXABS, MAXREL, SAME, SAME_NORM of two sample files (N=0 if it failed).
  mc_compare() {
    unset N MAXABS MAXREL SAME SAME_NORM
    eval "$($PY "$HERE/accept_lib.py" mc-compare "$1" "$2" 2>>"$LOGS/c4-tasks-file.log" ||
      echo 'N=0 MAXABS=inf MAXREL=inf SAME=-1 SAME_NORM=-1')"
  }
  mc_compare "$WORK/samples-cpu-fp32.jsonl" "$WORK/samples-$DEV-fp32.jsonl"
  local f32="$DEV fp32 vs cpu fp32: per-choice log-likelihood max abs $MAXABS, rel $MAXREL (tol 1e-4), same choice $SAME/$N, same norm choice $SAME_NORM/$N"
  local ok=1
  [ "$N" -gt 0 ] && awk -v r="$MAXREL" 'BEGIN { exit !(r + 0 < 1e-4) }' || ok=0
  [ "$SAME" = "$N" ] && [ "$SAME_NORM" = "$N" ] && [ "${ACC[cpu:fp32]}" = "${ACC[$DEV:fp32]}" ] || ok=0
  mc_compare "$WORK/samples-cpu-fp32.jsonl" "$WORK/samples-$DEV-bf16.jsonl"
  local bf="$DEV bf16 vs cpu fp32: max rel $MAXREL (tol 2e-2), same choice $SAME/$N"
  [ "$N" -gt 0 ] && awk -v r="$MAXREL" 'BEGIN { exit !(r + 0 < 2e-2) }' || ok=0
  # Training evaluates in its compute dtype (bf16) from the same weights as the checkpoint.
  local tb=${ACC[$DEV:bf16]%|*}
  local intrain="in training (bf16, step 4): acc|acc_norm $trained, eval --dtype bf16 ${tb}"
  [ "$trained" = "$tb" ] || intrain="$intrain DIFFERS"
  if [ "$ok" = 1 ] && [ "$trained" = "$tb" ]; then
    result PASS c4-tasks "$f32; $bf; $intrain; console: '$line'"
  else
    result FAIL c4-tasks "$f32; $bf; $intrain (acc|acc_norm|n cpu ${ACC[cpu:fp32]}, $DEV fp32 ${ACC[$DEV:fp32]})"
  fi
  rm -rf "$RUNS/tasks"
}

# c5: throughput of the 1B config against PyTorch on the same shapes, same machine, same call.
TOKJ=$WORK/byte_tokenizer.json
CFG1B=$ROOT/benches/gpu/llama-1b.json
prepare_1b() {
  [ -f "$TOKJ" ] || $PY "$HERE/byte_tokenizer.py" "$TOKJ" >>"$LOGS/c5-setup.log" 2>&1
  if [ "$DRY" = 1 ] && [ ! -f "$WORK/llama-1b-dry.json" ]; then
    $PY - "$CFG1B" "$WORK/llama-1b-dry.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["model"].update(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
c["training"].update(context_length=64, batch_size=2)
c["system"]["device"] = "cpu"
json.dump(c, open(sys.argv[2], "w"), indent=1)
EOF
  fi
  [ "$DRY" = 1 ] && CFG1B=$WORK/llama-1b-dry.json
  LS1B=(--config "$CFG1B" --set "data.tokenizer=$TOKJ" --set logging.interval=1 --set logging.memory_interval=0
    --set logging.tensorboard=false --set logging.verbose=true --set system.memory_check=warn
    --set training.max_steps=1000 --set training.eval_batches=0 --set "logging.dir=$RUNS")
}
STEPS5=$([ "$DRY" = 1 ] && echo 5 || echo 12)
declare -A LS_TOK LS_MFU PT_TOK PT_MFU
BEST_LS="" BEST_PT=""
check_c5_speed() {
  section "c5 throughput: benches/gpu/llama-1b.json, micro-batch $BATCHES"
  time_for 60 c5-lockstep || return 0
  prepare_1b
  fig=""
  for b in $BATCHES; do
    time_for 25 "c5-lockstep-b$b" || break
    mem_start "$LOGS/c5-mem-b$b.txt"
    train_until "c5-lockstep-b$b" "$STEPS5" 240 "$BIN" train "${LS1B[@]}" --set training.batch_size="$b" --set logging.run_name="ls-b$b"
    rc=$?
    mem_stop
    peak=$PEAK
    rm -rf "$RUNS/ls-b$b"
    if [ $rc -ne 0 ]; then
      fig="$fig b=$b: did not run (exit $rc: $(why "c5-lockstep-b$b" | cut -c1-160));"
      break
    fi
    eval "$($PY "$HERE/accept_lib.py" steplines "$LOGS/c5-lockstep-b$b.log" --skip 4)"
    if [ -z "$TOKS" ]; then
      fig="$fig b=$b: no step line after step 4 to time;"
      break
    fi
    LS_TOK[$b]=$TOKS LS_MFU[$b]=$MFU
    fig="$fig b=$b: $TOKS tok/s${MFU:+ MFU $MFU%}, peak $peak;"
    if [ -z "$BEST_LS" ] || [ "$TOKS" -gt "${LS_TOK[$BEST_LS]}" ]; then BEST_LS=$b; fi
  done
  fig=${fig# }
  if [ -n "$BEST_LS" ]; then result PASS c5-lockstep "${fig%;}"; else result FAIL c5-lockstep "${fig:-no run}"; fi

  if time_for 40 c5-eager; then
    fig=""
    for b in $BATCHES; do
      time_for 20 "c5-eager-b$b" || break
      run_logged "c5-eager-b$b" 240 "$PY" "$HERE/pytorch_step.py" "$CFG1B" --batch-size "$b" --device "$DEV" --json
      status=$($PY "$HERE/accept_lib.py" json-field "$LOGS/c5-eager-b$b.log" status)
      if [ "$status" != ok ]; then
        fig="$fig b=$b: ${status:-failed} $(why "c5-eager-b$b" | cut -c1-120);"
        break
      fi
      IFS='|' read -r tok mfu mem < <($PY "$HERE/accept_lib.py" json-field "$LOGS/c5-eager-b$b.log" tok_s mfu peak_reserved_gib)
      PT_TOK[$b]=$(printf '%.0f' "$tok") PT_MFU[$b]=$([ -n "$mfu" ] && awk -v m="$mfu" 'BEGIN { printf "%.1f", 100 * m }')
      fig="$fig b=$b: ${PT_TOK[$b]} tok/s${PT_MFU[$b]:+ MFU ${PT_MFU[$b]}%}${mem:+, peak reserved $(printf '%.1f' "$mem") GiB (NVML adds the context)};"
      if [ -z "$BEST_PT" ] || [ "${PT_TOK[$b]}" -gt "${PT_TOK[$BEST_PT]}" ]; then BEST_PT=$b; fi
    done
    fig=${fig# }
    if [ -n "$BEST_PT" ]; then result PASS c5-eager "${fig%;}"; else result FAIL c5-eager "${fig:-no run}"; fi
  fi
}
check_c5_compile() {
  section "c5 torch.compile at the largest micro-batch both ran; the goal"
  # torch.compile at the largest micro-batch both ran (compilation takes a minute or two).
  CB=""
  for b in $BATCHES; do [ -n "${LS_TOK[$b]:-}" ] && [ -n "${PT_TOK[$b]:-}" ] && CB=$b; done
  CT=""
  if [ "${ACCEPT_COMPILE:-1}" = 0 ]; then
    result SKIP c5-compile "ACCEPT_COMPILE=0"
  elif [ -z "$CB" ]; then
    result SKIP c5-compile "no micro-batch that both lockstep and eager ran (c5-speed, earlier in the same call)"
  elif time_for 90 c5-compile; then
    run_logged c5-compile 400 "$PY" "$HERE/pytorch_step.py" "$CFG1B" --batch-size "$CB" --device "$DEV" --compile --json
    status=$($PY "$HERE/accept_lib.py" json-field "$LOGS/c5-compile.log" status)
    if [ "$status" = ok ]; then
      IFS='|' read -r tok mfu warm < <($PY "$HERE/accept_lib.py" json-field "$LOGS/c5-compile.log" tok_s mfu warmup_s)
      CT=$(printf '%.0f' "$tok")
      result PASS c5-compile "b=$CB: $CT tok/s$([ -n "$mfu" ] && awk -v m="$mfu" 'BEGIN { printf " MFU %.1f%%", 100 * m }') (compile + 3 warm-up steps $(printf '%.0f' "$warm") s)"
    else
      result FAIL c5-compile "b=$CB: ${status:-failed}; $(why c5-compile)"
    fi
  fi

  if [ -n "$CB" ]; then
    ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
    fig="at b=$CB: lockstep ${LS_TOK[$CB]} tok/s = $(ratio "${LS_TOK[$CB]}" "${PT_TOK[$CB]}")x eager${CT:+, $(ratio "${LS_TOK[$CB]}" "$CT")x compile}"
    fig="$fig; best vs best: lockstep b=$BEST_LS ${LS_TOK[$BEST_LS]} / eager b=$BEST_PT ${PT_TOK[$BEST_PT]} = $(ratio "${LS_TOK[$BEST_LS]}" "${PT_TOK[$BEST_PT]}")x"
    mfu=${LS_MFU[$BEST_LS]:-}
    if [ -z "$mfu" ]; then
      result SKIP c5-goal "$fig; no MFU on the CPU (dry run) — goal: >= 45% MFU and >= 1.0x eager"
    elif awk -v m="$mfu" -v r="$(ratio "${LS_TOK[$BEST_LS]}" "${PT_TOK[$BEST_PT]}")" 'BEGIN { exit !(m >= 45 && r >= 1.0) }'; then
      result PASS c5-goal "$fig; MFU $mfu% (goal >= 45%, >= 1.0x eager: met)"
    else
      result FAIL c5-goal "$fig; MFU $mfu% (goal >= 45% and >= 1.0x eager: not met)"
    fi
  else
    result SKIP c5-goal "no micro-batch with both lockstep and eager figures"
  fi
}

# c7: one step profiled: per-phase times, host synchronisations per step.
check_c7_phases() {
  section "c7 profile: llama-1b.json at micro-batch $PROFILE_BATCH"
  time_for 25 c7-phases || return 0
  prepare_1b
  PB=(--set training.batch_size="$PROFILE_BATCH")
  train_until c7-plain 8 240 "$BIN" train "${LS1B[@]}" "${PB[@]}" --set logging.run_name=prof
  rc0=$?
  eval "$($PY "$HERE/accept_lib.py" steplines "$LOGS/c7-plain.log" --skip 3)"
  plain="data $T_DATA ms | forward+backward $T_FB ms | grad norm (+ all-reduce) $T_AR ms | optimizer $T_OPT ms ($TOKS tok/s)"
  CUDA_LAUNCH_BLOCKING=1 train_until c7-blocking 6 240 "$BIN" train "${LS1B[@]}" "${PB[@]}" --set logging.run_name=prof-blocking
  rc1=$?
  eval "$($PY "$HERE/accept_lib.py" steplines "$LOGS/c7-blocking.log" --skip 3)"
  blocking="data $T_DATA ms | forward+backward $T_FB ms | grad norm (+ all-reduce) $T_AR ms | optimizer $T_OPT ms ($TOKS tok/s)"
  if [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ]; then
    result PASS c7-phases "median per step, steps 4-8: $plain; with CUDA_LAUNCH_BLOCKING=1 (host waits for every kernel, so each phase's host time is its device time): $blocking"
  else
    result FAIL c7-phases "exit $rc0 / $rc1; $(why c7-plain) $(why c7-blocking)"
  fi
  LOCKSTEP_CUDA_SYNC_DEBUG=1 TORCH_CPP_LOG_LEVEL=WARNING train_until c7-syncs 8 240 "$BIN" train "${LS1B[@]}" "${PB[@]}" --set logging.run_name=prof-syncs
  rc=$?
  eval "$($PY "$HERE/accept_lib.py" syncs "$LOGS/c7-syncs.log" --skip 3)"
  if [ "$DRY" = 1 ]; then
    result SKIP c7-syncs "no CUDA in the dry run (the CPU never loads the CUDA backend; run exit $rc, $SYNCS warnings per step parsed from steps ${SYNC_LIST:-none})"
  elif [ $rc -eq 0 ] && [ "$ENABLED" = 1 ] && [ -n "$SYNCS" ]; then
    result PASS c7-syncs "$SYNCS host synchronisations per step (libtorch's sync debug mode, which PyTorch calls a prototype that does not see every synchronisation; steps 4-8: $SYNC_LIST)"
  else
    result FAIL c7-syncs "exit $rc; sync debug enabled: $ENABLED; $(grep -a 'LOCKSTEP_CUDA_SYNC_DEBUG' "$LOGS/c7-syncs.log" | head -1) $(why c7-syncs)"
  fi
  rm -rf "$RUNS/prof" "$RUNS/prof-blocking" "$RUNS/prof-syncs"
}
check_c7_kernels() {
  section "c7 GPU kernel time by kind: PyTorch eager and torch.compile at micro-batch $PROFILE_BATCH"
  prepare_1b
  # Where the time goes, kernel by kind, in PyTorch eager (the same ATen kernels lockstep calls,
  # at the same speed: c5) and under torch.compile: what compile's fusion takes off.
  if [ "$DRY" = 1 ]; then
    result SKIP c7-kernels "no CUDA kernels to profile in the dry run"
  elif time_for 80 c7-kernels; then
    local fig="" mode
    for mode in eager compile; do
      run_logged "c7-kernels-$mode" 240 "$PY" "$HERE/pytorch_step.py" "$CFG1B" --batch-size "$PROFILE_BATCH" --device "$DEV" \
        --steps 4 --profile --json $([ "$mode" = compile ] && echo --compile)
      fig="$fig $mode: $($PY "$HERE/accept_lib.py" json-field "$LOGS/c7-kernels-$mode.log" kernels_total_ms kernels_ms | tr -d '"{}' | sed 's/|/ ms a step: /');"
    done
    if grep -q kernels_ms "$LOGS/c7-kernels-eager.log"; then
      result PASS c7-kernels "GPU kernel time per step by kind at b=$PROFILE_BATCH (torch.profiler, ms):${fig%;}"
    else
      result FAIL c7-kernels "$(why c7-kernels-eager)"
    fi
  fi
}

# c6: the production preset (Llama-3.1-8B dimensions, 4 layers, context 8192).
check_c6() { # check_c6 NAME:KEY=VALUE,...  (NAME: the variant's name; an empty list: the preset)
  section "c6 production preset: 4 layers, context 8192, bf16 (${*%%:*})"
  PROD=(--preset production --set model.num_layers=4 "${SHRINK[@]}" --set system.device=$DEV --set training.dtype=bf16
    --set logging.interval=1 --set logging.memory_interval=0 --set logging.tensorboard=false --set logging.verbose=true
    --set system.memory_check=warn --set training.max_steps=1000 --set training.eval_batches=0 --set "logging.dir=$RUNS")
  for variant in "$@"; do
    name=${variant%%:*} sets=${variant#*:}
    time_for 15 "c6-$name" || break
    extra=()
    IFS=, read -ra kv <<<"$sets"
    for s in "${kv[@]}"; do [ -n "$s" ] && extra+=(--set "$s"); done
    "$BIN" plan "${PROD[@]}" "${extra[@]}" --json >"$LOGS/c6-plan-$name.json" 2>>"$LOGS/c6-plan-$name.log"
    planned=$($PY "$HERE/accept_lib.py" plan-total "$LOGS/c6-plan-$name.json" 2>/dev/null)
    mem_start "$LOGS/c6-mem-$name.txt"
    train_until "c6-$name" 8 200 "$BIN" train "${PROD[@]}" "${extra[@]}" --set logging.run_name="prod-$name"
    rc=$?
    mem_stop
    peak=$PEAK
    rm -rf "$RUNS/prod-$name"
    # The goal: the plan within 10% of the measured peak (NVML: the CUDA context and the
    # caching allocator's reserve included).
    off=$(awk -v p="$planned" -v m="$PEAK_GB" 'BEGIN { if (p != "" && m > 0) printf "%+.1f", 100 * (p - m) / m }')
    if [ $rc -eq 0 ] && [ -n "$off" ] && ! awk -v o="$off" 'BEGIN { exit !(o <= 10 && o >= -10) }'; then
      result FAIL "c6-$name" "${sets:-defaults}: plan ${planned} GB is ${off}% of the measured peak ${PEAK_GB} GB ($peak, NVML): outside the 10% goal"
    elif [ $rc -eq 0 ]; then
      eval "$($PY "$HERE/accept_lib.py" steplines "$LOGS/c6-$name.log" --skip 3)"
      result PASS "c6-$name" "${sets:-defaults (no checkpointing, loss chunks 1024, zero 0)}: $TOKS tok/s${MFU:+ MFU $MFU%}, peak GPU memory ${PEAK_GB:+$PEAK_GB GB = }$peak (NVML), plan ${planned:-?} GB (${off:-n/a}%, goal within 10%); fwd+bwd $T_FB ms, optimizer $T_OPT ms"
    else
      result FAIL "c6-$name" "${sets:-defaults}: exit $rc (plan ${planned:-?} GB); $(why "c6-$name")"
    fi
  done
}
check_c6_default() { check_c6 "default:"; }
check_c6_variants() {
  check_c6 "selective:training.activation_checkpointing=selective" "full:training.activation_checkpointing=full" \
    "chunk0:training.loss_chunk_tokens=0" "zero1:system.zero_stage=1" \
    "full-zero1:training.activation_checkpointing=full,system.zero_stage=1"
}

# c8: two ranks against one: the same global batch (2 x 1 sequences vs 1 x 2) gives the same
# losses, for each zero stage (3: the NCCL all-gathers of each unit's parameters and the
# per-unit reduce-scatters); on GPUs through NCCL, in the dry run through the TCP ring.
check_c8() {
  section "c8 two ranks against one"
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "$DRY" = 0 ] && [ "$ngpu" -lt 2 ]; then
    result SKIP c8-multi "needs 2 GPUs; this machine has $ngpu (NCCL refuses two ranks on one GPU). On a 2-GPU machine: bash benches/gpu/accept.sh multi"
  elif time_for 90 c8-multi; then
    if [ "$DRY" = 1 ]; then W1=(--cpu --nproc 1) W2=(--cpu --nproc 2); else W1=(--gpus 0) W2=(--gpus 0,1); fi
    M=(--debug "${SMALL[@]}" --set training.learning_rate=1e-4 --set training.min_lr=1e-5 --max-steps 8
      --set logging.interval=1 --set logging.tensorboard=false --set "logging.dir=$RUNS" --set checkpoint.interval=0)
    for dt in fp32 bf16; do
      run_logged "c8-w1-$dt" 180 "$BIN" run "${W1[@]}" -- "${M[@]}" --set training.dtype=$dt --set training.batch_size=2 \
        --set logging.run_name="w1-$dt"
      # z3h: stage 3 with hybrid sharding in groups of 1 (shard_degree=1): the subgroups (NCCL
      # communicators of one and of two ranks) and the replica all-reduce of the slices.
      for z in 0 1 2 3 3h; do
        # bf16 at stage 0 and at stage 3 (bf16 working weights gathered unit by unit).
        [ "$dt" = bf16 ] && [ "$z" = 1 -o "$z" = 2 ] && continue
        time_for 30 "c8-w2-z$z-$dt" || break
        hybrid=(); [ "$z" = 3h ] && hybrid=(--set system.shard_degree=1)
        run_logged "c8-w2-z$z-$dt" 180 "$BIN" run "${W2[@]}" -- "${M[@]}" --set training.dtype=$dt \
          --set training.batch_size=1 --set system.zero_stage=${z%h} "${hybrid[@]}" --set logging.run_name="w2-z$z-$dt"
        c8_verdict "w2-z$z-$dt" $? $dt "2 ranks x 1 vs 1 rank x 2, zero stage $z"
      done
      # Tensor and context parallelism (NCCL subgroups for the layers' collectives; the same
      # global batch of 2 sequences): TP 2 and CP 2 on 2 ranks (one data rank), and on 4 ranks
      # TP 2 x data 2 at stage 3 (the units' gathers on the data group, the layers'
      # collectives on the tensor group) and CP 2 x TP 2 (the K/V all-gathers and their
      # gradients' reduce-scatters on the context group, the efficient-attention kernel with
      # its log-sum-exp on CUDA).
      for mesh in tp2 tp2z3 cp2 cp2tp2; do
        case $mesh in
          tp2) n=2 sets=(--set system.tensor_parallel=2 --set training.batch_size=2) ;;
          tp2z3) n=4 sets=(--set system.tensor_parallel=2 --set training.batch_size=1 --set system.zero_stage=3) ;;
          cp2) n=2 sets=(--set system.context_parallel=2 --set training.batch_size=2) ;;
          cp2tp2) n=4 sets=(--set system.context_parallel=2 --set system.tensor_parallel=2 --set training.batch_size=2) ;;
        esac
        if [ "$DRY" = 0 ] && [ "$ngpu" -lt "$n" ]; then
          result SKIP "c8-$mesh-$dt" "needs $n GPUs; this machine has $ngpu"
          continue
        fi
        if [ "$DRY" = 1 ]; then W=(--cpu --nproc "$n"); else W=(--gpus "$(seq -s, 0 $((n - 1)))"); fi
        time_for 30 "c8-$mesh-$dt" || break
        run_logged "c8-$mesh-$dt" 180 "$BIN" run "${W[@]}" -- "${M[@]}" --set training.dtype=$dt \
          "${sets[@]}" --set logging.run_name="$mesh-$dt"
        c8_verdict "$mesh-$dt" $? $dt "${W[*]}, ${sets[*]} vs 1 rank x 2"
      done
      # Expert parallelism (a Qwen3-MoE of 4 experts, the load-balancing loss off so the
      # micro-batches' split does not matter): EP 2 on 2 ranks, the tokens' all-to-alls on
      # NCCL, against the same MoE on 1 rank x 2.
      if [ "$dt" = fp32 ] && { [ "$DRY" = 1 ] || [ "$ngpu" -ge 2 ]; } && time_for 40 "c8-ep2-$dt"; then
        MOE=(--set model.architecture=qwen3_moe --set model.num_experts=4 --set model.moe_intermediate_size=64
          --set model.router_aux_loss_coef=0)
        run_logged "c8-w1-moe-$dt" 180 "$BIN" run "${W1[@]}" -- "${M[@]}" "${MOE[@]}" --set training.dtype=$dt \
          --set training.batch_size=2 --set logging.run_name="w1-moe-$dt"
        run_logged "c8-ep2-$dt" 180 "$BIN" run "${W2[@]}" -- "${M[@]}" "${MOE[@]}" --set training.dtype=$dt \
          --set training.batch_size=1 --set system.expert_parallel=2 --set logging.run_name="ep2-$dt"
        c8_verdict "ep2-$dt" $? $dt "2 ranks x 1 at expert_parallel=2 vs 1 rank x 2 (Qwen3-MoE)" "w1-moe-$dt"
        rm -rf "$RUNS/w1-moe-$dt"
      fi
      # Muon at zero stage 2 (docs/optimizers.md): the matrices straddling the two slices, and
      # those that share the work, assembled by bf16 all-to-alls on NCCL, against Muon on 1
      # rank x 2. Newton-Schulz rounds to bf16, so the losses agree to its spread, not bitwise.
      if [ "$dt" = fp32 ] && time_for 40 "c8-muon-z2-$dt"; then
        run_logged "c8-w1-muon-$dt" 180 "$BIN" run "${W1[@]}" -- "${M[@]}" --set training.optimizer=muon \
          --set training.dtype=$dt --set training.batch_size=2 --set logging.run_name="w1-muon-$dt"
        run_logged "c8-muon-z2-$dt" 180 "$BIN" run "${W2[@]}" -- "${M[@]}" --set training.optimizer=muon \
          --set training.dtype=$dt --set training.batch_size=1 --set system.zero_stage=2 --set logging.run_name="muon-z2-$dt"
        c8_verdict "muon-z2-$dt" $? $dt "Muon, 2 ranks x 1 at zero stage 2 vs 1 rank x 2" "w1-muon-$dt"
        rm -rf "$RUNS/w1-muon-$dt"
      fi
      rm -rf "$RUNS/w1-$dt"
    done
  fi
}

# c8's verdict on run NAME (exit RC, dtype DT) against one rank's losses (those of run REF,
# default w1-DT): PASS within the dtype's tolerance, with WHAT and the collectives the run
# used, else FAIL with why.
c8_verdict() {
  local name=$1 rc=$2 dt=$3 what=$4 ref=${5:-w1-$3}
  eval "$($PY "$HERE/accept_lib.py" losses "$RUNS/$ref/metrics.jsonl" "$RUNS/$name/metrics.jsonl" 1 8 2>/dev/null || echo 'MISSING=all BITWISE=0 MAXREL=')"
  local tol backend
  tol=$([ "$dt" = fp32 ] && echo 1e-4 || echo 1e-2)
  backend=$(grep -ao "Collectives: .*" "$LOGS/c8-$name.log" | head -1)
  if [ "$rc" -eq 0 ] && [ -z "$MISSING" ] && awk -v x="${MAXREL:-1}" -v t="$tol" 'BEGIN { exit !(x <= t) }'; then
    result PASS "c8-$name" "$what, $dt: losses of 8 steps $([ "$BITWISE" = 1 ] && echo bitwise || echo "within $MAXREL (tol $tol)"); ${backend:-TCP ring (CPU)}"
  else
    result FAIL "c8-$name" "exit $rc; missing steps: ${MISSING:-none}; max rel ${MAXREL:-?} (tol $tol); $(why "c8-$name")"
  fi
  rm -rf "${RUNS:?}/$name"
}

# c9: the pip wheel on this machine (issue 34's `pip install lockstep-*.whl`, docs/install.md):
# scripts/wheel.sh's manylinux binary, not the release build the other checks run. pip judges its
# pin (torch==2.11.*) against this machine's CUDA torch, installs it into a folder of its own
# beside a link to that torch (site-packages' layout, nothing of the machine's Python changed),
# and it runs from an empty directory in the caller's environment, without the torch lib this
# script puts on LD_LIBRARY_PATH: the launcher (`python -m lockstep`, the `lockstep` console
# script) and the binary alone through its RUNPATH ($ORIGIN/../../torch/lib) each find torch's
# libraries and load its CUDA backend; a short bf16 run trains on the GPU and samples.
check_c9_wheel() {
  section "c9 the pip wheel beside this machine's torch"
  time_for 20 c9-wheel || return 0
  local whl site=$WORK/wheel-site dir=$WORK/wheel-work
  whl=$(ls "$WORK"/bin/lockstep-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ]; then
    result SKIP c9-wheel "no wheel in .carry (prepare.sh --no-wheel): bash benches/gpu/prepare.sh packs one"
    return 0
  fi
  rm -rf "$site" "$dir" && mkdir -p "$dir"
  # The caller's environment with no libtorch on LD_LIBRARY_PATH (each folder holding one
  # dropped); the wheel's folder on PYTHONPATH, as site-packages would be. Run from $dir
  # (subshells: the `cd` stays there).
  local ldp="" part parts=()
  [ "$LDP_CALLER" = unset ] || IFS=: read -ra parts <<<"$LDP_CALLER"
  for part in "${parts[@]}"; do [ -e "$part/libtorch_cpu.so" ] || ldp="${ldp:+$ldp:}$part"; done
  local as_user=(env -u LD_LIBRARY_PATH PYTHONPATH="$site")
  [ -n "$ldp" ] && as_user=(env LD_LIBRARY_PATH="$ldp" PYTHONPATH="$site")
  user_run() { (cd "$dir" && run_logged "$1" "$2" "${as_user[@]}" "${@:3}"); } # NAME TIMEOUT CMD...
  local fail=""
  local pip=("$PY" -m pip install --disable-pip-version-check --no-index) pin
  run_logged c9-pip-resolve 120 "${pip[@]}" --dry-run "$whl" &&
    run_logged c9-pip-install 120 "${pip[@]}" --no-deps --no-compile --target "$site" "$whl" ||
    fail="pip: $(cat "$LOGS"/c9-pip-*.log | grep -aiE 'error|requires|conflict' | head -2 | tr '\n' ' ')"
  pin=$(grep -ao "Requirement already satisfied: torch==2.11.* in .* (from lockstep.*) ([^)]*)" "$LOGS/c9-pip-resolve.log" |
    head -1 | sed 's/.*(\([^)]*\))$/torch \1 for its torch==2.11.*/')
  if [ -z "$fail" ] && { [ -z "$pin" ] || ! grep -q "Would install lockstep-" "$LOGS/c9-pip-resolve.log"; }; then
    fail="pip --dry-run did not take torch $($PY -c 'import torch; print(torch.__version__)' 2>&1) for the wheel's pin: $(grep -a 'torch' "$LOGS/c9-pip-resolve.log" | head -2 | tr '\n' ' ')"
  fi
  if [ -z "$fail" ]; then
    # Control: without torch beside it, the binary alone finds no libtorch (so LD_LIBRARY_PATH
    # really lacks it, and what finds it below is the RUNPATH).
    user_run c9-env-alone 60 "$site/lockstep/bin/lockstep" --version &&
      fail="the binary started with no torch beside it (LD_LIBRARY_PATH=$ldp): what finds libtorch is not its RUNPATH"
    ln -s "$(dirname "$TORCH_LIB")" "$site/torch"
    # env through the launcher and through the binary's RUNPATH alone: the same libtorch, and
    # on a GPU the CUDA backend loaded (torch's runtime and NCCL, the driver, GPU 0).
    user_run c9-env-launcher 60 "$PY" -m lockstep env || fail="python -m lockstep env: exit $?"
    user_run c9-env-runpath 60 "$site/lockstep/bin/lockstep" env || fail="${fail:+$fail; }lockstep/bin/lockstep env: exit $?"
    # (`lockstep env` names the library's canonical path: the link's target.)
    local want
    want=$(realpath "$TORCH_LIB")/libtorch_cpu.so
    for how in launcher runpath; do
      local L=$LOGS/c9-env-$how.log
      grep -qF "(CUDA" "$L" && grep -q "^libtorch   2\.11\.[0-9]* (.*) from $want" "$L" ||
        fail="${fail:+$fail; }$how: not the torch beside it: $(grep -a '^libtorch' "$L")"
      if [ "$DRY" = 0 ] && ! env_agrees "$L"; then
        fail="${fail:+$fail; }$how: not torch's CUDA $CUDA_WANT / NCCL $NCCL_WANT: $(grep -aE '^(CUDA|NCCL|driver|GPU)' "$L" | tr -s ' ' | tr '\n' ';')"
      fi
    done
  fi
  if [ -z "$fail" ]; then
    # The console script pip wrote (its shebang: this machine's Python), the demo's preset.
    user_run c9-train 180 "$site/bin/lockstep" run "${RUNDEV[@]}" -- --preset tiny --max-steps 30 \
      --set training.dtype=bf16 --set logging.tensorboard=false
    local rc=$? L=$LOGS/c9-train.log first last
    first=$(grep -ao "$TAG Step \[1/30\] | Loss: [0-9.]*" "$L" | sed 's/.*Loss: //')
    last=$(grep -ao "$TAG Step \[30/30\] | Loss: [0-9.]*" "$L" | sed 's/.*Loss: //')
    if [ $rc -ne 0 ] || [ -z "$last" ] || ! awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 1) }'; then
      fail="train: exit $rc, loss ${first:-?} -> ${last:-?} (30 steps); $(why c9-train)"
    else
      user_run c9-generate 120 "$site/bin/lockstep" generate --device "$DEV" \
        --model runs/tiny/checkpoints/step_30 --prompt "The" --max-new-tokens 16 ||
        fail="generate: exit $?; $(why c9-generate)"
    fi
  fi
  if [ -n "$fail" ]; then
    result FAIL c9-wheel "$(basename "$whl"): $fail"
  else
    local gpuline run
    gpuline=$(grep -E '^(libtorch|CUDA|GPU) ' "$LOGS/c9-env-runpath.log" | tr -s ' ' | tr '\n' ';' | cut -c1-240)
    run=$(grep -a "$TAG Run:" "$LOGS/c9-train.log" | head -1 | sed 's/.*| 1 rank | //')
    result PASS c9-wheel "$(basename "$whl"): pip took $pin; launcher and RUNPATH alone: $gpuline; the console script trained the tiny preset ('$run') loss $first -> $last in 30 steps, then generated on $DEV: $(grep -ao '^\[generate\] .*' "$LOGS/c9-generate.log" | tail -1 | sed 's/.*| //')"
  fi
}

# ---------------------------------------------------------------------------------------------
for step in "${STEPS[@]}"; do
  case $step in
    c3-* | c4-*) ;;
    *) rm -rf "$RUNS/full/checkpoints" ;; # ~10 GB of the GPU machine's disk; only c3 and c4 read it
  esac
  "check_${step//-/_}"
done

[ "$NFAIL" -eq 0 ]
