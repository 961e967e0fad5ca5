//! The initiator's connection to one target instance: the handshake, the target's live export
//! list (kept current by its updates), notifications, and the copy loop itself.

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use te_base::auth::{self, AuthKey, HandshakeError, HandshakeFrames, Step};
use te_base::notify::{Outcome, MAX_PAYLOAD_LIMIT};
use te_base::shared_memory::{map_sealed, SharedMapping};
use te_base::{BatchAborts, BatchState, Error, ResolvedRequest, Result, TransferOp};
use te_transport_local::copy::{copy_ops, NtKernel};
use te_transport_local::plan::CopyOp;

use crate::cma::{self, IOV_MAX};
use crate::endpoint::ShmEndpoint;
use crate::serve::AUTH_CONTEXT;
use crate::socket::{address, peer_cred, read_frame_fd, write_frame};
use crate::wire::{decode_ranges, decode_region_fd, refusal, Header, Opcode};

/// Largest number of bytes one system call is asked to move: the export list's read lock is
/// offered to a waiting revocation between calls, so this bounds how long a revocation waits
/// for a running copy (64 MiB: a few tens of milliseconds; the per-call cost is nothing at this
/// size).
const MAX_CALL_BYTES: u64 = 64 << 20;

/// One range the target exports, and our shared mapping of it when the target sent its sealed
/// memfd (then copies go through the mapping with the local transport's kernels; otherwise by
/// cross-memory attach).
pub(crate) struct Export {
    base: u64,
    len: u64,
    map: Option<SharedMapping>,
}

/// Bytes copied by each route, over every connection of one transport (updated once per copy
/// call, never per request).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub mapped_bytes: AtomicU64,
    pub cma_bytes: AtomicU64,
    pub fds_refused: AtomicU64,
}

/// The route of one group of requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Mapped,
    Cma(TransferOp),
}

/// A notification waiting for the target's answer.
struct PendingNote {
    done: Arc<BatchState>,
    index: usize,
    len: usize,
}

/// An open control connection to one target instance, shared by every peer opened on it.
pub(crate) struct Connection {
    /// The target segment's name (for errors).
    pub name: String,
    /// The target's pid, as the kernel reported it for the socket.
    pub pid: u32,
    writer: Mutex<UnixStream>,
    /// The socket's descriptor (owned by `writer`), to shut it down without waiting for a
    /// writer that is blocked on it.
    fd: i32,
    /// A pidfd of the target, checked before every system call: a pid given to a new process
    /// after the target exited is never written to (`None` on kernels before 5.3: the control
    /// socket's closing is the only sign then).
    pidfd: Option<std::os::fd::OwnedFd>,
    /// The ranges the target exports right now, sorted by base. A copy holds the read lock
    /// from its check through its system call and yields it to a waiting revocation between
    /// calls, so applying a revocation (write lock) waits for the calls in flight only and, once
    /// it is acknowledged, no byte of the revoked range is touched again.
    exports: RwLock<Vec<Export>>,
    /// Mappings of memfds received ahead of the update that exports their range.
    pending: Mutex<Vec<(u64, u64, SharedMapping)>>,
    /// Map the memfds the target sends (`TE_SHM_MEMFD`).
    map_memfd: bool,
    kernel: NtKernel,
    nt_min: u64,
    counters: Arc<Counters>,
    killed: AtomicBool,
    /// Set (before `killed`) once the target process is known to have exited: a copy failed
    /// with ESRCH, or its pidfd polled readable. Its memory went with it, so what is left of a
    /// batch fails for good at once instead of failing over to another route, which reaches the
    /// same dead process and would wait for its sockets to close: the kernel closes those only
    /// after tearing the whole address space down (`exit_mm` before `exit_files`).
    exited: AtomicBool,
    /// The target's probe byte (its welcome names it): read again when the control socket hangs
    /// up, to tell an exit (ESRCH) from a target that closed the connection and lives on.
    probe_addr: u64,
    error: Mutex<Option<Error>>,
    notes: Mutex<HashMap<u64, PendingNote>>,
    next_note: AtomicU64,
    /// Batches cut short by their deadline (checked between system calls).
    aborts: BatchAborts,
}

