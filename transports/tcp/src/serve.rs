//! The serving side: accepts connections and answers reads and writes into exported memory.
//!
//! Every connection faces a peer it does not trust:
//! - it is admitted only under the connection caps (total and per source address), and accept
//!   errors (`EMFILE`...) back off instead of spinning;
//! - it must finish its HELLO, and prove the shared key when one is configured, within the
//!   handshake deadline; refusals name no token, instance or key;
//! - a watchdog cuts it when it waits longer than the idle timeout for the first byte of a frame,
//!   or when a frame (the rest of a header, a payload, a reply write) makes no progress for the
//!   frame timeout. Cutting drops the connection's future, which closes the socket and releases
//!   every region pin it held (queued read replies included), so deregistration never waits on a
//!   peer for longer than that;
//! - every request is checked against the region table (registered AND exported) and the instance
//!   token before any byte of memory is touched; anything else gets an ERROR frame and is never
//!   served. A frame that breaks the protocol gets an ERROR frame and the connection is closed.
//!
//! Replies are queued and written with one vectored write when the next request is not already
//! buffered, so a burst of small requests is answered with few syscalls.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use te_base::auth::{self as auth, AuthKey, HandshakeError, HandshakeFrames, Nonce, Step, NONCE_LEN};
use te_base::listener::{
    accept_admitted, deadline, log_refusal, AcceptBackoff, ConnectionGate, ConnectionPermit, ListenerLimits,
};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::frame_io::{write_all, write_all_raw, FrameReader, RawPart};
use crate::regions::{LookupError, RegionGuard, RegionTable};
use crate::wire::{Header, Opcode, RefusalCode, HEADER_LEN, HELLO_AUTH_LEN, PROOF_LEN};

/// Flush queued replies once this many are waiting.
const MAX_QUEUED: usize = 32;
/// Flush queued replies once their payloads reach this many bytes.
const MAX_QUEUED_BYTES: u64 = 4 << 20;
/// Flush queued replies once the writes they acknowledge reach this many bytes, so a long stream
/// of large writes is still acknowledged every few MiB (the initiator completes requests as
/// their acknowledgements arrive).
const MAX_ACKED_BYTES: u64 = 4 << 20;
/// The authentication context of this listener (a proof for another protocol is useless here).
pub(crate) const AUTH_CONTEXT: &str = "tcp";

/// State shared by every served connection.
pub(crate) struct Server {
    /// What may be touched.
    pub regions: Arc<RegionTable>,
    /// This instance's token; requests naming another are refused (a restart guard, not a
    /// capability: access is granted by `auth`).
    pub token: u64,
    /// Caps and deadlines; `frame_timeout` is `TE_TCP_TIMEOUT_MS`.
    pub limits: ListenerLimits,
    /// The shared key initiators must prove; `None` serves anyone who connects.
    pub auth: Option<AuthKey>,
    /// Connections admitted now, in total and per source address.
    pub gate: ConnectionGate,
    /// Where NOTIFY frames are delivered (bounded; a full inbox is refused to the sender).
    pub inbox: Arc<te_base::NotifyInbox>,
}

/// Progress of one served connection, watched by [`watchdog`]: two relaxed atomics per frame.
#[derive(Default)]
struct ConnProgress {
    /// A frame is under way (header started, payload, reply write); false while waiting for the
    /// first byte of the next frame.
    busy: AtomicBool,
    /// Steps taken (each change of `busy` and each finished unit of work).
    steps: AtomicU64,
}

impl ConnProgress {
    /// Called by the connection's own task only (the watchdog just reads), so a load and a
    /// store do: no locked read-modify-write per frame.
    fn mark(&self, busy: bool) {
        self.busy.store(busy, Ordering::Relaxed);
        let steps = self.steps.load(Ordering::Relaxed);
        self.steps.store(steps.wrapping_add(1), Ordering::Relaxed);
    }
}

/// How often [`watchdog`] samples a connection's progress: a sixteenth of the shorter deadline,
/// 1 ms to 250 ms. A stall is seen only at a tick, so a connection is cut between its deadline and
/// the deadline plus one tick after its last step (a 3 s deadline cuts within 3.0-3.19 s).
fn watchdog_tick(limits: &ListenerLimits) -> Duration {
    (limits.frame_timeout.min(limits.idle_timeout) / 16).clamp(Duration::from_millis(1), Duration::from_millis(250))
}

