// Keeps the binary (and the NCCL shim) inside the manylinux_2_28 floor (glibc 2.28, libstdc++
// from GCC 8: GLIBCXX_3.4.24 / CXXABI_1.3.11) when the C++ is compiled with a newer g++ against
// a newer glibc. Two things that newer headers make the object files ask for, defined here with
// hidden visibility: they bind inside the binary, are never exported, and so never interpose on
// the library's own copy. Harmless on a new system too (the build on one links this as well).
// Only names the shims' and torch-sys's own code (libtch) reach for; the release check
// (scripts/check-manylinux.sh) fails the build when anything newer shows up.
#include <sstream>
#include <new>

// glibc 2.32's __libc_single_threaded, read by libstdc++ >= 11's inlined atomics
// (ext/atomicity.h, shared_ptr's refcounts) to skip atomics in a single-threaded process.
// 0 = "may be multi-threaded": always the atomic path, which is always correct.
extern "C" {
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
}

// GLIBCXX_3.4.26 (GCC 9) split basic_ostringstream's `explicit basic_ostringstream(openmode =
// out)` into a default constructor plus the openmode one; code compiled with GCC >= 9 calls the
// new default one (std::ostringstream os;), which GCC 8's libstdc++ lacks. It is the openmode one
// with ios_base::out (GLIBCXX_3.4.21), exactly.
extern "C" __attribute__((visibility("hidden"))) void
_ZNSt7__cxx1119basic_ostringstreamIcSt11char_traitsIcESaIcEEC1Ev(void* self) {
  ::new (self) std::ostringstream(std::ios_base::out);
}