/// Why a connection attempt failed.
pub(crate) enum ConnectError {
    /// Cross-memory attach is not permitted with this peer (uid, Yama, probe): fall back.
    NotPermitted(String),
    /// The socket's owner is another instance (the target restarted).
    Restarted(String),
    /// The key check failed.
    Unauthenticated(String),
    /// Anything else (no such socket, timeout, protocol error).
    Other(String),
}

impl ConnectError {
    pub fn into_error(self, peer: &str) -> Error {
        match self {
            ConnectError::NotPermitted(r) => Error::not_available(format!("shm route to {peer}"), r),
            ConnectError::Restarted(r) => Error::PeerGone {
                peer: peer.to_string(),
                reason: r,
            },
            ConnectError::Unauthenticated(r) => Error::Unauthenticated {
                peer: peer.to_string(),
                reason: r,
            },
            ConnectError::Other(r) => Error::PeerGone {
                peer: peer.to_string(),
                reason: format!("shm: {r}"),
            },
        }
    }
}

/// Settings of a connection attempt.
pub(crate) struct ConnectSettings {
    pub timeout: Duration,
    pub auth: Option<AuthKey>,
    pub allow_uids: Vec<u32>,
    pub fault_probe_errno: Option<i32>,
    /// Map the sealed memfds the target sends (`TE_SHM_MEMFD`).
    pub map_memfd: bool,
    /// The local transport's copy kernel and non-temporal threshold, for mapped regions.
    pub kernel: NtKernel,
    pub nt_min: u64,
    pub counters: Arc<Counters>,
}

