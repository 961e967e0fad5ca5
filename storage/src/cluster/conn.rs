//! Control connections: frames over TCP with a deadline on every read and write, and the mutual
//! challenge-response both sides run before any request when a key is set: te-base's one
//! handshake (`te_base::auth::{initiate, respond}`) over HELLO (which also names the member),
//! CHALLENGE and PROOF frames, then READY or REFUSED.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use te_base::auth::{AuthKey, HandshakeError, HandshakeFrames, Step, NONCE_LEN};
use te_base::listener::{deadline, read_growing};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::request_error::RequestError;
use super::wire::{decode_head, frame, Op, WireError, HEAD};

/// Context bound into every proof, so a proof for another listener kind is worthless here.
pub(crate) const AUTH_CONTEXT: &str = "umbp-cluster-control";

fn invalid(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

/// A frame that does not decode, its typed error kept inside (see [`wire_error`]).
fn undecodable(e: WireError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// The wire error behind an I/O error, if a frame failed to decode (another protocol or
/// version: [`WireError::BadMagic`], [`WireError::BadVersion`]).
pub(crate) fn wire_error(e: &io::Error) -> Option<&WireError> {
    e.get_ref()?.downcast_ref()
}

/// Reads one frame: the first byte may take `wait` (idle), the rest of the head and the body
/// `frame_timeout` each. The body buffer grows only as bytes arrive.
pub(crate) async fn read_frame(
    s: &mut TcpStream,
    wait: Duration,
    frame_timeout: Duration,
) -> io::Result<(Op, Vec<u8>)> {
    let mut head = [0u8; HEAD];
    deadline(wait, "waiting for a frame", s.read_exact(&mut head[..1])).await?;
    deadline(frame_timeout, "reading a frame head", s.read_exact(&mut head[1..])).await?;
    let h = decode_head(&head).map_err(undecodable)?;
    let body = deadline(frame_timeout, "reading a frame body", read_growing(s, h.len)).await?;
    Ok((h.op, body))
}

/// Writes one frame within `timeout`.
pub(crate) async fn write_frame(s: &mut TcpStream, op: Op, body: &[u8], timeout: Duration) -> io::Result<()> {
    deadline(timeout, "writing a frame", s.write_all(&frame(op, body))).await
}

/// An open, authenticated connection to a peer's control listener, used blocking from the
/// caller's thread: a control round trip costs two syscalls each side and no thread hand-off.
/// Every read and write ends by a deadline: the connection's timeout per frame, and no later than
/// the deadline of the call using it ([`Conn::set_deadline`]), re-armed per syscall with what is
/// left of it.
pub(crate) struct Conn {
    stream: std::net::TcpStream,
    timeout: Duration,
    /// The end of the call using the connection: no frame waits past it.
    end: Option<Instant>,
}

impl std::os::fd::AsFd for Conn {
    /// The socket, to poll several connections at once (`wake::wait_any`).
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.stream.as_fd()
    }
}

/// The handshake context of a connection from member `me`: the proofs of both sides cover the
/// member name, so a connection proves the shared key and who it speaks for.
fn member_context(me: &str) -> String {
    format!("{AUTH_CONTEXT}\0member={me}")
}

/// Longest member name a HELLO carries.
pub(crate) const MAX_MEMBER_NAME: usize = 255;

impl Conn {
    /// Connects as member `me` from `source` (see [`tcp_connect`]) and runs the handshake, all
    /// of it by `end`.
    pub(crate) fn connect(
        addr: SocketAddr,
        source: Option<IpAddr>,
        auth: Option<&AuthKey>,
        me: &str,
        timeout: Duration,
        end: Instant,
    ) -> io::Result<Conn> {
        let stream = tcp_connect(addr, source, left(end)?)?;
        stream.set_nodelay(true)?;
        let mut c = Conn {
            stream,
            timeout,
            end: Some(end),
        };
        match auth {
            None => c.send(Op::Hello, me.as_bytes())?,
            Some(key) => {
                let mut frames = InitiatorFrames { conn: &mut c, me };
                let peer = addr.to_string();
                te_base::auth::block_on(te_base::auth::initiate(&mut frames, key, &member_context(me), &peer))
                    .map_err(|e| match e {
                        HandshakeError::Frames(e) => e,
                        HandshakeError::Malformed { .. } => invalid("the peer did not authenticate"),
                        HandshakeError::Unauthenticated(_) => io::Error::new(
                            io::ErrorKind::PermissionDenied,
                            format!("{addr}: the peer does not hold this engine's key"),
                        ),
                    })?;
            }
        }
        match c.recv()? {
            (Op::Ready, _) => {}
            (Op::Refused, why) => return Err(refused(&why)),
            (op, _) => return Err(invalid(format!("expected READY, got {op:?}"))),
        }
        c.end = None;
        Ok(c)
    }

    /// Bounds every frame from now on by `end` too (`None`: the timeout per frame only).
    pub(crate) fn set_deadline(&mut self, end: Option<Instant>) {
        self.end = end;
    }

    /// The end of one frame started now.
    fn frame_end(&self) -> Instant {
        let e = Instant::now() + self.timeout;
        self.end.map_or(e, |end| end.min(e))
    }

    /// Sends one frame (a request; read its answer with [`Conn::recv`]).
    pub(crate) fn send(&mut self, op: Op, body: &[u8]) -> io::Result<()> {
        use std::io::Write;
        let f = frame(op, body);
        let end = self.frame_end();
        let mut at = 0;
        while at < f.len() {
            self.stream.set_write_timeout(Some(left(end)?))?;
            match self.stream.write(&f[at..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "control request timed out"))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads one frame, all of it within the connection's timeout and deadline; the body buffer
    /// grows only as its bytes arrive.
    pub(crate) fn recv(&mut self) -> io::Result<(Op, Vec<u8>)> {
        let end = self.frame_end();
        let mut head = [0u8; HEAD];
        self.fill(&mut head, end)?;
        let h = decode_head(&head).map_err(undecodable)?;
        let mut body = Vec::with_capacity(h.len.min(64 << 10));
        let mut chunk = [0u8; 64 << 10];
        while body.len() < h.len {
            let want = (h.len - body.len()).min(chunk.len());
            self.fill(&mut chunk[..want], end)?;
            body.extend_from_slice(&chunk[..want]);
        }
        Ok((h.op, body))
    }

    fn fill(&mut self, buf: &mut [u8], end: Instant) -> io::Result<()> {
        use std::io::Read;
        let mut at = 0;
        while at < buf.len() {
            let wait = end.saturating_duration_since(Instant::now());
            // Past the deadline, an answer that arrived while the caller waited on another peer
            // (one exchange reads its answers in turn) is still taken, without blocking.
            let late = wait.is_zero();
            if late {
                self.stream.set_nonblocking(true)?;
            } else {
                self.stream.set_read_timeout(Some(wait))?;
            }
            let r = self.stream.read(&mut buf[at..]);
            if late {
                self.stream.set_nonblocking(false)?;
            }
            match r {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "control answer timed out"))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// What is left until `end` (never zero, which would mean "no timeout" to the socket).
/// A TCP connection to `addr` made from `source` (this peer's announced control IP, so that a
/// peer checking a member's source address against its announcement sees that address, also on
/// a host with several; `None`, or another address family: the kernel's choice), within
/// `timeout`.
fn tcp_connect(addr: SocketAddr, source: Option<IpAddr>, timeout: Duration) -> io::Result<std::net::TcpStream> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let Some(ip) = source.filter(|ip| ip.is_ipv4() == addr.is_ipv4() && !ip.is_unspecified()) else {
        return std::net::TcpStream::connect_timeout(&addr, timeout);
    };
    let family = if ip.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let fd = rustix::net::socket_with(
        family,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    rustix::net::bind(&fd, &SocketAddr::new(ip, 0))
        .map_err(|e| io::Error::new(io::Error::from(e).kind(), format!("binding to {ip}: {e}")))?;
    match rustix::net::connect(&fd, &addr) {
        Ok(()) => {}
        Err(rustix::io::Errno::INPROGRESS) => {
            let end = Instant::now() + timeout;
            loop {
                let wait = end.saturating_duration_since(Instant::now());
                let ts = rustix::event::Timespec {
                    tv_sec: wait.as_secs() as _,
                    tv_nsec: wait.subsec_nanos() as _,
                };
                let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::OUT)];
                match rustix::event::poll(&mut fds, Some(&ts)) {
                    Ok(0) => return Err(io::Error::new(io::ErrorKind::TimedOut, "connecting timed out")),
                    Ok(_) => break,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Err(e.into()),
                }
            }
            rustix::net::sockopt::socket_error(&fd)??;
        }
        Err(e) => return Err(e.into()),
    }
    rustix::io::ioctl_fionbio(&fd, false)?;
    Ok(std::net::TcpStream::from(fd))
}

fn left(end: Instant) -> io::Result<Duration> {
    let d = end.saturating_duration_since(std::time::Instant::now());
    if d.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "control frame timed out"));
    }
    Ok(d)
}

