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
#   .carry/<name>.sha256      each stripped binary's checksum
#   .carry/build-info.json    the torch build the binaries were compiled against (accept.sh
#                             refuses a GPU machine whose torch differs: an NCCL/ABI mismatch
#                             segfaults rather than erroring), the commit, checksums
#
# Everything that travels (tracked + untracked-not-ignored files + .carry) must stay under the
# device tool's 64 MiB; this script fails loudly otherwise.
#
# usage: bash benches/gpu/prepare.sh [--no-build]
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

if [ "${1:-}" != "--no-build" ]; then
  echo "== cargo build --release --all-targets"
  cargo build --release --all-targets || die "cargo build failed"
fi
unit=$(cargo test --release --lib --no-run --message-format=json 2>/dev/null |
  jq -r 'select(.profile.test and .target.kind == ["lib"]) | .executable' | tail -1)
[ -n "$unit" ] && [ -x "$unit" ] || die "cannot find the lib unit-test binary (cargo test --release --lib --no-run)"
[ -x target/release/lockstep ] || die "target/release/lockstep missing"

echo "== packing into .carry/ (xz over both binaries: ~1.5 min)"
rm -f .carry/lockstep .carry/lockstep-unit .carry/*.gz  # older layouts
command -v xz >/dev/null || die "xz not found: install it (apt-get install xz-utils); the binaries travel as one .tar.xz"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
strip_to() {  # strip_to SRC NAME: debug info stripped into the staging folder, checksum in .carry
  objcopy --strip-debug "$1" "$stage/$2" || die "objcopy $1 failed"
  sha256sum "$stage/$2" | cut -d' ' -f1 >".carry/$2.sha256"
}
strip_to target/release/lockstep lockstep
strip_to "$unit" lockstep-unit
# dict=192MiB: the window must reach from the unit binary back into the CLI (~70 MB each).
tar -C "$stage" -cf - lockstep lockstep-unit | xz -T1 --lzma2=preset=6,dict=192MiB >.carry/binaries.tar.xz.tmp &&
  mv .carry/binaries.tar.xz.tmp .carry/binaries.tar.xz || die "tar | xz failed"
awk -v a="$(du -cb "$stage"/* | tail -1 | cut -f1)" -v b="$(stat -c %s .carry/binaries.tar.xz)" \
  'BEGIN { printf "  lockstep + lockstep-unit %.1f MiB stripped -> %.1f MiB in binaries.tar.xz\n", a/1048576, b/1048576 }'
rm -rf "$stage"

# The torch these binaries were compiled and linked against (torch-sys used the venv's).
python - "$unit" >.carry/build-info.json <<'EOF' || die "cannot read the venv's torch build"
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
    "built": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
}, indent=1))
EOF
# Check the packed binaries' own view: the lockstep binary starts and lists its keys.
tmpbin=$(mktemp -d)
python "$ROOT/benches/gpu/accept_lib.py" unpack .carry "$tmpbin" || die "the packed binaries do not unpack or match their checksums"
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
