//! The serving side: accepts connections and answers reads and writes into exported memory.
//!
//! Every request is checked against the region table (registered AND exported) and the instance
//! token before any byte of memory is touched; anything else gets an ERROR frame back and is never
//! served. A frame that breaks the protocol gets an ERROR frame and the connection is closed.
//! Replies are queued and written with one vectored write when the next request is not already
//! buffered, so a burst of small requests is answered with few syscalls.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::frame_io::{write_all, write_all_raw, FrameReader, RawPart};
use crate::regions::{LookupError, RegionGuard, RegionTable};
use crate::wire::{Header, Opcode, RefusalCode, HEADER_LEN};

/// Flush queued replies once this many are waiting.
const MAX_QUEUED: usize = 32;
/// Flush queued replies once their payloads reach this many bytes.
const MAX_QUEUED_BYTES: u64 = 4 << 20;

/// State shared by every served connection.
pub(crate) struct Server {
    /// What may be touched.
    pub regions: Arc<RegionTable>,
    /// This instance's token; requests naming another are refused.
    pub token: u64,
    /// How long a write's payload may stall before the connection is cut (its region pin would
    /// otherwise hold up deregistration forever).
    pub timeout: Duration,
}

/// Progress of one served connection, watched by [`stall_watchdog`].
#[derive(Default)]
struct ConnProgress {
    /// Payload bytes are awaited into exported memory (a pin is held).
    receiving: AtomicBool,
    /// Payloads completed.
    done: AtomicU64,
}

impl ConnProgress {
    /// Runs one payload read under the watchdog's eye.
    async fn watch<T>(&self, read: impl std::future::Future<Output = T>) -> T {
        self.receiving.store(true, Ordering::Relaxed);
        let out = read.await;
        self.receiving.store(false, Ordering::Relaxed);
        self.done.fetch_add(1, Ordering::Relaxed);
        out
    }
}

