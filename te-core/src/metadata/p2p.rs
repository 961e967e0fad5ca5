//! Peer-to-peer metadata: no store at all. Every engine answers descriptor requests on its own
//! small listener, and `fetch("host:port")` asks that engine directly.
//!
//! The engine hands its descriptor to the store through [`MetadataStore::publish`] (on every
//! change), and the store's listener serves the latest one. Names:
//! - `"host:port"` fetches the descriptor of the engine listening there (its primary segment:
//!   the first one published);
//! - `"segment@host:port"` fetches segment `segment` from the engine listening there;
//! - a plain name is answered from the descriptors published in this process, or
//!   `UnknownSegment`.
//!
//! Wire format (little-endian), one `GET` per connection:
//! ```text
//! request:  "TEmd" version:u8=1 op:u8 len:u16 payload
//!           op 1 GET (payload: segment name), 2 HELLO (initiator nonce), 3 PROOF (initiator proof)
//! answer:   "TEmd" version:u8=1 status:u8 len:u32 payload
//!           status 0 ok (descriptor JSON), 1 unknown segment, 2 refused (UTF-8 reason),
//!           3 unauthenticated (fixed text), 4 challenge (responder nonce | responder proof)
//! ```
//! With a shared key ([`te_base::auth`], context `"p2p"`), a connection runs
//! `HELLO -> CHALLENGE -> PROOF` before its `GET`; anything else first is answered
//! `unauthenticated` and the connection is closed, so a peer without the key learns nothing
//! (no descriptor, no token, no instance id, not even whether a name exists). The client checks the
//! server's proof too: a server without the key cannot hand it a forged descriptor.
//!
//! The framing ([`frame`]) is pure (no I/O), writes and reads through te-base's wire kit
//! ([`te_base::wire`]) and is property-tested; the socket code below only moves the bytes it asks
//! for. The handshake is te-base's ([`te_base::auth::initiate`] / [`te_base::auth::respond`]) over
//! these frames. The server caps connections (total and per source), and bounds the
//! handshake, reading the request and writing the answer by deadlines (`TE_P2P_*`, see
//! [`P2pConfig::from_env`]). The client reads an answer of at most `TE_P2P_MAX_ANSWER_BYTES`,
//! growing its buffer as bytes arrive (never by the announced size), within `TE_P2P_TIMEOUT_MS`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::RwLock;
use te_base::auth::{self as auth, warn_unauthenticated, AuthKey, HandshakeError, HandshakeFrames, Step, NONCE_LEN};
use te_base::config::{parse_bytes, parse_var, Env};
use te_base::listener::{
    accept_admitted, deadline, log_refusal, read_growing, AcceptBackoff, ConnectionGate, ListenerLimits,
};
use te_base::{Error, MetadataStore, Result, SegmentDescriptor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use self::frame::{AnswerHead, Op, RequestHead, Status};

/// Default listening address of the store.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:0";
/// Default time allowed for one remote fetch.
pub const DEFAULT_TIMEOUT_MS: u64 = 5000;
/// Default largest answer a fetch accepts (`TE_P2P_MAX_ANSWER_BYTES`).
pub const DEFAULT_MAX_ANSWER_BYTES: usize = 4 << 20;
/// The context of the p2p handshake's proofs (a proof for another listener is useless here).
pub const AUTH_CONTEXT: &str = "p2p";
/// Largest answer read during the handshake (a challenge or a short refusal).
const MAX_HANDSHAKE_ANSWER: usize = 4096;
/// What an unauthenticated peer is told, always the same.
const UNAUTHENTICATED_TEXT: &str = "authentication required";

/// The framing of the p2p protocol: pure encoders and decoders, no I/O.
pub mod frame {
    use te_base::wire::{Preamble, Reader, Writer};

    /// What is wrong with a frame (te-base's wire error: it names the field and its offset).
    pub use te_base::wire::WireError as FrameError;

    /// The first bytes of every frame.
    pub const MAGIC: [u8; 4] = *b"TEmd";
    /// The protocol version.
    pub const VERSION: u8 = 1;
    /// Magic and version at the start of every frame.
    pub const PREAMBLE: Preamble = Preamble {
        magic: &MAGIC,
        version: VERSION,
    };
    /// Bytes of a request header.
    pub const REQUEST_HEAD: usize = 8;
    /// Bytes of an answer header.
    pub const ANSWER_HEAD: usize = 10;

    /// A request's operation.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Op {
        /// Fetch a descriptor (payload: segment name, empty for the primary one).
        Get,
        /// Start the handshake (payload: the initiator's nonce).
        Hello,
        /// Finish the handshake (payload: the initiator's proof).
        Proof,
    }

    impl Op {
        fn code(self) -> u8 {
            match self {
                Op::Get => 1,
                Op::Hello => 2,
                Op::Proof => 3,
            }
        }
        fn from_code(c: u8) -> Option<Op> {
            Some(match c {
                1 => Op::Get,
                2 => Op::Hello,
                3 => Op::Proof,
                _ => return None,
            })
        }
    }

    /// An answer's status.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Status {
        /// The descriptor's JSON follows.
        Ok,
        /// No such segment.
        Unknown,
        /// Refused (a UTF-8 reason follows).
        Refused,
        /// The peer did not authenticate.
        Unauthenticated,
        /// The responder's nonce and proof follow.
        Challenge,
    }

    impl Status {
        fn code(self) -> u8 {
            match self {
                Status::Ok => 0,
                Status::Unknown => 1,
                Status::Refused => 2,
                Status::Unauthenticated => 3,
                Status::Challenge => 4,
            }
        }
        fn from_code(c: u8) -> Option<Status> {
            Some(match c {
                0 => Status::Ok,
                1 => Status::Unknown,
                2 => Status::Refused,
                3 => Status::Unauthenticated,
                4 => Status::Challenge,
                _ => return None,
            })
        }
    }

    /// A decoded request header.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct RequestHead {
        /// The operation.
        pub op: Op,
        /// Bytes of payload that follow.
        pub len: usize,
    }

    /// A decoded answer header.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct AnswerHead {
        /// The status.
        pub status: Status,
        /// Bytes of payload that follow.
        pub len: usize,
    }

    /// A whole answer, borrowed from the bytes it was decoded from.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Answer<'a> {
        /// The status.
        pub status: Status,
        /// The payload.
        pub payload: &'a [u8],
    }

    /// Encodes a request. `None` when the payload does not fit the 16-bit length.
    pub fn encode_request(op: Op, payload: &[u8]) -> Option<Vec<u8>> {
        let len = u16::try_from(payload.len()).ok()?;
        let mut v = Vec::with_capacity(REQUEST_HEAD + payload.len());
        PREAMBLE.write(&mut v);
        v.u8(op.code());
        v.u16(len);
        v.bytes(payload);
        Some(v)
    }

    /// Decodes a request header.
    pub fn decode_request_head(head: &[u8; REQUEST_HEAD]) -> Result<RequestHead, FrameError> {
        let mut r = Reader::new(head);
        PREAMBLE.check(&mut r)?;
        let at = r.position();
        let code = r.u8("operation")?;
        let op = Op::from_code(code).ok_or(FrameError::BadValue {
            field: "operation",
            at,
            value: code as u64,
        })?;
        Ok(RequestHead {
            op,
            len: r.u16("payload length")? as usize,
        })
    }

    /// Encodes an answer. `None` when the payload does not fit the 32-bit length.
    pub fn encode_answer(status: Status, payload: &[u8]) -> Option<Vec<u8>> {
        let len = u32::try_from(payload.len()).ok()?;
        let mut v = Vec::with_capacity(ANSWER_HEAD + payload.len());
        v.extend_from_slice(&encode_answer_head(status, len));
        v.extend_from_slice(payload);
        Some(v)
    }

    /// Encodes an answer header announcing `len` bytes of payload.
    pub fn encode_answer_head(status: Status, len: u32) -> [u8; ANSWER_HEAD] {
        let mut h = [0u8; ANSWER_HEAD];
        let mut w: &mut [u8] = &mut h;
        PREAMBLE.write(&mut w);
        w.u8(status.code());
        w.u32(len);
        debug_assert!(w.is_empty(), "the fields fill the header exactly");
        h
    }

    /// Decodes an answer header, refusing a payload longer than `max` before anything is
    /// allocated for it.
    pub fn decode_answer_head(head: &[u8; ANSWER_HEAD], max: usize) -> Result<AnswerHead, FrameError> {
        let mut r = Reader::new(head);
        PREAMBLE.check(&mut r)?;
        let at = r.position();
        let code = r.u8("status")?;
        let status = Status::from_code(code).ok_or(FrameError::BadValue {
            field: "status",
            at,
            value: code as u64,
        })?;
        let len = r.u32("payload length")?;
        if len as u64 > max as u64 {
            return Err(FrameError::TooLarge {
                field: "answer",
                len: len as u64,
                max: max as u64,
            });
        }
        Ok(AnswerHead {
            status,
            len: len as usize,
        })
    }

    /// Decodes a whole answer from the front of `bytes`: `Ok(None)` when more bytes are needed,
    /// else the answer and the bytes it used.
    pub fn decode_answer(bytes: &[u8], max: usize) -> Result<Option<(Answer<'_>, usize)>, FrameError> {
        let Some(head) = bytes.first_chunk::<ANSWER_HEAD>() else {
            return Ok(None);
        };
        let h = decode_answer_head(head, max)?;
        let end = ANSWER_HEAD + h.len;
        Ok(bytes.get(ANSWER_HEAD..end).map(|payload| {
            (
                Answer {
                    status: h.status,
                    payload,
                },
                end,
            )
        }))
    }

    /// Decodes a whole request from the front of `bytes`: `Ok(None)` when more bytes are needed,
    /// else the operation, its payload and the bytes used.
    #[allow(clippy::type_complexity)]
    pub fn decode_request(bytes: &[u8]) -> Result<Option<((Op, &[u8]), usize)>, FrameError> {
        let Some(head) = bytes.first_chunk::<REQUEST_HEAD>() else {
            return Ok(None);
        };
        let h = decode_request_head(head)?;
        let end = REQUEST_HEAD + h.len;
        Ok(bytes.get(REQUEST_HEAD..end).map(|p| ((h.op, p), end)))
    }
}

