// Helpers shared by the C shims (csrc/*.cpp) for passing messages across the C ABI.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

namespace lockstep_ffi {

// A malloc'd NUL-terminated copy (NULL if out of memory), released with free() (directly or
// through ls_store_free_buf).
inline char* dup_cstr(const std::string& s) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (p != nullptr) {
    std::memcpy(p, s.data(), s.size());
    p[s.size()] = '\0';
  }
  return p;
}

}  // namespace lockstep_ffi
