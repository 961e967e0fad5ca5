//! The `Transport` implementation: its own I/O runtime, the listener, and the pool of peers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use te_base::auth::{self as auth, AuthKey, HandshakeError, HandshakeFrames, Step};
use te_base::listener::{tune_socket, ConnectionGate};
use te_base::{
    Capabilities, Error, InstallContext, MemoryKinds, Peer, RegionInfo, Result, SegmentDescriptor, Transport,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::{Handle, Runtime};
use tokio::task::JoinHandle;

use crate::config::TcpConfig;
use crate::endpoint::{advertised, TcpEndpoint};
use crate::lane::{Lane, LaneOpener};
use crate::peer::{Connection, TcpPeer};
use crate::regions::RegionTable;
use crate::serve::{accept_loop, Server, AUTH_CONTEXT};
use crate::wire::{Header, Opcode, RefusalCode, CHALLENGE_LEN, HEADER_LEN, MAX_ERROR_LEN};

/// The TCP transport.
pub struct TcpTransport {
    config: TcpConfig,
    runtime: Option<Runtime>,
    handle: Handle,
    endpoint: TcpEndpoint,
    local_addr: SocketAddr,
    server: Arc<Server>,
    local: Arc<RegionTable>,
    listener: Mutex<Option<JoinHandle<()>>>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// Open connections by (address connected to, instance token the target acknowledged after
    /// authenticating): what was verified, not what a descriptor claims.
    pool: Mutex<HashMap<(SocketAddr, u64), Weak<Connection>>>,
    auth: Option<AuthKey>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("local_addr", &self.local_addr)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl TcpTransport {
    /// Starts the transport without a shared key: its I/O threads and its listener, open to
    /// anyone who reaches it (logged once).
    pub async fn start(config: TcpConfig) -> Result<TcpTransport> {
        TcpTransport::start_with_auth(config, None).await
    }

    /// Starts the transport; with `auth`, peers in both directions must prove the key.
    pub async fn start_with_auth(config: TcpConfig, auth: Option<AuthKey>) -> Result<TcpTransport> {
        let inbox = te_base::NotifyInbox::new(te_base::NotifyLimits::default());
        TcpTransport::start_with(config, auth, inbox).await
    }

    /// Starts the transport, delivering the notifications peers send into `inbox` (the engine's).
    pub async fn start_with(
        config: TcpConfig,
        auth: Option<AuthKey>,
        inbox: Arc<te_base::NotifyInbox>,
    ) -> Result<TcpTransport> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads)
            .thread_name("te-tcp")
            .enable_all()
            .build()
            .map_err(|e| Error::io("tcp: starting the I/O runtime", e))?;
        let handle = runtime.handle().clone();
        let listen = config.listen;
        let listener = handle
            .spawn(async move { TcpListener::bind(listen).await })
            .await
            .map_err(|e| Error::transport("tcp", format!("listener task failed: {e}")))?
            .map_err(|e| Error::io(format!("tcp: listening on {listen} (TE_TCP_LISTEN)"), e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("tcp: reading the listening address", e))?;
        let endpoint = TcpEndpoint {
            addrs: advertised(local_addr, config.advertise.as_deref())?,
            token: te_base::token::random_token(),
        };
        if auth.is_none() {
            te_base::auth::warn_unauthenticated(
                "the tcp transport",
                &local_addr.to_string(),
                "read and write access to exported memory",
            );
        }
        let server = Arc::new(Server {
            regions: Arc::new(RegionTable::default()),
            token: endpoint.token,
            limits: config.limits,
            auth: auth.clone(),
            gate: ConnectionGate::new(&config.limits),
            inbox,
        });
        let connections = Arc::new(Mutex::new(Vec::new()));
        let listener = handle.spawn(accept_loop(listener, server.clone(), connections.clone()));
        Ok(TcpTransport {
            config,
            runtime: Some(runtime),
            handle,
            endpoint,
            local_addr,
            server,
            local: Arc::new(RegionTable::with_private()),
            listener: Mutex::new(Some(listener)),
            connections,
            pool: Mutex::new(HashMap::new()),
            auth,
        })
    }

    /// Where notifications sent to this transport's segment are delivered.
    pub fn notifications(&self) -> &Arc<te_base::NotifyInbox> {
        &self.server.inbox
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The endpoint this transport advertises.
    pub fn tcp_endpoint(&self) -> &TcpEndpoint {
        &self.endpoint
    }

    /// Remote requests reading or writing this transport's exported memory right now (for tests
    /// and diagnostics).
    pub fn remote_requests_in_progress(&self) -> u64 {
        self.server.regions.pins()
    }

    /// The settings in force.
    pub fn config(&self) -> &TcpConfig {
        &self.config
    }

    /// Connections served by the listener right now (for tests and diagnostics).
    pub fn served_connections(&self) -> usize {
        self.server.gate.open()
    }

    fn live_connections(&self) -> Vec<Arc<Connection>> {
        self.pool.lock().values().filter_map(Weak::upgrade).collect()
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        if let Some(l) = self.listener.get_mut().take() {
            l.abort();
        }
        for c in self.connections.lock().drain(..) {
            c.abort();
        }
        for c in self.live_connections() {
            c.kill(Error::Closed("tcp transport".into()));
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// A greeted connection.
struct Greeted {
    stream: TcpStream,
    addr: SocketAddr,
    /// The target's idle timeout, from its HELLO_ACK (zero: it does not cut idle connections).
    idle: Duration,
}

/// Connects one lane: tries each address, greets the instance `ep.token` names, and proves the
/// key (and checks the target's proof) when this transport has one.
async fn connect_lane(peer: &str, ep: &TcpEndpoint, timeout: Duration, auth: Option<&AuthKey>) -> Result<Greeted> {
    let mut failures = Vec::new();
    for addr in &ep.addrs {
        match tokio::time::timeout(timeout, greet(*addr, ep.token, auth, timeout)).await {
            Ok(Ok((stream, idle))) => {
                return Ok(Greeted {
                    stream,
                    addr: *addr,
                    idle,
                });
            }
            Ok(Err(GreetError::Restarted(msg))) => {
                return Err(Error::PeerGone {
                    peer: peer.to_string(),
                    reason: format!("{addr}: {msg}"),
                })
            }
            Ok(Err(GreetError::Unauthenticated(reason))) => {
                return Err(Error::Unauthenticated {
                    peer: peer.to_string(),
                    reason: format!("{addr}: {reason}"),
                })
            }
            Ok(Err(GreetError::Other(msg))) => failures.push(format!("{addr}: {msg}")),
            Err(_) => failures.push(format!("{addr}: no answer within {} ms", timeout.as_millis())),
        }
    }
    Err(Error::PeerGone {
        peer: peer.to_string(),
        reason: format!("cannot connect: {}", failures.join("; ")),
    })
}

enum GreetError {
    Restarted(String),
    Unauthenticated(String),
    Other(String),
}

async fn greet(
    addr: SocketAddr,
    token: u64,
    auth: Option<&AuthKey>,
    timeout: Duration,
) -> std::result::Result<(TcpStream, Duration), GreetError> {
    let other = |e: std::io::Error| GreetError::Other(e.to_string());
    let mut stream = TcpStream::connect(addr).await.map_err(other)?;
    // Before the first frame: the handshake is small frames back and forth, which must never
    // wait for a delayed ACK (TCP_NODELAY is part of the tuning).
    tune_socket(&stream, timeout);
    match auth {
        // The shared-key handshake (te_base::auth): HELLO with the nonce, CHALLENGE, PROOF.
        Some(key) => {
            let mut frames = GreetFrames {
                stream: &mut stream,
                token,
            };
            auth::initiate(&mut frames, key, AUTH_CONTEXT, &addr.to_string())
                .await
                .map_err(|e| match e {
                    HandshakeError::Frames(e) => e,
                    HandshakeError::Malformed { .. } => GreetError::Other("a malformed challenge".into()),
                    HandshakeError::Unauthenticated(_) => {
                        GreetError::Unauthenticated("the target does not hold this engine's key".into())
                    }
                })?;
        }
        None => {
            let hello = Header {
                token,
                ..Header::new(Opcode::Hello)
            };
            stream.write_all(&hello.to_bytes()).await.map_err(other)?;
        }
    }
    let reply = read_header(&mut stream).await?;
    match reply.opcode {
        Opcode::HelloAck if reply.token == token => Ok((stream, Duration::from_millis(reply.addr))),
        _ => Err(refusal(&mut stream, reply).await),
    }
}

/// The handshake's frames on the initiator's side: HELLO (carrying the expected instance token)
/// and PROOF out, CHALLENGE in.
struct GreetFrames<'s> {
    stream: &'s mut TcpStream,
    token: u64,
}

impl HandshakeFrames for GreetFrames<'_> {
    type Error = GreetError;

    async fn send(&mut self, step: Step, body: &[u8]) -> std::result::Result<(), GreetError> {
        let (opcode, token) = match step {
            Step::Hello => (Opcode::Hello, self.token),
            _ => (Opcode::Proof, 0),
        };
        let h = Header {
            token,
            len: body.len() as u64,
            ..Header::new(opcode)
        };
        let mut frame = h.to_bytes().to_vec();
        frame.extend_from_slice(body);
        self.stream
            .write_all(&frame)
            .await
            .map_err(|e| GreetError::Other(e.to_string()))
    }

    async fn recv(&mut self, _: Step) -> std::result::Result<Vec<u8>, GreetError> {
        let reply = read_header(self.stream).await?;
        match reply.opcode {
            Opcode::Challenge if reply.len == CHALLENGE_LEN => {
                let mut body = vec![0u8; CHALLENGE_LEN as usize];
                self.stream
                    .read_exact(&mut body)
                    .await
                    .map_err(|e| GreetError::Other(e.to_string()))?;
                Ok(body)
            }
            Opcode::HelloAck => Err(GreetError::Unauthenticated(
                "the target does not authenticate (it has no key)".into(),
            )),
            _ => Err(refusal(self.stream, reply).await),
        }
    }
}

/// What a reply other than HELLO_ACK (for this instance) to a HELLO means.
async fn refusal(stream: &mut TcpStream, reply: Header) -> GreetError {
    let other = |e: std::io::Error| GreetError::Other(e.to_string());
    match reply.opcode {
        Opcode::Error => {
            let mut msg = vec![0u8; reply.len.min(MAX_ERROR_LEN) as usize];
            if let Err(e) = stream.read_exact(&mut msg).await {
                return other(e);
            }
            let text = String::from_utf8_lossy(&msg).into_owned();
            match RefusalCode::from_u16(reply.code) {
                RefusalCode::WrongInstance => GreetError::Restarted(text),
                RefusalCode::Unauthenticated => GreetError::Unauthenticated(text),
                _ => GreetError::Other(text),
            }
        }
        op => GreetError::Other(format!("unexpected {op:?} reply to HELLO")),
    }
}

async fn read_header(stream: &mut TcpStream) -> std::result::Result<Header, GreetError> {
    let mut raw = [0u8; HEADER_LEN];
    stream
        .read_exact(&mut raw)
        .await
        .map_err(|e| GreetError::Other(e.to_string()))?;
    Header::decode(&raw).map_err(|e| GreetError::Other(format!("bad reply: {e}")))
}

#[async_trait]
impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: MemoryKinds::HOST,
            remote: MemoryKinds::HOST,
        }
    }

    fn endpoint(&self) -> serde_json::Value {
        serde_json::to_value(&self.endpoint).unwrap_or(serde_json::Value::Null)
    }

    fn can_reach(&self, peer: &SegmentDescriptor) -> bool {
        TcpEndpoint::of(peer).is_ok()
    }

    async fn register(&self, regions: &[RegionInfo]) -> Result<Vec<serde_json::Value>> {
        let host: Vec<RegionInfo> = regions.iter().filter(|r| r.location.is_host()).cloned().collect();
        self.local.add(&host)?;
        if let Err(e) = self.server.regions.add(&host) {
            self.local.remove(&host).await;
            return Err(e);
        }
        Ok(vec![serde_json::Value::Null; regions.len()])
    }

    async fn deregister(&self, regions: &[RegionInfo]) -> Result<()> {
        self.server.regions.remove(regions).await;
        self.local.remove(regions).await;
        Ok(())
    }

    async fn connect(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Peer>> {
        let ep = TcpEndpoint::of(peer)?;
        let pooled = {
            let pool = self.pool.lock();
            ep.addrs
                .iter()
                .filter_map(|a| pool.get(&(*a, ep.token)).and_then(Weak::upgrade))
                .find(|c| c.is_healthy())
        };
        let connection = match pooled {
            Some(c) => c,
            None => self.open_connection(&peer.name, ep).await?,
        };
        // Every connect gets the descriptor it was given, so requests are checked against the
        // peer's current buffers; the connection itself is shared.
        Ok(Arc::new(TcpPeer {
            descriptor: peer.clone(),
            local: self.local.clone(),
            connection,
            slice: self.config.slice_bytes,
        }))
    }

    async fn shutdown(&self) {
        // Stop accepting, end every served connection, and wait until their sockets are closed.
        let mut tasks: Vec<JoinHandle<()>> = self.listener.lock().take().into_iter().collect();
        tasks.append(&mut self.connections.lock());
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
        for c in self.live_connections() {
            c.kill(Error::Closed("tcp transport".into()));
        }
    }
}

impl TcpTransport {
    /// Opens `lanes` greeted connections to the instance `ep` names and pools them.
    async fn open_connection(&self, name: &str, ep: TcpEndpoint) -> Result<Arc<Connection>> {
        let lanes = self.config.lanes;
        let timeout = self.config.timeout;
        let auth = self.auth.clone();
        let peer = name.to_string();
        let token = ep.token;
        let relief_ep = ep.clone();
        let (lanes, addr) = self
            .handle
            .spawn(async move {
                let mut out = Vec::with_capacity(lanes);
                let mut addr = None;
                for _ in 0..lanes {
                    let g = connect_lane(&peer, &ep, timeout, auth.as_ref()).await?;
                    addr.get_or_insert(g.addr);
                    out.push(Lane::start(peer.clone(), ep.token, g.stream, timeout, g.idle));
                }
                Ok::<_, Error>((out, addr))
            })
            .await
            .map_err(|e| Error::transport("tcp", format!("connect task failed: {e}")))??;
        // A lane cut for one batch's deadline hands the other batches' work to a sibling, or to
        // one more lane opened with this when none is alive.
        let open: LaneOpener = {
            let (peer, auth) = (name.to_string(), self.auth.clone());
            let (ep, handle) = (relief_ep, self.handle.clone());
            Arc::new(move || {
                let (peer, ep, auth, handle) = (peer.clone(), ep.clone(), auth.clone(), handle.clone());
                Box::pin(async move {
                    handle
                        .spawn(async move {
                            let g = connect_lane(&peer, &ep, timeout, auth.as_ref()).await?;
                            Ok(Lane::start(peer, ep.token, g.stream, timeout, g.idle))
                        })
                        .await
                        .map_err(|e| Error::transport("tcp", format!("connect task failed: {e}")))?
                })
            })
        };
        Lane::join(&lanes, open);
        let connection = Arc::new(Connection { lanes });
        if let Some(addr) = addr {
            let mut pool = self.pool.lock();
            pool.retain(|_, w| w.strong_count() > 0);
            pool.insert((addr, token), Arc::downgrade(&connection));
        }
        Ok(connection)
    }
}

/// Starts the TCP transport with settings from `ctx.env` and the engine's key.
pub async fn install(ctx: &InstallContext) -> Result<Arc<dyn Transport>> {
    let config = TcpConfig::from_env(ctx.env.as_ref())?;
    Ok(Arc::new(
        TcpTransport::start_with(config, ctx.auth.clone(), ctx.notifications.clone()).await?,
    ))
}