fn refused(why: &[u8]) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("refused: {}", String::from_utf8_lossy(&why[..why.len().min(200)])),
    )
}

/// The responder's side of the handshake, run within `limit`; returns the member name the
/// initiator spoke as (proved with the key when one is set; `None`: it named none). Errors close
/// the connection; the only thing an unauthenticated peer learns is "authentication required" or
/// "refused", and a peer of another protocol version the two versions.
pub(crate) async fn accept_handshake(
    s: &mut TcpStream,
    auth: Option<&AuthKey>,
    peer: &str,
    limit: Duration,
) -> io::Result<Option<String>> {
    let (op, body) = match read_frame(s, limit, limit).await {
        Ok(f) => f,
        Err(e) => {
            // A member of another build hears why, in a frame whose head it can still read.
            if let Some(w @ WireError::BadVersion { .. }) = wire_error(&e) {
                let _ = write_frame(s, Op::Refused, w.to_string().as_bytes(), limit).await;
            }
            return Err(e);
        }
    };
    if op != Op::Hello {
        return Err(invalid("expected HELLO"));
    }
    let name_of = |b: &[u8]| -> io::Result<Option<String>> {
        if b.is_empty() {
            return Ok(None);
        }
        match std::str::from_utf8(b) {
            Ok(n) if n.len() <= MAX_MEMBER_NAME => Ok(Some(n.to_owned())),
            _ => Err(invalid("malformed member name in HELLO")),
        }
    };
    match auth {
        None => {
            let name = name_of(&body)?;
            write_frame(s, Op::Ready, &[], limit).await?;
            Ok(name)
        }
        Some(key) => {
            // HELLO: the initiator's nonce, then the member name its proof will cover.
            let parsed = (body.len() > NONCE_LEN)
                .then(|| name_of(&body[NONCE_LEN..]).ok().flatten())
                .flatten();
            let Some(name) = parsed else {
                write_frame(s, Op::Refused, b"authentication required", limit).await?;
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("{peer}: no credentials"),
                ));
            };
            let mut frames = ResponderFrames { s: &mut *s, limit };
            let done = te_base::auth::respond(&mut frames, key, &member_context(&name), &body[..NONCE_LEN], peer).await;
            match done {
                Ok(()) => {}
                // I/O: the connection is gone or silent; nothing to answer.
                Err(HandshakeError::Frames(e)) if e.kind() != io::ErrorKind::PermissionDenied => return Err(e),
                // Another frame than the proof, or a proof of another length or key.
                Err(_) => {
                    let _ = write_frame(s, Op::Refused, b"refused", limit).await;
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!("{peer}: wrong key"),
                    ));
                }
            }
            write_frame(s, Op::Ready, &[], limit).await?;
            Ok(Some(name))
        }
    }
}

