//! The `Transport` implementation: the control listener, the pool of connections, install.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};

use async_trait::async_trait;
use parking_lot::Mutex;
use te_base::auth::AuthKey;
use te_base::{
    Capabilities, Error, InstallContext, MemoryKinds, NotifyInbox, Peer, RegionInfo, Result, SegmentDescriptor,
    Transport,
};

use crate::cma::{self, PtraceScope};
use crate::config::ShmConfig;
use crate::connection::{ConnectError, ConnectSettings, Connection, Counters};
use crate::endpoint::{HostIdentity, ShmEndpoint};
use crate::peer::{CopyThreads, LocalTable, ShmPeer};
use crate::serve::{accept_loop, Server};
use crate::socket;

/// The same-host transport (cross-memory attach).
pub struct ShmTransport {
    config: ShmConfig,
    endpoint: ShmEndpoint,
    server: Arc<Server>,
    listener: Arc<std::os::unix::net::UnixListener>,
    local: Arc<LocalTable>,
    pool: Mutex<HashMap<(u32, u64), Weak<Connection>>>,
    copier: Arc<CopyThreads>,
    auth: Option<AuthKey>,
    /// Target instances already reported as unreachable (each is reported once).
    reported: Mutex<HashSet<(u32, u64)>>,
    /// Bytes by route, over every connection.
    counters: Arc<Counters>,
    /// The local transport's copy kernel, for mapped regions.
    kernel: te_transport_local::NtKernel,
}

/// What this transport's copies went through, since it started (a route detail, for tests and
/// reports; updated once per copy call).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteCounters {
    /// Bytes copied through mappings of targets' memfds (the local transport's kernels).
    pub mapped_bytes: u64,
    /// Bytes copied by cross-memory attach (`process_vm_writev/readv`).
    pub cma_bytes: u64,
    /// Memfds a target sent that were not mapped (no seals, bad frame).
    pub fds_refused: u64,
    /// Target regions this engine holds a mapping of right now.
    pub mapped_regions: usize,
}

impl std::fmt::Debug for ShmTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTransport")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl ShmTransport {
    /// Starts the transport: checks that cross-memory attach can work on this host at all (Yama),
    /// binds the control socket and starts serving it.
    pub fn start(config: ShmConfig, auth: Option<AuthKey>, inbox: Arc<NotifyInbox>) -> Result<ShmTransport> {
        let scope = PtraceScope::read(&config.ptrace_scope_file);
        if let Some(reason) = scope.refusal() {
            return Err(Error::not_available("shm", reason));
        }
        if let PtraceScope::Unreadable(why) = &scope {
            tracing::info!("shm: Yama ptrace_scope unreadable ({why}); the connect-time probe decides per peer");
        }
        let host = HostIdentity::current()?;
        let token = te_base::token::random_token();
        let name = match &config.socket {
            Some(p) => p.to_string_lossy().into_owned(),
            None => format!("@te-shm.{}.{token:016x}", std::process::id()),
        };
        let listener = socket::bind(&name).map_err(|e| Error::io(format!("shm: binding {name} (TE_SHM_SOCKET)"), e))?;
        if auth.is_none() {
            te_base::auth::warn_unauthenticated(
                "the shm transport",
                &name,
                "the process id to attach to (the kernel still requires the same uid)",
            );
        }
        let server = Arc::new(Server::new(
            token,
            auth.clone(),
            config.allow_uids.clone(),
            config.timeout,
            config.max_connections,
            inbox,
            scope,
            config.memfd,
        ));
        let copier = Arc::new(CopyThreads::start(config.copy_threads)?);
        let listener = Arc::new(listener);
        let (srv, accepting) = (server.clone(), listener.clone());
        std::thread::Builder::new()
            .name("te-shm-accept".into())
            .spawn(move || accept_loop(accepting, srv))
            .map_err(|e| Error::io("shm: starting the accept thread", e))?;
        Ok(ShmTransport {
            endpoint: ShmEndpoint {
                host,
                pid: std::process::id(),
                uid: cma::euid(),
                token,
                socket: name,
                device_ipc: None,
            },
            config,
            server,
            listener,
            local: Arc::new(LocalTable::default()),
            pool: Mutex::new(HashMap::new()),
            copier,
            auth,
            reported: Mutex::new(HashSet::new()),
            counters: Arc::new(Counters::default()),
            kernel: te_transport_local::NtKernel::detect(),
        })
    }

    /// The endpoint this transport advertises.
    pub fn shm_endpoint(&self) -> &ShmEndpoint {
        &self.endpoint
    }

    /// Initiators connected to this transport's serving side right now.
    pub fn served_connections(&self) -> usize {
        self.server.connections()
    }

    /// The settings in force.
    pub fn config(&self) -> &ShmConfig {
        &self.config
    }

    /// Bytes by route since start, and the target regions mapped now.
    pub fn route_counters(&self) -> RouteCounters {
        use std::sync::atomic::Ordering::Relaxed;
        RouteCounters {
            mapped_bytes: self.counters.mapped_bytes.load(Relaxed),
            cma_bytes: self.counters.cma_bytes.load(Relaxed),
            fds_refused: self.counters.fds_refused.load(Relaxed),
            mapped_regions: self.live_connections().iter().map(|c| c.mapped_regions()).sum(),
        }
    }

    fn live_connections(&self) -> Vec<Arc<Connection>> {
        self.pool.lock().values().filter_map(Weak::upgrade).collect()
    }

    async fn open_connection(&self, peer: &SegmentDescriptor, ep: ShmEndpoint) -> Result<Arc<Connection>> {
        let settings = ConnectSettings {
            timeout: self.config.timeout,
            auth: self.auth.clone(),
            allow_uids: self.config.allow_uids.clone(),
            fault_probe_errno: self.config.fault_probe_errno,
            map_memfd: self.config.memfd,
            kernel: self.kernel,
            nt_min: self.config.nt_copy_min_bytes,
            counters: self.counters.clone(),
        };
        let name = peer.name.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let key = (ep.pid, ep.token);
        // Blocking socket steps, each bounded by TE_SHM_TIMEOUT_MS, off the caller's runtime.
        std::thread::Builder::new()
            .name("te-shm-connect".into())
            .spawn(move || {
                let _ = tx.send(Connection::open(&name, &ep, &settings));
            })
            .map_err(|e| Error::io("shm: starting a connect thread", e))?;
        let opened = rx
            .await
            .map_err(|_| Error::transport("shm", "the connect thread ended without an answer"))?;
        match opened {
            Ok(conn) => {
                let mut pool = self.pool.lock();
                pool.retain(|_, w| w.strong_count() > 0);
                pool.insert(key, Arc::downgrade(&conn));
                Ok(conn)
            }
            Err(e) => {
                if let ConnectError::NotPermitted(reason) = &e {
                    if self.reported.lock().insert(key) {
                        tracing::warn!(
                            segment = %peer.name,
                            "shm: route not available, another transport carries this peer: {reason}"
                        );
                    }
                }
                Err(e.into_error(&peer.name))
            }
        }
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.server.stop(&self.listener);
        self.copier.stop();
        for c in self.live_connections() {
            c.kill(Error::Closed("shm transport".into()));
        }
    }
}