/// Returns when the connection stalled: idle for the idle timeout, or inside a frame with no
/// step for the frame timeout (bounded as [`watchdog_tick`] says). Reads a counter every tick;
/// nothing on the data path reads a clock.
async fn watchdog(progress: &ConnProgress, limits: &ListenerLimits) -> io::Error {
    let tick = watchdog_tick(limits);
    let mut last = u64::MAX;
    let mut stalled = Duration::ZERO;
    loop {
        tokio::time::sleep(tick).await;
        let now = progress.steps.load(Ordering::Relaxed);
        if now != last {
            last = now;
            stalled = Duration::ZERO;
            continue;
        }
        stalled += tick;
        let (limit, what) = if progress.busy.load(Ordering::Relaxed) {
            (limits.frame_timeout, "a frame made no progress")
        } else {
            (limits.idle_timeout, "idle")
        };
        if stalled >= limit {
            return io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{what} for {} ms; connection cut", limit.as_millis()),
            );
        }
    }
}

/// Accepts connections until the listener fails or the task is aborted. Served connections
/// are tracked in `connections` so shutdown can end them.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    server: Arc<Server>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
) {
    // Accept errors (out of descriptors...) back off while the connections we have keep being
    // served; connections over the caps are closed at once.
    let mut backoff = AcceptBackoff::default();
    loop {
        let (stream, from, permit) = accept_admitted(
            &listener,
            &server.gate,
            &mut backoff,
            "tcp transport",
            server.limits.frame_timeout,
        )
        .await;
        let server = server.clone();
        let task = tokio::spawn(async move {
            match serve_connection(stream, &server, permit).await {
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => log_refusal("tcp transport", &from, &e),
                Err(e) => tracing::debug!("tcp: connection from {from} ended: {e}"),
                Ok(()) => {}
            }
        });
        let mut conns = connections.lock();
        conns.retain(|t| !t.is_finished());
        conns.push(task);
    }
}

/// A reply waiting to be written.
struct Reply {
    header: [u8; HEADER_LEN],
    payload: RawPart,
    /// Keeps the region of a read's payload pinned until the reply is written.
    _pin: Option<RegionGuard>,
}

struct Replies {
    queue: Vec<Reply>,
    parts: Vec<RawPart>,
    /// Payload bytes of the queued replies.
    bytes: u64,
    /// Bytes of the writes the queued replies acknowledge.
    acked: u64,
}

impl Replies {
    fn push(&mut self, header: Header, payload: RawPart, pin: Option<RegionGuard>) {
        self.bytes += payload.len as u64;
        if header.opcode == Opcode::WriteAck {
            self.acked += header.len;
        }
        self.queue.push(Reply {
            header: header.to_bytes(),
            payload,
            _pin: pin,
        });
    }

    fn is_full(&self) -> bool {
        self.queue.len() >= MAX_QUEUED || self.bytes >= MAX_QUEUED_BYTES || self.acked >= MAX_ACKED_BYTES
    }

    async fn flush(&mut self, w: &mut OwnedWriteHalf) -> io::Result<()> {
        if self.queue.is_empty() {
            return Ok(());
        }
        self.parts.clear();
        for r in &self.queue {
            self.parts.push(RawPart::of(&r.header));
            if r.payload.len > 0 {
                self.parts.push(r.payload);
            }
        }
        // SAFETY: headers live in `self.queue`, which is not touched until the write completes;
        // payloads point into regions pinned by the queued guards, so they stay mapped.
        let result = unsafe { write_all_raw(w, &self.parts).await };
        self.queue.clear();
        self.bytes = 0;
        self.acked = 0;
        result
    }
}

async fn send_error(w: &mut OwnedWriteHalf, request_id: u64, code: RefusalCode, msg: &str) -> io::Result<()> {
    send_error_at(w, request_id, code, 0, msg).await
}

/// An ERROR frame whose `addr` carries a number the code defines (0 for most).
async fn send_error_at(
    w: &mut OwnedWriteHalf,
    request_id: u64,
    code: RefusalCode,
    addr: u64,
    msg: &str,
) -> io::Result<()> {
    let msg = &msg.as_bytes()[..msg.len().min(crate::wire::MAX_ERROR_LEN as usize)];
    let h = Header {
        code: code as u16,
        request_id,
        addr,
        len: msg.len() as u64,
        ..Header::new(Opcode::Error)
    };
    let mut frame = h.to_bytes().to_vec();
    frame.extend_from_slice(msg);
    write_all(w, &frame).await
}

