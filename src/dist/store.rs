//! Safe wrapper over libtorch's `c10d::TCPStore` (through the C shim in `csrc/c10d_store.cpp`).
//!
//! The store is the rendezvous point: ranks publish their ring addresses, the run nonce and
//! their per-collective sequence numbers here. It is not on the data path.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::net::TcpListener;
use std::ptr::NonNull;
use std::time::Duration;

use anyhow::Result;

mod ffi {
    use std::ffi::{c_char, c_int, c_void};

    extern "C" {
        #[allow(clippy::too_many_arguments)]
        pub fn ls_store_new(
            host: *const c_char,
            host_len: usize,
            port: u16,
            is_server: c_int,
            world_size: i64,
            timeout_ms: i64,
            out: *mut *mut c_void,
            err: *mut *mut c_char,
        ) -> c_int;
        pub fn ls_store_free(h: *mut c_void);
        pub fn ls_store_c10d(h: *mut c_void) -> *mut c_void;
        pub fn ls_store_free_buf(p: *mut c_void);
        pub fn ls_store_port(h: *const c_void) -> u16;
        pub fn ls_store_set(
            h: *mut c_void,
            key: *const c_char,
            key_len: usize,
            data: *const u8,
            len: usize,
            err: *mut *mut c_char,
        ) -> c_int;
        pub fn ls_store_get(
            h: *mut c_void,
            key: *const c_char,
            key_len: usize,
            data: *mut *mut u8,
            len: *mut usize,
            err: *mut *mut c_char,
        ) -> c_int;
        pub fn ls_store_add(
            h: *mut c_void,
            key: *const c_char,
            key_len: usize,
            delta: i64,
            out: *mut i64,
            err: *mut *mut c_char,
        ) -> c_int;
        pub fn ls_store_check(
            h: *mut c_void,
            keys: *const *const c_char,
            lens: *const usize,
            n: usize,
            out: *mut c_int,
            err: *mut *mut c_char,
        ) -> c_int;
        pub fn ls_store_wait(
            h: *mut c_void,
            keys: *const *const c_char,
            lens: *const usize,
            n: usize,
            timeout_ms: i64,
            err: *mut *mut c_char,
        ) -> c_int;
        pub fn ls_store_delete(
            h: *mut c_void,
            key: *const c_char,
            key_len: usize,
            deleted: *mut c_int,
            err: *mut *mut c_char,
        ) -> c_int;
    }
}

/// What went wrong in a store operation, so callers can react (e.g. the ring names "the store
/// host is gone" for [`StoreErrorKind::Unreachable`]) without parsing messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    /// A `get`/`wait` hit its timeout before the key(s) appeared.
    Timeout,
    /// The server could not bind its port.
    AddrInUse,
    /// The TCP connection to the store failed or broke: its host is gone or unreachable.
    Unreachable,
    /// Anything else TCPStore reported.
    Other,
}

/// Error from a store operation. It travels inside `anyhow::Error`; recover it with
/// `err.downcast_ref::<StoreError>()`.
#[derive(Debug, thiserror::Error)]
#[error("{msg}")]
pub struct StoreError {
    /// Classification of the failure.
    pub kind: StoreErrorKind,
    /// Human-readable message, including the operation, key and store address.
    pub msg: String,
}

/// Client (and optionally server) handle on a c10d `TCPStore`.
///
/// Dropping a server handle stops the server; clients still connected then get
/// [`StoreErrorKind::Unreachable`] errors.
pub struct Store {
    ptr: NonNull<c_void>,
    host: String,
    port: u16,
    timeout: Duration,
    is_server: bool,
}

// SAFETY: `c10d::TCPStore` serialises every client operation with its internal `activeOpLock_`
// mutex and the server runs on its own thread, so a handle may be used from several threads at
// once and moved between threads. The shim holds no state of its own besides the pointer.
unsafe impl Send for Store {}
// SAFETY: see `Send` above: all methods go through TCPStore's internal lock.
unsafe impl Sync for Store {}