#[derive(Default)]
struct Published {
    by_name: HashMap<String, Arc<str>>,
    primary: Option<String>,
}

/// Everything the p2p store is configured with.
#[derive(Debug, Clone)]
pub struct P2pConfig {
    /// `TE_P2P_LISTEN` (default `0.0.0.0:0`).
    pub listen: SocketAddr,
    /// `TE_P2P_TIMEOUT_MS` (default 5000): one remote fetch, all included; on the serving side,
    /// reading one request and writing one answer.
    pub timeout: Duration,
    /// `TE_P2P_MAX_ANSWER_BYTES` (default 4 MiB): the largest answer a fetch reads.
    pub max_answer_bytes: usize,
    /// `TE_P2P_MAX_CONNECTIONS`, `TE_P2P_MAX_CONNECTIONS_PER_SOURCE`,
    /// `TE_P2P_HANDSHAKE_TIMEOUT_MS` of the listener.
    pub limits: ListenerLimits,
    /// The shared key (context `"p2p"`); `None` serves anyone (warned once at bind).
    pub auth: Option<AuthKey>,
}

impl P2pConfig {
    /// Defaults: listen on `listen`, fetches time out after `timeout`, no key.
    pub fn new(listen: SocketAddr, timeout: Duration) -> Self {
        P2pConfig {
            listen,
            timeout,
            max_answer_bytes: DEFAULT_MAX_ANSWER_BYTES,
            limits: ListenerLimits::with_frame_timeout(timeout),
            auth: None,
        }
    }

