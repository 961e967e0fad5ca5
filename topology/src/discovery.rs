//! Reading the host's devices from sysfs: RDMA/EFA NICs, network interfaces, GPUs, NUMA nodes and
//! where each device sits in the PCI tree. The sysfs root is a parameter so tests and `te-bench
//! topology --sysfs` read fixtures; nothing here writes or opens a device.

use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use serde::Serialize;

use super::cpulist::CpuList;
use super::pci::{PciAddress, PciPath};
use te_base::error::{Error, Result};

/// PCI vendor id of NVIDIA.
pub const VENDOR_NVIDIA: u16 = 0x10de;
/// PCI vendor id of AMD (ATI).
pub const VENDOR_AMD: u16 = 0x1002;

/// The NUMA node CPUs and their list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NumaNode {
    /// Node number.
    pub id: u32,
    /// CPUs of the node (`/sys/devices/system/node/nodeN/cpulist`).
    pub cpus: CpuList,
}

/// How a NIC is driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NicKind {
    /// AWS Elastic Fabric Adapter (driver `efa`), used through libfabric's efa provider.
    Efa,
    /// Any other RDMA device (mlx5, irdma, bnxt_re...), used through verbs.
    Verbs,
}

/// One port of an RDMA device.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RdmaPort {
    /// Port number (from 1).
    pub number: u32,
    /// The state text after the code, e.g. `ACTIVE`, `DOWN`.
    pub state: String,
    /// True when the port is `ACTIVE`.
    pub active: bool,
    /// Link rate in Mbit/s (`100 Gb/sec (4X EDR)` is 100000); 0 when unknown.
    pub rate_mbps: u64,
    /// `InfiniBand`, `Ethernet` (RoCE) or `Unspecified` (EFA).
    pub link_layer: String,
}

/// An RDMA-capable NIC from `/sys/class/infiniband`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RdmaNic {
    /// Device name (`rdmap79s0`, `mlx5_0`).
    pub name: String,
    /// Kernel driver bound to the PCI function (`efa`, `mlx5_core`), when known.
    pub driver: Option<String>,
    /// EFA or verbs.
    pub kind: NicKind,
    /// Where the NIC sits in the PCI tree; `None` for software devices (rxe, siw).
    pub pci: Option<PciPath>,
    /// NUMA node of the PCI function; `None` when the kernel reports -1.
    pub numa: Option<u32>,
    /// Ports, by number.
    pub ports: Vec<RdmaPort>,
    /// Network interfaces backed by this device (RoCE netdevs).
    pub netdevs: Vec<String>,
}

impl RdmaNic {
    /// The rate used to weight this rail when striping: the fastest active port, else the fastest
    /// port, in Mbit/s (0 when the kernel reports none).
    pub fn rate_mbps(&self) -> u64 {
        let active = self.ports.iter().filter(|p| p.active).map(|p| p.rate_mbps).max();
        active
            .or_else(|| self.ports.iter().map(|p| p.rate_mbps).max())
            .unwrap_or(0)
    }

    /// The PCI bus id, when the NIC is a PCI function.
    pub fn bus_id(&self) -> Option<PciAddress> {
        self.pci.as_ref().map(|p| p.device)
    }
}

/// GPU vendors recognised by PCI vendor id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuVendor {
    /// NVIDIA (CUDA).
    Nvidia,
    /// AMD (HIP/ROCm).
    Amd,
}

/// A GPU found on the PCI bus.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gpu {
    /// Vendor.
    pub vendor: GpuVendor,
    /// PCI device id (`0x2330` is an H100 SXM5).
    #[serde(serialize_with = "hex4")]
    pub device_id: u16,
    /// PCI class code (`0x030200` 3D controller, `0x030000` VGA, `0x038000` display controller).
    #[serde(serialize_with = "hex6")]
    pub class: u32,
    /// Where the GPU sits in the PCI tree.
    pub pci: PciPath,
    /// NUMA node; `None` when the kernel reports -1.
    pub numa: Option<u32>,
}

impl Gpu {
    /// The PCI bus id.
    pub fn bus_id(&self) -> PciAddress {
        self.pci.device
    }
}