impl Connection {
    /// Connects to `ep`, checks who answered, authenticates, reads the exported ranges and
    /// probes the permission to attach. Blocking; bounded by `s.timeout` per step.
    pub fn open(
        name: &str,
        ep: &ShmEndpoint,
        s: &ConnectSettings,
    ) -> std::result::Result<Arc<Connection>, ConnectError> {
        let other = |e: std::io::Error| ConnectError::Other(format!("{}: {e}", ep.socket));
        let addr = address(&ep.socket).map_err(other)?;
        let mut stream = UnixStream::connect_addr(&addr).map_err(other)?;
        stream.set_read_timeout(Some(s.timeout)).map_err(other)?;
        stream.set_write_timeout(Some(s.timeout)).map_err(other)?;
        let cred = peer_cred(&stream).map_err(other)?;
        let own = cma::euid();
        if cred.uid != own && !s.allow_uids.contains(&cred.uid) {
            return Err(ConnectError::NotPermitted(format!(
                "the target runs as uid {}, this engine as uid {own} (cross-memory attach follows the uid; TE_SHM_ALLOW_UIDS)",
                cred.uid
            )));
        }
        if cred.pid != ep.pid {
            return Err(ConnectError::Restarted(format!(
                "process {} listens on {}, not {} as the descriptor says (the target restarted)",
                cred.pid, ep.socket, ep.pid
            )));
        }
        // Opened before the probe below, which then proves this pid is the process that answered.
        let pidfd = cma::pidfd_open(cred.pid);
        let hello = Header {
            a: ep.token,
            b: s.auth.is_some() as u64,
            ..Header::new(Opcode::Hello)
        };
        // Memfds of the exported regions arrive ahead of the welcome; they are mapped only once
        // the welcome (and the probe) accepted this target.
        let mut fds = Vec::new();
        let mut frames = HelloFrames {
            stream: &mut stream,
            hello,
            fds: &mut fds,
            wrote: Ok(()),
        };
        let (h, body) = match &s.auth {
            None => {
                frames.send_hello(&[]);
                frames.reply().map_err(other)?
            }
            // The shared-key handshake (te_base::auth); then the target's welcome or refusal.
            Some(key) => match auth::block_on(auth::initiate(&mut frames, key, AUTH_CONTEXT, name)) {
                Ok(()) => frames.reply().map_err(other)?,
                Err(HandshakeError::Frames(HelloError::Io(e))) => return Err(other(e)),
                Err(HandshakeError::Frames(HelloError::Reply(h, _))) if h.op == Opcode::Welcome => {
                    return Err(ConnectError::Unauthenticated(
                        "the target does not authenticate (it has no key)".into(),
                    ))
                }
                // A refusal (or another frame), decided below.
                Err(HandshakeError::Frames(HelloError::Reply(h, body))) => (h, body),
                Err(HandshakeError::Malformed { .. }) => {
                    return Err(ConnectError::Other("unexpected Challenge reply to HELLO".into()))
                }
                Err(HandshakeError::Unauthenticated(_)) => {
                    return Err(ConnectError::Unauthenticated(
                        "the target does not hold this engine's key".into(),
                    ))
                }
            },
        };
        match h.op {
            Opcode::Welcome if h.a == ep.token && body.len() >= 8 => {}
            Opcode::Refuse => {
                let text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
                return Err(match h.code {
                    refusal::WRONG_INSTANCE => ConnectError::Restarted(text),
                    refusal::UNAUTHENTICATED => ConnectError::Unauthenticated(text),
                    refusal::UID => ConnectError::NotPermitted(text),
                    _ => ConnectError::Other(text),
                });
            }
            op => return Err(ConnectError::Other(format!("unexpected {op:?} reply to HELLO"))),
        }
        let ranges = decode_ranges(&body[8..]).map_err(|e| ConnectError::Other(format!("bad welcome: {e}")))?;
        // The permission itself: one byte read from the target's probe address.
        cma::probe(ep.pid, h.b, s.fault_probe_errno).map_err(|e| {
            ConnectError::NotPermitted(format!(
                "process_vm_readv of process {} refused: {e} (cross-memory attach needs ptrace permission: same uid, Yama ptrace_scope 0 or 1, no seccomp filter denying it)",
                ep.pid
            ))
        })?;
        let reader = stream.try_clone().map_err(other)?;
        reader.set_read_timeout(None).map_err(other)?;
        let conn = Arc::new(Connection {
            name: name.to_string(),
            pid: ep.pid,
            fd: stream.as_raw_fd(),
            pidfd,
            writer: Mutex::new(stream),
            exports: RwLock::new(Vec::new()),
            pending: Mutex::new(Vec::new()),
            map_memfd: s.map_memfd,
            kernel: s.kernel,
            nt_min: s.nt_min,
            counters: s.counters.clone(),
            killed: AtomicBool::new(false),
            exited: AtomicBool::new(false),
            probe_addr: h.b,
            error: Mutex::new(None),
            notes: Mutex::new(HashMap::new()),
            next_note: AtomicU64::new(1),
            aborts: BatchAborts::default(),
        });
        for (h, fd_body, fd) in fds {
            conn.received_fd(&h, &fd_body, fd);
        }
        conn.apply(false, &ranges);
        let weak = Arc::downgrade(&conn);
        std::thread::Builder::new()
            .name("te-shm-control".into())
            .spawn(move || read_loop(weak, reader))
            .map_err(|e| ConnectError::Other(format!("starting the control thread: {e}")))?;
        Ok(conn)
    }

    /// True until the connection was cut.
    pub fn is_healthy(&self) -> bool {
        !self.killed.load(Ordering::Acquire)
    }

    /// Before a system call: still connected, and the target process still alive (its pidfd).
    fn may_copy(&self) -> bool {
        if !self.is_healthy() {
            return false;
        }
        if self.pidfd.as_ref().is_some_and(cma::exited) {
            self.process_exited();
            return false;
        }
        true
    }

    /// True when the target process is gone: its pidfd polls readable, or a read of its probe
    /// byte fails with ESRCH (its address space is detached, which a killed process's is before
    /// its sockets close).
    fn target_exited(&self) -> bool {
        self.pidfd.as_ref().is_some_and(cma::exited)
            || cma::probe(self.pid, self.probe_addr, None).is_err_and(|e| e.raw_os_error() == Some(libc::ESRCH))
    }

    /// The target process exited: the connection is cut with the error that says so, and
    /// requests fail for good from now on ([`Connection::fail_rest`]).
    fn process_exited(&self) {
        self.exited.store(true, Ordering::Release);
        self.kill(self.gone("the process exited"));
    }

