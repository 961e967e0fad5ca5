//! Control connections: frames over TCP with a deadline on every read and write, and the mutual
//! challenge-response (te_base::auth) both sides run before any request when a key is set.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use te_base::auth::AuthKey;
use te_base::auth::{InitiatorHandshake, ResponderHandshake, NONCE_LEN, PROOF_LEN};
use te_base::listener::{deadline, read_growing};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::wire::{decode_head, frame, Op, HEAD};

/// Context bound into every proof, so a proof for another listener kind is worthless here.
pub(crate) const AUTH_CONTEXT: &str = "umbp-cluster-control";

fn invalid(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
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
    let h = decode_head(&head).map_err(invalid)?;
    let body = deadline(frame_timeout, "reading a frame body", read_growing(s, h.len)).await?;
    Ok((h.op, body))
}

/// Writes one frame within `timeout`.
pub(crate) async fn write_frame(s: &mut TcpStream, op: Op, body: &[u8], timeout: Duration) -> io::Result<()> {
    deadline(timeout, "writing a frame", s.write_all(&frame(op, body))).await
}

/// An open, authenticated connection to a peer's control listener, used blocking from the
/// caller's thread: a control round trip costs two syscalls each side and no thread hand-off.
/// Every read and write ends by a deadline (re-armed per syscall with what is left of it).
pub(crate) struct Conn {
    stream: std::net::TcpStream,
    timeout: Duration,
}

