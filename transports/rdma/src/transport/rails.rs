//! Per-rail device resources (context, protection domain, completion queue, chosen port and GID)
//! and memory registration, on the rails placement chooses, through te-base's registration pool.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use te_base::device::DmaBufExport;
use te_base::registration::RegistrationProvider;
use te_base::{Error, RegionId, RegionInfo, Result, SkippedDevice};
use te_topology::Topology;

use super::device_memory::DeviceMemory;
use crate::config::RdmaConfig;
use crate::protocol::handshake::{gid_hex, RailInfo};
use crate::protocol::mr_split;
use crate::verbs::{Access, DeviceAttrs, Gid, LinkLayer, MrKeys, PortAttrs, Verbs};
use te_topology::RailPlacement;

/// One device port in use.
pub struct Rail<V: Verbs> {
    /// Rail number (see [`RailInfo::rail`]): what buffer keys list and what pairs with the
    /// peer's rail of the same number. The rail's position in [`RailSet::rails`] may differ.
    pub id: usize,
    /// Device name.
    pub name: String,
    /// Port number.
    pub port: u8,
    /// Port state at discovery.
    pub port_attrs: PortAttrs,
    /// Device limits.
    pub attrs: DeviceAttrs,
    /// Link rate from the topology, Mbit/s (0 when unknown); weights striping.
    pub rate_mbps: u64,
    /// GID index we send from.
    pub gid_index: u8,
    /// That GID.
    pub gid: Gid,
    /// Entries of the CQ.
    pub cq_capacity: u64,
    /// Send-queue slots of the QPs using the CQ; never above `cq_capacity`.
    cq_reserved: AtomicU64,
    pub(crate) ctx: Option<V::Context>,
    pub(crate) pd: Option<V::Pd>,
    pub(crate) cq: Option<V::Cq>,
    /// The CQ's completion channel; `None` when the device could not make one (the progress
    /// thread then polls this rail without waiting on it).
    pub(crate) channel: Option<V::Channel>,
}

impl<V: Verbs> Rail<V> {
    /// What peers learn about this rail.
    pub fn info(&self) -> RailInfo {
        RailInfo {
            rail: self.id as u32,
            device: self.name.clone(),
            port: self.port,
            link_layer: self.port_attrs.link_layer,
            lid: self.port_attrs.lid,
            gid: gid_hex(&self.gid),
            mtu: self.port_attrs.active_mtu,
            rate_mbps: self.rate_mbps,
        }
    }

    /// The protection domain.
    pub fn pd(&self) -> &V::Pd {
        self.pd.as_ref().expect("live until drop")
    }

    /// The completion queue every QP of this rail uses.
    pub fn cq(&self) -> &V::Cq {
        self.cq.as_ref().expect("live until drop")
    }

    /// The CQ's completion channel, if it has one.
    pub fn channel(&self) -> Option<&V::Channel> {
        self.channel.as_ref()
    }

    /// Reserves CQ room for a QP of `depth` send slots: every work request completes at most once
    /// (flushed ones included), so while the depths fit the CQ cannot overrun.
    pub fn reserve_cq(&self, depth: u32) -> Result<()> {
        let depth = u64::from(depth);
        let before = self.cq_reserved.fetch_add(depth, Ordering::AcqRel);
        if before + depth > self.cq_capacity {
            self.cq_reserved.fetch_sub(depth, Ordering::AcqRel);
            return Err(Error::transport(
                "rdma",
                format!(
                    "completion queue of {} is full ({before} of {} entries promised to QPs, {depth} more asked): \
                     raise TE_RDMA_CQ_DEPTH or lower TE_RDMA_SEND_QUEUE_DEPTH / TE_RDMA_QPS_PER_PEER",
                    self.name, self.cq_capacity
                ),
            ));
        }
        Ok(())
    }

    /// Returns what [`Rail::reserve_cq`] took.
    pub fn release_cq(&self, depth: u32) {
        self.cq_reserved.fetch_sub(u64::from(depth), Ordering::AcqRel);
    }
}

/// Every rail of the transport. Destroys its resources on drop (after every QP and MR that uses
/// them, which hold an `Arc` to this set).
pub struct RailSet<V: Verbs> {
    pub(crate) verbs: Arc<V>,
    /// Rails in index order.
    pub rails: Vec<Rail<V>>,
    /// Split size of every registration (the smallest device max MR size, or the knob).
    pub chunk: u64,
    /// Devices not opened as rails (no active port, no usable GID), each with why: reported through
    /// `Transport::skipped_devices`, as the efa transport reports its domains.
    pub skipped: Vec<SkippedDevice>,
}

/// Registrations of one region on one rail: one MR per chunk.
pub struct RailRegistration<V: Verbs> {
    pub(crate) mrs: Vec<V::Mr>,
    /// Keys per chunk.
    pub keys: Vec<MrKeys>,
}

