#!/usr/bin/env bash
# Runs HERE (the build machine, no GPU): builds the release binaries and packs what the GPU
# machine needs into .carry/ (git-ignored), which the device tool's `run` carries with
# carry [".carry"]. The GPU machine has torch 2.11 (CUDA) + transformers but no Rust and no
# network; benches/gpu/accept.sh runs there from this.
#
#   .carry/lockstep.gz        the CLI, debug info stripped (objcopy --strip-debug), gzipped
#   .carry/lockstep-unit.gz   the library's unit-test binary (NCCL group, model tests on CUDA)
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
source scripts/env.sh
set +e  # env.sh sets -e; every step below checks its own status

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

pack() {  # pack SRC NAME: strip debug info, gzip to .carry/NAME.gz
  local tmp=".carry/$2.tmp"
  objcopy --strip-debug "$1" "$tmp" || die "objcopy $1 failed"
  gzip -6 -c "$tmp" >".carry/$2.gz.tmp" && mv ".carry/$2.gz.tmp" ".carry/$2.gz" || die "gzip $2 failed"
  sha256sum "$tmp" | cut -d' ' -f1 >".carry/$2.sha256"
  awk -v n="$2" -v a="$(stat -c %s "$tmp")" -v b="$(stat -c %s ".carry/$2.gz")" -v f="$1" \
    'BEGIN { printf "  %-14s %6.1f MiB stripped -> %5.1f MiB gzipped (%s)\n", n, a/1048576, b/1048576, f }'
  rm -f "$tmp"
}
echo "== packing into .carry/"
rm -f .carry/lockstep .carry/lockstep-unit  # plain copies from an older layout
pack target/release/lockstep lockstep
pack "$unit" lockstep-unit

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
gzip -dc .carry/lockstep.gz >"$tmpbin/lockstep" && chmod +x "$tmpbin/lockstep"
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
echo "prepare.sh: ok; on the GPU machine: bash benches/gpu/accept.sh correctness|perf|scale (see benches/gpu/README.md)"