impl Conn {
    /// Connects and runs the handshake, within `timeout` for the connect and each frame.
    pub(crate) fn connect(addr: SocketAddr, auth: Option<&AuthKey>, timeout: Duration) -> io::Result<Conn> {
        let stream = std::net::TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_nodelay(true)?;
        let mut c = Conn { stream, timeout };
        match auth {
            None => {
                c.send(Op::Hello, &[])?;
                match c.recv()? {
                    (Op::Ready, _) => {}
                    (Op::Refused, why) => return Err(refused(&why)),
                    (op, _) => return Err(invalid(format!("expected READY, got {op:?}"))),
                }
            }
            Some(key) => {
                let (hs, nonce) = InitiatorHandshake::start(key, AUTH_CONTEXT);
                c.send(Op::Hello, &nonce)?;
                let (op, body) = c.recv()?;
                match op {
                    Op::Challenge if body.len() == NONCE_LEN + PROOF_LEN => {}
                    Op::Refused => return Err(refused(&body)),
                    _ => return Err(invalid("the peer did not authenticate")),
                }
                let theirs: [u8; NONCE_LEN] = body[..NONCE_LEN].try_into().expect("length checked");
                let proof = hs
                    .finish(&theirs, &body[NONCE_LEN..], &addr.to_string())
                    .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e.to_string()))?;
                c.send(Op::Proof, &proof)?;
                match c.recv()? {
                    (Op::Ready, _) => {}
                    (Op::Refused, why) => return Err(refused(&why)),
                    (op, _) => return Err(invalid(format!("expected READY, got {op:?}"))),
                }
            }
        }
        Ok(c)
    }

    /// Sends one frame (a request; read its answer with [`Conn::recv`]).
    pub(crate) fn send(&mut self, op: Op, body: &[u8]) -> io::Result<()> {
        use std::io::Write;
        let f = frame(op, body);
        let end = std::time::Instant::now() + self.timeout;
        let mut at = 0;
        while at < f.len() {
            self.stream.set_write_timeout(Some(left(end)?))?;
            match self.stream.write(&f[at..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads one frame, all of it within the connection's timeout; the body buffer grows only
    /// as its bytes arrive.
    pub(crate) fn recv(&mut self) -> io::Result<(Op, Vec<u8>)> {
        let end = std::time::Instant::now() + self.timeout;
        let mut head = [0u8; HEAD];
        self.fill(&mut head, end)?;
        let h = decode_head(&head).map_err(invalid)?;
        let mut body = Vec::with_capacity(h.len.min(64 << 10));
        let mut chunk = [0u8; 64 << 10];
        while body.len() < h.len {
            let want = (h.len - body.len()).min(chunk.len());
            self.fill(&mut chunk[..want], end)?;
            body.extend_from_slice(&chunk[..want]);
        }
        Ok((h.op, body))
    }

    fn fill(&mut self, buf: &mut [u8], end: std::time::Instant) -> io::Result<()> {
        use std::io::Read;
        let mut at = 0;
        while at < buf.len() {
            self.stream.set_read_timeout(Some(left(end)?))?;
            match self.stream.read(&mut buf[at..]) {
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
fn left(end: std::time::Instant) -> io::Result<Duration> {
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

/// The responder's side of the handshake, run within `limit`. Errors close the connection; the
/// only thing an unauthenticated peer learns is "authentication required" or "refused".
pub(crate) async fn accept_handshake(
    s: &mut TcpStream,
    auth: Option<&AuthKey>,
    peer: &str,
    limit: Duration,
) -> io::Result<()> {
    let (op, body) = read_frame(s, limit, limit).await?;
    if op != Op::Hello {
        return Err(invalid("expected HELLO"));
    }
    match auth {
        None => write_frame(s, Op::Ready, &[], limit).await,
        Some(key) => {
            let Ok(theirs) = <[u8; NONCE_LEN]>::try_from(body.as_slice()) else {
                write_frame(s, Op::Refused, b"authentication required", limit).await?;
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("{peer}: no credentials"),
                ));
            };
            let (hs, nonce, proof) = ResponderHandshake::answer(key, AUTH_CONTEXT, &theirs);
            let mut answer = nonce.to_vec();
            answer.extend_from_slice(&proof);
            write_frame(s, Op::Challenge, &answer, limit).await?;
            let (op, body) = read_frame(s, limit, limit).await?;
            if op != Op::Proof || hs.check(&body, peer).is_err() {
                let _ = write_frame(s, Op::Refused, b"refused", limit).await;
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("{peer}: wrong key"),
                ));
            }
            write_frame(s, Op::Ready, &[], limit).await
        }
    }
}

/// Idle control connections to other peers, by peer name (at most 8 each), shared by the read
/// path (RESOLVE, VALIDATE) and the sharded directory (PUBLISH, LOOKUP).
pub(crate) struct ConnPool {
    idle: parking_lot::Mutex<std::collections::HashMap<std::sync::Arc<str>, Vec<Conn>>>,
    auth: Option<AuthKey>,
    timeout: Duration,
}

/// One request of [`ConnPool::exchange`]: the peer, its address, and the frame to send.
pub(crate) struct Request {
    pub(crate) peer: std::sync::Arc<str>,
    pub(crate) addr: SocketAddr,
    pub(crate) op: Op,
    pub(crate) body: Vec<u8>,
}

impl ConnPool {
    pub(crate) fn new(auth: Option<AuthKey>, timeout: Duration) -> ConnPool {
        ConnPool {
            idle: Default::default(),
            auth,
            timeout,
        }
    }

    /// An idle connection to `peer`, if one is pooled.
    fn take(&self, peer: &str) -> Option<Conn> {
        self.idle.lock().get_mut(peer).and_then(Vec::pop)
    }

    /// A pooled connection to `peer`, or a new one.
    pub(crate) fn get(&self, peer: &str, addr: SocketAddr) -> io::Result<(Conn, bool)> {
        match self.take(peer) {
            Some(c) => Ok((c, true)),
            None => Conn::connect(addr, self.auth.as_ref(), self.timeout).map(|c| (c, false)),
        }
    }

    /// Returns a healthy connection to the pool.
    pub(crate) fn put(&self, peer: std::sync::Arc<str>, c: Conn) {
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

    /// Sends every request before reading any answer, so the peers work at once; each answer
    /// is the peer's frame or why there is none. A pooled connection that turns out dead (the
    /// peer restarted) is replaced once by a fresh one. Blocking, bounded by the timeout per
    /// frame.
    pub(crate) fn exchange(&self, reqs: &[Request]) -> Vec<Result<(Op, Vec<u8>), String>> {
        let mut open: Vec<Result<(Conn, bool), String>> = reqs
            .iter()
            .map(|r| {
                let (mut c, pooled) = self.get(&r.peer, r.addr).map_err(|e| format!("connecting: {e}"))?;
                match c.send(r.op, &r.body) {
                    Ok(()) => Ok((c, pooled)),
                    Err(e) if pooled => self
                        .fresh_send(r)
                        .map(|c| (c, false))
                        .map_err(|_| format!("sending: {e}")),
                    Err(e) => Err(format!("sending: {e}")),
                }
            })
            .collect();
        reqs.iter()
            .zip(open.iter_mut())
            .map(|(r, o)| {
                let (mut c, pooled) = std::mem::replace(o, Err(String::new()))?;
                let answer = match c.recv() {
                    Ok(a) => Ok(a),
                    Err(_) if pooled => {
                        c = self.fresh_send(r)?;
                        c.recv().map_err(|e| format!("reading the answer: {e}"))
                    }
                    Err(e) => Err(format!("reading the answer: {e}")),
                };
                match &answer {
                    Ok(_) => self.put(r.peer.clone(), c),
                    Err(_) => self.forget(&r.peer),
                }
                answer
            })
            .collect()
    }

    fn fresh_send(&self, r: &Request) -> Result<Conn, String> {
        self.forget(&r.peer);
        let mut c = Conn::connect(r.addr, self.auth.as_ref(), self.timeout).map_err(|e| format!("connecting: {e}"))?;
        c.send(r.op, &r.body).map_err(|e| format!("sending: {e}"))?;
        Ok(c)
    }
}
