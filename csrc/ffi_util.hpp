// The C ABI convention shared by every shim in csrc/ (and src/sys/ffi.rs on the Rust side):
//
//   * A function that can fail returns an int status: LS_OK (0) on success, otherwise an error
//     class. LS_ERR_OTHER (1) is "any error"; a shim whose caller acts on the kind of failure
//     defines further classes from 2 up (the store: timeout, address in use, network).
//   * Its last parameter is `char** err`: on failure it receives a malloc'd NUL-terminated
//     message (or NULL if even that allocation failed); on success it is left untouched.
//   * Every buffer a shim hands out (messages, strings, data) is malloc'd; the caller releases
//     it with free().
//   * No C++ exception crosses the boundary: bodies run inside guarded().
//   * Functions that cannot fail (destructors, accessors) return their result directly.
//
// Tensors arrive as tch's handles, which are `at::Tensor*`.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

namespace lockstep_ffi {

enum : int {
  LS_OK = 0,
  LS_ERR_OTHER = 1,
};

// A malloc'd NUL-terminated copy (NULL if out of memory), released with free().
inline char* dup_cstr(const std::string& s) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (p != nullptr) {
    std::memcpy(p, s.data(), s.size());
    p[s.size()] = '\0';
  }
  return p;
}

// Runs f() and returns LS_OK, or turns the exception it threw into a status and *err.
// `classify(exception, message)` picks the status for a std::exception; `what` names the
// shim in the message of an exception of unknown type. c10::Error::what() carries a C++
// backtrace, noise for the user, so its short form is the message.
template <typename F, typename Classify>
int guarded(char** err, const char* what, F&& f, Classify&& classify) {
  std::string msg;
  int status = LS_ERR_OTHER;
  try {
    f();
    return LS_OK;
  } catch (const c10::Error& e) {
    msg = e.what_without_backtrace();
    status = classify(e, msg);
  } catch (const std::exception& e) {
    msg = e.what();
    status = classify(e, msg);
  } catch (...) {
    msg = std::string("unknown C++ exception in ") + what;
  }
  if (err != nullptr) *err = dup_cstr(msg);
  return status;
}

// guarded() for a shim whose caller needs no error classes: every failure is LS_ERR_OTHER.
template <typename F>
int guarded(char** err, const char* what, F&& f) {
  return guarded(err, what, std::forward<F>(f),
                 [](const std::exception&, const std::string&) { return LS_ERR_OTHER; });
}

}  // namespace lockstep_ffi
