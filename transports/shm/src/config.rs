//! Configuration of the same-host transport, read strictly from `TE_SHM_*` variables.

use std::path::PathBuf;
use std::time::Duration;

use te_base::config::{parse_bytes, parse_var, Env};
use te_base::{Error, Result};

/// Where the listening Unix socket is bound; unset: an abstract socket name of this process.
pub const SOCKET_VAR: &str = "TE_SHM_SOCKET";
/// Handshake, control-frame and revocation deadline in milliseconds.
pub const TIMEOUT_VAR: &str = "TE_SHM_TIMEOUT_MS";
/// Extra user ids (comma-separated) allowed to connect besides this process's own.
pub const ALLOW_UIDS_VAR: &str = "TE_SHM_ALLOW_UIDS";
/// Batches of at most this many bytes are copied on the submitting thread.
pub const INLINE_BYTES_VAR: &str = "TE_SHM_INLINE_BYTES";
/// Copy threads that share large batches.
pub const COPY_THREADS_VAR: &str = "TE_SHM_COPY_THREADS";
/// Connections the serving side accepts at once.
pub const MAX_CONNECTIONS_VAR: &str = "TE_SHM_MAX_CONNECTIONS";
/// Where Yama's `ptrace_scope` is read from.
pub const PTRACE_SCOPE_FILE_VAR: &str = "TE_SHM_PTRACE_SCOPE_FILE";
/// Fault injection for tests: the connect-time permission probe fails with this errno.
pub const FAULT_PROBE_ERRNO_VAR: &str = "TE_SHM_FAULT_PROBE_ERRNO";

/// Memory the engine allocates is a sealed memfd that connected peers map (1, default), or
/// anonymous memory reached by cross-memory attach only (0).
pub const MEMFD_VAR: &str = "TE_SHM_MEMFD";

/// Every variable this transport reads (`TE_NT_COPY_MIN_BYTES` is the local transport's: the
/// mapped path copies with its kernels and threshold).
pub const ENV_VARS: &[&str] = &[
    MEMFD_VAR,
    te_transport_local::config::NT_COPY_MIN_BYTES_VAR,
    SOCKET_VAR,
    TIMEOUT_VAR,
    ALLOW_UIDS_VAR,
    INLINE_BYTES_VAR,
    COPY_THREADS_VAR,
    MAX_CONNECTIONS_VAR,
    PTRACE_SCOPE_FILE_VAR,
    FAULT_PROBE_ERRNO_VAR,
];

/// Yama's setting, where the kernel has Yama.
pub const DEFAULT_PTRACE_SCOPE_FILE: &str = "/proc/sys/kernel/yama/ptrace_scope";

/// How the same-host transport is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmConfig {
    /// `TE_SHM_SOCKET`: a filesystem path for the listening socket (a restarted engine can come
    /// back at the same address); `None`: an abstract name unique to this process.
    pub socket: Option<PathBuf>,
    /// `TE_SHM_TIMEOUT_MS` (default 5,000): handshake, each control frame, and how long a
    /// deregistration waits for a connected initiator to confirm the revocation before cutting it.
    pub timeout: Duration,
    /// `TE_SHM_ALLOW_UIDS`: user ids besides our own that may connect (default none).
    pub allow_uids: Vec<u32>,
    /// `TE_SHM_INLINE_BYTES` (default 1 MiB): batches up to this size are copied on the
    /// submitting thread; larger ones are cut into ~1 MiB chunks the copy threads (and, up to
    /// 256 MiB, the submitting thread) claim one at a time.
    pub inline_bytes: u64,
    /// `TE_SHM_COPY_THREADS` (default 2, at most 64): persistent threads that share large
    /// batches. One kernel copy thread reaches about half a memcpy loop's rate here (measured in
    /// `docs/shm.md`); two reach about 0.85 of it.
    pub copy_threads: usize,
    /// `TE_SHM_MAX_CONNECTIONS` (default 1,024).
    pub max_connections: usize,
    /// `TE_SHM_PTRACE_SCOPE_FILE` (default [`DEFAULT_PTRACE_SCOPE_FILE`]); tests point it at a
    /// file to simulate a restrictive or unreadable setting.
    pub ptrace_scope_file: PathBuf,
    /// `TE_SHM_FAULT_PROBE_ERRNO`: fault injection for tests; every connect-time permission probe
    /// fails with this errno as if the kernel had refused it.
    pub fault_probe_errno: Option<i32>,
    /// `TE_SHM_MEMFD` (default on): the engine allocates host memory as sealed memfds and this
    /// transport hands each exported one to connected peers once (`SCM_RIGHTS`), which map it and
    /// copy with the local transport's kernels. Off: allocations are anonymous, no fd is sent,
    /// and received fds are not mapped (everything goes by cross-memory attach).
    pub memfd: bool,
    /// `TE_NT_COPY_MIN_BYTES` (the local transport's, default 2 KiB): copies into a mapped
    /// region of at least this size use non-temporal stores.
    pub nt_copy_min_bytes: u64,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            socket: None,
            timeout: Duration::from_millis(5000),
            allow_uids: Vec::new(),
            inline_bytes: 1 << 20,
            copy_threads: 2,
            max_connections: 1024,
            ptrace_scope_file: PathBuf::from(DEFAULT_PTRACE_SCOPE_FILE),
            fault_probe_errno: None,
            memfd: true,
            nt_copy_min_bytes: te_transport_local::config::DEFAULT_NT_COPY_MIN_BYTES,
        }
    }
}