const ERR_OK: c_int = 0;
const ERR_TIMEOUT: c_int = 2;
const ERR_ADDR_IN_USE: c_int = 3;
const ERR_NETWORK: c_int = 4;

/// Takes ownership of a shim error string.
fn take_err(err: *mut c_char) -> String {
    if err.is_null() {
        return "unknown TCPStore error (no message)".to_owned();
    }
    // SAFETY: the shim returns a malloc'd NUL-terminated string that we own; it is read once
    // and then freed with the shim's matching free function.
    let s = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: `err` came from the shim's malloc and is not used afterwards.
    unsafe { ffi::ls_store_free_buf(err.cast()) };
    s
}

fn kind_of(code: c_int) -> StoreErrorKind {
    match code {
        ERR_TIMEOUT => StoreErrorKind::Timeout,
        ERR_ADDR_IN_USE => StoreErrorKind::AddrInUse,
        ERR_NETWORK => StoreErrorKind::Unreachable,
        _ => StoreErrorKind::Other,
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// Picks a currently free TCP port on this host by binding port 0 and releasing it.
///
/// Another process may grab it before it is reused; prefer passing port 0 to
/// [`Store::server`] and reading [`Store::port`] back where possible.
pub fn free_port() -> u16 {
    TcpListener::bind(("0.0.0.0", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

impl Store {
    /// Hosts a TCPStore on `port` (all interfaces; 0 picks a free port) and connects to it via
    /// `host`. `timeout` bounds every blocking `get`/`wait` made through this handle.
    pub fn server(host: &str, port: u16, world_size: usize, timeout: Duration) -> Result<Store> {
        Self::open(host, port, true, world_size as i64, timeout).map_err(|e| {
            match e.downcast_ref::<StoreError>() {
                Some(se) if se.kind == StoreErrorKind::AddrInUse => {
                    anyhow::Error::new(StoreError {
                        kind: StoreErrorKind::AddrInUse,
                        msg: format!(
                            "cannot host the rendezvous store on {host}:{port}: address in use; \
                         choose another --master-port (0 picks a free one)"
                        ),
                    })
                }
                _ => e,
            }
        })
    }

    /// Connects to a TCPStore at `host:port`, retrying until `timeout` if it is not up yet.
    pub fn client(host: &str, port: u16, timeout: Duration) -> Result<Store> {
        Self::open(host, port, false, 0, timeout)
    }

    fn open(host: &str, port: u16, server: bool, world: i64, timeout: Duration) -> Result<Store> {
        let mut out: *mut c_void = std::ptr::null_mut();
        let mut err: *mut c_char = std::ptr::null_mut();
        // SAFETY: `host` is valid for `host.len()` bytes; `out`/`err` are valid out-pointers.
        let rc = unsafe {
            ffi::ls_store_new(
                host.as_ptr().cast(),
                host.len(),
                port,
                c_int::from(server),
                world,
                millis(timeout),
                &mut out,
                &mut err,
            )
        };
        if rc != ERR_OK {
            let role = if server { "host" } else { "connect to" };
            return Err(StoreError {
                kind: kind_of(rc),
                msg: format!(
                    "cannot {role} the rendezvous store at {host}:{port}: {}",
                    take_err(err)
                ),
            }
            .into());
        }
        let ptr =
            NonNull::new(out).ok_or_else(|| anyhow::anyhow!("TCPStore shim returned null"))?;
        // SAFETY: `ptr` is a live handle just created by the shim.
        let port = unsafe { ffi::ls_store_port(ptr.as_ptr()) };
        Ok(Store {
            ptr,
            host: host.to_owned(),
            port,
            timeout,
            is_server: server,
        })
    }

    /// The underlying `c10d::Store*`, for another shim (NCCL) that takes its own reference;
    /// valid while `self` lives.
    pub(crate) fn c10d_ptr(&self) -> *mut c_void {
        // SAFETY: `self.ptr` is a live handle.
        unsafe { ffi::ls_store_c10d(self.ptr.as_ptr()) }
    }

    /// Host name the handle connects through.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Port of the store (the real one when a server was asked for port 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Timeout for blocking `get`s made through this handle.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether this handle hosts the server.
    pub fn is_server(&self) -> bool {
        self.is_server
    }

    fn check_rc(&self, rc: c_int, err: *mut c_char, what: &str) -> Result<()> {
        if rc == ERR_OK {
            return Ok(());
        }
        Err(StoreError {
            kind: kind_of(rc),
            msg: format!(
                "store {what} on {}:{} failed: {}",
                self.host,
                self.port,
                take_err(err)
            ),
        }
        .into())
    }

    /// Sets `key` to `value`, overwriting.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut err = std::ptr::null_mut();
        // SAFETY: handle is live; key/value pointers are valid for their lengths.
        let rc = unsafe {
            ffi::ls_store_set(
                self.ptr.as_ptr(),
                key.as_ptr().cast(),
                key.len(),
                value.as_ptr(),
                value.len(),
                &mut err,
            )
        };
        self.check_rc(rc, err, &format!("set of {key:?}"))
    }

    /// Returns the value of `key`, blocking until it exists or the store's timeout expires.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut len = 0usize;
        let mut err = std::ptr::null_mut();
        // SAFETY: handle is live; key is valid for key.len(); out-pointers are valid.
        let rc = unsafe {
            ffi::ls_store_get(
                self.ptr.as_ptr(),
                key.as_ptr().cast(),
                key.len(),
                &mut data,
                &mut len,
                &mut err,
            )
        };
        self.check_rc(rc, err, &format!("get of {key:?}"))?;
        if data.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: on success the shim returns a malloc'd buffer of exactly `len` bytes that we own.
        let v = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        // SAFETY: `data` came from the shim's malloc and is not used afterwards.
        unsafe { ffi::ls_store_free_buf(data.cast()) };
        Ok(v)
    }

    /// Atomically adds `delta` to the integer at `key` (missing = 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut out = 0i64;
        let mut err = std::ptr::null_mut();
        // SAFETY: handle is live; key is valid for key.len(); out-pointers are valid.
        let rc = unsafe {
            ffi::ls_store_add(
                self.ptr.as_ptr(),
                key.as_ptr().cast(),
                key.len(),
                delta,
                &mut out,
                &mut err,
            )
        };
        self.check_rc(rc, err, &format!("add to {key:?}"))?;
        Ok(out)
    }

    /// Whether all `keys` exist, without blocking.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        let (ptrs, lens) = key_arrays(keys);
        let mut out: c_int = 0;
        let mut err = std::ptr::null_mut();
        // SAFETY: handle is live; `ptrs[i]` is valid for `lens[i]` bytes and both arrays have
        // `keys.len()` entries borrowed from `keys`, which outlives the call.
        let rc = unsafe {
            ffi::ls_store_check(
                self.ptr.as_ptr(),
                ptrs.as_ptr(),
                lens.as_ptr(),
                keys.len(),
                &mut out,
                &mut err,
            )
        };
        self.check_rc(rc, err, &format!("check of {keys:?}"))?;
        Ok(out != 0)
    }

    /// Blocks until all `keys` exist; a [`StoreErrorKind::Timeout`] error after `timeout`.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let (ptrs, lens) = key_arrays(keys);
        let mut err = std::ptr::null_mut();
        // SAFETY: as in `check`.
        let rc = unsafe {
            ffi::ls_store_wait(
                self.ptr.as_ptr(),
                ptrs.as_ptr(),
                lens.as_ptr(),
                keys.len(),
                millis(timeout),
                &mut err,
            )
        };
        self.check_rc(rc, err, &format!("wait for {keys:?}"))
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        let mut out: c_int = 0;
        let mut err = std::ptr::null_mut();
        // SAFETY: handle is live; key is valid for key.len(); out-pointers are valid.
        let rc = unsafe {
            ffi::ls_store_delete(
                self.ptr.as_ptr(),
                key.as_ptr().cast(),
                key.len(),
                &mut out,
                &mut err,
            )
        };
        self.check_rc(rc, err, &format!("delete of {key:?}"))?;
        Ok(out != 0)
    }
}

