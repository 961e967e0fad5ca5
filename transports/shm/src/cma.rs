//! The kernel side: cross-memory attach (`process_vm_writev` / `process_vm_readv`), the Yama
//! setting that decides who may use it, and the one-byte permission probe.

use std::io;
use std::path::Path;

use te_base::TransferOp;

/// The most iovec entries one call takes (the kernel's `UIO_MAXIOV`).
pub const IOV_MAX: usize = 1024;

/// A byte at a fixed address of every process running this library: the target names its address
/// in its handshake reply and the initiator reads it back, so a working probe proves both the
/// permission and that the pid is the process that answered.
pub static PROBE_BYTE: u8 = 0xA5;

/// Yama's `ptrace_scope`, as far as it can be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PtraceScope {
    /// The kernel has no Yama (the file does not exist): the classic rule, same uid, holds.
    NoYama,
    /// 0: same uid; 1: same uid and only a declared tracer (the target names its peers with
    /// `prctl(PR_SET_PTRACER)`); 2: only CAP_SYS_PTRACE; 3: nobody.
    Scope(u32),
    /// The file exists but could not be read or parsed: the connect-time probe decides.
    Unreadable(String),
}

impl PtraceScope {
    /// Reads `path` (normally [`crate::config::DEFAULT_PTRACE_SCOPE_FILE`]).
    pub fn read(path: &Path) -> PtraceScope {
        match std::fs::read_to_string(path) {
            Ok(text) => match text.trim().parse::<u32>() {
                Ok(n) => PtraceScope::Scope(n),
                Err(_) => PtraceScope::Unreadable(format!("{}: {:?} is not a number", path.display(), text.trim())),
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => PtraceScope::NoYama,
            Err(e) => PtraceScope::Unreadable(format!("{}: {e}", path.display())),
        }
    }

    /// Why cross-memory attach between two processes of this user is impossible here, if it is.
    /// Root (CAP_SYS_PTRACE) is allowed at scope 2.
    pub fn refusal(&self) -> Option<String> {
        match self {
            PtraceScope::Scope(n @ 2) if !is_root() => Some(format!(
                "Yama ptrace_scope is {n} (admin-only attach): process_vm_writev needs CAP_SYS_PTRACE"
            )),
            PtraceScope::Scope(n) if *n >= 3 => {
                Some(format!("Yama ptrace_scope is {n}: no process may attach to another"))
            }
            _ => None,
        }
    }

    /// True when the target must name its peer with `prctl(PR_SET_PTRACER)`.
    pub fn needs_declared_tracer(&self) -> bool {
        matches!(self, PtraceScope::Scope(1)) && !is_root()
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Lets any process of our uid attach to this one (Yama scope 1, after a peer authenticated):
/// the classic same-uid rule, for this process only.
pub fn allow_any_tracer() -> io::Result<()> {
    // SAFETY: PR_SET_PTRACER takes a pid (or PR_SET_PTRACER_ANY) and touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads [`PROBE_BYTE`] of process `pid` at `addr`; `fault` injects a refusal (tests).
pub fn probe(pid: u32, addr: u64, fault: Option<i32>) -> io::Result<()> {
    if let Some(errno) = fault {
        return Err(io::Error::from_raw_os_error(errno));
    }
    let mut byte = 0u8;
    let local = libc::iovec {
        iov_base: (&mut byte as *mut u8).cast(),
        iov_len: 1,
    };
    let remote = libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: 1,
    };
    // SAFETY: `local` is one live byte on our stack; the kernel checks `remote` against the
    // target's mappings and fails (never faults us) when it is not mapped there.
    let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n != 1 || byte != PROBE_BYTE {
        return Err(io::Error::other(format!(
            "the probe byte read {byte:#x} ({n} bytes), not {PROBE_BYTE:#x}: pid {pid} is not the process that answered"
        )));
    }
    Ok(())
}

/// One `process_vm_writev` (op write: local to remote) or `process_vm_readv` (read: remote to
/// local) over matching iovec arrays of equal total length. Returns the bytes moved; the kernel
/// stops at the first iovec it cannot complete (it never splits one... except at a fault), so a
/// short count is resolved by the caller request by request.
pub fn vm_copy(pid: u32, op: TransferOp, local: &[libc::iovec], remote: &[libc::iovec]) -> io::Result<usize> {
    debug_assert!(local.len() <= IOV_MAX && remote.len() <= IOV_MAX);
    // SAFETY: every local iovec lies in memory registered with this engine and held for the
    // batch (the engine deregisters only what no batch uses); remote iovecs are checked by the
    // kernel against the target's mappings (EFAULT, never a fault here) and by the caller against
    // the target's exported regions.
    let n = unsafe {
        match op {
            TransferOp::Write => libc::process_vm_writev(
                pid as libc::pid_t,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            ),
            TransferOp::Read => libc::process_vm_readv(
                pid as libc::pid_t,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            ),
        }
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// A pidfd of process `pid` (Linux 5.3+): it stays bound to that process, so a later check
/// cannot be fooled by the pid being given to a new process. `None` where the kernel lacks it.
pub fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Some(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) })
}

/// True once the process behind `pidfd` exited (its pidfd polls readable then). One `poll`
/// with a zero timeout.
pub fn exited(pidfd: &std::os::fd::OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(pidfd),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd, a count of 1, no waiting.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents != 0
}

/// An iovec for `[addr, addr + len)`.
pub fn iovec(addr: u64, len: u64) -> libc::iovec {
    libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: len as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_file_is_read_strictly() {
        let dir = std::env::temp_dir().join(format!("te-shm-scope-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("scope");
        std::fs::write(&f, "3\n").unwrap();
        assert_eq!(PtraceScope::read(&f), PtraceScope::Scope(3));
        assert!(PtraceScope::read(&f).refusal().is_some());
        std::fs::write(&f, "x").unwrap();
        assert!(matches!(PtraceScope::read(&f), PtraceScope::Unreadable(_)));
        assert_eq!(PtraceScope::read(&dir.join("absent")), PtraceScope::NoYama);
        assert!(PtraceScope::Scope(0).refusal().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_pidfd_tells_an_exited_process() {
        let mut child = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let Some(fd) = pidfd_open(child.id()) else {
            eprintln!("skipped: this kernel has no pidfd_open");
            let _ = child.kill();
            let _ = child.wait();
            return;
        };
        assert!(!exited(&fd));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(exited(&fd));
    }

    #[test]
    fn probe_reads_our_own_byte() {
        probe(std::process::id(), &PROBE_BYTE as *const u8 as u64, None).unwrap();
        let e = probe(std::process::id(), &PROBE_BYTE as *const u8 as u64, Some(libc::EPERM)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
    }
}