    /// Fails `indices` of `batch` with `err`: past the engine's failover once the process
    /// exited (no route reaches its memory any more), through it otherwise.
    fn fail_rest(&self, batch: &BatchState, indices: impl IntoIterator<Item = usize>, err: &Error) {
        if self.exited.load(Ordering::Acquire) {
            for i in indices {
                batch.fail_final(i, err.clone());
            }
        } else {
            batch.fail_many(indices, err);
        }
    }

    /// The error requests fail with once the connection is cut.
    fn cut_error(&self) -> Error {
        self.error
            .lock()
            .clone()
            .unwrap_or_else(|| self.gone("the connection was cut"))
    }

    fn gone(&self, reason: &str) -> Error {
        Error::PeerGone {
            peer: self.name.clone(),
            reason: format!("shm (process {}): {reason}", self.pid),
        }
    }

    /// Cuts the connection: later and queued copies fail with `err`, pending notifications too.
    /// A copy inside a system call finishes that call first (it never blocks on the peer).
    pub fn kill(&self, err: Error) {
        // The error is in place before `killed` shows, so whoever sees the cut names its reason.
        {
            let mut error = self.error.lock();
            if error.is_some() {
                return;
            }
            *error = Some(err.clone());
        }
        self.killed.store(true, Ordering::Release);
        // SAFETY: `fd` is the open socket `writer` owns for as long as `self` lives; shutting it
        // down wakes every thread blocked on it and closes nothing.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
        let pending: Vec<PendingNote> = self.notes.lock().drain().map(|(_, p)| p).collect();
        for p in pending {
            p.done.fail(p.index, err.clone());
        }
    }

    /// Cuts `batch` short: its copies (queued, or running on any thread) stop before their next
    /// system call and fail what is left with `err`; other batches go on, the connection stays.
    pub fn abort_batch(&self, batch: &Arc<BatchState>, err: Error) {
        self.aborts.abort(batch, err);
    }

    /// Sends a notification; its answer settles `done[index]`.
    pub fn notify(&self, body: &[u8], payload_len: usize, done: &Arc<BatchState>, index: usize) -> Result<()> {
        if !self.is_healthy() {
            return Err(self.cut_error());
        }
        let seq = self.next_note.fetch_add(1, Ordering::Relaxed);
        self.notes.lock().insert(
            seq,
            PendingNote {
                done: done.clone(),
                index,
                len: payload_len,
            },
        );
        let h = Header {
            a: seq,
            ..Header::new(Opcode::Note)
        };
        let written = write_frame(&mut self.writer.lock(), h, body);
        if let Err(e) = written {
            // Nothing went out, so the note is ours to fail unless a kill already drained it:
            // taken back before our own kill, which would otherwise fail it (or, when another
            // kill drained the notes before the insert, nobody would). A kill shuts the socket
            // down before it drains, so a written frame always has its note in the map.
            let mine = self.notes.lock().remove(&seq).is_some();
            self.kill(self.gone(&format!("sending a notification: {e}")));
            if mine {
                return Err(self.cut_error());
            }
        }
        Ok(())
    }

    /// What a failed copy of `r` means, and whether it cuts the connection. ESRCH (the target
    /// process exited, or at least its address space is gone) is handled by the caller.
    fn error_of(&self, e: &std::io::Error, r: &ResolvedRequest) -> (Error, bool) {
        match e.raw_os_error() {
            Some(libc::EFAULT) => (
                Error::Refused {
                    peer: self.name.clone(),
                    reason: format!(
                        "[{:#x}, +{}) is not mapped in the target process any more",
                        r.remote_addr, r.len
                    ),
                },
                false,
            ),
            Some(libc::EPERM) => (
                Error::Refused {
                    peer: self.name.clone(),
                    reason: format!("the kernel refused cross-memory attach: {e}"),
                },
                true,
            ),
            _ => (
                Error::transport("shm", format!("process_vm_{}v: {e}", verb(r.op))),
                false,
            ),
        }
    }