impl ShmConfig {
    /// Reads the `TE_SHM_*` variables; unset means the default, malformed is an
    /// [`Error::Config`] naming the variable.
    ///
    /// ```
    /// use te_base::config::MapEnv;
    /// use te_transport_shm::ShmConfig;
    ///
    /// let c = ShmConfig::from_env(&MapEnv::new([("TE_SHM_ALLOW_UIDS", "1000,1001")])).unwrap();
    /// assert_eq!(c.allow_uids, vec![1000, 1001]);
    /// assert!(ShmConfig::from_env(&MapEnv::new([("TE_SHM_TIMEOUT_MS", "0")])).is_err());
    /// ```
    pub fn from_env(env: &dyn Env) -> Result<Self> {
        let mut c = ShmConfig::default();
        if let Some(p) = env.get(SOCKET_VAR) {
            if p.is_empty() {
                return Err(Error::config(SOCKET_VAR, p, "empty path"));
            }
            c.socket = Some(PathBuf::from(p));
        }
        if let Some(ms) = parse_var::<u64>(env, TIMEOUT_VAR)? {
            if ms == 0 {
                return Err(Error::config(TIMEOUT_VAR, "0", "must be at least 1"));
            }
            c.timeout = Duration::from_millis(ms);
        }
        if let Some(raw) = env.get(ALLOW_UIDS_VAR) {
            c.allow_uids = raw
                .split(',')
                .map(|u| {
                    u.trim()
                        .parse::<u32>()
                        .map_err(|_| Error::config(ALLOW_UIDS_VAR, raw.clone(), "expected comma-separated uids"))
                })
                .collect::<Result<_>>()?;
        }
        if let Some(b) = parse_bytes(env, INLINE_BYTES_VAR)? {
            c.inline_bytes = b;
        }
        if let Some(n) = parse_var::<usize>(env, COPY_THREADS_VAR)? {
            if n == 0 || n > 64 {
                return Err(Error::config(COPY_THREADS_VAR, n.to_string(), "must be 1..=64"));
            }
            c.copy_threads = n;
        }
        if let Some(n) = parse_var::<usize>(env, MAX_CONNECTIONS_VAR)? {
            if n == 0 {
                return Err(Error::config(MAX_CONNECTIONS_VAR, "0", "must be at least 1"));
            }
            c.max_connections = n;
        }
        if let Some(p) = env.get(PTRACE_SCOPE_FILE_VAR) {
            c.ptrace_scope_file = PathBuf::from(p);
        }
        if let Some(e) = parse_var::<i32>(env, FAULT_PROBE_ERRNO_VAR)? {
            if e <= 0 {
                return Err(Error::config(
                    FAULT_PROBE_ERRNO_VAR,
                    e.to_string(),
                    "an errno is positive",
                ));
            }
            c.fault_probe_errno = Some(e);
        }
        if let Some(on) = te_base::config::parse_bool(env, MEMFD_VAR)? {
            c.memfd = on;
        }
        c.nt_copy_min_bytes = te_transport_local::LocalConfig::from_env(env)?.nt_copy_min_bytes;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::config::MapEnv;

    #[test]
    fn malformed_values_name_the_variable() {
        for (var, value) in [
            (TIMEOUT_VAR, "x"),
            (ALLOW_UIDS_VAR, "1,a"),
            (INLINE_BYTES_VAR, "-1"),
            (MAX_CONNECTIONS_VAR, "0"),
            (COPY_THREADS_VAR, "65"),
            (FAULT_PROBE_ERRNO_VAR, "0"),
            (SOCKET_VAR, ""),
            (MEMFD_VAR, "maybe"),
        ] {
            let e = ShmConfig::from_env(&MapEnv::new([(var, value)])).unwrap_err();
            assert!(e.to_string().contains(var), "{e}");
        }
        assert_eq!(ShmConfig::from_env(&MapEnv::default()).unwrap(), ShmConfig::default());
        assert!(!ShmConfig::from_env(&MapEnv::new([(MEMFD_VAR, "0")])).unwrap().memfd);
    }
}
