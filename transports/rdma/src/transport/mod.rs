//! The verbs transport over any [`Verbs`] implementation: rail-local registration (host and GPU
//! memory), connection through the handshake, the data path and the progress thread.

mod abort;
pub mod device_memory;
mod handshake_io;
mod notify;
#[cfg(test)]
mod notify_tests;
mod peer;
#[cfg(test)]
mod placement_tests;
mod progress;
pub mod rails;
mod target;
pub(crate) use target::MAX_ACCEPTED_QPS;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::{Mutex, RwLock};
use te_base::auth::AuthKey;
use te_base::device::DevicePlugin;
use te_base::registration::{deregister_regions, register_regions, DomainHandles, RegistrationPool};
use te_base::{Capabilities, Error, NotifyInbox, Peer, RegionId, RegionInfo, Result, SegmentDescriptor, Transport};
use te_topology::{NicPlacement, RailPlacement, RailRate, StripePlanner};

use crate::config::RdmaConfig;
use crate::protocol::handshake::{EndpointInfo, PROTOCOL_VERSION};
use crate::protocol::recovery::Backoff;
use crate::protocol::remote_keys::{BufferKeys, RemoteKeyTable};
use crate::verbs::{LinkLayer, QpCaps, Verbs};
use crate::NAME;
use device_memory::DeviceMemory;
use peer::{PeerInner, QpInner, QpSlot, RailPair, RdmaPeer, SlotRef};
use rails::{gid_ipv4, RailRegistrar, RailRegistration, RailSet};

/// A registered region: the rails holding it, its lkeys per rail and chunk, and the handles to
/// release it.
pub(crate) struct LocalRegion<V: Verbs> {
    pub(crate) info: RegionInfo,
    /// Rail numbers holding the region, ascending, with their link rates.
    pub(crate) rails: Vec<RailRate>,
    /// `lkeys[rail position][chunk]`; empty for rails not holding the region.
    pub(crate) lkeys: Vec<Vec<u32>>,
    handles: Mutex<Option<DomainHandles<RailRegistration<V>>>>,
}

/// State shared by the transport, its peers, the handshake listener and the progress thread.
pub(crate) struct Shared<V: Verbs> {
    pub(crate) verbs: Arc<V>,
    pub(crate) config: RdmaConfig,
    registrar: Arc<RailRegistrar<V>>,
    pub(crate) segment_name: String,
    pub(crate) instance: u64,
    pub(crate) slice_size: u64,
    advertised: SocketAddr,
    capabilities: Capabilities,
    pub(crate) regions: RwLock<HashMap<RegionId, Arc<LocalRegion<V>>>>,
    /// Initiator QPs by QP number, for completion dispatch.
    pub(crate) qps: RwLock<HashMap<u32, SlotRef<V>>>,
    /// Target-side QPs accepted through the handshake, and the claims binding them.
    pub(crate) accepted: Mutex<target::Accepted<V>>,
    /// The shared key handshake peers must prove (`None`: anyone who reaches the listener).
    pub(crate) auth: Option<AuthKey>,
    /// This transport's claim on its (segment name, instance) at targets; never published.
    pub(crate) claim: [u8; 32],
    /// Slots waiting for re-establishment.
    pub(crate) broken: Mutex<Vec<SlotRef<V>>>,
    /// Aborted peers waiting for their QPs' flush completions (the progress thread enforces the
    /// grace).
    pub(crate) aborting: Mutex<Vec<Weak<PeerInner<V>>>>,
    /// Peers with notifications to post that `notify` could not post itself (slot 0 was locked).
    pub(crate) note_waiting: Mutex<Vec<Weak<PeerInner<V>>>>,
    /// Where notifications from peers go (`None`: this transport takes none and advertises none).
    pub(crate) inbox: RwLock<Option<Arc<NotifyInbox>>>,
    outstanding: AtomicUsize,
    psn_state: AtomicU64,
    stop: AtomicBool,
    progress_thread: Mutex<Option<std::thread::Thread>>,
    /// Set by the progress thread before it sleeps on the completion channels: wakers then write
    /// to `wake` (see [`progress::Sleeper`]).
    pub(crate) sleeping: AtomicBool,
    wake: std::os::unix::net::UnixStream,
    runtime: tokio::runtime::Handle,
    pool: &'static RegistrationPool,
}