/// Answers a NOTIFY the inbox did not take.
async fn send_refusal(w: &mut OwnedWriteHalf, request_id: u64, r: &crate::notify::Refused) -> io::Result<()> {
    send_error_at(w, request_id, r.code, r.max, &r.message).await
}

/// Sends a refusal that ends the connection and returns the error that ends it.
async fn refuse(w: &mut OwnedWriteHalf, request_id: u64, code: RefusalCode, msg: &str) -> io::Error {
    let kind = if code == RefusalCode::Unauthenticated {
        io::ErrorKind::PermissionDenied
    } else {
        io::ErrorKind::InvalidData
    };
    let _ = send_error(w, request_id, code, msg).await;
    io::Error::new(kind, msg.to_string())
}

fn refusal(e: LookupError, h: &Header) -> (RefusalCode, String) {
    match e {
        LookupError::ZeroLength => (RefusalCode::ZeroLength, "zero-length request".to_string()),
        LookupError::Overflow => (
            RefusalCode::OutOfBounds,
            format!("address {:#x} + length {} overflows", h.addr, h.len),
        ),
        LookupError::Outside => (
            RefusalCode::OutOfBounds,
            format!(
                "range [{:#x}, +{}) is not inside one registered, exported region",
                h.addr, h.len
            ),
        ),
    }
}

/// Serves one connection until it closes, breaks the protocol or stalls. Returns why it ended.
pub(crate) async fn serve_connection(stream: TcpStream, server: &Server, permit: ConnectionPermit) -> io::Result<()> {
    let progress = ConnProgress::default();
    // Dropping `serve_frames` on a stall closes the socket and releases the pins it holds.
    let result = tokio::select! {
        r = serve_frames(stream, server, &progress) => r,
        e = watchdog(&progress, &server.limits) => Err(e),
    };
    drop(permit);
    result
}

/// Why the handshake's frames failed on the target's side.
enum HelloFailed {
    /// The initiator closed the connection.
    Closed,
    /// The socket failed.
    Io(io::Error),
    /// Another frame than the proof (or one for another request id): refused.
    Unexpected,
}

/// The handshake's frames on the target's side: CHALLENGE out, PROOF in, both under the
/// HELLO's request id.
struct HelloFrames<'a, R> {
    reader: &'a mut FrameReader<R>,
    w: &'a mut OwnedWriteHalf,
    id: u64,
}

impl<R: crate::frame_io::FrameSource + Send> HandshakeFrames for HelloFrames<'_, R> {
    type Error = HelloFailed;

    async fn send(&mut self, _: Step, body: &[u8]) -> Result<(), HelloFailed> {
        let challenge = Header {
            request_id: self.id,
            len: body.len() as u64,
            ..Header::new(Opcode::Challenge)
        };
        let mut frame = challenge.to_bytes().to_vec();
        frame.extend_from_slice(body);
        write_all(self.w, &frame).await.map_err(HelloFailed::Io)
    }

    async fn recv(&mut self, _: Step) -> Result<Vec<u8>, HelloFailed> {
        match self.reader.header().await.map_err(HelloFailed::Io)? {
            Some(Ok(h)) if h.opcode == Opcode::Proof && h.len == PROOF_LEN && h.request_id == self.id => {
                let mut theirs = vec![0u8; PROOF_LEN as usize];
                self.reader.payload_into(&mut theirs).await.map_err(HelloFailed::Io)?;
                Ok(theirs)
            }
            None => Err(HelloFailed::Closed),
            _ => Err(HelloFailed::Unexpected),
        }
    }
}