/// The frame of each handshake step.
fn step_op(step: Step) -> Op {
    match step {
        Step::Hello => Op::Hello,
        Step::Challenge => Op::Challenge,
        Step::Proof => Op::Proof,
    }
}

/// The initiator's handshake frames on a new connection of member `me` (blocking: the
/// handshake runs under `te_base::auth::block_on`). Its HELLO carries the nonce, then the name.
struct InitiatorFrames<'c> {
    conn: &'c mut Conn,
    me: &'c str,
}

impl HandshakeFrames for InitiatorFrames<'_> {
    type Error = io::Error;

    async fn send(&mut self, step: Step, body: &[u8]) -> io::Result<()> {
        if step == Step::Hello {
            let mut hello = body.to_vec();
            hello.extend_from_slice(self.me.as_bytes());
            return self.conn.send(Op::Hello, &hello);
        }
        self.conn.send(step_op(step), body)
    }

    /// The initiator receives one step, the CHALLENGE (or the responder's refusal).
    async fn recv(&mut self, _: Step) -> io::Result<Vec<u8>> {
        match self.conn.recv()? {
            (Op::Challenge, body) => Ok(body),
            (Op::Refused, why) => Err(refused(&why)),
            _ => Err(invalid("the peer did not authenticate")),
        }
    }
}

