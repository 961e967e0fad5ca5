//! The transport: provider and rail selection at install, registration, connecting peers.

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use te_base::auth::AuthKey;
use te_base::{
    Capabilities, Error, InstallContext, MemoryKinds, NotifyInbox, Peer, RegionInfo, Result, SegmentDescriptor,
    SkippedDevice, Transport,
};
use te_topology::{NicPlacement, RailPlacement, Topology};

use crate::config::{FabricConfig, VAR_DOMAINS, VAR_PROVIDER};
use crate::fabric::{providers_found, Info, InfoList, Rail, TRANSPORT};
use crate::inner::Inner;
use crate::mailbox::Mailbox;
use crate::peer::FabricPeer;
use crate::registry::{RegionTable, Registrar};
use crate::wire::{to_hex, EndpointInfo, NotifyInfo, RailEndpoint};
use crate::worker::RailWorker;

/// The libfabric transport (`efa`). Create it with [`crate::install`].
pub struct FabricTransport {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for FabricTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FabricTransport")
            .field("provider", &self.inner.provider)
            .field("rails", &self.inner.workers.len())
            .finish()
    }
}

/// Names of loopback network interfaces (their tcp domains cannot reach other hosts).
fn loopback_interfaces() -> Vec<String> {
    let mut out = Vec::new();
    let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut addrs) } != 0 {
        return out;
    }
    let mut cur = addrs;
    while !cur.is_null() {
        // SAFETY: cur is a live node of the list returned by getifaddrs.
        let ifa = unsafe { &*cur };
        if ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0 && !ifa.ifa_name.is_null() {
            // SAFETY: ifa_name is a NUL-terminated string owned by the list.
            out.push(unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned());
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: addrs came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(addrs) };
    out
}

/// Picks one getinfo entry per domain (NIC) of the first provider returned: the candidates to
/// open rails on, in order, and the domains `TE_FABRIC_DOMAINS` names that fi_getinfo did not
/// return (skipped, with why). A configuration naming only such domains is an error.
fn select_rails<'a>(list: &'a InfoList, config: &FabricConfig) -> Result<(String, Vec<Info<'a>>, Vec<SkippedDevice>)> {
    let entries: Vec<Info<'a>> = list.iter().collect();
    let provider = entries[0].provider();
    let mut by_domain: BTreeMap<String, Info<'a>> = BTreeMap::new();
    let mut order = Vec::new();
    for e in entries.iter().filter(|e| e.provider() == provider) {
        let d = e.domain();
        match by_domain.get(&d) {
            None => {
                order.push(d.clone());
                by_domain.insert(d, *e);
            }
            // Prefer IPv4 addressing on socket providers: link-local IPv6 needs scope ids.
            Some(prev) if !prev.is_ipv4() && e.is_ipv4() => {
                by_domain.insert(d, *e);
            }
            Some(_) => {}
        }
    }
    let mut skipped = Vec::new();
    let chosen: Vec<String> = match &config.domains {
        Some(wanted) => {
            let (present, absent): (Vec<&String>, Vec<&String>) =
                wanted.iter().partition(|w| by_domain.contains_key(w.as_str()));
            if present.is_empty() {
                return Err(Error::config(
                    VAR_DOMAINS,
                    wanted.join(","),
                    format!(
                        "provider '{provider}' has none of these domains (it has: {})",
                        order.join(", ")
                    ),
                ));
            }
            for w in absent {
                skipped.push(SkippedDevice {
                    name: w.clone(),
                    reason: format!(
                        "named in {VAR_DOMAINS}, but provider '{provider}' offers no such domain (it has: {})",
                        order.join(", ")
                    ),
                });
            }
            present.into_iter().cloned().collect()
        }
        None => {
            let lo = loopback_interfaces();
            let external: Vec<String> = order.iter().filter(|d| !lo.contains(d)).cloned().collect();
            if external.is_empty() {
                order.clone()
            } else {
                external
            }
        }
    };
    let infos = chosen.iter().map(|d| by_domain[d]).collect();
    Ok((provider, infos, skipped))
}