    /// Reads `TE_P2P_LISTEN`, `TE_P2P_TIMEOUT_MS`, `TE_P2P_MAX_ANSWER_BYTES` and the listener
    /// limits (`TE_P2P_MAX_CONNECTIONS`...), strictly.
    pub fn from_env(env: &dyn Env, auth: Option<AuthKey>) -> Result<Self> {
        let listen = match parse_var::<SocketAddr>(env, "TE_P2P_LISTEN")? {
            Some(a) => a,
            None => DEFAULT_LISTEN.parse().expect("valid default address"),
        };
        let ms = parse_var::<u64>(env, "TE_P2P_TIMEOUT_MS")?.unwrap_or(DEFAULT_TIMEOUT_MS);
        if ms == 0 {
            return Err(Error::config("TE_P2P_TIMEOUT_MS", "0", "must be at least 1"));
        }
        let timeout = Duration::from_millis(ms);
        let max_answer_bytes = match parse_bytes(env, "TE_P2P_MAX_ANSWER_BYTES")?.map(|n| n as usize) {
            None => DEFAULT_MAX_ANSWER_BYTES,
            Some(n) if n < 1024 || n > u32::MAX as usize => {
                return Err(Error::config(
                    "TE_P2P_MAX_ANSWER_BYTES",
                    n.to_string(),
                    format!("must be 1024..={}", u32::MAX),
                ))
            }
            Some(n) => n,
        };
        Ok(P2pConfig {
            listen,
            timeout,
            max_answer_bytes,
            limits: ListenerLimits::from_env(env, "TE_P2P", timeout)?,
            auth,
        })
    }
}

/// The peer-to-peer metadata store of one engine.
pub struct P2pStore {
    local_addr: SocketAddr,
    published: Arc<RwLock<Published>>,
    server: JoinHandle<()>,
    config: P2pConfig,
}

impl std::fmt::Debug for P2pStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2pStore")
            .field("local_addr", &self.local_addr)
            .field("authenticated", &self.config.auth.is_some())
            .finish()
    }
}

impl Drop for P2pStore {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl P2pStore {
    /// Listens on `addr` without a key and serves published descriptors from a task of the
    /// current runtime (defaults for everything else).
    pub async fn bind(addr: SocketAddr, timeout: Duration) -> Result<P2pStore> {
        P2pStore::start(P2pConfig::new(addr, timeout)).await
    }

