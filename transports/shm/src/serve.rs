//! The target's side: the control listener, the handshake (peer credentials, instance token,
//! shared key), and the exported-region updates every connected initiator must confirm.
//!
//! Data never crosses these sockets: initiators copy with `process_vm_writev/readv`. What the
//! target controls is which ranges its peers' engines will touch: each connection learns the
//! exported ranges at its handshake and every change after it, and a deregistration returns only
//! once every connected initiator confirmed it (or was cut off at the deadline).

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use te_base::auth::{self, AuthKey, HandshakeError, HandshakeFrames, Step, NONCE_LEN};
use te_base::notify::Outcome;
use te_base::shared_memory::MemfdRange;
use te_base::{NotifyInbox, RegionId, RegionInfo};

use crate::cma::{self, PtraceScope};
use crate::socket::{peer_cred, read_frame, write_frame, write_frame_fd};
use crate::wire::{encode_ranges, refusal, Header, Opcode, MAX_RANGES};

/// The authentication context of this transport's handshake.
pub(crate) const AUTH_CONTEXT: &str = "te-shm-control-v1";

/// One exported region: its range, and the sealed memfd behind it when the engine allocated it
/// as one (sent to every initiator once, which maps it).
struct Exported {
    base: u64,
    len: u64,
    memfd: Option<MemfdRange>,
}

/// Regions the target exports, and the epoch of the last change.
#[derive(Default)]
struct Exports {
    regions: BTreeMap<RegionId, Exported>,
    epoch: u64,
}

/// One accepted, authenticated connection.
pub(crate) struct Served {
    writer: Mutex<UnixStream>,
    /// The socket's descriptor (owned by `writer`), to cut it without waiting for its lock.
    fd: i32,
    /// The last region epoch the initiator confirmed.
    acked: tokio::sync::watch::Sender<u64>,
    alive: AtomicBool,
    pid: u32,
}

impl Served {
    fn cut(&self) {
        self.alive.store(false, Ordering::SeqCst);
        // SAFETY: `fd` is the open socket `writer` owns for as long as `self` lives; shutting it
        // down wakes threads blocked on it and closes nothing.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
    }
}

/// The serving side of one transport.
pub(crate) struct Server {
    pub token: u64,
    pub auth: Option<AuthKey>,
    pub allow_uids: Vec<u32>,
    pub timeout: Duration,
    pub max_connections: usize,
    pub inbox: Arc<NotifyInbox>,
    pub scope: PtraceScope,
    /// `TE_SHM_MEMFD`: hand the memfds of exported engine-allocated regions to initiators.
    pub share_memfd: bool,
    exports: Mutex<Exports>,
    conns: Mutex<Vec<Arc<Served>>>,
    open: AtomicUsize,
    tracer_declared: AtomicBool,
    stopped: AtomicBool,
}

impl Server {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        token: u64,
        auth: Option<AuthKey>,
        allow_uids: Vec<u32>,
        timeout: Duration,
        max_connections: usize,
        inbox: Arc<NotifyInbox>,
        scope: PtraceScope,
        share_memfd: bool,
    ) -> Server {
        Server {
            token,
            auth,
            allow_uids,
            timeout,
            max_connections,
            inbox,
            scope,
            share_memfd,
            exports: Mutex::new(Exports::default()),
            conns: Mutex::new(Vec::new()),
            open: AtomicUsize::new(0),
            tracer_declared: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        }
    }

    /// Connections served right now.
    pub fn connections(&self) -> usize {
        self.conns
            .lock()
            .iter()
            .filter(|c| c.alive.load(Ordering::SeqCst))
            .count()
    }

    /// Adds (`add`) or revokes exported host regions, tells every connection, and waits until
    /// each confirmed or was cut at the deadline.
    pub async fn update(&self, regions: &[RegionInfo], add: bool) {
        let (epoch, waiting) = {
            let mut ex = self.exports.lock();
            let mut changed = Vec::with_capacity(regions.len());
            let mut fds = Vec::new();
            for r in regions.iter().filter(|r| r.exported && r.location.is_host()) {
                let hit = if add {
                    // Memory the engine allocated as a sealed memfd (never a register_raw range
                    // of foreign memory: only HostBuffers are listed).
                    let memfd = self
                        .share_memfd
                        .then(|| te_base::shared_memory::memfd_of(r.base, r.len))
                        .flatten();
                    let e = Exported {
                        base: r.base,
                        len: r.len,
                        memfd: memfd.clone(),
                    };
                    let new = ex.regions.insert(r.id, e).is_none();
                    if let (true, Some(m)) = (new, memfd) {
                        fds.push((r.base, r.len, m));
                    }
                    new
                } else {
                    ex.regions.remove(&r.id).is_some()
                };
                if hit {
                    changed.push((r.base, r.len));
                }
            }
            if changed.is_empty() {
                return;
            }
            ex.epoch += 1;
            let epoch = ex.epoch;
            // Sent under the exports lock so every connection sees the changes in epoch order
            // and a connection being welcomed gets either the old snapshot and this update, or
            // the new snapshot.
            let conns: Vec<Arc<Served>> = self.conns.lock().clone();
            for c in &conns {
                if send_fds(c, &fds).is_err() || send_ranges(c, epoch, !add, &changed).is_err() {
                    c.cut();
                }
            }
            (epoch, conns)
        };
        for c in waiting {
            let mut rx = c.acked.subscribe();
            let confirmed = tokio::time::timeout(self.timeout, rx.wait_for(|e| *e >= epoch)).await;
            if !matches!(confirmed, Ok(Ok(_))) && c.alive.load(Ordering::SeqCst) {
                tracing::warn!(
                    pid = c.pid,
                    "shm: initiator did not confirm the region update within {} ms; connection cut",
                    self.timeout.as_millis()
                );
                c.cut();
            }
        }
    }

    /// Cuts every connection and stops accepting.
    pub fn stop(&self, listener: &UnixListener) {
        self.stopped.store(true, Ordering::SeqCst);
        // SAFETY: the listener is borrowed, so its fd is open; shutting it down wakes the blocked
        // accept and closes nothing.
        unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RDWR) };
        for c in self.conns.lock().drain(..) {
            c.cut();
        }
    }
}