/// A network interface from `/sys/class/net`, for the TCP transport.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NetInterface {
    /// Interface name.
    pub name: String,
    /// The PCI function behind it; `None` for virtual interfaces (lo, veth, bridges).
    pub pci: Option<PciPath>,
    /// NUMA node of the PCI function.
    pub numa: Option<u32>,
    /// `operstate` (`up`, `down`, `unknown`).
    pub operstate: Option<String>,
    /// Link speed in Mbit/s when the kernel reports one.
    pub speed_mbps: Option<u64>,
    /// The RDMA device that backs this interface, if any.
    pub rdma_device: Option<String>,
}

/// Everything discovered on one host.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Topology {
    /// Where it was read from (`/sys`, a fixture directory or a fixture spec file).
    pub source: String,
    /// NUMA nodes, ascending.
    pub numa_nodes: Vec<NumaNode>,
    /// RDMA NICs sorted by PCI bus id (software devices last, by name). A NIC's position in this
    /// list is its rail index.
    pub nics: Vec<RdmaNic>,
    /// GPUs sorted by PCI bus id.
    pub gpus: Vec<Gpu>,
    /// Network interfaces sorted by name.
    pub net_interfaces: Vec<NetInterface>,
}

impl Topology {
    /// Reads the running host's `/sys`.
    pub fn discover() -> Result<Topology> {
        Topology::discover_at("/sys")
    }

    /// Reads a sysfs tree rooted at `root` (a directory holding `class/`, `bus/`, `devices/`).
    /// Missing classes mean "no such device" (a host without RDMA NICs is not an error); a file that
    /// is present but malformed is an error naming it.
    pub fn discover_at(root: impl AsRef<Path>) -> Result<Topology> {
        let root = root.as_ref();
        let canonical_root =
            fs::canonicalize(root).map_err(|e| Error::io(format!("sysfs root {}", root.display()), e))?;
        let sysfs = Sysfs { root: canonical_root };
        let mut nics = sysfs.rdma_nics()?;
        nics.sort_by(|a, b| match (a.bus_id(), b.bus_id()) {
            (Some(x), Some(y)) => x.cmp(&y).then_with(|| a.name.cmp(&b.name)),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => a.name.cmp(&b.name),
        });
        let mut gpus = sysfs.gpus()?;
        gpus.sort_by_key(|g| g.bus_id());
        let mut net_interfaces = sysfs.net_interfaces()?;
        for iface in &mut net_interfaces {
            iface.rdma_device = nics
                .iter()
                .find(|n| n.netdevs.iter().any(|d| d == &iface.name))
                .map(|n| n.name.clone());
        }
        Ok(Topology {
            source: root.display().to_string(),
            numa_nodes: sysfs.numa_nodes()?,
            nics,
            gpus,
            net_interfaces,
        })
    }

    /// Reads the sysfs tree at `path`, naming it in errors as a source the caller chose (a
    /// sysfs copy, a fixture tree). Fixture specs (`*.json`) are turned into trees by the
    /// `te-testkit` crate, which only benches and tests depend on.
    pub fn discover_from(path: impl AsRef<Path>) -> Result<Topology> {
        let path = path.as_ref();
        let meta = fs::metadata(path).map_err(|e| Error::io(format!("sysfs source {}", path.display()), e))?;
        if !meta.is_dir() {
            return Err(Error::config(
                "sysfs source",
                path.display().to_string(),
                "not a directory (a fixture spec is materialized with te_testkit::fixture::discover)",
            ));
        }
        Topology::discover_at(path)
    }

    /// The index (rail number) of the NIC called `name`.
    pub fn nic_index(&self, name: &str) -> Option<usize> {
        self.nics.iter().position(|n| n.name == name)
    }

    /// The GPU with this bus id.
    pub fn gpu(&self, bus_id: PciAddress) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.bus_id() == bus_id)
    }

    /// Bus ids of the GPUs of one vendor, ascending.
    pub fn gpu_bus_ids(&self, vendor: GpuVendor) -> Vec<PciAddress> {
        self.gpus
            .iter()
            .filter(|g| g.vendor == vendor)
            .map(|g| g.bus_id())
            .collect()
    }
}

/// A sysfs tree with a canonical root.
struct Sysfs {
    root: PathBuf,
}