/// The HELLO exchange, authenticated when the server has a key. `Ok(false)`: the peer closed.
async fn handshake<R>(reader: &mut FrameReader<R>, w: &mut OwnedWriteHalf, server: &Server) -> io::Result<bool>
where
    R: crate::frame_io::FrameSource + Send,
{
    let hello = match reader.header().await? {
        None => return Ok(false),
        Some(Ok(h)) if h.opcode == Opcode::Hello => h,
        Some(Ok(h)) => return Err(refuse(w, h.request_id, RefusalCode::Protocol, "expected HELLO").await),
        Some(Err(e)) => return Err(refuse(w, 0, RefusalCode::Protocol, &e.to_string()).await),
    };
    let id = hello.request_id;
    let offers_auth = match hello.len {
        0 => false,
        HELLO_AUTH_LEN => true,
        _ => return Err(refuse(w, id, RefusalCode::Protocol, "malformed HELLO").await),
    };
    match (&server.auth, offers_auth) {
        (Some(key), true) => {
            let mut nonce: Nonce = [0u8; NONCE_LEN];
            reader.payload_into(&mut nonce).await?;
            let mut frames = HelloFrames { reader, w, id };
            match auth::respond(&mut frames, key, AUTH_CONTEXT, &nonce, "initiator").await {
                Ok(()) => {}
                Err(HandshakeError::Frames(HelloFailed::Closed)) => return Ok(false),
                Err(HandshakeError::Frames(HelloFailed::Io(e))) => return Err(e),
                Err(_) => return Err(refuse(w, id, RefusalCode::Unauthenticated, "authentication failed").await),
            }
        }
        (Some(_), false) => {
            return Err(refuse(
                w,
                id,
                RefusalCode::Unauthenticated,
                "this target requires authentication",
            )
            .await)
        }
        // No key here: the initiator that wants proof refuses our plain HELLO_ACK itself.
        (None, offers) => {
            if offers {
                reader.discard(HELLO_AUTH_LEN).await?;
            }
        }
    }
    if hello.token != server.token {
        let msg = "the requested instance is gone: the target restarted";
        return Err(refuse(w, id, RefusalCode::WrongInstance, msg).await);
    }
    let ack = Header {
        request_id: id,
        token: server.token,
        addr: server.limits.idle_timeout.as_millis() as u64,
        ..Header::new(Opcode::HelloAck)
    };
    write_all(w, &ack.to_bytes()).await?;
    Ok(true)
}

/// Serves one connection past its handshake: a loop of one request at a time, each served by
/// its own step, replies queued and flushed as the module doc says.
async fn serve_frames(stream: TcpStream, server: &Server, progress: &ConnProgress) -> io::Result<()> {
    let (r, mut w) = stream.into_split();
    let mut reader = FrameReader::new(r);

    progress.mark(true);
    let limit = server.limits.handshake_timeout;
    if !deadline(limit, "handshake", handshake(&mut reader, &mut w, server)).await? {
        return Ok(());
    }

    let mut conn = Conn {
        server,
        reader,
        w,
        // One body buffer per connection, sized on first use to the wire's bound (64 KiB + name).
        notify_body: Vec::new(),
        replies: Replies {
            queue: Vec::with_capacity(MAX_QUEUED),
            parts: Vec::with_capacity(2 * MAX_QUEUED),
            bytes: 0,
            acked: 0,
        },
    };
    loop {
        let Some(h) = conn.next_request(progress).await? else {
            return Ok(());
        };
        if h.token != server.token && matches!(h.opcode, Opcode::Write | Opcode::Read) {
            conn.refuse_other_instance(&h).await?;
            continue;
        }
        match h.opcode {
            Opcode::Write => conn.serve_write(&h).await?,
            Opcode::Read => conn.serve_read(&h).await?,
            Opcode::Ping => {}
            Opcode::Notify => conn.serve_notify(&h).await?,
            other => {
                conn.replies.flush(&mut conn.w).await?;
                let msg = format!("{other:?} is not a request");
                return Err(refuse(&mut conn.w, h.request_id, RefusalCode::Protocol, &msg).await);
            }
        }
    }
}

/// A connection being served, past its handshake.
struct Conn<'s> {
    server: &'s Server,
    reader: FrameReader<OwnedReadHalf>,
    w: OwnedWriteHalf,
    replies: Replies,
    notify_body: Vec<u8>,
}