/// Sends the memfd of each `(base, len, memfd)`, before the update that exports the range.
fn send_fds(c: &Served, fds: &[(u64, u64, MemfdRange)]) -> std::io::Result<()> {
    if fds.is_empty() {
        return Ok(());
    }
    let mut w = c.writer.lock();
    for (base, len, m) in fds {
        send_fd(&mut w, *base, *len, m)?;
    }
    Ok(())
}

fn send_fd(w: &mut UnixStream, base: u64, len: u64, m: &MemfdRange) -> std::io::Result<()> {
    let h = Header {
        a: base,
        b: len,
        ..Header::new(Opcode::RegionFd)
    };
    write_frame_fd(w, h, &m.offset.to_le_bytes(), m.fd())
}

fn send_ranges(c: &Served, epoch: u64, revoke: bool, ranges: &[(u64, u64)]) -> std::io::Result<()> {
    let mut w = c.writer.lock();
    for chunk in ranges.chunks(MAX_RANGES) {
        let mut body = Vec::new();
        encode_ranges(chunk, &mut body);
        let h = Header {
            code: revoke as u8,
            a: epoch,
            ..Header::new(Opcode::Regions)
        };
        write_frame(&mut w, h, &body)?;
    }
    Ok(())
}

/// Accepts connections until the server stops; each is served on its own thread (bounded by
/// `max_connections`).
pub(crate) fn accept_loop(listener: Arc<UnixListener>, server: Arc<Server>) {
    let mut backoff = Duration::from_millis(1);
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                backoff = Duration::from_millis(1);
                if server.stopped.load(Ordering::SeqCst) {
                    return;
                }
                if server.open.fetch_add(1, Ordering::SeqCst) >= server.max_connections {
                    server.open.fetch_sub(1, Ordering::SeqCst);
                    let mut s = stream;
                    let _ = s.set_write_timeout(Some(server.timeout));
                    let _ = write_frame(
                        &mut s,
                        Header {
                            code: refusal::BUSY,
                            ..Header::new(Opcode::Refuse)
                        },
                        b"too many connections",
                    );
                    continue;
                }
                let server = server.clone();
                let spawned = std::thread::Builder::new().name("te-shm-serve".into()).spawn(move || {
                    serve(stream, &server);
                    server.open.fetch_sub(1, Ordering::SeqCst);
                });
                if spawned.is_err() {
                    tracing::warn!("shm: cannot start a connection thread");
                }
            }
            Err(_) if server.stopped.load(Ordering::SeqCst) => return,
            Err(e) => {
                tracing::warn!("shm: accept failed: {e}; retrying in {backoff:?}");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

fn refuse(stream: &mut UnixStream, code: u8, msg: &str) {
    let _ = write_frame(
        stream,
        Header {
            code,
            ..Header::new(Opcode::Refuse)
        },
        msg.as_bytes(),
    );
}

/// The handshake; `None` when the peer was refused (and told why, without secrets).
fn handshake(stream: &mut UnixStream, server: &Server) -> Option<u32> {
    stream.set_read_timeout(Some(server.timeout)).ok()?;
    stream.set_write_timeout(Some(server.timeout)).ok()?;
    let cred = peer_cred(stream).ok()?;
    let own = cma::euid();
    if cred.uid != own && !server.allow_uids.contains(&cred.uid) {
        refuse(
            stream,
            refusal::UID,
            &format!(
                "uid {} may not connect (this engine runs as uid {own}; TE_SHM_ALLOW_UIDS)",
                cred.uid
            ),
        );
        return None;
    }
    let (hello, body) = read_frame(stream).ok()?;
    if hello.op != Opcode::Hello {
        return None;
    }
    if hello.a != server.token {
        refuse(
            stream,
            refusal::WRONG_INSTANCE,
            "this socket belongs to another instance of the segment (it restarted)",
        );
        return None;
    }
    if let Some(key) = &server.auth {
        let Ok(nonce) = <[u8; NONCE_LEN]>::try_from(body.as_slice()) else {
            refuse(stream, refusal::UNAUTHENTICATED, "authentication required");
            return None;
        };
        match auth::block_on(auth::respond(
            &mut ChallengeFrames { stream },
            key,
            AUTH_CONTEXT,
            &nonce,
            "shm peer",
        )) {
            Ok(()) => {}
            // The socket failed or went silent: nothing to answer.
            Err(HandshakeError::Frames(FrameError::Io)) => return None,
            // Another frame than the proof, or a proof of another length or key.
            Err(_) => {
                refuse(stream, refusal::UNAUTHENTICATED, "refused");
                return None;
            }
        }
    }
    if server.scope.needs_declared_tracer() && !server.tracer_declared.swap(true, Ordering::SeqCst) {
        if let Err(e) = cma::allow_any_tracer() {
            tracing::warn!("shm: prctl(PR_SET_PTRACER) failed: {e}; peers cannot attach under Yama scope 1");
        }
    }
    Some(cred.pid)
}

/// Why the target's handshake frames failed.
enum FrameError {
    /// The socket failed or timed out.
    Io,
    /// The initiator sent another frame than the step's.
    Unexpected,
}

/// The target's handshake frames (te_base::auth::respond): its CHALLENGE out, the PROOF in.
struct ChallengeFrames<'a> {
    stream: &'a mut UnixStream,
}