impl Sysfs {
    fn numa_nodes(&self) -> Result<Vec<NumaNode>> {
        let mut nodes = Vec::new();
        for (name, path) in self.list(&self.root.join("devices/system/node"))? {
            let Some(id) = name.strip_prefix("node").and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let cpus = match read_attr(&path.join("cpulist"))? {
                Some(text) => CpuList::parse(&text).map_err(|e| invalid(&path.join("cpulist"), e))?,
                None => CpuList::default(),
            };
            nodes.push(NumaNode { id, cpus });
        }
        nodes.sort_by_key(|n| n.id);
        Ok(nodes)
    }

    fn rdma_nics(&self) -> Result<Vec<RdmaNic>> {
        let mut nics = Vec::new();
        for (name, path) in self.list(&self.root.join("class/infiniband"))? {
            let device = path.join("device");
            let pci = self.pci_path_of(&device);
            let driver = driver_name(&device);
            let kind = match driver.as_deref() {
                Some("efa") => NicKind::Efa,
                None if name.starts_with("rdmap") || name.starts_with("efa") => NicKind::Efa,
                _ => NicKind::Verbs,
            };
            let numa = match &pci {
                Some(p) => self.numa_of(p)?,
                None => None,
            };
            let mut ports = Vec::new();
            for (port_name, port_path) in self.list(&path.join("ports"))? {
                let Ok(number) = port_name.parse::<u32>() else { continue };
                ports.push(read_port(number, &port_path)?);
            }
            ports.sort_by_key(|p| p.number);
            let mut netdevs: Vec<String> = self.list(&device.join("net"))?.into_iter().map(|(n, _)| n).collect();
            netdevs.sort();
            nics.push(RdmaNic {
                name,
                driver,
                kind,
                pci,
                numa,
                ports,
                netdevs,
            });
        }
        Ok(nics)
    }

    fn gpus(&self) -> Result<Vec<Gpu>> {
        let mut gpus = Vec::new();
        for (_, path) in self.list(&self.root.join("bus/pci/devices"))? {
            let Some(class) = read_hex(&path.join("class"))? else {
                continue;
            };
            let Some(vendor) = read_hex(&path.join("vendor"))? else {
                continue;
            };
            let vendor = match vendor as u16 {
                VENDOR_NVIDIA => GpuVendor::Nvidia,
                VENDOR_AMD => GpuVendor::Amd,
                _ => continue,
            };
            // 0x0302 3D controller (datacenter NVIDIA), 0x0300 VGA, 0x0380 display controller (AMD Instinct).
            if !matches!(class >> 8, 0x0300 | 0x0302 | 0x0380) {
                continue;
            }
            let Some(pci) = self.pci_path_of(&path) else { continue };
            let device_id = read_hex(&path.join("device"))?.unwrap_or(0) as u16;
            let numa = self.numa_of(&pci)?;
            gpus.push(Gpu {
                vendor,
                device_id,
                class,
                pci,
                numa,
            });
        }
        Ok(gpus)
    }