fn key_arrays(keys: &[&str]) -> (Vec<*const c_char>, Vec<usize>) {
    (
        keys.iter().map(|k| k.as_ptr().cast()).collect(),
        keys.iter().map(|k| k.len()).collect(),
    )
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: `ptr` was created by `ls_store_new`, is freed exactly once, here.
        unsafe { ffi::ls_store_free(self.ptr.as_ptr()) }
    }
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("server", &self.is_server)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(e: &anyhow::Error) -> StoreErrorKind {
        e.downcast_ref::<StoreError>().expect("StoreError").kind
    }

    #[test]
    fn set_get_add_check_wait_delete() -> Result<()> {
        let t = Duration::from_secs(20);
        let server = Store::server("127.0.0.1", 0, 2, t)?;
        let port = server.port();
        assert_ne!(port, 0);
        let client = Store::client("127.0.0.1", port, t)?;

        server.set("a", b"hello")?;
        assert_eq!(client.get("a")?, b"hello");
        client.set("empty", b"")?;
        assert_eq!(server.get("empty")?, b"");
        assert_eq!(client.add("n", 5)?, 5);
        assert_eq!(server.add("n", -2)?, 3);
        assert!(client.check(&["a", "n"])?);
        assert!(!client.check(&["a", "missing"])?);
        client.wait(&["a", "n"], Duration::from_millis(200))?;
        assert!(server.delete("a")?);
        assert!(!server.delete("a")?);
        assert!(!client.check(&["a"])?);
        Ok(())
    }

    #[test]
    fn get_blocks_until_set_from_another_thread() -> Result<()> {
        let t = Duration::from_secs(20);
        let server = Store::server("127.0.0.1", 0, 2, t)?;
        let client = Store::client("127.0.0.1", server.port(), t)?;
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                server.set("late", b"x").unwrap();
            });
            assert_eq!(client.get("late").unwrap(), b"x");
        });
        Ok(())
    }

    #[test]
    fn missing_key_times_out() -> Result<()> {
        // The store timeout also bounds the server's connection to itself, so not too short.
        let server = Store::server("127.0.0.1", 0, 1, Duration::from_millis(1000))?;
        let t0 = std::time::Instant::now();
        let e = server.get("nope").unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert_eq!(kind(&e), StoreErrorKind::Timeout, "{e:#}");
        assert!(format!("{e}").contains("nope"), "{e}");
        let e = server
            .wait(&["nope"], Duration::from_millis(100))
            .unwrap_err();
        assert_eq!(kind(&e), StoreErrorKind::Timeout, "{e:#}");
        Ok(())
    }

    #[test]
    fn busy_port_is_a_clear_error() -> Result<()> {
        let t = Duration::from_secs(20);
        let first = Store::server("127.0.0.1", 0, 1, t)?;
        let e = Store::server("127.0.0.1", first.port(), 1, t).unwrap_err();
        assert_eq!(kind(&e), StoreErrorKind::AddrInUse, "{e:#}");
        let msg = format!("{e}");
        assert!(msg.contains("address in use"), "{msg}");
        assert!(
            msg.contains(&format!("127.0.0.1:{}", first.port())),
            "{msg}"
        );
        assert!(msg.contains("--master-port"), "{msg}");
        Ok(())
    }

    #[test]
    fn dead_server_is_reported_unreachable() -> Result<()> {
        // Generous: the connect shares this timeout and the test machine may be loaded; the
        // failing get below does not wait for it.
        let t = Duration::from_secs(20);
        let server = Store::server("127.0.0.1", 0, 2, t)?;
        let client = Store::client("127.0.0.1", server.port(), t)?;
        client.set("k", b"v")?;
        drop(server);
        let e = client.get("k").unwrap_err();
        assert_eq!(kind(&e), StoreErrorKind::Unreachable, "{e:#}");
        Ok(())
    }

    #[test]
    fn free_port_is_nonzero() {
        assert_ne!(free_port(), 0);
    }
}
