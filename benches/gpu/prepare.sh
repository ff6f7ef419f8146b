#!/usr/bin/env bash
# Runs HERE (the build machine, no GPU): builds the release binaries and packs what the GPU
# machine needs into .carry/ (git-ignored), which the device tool's `run` carries with
# carry [".carry"]. The GPU machine has torch 2.11 (CUDA) + transformers but no Rust and no
# network; benches/gpu/accept.sh runs there from this.
#
#   .carry/binaries.tar.xz    the CLI `lockstep` and the library's unit-test binary
#                             `lockstep-unit` (NCCL group, model tests on CUDA), debug info
#                             stripped (objcopy --strip-debug), in one xz archive whose window
#                             spans both: they share ~47 MB of embedded BPE dictionaries
#                             (bpe-openai's cl100k/o200k), stored once (two gzip files: 69 MiB,
#                             over the limit; this: ~25 MiB). accept.sh unpacks it with Python's
#                             tarfile (the GPU machine has no guaranteed `xz`).
#                             It also holds the pip wheel (scripts/wheel.sh: the manylinux
#                             binary and its Python launcher) re-zipped with its entries stored,
#                             not deflated: the same files, so pip installs the same thing, while
#                             xz sees the wheel's binary and stores its copy of the dictionaries
#                             once too (accept.sh's c9-wheel installs it on the GPU machine).
#   .carry/<name>.sha256      each packed file's checksum
#   .carry/build-info.json    the torch build the binaries were compiled against (accept.sh
#                             refuses a GPU machine whose torch differs: an NCCL/ABI mismatch
#                             segfaults rather than erroring), the commit, checksums
#
# Everything that travels (tracked + untracked-not-ignored files + .carry) must stay under the
# device tool's 64 MiB; this script fails loudly otherwise.
#
# usage: bash benches/gpu/prepare.sh [--no-build] [--no-wheel]
#   --no-build   packs what target/ holds (the newest wheel in target/wheels must be of the same
#                commit as target/release/lockstep)
#   --no-wheel   packs no wheel (accept.sh's c9-wheel is then a SKIP)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
LIMIT=$((64 * 1024 * 1024))
die() { echo "prepare.sh: $*" >&2; exit 1; }

# shellcheck disable=SC1091
source scripts/env.sh || die "scripts/env.sh failed"
set +e  # every step below checks its own status

git check-ignore -q .carry || die ".carry is not git-ignored: add /.carry to .gitignore (it must not be committed)"
mkdir -p .carry

BUILD=1 WHEEL=1
for arg in "$@"; do
  case "$arg" in
    --no-build) BUILD=0 ;;
    --no-wheel) WHEEL=0 ;;
    *) die "unknown argument '$arg' (--no-build, --no-wheel)" ;;
  esac
done
if [ "$BUILD" = 1 ]; then
  echo "== cargo build --release --all-targets"
  cargo build --release --all-targets || die "cargo build failed"
fi
unit=$(cargo test --release --lib --no-run --message-format=json 2>/dev/null |
  jq -r 'select(.profile.test and .target.kind == ["lib"]) | .executable' | tail -1)
[ -n "$unit" ] && [ -x "$unit" ] || die "cannot find the lib unit-test binary (cargo test --release --lib --no-run)"
[ -x target/release/lockstep ] || die "target/release/lockstep missing"
wheel=
if [ "$WHEEL" = 1 ]; then
  if [ "$BUILD" = 1 ]; then
    echo "== bash scripts/wheel.sh (the manylinux build: ~7 min the first time, less after)"
    wheel=$(bash scripts/wheel.sh | tail -1) || die "scripts/wheel.sh failed (or: --no-wheel)"
  else
    wheel=$(ls -t target/wheels/lockstep-*.whl 2>/dev/null | head -1)
  fi
  [ -f "$wheel" ] || die "no wheel in target/wheels: run without --no-build, or pass --no-wheel"
  # The wheel's commit (its _build.py) must be the release binary's: one build, one report.
  built=$(python -c 'import re, sys, zipfile; print(re.search(r"COMMIT = \"(.*)\"", zipfile.ZipFile(sys.argv[1]).read("lockstep/_build.py").decode()).group(1))' "$wheel")
  [[ "$(target/release/lockstep --version)" == *"(commit $built)" ]] ||
    die "$wheel is of commit $built, target/release/lockstep is $(target/release/lockstep --version): run without --no-build"