    /// Listens as `config` says, from a task of the current runtime.
    pub async fn start(config: P2pConfig) -> Result<P2pStore> {
        tokio::runtime::Handle::try_current()
            .map_err(|_| Error::Metadata("p2p: the store must be created inside a tokio runtime".into()))?;
        let addr = config.listen;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io(format!("p2p metadata: listening on {addr}"), e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("p2p metadata: reading the listening address", e))?;
        if config.auth.is_none() {
            warn_unauthenticated(
                "p2p metadata",
                &local_addr.to_string(),
                "this engine's segment descriptors",
            );
        }
        let published = Arc::new(RwLock::new(Published::default()));
        let server = tokio::spawn(serve(listener, published.clone(), config.clone()));
        Ok(P2pStore {
            local_addr,
            published,
            server,
            config,
        })
    }

    /// Reads [`P2pConfig::from_env`] and starts the store; `auth` is the shared key peers must
    /// prove (and this store proves to them when it fetches).
    pub async fn from_env(env: &dyn Env, auth: Option<AuthKey>) -> Result<P2pStore> {
        P2pStore::start(P2pConfig::from_env(env, auth)?).await
    }

    /// Where this store listens: peers fetch this engine's descriptor at this address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    async fn fetch_remote(&self, addr: &str, segment: &str) -> Result<SegmentDescriptor> {
        let what = if segment.is_empty() {
            format!("p2p fetch from {addr}")
        } else {
            format!("p2p fetch of '{segment}' from {addr}")
        };
        let timeout = self.config.timeout;
        let after_ms = timeout.as_millis() as u64;
        let client = Client {
            addr,
            auth: self.config.auth.as_ref(),
            max_answer: self.config.max_answer_bytes,
        };
        let bytes = tokio::time::timeout(timeout, client.get(segment))
            .await
            .map_err(|_| Error::Timeout {
                what: what.clone(),
                after_ms,
            })??;
        // A JSON value costs tens of bytes once parsed (free-form `info` and `keys` become
        // `serde_json::Value`s), so a valid answer of `[0,0,0,...]` costs ~17x its size (17.8 MB
        // parsed from a 1 MiB answer, measured).
        // Counting the structural bytes first bounds the parsed tree to about the cap.
        let values = bytes
            .iter()
            .filter(|&&b| matches!(b, b',' | b'[' | b'{' | b':'))
            .count();
        let budget = self.config.max_answer_bytes / VALUE_COST;
        if values > budget {
            return Err(Error::InvalidDescriptor(format!(
                "{what}: the answer holds {values} JSON values, more than {budget} \
                 (TE_P2P_MAX_ANSWER_BYTES / {VALUE_COST})"
            )));
        }
        // Typed parse straight from the bytes (serde_json's recursion limit refuses deep nesting).
        let d = SegmentDescriptor::from_json(&bytes)?;
        drop(bytes);
        if !segment.is_empty() && d.name != segment {
            return Err(Error::InvalidDescriptor(format!(
                "{what}: the peer answered with segment '{}'",
                d.name
            )));
        }
        Ok(d)
    }
}

/// Splits `"segment@host:port"` / `"host:port"` into (segment, address); `None` for plain names.
fn remote_name(name: &str) -> Option<(&str, &str)> {
    let (segment, addr) = match name.rsplit_once('@') {
        Some((s, a)) => (s, a),
        None => ("", name),
    };
    let (host, port) = addr.rsplit_once(':')?;
    if host.is_empty() || port.parse::<u16>().is_err() {
        return None;
    }
    Some((segment, addr))
}

/// One fetch's connection, from the client side.
struct Client<'a> {
    addr: &'a str,
    auth: Option<&'a AuthKey>,
    max_answer: usize,
}