impl<V: Verbs> Shared<V> {
    pub(crate) fn rails(&self) -> &RailSet<V> {
        &self.registrar.set
    }

    pub(crate) fn next_psn(&self) -> u32 {
        let x = self.psn_state.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        crate::protocol::handshake::psn_from(x)
    }

    pub(crate) fn posted(&self, n: usize) {
        self.outstanding.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn retired(&self, n: usize) {
        self.outstanding.fetch_sub(n, Ordering::Relaxed);
    }

    pub(crate) fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub(crate) fn wake_progress(&self) {
        // SeqCst pairs with the progress thread's store before its last look at the queues:
        // either it sees what the caller queued, or the caller sees it asleep and wakes it.
        if self.sleeping.load(Ordering::SeqCst) {
            // A full socket buffer is already readable: the thread wakes either way.
            let _ = std::io::Write::write(&mut &self.wake, &[1]);
        }
        if let Some(t) = self.progress_thread.lock().as_ref() {
            t.unpark();
        }
    }

    fn backoff(&self) -> Backoff {
        let (lo, hi) = self.config.backoff_ms;
        Backoff::new(Duration::from_millis(lo), Duration::from_millis(hi))
    }
}

impl<V: Verbs> Drop for Shared<V> {
    fn drop(&mut self) {
        let rails = self.registrar.set.clone();
        self.accepted.get_mut().destroy_all(&rails);
        let left: Vec<(RegionInfo, DomainHandles<RailRegistration<V>>)> = self
            .regions
            .get_mut()
            .drain()
            .filter_map(|(_, r)| r.handles.lock().take().map(|h| (r.info.clone(), h)))
            .collect();
        if !left.is_empty() {
            if let Err(e) = deregister_regions(self.pool, &self.registrar, left) {
                tracing::warn!("rdma teardown: {e}");
            }
        }
    }
}

/// The RDMA transport.
pub struct RdmaTransport<V: Verbs> {
    shared: Arc<Shared<V>>,
    listener: tokio::task::JoinHandle<()>,
}

impl<V: Verbs> std::fmt::Debug for RdmaTransport<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("segment", &self.shared.segment_name)
            .field("rails", &self.shared.rails().rails.len())
            .finish()
    }
}