/// Reads the RoCE GID type of entry `index` from sysfs (`RoCE v2`, `IB/RoCE v1`), if known.
fn sysfs_gid_type(root: &Path, device: &str, port: u8, index: u32) -> Option<String> {
    let p = root.join(format!(
        "class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}"
    ));
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn is_ipv4_mapped(g: &Gid) -> bool {
    g.0[..10] == [0; 10] && g.0[10] == 0xff && g.0[11] == 0xff
}

/// Chooses the GID to send from among `(index, gid, type)` entries: for RoCE the first RoCE v2
/// IPv4-mapped GID, then any RoCE v2 GID, then any IPv4-mapped GID (type unknown); for
/// InfiniBand index 0.
pub fn choose_gid(link_layer: LinkLayer, entries: &[(u32, Gid, Option<String>)]) -> Option<u32> {
    let usable = |g: &Gid| !g.is_zero();
    if link_layer == LinkLayer::Infiniband {
        return entries.iter().find(|(i, g, _)| *i == 0 && usable(g)).map(|e| e.0);
    }
    let v2 = |t: &Option<String>| t.as_deref() == Some("RoCE v2");
    entries
        .iter()
        .find(|(_, g, t)| v2(t) && is_ipv4_mapped(g))
        .or_else(|| entries.iter().find(|(_, g, t)| v2(t) && usable(g)))
        .or_else(|| entries.iter().find(|(_, g, t)| t.is_none() && is_ipv4_mapped(g)))
        .map(|e| e.0)
}

/// A device to open as a rail: name, link rate (Mbit/s, 0 when unknown) and rail number.
pub type RailSpec = (String, u64, usize);

/// Orders devices as te-base's topology numbers rails (NIC position in PCI bus-id order, so rail
/// `i` of two identical nodes is the same NIC position, the same switch rail in rail-optimized
/// fabrics), with each one's link rate and rail number (its topology position). Devices the
/// topology does not know keep their order, last, with rate 0, numbered after every topology NIC;
/// without a topology, rails are numbered in the given order.
pub fn order_by_topology(devices: &[String], topology: Option<&Topology>) -> Vec<RailSpec> {
    let mut out: Vec<(Option<usize>, usize, String, u64)> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let idx = topology.and_then(|t| t.nic_index(d));
            let rate = idx.and_then(|x| topology.map(|t| t.nics[x].rate_mbps())).unwrap_or(0);
            (idx, i, d.clone(), rate)
        })
        .collect();
    out.sort_by_key(|(idx, i, _, _)| (idx.is_none(), idx.unwrap_or(0), *i));
    let known = topology.map_or(0, |t| t.nics.len());
    out.into_iter()
        .enumerate()
        .map(|(position, (idx, _, d, r))| (d, r, idx.unwrap_or(known + position)))
        .collect()
}

/// The IPv4 address inside an IPv4-mapped GID.
pub fn gid_ipv4(g: &Gid) -> Option<std::net::Ipv4Addr> {
    is_ipv4_mapped(g).then(|| std::net::Ipv4Addr::new(g.0[12], g.0[13], g.0[14], g.0[15]))
}