    /// Copies every request of `reqs` (already checked against the descriptor and local
    /// registrations) and settles each on `batch`. One read lock of the export list (offered to
    /// a waiting revocation between calls), and one system call per up to [`IOV_MAX`] requests
    /// of one direction (adjacent ones coalesced).
    pub fn run(&self, reqs: &[ResolvedRequest], batch: &BatchState) {
        let mut exports = self.exports.read();
        let (mut mapped, mut kernel_copied) = (0u64, 0u64);
        SCRATCH.with(|cell| {
            let mut guard = cell.borrow_mut();
            let s = &mut *guard;
            let mut i = 0;
            while i < reqs.len() {
                // A revocation waiting for the lock applies here, before the next check.
                RwLockReadGuard::bump(&mut exports);
                if !self.may_copy() {
                    let err = self.cut_error();
                    self.fail_rest(batch, reqs[i..].iter().map(|r| r.index as usize), &err);
                    return;
                }
                if let Some(err) = self.aborts.error_of(batch) {
                    batch.fail_many(reqs[i..].iter().map(|r| r.index as usize), &err);
                    return;
                }
                s.clear();
                let mut total = 0u64;
                // One group: consecutive requests of one route (mapped, or cross-memory attach
                // in one direction), up to IOV_MAX copies or MAX_CALL_BYTES.
                let mut route: Option<Route> = None;
                while i < reqs.len() && s.local.len() < IOV_MAX && s.ops.len() < IOV_MAX {
                    let r = &reqs[i];
                    let Some(e) = find(&exports, r.remote_addr, r.len) else {
                        batch.fail(
                            r.index as usize,
                            Error::Refused {
                                peer: self.name.clone(),
                                reason: format!(
                                    "[{:#x}, +{}) is not exported by the target any more (deregistered)",
                                    r.remote_addr, r.len
                                ),
                            },
                        );
                        i += 1;
                        continue;
                    };
                    let this = match e.map {
                        Some(_) => Route::Mapped,
                        None => Route::Cma(r.op),
                    };
                    if route.is_some_and(|x| x != this) {
                        break;
                    }
                    if !s.members.is_empty() && total + r.len > MAX_CALL_BYTES {
                        break;
                    }
                    route = Some(this);
                    if let Some(m) = &e.map {
                        // The same bytes in our mapping of the target's memfd.
                        let at = m.addr() + (r.remote_addr - e.base);
                        let (dst, src) = match r.op {
                            TransferOp::Write => (at, r.local_addr),
                            TransferOp::Read => (r.local_addr, at),
                        };
                        match s.ops.last_mut() {
                            Some(c) if c.dst + c.len == dst && c.src + c.len == src => c.len += r.len,
                            _ => s.ops.push(CopyOp { dst, src, len: r.len }),
                        }
                    } else {
                        let (l, rm) = (s.local.last_mut(), s.remote.last_mut());
                        match (l, rm) {
                            (Some(l), Some(rm))
                                if l.iov_base as u64 + l.iov_len as u64 == r.local_addr
                                    && rm.iov_base as u64 + rm.iov_len as u64 == r.remote_addr =>
                            {
                                l.iov_len += r.len as usize;
                                rm.iov_len += r.len as usize;
                            }
                            _ => {
                                s.local.push(cma::iovec(r.local_addr, r.len));
                                s.remote.push(cma::iovec(r.remote_addr, r.len));
                            }
                        }
                    }
                    s.members.push(i);
                    total += r.len;
                    i += 1;
                }
                match route {
                    None => continue,
                    Some(Route::Mapped) => {
                        // SAFETY: every source and destination lies in registered local memory
                        // (checked at submit, held for the batch) or in a live mapping of the
                        // target's sealed memfd (kept mapped by the export list's read lock held
                        // here; sealed, so no page of it can vanish).
                        unsafe { copy_ops(&s.ops, self.kernel, self.nt_min) };
                        batch.complete_many(s.members.iter().map(|&m| reqs[m].index as usize));
                        mapped += total;
                    }
                    Some(Route::Cma(op)) => {
                        kernel_copied += total;
                        match cma::vm_copy(self.pid, op, &s.local, &s.remote) {
                            Ok(n) if n as u64 == total => {
                                batch.complete_many(s.members.iter().map(|&m| reqs[m].index as usize));
                            }
                            first => self.settle_one_by_one(reqs, &s.members, first, batch),
                        }
                    }
                }
            }
        });
        if mapped > 0 {
            self.counters.mapped_bytes.fetch_add(mapped, Ordering::Relaxed);
        }
        if kernel_copied > 0 {
            self.counters.cma_bytes.fetch_add(kernel_copied, Ordering::Relaxed);
        }
    }