    fn net_interfaces(&self) -> Result<Vec<NetInterface>> {
        let mut out = Vec::new();
        for (name, path) in self.list(&self.root.join("class/net"))? {
            let pci = self.pci_path_of(&path);
            let numa = match &pci {
                Some(p) => self.numa_of(p)?,
                None => None,
            };
            // `speed` is -1 or unreadable (EINVAL) on links that are down or virtual.
            let speed_mbps = read_attr(&path.join("speed"))
                .ok()
                .flatten()
                .and_then(|s| s.parse::<i64>().ok())
                .and_then(|s| u64::try_from(s).ok())
                .filter(|&s| s > 0);
            out.push(NetInterface {
                name,
                pci,
                numa,
                operstate: read_attr(&path.join("operstate")).ok().flatten(),
                speed_mbps,
                rdma_device: None,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// The PCI path of whatever `link` resolves to, from the components under `devices/`.
    fn pci_path_of(&self, link: &Path) -> Option<PciPath> {
        let resolved = fs::canonicalize(link).ok()?;
        let rel = resolved.strip_prefix(self.root.join("devices")).ok()?;
        let parts: Vec<&str> = rel
            .components()
            .filter_map(|c| match c {
                Component::Normal(s) => s.to_str(),
                _ => None,
            })
            .collect();
        PciPath::from_components(parts)
    }

    /// The `numa_node` of the PCI function at `path`.
    fn numa_of(&self, path: &PciPath) -> Result<Option<u32>> {
        let mut dir = self.root.join("devices").join(&path.root);
        for b in &path.bridges {
            dir.push(b.to_string());
        }
        dir.push(path.device.to_string());
        let file = dir.join("numa_node");
        let Some(text) = read_attr(&file)? else { return Ok(None) };
        let node: i64 = text
            .parse()
            .map_err(|_| invalid(&file, format!("not an integer: {text:?}")))?;
        Ok(u32::try_from(node).ok())
    }

    /// Entries of a directory as (name, path), empty when the directory does not exist.
    fn list(&self, dir: &Path) -> Result<Vec<(String, PathBuf)>> {
        let entries = match fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io(format!("listing {}", dir.display()), e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
            if let Some(name) = entry.file_name().to_str() {
                out.push((name.to_string(), entry.path()));
            }
        }
        out.sort();
        Ok(out)
    }
}

fn read_port(number: u32, dir: &Path) -> Result<RdmaPort> {
    // `state` reads "4: ACTIVE"; `rate` reads "100 Gb/sec (4X EDR)".
    let state_text = read_attr(&dir.join("state"))?.unwrap_or_default();
    let state = state_text
        .split_once(':')
        .map(|(_, s)| s.trim())
        .unwrap_or(&state_text)
        .to_string();
    let rate_mbps = match read_attr(&dir.join("rate"))? {
        Some(text) => parse_rate(&text).map_err(|e| invalid(&dir.join("rate"), e))?,
        None => 0,
    };
    Ok(RdmaPort {
        number,
        active: state == "ACTIVE",
        state,
        rate_mbps,
        link_layer: read_attr(&dir.join("link_layer"))?.unwrap_or_else(|| "Unspecified".into()),
    })
}

/// `"100 Gb/sec (4X EDR)"` -> 100000, `"2.5 Gb/sec (1X SDR)"` -> 2500.
fn parse_rate(text: &str) -> std::result::Result<u64, String> {
    let number = text.split_whitespace().next().unwrap_or("");
    let gbps: f64 = number
        .parse()
        .map_err(|_| format!("rate {text:?} does not start with a number of Gb/sec"))?;
    if !gbps.is_finite() || !(0.0..=1.0e6).contains(&gbps) {
        return Err(format!("rate {text:?} is out of range"));
    }
    Ok((gbps * 1000.0).round() as u64)
}

fn driver_name(device: &Path) -> Option<String> {
    let target = fs::read_link(device.join("driver")).ok()?;
    target.file_name()?.to_str().map(str::to_string)
}

/// A trimmed attribute, `None` if the file does not exist.
fn read_attr(path: &Path) -> Result<Option<String>> {
    match fs::read_to_string(path) {
        Ok(s) => Ok(Some(s.trim().to_string())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(format!("reading {}", path.display()), e)),
    }
}

/// A `0x`-prefixed hex attribute (`class`, `vendor`, `device`).
fn read_hex(path: &Path) -> Result<Option<u32>> {
    let Some(text) = read_attr(path)? else { return Ok(None) };
    let digits = text.strip_prefix("0x").unwrap_or(&text);
    u32::from_str_radix(digits, 16)
        .map(Some)
        .map_err(|_| invalid(path, format!("not a hex number: {text:?}")))
}

/// Device ids print as sysfs shows them, `0x2330`.
fn hex4<S: serde::Serializer>(v: &u16, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("{v:#06x}"))
}

/// Class codes print as sysfs shows them, `0x030200`.
fn hex6<S: serde::Serializer>(v: &u32, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("{v:#08x}"))
}

fn invalid(path: &Path, reason: impl Into<String>) -> Error {
    Error::io(
        format!("reading {}", path.display()),
        io::Error::new(io::ErrorKind::InvalidData, reason.into()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(parse_rate("100 Gb/sec (4X EDR)"), Ok(100_000));
        assert_eq!(parse_rate("2.5 Gb/sec (1X SDR)"), Ok(2_500));
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("-1 Gb/sec").is_err());
    }
}