/// Shuts the connection down when a payload makes no progress for `timeout`. Checks a counter
/// every quarter timeout: nothing on the data path reads a clock.
async fn stall_watchdog(progress: Arc<ConnProgress>, socket: socket2::Socket, timeout: Duration) {
    let tick = (timeout / 4).max(Duration::from_millis(1));
    let mut last = u64::MAX;
    let mut stalled = Duration::ZERO;
    loop {
        tokio::time::sleep(tick).await;
        let now = progress.done.load(Ordering::Relaxed);
        if now != last || !progress.receiving.load(Ordering::Relaxed) {
            last = now;
            stalled = Duration::ZERO;
            continue;
        }
        stalled += tick;
        if stalled >= timeout {
            let _ = socket.shutdown(std::net::Shutdown::Both);
            return;
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
    loop {
        match listener.accept().await {
            Ok((stream, from)) => {
                let server = server.clone();
                let task = tokio::spawn(async move {
                    if let Err(e) = serve_connection(stream, &server).await {
                        tracing::debug!("tcp: connection from {from} ended: {e}");
                    }
                });
                let mut conns = connections.lock();
                conns.retain(|t| !t.is_finished());
                conns.push(task);
            }
            Err(e) => {
                // Out of descriptors and similar: keep serving the connections we have.
                tracing::warn!("tcp: accept failed: {e}");
                tokio::task::yield_now().await;
            }
        }
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
    bytes: u64,
}

impl Replies {
    fn push(&mut self, header: Header, payload: RawPart, pin: Option<RegionGuard>) {
        self.bytes += payload.len as u64;
        self.queue.push(Reply {
            header: header.to_bytes(),
            payload,
            _pin: pin,
        });
    }

    fn is_full(&self) -> bool {
        self.queue.len() >= MAX_QUEUED || self.bytes >= MAX_QUEUED_BYTES
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
        result
    }
}

async fn send_error(w: &mut OwnedWriteHalf, request_id: u64, code: RefusalCode, msg: &str) -> io::Result<()> {
    let msg = &msg.as_bytes()[..msg.len().min(crate::wire::MAX_ERROR_LEN as usize)];
    let h = Header {
        code: code as u16,
        request_id,
        len: msg.len() as u64,
        ..Header::new(Opcode::Error)
    };
    let mut frame = h.to_bytes().to_vec();
    frame.extend_from_slice(msg);
    write_all(w, &frame).await
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

/// Serves one connection until it closes. Returns the reason it ended.
pub(crate) async fn serve_connection(stream: TcpStream, server: &Server) -> io::Result<()> {
    let _ = stream.set_nodelay(true);
    let progress = Arc::new(ConnProgress::default());
    let watchdog = socket2::SockRef::from(&stream)
        .try_clone()
        .ok()
        .map(|sock| tokio::spawn(stall_watchdog(progress.clone(), sock, server.timeout)));
    let result = serve_frames(stream, server, &progress).await;
    if let Some(w) = watchdog {
        w.abort();
    }
    result
}

async fn serve_frames(stream: TcpStream, server: &Server, progress: &ConnProgress) -> io::Result<()> {
    let (r, mut w) = stream.into_split();
    let mut reader = FrameReader::new(r);

    // Handshake: the initiator names the instance it wants.
    match reader.header().await? {
        None => return Ok(()),
        Some(Ok(h)) if h.opcode == Opcode::Hello && h.token == server.token => {
            let ack = Header {
                request_id: h.request_id,
                token: server.token,
                ..Header::new(Opcode::HelloAck)
            };
            write_all(&mut w, &ack.to_bytes()).await?;
        }
        Some(Ok(h)) if h.opcode == Opcode::Hello => {
            let msg = format!(
                "this instance is {:#x}, not {:#x}: the target restarted",
                server.token, h.token
            );
            send_error(&mut w, h.request_id, RefusalCode::WrongInstance, &msg).await?;
            return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
        }
        Some(Ok(h)) => {
            let msg = format!("expected HELLO, got {:?}", h.opcode);
            send_error(&mut w, h.request_id, RefusalCode::Protocol, &msg).await?;
            return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
        }
        Some(Err(e)) => {
            send_error(&mut w, 0, RefusalCode::Protocol, &e.to_string()).await?;
            return Err(io::Error::new(io::ErrorKind::InvalidData, e));
        }
    }

    let mut replies = Replies {
        queue: Vec::with_capacity(MAX_QUEUED),
        parts: Vec::with_capacity(2 * MAX_QUEUED),
        bytes: 0,
    };
    loop {
        if !reader.has_buffered_header() || replies.is_full() {
            replies.flush(&mut w).await?;
        }
        let h = match reader.header().await? {
            None => return replies.flush(&mut w).await,
            Some(Ok(h)) => h,
            Some(Err(e)) => {
                replies.flush(&mut w).await?;
                send_error(&mut w, 0, RefusalCode::Protocol, &e.to_string()).await?;
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        };
        if h.token != server.token && matches!(h.opcode, Opcode::Write | Opcode::Read) {
            progress.watch(reader.discard(h.payload_len())).await?;
            replies.flush(&mut w).await?;
            let msg = format!("request for instance {:#x}; this is {:#x}", h.token, server.token);
            send_error(&mut w, h.request_id, RefusalCode::WrongInstance, &msg).await?;
            continue;
        }
        match h.opcode {
            Opcode::Write => match server.regions.acquire(h.addr, h.len) {
                Ok(pin) => {
                    // SAFETY: `pin` keeps the registered, exported region [addr, +len) mapped
                    // until the payload is in; remote writes are the purpose of exporting it.
                    let dst = unsafe { std::slice::from_raw_parts_mut(h.addr as usize as *mut u8, h.len as usize) };
                    let received = progress.watch(reader.payload_into(dst)).await;
                    drop(pin);
                    received?;
                    let ack = Header {
                        request_id: h.request_id,
                        token: server.token,
                        addr: h.addr,
                        len: h.len,
                        ..Header::new(Opcode::WriteAck)
                    };
                    replies.push(ack, RawPart { addr: 0, len: 0 }, None);
                }
                Err(e) => {
                    progress.watch(reader.discard(h.len)).await?;
                    replies.flush(&mut w).await?;
                    let (code, msg) = refusal(e, &h);
                    send_error(&mut w, h.request_id, code, &msg).await?;
                }
            },
            Opcode::Read => match server.regions.acquire(h.addr, h.len) {
                Ok(pin) => {
                    let data = Header {
                        request_id: h.request_id,
                        token: server.token,
                        addr: h.addr,
                        len: h.len,
                        ..Header::new(Opcode::ReadData)
                    };
                    let payload = RawPart {
                        addr: h.addr as usize,
                        len: h.len as usize,
                    };
                    replies.push(data, payload, Some(pin));
                }
                Err(e) => {
                    replies.flush(&mut w).await?;
                    let (code, msg) = refusal(e, &h);
                    send_error(&mut w, h.request_id, code, &msg).await?;
                }
            },
            other => {
                replies.flush(&mut w).await?;
                let msg = format!("{other:?} is not a request");
                send_error(&mut w, h.request_id, RefusalCode::Protocol, &msg).await?;
                return Err(io::Error::new(io::ErrorKind::InvalidData, msg));
            }
        }
    }
}