/// The responder's handshake frames: CHALLENGE out, PROOF in, each within `limit`. Another frame
/// than the one expected is a refusal (`PermissionDenied`), answered as a wrong key.
struct ResponderFrames<'s> {
    s: &'s mut TcpStream,
    limit: Duration,
}

impl HandshakeFrames for ResponderFrames<'_> {
    type Error = io::Error;

    async fn send(&mut self, step: Step, body: &[u8]) -> io::Result<()> {
        write_frame(self.s, step_op(step), body, self.limit).await
    }

    async fn recv(&mut self, step: Step) -> io::Result<Vec<u8>> {
        let (op, body) = read_frame(self.s, self.limit, self.limit).await?;
        if op != step_op(step) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{op:?} instead of {step:?}"),
            ));
        }
        Ok(body)
    }
}

/// Idle control connections to other peers, by peer name (at most 8 each), shared by the read
/// path (RESOLVE, VALIDATE) and the sharded directory (PUBLISH, LOOKUP); and the peers that
/// lately did not answer in time (suspects), which callers pass over at once.
pub(crate) struct ConnPool {
    idle: Mutex<HashMap<Arc<str>, Vec<Conn>>>,
    auth: Option<AuthKey>,
    /// This peer's member name, bound into every connection's handshake.
    me: Arc<str>,
    /// The IP connections are made from: this peer's announced control address.
    source: Option<IpAddr>,
    timeout: Duration,
    /// Peer name to when it last failed to answer in time.
    suspects: Mutex<HashMap<Arc<str>, Instant>>,
}

/// One request of [`ConnPool::exchange`]: the peer, its address, and the frame to send.
pub(crate) struct Request {
    pub(crate) peer: Arc<str>,
    pub(crate) addr: SocketAddr,
    pub(crate) op: Op,
    pub(crate) body: Vec<u8>,
}

impl ConnPool {
    /// `source`: the IP to connect from (this peer's announced control address; `None` or
    /// unspecified: the kernel's choice).
    pub(crate) fn new(auth: Option<AuthKey>, me: Arc<str>, source: Option<IpAddr>, timeout: Duration) -> ConnPool {
        ConnPool {
            idle: Default::default(),
            auth,
            me,
            source,
            timeout,
            suspects: Default::default(),
        }
    }

    /// An idle connection to `peer`, if one is pooled.
    fn take(&self, peer: &str) -> Option<Conn> {
        self.idle.lock().get_mut(peer).and_then(Vec::pop)
    }

    /// A pooled connection to `peer`, or a new one connected by `end`; either is bounded by
    /// `end` until [`ConnPool::put`] takes it back.
    pub(crate) fn get(&self, peer: &str, addr: SocketAddr, end: Instant) -> io::Result<(Conn, bool)> {
        match self.take(peer) {
            Some(mut c) => {
                c.set_deadline(Some(end));
                Ok((c, true))
            }
            None => {
                let mut c = Conn::connect(addr, self.source, self.auth.as_ref(), &self.me, self.timeout, end)?;
                c.set_deadline(Some(end));
                Ok((c, false))
            }
        }
    }

    /// An idle connection to `peer`, bounded by `end` until [`ConnPool::put`] takes it back.
    pub(crate) fn pooled(&self, peer: &str, end: Instant) -> Option<Conn> {
        self.take(peer).map(|mut c| {
            c.set_deadline(Some(end));
            c
        })
    }

    /// A new connection to `addr`, handshake included, by `end`, and bounded by `end` after.
    pub(crate) fn connect(&self, addr: SocketAddr, end: Instant) -> io::Result<Conn> {
        let mut c = Conn::connect(addr, self.source, self.auth.as_ref(), &self.me, self.timeout, end)?;
        c.set_deadline(Some(end));
        Ok(c)
    }

    /// Returns a healthy connection to the pool.
    pub(crate) fn put(&self, peer: Arc<str>, mut c: Conn) {
        c.set_deadline(None);
        let mut idle = self.idle.lock();
        let v = idle.entry(peer).or_default();
        if v.len() < 8 {
            v.push(c);
        }
    }

    /// Drops every idle connection to `peer` (it failed, perhaps restarted).
    pub(crate) fn forget(&self, peer: &str) {
        self.idle.lock().remove(peer);
    }