fi

echo "== packing into .carry/ (xz over the binaries and the wheel: ~2.5 min)"
rm -f .carry/lockstep .carry/lockstep-unit .carry/*.gz .carry/*.sha256  # older layouts and wheels
command -v xz >/dev/null || die "xz not found: install it (apt-get install xz-utils); the binaries travel as one .tar.xz"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
strip_to() {  # strip_to SRC NAME: debug info stripped into the staging folder, checksum in .carry
  objcopy --strip-debug "$1" "$stage/$2" || die "objcopy $1 failed"
  sha256sum "$stage/$2" | cut -d' ' -f1 >".carry/$2.sha256"
}
strip_to target/release/lockstep lockstep
strip_to "$unit" lockstep-unit
members=(lockstep lockstep-unit)
if [ -n "$wheel" ]; then
  name=$(basename "$wheel")
  # Every entry as it is (name, date, mode: the binary's executable bit), stored.
  python - "$wheel" "$stage/$name" <<'EOF' || die "re-zipping $wheel failed"
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as src, zipfile.ZipFile(sys.argv[2], "w") as dst:
    for info in src.infolist():
        data = src.read(info)
        info.compress_type = zipfile.ZIP_STORED
        dst.writestr(info, data)
EOF
  sha256sum "$stage/$name" | cut -d' ' -f1 >".carry/$name.sha256"
  members+=("$name")
fi
# dict=192MiB: the window must reach from each binary back into the one before (~70 MB each).
tar -C "$stage" -cf - "${members[@]}" | xz -T1 --lzma2=preset=6,dict=192MiB >.carry/binaries.tar.xz.tmp &&
  mv .carry/binaries.tar.xz.tmp .carry/binaries.tar.xz || die "tar | xz failed"
awk -v a="$(du -cb "$stage"/* | tail -1 | cut -f1)" -v b="$(stat -c %s .carry/binaries.tar.xz)" -v m="${members[*]}" \
  'BEGIN { printf "  %s: %.1f MiB -> %.1f MiB in binaries.tar.xz\n", m, a/1048576, b/1048576 }'
rm -rf "$stage"

# The torch these binaries were compiled and linked against (torch-sys used the venv's).
python - "$unit" "$(basename "${wheel:-}")" >.carry/build-info.json <<'EOF' || die "cannot read the venv's torch build"
import json, subprocess, sys, time
import torch
print(json.dumps({
    "torch": torch.__version__,
    "git": torch.version.git_version,
    "cuda": torch.version.cuda,
    "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    "cudnn": torch.backends.cudnn.version(),
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "uncommitted_files": len(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.splitlines()),
    "unit_test_binary": sys.argv[1],
    "wheel": sys.argv[2] or None,
    "built": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
}, indent=1))
EOF
# Check the packed binaries' own view: the lockstep binary starts and lists its keys.
tmpbin=$(mktemp -d)
python "$ROOT/benches/gpu/accept_lib.py" unpack .carry "$tmpbin" || die "the packed files do not unpack or match their checksums"
"$tmpbin/lockstep" --version >/dev/null || die "the packed lockstep does not start"
rm -rf "$tmpbin"

carry=$(du -sb .carry | cut -f1)
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
shared=0
[ -d shared ] && shared=$(du -sb shared | cut -f1)
total=$((carry + tree + shared))
awk -v c="$carry" -v t="$tree" -v s="$shared" -v a="$total" 'BEGIN {
  m = 1048576
  printf "== .carry %.1f MiB + working tree %.1f MiB + shared/ %.1f MiB = %.1f MiB of 64 MiB that travel\n", c/m, t/m, s/m, a/m
}'
if [ "$total" -ge "$LIMIT" ]; then
  die "FAIL: $total bytes would travel, over the device tool's 64 MiB ($LIMIT bytes)"
fi
echo "prepare.sh: ok; on the GPU machine, in one device call: bash benches/gpu/accept.sh lease (see benches/gpu/README.md)"
