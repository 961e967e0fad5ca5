//! The `Transport` implementation: its own I/O runtime, the listener, and the pool of peers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use te_base::{
    Capabilities, Error, InstallContext, MemoryKinds, Peer, RegionInfo, Result, SegmentDescriptor, Transport,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::{Handle, Runtime};
use tokio::task::JoinHandle;

use crate::config::TcpConfig;
use crate::endpoint::{advertised, TcpEndpoint};
use crate::lane::Lane;
use crate::peer::TcpPeer;
use crate::regions::RegionTable;
use crate::serve::{accept_loop, Server};
use crate::wire::{Header, Opcode, RefusalCode, HEADER_LEN, MAX_ERROR_LEN};

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
    peers: Mutex<HashMap<(String, u64), Weak<TcpPeer>>>,
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
    /// Starts the transport: its I/O threads and its listener.
    pub async fn start(config: TcpConfig) -> Result<TcpTransport> {
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
        let server = Arc::new(Server {
            regions: Arc::new(RegionTable::default()),
            token: endpoint.token,
            timeout: config.timeout,
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
            peers: Mutex::new(HashMap::new()),
        })
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

    fn live_peers(&self) -> Vec<Arc<TcpPeer>> {
        self.peers.lock().values().filter_map(Weak::upgrade).collect()
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
        for p in self.live_peers() {
            p.kill(Error::Closed("tcp transport".into()));
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Applies keepalive and a user timeout so the kernel also notices a peer that vanished silently.
fn tune(stream: &TcpStream, timeout: Duration) {
    let _ = stream.set_nodelay(true);
    let sock = socket2::SockRef::from(stream);
    let idle = (timeout / 2).max(Duration::from_secs(1));
    let ka = socket2::TcpKeepalive::new().with_time(idle).with_interval(idle);
    let _ = sock.set_tcp_keepalive(&ka);
    #[cfg(target_os = "linux")]
    let _ = sock.set_tcp_user_timeout(Some(timeout));
}

/// Connects one lane: tries each address, greets the instance `ep.token` names.
async fn connect_lane(peer: &str, ep: &TcpEndpoint, timeout: Duration) -> Result<TcpStream> {
    let mut failures = Vec::new();
    for addr in &ep.addrs {
        match tokio::time::timeout(timeout, greet(*addr, ep.token)).await {
            Ok(Ok(stream)) => {
                tune(&stream, timeout);
                return Ok(stream);
            }
            Ok(Err(GreetError::Restarted(msg))) => {
                return Err(Error::PeerGone {
                    peer: peer.to_string(),
                    reason: format!("{addr}: {msg}"),
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
    Other(String),
}

async fn greet(addr: SocketAddr, token: u64) -> std::result::Result<TcpStream, GreetError> {
    let other = |e: std::io::Error| GreetError::Other(e.to_string());
    let mut stream = TcpStream::connect(addr).await.map_err(other)?;
    let hello = Header {
        token,
        ..Header::new(Opcode::Hello)
    };
    stream.write_all(&hello.to_bytes()).await.map_err(other)?;
    let mut raw = [0u8; HEADER_LEN];
    stream.read_exact(&mut raw).await.map_err(other)?;
    let reply = Header::decode(&raw).map_err(|e| GreetError::Other(format!("bad reply: {e}")))?;
    match reply.opcode {
        Opcode::HelloAck if reply.token == token => Ok(stream),
        Opcode::Error => {
            let mut msg = vec![0u8; reply.len.min(MAX_ERROR_LEN) as usize];
            stream.read_exact(&mut msg).await.map_err(other)?;
            let text = String::from_utf8_lossy(&msg).into_owned();
            if RefusalCode::from_u16(reply.code) == RefusalCode::WrongInstance {
                Err(GreetError::Restarted(text))
            } else {
                Err(GreetError::Other(text))
            }
        }
        op => Err(GreetError::Other(format!("unexpected {op:?} reply to HELLO"))),
    }
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
        let key = (peer.name.clone(), ep.token);
        if let Some(existing) = self.peers.lock().get(&key).and_then(Weak::upgrade) {
            if existing.is_healthy() {
                return Ok(existing);
            }
        }
        let name = peer.name.clone();
        let lanes = self.config.lanes;
        let timeout = self.config.timeout;
        let lanes = self
            .handle
            .spawn(async move {
                let mut out = Vec::with_capacity(lanes);
                for i in 0..lanes {
                    let stream = connect_lane(&name, &ep, timeout).await?;
                    out.push(Lane::start(i as u64, name.clone(), ep.token, stream, timeout));
                }
                Ok::<_, Error>(out)
            })
            .await
            .map_err(|e| Error::transport("tcp", format!("connect task failed: {e}")))??;
        let connected = Arc::new(TcpPeer {
            descriptor: peer.clone(),
            local: self.local.clone(),
            lanes,
            slice: self.config.slice_bytes,
        });
        let mut pool = self.peers.lock();
        pool.retain(|_, w| w.strong_count() > 0);
        pool.insert(key, Arc::downgrade(&connected));
        Ok(connected)
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
        for p in self.live_peers() {
            p.kill(Error::Closed("tcp transport".into()));
        }
    }
}

/// Starts the TCP transport with settings from `ctx.env`.
pub async fn install(ctx: &InstallContext) -> Result<Arc<dyn Transport>> {
    let config = TcpConfig::from_env(ctx.env.as_ref())?;
    Ok(Arc::new(TcpTransport::start(config).await?))
}