    /// Drops the idle connections to every peer `keep` refuses (a membership change: a peer
    /// that left, or came back as a new instance, is not reached over its old connections), and
    /// its suspicion with them.
    pub(crate) fn retain_peers(&self, keep: impl Fn(&str) -> bool) {
        self.idle.lock().retain(|n, _| keep(n));
        self.suspects.lock().retain(|n, _| keep(n));
    }

    /// Marks `peer` as not answering in time: callers pass it over for a while.
    pub(crate) fn suspect(&self, peer: &Arc<str>) {
        self.suspects.lock().insert(peer.clone(), Instant::now());
    }

    /// Whether `peer` failed to answer in time within the last `within`.
    pub(crate) fn is_suspect(&self, peer: &str, within: Duration) -> bool {
        self.suspects.lock().get(peer).is_some_and(|at| at.elapsed() < within)
    }

    /// The peers that failed to answer in time within the last `within` (one lock per call).
    pub(crate) fn suspects(&self, within: Duration) -> Vec<Arc<str>> {
        let s = self.suspects.lock();
        s.iter()
            .filter(|(_, at)| at.elapsed() < within)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Sends every request before reading any answer, so the peers work at once; each answer
    /// is the peer's frame or why there is none. Blocking; nothing waits past `end`. A request
    /// that needs a new connection makes its whole round trip on a scoped thread of its own, so a
    /// silent peer's handshake holds up no request to another. A pooled connection that turns out
    /// dead (the peer restarted: reset or closed, not silent) is replaced once by a fresh one,
    /// which spends what is left until `end`, never a new timeout. A peer that does not answer in
    /// time is marked suspect.
    pub(crate) fn exchange(&self, reqs: &[Request], end: Instant) -> Vec<Result<(Op, Vec<u8>), RequestError>> {
        let mut pooled: Vec<Option<Conn>> = reqs
            .iter()
            .map(|r| {
                self.take(&r.peer).map(|mut c| {
                    c.set_deadline(Some(end));
                    c
                })
            })
            .collect();
        type Answer = Result<(Op, Vec<u8>), RequestError>;
        std::thread::scope(|s| {
            let fresh: Vec<Option<std::thread::ScopedJoinHandle<'_, Answer>>> = reqs
                .iter()
                .zip(&pooled)
                .map(|(r, c)| c.is_none().then(|| s.spawn(move || self.round_trip_fresh(r, end))))
                .collect();
            // Pooled connections: every request sent, then every answer read.
            let mut open: Vec<Option<Result<(Conn, bool), RequestError>>> = reqs
                .iter()
                .zip(pooled.iter_mut())
                .map(|(r, c)| {
                    let mut c = c.take()?;
                    Some(match c.send(r.op, &r.body) {
                        Ok(()) => Ok((c, true)),
                        Err(e) if e.kind() != io::ErrorKind::TimedOut => self
                            .fresh_send(r, end)
                            .map(|c| (c, false))
                            .map_err(|_| RequestError::io("sending", e)),
                        Err(e) => {
                            self.suspect(&r.peer);
                            Err(RequestError::io("sending", e))
                        }
                    })
                })
                .collect();
            reqs.iter()
                .zip(open.iter_mut())
                .zip(fresh)
                .map(|((r, o), f)| {
                    if let Some(h) = f {
                        return h.join().unwrap_or(Err(RequestError::ThreadFailed));
                    }
                    // Every request has a pooled connection or a thread of its own (above).
                    let Some(opened) = o.take() else {
                        return Err(RequestError::ThreadFailed);
                    };
                    let (mut c, pooled) = opened?;
                    let answer = match c.recv() {
                        Ok(a) => Ok(a),
                        Err(e) if pooled && e.kind() != io::ErrorKind::TimedOut => {
                            c = self.fresh_send(r, end)?;
                            c.recv()
                        }
                        Err(e) => Err(e),
                    };
                    self.settle(r, c, answer)
                })
                .collect()
        })
    }

    /// One request on a new connection: connect, send, read the answer, all by `end`.
    fn round_trip_fresh(&self, r: &Request, end: Instant) -> Result<(Op, Vec<u8>), RequestError> {
        let mut c =
            Conn::connect(r.addr, self.source, self.auth.as_ref(), &self.me, self.timeout, end).map_err(|e| {
                if e.kind() == io::ErrorKind::TimedOut {
                    self.suspect(&r.peer);
                }
                RequestError::io("connecting", e)
            })?;
        c.set_deadline(Some(end));
        if let Err(e) = c.send(r.op, &r.body) {
            if e.kind() == io::ErrorKind::TimedOut {
                self.suspect(&r.peer);
            }
            return Err(RequestError::io("sending", e));
        }
        let answer = c.recv();
        self.settle(r, c, answer)
    }

    /// Pools the connection after an answer; after a failure drops the peer's connections and,
    /// if it did not answer in time, marks it suspect.
    fn settle(&self, r: &Request, c: Conn, answer: io::Result<(Op, Vec<u8>)>) -> Result<(Op, Vec<u8>), RequestError> {
        match answer {
            Ok(a) => {
                self.put(r.peer.clone(), c);
                Ok(a)
            }
            Err(e) => {
                self.forget(&r.peer);
                if e.kind() == io::ErrorKind::TimedOut {
                    self.suspect(&r.peer);
                }
                Err(RequestError::io("reading the answer", e))
            }
        }
    }

    fn fresh_send(&self, r: &Request, end: Instant) -> Result<Conn, RequestError> {
        self.forget(&r.peer);
        let mut c = Conn::connect(r.addr, self.source, self.auth.as_ref(), &self.me, self.timeout, end)
            .map_err(|e| RequestError::io("connecting", e))?;
        c.set_deadline(Some(end));
        c.send(r.op, &r.body).map_err(|e| RequestError::io("sending", e))?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;
    use crate::cluster::wire::VERSION;

    const LIMIT: Duration = Duration::from_secs(10);

    /// A frame as a member of another build (another protocol version) would write it.
    fn frame_of_another_version(op: Op, body: &[u8]) -> Vec<u8> {
        let mut f = frame(op, body);
        f[2] = VERSION + 1;
        f
    }

    fn another_version() -> WireError {
        WireError::BadVersion {
            got: VERSION + 1,
            speaks: VERSION,
        }
    }

    /// The listener refuses a HELLO of another version with the typed error naming both
    /// versions, and tells the member so in a frame of its own version.
    #[test]
    fn a_listener_refuses_a_member_of_another_version() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let member = std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(LIMIT)).unwrap();
            s.write_all(&frame_of_another_version(Op::Hello, b"m1")).unwrap();
            let mut head = [0u8; HEAD];
            s.read_exact(&mut head).unwrap();
            let h = decode_head(&head).unwrap();
            let mut body = vec![0; h.len];
            s.read_exact(&mut body).unwrap();
            (h.op, String::from_utf8(body).unwrap())
        });
        let e = rt.block_on(async {
            let (mut s, _) = listener.accept().await.unwrap();
            accept_handshake(&mut s, None, "m1", LIMIT).await.unwrap_err()
        });
        assert_eq!(wire_error(&e), Some(&another_version()), "{e}");
        let (op, why) = member.join().unwrap();
        assert_eq!(op, Op::Refused);
        assert_eq!(why, another_version().to_string());
    }

    /// A member connecting to a listener of another version gets the same typed error from the
    /// listener's first frame, with or without a key, instead of reading its fields.
    #[test]
    fn a_member_refuses_a_listener_of_another_version() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let answers = std::thread::spawn(move || {
            for _ in 0..2 {
                let (mut s, _) = listener.accept().unwrap();
                let mut head = [0u8; HEAD];
                s.read_exact(&mut head).unwrap();
                let h = decode_head(&head).unwrap();
                let mut body = vec![0; h.len];
                s.read_exact(&mut body).unwrap();
                let answer = match h.op {
                    Op::Hello if h.len > NONCE_LEN => Op::Challenge,
                    _ => Op::Ready,
                };
                s.write_all(&frame_of_another_version(answer, &[0u8; 64])).unwrap();
            }
        });
        let key = AuthKey::from_bytes(&[7u8; 32]).unwrap();
        for auth in [None, Some(&key)] {
            let end = Instant::now() + LIMIT;
            let e = Conn::connect(addr, None, auth, "m1", LIMIT, end)
                .err()
                .expect("refused");
            assert_eq!(wire_error(&e), Some(&another_version()), "{e}");
            assert!(e.to_string().contains(&format!("speaks {VERSION}")), "{e}");
        }
        answers.join().unwrap();
    }
}