    /// Regions of this target we hold a mapping of.
    pub fn mapped_regions(&self) -> usize {
        self.exports.read().iter().filter(|e| e.map.is_some()).count()
    }

    /// A memfd the target sent for `[h.a, +h.b)`: checks its seals and maps it, kept until the
    /// update that exports the range. Refused (not mapped; the range goes by cross-memory attach)
    /// without both seals, or when `TE_SHM_MEMFD` is off.
    fn received_fd(&self, h: &Header, body: &[u8], fd: Option<std::os::fd::OwnedFd>) {
        let (Ok((base, len, offset)), Some(fd)) = (decode_region_fd(h, body), fd) else {
            tracing::warn!(segment = %self.name, "shm: a region fd frame without a valid range or descriptor; ignored");
            self.counters.fds_refused.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if !self.map_memfd {
            return;
        }
        if self.pending.lock().len() >= crate::wire::MAX_RANGES {
            tracing::warn!(segment = %self.name, "shm: too many region fds ahead of their updates; refused");
            self.counters.fds_refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match map_sealed(std::os::fd::AsFd::as_fd(&fd), offset, len) {
            Ok(m) => self.pending.lock().push((base, len, m)),
            Err(why) => {
                self.counters.fds_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    segment = %self.name,
                    "shm: not mapping the memfd of [{base:#x}, +{len}): {why}; it goes by cross-memory attach"
                );
            }
        }
    }

    /// After a short or failed call: completes what the call moved, then copies each remaining
    /// request on its own so a failure settles only its own request.
    fn settle_one_by_one(
        &self,
        reqs: &[ResolvedRequest],
        members: &[usize],
        first: std::io::Result<usize>,
        batch: &BatchState,
    ) {
        if first.as_ref().err().and_then(std::io::Error::raw_os_error) == Some(libc::ESRCH) {
            // The kernel detaches a killed process's address space first thing: the earliest
            // sign of its death, well before its sockets close.
            self.process_exited();
        }
        let mut moved = first.as_ref().map(|n| *n as u64).unwrap_or(0);
        for &m in members {
            let r = &reqs[m];
            if moved >= r.len {
                moved -= r.len;
                batch.complete(r.index as usize);
                continue;
            }
            moved = 0;
            if !self.may_copy() {
                self.fail_rest(batch, [r.index as usize], &self.cut_error());
                continue;
            }
            if let Some(err) = self.aborts.error_of(batch) {
                batch.fail(r.index as usize, err);
                continue;
            }
            let mut off = 0u64;
            let outcome = loop {
                if off == r.len {
                    break Ok(());
                }
                let len = (r.len - off).min(MAX_CALL_BYTES);
                let l = [cma::iovec(r.local_addr + off, len)];
                let rm = [cma::iovec(r.remote_addr + off, len)];
                match cma::vm_copy(self.pid, r.op, &l, &rm) {
                    Ok(0) => break Err(std::io::Error::from_raw_os_error(libc::EFAULT)),
                    Ok(n) => off += n as u64,
                    Err(e) => break Err(e),
                }
            };
            match outcome {
                Ok(()) => batch.complete(r.index as usize),
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                    self.process_exited();
                    self.fail_rest(batch, [r.index as usize], &self.cut_error());
                }
                Err(e) => {
                    let (err, fatal) = self.error_of(&e, r);
                    if fatal {
                        self.kill(err.clone());
                    }
                    batch.fail(r.index as usize, err);
                }
            }
        }
    }

