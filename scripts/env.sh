# Sourced by the other scripts and by job scripts (`source scripts/env.sh` in an sbatch file):
# makes the project-local venv (which provides libtorch) the one torch-sys builds against, and
# creates it on first use. It leaves the caller's shell options as they were (no `set -e` or
# pipefail leaks into a job script); the scripts that want them set them themselves.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
REQ="$ROOT/scripts/requirements.txt"
STAMP="$VENV/.lockstep-requirements"
if [ ! -x "$VENV/bin/python" ] || ! cmp -s "$REQ" "$STAMP"; then
  echo "lockstep: installing the Python side (torch, transformers) into $VENV; first time only, ~3 min" >&2
  if ! { python3 -m venv "$VENV" \
      && "$VENV/bin/pip" install -q --upgrade pip \
      && "$VENV/bin/pip" install -q -r "$REQ" \
      && cp "$REQ" "$STAMP"; }; then
    echo "lockstep: installing $VENV failed (see pip's output above)" >&2
    # `return` when sourced, `exit` when run.
    return 1 2>/dev/null || exit 1
  fi
fi
export VIRTUAL_ENV="$VENV"
export PATH="$VENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
# Two-core machines are the norm here; a passive OpenMP wait keeps idle threads from spinning.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
