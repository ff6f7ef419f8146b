#!/usr/bin/env bash
# The wheel as a user gets it (scripts/test.sh runs this after the Rust tests; CI with it):
# built by scripts/wheel.sh, installed into a fresh venv (torch comes from the package index
# as its dependency), then run from an empty directory with a
# clean environment and no cargo on PATH. Then the bad installs: no torch, torch 2.10, a
# broken torch, torch deleted after the install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEEL=$(bash "$ROOT/scripts/wheel.sh" | tail -1)
WHEEL=$(realpath "$WHEEL")
# The tag auditwheel read off the binary: glibc 2.28 (RHEL/Rocky 8) and newer.
[[ "$WHEEL" == *-py3-none-manylinux_2_28_x86_64.whl ]] || { echo "wheel_test: FAILED: not manylinux_2_28: $WHEEL" >&2; exit 1; }
T=$(mktemp -d /tmp/lockstep-wheel.XXXXXX)
trap 'rm -rf "$T"' EXIT
PY=$(command -v python3)
fail() { echo "wheel_test: FAILED: $*" >&2; exit 1; }
# A command in a clean environment: no cargo, no venv, no LD_LIBRARY_PATH, from $T/work.
clean() { (cd "$T/work" && env -i HOME="$T/home" PATH="$1/bin:/usr/bin:/bin" "${@:2}"); }
# Expects the command to fail with exit code 2 and one stderr line holding each pattern.
refuses() {
  local venv=$1 want=$2; shift 2
  local rc=0 err
  err=$(clean "$venv" lockstep "$@" 2>&1 >/dev/null) || rc=$?
  [ "$rc" = 2 ] || fail "exit $rc, not 2, for '$want' ($err)"
  [ "$(printf '%s\n' "$err" | wc -l)" = 1 ] || fail "more than one line for '$want': $err"
  printf '%s\n' "$err" | grep -qF -- "$want" || fail "no '$want' in: $err"
  printf '%s\n' "$err" | grep -qF -- 'pip install' || fail "no fix in: $err"
  echo "wheel_test: refused as expected: $err"
}
mkdir -p "$T/work" "$T/home"

# 1. The binary links no CUDA library (one wheel for torch's cu126, cu128 and cu130 builds)
# and finds torch beside itself.
"$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("lockstep/bin/lockstep", sys.argv[2])' "$WHEEL" "$T/unpacked"
DYN=$(readelf -d "$T/unpacked/lockstep/bin/lockstep")
if printf '%s\n' "$DYN" | grep -E 'NEEDED.*(libcuda|libcudart|libnccl|libcublas|libcudnn)'; then
  fail "the wheel's binary links a CUDA library (above)"
fi
printf '%s\n' "$DYN" | grep -q 'RUNPATH.*\[\$ORIGIN/../../torch/lib\]' || fail "RUNPATH: $DYN"
echo "wheel_test: the binary NEEDs $(printf '%s\n' "$DYN" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')"

# 2. A fresh venv; torch 2.11 arrives as the wheel's dependency. Installed by uv (the project
# venv's, scripts/env.sh) from the cache that venv's install filled, where pip would download
# torch's 5 GB again (CI starts with no pip cache); the wheel's requirements are read the same
# way, and pip's own refusal of the wheel beside torch 2.10 is checked with pip below.
uv_install() { # VENV, requirement: uv pip install into that venv
  "$ROOT/.venv/bin/uv" pip install -q --python "$1/bin/python" "$2"
}
"$PY" -m venv "$T/venv"
START=$(date +%s)
uv_install "$T/venv" "$WHEEL"
echo "wheel_test: the install took $(( $(date +%s) - START )) s"
clean "$T/venv" sh -c '! command -v cargo' || fail "cargo is on the clean PATH"
ENV_OUT=$(clean "$T/venv" lockstep env)
echo "$ENV_OUT"
echo "$ENV_OUT" | grep -q "^libtorch   2.11.0 (CUDA .* build) from $T/venv/lib/python3.*/site-packages/torch/lib/libtorch_cpu.so" \
  || fail "lockstep env did not find the venv's torch"
