//! Safe wrapper over libtorch's `c10d::TCPStore` (through the C shim in `csrc/c10d_store.cpp`).
//!
//! The store is the rendezvous point: ranks publish their ring addresses, the run nonce and
//! their per-collective sequence numbers here. It is not on the data path.

use std::ffi::{c_char, c_int, c_void};
use std::fmt;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::time::Duration;

use anyhow::Result;

use crate::sys::ffi::{self as sys_ffi, ShimError};

mod ffi {
    use std::ffi::{c_char, c_int, c_void};

    extern "C" {
        pub fn ls_store_new(
            host: *const c_char,
            host_len: usize,
            port: u16,
            is_server: c_int,
            world_size: i64,
            timeout_ms: i64,
            listen_fd: c_int,
            out: *mut *mut c_void,
            err: *mut *mut c_char,
        ) -> c_int;
        pub fn ls_store_free(h: *mut c_void);
        pub fn ls_store_c10d(h: *mut c_void) -> *mut c_void;
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

// The shim's error classes (csrc/c10d_store.cpp); any other status is `Other`.
const ERR_TIMEOUT: c_int = 2;
const ERR_ADDR_IN_USE: c_int = 3;
const ERR_NETWORK: c_int = 4;

fn kind_of(e: &ShimError) -> StoreErrorKind {
    match e.status {
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
    /// Hosts a TCPStore on `host:port` (0 picks a free port) and connects to it. The socket is
    /// bound here, to the address `host` resolves to, and handed to the store
    /// (`TCPStoreOptions::masterListenFd`): left to itself TCPStore listens on every interface,
    /// so any host that can reach this machine could read and write the run's keys (the ring's
    /// nonce included). `host` must therefore be an address of this machine: loopback for a
    /// single-node run, the address the other nodes use otherwise. `timeout` bounds every
    /// blocking `get`/`wait` made through this handle.
    pub fn server(host: &str, port: u16, world_size: usize, timeout: Duration) -> Result<Store> {
        let listener = bind_listener(host, port)?;
        let port = listener.local_addr()?.port();
        // The store takes over the descriptor it is given whatever happens, so it gets a
        // duplicate and `listener` closes ours. Close-on-exec: the workers a launcher spawns
        // must not inherit the listening socket (a worker outliving the launcher would keep
        // the port bound).
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) of a descriptor we own; the result is checked below.
        let fd = unsafe { libc::fcntl(listener.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error())
                .map_err(|e| anyhow::anyhow!("duplicating the store's listening socket: {e}"));
        }
        Self::open(host, port, Some(fd), world_size as i64, timeout)
    }

    /// Connects to a TCPStore at `host:port`, retrying until `timeout` if it is not up yet.
    pub fn client(host: &str, port: u16, timeout: Duration) -> Result<Store> {
        Self::open(host, port, None, 0, timeout)
    }

    /// A server when `listen_fd` is given (the store takes the descriptor over), else a client.
    fn open(
        host: &str,
        port: u16,
        listen_fd: Option<c_int>,
        world: i64,
        timeout: Duration,
    ) -> Result<Store> {
        let server = listen_fd.is_some();
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: `host` is valid for `host.len()` bytes; `out`/`err` are valid out-pointers.
        let created = sys_ffi::call(|err| unsafe {
            ffi::ls_store_new(
                host.as_ptr().cast(),
                host.len(),
                port,
                c_int::from(server),
                world,
                millis(timeout),
                listen_fd.unwrap_or(-1),
                &mut out,
                err,
            )
        });
        if let Err(e) = created {
            let role = if server { "host" } else { "connect to" };
            return Err(StoreError {
                kind: kind_of(&e),
                msg: format!("cannot {role} the rendezvous store at {host}:{port}: {e}"),
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

    /// Runs one shim call (given the `err` out-parameter); a failure becomes a [`StoreError`]
    /// saying which operation (`what`) failed on which store.
    fn call(&self, what: &str, f: impl FnOnce(*mut *mut c_char) -> c_int) -> Result<()> {
        sys_ffi::call(f).map_err(|e| {
            let msg = format!("store {what} on {}:{} failed: {e}", self.host, self.port);
            StoreError {
                kind: kind_of(&e),
                msg,
            }
            .into()
        })
    }

    /// Sets `key` to `value`, overwriting.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        // SAFETY: handle is live; key/value pointers are valid for their lengths.
        self.call(&format!("set of {key:?}"), |err| unsafe {
            ffi::ls_store_set(
                self.ptr.as_ptr(),
                key.as_ptr().cast(),
                key.len(),
                value.as_ptr(),
                value.len(),
                err,
            )
        })
    }

    /// Returns the value of `key`, blocking until it exists or the store's timeout expires.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: handle is live; key is valid for key.len(); out-pointers are valid.
        self.call(&format!("get of {key:?}"), |err| unsafe {
            ffi::ls_store_get(
                self.ptr.as_ptr(),
                key.as_ptr().cast(),
                key.len(),
                &mut data,
                &mut len,
                err,
            )
        })?;
        if data.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: on success the shim returns a malloc'd buffer of exactly `len` bytes that we own.
        let v = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        // SAFETY: `data` came from the shim's malloc and is not used afterwards.
        unsafe { libc::free(data.cast()) };
        Ok(v)
    }

    /// Atomically adds `delta` to the integer at `key` (missing = 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut out = 0i64;
        // SAFETY: handle is live; key is valid for key.len(); out-pointers are valid.
        self.call(&format!("add to {key:?}"), |err| unsafe {
            ffi::ls_store_add(
                self.ptr.as_ptr(),
                key.as_ptr().cast(),
                key.len(),
                delta,
                &mut out,
                err,
            )
        })?;
        Ok(out)
    }

    /// Whether all `keys` exist, without blocking.
    pub fn check(&self, keys: &[&str]) -> Result<bool> {
        let (ptrs, lens) = key_arrays(keys);
        let mut out: c_int = 0;
        // SAFETY: handle is live; `ptrs[i]` is valid for `lens[i]` bytes and both arrays have
        // `keys.len()` entries borrowed from `keys`, which outlives the call.
        self.call(&format!("check of {keys:?}"), |err| unsafe {
            ffi::ls_store_check(
                self.ptr.as_ptr(),
                ptrs.as_ptr(),
                lens.as_ptr(),
                keys.len(),
                &mut out,
                err,
            )
        })?;
        Ok(out != 0)
    }

    /// Blocks until all `keys` exist; a [`StoreErrorKind::Timeout`] error after `timeout`.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let (ptrs, lens) = key_arrays(keys);
        // SAFETY: as in `check`.
        self.call(&format!("wait for {keys:?}"), |err| unsafe {
            ffi::ls_store_wait(
                self.ptr.as_ptr(),
                ptrs.as_ptr(),
                lens.as_ptr(),
                keys.len(),
                millis(timeout),
                err,
            )
        })
    }

    /// Deletes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        let mut out: c_int = 0;
        // SAFETY: handle is live; key is valid for key.len(); out-pointers are valid.
        self.call(&format!("delete of {key:?}"), |err| unsafe {
            ffi::ls_store_delete(
                self.ptr.as_ptr(),
                key.as_ptr().cast(),
                key.len(),
                &mut out,
                err,
            )
        })?;
        Ok(out != 0)
    }
}

/// The listening socket of a store hosted at `host:port`: bound to the address `host` resolves
/// to (IPv4 first, as the ring's route lookup picks), with errors that say what to change.
fn bind_listener(host: &str, port: u16) -> Result<TcpListener> {
    let addr = resolve(host, port)?;
    TcpListener::bind(addr).map_err(|e| bind_failure(&e, host, addr).into())
}

/// Why hosting the store on `addr` (`host` resolved) failed, and what to change.
fn bind_failure(e: &std::io::Error, host: &str, addr: SocketAddr) -> StoreError {
    let port = addr.port();
    let (kind, why) = match e.kind() {
        ErrorKind::AddrInUse => (
            StoreErrorKind::AddrInUse,
            "address in use; choose another --master-port (0 picks a free one)".to_string(),
        ),
        ErrorKind::AddrNotAvailable => (
            StoreErrorKind::Other,
            format!(
                "{host} resolves to {}, which is not an address of this machine; MASTER_ADDR \
                 (--master-addr) must name the host that runs rank 0 (node 0)",
                addr.ip()
            ),
        ),
        ErrorKind::PermissionDenied if port < 1024 => (
            StoreErrorKind::Other,
            format!(
                "{e}: ports below 1024 need root; use --master-port 0 for a free port, or one \
                 above 1023 (e.g. 29500)"
            ),
        ),
        _ => (StoreErrorKind::Other, e.to_string()),
    };
    StoreError {
        kind,
        msg: format!("cannot host the rendezvous store on {host}:{port}: {why}"),
    }
}

/// For a store that other machines must reach: an error when `host` is a name (not an address
/// literal) that resolves to a loopback address here, as a host's own name often does through
/// /etc/hosts (`127.0.1.1 node0`). The store would listen where no other node can connect.
pub fn check_reachable_name(host: &str) -> Result<()> {
    if host.parse::<std::net::IpAddr>().is_ok() {
        return Ok(()); // an explicit address is taken as meant
    }
    let ip = resolve(host, 0)?.ip();
    anyhow::ensure!(
        !ip.is_loopback(),
        "the master address {host} resolves to {ip} on this host, a loopback address that the \
         other nodes cannot reach (often an /etc/hosts line for the host's own name); set \
         MASTER_ADDR / --master-addr to this node's network address"
    );
    Ok(())
}

/// `host:port` as a socket address, preferring IPv4 when the name has both.
pub(crate) fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    let all: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| anyhow::anyhow!("cannot resolve the rendezvous host {host:?}: {e}"))?
        .collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or_else(|| all.first())
        .copied()
        .ok_or_else(|| anyhow::anyhow!("the rendezvous host {host:?} resolves to no address"))
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
    #[test]
    fn a_privileged_port_says_it_needs_root_and_what_to_use() {
        let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        let addr: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
        let msg = super::bind_failure(&denied, "127.0.0.1", addr).to_string();
        assert!(
            msg.contains("127.0.0.1:1")
                && msg.contains("ports below 1024 need root")
                && msg.contains("--master-port 0"),
            "{msg}"
        );
        let high: std::net::SocketAddr = "127.0.0.1:2000".parse().unwrap();
        let msg = super::bind_failure(&denied, "127.0.0.1", high).to_string();
        assert!(!msg.contains("need root"), "{msg}");
    }

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

    /// The server listens on the address it was given only: the whole of 127.0.0.0/8 reaches
    /// this machine, yet 127.0.0.2 is refused when the store was bound to 127.0.0.1.
    #[test]
    fn server_listens_on_its_address_only() -> Result<()> {
        let t = Duration::from_secs(20);
        let server = Store::server("127.0.0.1", 0, 1, t)?;
        let port = server.port();
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
        let other = std::net::TcpStream::connect(("127.0.0.2", port));
        assert!(
            other.is_err(),
            "the store on 127.0.0.1:{port} also accepted a connection on 127.0.0.2"
        );
        server.set("k", b"v")?;
        assert_eq!(Store::client("127.0.0.1", port, t)?.get("k")?, b"v");
        Ok(())
    }

    #[test]
    fn hosting_on_an_address_of_another_machine_is_a_clear_error() {
        // TEST-NET-3 (RFC 5737): never an address of this machine.
        let e = Store::server("203.0.113.7", 0, 1, Duration::from_secs(5)).unwrap_err();
        let msg = format!("{e}");
        assert!(
            msg.contains("203.0.113.7") && msg.contains("not an address of this machine"),
            "{msg}"
        );
    }

    #[test]
    fn a_name_for_loopback_cannot_serve_other_nodes() {
        let e = check_reachable_name("localhost").unwrap_err();
        assert!(
            format!("{e}").contains("localhost resolves to 127.0.0.1"),
            "{e}"
        );
        assert!(
            check_reachable_name("127.0.0.1").is_ok(),
            "a literal is meant"
        );
    }

    #[test]
    fn free_port_is_nonzero() {
        assert_ne!(free_port(), 0);
    }
}
