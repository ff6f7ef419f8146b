#!/usr/bin/env bash
# Fails unless every ELF file named stays within manylinux_2_28 (auditwheel's policy: GLIBC_2.28,
# GLIBCXX_3.4.24, CXXABI_1.3.11, GCC_7.0.0) and needs no library beyond the policy's system ones
# and libtorch's own (libtorch_cpu, libc10; the NCCL shim: also libtorch_cuda, libc10_cuda).
# Prints each file's highest version per family. Default files: the zigbuild binary and the
# newest NCCL shim under the target dir.
set -euo pipefail
TARGET_DIR="${CARGO_TARGET_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target}"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  files=("$TARGET_DIR/x86_64-unknown-linux-gnu/release/lockstep")
  shim=$(ls -t "$TARGET_DIR"/x86_64-unknown-linux-gnu/release/build/lockstep-*/out/liblockstep_nccl.so 2>/dev/null | head -1 || true)
  [ -n "$shim" ] && files+=("$shim")
fi
allowed_libs='^(libc\.so\.6|libm\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|libgcc_s\.so\.1|libstdc\+\+\.so\.6|ld-linux-x86-64\.so\.2|libtorch_cpu\.so|libc10\.so|libtorch_cuda\.so|libc10_cuda\.so)$'
bad=0
for f in "${files[@]}"; do
  echo "== $f"
  objdump -T "$f" | grep -oE '\((GLIBC|GLIBCXX|CXXABI|GCC)_[0-9.]+\)' | tr -d '()' | sort -uV \
    | awk -F_ '{v[$1]=$0} END {for (k in v) print "   highest " v[k]}' | sort
  over=$(objdump -T "$f" | grep -E '\((GLIBC_2\.(29|[3-9][0-9])|GLIBCXX_3\.4\.(2[5-9]|3[0-9])|CXXABI_1\.3\.(1[2-9])|GCC_([89]|1[0-9])\.)' || true)
  if [ -n "$over" ]; then echo "   NEWER THAN manylinux_2_28:"; echo "$over" | sed 's/^/     /'; bad=1; fi
  needed=$(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  echo "   NEEDED: $(echo $needed)"
  for lib in $needed; do
    if ! [[ $lib =~ $allowed_libs ]]; then echo "   NOT ALLOWED: $lib"; bad=1; fi
  done
done
if [ $bad -ne 0 ]; then echo "check-manylinux: FAILED" >&2; exit 1; fi
echo "check-manylinux: OK (manylinux_2_28_x86_64)"