impl HandshakeFrames for ChallengeFrames<'_> {
    type Error = FrameError;

    async fn send(&mut self, _: Step, body: &[u8]) -> Result<(), FrameError> {
        write_frame(self.stream, Header::new(Opcode::Challenge), body).map_err(|_| FrameError::Io)
    }

    async fn recv(&mut self, _: Step) -> Result<Vec<u8>, FrameError> {
        match read_frame(self.stream).map_err(|_| FrameError::Io)? {
            (h, body) if h.op == Opcode::Proof => Ok(body),
            _ => Err(FrameError::Unexpected),
        }
    }
}

/// Serves one connection: handshake, welcome with the exported ranges, then acknowledgements and
/// notifications until the peer leaves.
fn serve(mut stream: UnixStream, server: &Arc<Server>) {
    let Some(pid) = handshake(&mut stream, server) else {
        return;
    };
    let Ok(writer) = stream.try_clone() else { return };
    let (acked, _) = tokio::sync::watch::channel(0u64);
    let conn = Arc::new(Served {
        fd: writer.as_raw_fd(),
        writer: Mutex::new(writer),
        acked,
        alive: AtomicBool::new(true),
        pid,
    });
    {
        let ex = server.exports.lock();
        let ranges: Vec<(u64, u64)> = ex.regions.values().map(|e| (e.base, e.len)).collect();
        let mut w = conn.writer.lock();
        // The memfds of what is exported now, before the welcome that exports it.
        for e in ex.regions.values() {
            if let Some(m) = &e.memfd {
                if send_fd(&mut w, e.base, e.len, m).is_err() {
                    return;
                }
            }
        }
        let first = &ranges[..ranges.len().min(MAX_RANGES)];
        let mut body = ex.epoch.to_le_bytes().to_vec();
        encode_ranges(first, &mut body);
        let welcome = Header {
            a: server.token,
            b: &cma::PROBE_BYTE as *const u8 as u64,
            ..Header::new(Opcode::Welcome)
        };
        if write_frame(&mut w, welcome, &body).is_err() {
            return;
        }
        drop(w);
        if ranges.len() > MAX_RANGES && send_ranges(&conn, ex.epoch, false, &ranges[MAX_RANGES..]).is_err() {
            return;
        }
        conn.acked.send_replace(ex.epoch);
        server.conns.lock().push(conn.clone());
    }
    // Idle connections are the normal state (an initiator holds one per target); reads wait.
    let _ = stream.set_read_timeout(None);
    while let Ok((h, body)) = read_frame(&mut stream) {
        match h.op {
            Opcode::Ack => {
                conn.acked.send_modify(|e| *e = (*e).max(h.a));
            }
            Opcode::Note => {
                let outcome = Outcome::of_delivery(&server.inbox, &body);
                let reply = Header {
                    code: outcome.code(),
                    a: h.a,
                    b: server.inbox.limits().max_bytes as u64,
                    ..Header::new(Opcode::NoteAck)
                };
                if write_frame(&mut conn.writer.lock(), reply, &[]).is_err() {
                    break;
                }
            }
            _ => break,
        }
    }
    conn.cut();
    server.conns.lock().retain(|c| !Arc::ptr_eq(c, &conn));
}