impl<V: Verbs> RdmaTransport<V> {
    /// Opens `devices` and starts the handshake listener and the progress thread. Must run inside
    /// a tokio runtime. `sysfs` is the sysfs root (`/sys`), for GID types and peer-memory modules.
    ///
    /// With a `placement`, rails are numbered like te-base's rail map (NIC bus-id order), carry
    /// their link rates for striping, and each region is registered only on the rails placement
    /// chooses for it (NUMA-local for host memory, switch-local for GPU memory); without one,
    /// on every rail. `plugins` are the engine's device plugins: GPU memory of their kind is
    /// registered through dma-bufs they export. `auth` is the shared key handshake peers must
    /// prove (and this side proves to them); without it the listener is open (warned once).
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        verbs: Arc<V>,
        devices: &[String],
        placement: Option<NicPlacement>,
        plugins: Vec<Arc<dyn DevicePlugin>>,
        config: RdmaConfig,
        segment_name: &str,
        sysfs: &Path,
        auth: Option<AuthKey>,
    ) -> Result<Self> {
        let devices = rails::order_by_topology(devices, placement.as_ref().map(|p| p.topology()));
        let set = RailSet::open(verbs.clone(), &devices, &config, sysfs)?;
        let placement = placement.map(|mut p| {
            // GPU ordinals map to bus ids as the loaded runtime numbers them (after its
            // visible-devices filtering), not by sysfs order.
            for plugin in &plugins {
                p.use_device_plugin(plugin.as_ref())?;
            }
            Ok::<_, Error>(p)
        });
        let placement = placement.transpose()?.and_then(|p| {
            let names: Vec<&str> = set.rails.iter().map(|r| r.name.as_str()).collect();
            let joined = RailPlacement::new(p, &names);
            if joined.is_none() {
                tracing::warn!("rdma: no topology NIC is an open rail; registering every region on every rail");
            }
            joined
        });
        let bind = config
            .handshake_addr
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let listener = tokio::net::TcpListener::bind(bind)
            .await
            .map_err(|e| Error::io(format!("rdma: binding the handshake listener to {bind}"), e))?;
        let mut advertised = listener
            .local_addr()
            .map_err(|e| Error::io("rdma: handshake listener address", e))?;
        if advertised.ip().is_unspecified() {
            let ip = set.rails.iter().find_map(|r| gid_ipv4(&r.gid)).ok_or_else(|| {
                Error::not_available(
                    "rdma",
                    "no IPv4 RoCE GID to advertise the handshake on; set TE_RDMA_HANDSHAKE_ADDR=<ip>:<port>",
                )
            })?;
            advertised.set_ip(IpAddr::V4(ip));
        }
        let max_msg = set
            .rails
            .iter()
            .map(|r| u64::from(r.port_attrs.max_msg_size))
            .min()
            .unwrap_or(0);
        let slice_size = config.slice_size.min(max_msg.max(4096));
        let peermem = sysfs.join("module/nvidia_peermem").exists();
        let device = DeviceMemory::new(plugins, peermem, verbs.supports_dmabuf());
        let kinds = device.kinds();
        let (wake_rx, wake) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| Error::io("rdma: the progress thread's wake socket", e))?;
        for end in [&wake_rx, &wake] {
            end.set_nonblocking(true)
                .map_err(|e| Error::io("rdma: the progress thread's wake socket", e))?;
        }
        let sleeper = progress::Sleeper::new(&verbs, &set, wake_rx, config.poll)?;
        let shared = Arc::new(Shared {
            verbs,
            registrar: Arc::new(RailRegistrar::new(Arc::new(set), placement, device)),
            segment_name: segment_name.to_string(),
            instance: te_base::token::random_token(),
            slice_size,
            advertised,
            capabilities: Capabilities {
                local: kinds,
                remote: kinds,
            },
            regions: RwLock::new(HashMap::new()),
            qps: RwLock::new(HashMap::new()),
            accepted: Mutex::new(target::Accepted::default()),
            claim: te_base::auth::nonce(),
            auth,
            broken: Mutex::new(Vec::new()),
            aborting: Mutex::new(Vec::new()),
            note_waiting: Mutex::new(Vec::new()),
            inbox: RwLock::new(None),
            outstanding: AtomicUsize::new(0),
            psn_state: AtomicU64::new(te_base::token::random_token()),
            stop: AtomicBool::new(false),
            progress_thread: Mutex::new(None),
            sleeping: AtomicBool::new(false),
            wake,
            runtime: tokio::runtime::Handle::current(),
            pool: RegistrationPool::global()?,
            config,
        });
        let thread = progress::spawn(Arc::downgrade(&shared), sleeper)?;
        *shared.progress_thread.lock() = Some(thread);
        if shared.auth.is_none() {
            te_base::auth::warn_unauthenticated(
                "rdma handshake",
                &advertised.to_string(),
                "queue pairs to exported memory",
            );
        }
        let limits = shared.config.listener;
        let listener = tokio::spawn(target::serve(Arc::downgrade(&shared), listener, limits));
        Ok(RdmaTransport { shared, listener })
    }

    /// The address peers reach the handshake listener at.
    pub fn handshake_addr(&self) -> SocketAddr {
        self.shared.advertised
    }

    /// Takes notifications from peers into `inbox` (the engine's), and advertises so in
    /// [`Transport::endpoint`]. Call before publishing the endpoint.
    pub fn deliver_notifications_to(&self, inbox: Arc<NotifyInbox>) {
        *self.shared.inbox.write() = Some(inbox);
    }
}

impl<V: Verbs> Drop for RdmaTransport<V> {
    fn drop(&mut self) {
        self.listener.abort();
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake_progress();
    }
}

