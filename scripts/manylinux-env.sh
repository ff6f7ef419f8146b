# Sourced after scripts/env.sh by the scripts that build for manylinux_2_28 (glibc 2.28 = RHEL/
# Rocky 8; libstdc++ of GCC 8) on a newer machine: scripts/build-manylinux.sh (the wheel's
# binary) and scripts/test.sh (the suite, so that it tests that very binary: one build serves
# both). Defines
#   zigcargo SUBCOMMAND ARGS...   cargo-zigbuild's SUBCOMMAND (zigbuild, test) for that target;
#                                 the artifacts land in $CARGO_TARGET_DIR/x86_64-unknown-linux-gnu.
# cargo-zigbuild links the Rust side against zig's glibc 2.28 stubs; the C++ (torch-sys's libtch,
# csrc/) is still compiled by GNU g++ with libstdc++'s headers and the C++11 ABI, libtorch's own.
# csrc/glibc_compat.cpp covers what newer headers make that code ask for; scripts/check-manylinux.sh
# checks the result. Tools from PyPI (ziglang, cargo-zigbuild), in their own venv.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
MANYLINUX_TOOLS="${LOCKSTEP_ZIG_TOOLS:-$CARGO_TARGET_DIR/zig-tools}"
if [ ! -x "$MANYLINUX_TOOLS/bin/cargo-zigbuild" ]; then
  echo "lockstep: installing ziglang and cargo-zigbuild into $MANYLINUX_TOOLS; first time only" >&2
  python3 -m venv "$MANYLINUX_TOOLS"
  "$MANYLINUX_TOOLS/bin/pip" install -q ziglang==0.17.1 cargo-zigbuild==0.24.1
fi
CARGO_ZIGBUILD_ZIG_PATH="$("$MANYLINUX_TOOLS/bin/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')"
export CARGO_ZIGBUILD_ZIG_PATH
MANYLINUX_TORCH_LIB="$(python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
# torch-sys asks for -lgomp; zig searches no system directory and the wheel ships only
# libgomp.so.1 (--as-needed drops it again: nothing refers to it).
mkdir -p "$CARGO_TARGET_DIR/manylinux-lib"
ln -sf "$MANYLINUX_TORCH_LIB/libgomp.so.1" "$CARGO_TARGET_DIR/manylinux-lib/libgomp.so"
# C++ with GNU g++ and libstdc++'s headers, not zig's clang and libc++.
export CXX_x86_64_unknown_linux_gnu=g++
# No -lstdc++ from the cc crate (zig reads it as its own libc++): libstdc++ by its full path.
export CXXSTDLIB_x86_64_unknown_linux_gnu=
# --allow-shlib-undefined: this machine's libstdc++.so.6 refers to glibc 2.3x symbols that the
# 2.28 stubs lack; at run time the target's own libstdc++ is loaded, and check-manylinux.sh keeps
# what *the binary* asks of it within GLIBCXX_3.4.24. libgcc_s by path: the one unwinder for
# Rust and C++ (cargo-zigbuild turns rustc's -lgcc_s into zig's static libunwind). With a
# --target, RUSTFLAGS reach the target's artifacts only, not build scripts or proc macros.
lockstep_flags="-L native=$CARGO_TARGET_DIR/manylinux-lib"
lockstep_flags+=" -C link-arg=$(g++ -print-file-name=libstdc++.so.6)"
lockstep_flags+=" -C link-arg=$(g++ -print-file-name=libgcc_s.so.1)"
lockstep_flags+=" -C link-arg=-Wl,--allow-shlib-undefined"
# Once: sourced again from a shell that already did (a script that calls another), it must not
# append them twice, a different RUSTFLAGS that would rebuild every crate.
[[ "${RUSTFLAGS:-}" == *"$lockstep_flags"* ]] || RUSTFLAGS="${RUSTFLAGS:-} $lockstep_flags"
export RUSTFLAGS
unset lockstep_flags
zigcargo() {
  local sub=$1
  shift
  "$MANYLINUX_TOOLS/bin/cargo-zigbuild" "$sub" --target x86_64-unknown-linux-gnu.2.28 "$@"
}