impl<V: Verbs> RailSet<V> {
    /// Opens `devices` (name, link rate), keeping the first active port of each, and creates a PD
    /// and CQ per rail.
    pub fn open(verbs: Arc<V>, devices: &[RailSpec], config: &RdmaConfig, sysfs: &Path) -> Result<Self> {
        let mut set = RailSet {
            verbs: verbs.clone(),
            rails: Vec::new(),
            chunk: u64::MAX,
            skipped: Vec::new(),
        };
        let skip = |name: &String, reason: &str| SkippedDevice {
            name: name.clone(),
            reason: reason.to_string(),
        };
        for (name, rate_mbps, id) in devices {
            let ctx = verbs.open_device(name)?;
            let attrs = verbs.query_device(&ctx)?;
            let mut chosen = None;
            for port in 1..=attrs.phys_port_cnt.max(1) {
                let pa = verbs.query_port(&ctx, port)?;
                if pa.active {
                    chosen = Some((port, pa));
                    break;
                }
            }
            let Some((port, port_attrs)) = chosen else {
                set.skipped.push(skip(name, "no active port"));
                verbs.close_device(ctx)?;
                continue;
            };
            let gid_index = match config.gid_index {
                Some(i) => u32::from(i),
                None => {
                    let entries: Vec<(u32, Gid, Option<String>)> = (0..port_attrs.gid_table_len.min(256))
                        .filter_map(|i| {
                            let g = verbs.query_gid(&ctx, port, i).ok()?;
                            Some((i, g, sysfs_gid_type(sysfs, name, port, i)))
                        })
                        .collect();
                    match choose_gid(port_attrs.link_layer, &entries) {
                        Some(i) => i,
                        None => {
                            set.skipped.push(skip(name, "no usable GID (set TE_RDMA_GID_INDEX)"));
                            verbs.close_device(ctx)?;
                            continue;
                        }
                    }
                }
            };
            let gid = verbs.query_gid(&ctx, port, gid_index)?;
            if gid.is_zero() && port_attrs.link_layer == LinkLayer::Ethernet {
                return Err(Error::config(
                    "TE_RDMA_GID_INDEX",
                    gid_index.to_string(),
                    format!("GID {gid_index} of {name} port {port} is empty"),
                ));
            }
            let pd = verbs.alloc_pd(&ctx)?;
            let cq_capacity = config.cq_depth.min(attrs.max_cqe.max(16));
            // A channel lets the progress thread sleep until a completion arrives; without one
            // (a provider that cannot make it) the rail is polled only.
            let channel = match verbs.create_comp_channel(&ctx) {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(device = %name, "rdma: no completion channel, polling only: {e}");
                    None
                }
            };
            let cq = verbs.create_cq(&ctx, cq_capacity, channel.as_ref())?;
            set.chunk = set
                .chunk
                .min(mr_split::chunk_size(attrs.max_mr_size, config.max_mr_size));
            set.rails.push(Rail {
                id: *id,
                name: name.clone(),
                port,
                port_attrs,
                attrs,
                rate_mbps: *rate_mbps,
                cq_capacity: u64::from(cq_capacity),
                cq_reserved: AtomicU64::new(0),
                gid_index: gid_index as u8,
                gid,
                ctx: Some(ctx),
                pd: Some(pd),
                cq: Some(cq),
                channel,
            });
        }
        if set.rails.is_empty() {
            return Err(Error::not_available(
                "rdma",
                format!(
                    "no usable RDMA port ({})",
                    set.skipped
                        .iter()
                        .map(|d| format!("{}: {}", d.name, d.reason))
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            ));
        }
        Ok(set)
    }
}

impl<V: Verbs> RailSet<V> {
    /// The position in [`RailSet::rails`] of rail number `id`.
    pub fn position(&self, id: usize) -> Option<usize> {
        self.rails.iter().position(|r| r.id == id)
    }

    /// The largest rail number, plus one (for tables indexed by rail number).
    pub fn id_bound(&self) -> usize {
        self.rails.iter().map(|r| r.id + 1).max().unwrap_or(0)
    }
}

impl<V: Verbs> Drop for RailSet<V> {
    fn drop(&mut self) {
        for rail in &mut self.rails {
            let results = [
                rail.cq.take().map(|cq| self.verbs.destroy_cq(cq)),
                rail.channel.take().map(|ch| self.verbs.destroy_comp_channel(ch)),
                rail.pd.take().map(|pd| self.verbs.dealloc_pd(pd)),
                rail.ctx.take().map(|ctx| self.verbs.close_device(ctx)),
            ];
            for e in results.into_iter().flatten().filter_map(|r| r.err()) {
                tracing::warn!(rail = %rail.name, "rdma teardown: {e}");
            }
        }
    }
}

/// Registration through the pool on the rails placement chooses for each region (every rail
/// without placement). Exported regions grant remote read and write; others only local access.
/// GPU memory goes through a dma-buf when one was exported for the region, else as a plain
/// registration of the device pointer (peer memory).
pub struct RailRegistrar<V: Verbs> {
    /// The rails.
    pub set: Arc<RailSet<V>>,
    placement: Option<RailPlacement>,
    /// GPU registration routes.
    pub device: DeviceMemory,
    /// Dma-bufs of the regions of the batch being registered, shared by their rails.
    exports: Mutex<HashMap<RegionId, Arc<DmaBufExport>>>,
}

impl<V: Verbs> RailRegistrar<V> {
    /// Registers on `set`, placed by `placement`.
    pub fn new(set: Arc<RailSet<V>>, placement: Option<RailPlacement>, device: DeviceMemory) -> Self {
        RailRegistrar {
            set,
            placement,
            device,
            exports: Mutex::new(HashMap::new()),
        }
    }

    /// The rails `region` is registered on, ascending.
    pub fn rails_for(&self, region: &RegionInfo) -> Vec<usize> {
        let n = self.set.rails.len();
        match &self.placement {
            Some(p) => p.rails_for(region, n, "rdma"),
            None => (0..n).collect(),
        }
    }

    /// Keeps `export` for `region` until [`RailRegistrar::forget_exports`].
    pub fn stage_export(&self, region: RegionId, export: DmaBufExport) {
        self.exports.lock().insert(region, Arc::new(export));
    }

    /// Drops the staged dma-bufs of `regions` (their MRs keep their own references).
    pub fn forget_exports(&self, regions: &[RegionInfo]) {
        let mut exports = self.exports.lock();
        for r in regions {
            exports.remove(&r.id);
        }
    }
}