#[async_trait]
impl<V: Verbs> Transport for RdmaTransport<V> {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.shared.capabilities
    }

    fn endpoint(&self) -> serde_json::Value {
        EndpointInfo {
            version: PROTOCOL_VERSION,
            handshake: self.shared.advertised.to_string(),
            instance: self.shared.instance,
            rails: self.shared.rails().rails.iter().map(|r| r.info()).collect(),
            notify: self.shared.inbox.read().as_deref().map(notify::params),
        }
        .to_value()
    }

    fn can_reach(&self, peer: &SegmentDescriptor) -> bool {
        peer.endpoint(NAME).is_some_and(|v| EndpointInfo::from_value(v).is_ok())
    }

    async fn register(&self, regions: &[RegionInfo]) -> Result<Vec<serde_json::Value>> {
        let registrar = &self.shared.registrar;
        // GPU regions: one dma-buf per region, shared by its rails, or peer memory, or a
        // NotAvailable naming what is missing, before anything is registered.
        let prepared = regions.iter().try_for_each(|r| {
            if let Some(export) = registrar.device.prepare(r)? {
                registrar.stage_export(r.id, export);
            }
            Ok(())
        });
        if let Err(e) = prepared {
            registrar.forget_exports(regions);
            return Err(e);
        }
        let shared = self.shared.clone();
        let batch = regions.to_vec();
        let registered =
            tokio::task::spawn_blocking(move || register_regions(shared.pool, &shared.registrar, batch)).await;
        registrar.forget_exports(regions);
        let handles = registered.map_err(|e| Error::transport(NAME, format!("registration task: {e}")))??;
        let rail_set = self.shared.rails();
        let chunk = rail_set.chunk;
        let mut keys = Vec::with_capacity(regions.len());
        let mut table = self.shared.regions.write();
        for (info, h) in regions.iter().zip(handles) {
            let mut per_rail: Vec<(usize, &RailRegistration<V>)> = h.iter().map(|(d, r)| (*d, r)).collect();
            per_rail.sort_by_key(|(d, _)| *d);
            let mut lkeys: Vec<Vec<u32>> = vec![Vec::new(); rail_set.rails.len()];
            for (d, r) in &per_rail {
                lkeys[*d] = r.keys.iter().map(|k| k.lkey).collect();
            }
            // Listed by rail number, ascending; positions follow rail numbers (both bus-id order).
            per_rail.sort_by_key(|(d, _)| rail_set.rails[*d].id);
            let rails: Vec<RailRate> = per_rail
                .iter()
                .map(|(d, _)| RailRate {
                    rail: rail_set.rails[*d].id,
                    rate_mbps: rail_set.rails[*d].rate_mbps,
                })
                .collect();
            let value = if info.exported {
                let rkeys = per_rail
                    .iter()
                    .map(|(_, r)| r.keys.iter().map(|k| k.rkey).collect())
                    .collect();
                let keys = BufferKeys {
                    chunk,
                    rails: rails.clone(),
                    rkeys,
                };
                serde_json::to_value(keys).expect("keys serialize")
            } else {
                serde_json::Value::Null
            };
            keys.push(value);
            table.insert(
                info.id,
                Arc::new(LocalRegion {
                    info: info.clone(),
                    rails,
                    lkeys,
                    handles: Mutex::new(Some(h)),
                }),
            );
        }
        Ok(keys)
    }

    async fn deregister(&self, regions: &[RegionInfo]) -> Result<()> {
        let mut release = Vec::with_capacity(regions.len());
        {
            let mut table = self.shared.regions.write();
            for r in regions {
                if let Some(local) = table.remove(&r.id) {
                    if let Some(h) = local.handles.lock().take() {
                        release.push((local.info.clone(), h));
                    }
                }
            }
        }
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || deregister_regions(shared.pool, &shared.registrar, release))
            .await
            .map_err(|e| Error::transport(NAME, format!("deregistration task: {e}")))?
    }

    fn skipped_devices(&self) -> Vec<te_base::SkippedDevice> {
        self.shared.rails().skipped.clone()
    }

    async fn connect(&self, desc: &SegmentDescriptor) -> Result<Arc<dyn Peer>> {
        let shared = &self.shared;
        let info = desc
            .endpoint(NAME)
            .ok_or_else(|| Error::NoTransport {
                segment: desc.name.clone(),
                reason: "it does not advertise rdma".into(),
            })
            .and_then(EndpointInfo::from_value)?;
        let handshake_addr: SocketAddr = info.handshake.parse().expect("validated by from_value");
        let keys = RemoteKeyTable::from_descriptor(desc, NAME)?;
        let local_rails = &shared.rails().rails;
        let mine: Vec<(usize, LinkLayer)> = local_rails.iter().map(|r| (r.id, r.port_attrs.link_layer)).collect();
        let theirs: Vec<(usize, LinkLayer)> = info.rails.iter().map(|r| (r.rail as usize, r.link_layer)).collect();
        let pairs = rail_pairs(&mine, &theirs).map_err(|reason| Error::NoTransport {
            segment: desc.name.clone(),
            reason,
        })?;
        let mut pair_of_rail = vec![None; shared.rails().id_bound()];
        for (i, p) in pairs.iter().enumerate() {
            pair_of_rail[local_rails[p.local].id] = Some(i);
        }
        let q = shared.config.qps_per_peer as usize;
        let depth = shared.config.send_queue_depth;
        // Notifications ride slot 0 when the target takes them in a format this build speaks.
        let notify = info.notify.filter(|p| p.usable());
        let mut slots: Vec<Arc<QpSlot<V>>> = Vec::with_capacity(pairs.len() * q);
        let created = (|| -> Result<()> {
            for (pi, pair) in pairs.iter().enumerate() {
                let rail = &local_rails[pair.local];
                let depth = depth.min(rail.attrs.max_qp_wr.max(1));
                for k in 0..q {
                    let notes = notify.filter(|_| pi == 0 && k == 0);
                    let credits = notes.map_or(0, |p| p.credits);
                    // The notification SENDs share the send queue: keep within the device.
                    let depth = depth.min(rail.attrs.max_qp_wr.saturating_sub(credits).max(1));
                    // Each notification completes twice here: its SEND and its answer's receive.
                    let cq_room = depth + 2 * credits;
                    rail.reserve_cq(cq_room)?;
                    let caps = QpCaps {
                        max_send_wr: depth + credits,
                        max_send_sge: 1,
                        max_recv_wr: credits,
                    };
                    let (qp, qpn) = match shared.verbs.create_qp(rail.pd(), rail.cq(), caps) {
                        Ok(x) => x,
                        Err(e) => {
                            rail.release_cq(cq_room);
                            return Err(e);
                        }
                    };
                    let mut inner = QpInner::new(qp, qpn, depth, shared.config.signal_every, shared.backoff());
                    let channel = notes.map(|p| notify::NoteChannel::new(&*shared.verbs, rail.pd(), p));
                    let failed = match channel.transpose() {
                        Ok(ch) => {
                            inner.notes = ch;
                            None
                        }
                        Err(e) => Some(e),
                    };
                    slots.push(Arc::new(QpSlot {
                        slot: (pi * q + k) as u32,
                        pair: pi,
                        rail: pair.local,
                        cq_room,
                        inner: Mutex::new(inner),
                    }));
                    if let Some(e) = failed {
                        return Err(e);
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = created {
            // Nothing was connected yet: release what this attempt created.
            for s in slots {
                let mut inner = s.inner.lock();
                if let Some(qp) = inner.qp.take() {
                    let _ = shared.verbs.destroy_qp(qp);
                    local_rails[s.rail].release_cq(s.cq_room);
                }
                if let Some(mut ch) = inner.notes.take() {
                    ch.release(&*shared.verbs);
                }
            }
            return Err(e);
        }
        let peer = Arc::new(PeerInner {
            shared: shared.clone(),
            descriptor: desc.clone(),
            endpoint: info,
            handshake_addr,
            keys,
            pairs,
            pair_of_rail,
            slots,
            qps_per_pair: q,
            rotation: AtomicUsize::new(0),
            planner: StripePlanner::new(shared.config.stripe_min_bytes),
            notify,
            notes_in: Mutex::new(VecDeque::new()),
            abort: OnceLock::new(),
            cut_batches: te_base::BatchAborts::default(),
        });
        let offers: Vec<_> = peer
            .slots
            .iter()
            .map(|s| {
                let qpn = s.inner.lock().qpn;
                peer.offer(s, qpn)
            })
            .collect();
        let request = peer.request(offers);
        let response = handshake_io::exchange(handshake_addr, &desc.name, &request, shared.auth.as_ref()).await?;
        let answers = response.accepted_for(&request, peer.endpoint.rails.len())?;
        for ((slot, mine), theirs) in peer.slots.iter().zip(&request.qps).zip(answers) {
            let mut inner = slot.inner.lock();
            peer.bring_up(slot, &mut inner, mine, theirs)?;
        }
        {
            let mut map = shared.qps.write();
            for (i, s) in peer.slots.iter().enumerate() {
                map.insert(s.inner.lock().qpn, (Arc::downgrade(&peer), i));
            }
        }
        Ok(Arc::new(RdmaPeer { inner: peer }))
    }

    async fn shutdown(&self) {
        self.listener.abort();
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake_progress();
    }
}

/// The rail pairs two sides can use: rail number `i` talks to the peer's rail number `i` (the same
/// NIC position, the same switch rail in rail-optimized fabrics), wherever each side holds it, when
/// both have the same link layer. `mine` and `theirs` are (rail number, link layer) in each side's
/// order. The error says which rule left nothing: no rail number in common (two processes that
/// each opened a different NIC of one host, as on a soft-RoCE VM with rxe0 and rxe1), or common
/// numbers whose link layers differ.
fn rail_pairs(
    mine: &[(usize, LinkLayer)],
    theirs: &[(usize, LinkLayer)],
) -> std::result::Result<Vec<RailPair>, String> {
    let mut common = 0;
    let pairs: Vec<RailPair> = mine
        .iter()
        .enumerate()
        .filter_map(|(local, &(id, layer))| {
            let remote = theirs.iter().position(|&(r, _)| r == id)?;
            common += 1;
            (layer == theirs[remote].1).then_some(RailPair { local, remote })
        })
        .collect();
    if !pairs.is_empty() {
        return Ok(pairs);
    }
    let numbers = |rails: &[(usize, LinkLayer)]| rails.iter().map(|r| r.0.to_string()).collect::<Vec<_>>().join(", ");
    Err(if common == 0 {
        format!(
            "no rail number in common (rail i talks to the peer's rail i): this side has rails [{}], the peer [{}]",
            numbers(mine),
            numbers(theirs)
        )
    } else {
        format!("the {common} rail number(s) in common differ in link layer (InfiniBand vs RoCE)")
    })
}

#[cfg(test)]
mod rail_pair_tests {
    use super::*;

    #[test]
    fn rails_pair_by_number_and_the_refusal_names_the_rule_that_left_none() {
        let (e, ib) = (LinkLayer::Ethernet, LinkLayer::Infiniband);
        // Rail numbers pair wherever each side holds them.
        let p = rail_pairs(&[(0, e), (1, e)], &[(1, e), (0, e)]).unwrap();
        assert_eq!(
            p.iter().map(|p| (p.local, p.remote)).collect::<Vec<_>>(),
            [(0, 1), (1, 0)]
        );
        // One process per NIC of one host (soft-RoCE: rxe0 is rail 0, rxe1 rail 1).
        let err = rail_pairs(&[(0, e)], &[(1, e)]).unwrap_err();
        assert!(
            err.contains("no rail number in common") && err.contains("[0]") && err.contains("[1]"),
            "{err}"
        );
        // The same number on both sides but another link layer.
        let err = rail_pairs(&[(0, e)], &[(0, ib)]).unwrap_err();
        assert!(err.contains("differ in link layer"), "{err}");
    }
}