    /// Applies a region update. A revoked range leaves the list and its mapping is unmapped
    /// here, under the write lock: no copy is in flight on it, and none starts again.
    fn apply(&self, revoke: bool, ranges: &[(u64, u64)]) {
        let mut unmapped = Vec::new();
        let mut pending = self.pending.lock();
        let mut ex = self.exports.write();
        for &(base, len) in ranges {
            let at = ex.partition_point(|e| e.base < base);
            let here = ex.get(at).is_some_and(|e| e.base == base && e.len == len);
            // A mapping received for this range is used by an add and dropped by a revoke.
            let map = pending
                .iter()
                .position(|p| p.0 == base && p.1 == len)
                .map(|k| pending.swap_remove(k).2);
            if revoke {
                if here {
                    unmapped.push(ex.remove(at));
                }
                unmapped.extend(map.map(|m| Export {
                    base,
                    len,
                    map: Some(m),
                }));
            } else if here {
                if map.is_some() {
                    ex[at].map = map;
                }
            } else {
                ex.insert(at, Export { base, len, map });
            }
        }
        drop(ex);
        drop(pending);
        // Unmapped here, after the write lock: no copy was in flight on them when they left
        // the list, and none can find them again.
        drop(unmapped);
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Ends the control thread (it holds only a weak reference).
        // SAFETY: `fd` is still the open socket `writer` owns (it is closed after this body).
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
        // Notifications still waiting for their answer would never get one.
        let err = Error::Closed(format!("the shm connection to '{}'", self.name));
        for (_, p) in self.notes.get_mut().drain() {
            p.done.fail(p.index, err.clone());
        }
    }
}

fn verb(op: TransferOp) -> &'static str {
    match op {
        TransferOp::Write => "write",
        TransferOp::Read => "read",
    }
}

/// The range of `exports` (sorted by base) that holds `[addr, addr + len)`, if one does.
fn find(exports: &[Export], addr: u64, len: u64) -> Option<&Export> {
    let idx = exports.partition_point(|e| e.base <= addr);
    let e = exports.get(idx.checked_sub(1)?)?;
    (len <= e.len && addr - e.base <= e.len - len).then_some(e)
}

/// Per-thread iovec arrays, reused by every batch the thread copies (no allocation per batch
/// once warm).
struct Scratch {
    local: Vec<libc::iovec>,
    remote: Vec<libc::iovec>,
    ops: Vec<CopyOp>,
    members: Vec<usize>,
}

impl Scratch {
    fn clear(&mut self) {
        self.local.clear();
        self.remote.clear();
        self.ops.clear();
        self.members.clear();
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch {
        local: Vec::with_capacity(IOV_MAX),
        remote: Vec::with_capacity(IOV_MAX),
        ops: Vec::with_capacity(IOV_MAX),
        members: Vec::with_capacity(IOV_MAX),
    });
}

/// The control thread: applies the target's region updates (and confirms them), settles
/// notifications, and cuts the connection when the target goes away.
fn read_loop(conn: Weak<Connection>, mut stream: UnixStream) {
    let why = loop {
        let (h, body, fd) = match read_frame_fd(&mut stream) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break "the target closed the connection".to_string()
            }
            Err(e) => break format!("control connection: {e}"),
        };
        let Some(c) = conn.upgrade() else { return };
        match h.op {
            Opcode::RegionFd => c.received_fd(&h, &body, fd),
            Opcode::Regions => {
                let Ok(ranges) = decode_ranges(&body) else {
                    break "malformed region update".into();
                };
                c.apply(h.code == 1, &ranges);
                let ack = Header {
                    a: h.a,
                    ..Header::new(Opcode::Ack)
                };
                if write_frame(&mut c.writer.lock(), ack, &[]).is_err() {
                    break "cannot confirm a region update".into();
                }
            }
            Opcode::NoteAck => {
                let pending = c.notes.lock().remove(&h.a);
                if let Some(p) = pending {
                    let outcome = Outcome::from_code(h.code).unwrap_or(Outcome::Malformed);
                    outcome.settle(
                        &p.done,
                        p.index,
                        (&c.name, p.len, (h.b as usize).min(MAX_PAYLOAD_LIMIT)),
                        || Error::transport("shm", "the target could not decode the notification"),
                    );
                }
            }
            op => break format!("unexpected {op:?} frame"),
        }
    };
    if let Some(c) = conn.upgrade() {
        // A hang-up can beat every copy to the news of an exit (when a copy in flight held the
        // last reference to the target's memory, its thread tears it down and the process is
        // gone at once): then too the rest fails for good.
        if c.target_exited() {
            c.process_exited();
        } else {
            let err = c.gone(&why);
            c.kill(err);
        }
    }
}