impl<V: Verbs> RegistrationProvider for RailRegistrar<V> {
    type Handle = RailRegistration<V>;

    fn name(&self) -> &str {
        "rdma"
    }

    fn domain_count(&self) -> usize {
        self.set.rails.len()
    }

    fn domains_for(&self, region: &RegionInfo) -> Vec<usize> {
        self.rails_for(region)
    }

    fn register(&self, domain: usize, region: &RegionInfo) -> Result<RailRegistration<V>> {
        let rail = &self.set.rails[domain];
        let access = Access {
            remote_write: region.exported,
            remote_read: region.exported,
        };
        let export = self.exports.lock().get(&region.id).cloned();
        let mut reg = RailRegistration {
            mrs: Vec::new(),
            keys: Vec::new(),
        };
        for (addr, len) in mr_split::split(region.base, region.len, self.set.chunk) {
            let made = match &export {
                // SAFETY: the dma-buf covers the region (exported for `[base, base + len)`, the
                // requested address `offset` bytes in) and the engine deregisters before freeing
                // the device memory.
                Some(e) => unsafe {
                    self.set.verbs.reg_dmabuf_mr(
                        rail.pd(),
                        e.offset + (addr - region.base),
                        len,
                        addr,
                        e.fd.as_raw_fd(),
                        access,
                    )
                },
                // SAFETY: the engine registers only memory it owns or was handed under
                // `register_raw`'s contract, and calls deregister before that memory goes away.
                None => unsafe { self.set.verbs.reg_mr(rail.pd(), addr, len, access) },
            };
            match made {
                Ok((mr, keys)) => {
                    reg.mrs.push(mr);
                    reg.keys.push(keys);
                }
                Err(e) => {
                    for mr in reg.mrs.drain(..) {
                        let _ = self.set.verbs.dereg_mr(mr);
                    }
                    return Err(e);
                }
            }
        }
        Ok(reg)
    }

    fn deregister(&self, _domain: usize, _region: &RegionInfo, handle: RailRegistration<V>) -> Result<()> {
        let mut first = Ok(());
        for mr in handle.mrs {
            if let Err(e) = self.set.verbs.dereg_mr(mr) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(last: u8) -> Gid {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[10, 0, 0, last]);
        Gid(g)
    }

    #[test]
    fn rails_follow_the_topology_order_with_rates() {
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../topology/tests/fixtures/topology/roce-8gpu.json");
        let topology = te_testkit::fixture::discover(&fixture).expect("te-base's RoCE fixture");
        let devices: Vec<String> = ["mlx5_3", "mlx5_9", "mlx5_0"].iter().map(|s| s.to_string()).collect();
        let ordered = order_by_topology(&devices, Some(&topology));
        let names: Vec<&str> = ordered.iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(names, ["mlx5_0", "mlx5_3", "mlx5_9"], "bus-id order, unknown last");
        assert_eq!(ordered[0].1, 200_000, "HDR 200 Gb/s from sysfs");
        assert_eq!(ordered[2].1, 0);
        let ids: Vec<usize> = ordered.iter().map(|r| r.2).collect();
        assert_eq!(
            ids,
            [0, 3, 8 + 2],
            "topology positions; unknown devices numbered past the 8 NICs"
        );
        let ids: Vec<usize> = order_by_topology(&devices, None).iter().map(|r| r.2).collect();
        assert_eq!(ids, [0, 1, 2]);
        assert_eq!(
            order_by_topology(&devices, None)[0].0,
            "mlx5_3",
            "no topology: given order"
        );
    }

    #[test]
    fn prefers_roce_v2_ipv4_gids() {
        let ll = Gid([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        let v1 = Some("IB/RoCE v1".to_string());
        let v2 = Some("RoCE v2".to_string());
        let table = vec![
            (0, ll, v1.clone()),
            (1, ll, v2.clone()),
            (2, v4(1), v1.clone()),
            (3, v4(1), v2.clone()),
        ];
        assert_eq!(choose_gid(LinkLayer::Ethernet, &table), Some(3));
        assert_eq!(
            choose_gid(LinkLayer::Ethernet, &table[..3]),
            Some(1),
            "v2 link-local next"
        );
        assert_eq!(
            choose_gid(LinkLayer::Ethernet, &[(0, ll, None), (2, v4(2), None)]),
            Some(2)
        );
        assert_eq!(choose_gid(LinkLayer::Ethernet, &[(0, Gid::default(), v2)]), None);
        assert_eq!(choose_gid(LinkLayer::Infiniband, &[(0, ll, None)]), Some(0));
        assert_eq!(gid_ipv4(&v4(7)), Some(std::net::Ipv4Addr::new(10, 0, 0, 7)));
        assert_eq!(gid_ipv4(&ll), None);
    }
}