impl Client<'_> {
    fn io(&self, e: impl std::fmt::Display) -> Error {
        Error::Metadata(format!("p2p: {}: {e}", self.addr))
    }

    fn unauthenticated(&self, reason: &str) -> Error {
        Error::Unauthenticated {
            peer: self.addr.to_string(),
            reason: reason.into(),
        }
    }

    async fn send(&self, stream: &mut TcpStream, op: Op, payload: &[u8]) -> Result<()> {
        let req = frame::encode_request(op, payload)
            .ok_or_else(|| Error::Metadata(format!("p2p: a request of {} bytes is too long", payload.len())))?;
        stream.write_all(&req).await.map_err(|e| self.io(e))
    }

    async fn receive(&self, stream: &mut TcpStream, max: usize) -> Result<(Status, Vec<u8>)> {
        let mut head = [0u8; frame::ANSWER_HEAD];
        stream.read_exact(&mut head).await.map_err(|e| self.io(e))?;
        let AnswerHead { status, len } = frame::decode_answer_head(&head, max).map_err(|e| self.io(e))?;
        let payload = read_growing(stream, len).await.map_err(|e| self.io(e))?;
        Ok((status, payload))
    }

    /// The peer's reason, shortened and stripped of control characters.
    fn reason(payload: &[u8]) -> String {
        String::from_utf8_lossy(&payload[..payload.len().min(200)])
            .chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .collect()
    }

    async fn authenticate(&self, stream: &mut TcpStream, key: &AuthKey) -> Result<()> {
        let mut frames = ClientFrames { client: self, stream };
        auth::initiate(&mut frames, key, AUTH_CONTEXT, self.addr)
            .await
            .map_err(|e| match e {
                HandshakeError::Frames(e) | HandshakeError::Unauthenticated(e) => e,
                HandshakeError::Malformed { len, expected, .. } => Error::Metadata(format!(
                    "p2p: {}: a challenge of {len} bytes (expected {expected})",
                    self.addr
                )),
            })
    }

    /// The handshake's challenge, or why the peer answered something else.
    async fn challenge(&self, stream: &mut TcpStream) -> Result<Vec<u8>> {
        let (status, payload) = self.receive(stream, MAX_HANDSHAKE_ANSWER).await?;
        match status {
            Status::Challenge => Ok(payload),
            Status::Refused | Status::Unauthenticated => {
                Err(self.unauthenticated("the peer does not authenticate (it has no shared key configured)"))
            }
            other => Err(Error::Metadata(format!(
                "p2p: {}: answered the handshake with {other:?}",
                self.addr
            ))),
        }
    }

    async fn get(&self, segment: &str) -> Result<Vec<u8>> {
        if segment.len() > u16::MAX as usize {
            return Err(Error::Metadata(format!(
                "p2p: segment name of {} bytes is too long",
                segment.len()
            )));
        }
        let mut stream = TcpStream::connect(self.addr).await.map_err(|e| self.io(e))?;
        // The handshake is a ping-pong of small frames: without this, Nagle holds the request
        // behind the unacknowledged proof for a delayed ACK (~40 ms per fetch, measured).
        let _ = stream.set_nodelay(true);
        if let Some(key) = self.auth {
            self.authenticate(&mut stream, key).await?;
        }
        self.send(&mut stream, Op::Get, segment.as_bytes()).await?;
        let (status, payload) = self.receive(&mut stream, self.max_answer).await?;
        match status {
            Status::Ok => Ok(payload),
            Status::Unknown => Err(Error::UnknownSegment(if segment.is_empty() {
                self.addr.to_string()
            } else {
                format!("{segment}@{}", self.addr)
            })),
            Status::Unauthenticated => {
                Err(self
                    .unauthenticated("the peer requires the shared key (TE_AUTH_KEY_FILE) and this engine has none"))
            }
            Status::Refused => Err(Error::Metadata(format!(
                "p2p: {} refused: {}",
                self.addr,
                Self::reason(&payload)
            ))),
            Status::Challenge => Err(Error::Metadata(format!(
                "p2p: {}: answered a request with a challenge",
                self.addr
            ))),
        }
    }
}

/// The handshake's frames on the fetching side: HELLO and PROOF requests out, the CHALLENGE
/// answer in.
struct ClientFrames<'c, 's> {
    client: &'c Client<'c>,
    stream: &'s mut TcpStream,
}

impl HandshakeFrames for ClientFrames<'_, '_> {
    type Error = Error;

    async fn send(&mut self, step: Step, body: &[u8]) -> Result<()> {
        let op = if step == Step::Hello { Op::Hello } else { Op::Proof };
        self.client.send(self.stream, op, body).await
    }

    async fn recv(&mut self, _: Step) -> Result<Vec<u8>> {
        self.client.challenge(self.stream).await
    }
}

/// Bytes of memory a parsed JSON value may cost, for the value budget of an answer: a
/// `serde_json::Value` is 32 bytes, plus its container's spare capacity.
const VALUE_COST: usize = 64;

async fn serve(listener: TcpListener, published: Arc<RwLock<Published>>, config: P2pConfig) {
    let gate = ConnectionGate::new(&config.limits);
    let mut backoff = AcceptBackoff::default();
    let config = Arc::new(config);
    loop {
        let (stream, peer, permit) =
            accept_admitted(&listener, &gate, &mut backoff, "p2p metadata", config.timeout).await;
        let published = published.clone();
        let config = config.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = answer(stream, peer, &published, &config).await {
                tracing::debug!("p2p metadata: connection from {peer}: {e}");
            }
        });
    }
}

