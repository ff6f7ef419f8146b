# Sourced by the other scripts and by job scripts (`source scripts/env.sh` in an sbatch file):
# makes the project-local venv (which provides libtorch) the one torch-sys builds against, and
# creates it on first use. It leaves the caller's shell options as they were (no `set -e` or
# pipefail leaks into a job script); the scripts that want them set them themselves.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
REQ="$ROOT/scripts/requirements.txt"
STAMP="$VENV/.lockstep-requirements"
# A venv made before this script used uv has none (scripts/wheel_test.sh installs with it too):
# it goes through the same install, which finds the requirements already there.
if [ ! -x "$VENV/bin/uv" ] || ! cmp -s "$REQ" "$STAMP"; then
  echo "lockstep: installing the Python side (torch, transformers) into $VENV; first time only, ~1 min" >&2
  # uv (from PyPI, into the venv) rather than pip: it downloads and unpacks in parallel; the
  # 5.4 GB of scripts/requirements.txt took 55 s against pip's 256 s (BENCHMARKS.md §18).
  if ! { python3 -m venv "$VENV" \
      && { [ -x "$VENV/bin/uv" ] || "$VENV/bin/pip" install -q uv==0.13.9; } \
      && "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -r "$REQ" \
      && cp "$REQ" "$STAMP"; }; then
    echo "lockstep: installing $VENV failed (see uv's output above)" >&2
    # `return` when sourced, `exit` when run.
    return 1 2>/dev/null || exit 1
  fi
fi
export VIRTUAL_ENV="$VENV"
export PATH="$VENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
# Two-core machines are the norm here; a passive OpenMP wait keeps idle threads from spinning.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