impl Conn<'_> {
    /// Waits for the next request's header, flushing the queued replies first unless the next
    /// request is already here (buffered, or ready in the socket) and the queue has room: they
    /// are written before this connection waits for its peer. (The initiator never waits for a
    /// reply before finishing a frame it started, so held replies cannot stall it.) `None`: the
    /// peer closed the connection (after the replies were flushed).
    async fn next_request(&mut self, progress: &ConnProgress) -> io::Result<Option<Header>> {
        if self.replies.is_full() || !self.reader.fill_ready().await? {
            self.replies.flush(&mut self.w).await?;
            progress.mark(false);
        }
        if !self.reader.fill().await? {
            return Ok(None);
        }
        progress.mark(true);
        match self.reader.header().await? {
            None => self.replies.flush(&mut self.w).await.map(|()| None),
            Some(Ok(h)) => Ok(Some(h)),
            Some(Err(e)) => {
                self.replies.flush(&mut self.w).await?;
                Err(refuse(&mut self.w, 0, RefusalCode::Protocol, &e.to_string()).await)
            }
        }
    }

    /// Sends the queued replies, then an ERROR frame answering `request_id`.
    async fn error_after_replies(&mut self, request_id: u64, code: RefusalCode, msg: &str) -> io::Result<()> {
        self.replies.flush(&mut self.w).await?;
        send_error(&mut self.w, request_id, code, msg).await
    }

    /// A read or write naming another instance (the target restarted): refused, its payload
    /// skipped, the connection kept.
    async fn refuse_other_instance(&mut self, h: &Header) -> io::Result<()> {
        self.reader.discard(h.payload_len()).await?;
        let msg = "request for another instance: the target restarted";
        self.error_after_replies(h.request_id, RefusalCode::WrongInstance, msg)
            .await
    }

    /// A write: its payload straight into the region (pinned while it comes in), then an
    /// acknowledgement queued; outside every exported region, refused and its payload skipped.
    async fn serve_write(&mut self, h: &Header) -> io::Result<()> {
        match self.server.regions.acquire(h.addr, h.len) {
            Ok(pin) => {
                // SAFETY: `pin` keeps the registered, exported region [addr, +len) mapped
                // until the payload is in; remote writes are the purpose of exporting it.
                let dst = unsafe { std::slice::from_raw_parts_mut(h.addr as usize as *mut u8, h.len as usize) };
                let received = self.reader.payload_into(dst).await;
                drop(pin);
                received?;
                let ack = Header {
                    request_id: h.request_id,
                    token: self.server.token,
                    addr: h.addr,
                    len: h.len,
                    ..Header::new(Opcode::WriteAck)
                };
                self.replies.push(ack, RawPart { addr: 0, len: 0 }, None);
                Ok(())
            }
            Err(e) => {
                self.reader.discard(h.len).await?;
                let (code, msg) = refusal(e, h);
                self.error_after_replies(h.request_id, code, &msg).await
            }
        }
    }

    /// A read: its reply queued with the region's bytes as payload, the region pinned until the
    /// reply is written; outside every exported region, refused.
    async fn serve_read(&mut self, h: &Header) -> io::Result<()> {
        match self.server.regions.acquire(h.addr, h.len) {
            Ok(pin) => {
                let data = Header {
                    request_id: h.request_id,
                    token: self.server.token,
                    addr: h.addr,
                    len: h.len,
                    ..Header::new(Opcode::ReadData)
                };
                let payload = RawPart {
                    addr: h.addr as usize,
                    len: h.len as usize,
                };
                self.replies.push(data, payload, Some(pin));
                Ok(())
            }
            Err(e) => {
                let (code, msg) = refusal(e, h);
                self.error_after_replies(h.request_id, code, &msg).await
            }
        }
    }

    /// A notification: delivered to the inbox and acknowledged, or refused when the inbox does
    /// not take it. Frames on a connection are served in order, so the writes before it are in
    /// memory already; the initiator sends it only after they were acknowledged.
    async fn serve_notify(&mut self, h: &Header) -> io::Result<()> {
        let body = crate::notify::body_buffer(&mut self.notify_body, h.len);
        self.reader.payload_into(body).await?;
        match crate::notify::deliver(&self.server.inbox, body) {
            Ok(()) => {
                let ack = Header {
                    request_id: h.request_id,
                    token: self.server.token,
                    ..Header::new(Opcode::NotifyAck)
                };
                self.replies.push(ack, RawPart { addr: 0, len: 0 }, None);
                Ok(())
            }
            Err(refused) => {
                self.replies.flush(&mut self.w).await?;
                send_refusal(&mut self.w, h.request_id, &refused).await
            }
        }
    }
}