/// Reads one request (a bad header is `InvalidData`).
async fn read_frame(stream: &mut TcpStream) -> std::io::Result<(RequestHead, Vec<u8>)> {
    let mut head = [0u8; frame::REQUEST_HEAD];
    stream.read_exact(&mut head).await?;
    let h = frame::decode_request_head(&head).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let payload = read_growing(stream, h.len).await?;
    Ok((h, payload))
}

async fn write_answer(stream: &mut TcpStream, status: Status, payload: &[u8], limit: Duration) -> std::io::Result<()> {
    let (status, payload) = match u32::try_from(payload.len()) {
        Ok(_) => (status, payload),
        Err(_) => (Status::Refused, &b"the descriptor does not fit one answer"[..]),
    };
    let head = frame::encode_answer_head(status, payload.len() as u32);
    deadline(limit, "p2p answer", async {
        stream.write_all(&head).await?;
        stream.write_all(payload).await?;
        stream.shutdown().await
    })
    .await
}

/// Runs the server's side of the handshake (the caller bounds it by the handshake deadline);
/// `Ok(false)` when the peer did not prove the key.
async fn authenticate_peer(stream: &mut TcpStream, key: &AuthKey, peer: &str) -> std::io::Result<bool> {
    let (h, nonce_i) = read_frame(stream).await?;
    if h.op != Op::Hello || nonce_i.len() != NONCE_LEN {
        return Ok(false);
    }
    match auth::respond(&mut ServerFrames { stream }, key, AUTH_CONTEXT, &nonce_i, peer).await {
        Ok(()) => Ok(true),
        Err(HandshakeError::Frames(Some(e))) => Err(e),
        Err(_) => Ok(false),
    }
}

/// The handshake's frames on the serving side: the CHALLENGE answer out, the PROOF request in.
/// The error is `None` when the request is not a proof.
struct ServerFrames<'s> {
    stream: &'s mut TcpStream,
}

impl HandshakeFrames for ServerFrames<'_> {
    type Error = Option<std::io::Error>;

    async fn send(&mut self, _: Step, body: &[u8]) -> std::result::Result<(), Self::Error> {
        let challenge = frame::encode_answer(Status::Challenge, body).expect("64 bytes fit");
        self.stream.write_all(&challenge).await.map_err(Some)
    }

    async fn recv(&mut self, _: Step) -> std::result::Result<Vec<u8>, Self::Error> {
        match read_frame(self.stream).await.map_err(Some)? {
            (h, proof) if h.op == Op::Proof => Ok(proof),
            _ => Err(None),
        }
    }
}

async fn answer(
    mut stream: TcpStream,
    peer: SocketAddr,
    published: &RwLock<Published>,
    config: &P2pConfig,
) -> std::io::Result<()> {
    let timeout = config.timeout;
    if let Some(key) = &config.auth {
        let hs = config.limits.handshake_timeout;
        let ok = deadline(
            hs,
            "p2p handshake",
            authenticate_peer(&mut stream, key, &peer.to_string()),
        )
        .await;
        if !matches!(ok, Ok(true)) {
            match &ok {
                Ok(_) => log_refusal("p2p metadata", &peer, &"it did not prove the shared key"),
                Err(e) => log_refusal("p2p metadata", &peer, &format_args!("its handshake failed: {e}")),
            }
            // Whatever went wrong, the peer hears the same words and nothing else.
            let _ = write_answer(
                &mut stream,
                Status::Unauthenticated,
                UNAUTHENTICATED_TEXT.as_bytes(),
                timeout,
            )
            .await;
            return ok.map(|_| ());
        }
    }
    let (h, name) = match deadline(timeout, "p2p request", read_frame(&mut stream)).await {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            return write_answer(&mut stream, Status::Refused, b"bad request header", timeout).await;
        }
        Err(e) => return Err(e),
    };
    let (status, payload): (Status, Arc<str>) = match h.op {
        Op::Hello | Op::Proof => (
            Status::Refused,
            "this peer has no shared key configured (TE_AUTH_KEY_FILE)".into(),
        ),
        Op::Get => match std::str::from_utf8(&name) {
            Err(_) => (Status::Refused, "segment name is not UTF-8".into()),
            Ok(name) => {
                let p = published.read();
                let key = if name.is_empty() {
                    p.primary.as_deref()
                } else {
                    Some(name)
                };
                match key.and_then(|k| p.by_name.get(k)) {
                    Some(json) => (Status::Ok, json.clone()),
                    None => (Status::Unknown, "".into()),
                }
            }
        },
    };
    write_answer(&mut stream, status, payload.as_bytes(), timeout).await
}

