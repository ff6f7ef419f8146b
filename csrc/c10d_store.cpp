// Thin C ABI over libtorch's c10d::TCPStore, consumed by src/dist/store.rs.
//
// Why TCPStore and not a Rust key-value server: torchrun's elastic agent hosts
// a TCPStore (TORCHELASTIC_USE_AGENT_STORE=True), so speaking its wire protocol
// through libtorch itself is the only way to rendezvous under torchrun without
// re-implementing (and tracking) that protocol.
//
// Error convention: csrc/ffi_util.hpp. The error classes below let the caller tell a timeout
// from a busy port from an unreachable store.
//
// Keys are passed as (pointer, length) so they need not be NUL-terminated.

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "ffi_util.hpp"

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

using lockstep_ffi::LS_ERR_OTHER;

enum : int {
  LS_ERR_TIMEOUT = 2,
  LS_ERR_ADDR_IN_USE = 3,
  LS_ERR_NETWORK = 4,
};

struct Handle {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

bool contains_ci(const std::string& hay, const char* needle) {
  std::string h(hay), n(needle);
  for (auto& c : h) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (auto& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return h.find(n) != std::string::npos;
}

// Classifies by message text as well as type: a busy port and a dead peer are
// both DistNetworkError, a wait timeout is a plain DistStoreError, and the
// message is the only place EADDRINUSE / "timeout" show up. A network error
// mentioning a timeout (e.g. connecting to a host that is gone) stays a
// network error: the caller must learn that the store is unreachable.
int classify(int by_type, const std::string& msg) {
  if (contains_ci(msg, "EADDRINUSE") || contains_ci(msg, "address already in use")) {
    return LS_ERR_ADDR_IN_USE;
  }
  if (by_type == LS_ERR_NETWORK) return LS_ERR_NETWORK;
  if (contains_ci(msg, "timeout") || contains_ci(msg, "timed out")) {
    return LS_ERR_TIMEOUT;
  }
  return by_type;
}

// The error class of an exception thrown by TCPStore: its type, refined by its message.
int class_of(const std::exception& e, const std::string& msg) {
  const bool network = dynamic_cast<const c10::DistNetworkError*>(&e) != nullptr;
  return classify(network ? LS_ERR_NETWORK : LS_ERR_OTHER, msg);
}

template <typename F>
int guarded(char** err, F&& f) {
  return lockstep_ffi::guarded(err, "TCPStore", std::forward<F>(f), class_of);
}

std::vector<std::string> keys_of(const char* const* keys, const size_t* lens, size_t n) {
  std::vector<std::string> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.emplace_back(keys[i], lens[i]);
  return out;
}

}  // namespace

extern "C" {

// Creates a server (is_server != 0; it also acts as a client of itself) or a
// client. world_size <= 0 means "unknown". The server does not wait for the
// workers here: the ring bootstrap synchronises the ranks itself.
//
// listen_fd >= 0 (servers only) is a socket the caller has bound and put in
// the listening state; the server takes it over (TCPStoreOptions::
// masterListenFd) instead of binding its own, which would listen on every
// interface. The store owns the descriptor from then on, success or failure
// (pass a dup if you keep your own).
int ls_store_new(const char* host, size_t host_len, uint16_t port, int is_server,
                 int64_t world_size, int64_t timeout_ms, int listen_fd, void** out,
                 char** err) {
  return guarded(err, [&] {
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = is_server != 0;
    if (is_server != 0 && listen_fd >= 0) opts.masterListenFd = listen_fd;
    if (world_size > 0) opts.numWorkers = static_cast<size_t>(world_size);
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host, host_len), opts);
    *out = new Handle{std::move(store)};
  });
}

void ls_store_free(void* h) {
  // The destructor joins the server thread; it does not throw in practice, but
  // swallow anything rather than abort across the FFI boundary.
  try {
    delete static_cast<Handle*>(h);
  } catch (...) {
  }
}

// The c10d::Store behind a handle, for other shims in this process (csrc/nccl_group.cpp) that
// take their own reference with intrusive_ptr::reclaim_copy; the handle keeps one until freed.
void* ls_store_c10d(void* h) {
  return static_cast<c10d::Store*>(static_cast<Handle*>(h)->store.get());
}

uint16_t ls_store_port(const void* h) { return static_cast<const Handle*>(h)->store->getPort(); }

int ls_store_set(void* h, const char* key, size_t key_len, const uint8_t* data, size_t len,
                 char** err) {
  return guarded(err, [&] {
    std::vector<uint8_t> v(data, data + len);
    static_cast<Handle*>(h)->store->set(std::string(key, key_len), v);
  });
}

// Blocks until the key exists or the store's timeout expires. *data is
// malloc'd (possibly NULL when *len == 0); free it with free().
int ls_store_get(void* h, const char* key, size_t key_len, uint8_t** data, size_t* len,
                 char** err) {
  return guarded(err, [&] {
    std::vector<uint8_t> v = static_cast<Handle*>(h)->store->get(std::string(key, key_len));
    uint8_t* p = nullptr;
    if (!v.empty()) {
      p = static_cast<uint8_t*>(std::malloc(v.size()));
      if (p == nullptr) throw std::bad_alloc();
      std::memcpy(p, v.data(), v.size());
    }
    *data = p;
    *len = v.size();
  });
}

int ls_store_add(void* h, const char* key, size_t key_len, int64_t delta, int64_t* out,
                 char** err) {
  return guarded(err, [&] {
    *out = static_cast<Handle*>(h)->store->add(std::string(key, key_len), delta);
  });
}

int ls_store_check(void* h, const char* const* keys, const size_t* lens, size_t n, int* out,
                   char** err) {
  return guarded(err, [&] {
    *out = static_cast<Handle*>(h)->store->check(keys_of(keys, lens, n)) ? 1 : 0;
  });
}

int ls_store_wait(void* h, const char* const* keys, const size_t* lens, size_t n,
                  int64_t timeout_ms, char** err) {
  return guarded(err, [&] {
    static_cast<Handle*>(h)->store->wait(keys_of(keys, lens, n),
                                         std::chrono::milliseconds(timeout_ms));
  });
}

int ls_store_delete(void* h, const char* key, size_t key_len, int* deleted, char** err) {
  return guarded(err, [&] {
    *deleted = static_cast<Handle*>(h)->store->deleteKey(std::string(key, key_len)) ? 1 : 0;
  });
}

}  // extern "C"