#[async_trait]
impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    /// Host memory only. Device memory (CUDA/HIP IPC handles) is not served by this transport.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: MemoryKinds::HOST,
            remote: MemoryKinds::HOST,
        }
    }

    fn endpoint(&self) -> serde_json::Value {
        serde_json::to_value(&self.endpoint).unwrap_or(serde_json::Value::Null)
    }

    /// Same boot of the same kernel and the same pid namespace (the peer is named by pid).
    fn can_reach(&self, peer: &SegmentDescriptor) -> bool {
        ShmEndpoint::of(peer).is_ok_and(|ep| ep.host == self.endpoint.host)
    }

    async fn register(&self, regions: &[RegionInfo]) -> Result<Vec<serde_json::Value>> {
        {
            let mut local = self.local.write();
            for r in regions.iter().filter(|r| r.location.is_host()) {
                local.insert(r.id, (r.base, r.len));
            }
        }
        self.server.update(regions, true).await;
        Ok(vec![serde_json::Value::Null; regions.len()])
    }

    /// Revokes the exported ones from every connected initiator (each confirms, or is cut at
    /// `TE_SHM_TIMEOUT_MS`) before returning.
    async fn deregister(&self, regions: &[RegionInfo]) -> Result<()> {
        self.server.update(regions, false).await;
        let mut local = self.local.write();
        for r in regions {
            local.remove(&r.id);
        }
        Ok(())
    }

    async fn connect(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Peer>> {
        let ep = ShmEndpoint::of(peer)?;
        if ep.host != self.endpoint.host {
            return Err(Error::not_available(
                format!("shm route to {}", peer.name),
                "it runs on another host or in another pid namespace",
            ));
        }
        let pooled = self
            .pool
            .lock()
            .get(&(ep.pid, ep.token))
            .and_then(Weak::upgrade)
            .filter(|c| c.is_healthy());
        let conn = match pooled {
            Some(c) => c,
            None => self.open_connection(peer, ep).await?,
        };
        Ok(Arc::new(ShmPeer {
            descriptor: peer.clone(),
            local: self.local.clone(),
            conn,
            inline_bytes: self.config.inline_bytes,
            copier: self.copier.clone(),
        }))
    }

    async fn shutdown(&self) {
        self.server.stop(&self.listener);
        for c in self.live_connections() {
            c.kill(Error::Closed("shm transport".into()));
        }
    }
}

/// Starts the shm transport with settings from `ctx.env` and the engine's key; `NotAvailable`
/// when cross-memory attach cannot work on this host (Yama ptrace_scope 2 or 3).
pub async fn install(ctx: &InstallContext) -> Result<Arc<dyn Transport>> {
    let config = ShmConfig::from_env(ctx.env.as_ref())?;
    Ok(Arc::new(ShmTransport::start(
        config,
        ctx.auth.clone(),
        ctx.notifications.clone(),
    )?))
}