/// Opens a rail on each candidate domain in turn until `max_rails` are open. A domain whose rail
/// does not open (fi_fabric, fi_domain, endpoint...), or whose memory-registration mode disagrees
/// with the first rail's, is skipped with why: on a node with many NICs one bad NIC must not take
/// the others away. `Err` only when none opens, naming every domain tried.
fn open_rails(
    provider: &str,
    candidates: Vec<Info<'_>>,
    config: &FabricConfig,
    skipped: &mut Vec<SkippedDevice>,
) -> Result<Vec<Arc<Rail>>> {
    let mut rails: Vec<Arc<Rail>> = Vec::with_capacity(candidates.len().min(config.max_rails));
    for info in candidates {
        if rails.len() == config.max_rails {
            break;
        }
        let domain = info.domain();
        let rail = match Rail::open(info, config.shm_permitted) {
            Ok(rail) => rail,
            Err(e) => {
                tracing::warn!(%provider, %domain, error = %e, "efa: domain skipped: its rail did not open");
                skipped.push(SkippedDevice {
                    name: domain,
                    reason: e.to_string(),
                });
                continue;
            }
        };
        if let Some(first) = rails.first() {
            if first.attrs.virt_addr() != rail.attrs.virt_addr() {
                let reason = format!(
                    "its FI_MR_VIRT_ADDR ({}) disagrees with the first rail's ('{}': {}); one endpoint \
                     descriptor cannot address both",
                    rail.attrs.virt_addr(),
                    first.attrs.domain,
                    first.attrs.virt_addr()
                );
                tracing::warn!(%provider, %domain, %reason, "efa: domain skipped");
                skipped.push(SkippedDevice { name: domain, reason });
                continue;
            }
        }
        rails.push(Arc::new(rail));
    }
    if rails.is_empty() {
        return Err(Error::NoDeviceOpened {
            transport: format!("{TRANSPORT} ({provider})"),
            skipped: std::mem::take(skipped),
        });
    }
    Ok(rails)
}

impl FabricTransport {
    /// Opens the rails of the configured provider and starts one owner thread per rail; every
    /// buffer is registered on every rail. A domain whose rail does not open is skipped and
    /// listed in [`Transport::skipped_devices`] (as is a domain `TE_FABRIC_DOMAINS` names
    /// but the provider does not offer); [`Error::NoDeviceOpened`] when no domain opens.
    pub fn open(config: FabricConfig) -> Result<FabricTransport> {
        Self::open_with(config, None)
    }

    /// As [`FabricTransport::open`], placing buffers on the rails `placement` selects.
    /// Notifications peers send go to an inbox of its own with default bounds.
    pub fn open_with(config: FabricConfig, placement: Option<NicPlacement>) -> Result<FabricTransport> {
        Self::open_notifying(config, placement, NotifyInbox::new(Default::default()), None)
    }

    /// As [`FabricTransport::open_with`], delivering the notifications peers send into `inbox`;
    /// with `auth`, only messages that prove the key are accepted (and ours carry the proof).
    pub fn open_notifying(
        config: FabricConfig,
        placement: Option<NicPlacement>,
        inbox: Arc<NotifyInbox>,
        auth: Option<AuthKey>,
    ) -> Result<FabricTransport> {
        let list = match InfoList::query(Some(&config.provider))? {
            Some(l) => l,
            None => {
                let found = providers_found();
                let found = if found.is_empty() {
                    "none".to_string()
                } else {
                    found.join(", ")
                };
                let how = if config.provider_defaulted {
                    format!("the default provider 'efa' is not present (set {VAR_PROVIDER} to use another)")
                } else {
                    format!(
                        "provider '{}' (from {VAR_PROVIDER}) offers no RDM endpoint with RMA",
                        config.provider
                    )
                };
                return Err(Error::not_available(
                    "efa transport",
                    format!("{how}; providers with RDM endpoints and RMA here: {found}"),
                ));
            }
        };
        let (provider, candidates, mut skipped) = select_rails(&list, &config)?;
        let (major, minor) = crate::libfabric()?.version;
        let refusal = crate::RefusalReport::of(&provider, (major, minor));
        if refusal == crate::RefusalReport::SilentSuccess {
            tracing::warn!(%provider, libfabric = %format!("{major}.{minor}"), "efa: {refusal}");
        }
        let opened = open_rails(&provider, candidates, &config, &mut skipped)?;
        let mut workers = Vec::with_capacity(opened.len());
        let mut rails_json = Vec::with_capacity(opened.len());
        let mut max_fragment = config.max_fragment.unwrap_or(u64::MAX);
        let virt_addr = opened[0].attrs.virt_addr();
        for (i, rail) in opened.into_iter().enumerate() {
            max_fragment = max_fragment.min(rail.attrs.max_msg_size.max(1));
            rails_json.push(RailEndpoint {
                domain: rail.attrs.domain.clone(),
                addr: to_hex(&rail.address),
            });
            tracing::info!(
                provider = %provider,
                domain = %rail.attrs.domain,
                fabric = %rail.attrs.fabric,
                mr_mode = rail.attrs.mr_mode,
                mr_key_size = rail.attrs.mr_key_size,
                max_msg_size = rail.attrs.max_msg_size,
                tx_size = rail.attrs.tx_size,
                cq_wait = rail.cq_can_wait,
                "efa rail opened"
            );
            // Notifications travel on rail 0 (peers send to our rail 0 and answer to theirs).
            let mailbox = if i == 0 {
                Some(Mailbox::open(
                    rail.clone(),
                    inbox.clone(),
                    auth.clone(),
                    config.timeout,
                )?)
            } else {
                None
            };
            workers.push(RailWorker::start(rail, i, config.timeout, config.idle, mailbox)?);
        }
        let rails: Vec<Arc<Rail>> = workers.iter().map(|w| w.rail().clone()).collect();
        let names: Vec<&str> = rails.iter().map(|r| r.attrs.domain.as_str()).collect();
        let placement = placement.and_then(|p| RailPlacement::new(p, &names));
        let regions = RegionTable::new(Registrar::new(rails, placement));
        let endpoint = serde_json::to_value(EndpointInfo {
            provider: provider.clone(),
            virt_addr,
            rails: rails_json,
            notify: Some(NotifyInfo {
                version: crate::note_wire::VERSION,
                max_bytes: inbox.limits().max_bytes as u64,
            }),
        })
        .map_err(|e| Error::transport(TRANSPORT, format!("encoding endpoint info: {e}")))?;
        Ok(FabricTransport {
            inner: Arc::new(Inner {
                config,
                provider,
                workers,
                regions,
                max_fragment,
                endpoint,
                skipped,
                closed: AtomicBool::new(false),
            }),
        })
    }