/// Reads a handshake reply, setting aside the memfd frames that come ahead of the welcome.
/// Why the initiator's side of the handshake stopped short of the target's challenge.
enum HelloError {
    /// The socket failed.
    Io(std::io::Error),
    /// The target answered the HELLO with another frame than a challenge: a welcome (it has no
    /// key) or a refusal, for the caller to decide on.
    Reply(Header, Vec<u8>),
}

/// The initiator's handshake frames: HELLO (with the instance token, and the nonce as its body),
/// then the target's CHALLENGE in and the PROOF out. Memfds that arrive ahead of the welcome are
/// collected in `fds`.
struct HelloFrames<'a> {
    stream: &'a mut UnixStream,
    hello: Header,
    fds: &'a mut Vec<(Header, Vec<u8>, Option<std::os::fd::OwnedFd>)>,
    /// The HELLO's write: a target that refuses us by uid answers at once and closes, which can
    /// fail this write (EPIPE) while its REFUSE waits to be read, so the reply decides, the
    /// write error only when there is none.
    wrote: std::io::Result<()>,
}

impl HelloFrames<'_> {
    fn send_hello(&mut self, body: &[u8]) {
        self.wrote = write_frame(self.stream, self.hello, body);
    }

    /// The next frame other than a memfd (whose frames arrive ahead of the welcome).
    fn reply(&mut self) -> std::io::Result<(Header, Vec<u8>)> {
        read_reply(self.stream, self.fds).map_err(|e| std::mem::replace(&mut self.wrote, Ok(())).err().unwrap_or(e))
    }
}

impl HandshakeFrames for HelloFrames<'_> {
    type Error = HelloError;

    async fn send(&mut self, step: Step, body: &[u8]) -> std::result::Result<(), HelloError> {
        match step {
            Step::Hello => {
                self.send_hello(body);
                Ok(())
            }
            _ => write_frame(self.stream, Header::new(Opcode::Proof), body).map_err(HelloError::Io),
        }
    }

    /// The initiator receives one step, the CHALLENGE.
    async fn recv(&mut self, _: Step) -> std::result::Result<Vec<u8>, HelloError> {
        match self.reply().map_err(HelloError::Io)? {
            (h, body) if h.op == Opcode::Challenge => Ok(body),
            (h, body) => Err(HelloError::Reply(h, body)),
        }
    }
}

fn read_reply(
    stream: &mut UnixStream,
    fds: &mut Vec<(Header, Vec<u8>, Option<std::os::fd::OwnedFd>)>,
) -> std::io::Result<(Header, Vec<u8>)> {
    loop {
        let (h, body, fd) = read_frame_fd(stream)?;
        if h.op != Opcode::RegionFd {
            return Ok((h, body));
        }
        if fds.len() >= crate::wire::MAX_RANGES {
            return Err(std::io::Error::other("too many region fds before the welcome"));
        }
        fds.push((h, body, fd));
    }
}

#[cfg(test)]
mod tests {
    use super::{find, Export};

    fn exported(ex: &[Export], addr: u64, len: u64) -> bool {
        find(ex, addr, len).is_some()
    }

    #[test]
    fn export_checks_are_overflow_safe() {
        let ex = [(0x1000, 0x100), (0x3000, 0x10)].map(|(base, len)| Export { base, len, map: None });
        assert!(exported(&ex, 0x1000, 0x100));
        assert!(exported(&ex, 0x30ff - 0xf0, 1));
        assert!(!exported(&ex, 0x10ff, 2));
        assert!(!exported(&ex, 0x2000, 1));
        assert!(!exported(&ex, 0xfff, 1));
        assert!(!exported(&ex, 0x1001, u64::MAX));
        assert!(!exported(&ex, u64::MAX, 1));
    }
}
