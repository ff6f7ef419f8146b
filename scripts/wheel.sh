#!/usr/bin/env bash
# Builds target/wheels/lockstep-<version>-py3-none-<platform>.whl: the release binary linked
# against glibc 2.28 (scripts/build-manylinux.sh: cargo-zigbuild; ~7 min the first time, nothing
# to build after scripts/test.sh, which builds and tests that same binary), debug
# info stripped, symbols kept for backtraces, inside the `lockstep` Python package, with the
# launcher that finds this environment's torch (python/lockstep/__main__.py), the `lockstep`
# command, `Requires-Dist: torch==2.11.*` and the extra `lockstep[wandb]`.
#
# The platform tag is the one `auditwheel show` reads off the binary's symbol versions, never
# a wish; libtorch_cpu/libc10 come from the torch wheel at run time, as torchvision's do.
# The binary must not link a CUDA library (CUDA is dlopen'ed through libtorch_cuda), so one
# wheel serves torch's cu126, cu128 and cu130 builds: checked here with readelf.
#
#   bash scripts/wheel.sh            # builds, prints the wheel's path last
#   pip install target/wheels/lockstep-*.whl
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
set -euo pipefail

bash scripts/build-manylinux.sh --bin lockstep
BIN=target/x86_64-unknown-linux-gnu/release/lockstep
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
# The commit the binary says it was built from (build.rs: `git rev-parse`, `+modified`).
COMMIT=$("$BIN" --version | sed -n 's/.*(commit \(.*\))$/\1/p')

# A library the binary must never need: any CUDA one ties the wheel to one CUDA build. The NCCL
# shim it embeds (loaded on GPU ranks only) may need libtorch_cuda, never the CUDA runtime or
# NCCL themselves (their sonames differ between cu12x and cu130 builds).
if readelf -d "$BIN" | grep -E 'NEEDED.*(libcuda|libcudart|libnccl|libcublas|libcudnn|libnvrtc|libtorch_cuda|libc10_cuda)'; then
  echo "wheel.sh: $BIN links a CUDA library (above): it would run on one CUDA build of torch only" >&2
  exit 1
fi
SHIM=$(ls -t target/x86_64-unknown-linux-gnu/release/build/lockstep-*/out/liblockstep_nccl.so 2>/dev/null | head -1)
if [ -z "$SHIM" ]; then
  echo "wheel.sh: the build made no NCCL shim (see build.rs's warning): the wheel would have no NCCL backend" >&2
  exit 1
fi
if readelf -d "$SHIM" | grep -E 'NEEDED.*(libcuda\.|libcudart|libnccl|libcublas|libcudnn|libnvrtc)'; then
  echo "wheel.sh: the NCCL shim $SHIM links a CUDA library (above)" >&2
  exit 1
fi

OUT=target/wheels
mkdir -p "$OUT"
STAGE=$(mktemp -d "$OUT/.stage.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
PKG="$STAGE/lockstep"
DIST="$STAGE/lockstep-$VERSION.dist-info"
mkdir -p "$PKG/bin" "$DIST"
cp python/lockstep/__init__.py python/lockstep/__main__.py "$PKG/"
printf 'VERSION = "%s"\nCOMMIT = "%s"\n' "$VERSION" "$COMMIT" > "$PKG/_build.py"
strip --strip-debug -o "$PKG/bin/lockstep" "$BIN"
# site-packages/lockstep/bin/lockstep → site-packages/torch/lib; replaces the build venv's
# absolute path.
patchelf --set-rpath '$ORIGIN/../../torch/lib' "$PKG/bin/lockstep"
chmod 755 "$PKG/bin/lockstep"

cat > "$DIST/METADATA" <<EOF
Metadata-Version: 2.1
Name: lockstep
Version: $VERSION
Summary: Multi-GPU LLaMA pretraining on libtorch: one binary to prepare data, train, and launch ranks
License: Apache-2.0
Requires-Python: >=3.9
Requires-Dist: torch==2.11.*
Provides-Extra: wandb
Requires-Dist: wandb>=0.31; extra == "wandb"
Description-Content-Type: text/markdown

lockstep $VERSION (commit $COMMIT). Needs torch 2.11 (any CUDA build: cu126, cu128, cu130)
from the same environment; \`lockstep env\` shows what it found.
EOF
cat > "$DIST/entry_points.txt" <<EOF
[console_scripts]
lockstep = lockstep.__main__:main
EOF
# A first tag that claims nothing; auditwheel reads the real one off the binary below.
cat > "$DIST/WHEEL" <<EOF
Wheel-Version: 1.0
Generator: lockstep scripts/wheel.sh
Root-Is-Purelib: false
Tag: py3-none-linux_x86_64
EOF
rm -f "$OUT"/lockstep-"$VERSION"-*.whl
python -m wheel pack "$STAGE" -d "$OUT" >/dev/null
RAW="$OUT/lockstep-$VERSION-py3-none-linux_x86_64.whl"

# auditwheel resolves libtorch through LD_LIBRARY_PATH and judges only the system libraries
# (glibc, libstdc++, libgcc_s) by their symbol versions; libtorch's own are torch's business.
TORCH_LIB=$(python -c 'import os, importlib.util as u; print(os.path.join(u.find_spec("torch").submodule_search_locations[0], "lib"))')
SHOW=$(LD_LIBRARY_PATH="$TORCH_LIB" auditwheel show "$RAW" 2>&1 || true)
TAG=$(printf '%s\n' "$SHOW" | grep -o 'manylinux_2_[0-9]*_x86_64' | head -1)
if [ -z "$TAG" ]; then
  printf '%s\n' "$SHOW" >&2
  echo "wheel.sh: auditwheel named no manylinux tag for the binary (its output is above)" >&2
  exit 1
fi
python -m wheel tags --remove --platform-tag "$TAG" "$RAW" >/dev/null
WHEEL="$OUT/lockstep-$VERSION-py3-none-$TAG.whl"
echo "wheel.sh: the binary needs $(printf '%s\n' "$SHOW" | grep -o 'GLIBC_2\.[0-9]*' | sort -V | tail -1) at most: $TAG" >&2
ls -l "$WHEEL" >&2
echo "$WHEEL"