    /// The provider in use (e.g. `tcp;ofi_rxm`).
    pub fn provider(&self) -> &str {
        &self.inner.provider
    }

    /// Number of rails (NICs).
    pub fn rails(&self) -> usize {
        self.inner.workers.len()
    }

    /// Granted mr_mode bits of rail `i` in the shim's encoding (see [`crate::ffi::mr`]).
    pub fn rail_mr_mode(&self, i: usize) -> Option<u32> {
        self.inner.workers.get(i).map(|w| w.rail().attrs.mr_mode)
    }
}

/// Installs the transport from the engine's configuration.
pub(crate) fn install_from(ctx: &InstallContext) -> Result<FabricTransport> {
    let config = FabricConfig::from_env(ctx.env.as_ref())?;
    // Rail-local placement needs the host's topology; a host whose sysfs cannot be read still
    // works, registering on every rail. A malformed placement variable is an error.
    let placement = match Topology::discover() {
        Ok(topology) => {
            let mut placement = NicPlacement::from_env(topology, ctx.env.as_ref())?;
            // GPU ordinals map to bus ids as the loaded runtime numbers them (after its
            // visible-devices filtering), not by sysfs order.
            for plugin in &ctx.devices {
                placement.use_device_plugin(plugin.as_ref())?;
            }
            Some(placement)
        }
        Err(e) => {
            tracing::warn!(error = %e, "efa: topology discovery failed; registering on every rail");
            None
        }
    };
    FabricTransport::open_notifying(config, placement, ctx.notifications.clone(), ctx.auth.clone())
}

#[async_trait]
impl Transport for FabricTransport {
    fn name(&self) -> &'static str {
        TRANSPORT
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: MemoryKinds::HOST,
            remote: MemoryKinds::HOST,
        }
    }

    fn endpoint(&self) -> serde_json::Value {
        self.inner.endpoint.clone()
    }

    fn can_reach(&self, peer: &SegmentDescriptor) -> bool {
        peer.endpoint(TRANSPORT)
            .and_then(|v| EndpointInfo::parse(&peer.name, v).ok())
            .is_some_and(|e| e.provider == self.inner.provider)
    }

    async fn register(&self, regions: &[RegionInfo]) -> Result<Vec<serde_json::Value>> {
        if self.inner.is_closed() {
            return Err(Error::Closed("efa transport".into()));
        }
        self.inner.regions.register(regions)
    }

    async fn deregister(&self, regions: &[RegionInfo]) -> Result<()> {
        self.inner.regions.deregister(regions)
    }

    async fn connect(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Peer>> {
        if self.inner.is_closed() {
            return Err(Error::Closed("efa transport".into()));
        }
        Ok(Arc::new(FabricPeer::connect(self.inner.clone(), peer)?))
    }

    fn skipped_devices(&self) -> Vec<SkippedDevice> {
        self.inner.skipped.clone()
    }

    async fn shutdown(&self) {
        self.inner.closed.store(true, Ordering::Release);
        for w in &self.inner.workers {
            w.stop();
        }
        self.inner.regions.clear();
    }
}

impl Drop for FabricTransport {
    fn drop(&mut self) {
        self.inner.closed.store(true, Ordering::Release);
        for w in &self.inner.workers {
            w.stop();
        }
    }
}