#[async_trait]
impl MetadataStore for P2pStore {
    fn name(&self) -> &'static str {
        "p2p"
    }

    async fn publish(&self, descriptor: &SegmentDescriptor) -> Result<()> {
        descriptor.validate()?;
        let json: Arc<str> = descriptor.to_json().into();
        if json.len() > self.config.max_answer_bytes {
            tracing::warn!(
                "p2p: the descriptor of '{}' is {} bytes, more than TE_P2P_MAX_ANSWER_BYTES={} \
                 (peers with that limit will refuse it)",
                descriptor.name,
                json.len(),
                self.config.max_answer_bytes
            );
        }
        let mut p = self.published.write();
        p.by_name.insert(descriptor.name.clone(), json);
        if p.primary.is_none() {
            p.primary = Some(descriptor.name.clone());
        }
        Ok(())
    }

    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        if let Some((segment, addr)) = remote_name(name) {
            return self.fetch_remote(addr, segment).await;
        }
        let json = self.published.read().by_name.get(name).cloned();
        match json {
            Some(j) => SegmentDescriptor::from_json(j.as_bytes()),
            None => Err(Error::UnknownSegment(name.to_string())),
        }
    }

    async fn remove(&self, name: &str) -> Result<()> {
        let mut p = self.published.write();
        p.by_name.remove(name);
        if p.primary.as_deref() == Some(name) {
            p.primary = p.by_name.keys().next().cloned();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_point_at_peers() {
        assert_eq!(remote_name("10.0.0.1:7000"), Some(("", "10.0.0.1:7000")));
        assert_eq!(remote_name("seg@host:1"), Some(("seg", "host:1")));
        assert_eq!(remote_name("[::1]:9"), Some(("", "[::1]:9")));
        assert_eq!(remote_name("node-a"), None);
        assert_eq!(remote_name("a:b"), None);
        assert_eq!(remote_name(":80"), None);
        assert_eq!(remote_name("host:99999"), None);
    }

    mod framing {
        use super::super::frame::*;
        use proptest::prelude::*;

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![Just(Op::Get), Just(Op::Hello), Just(Op::Proof)]
        }

        fn status() -> impl Strategy<Value = Status> {
            prop_oneof![
                Just(Status::Ok),
                Just(Status::Unknown),
                Just(Status::Refused),
                Just(Status::Unauthenticated),
                Just(Status::Challenge),
            ]
        }

        proptest! {
            #[test]
            fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64), max in 0usize..64) {
                if let Ok(Some((_, used))) = decode_request(&bytes) {
                    prop_assert!(used <= bytes.len());
                }
                if let Ok(Some((a, used))) = decode_answer(&bytes, max) {
                    prop_assert!(used <= bytes.len() && a.payload.len() <= max);
                }
            }

            #[test]
            fn arbitrary_headers_never_panic(mut head in any::<[u8; ANSWER_HEAD]>(), magic in any::<bool>(), max in any::<usize>()) {
                if magic {
                    head[..4].copy_from_slice(&MAGIC);
                    head[4] = VERSION;
                }
                if let Ok(h) = decode_answer_head(&head, max) {
                    prop_assert!(h.len <= max);
                }
                let req: [u8; REQUEST_HEAD] = head[..REQUEST_HEAD].try_into().unwrap();
                let _ = decode_request_head(&req);
            }

            #[test]
            fn requests_round_trip(op in op(), payload in proptest::collection::vec(any::<u8>(), 0..300), cut in any::<prop::sample::Index>()) {
                let bytes = encode_request(op, &payload).unwrap();
                let ((o, p), used) = decode_request(&bytes).unwrap().unwrap();
                prop_assert_eq!((o, p, used), (op, &payload[..], bytes.len()));
                // Any strict prefix asks for more; trailing bytes are left alone.
                let cut = cut.index(bytes.len());
                prop_assert_eq!(decode_request(&bytes[..cut]).unwrap(), None);
                let mut longer = bytes.clone();
                longer.extend_from_slice(b"next");
                prop_assert_eq!(decode_request(&longer).unwrap().unwrap().1, bytes.len());
            }

            /// The layout of every request and answer, as the table at the top of this file
            /// gives it.
            #[test]
            fn every_frame_has_the_pinned_layout(op in op(), status in status(), payload in proptest::collection::vec(any::<u8>(), 0..300), len: u32) {
                let req = encode_request(op, &payload).unwrap();
                prop_assert_eq!(&req[..5], b"TEmd\x01");
                let op_code = match op { Op::Get => 1, Op::Hello => 2, Op::Proof => 3 };
                prop_assert_eq!(req[5], op_code);
                prop_assert_eq!(&req[6..8], &(payload.len() as u16).to_le_bytes());
                prop_assert_eq!(&req[REQUEST_HEAD..], &payload[..]);
                let head = encode_answer_head(status, len);
                prop_assert_eq!(&head[..5], b"TEmd\x01");
                let status_code = match status {
                    Status::Ok => 0,
                    Status::Unknown => 1,
                    Status::Refused => 2,
                    Status::Unauthenticated => 3,
                    Status::Challenge => 4,
                };
                prop_assert_eq!(head[5], status_code);
                prop_assert_eq!(&head[6..10], &len.to_le_bytes());
                let ans = encode_answer(status, &payload).unwrap();
                prop_assert_eq!(&ans[..ANSWER_HEAD], &encode_answer_head(status, payload.len() as u32));
                prop_assert_eq!(&ans[ANSWER_HEAD..], &payload[..]);
            }

            #[test]
            fn answers_round_trip_within_the_cap(status in status(), payload in proptest::collection::vec(any::<u8>(), 0..300), cut in any::<prop::sample::Index>()) {
                let bytes = encode_answer(status, &payload).unwrap();
                let (a, used) = decode_answer(&bytes, payload.len()).unwrap().unwrap();
                prop_assert_eq!((a.status, a.payload, used), (status, &payload[..], bytes.len()));
                let cut = cut.index(bytes.len());
                prop_assert_eq!(decode_answer(&bytes[..cut], payload.len()).unwrap_or(None), None);
                if !payload.is_empty() {
                    let too_long = decode_answer(&bytes, payload.len() - 1).unwrap_err();
                    prop_assert!(
                        matches!(too_long, FrameError::TooLarge { .. }),
                        "{:?}",
                        too_long
                    );
                }
            }
        }

        /// The exact bytes of a known request, answer and answer header, pinned before the
        /// encoders moved onto te-base's wire kit: peers of other builds read these bytes.
        #[test]
        fn known_frames_have_these_exact_bytes() {
            assert_eq!(
                encode_request(Op::Hello, b"abc").unwrap(),
                b"TEmd\x01\x02\x03\x00abc".to_vec()
            );
            assert_eq!(encode_request(Op::Get, b"").unwrap(), b"TEmd\x01\x01\x00\x00".to_vec());
            let long = vec![0x5au8; 0x0102];
            let req = encode_request(Op::Proof, &long).unwrap();
            assert_eq!(&req[..REQUEST_HEAD], b"TEmd\x01\x03\x02\x01");
            assert_eq!(&req[REQUEST_HEAD..], &long[..]);
            assert_eq!(
                encode_answer_head(Status::Challenge, 0x0102_0304),
                *b"TEmd\x01\x04\x04\x03\x02\x01"
            );
            assert_eq!(
                encode_answer(Status::Refused, b"no").unwrap(),
                b"TEmd\x01\x02\x02\x00\x00\x00no".to_vec()
            );
            assert_eq!(
                encode_answer(Status::Ok, b"").unwrap(),
                b"TEmd\x01\x00\x00\x00\x00\x00".to_vec()
            );
        }

        #[test]
        fn other_protocols_and_codes_are_named() {
            assert!(matches!(
                decode_request(b"GET / HTTP/1.1\r\n"),
                Err(FrameError::BadMagic { .. })
            ));
            assert_eq!(
                decode_request(b"TEmd\x02\x01\x00\x00"),
                Err(FrameError::BadVersion { got: 2, speaks: 1 })
            );
            assert_eq!(
                decode_request(b"TEmd\x01\x09\x00\x00"),
                Err(FrameError::BadValue {
                    field: "operation",
                    at: 5,
                    value: 9
                })
            );
            assert_eq!(
                decode_answer(b"TEmd\x01\x07\x00\x00\x00\x00", 10),
                Err(FrameError::BadValue {
                    field: "status",
                    at: 5,
                    value: 7
                })
            );
            assert!(encode_request(Op::Get, &vec![0u8; 1 << 16]).is_none());
        }
    }

    #[tokio::test]
    async fn payloads_grow_with_the_bytes_not_the_announcement() {
        use tokio::io::AsyncWriteExt;
        // A peer announcing 1 GiB that sends 100 bytes and closes costs about 100 bytes.
        let (mut tx, mut rx) = tokio::io::duplex(1 << 16);
        tx.write_all(&[7u8; 100]).await.unwrap();
        drop(tx);
        let err = read_growing(&mut rx, 1 << 30).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
        // A complete payload of 1 MiB + 1 arrives whole, in a buffer no larger than it.
        let len = (1 << 20) + 1;
        let (mut tx, mut rx) = tokio::io::duplex(1 << 16);
        let writer = tokio::spawn(async move {
            let data: Vec<u8> = (0..len).map(|i| i as u8).collect();
            tx.write_all(&data).await.unwrap();
            tx.write_all(b"extra").await.unwrap();
        });
        let got = read_growing(&mut rx, len).await.unwrap();
        writer.await.unwrap();
        assert_eq!(got.len(), len);
        assert!(got.capacity() <= len, "{} > {len}", got.capacity());
        assert!(got.iter().enumerate().all(|(i, b)| *b == i as u8));
    }
}