echo "$ENV_OUT" | grep -q "^W&B Python $T/venv/bin/python" || fail "W&B Python is not the venv's"
V=$(clean "$T/venv" python -m lockstep --version)
[[ "$V" == "lockstep "*" (commit "* ]] || fail "python -m lockstep --version: $V"
[ "$V" = "$(clean "$T/venv" lockstep --version)" ] || fail "the two ways in disagree"
clean "$T/venv" lockstep prepare --preset tiny
clean "$T/venv" lockstep train --preset tiny --max-steps 3
clean "$T/venv" lockstep export --hf exports/tiny --checkpoint runs/tiny/checkpoints/step_3
[ -f "$T/work/exports/tiny/config.json" ] && [ -f "$T/work/exports/tiny/model.safetensors" ] \
  || fail "export wrote no Hugging Face directory"

# 3. The W&B sidecar runs on this environment's Python: without wandb, training goes on with
# a warning naming that Python; with the extra installed it logs.
WB=(--preset tiny --max-steps 2 --set logging.wandb.project=wheel --set logging.wandb.mode=offline)
out=$(clean "$T/venv" lockstep train "${WB[@]}" --set checkpoint.dir=ckpt-a 2>&1) \
  || fail "W&B without the wandb package stopped training: $out"
printf '%s\n' "$out" | grep -qE "W&B: the Python at $T/venv/bin/python[0-9.]* cannot import wandb" \
  || fail "W&B without the wandb package: no warning naming the venv's Python: $out"
uv_install "$T/venv" "lockstep[wandb] @ file://$WHEEL"
clean "$T/venv" lockstep train "${WB[@]}" --set checkpoint.dir=ckpt-b
ls "$T"/work/runs/tiny/wandb/offline-run-*/run-*.wandb >/dev/null || fail "no offline W&B run"

# 4. Bad installs: each a one-line message with the fix, never a loader error.
"$PY" -m venv "$T/bare"
"$T/bare/bin/pip" install -q --no-deps "$WHEEL"
refuses "$T/bare" "torch is not installed in this Python environment" --version
SITE=$("$T/bare/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
fake_torch() { # version
  rm -rf "$SITE"/torch "$SITE"/torch-*.dist-info
  mkdir -p "$SITE/torch" "$SITE/torch-$1.dist-info"
  echo "__version__ = '$1+cu128'" > "$SITE/torch/version.py"
  touch "$SITE/torch/__init__.py"
  printf 'Metadata-Version: 2.1\nName: torch\nVersion: %s\n' "$1" > "$SITE/torch-$1.dist-info/METADATA"
  : > "$SITE/torch-$1.dist-info/RECORD"
}
fake_torch 2.10.0
refuses "$T/bare" "has torch 2.10.0+cu128" train --preset tiny
fake_torch 2.11.0
refuses "$T/bare" "libtorch_cpu.so is missing" env
# pip itself refuses the wheel beside torch 2.10 (the pin), rather than installing it.
fake_torch 2.10.0
"$T/bare/bin/pip" uninstall -q -y lockstep
rc=0; err=$("$T/bare/bin/pip" install --no-index "$WHEEL" 2>&1) || rc=$?
[ "$rc" != 0 ] && printf '%s\n' "$err" | grep -qF 'torch==2.11' || fail "pip installed beside torch 2.10: $err"
echo "wheel_test: pip refused: $(printf '%s\n' "$err" | grep -F 'torch==2.11' | head -1)"
# torch uninstalled after lockstep was installed.
"$T/venv/bin/pip" uninstall -q -y torch
refuses "$T/venv" "torch is not installed in this Python environment" train --preset tiny
echo "wheel_test: passed"
