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
//! Wire format (little-endian), one request per round trip:
//! ```text
//! request:  "TEmd" version:u8=1 op:u8=1(GET) name_len:u16 name
//! response: "TEmd" version:u8=1 status:u8 (0 ok, 1 unknown segment, 2 refused) len:u32 payload
//! ```
//! The payload is the descriptor's JSON (validated by the reader) or a UTF-8 reason.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::RwLock;
use te_base::config::{parse_var, Env};
use te_base::{Error, MetadataStore, Result, SegmentDescriptor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

const MAGIC: [u8; 4] = *b"TEmd";
const VERSION: u8 = 1;
const OP_GET: u8 = 1;
const STATUS_OK: u8 = 0;
const STATUS_UNKNOWN: u8 = 1;
const STATUS_REFUSED: u8 = 2;
/// Largest descriptor accepted (bounds a hostile peer's answer).
const MAX_PAYLOAD: u32 = 256 << 20;
/// Default listening address of the store.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:0";
/// Default time allowed for one remote fetch.
pub const DEFAULT_TIMEOUT_MS: u64 = 5000;

#[derive(Default)]
struct Published {
    by_name: HashMap<String, Arc<str>>,
    primary: Option<String>,
}

/// The peer-to-peer metadata store of one engine.
pub struct P2pStore {
    local_addr: SocketAddr,
    published: Arc<RwLock<Published>>,
    server: JoinHandle<()>,
    timeout: Duration,
}

impl std::fmt::Debug for P2pStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2pStore")
            .field("local_addr", &self.local_addr)
            .finish()
    }
}

impl Drop for P2pStore {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl P2pStore {
    /// Listens on `addr` and serves published descriptors from a task of the current runtime.
    pub async fn bind(addr: SocketAddr, timeout: Duration) -> Result<P2pStore> {
        tokio::runtime::Handle::try_current()
            .map_err(|_| Error::Metadata("p2p: the store must be created inside a tokio runtime".into()))?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io(format!("p2p metadata: listening on {addr}"), e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("p2p metadata: reading the listening address", e))?;
        let published = Arc::new(RwLock::new(Published::default()));
        let server = tokio::spawn(serve(listener, published.clone(), timeout));
        Ok(P2pStore {
            local_addr,
            published,
            server,
            timeout,
        })
    }

    /// Listens on `TE_P2P_LISTEN` (default `0.0.0.0:0`); remote fetches time out after
    /// `TE_P2P_TIMEOUT_MS` (default 5000).
    pub async fn from_env(env: &dyn Env) -> Result<P2pStore> {
        let addr = match parse_var::<SocketAddr>(env, "TE_P2P_LISTEN")? {
            Some(a) => a,
            None => DEFAULT_LISTEN.parse().expect("valid default address"),
        };
        let ms = parse_var::<u64>(env, "TE_P2P_TIMEOUT_MS")?.unwrap_or(DEFAULT_TIMEOUT_MS);
        if ms == 0 {
            return Err(Error::config("TE_P2P_TIMEOUT_MS", "0", "must be at least 1"));
        }
        P2pStore::bind(addr, Duration::from_millis(ms)).await
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
        let after_ms = self.timeout.as_millis() as u64;
        let text = tokio::time::timeout(self.timeout, get(addr, segment))
            .await
            .map_err(|_| Error::Timeout {
                what: what.clone(),
                after_ms,
            })??;
        let d = SegmentDescriptor::from_json(&text)?;
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

async fn get(addr: &str, segment: &str) -> Result<Vec<u8>> {
    let io = |e: std::io::Error| Error::Metadata(format!("p2p: {addr}: {e}"));
    if segment.len() > u16::MAX as usize {
        return Err(Error::Metadata(format!(
            "p2p: segment name of {} bytes is too long",
            segment.len()
        )));
    }
    let mut stream = TcpStream::connect(addr).await.map_err(io)?;
    let mut req = Vec::with_capacity(8 + segment.len());
    req.extend_from_slice(&MAGIC);
    req.push(VERSION);
    req.push(OP_GET);
    req.extend_from_slice(&(segment.len() as u16).to_le_bytes());
    req.extend_from_slice(segment.as_bytes());
    stream.write_all(&req).await.map_err(io)?;
    let mut head = [0u8; 10];
    stream.read_exact(&mut head).await.map_err(io)?;
    if head[..4] != MAGIC || head[4] != VERSION {
        return Err(Error::Metadata(format!(
            "p2p: {addr} does not speak the p2p metadata protocol"
        )));
    }
    let len = u32::from_le_bytes([head[6], head[7], head[8], head[9]]);
    if len > MAX_PAYLOAD {
        return Err(Error::Metadata(format!(
            "p2p: {addr} announced a {len}-byte answer (max {MAX_PAYLOAD})"
        )));
    }
    let mut payload = vec![0u8; len as usize];
    stream.read_exact(&mut payload).await.map_err(io)?;
    match head[5] {
        STATUS_OK => Ok(payload),
        STATUS_UNKNOWN => Err(Error::UnknownSegment(if segment.is_empty() {
            addr.to_string()
        } else {
            format!("{segment}@{addr}")
        })),
        _ => Err(Error::Metadata(format!(
            "p2p: {addr} refused: {}",
            String::from_utf8_lossy(&payload)
        ))),
    }
}

async fn serve(listener: TcpListener, published: Arc<RwLock<Published>>, timeout: Duration) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::task::yield_now().await;
            continue;
        };
        let published = published.clone();
        tokio::spawn(async move {
            // A peer that sends nothing cannot hold the task forever.
            let _ = tokio::time::timeout(timeout, answer(stream, &published)).await;
        });
    }
}

async fn answer(mut stream: TcpStream, published: &RwLock<Published>) -> std::io::Result<()> {
    let mut head = [0u8; 8];
    stream.read_exact(&mut head).await?;
    let name_len = u16::from_le_bytes([head[6], head[7]]) as usize;
    let mut name = vec![0u8; name_len];
    stream.read_exact(&mut name).await?;
    let (status, payload): (u8, Arc<str>) = if head[..4] != MAGIC || head[4] != VERSION || head[5] != OP_GET {
        (STATUS_REFUSED, "bad request header".into())
    } else {
        match std::str::from_utf8(&name) {
            Err(_) => (STATUS_REFUSED, "segment name is not UTF-8".into()),
            Ok(name) => {
                let p = published.read();
                let key = if name.is_empty() {
                    p.primary.as_deref()
                } else {
                    Some(name)
                };
                match key.and_then(|k| p.by_name.get(k)) {
                    Some(json) => (STATUS_OK, json.clone()),
                    None => (STATUS_UNKNOWN, "".into()),
                }
            }
        }
    };
    let mut head = [0u8; 10];
    head[..4].copy_from_slice(&MAGIC);
    head[4] = VERSION;
    head[5] = status;
    head[6..].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    stream.write_all(&head).await?;
    stream.write_all(payload.as_bytes()).await?;
    stream.shutdown().await
}

#[async_trait]
impl MetadataStore for P2pStore {
    fn name(&self) -> &'static str {
        "p2p"
    }

    async fn publish(&self, descriptor: &SegmentDescriptor) -> Result<()> {
        descriptor.validate()?;
        let json: Arc<str> = descriptor.to_json().into();
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
}
