//! Sysfs fixtures: a compact JSON description of a host that is generated into a real sysfs-shaped
//! directory tree (directories, attribute files and relative symlinks laid out as the kernel does),
//! so discovery reads fixtures through exactly the code it uses on `/sys`.
//!
//! A spec lists NUMA nodes, device templates (`kinds`) and devices by their full PCI path under
//! `devices/`; the bridges on each path are created as PCI bridges. See
//! `topology/tests/fixtures/topology/` for the instance types and where their facts come from.
//! [`discover`] reads a sysfs directory or a spec, which is what `te-bench --sysfs` accepts.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use te_base::{Error, Result};
use te_topology::{CpuList, PciPath, Topology};

/// A host description.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureSpec {
    /// Instance type or host name.
    pub name: String,
    /// Where each fact comes from, and what is inferred.
    #[serde(default)]
    pub sources: Vec<String>,
    /// NUMA nodes and their CPUs.
    pub numa_nodes: Vec<FixtureNuma>,
    /// Device templates by name.
    #[serde(default)]
    pub kinds: BTreeMap<String, FixtureKind>,
    /// PCI devices.
    #[serde(default)]
    pub devices: Vec<FixtureDevice>,
    /// Virtual network interfaces (`lo`, bridges) under `devices/virtual/net`.
    #[serde(default)]
    pub virtual_net: Vec<String>,
}

/// A NUMA node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureNuma {
    /// Node number.
    pub id: u32,
    /// CPU list, kernel form (`0-47,96-143`).
    pub cpus: String,
}

/// What every device of a kind has.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureKind {
    /// PCI class, `0x030200`.
    pub class: String,
    /// PCI vendor, `0x10de`.
    pub vendor: String,
    /// PCI device id, `0x2330`.
    pub device: String,
    /// Bound kernel driver (`nvidia`, `efa`, `mlx5_core`).
    #[serde(default)]
    pub driver: Option<String>,
    /// RDMA port attributes, for devices that have an `ibdev`.
    #[serde(default)]
    pub port: Option<FixturePort>,
}

/// RDMA port attributes (port 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixturePort {
    /// `rate` file text, `100 Gb/sec (4X EDR)`.
    pub rate: String,
    /// `link_layer` file text.
    pub link_layer: String,
    /// `state` file text; `4: ACTIVE` when omitted.
    #[serde(default)]
    pub state: Option<String>,
}

/// One PCI function.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureDevice {
    /// Template name in `kinds`.
    pub kind: String,
    /// Path under `devices/`: root bus, bridges, then the device
    /// (`pci0000:4c/0000:4c:01.0/0000:4d:00.0/0000:4f:00.0`).
    pub path: String,
    /// NUMA node; -1 (the kernel's "unknown") when omitted.
    #[serde(default = "minus_one")]
    pub numa: i32,
    /// RDMA device name under `class/infiniband`.
    #[serde(default)]
    pub ibdev: Option<String>,
    /// Network interface name under `class/net`.
    #[serde(default)]
    pub netdev: Option<String>,
}

fn minus_one() -> i32 {
    -1
}

/// A generated tree in a temporary directory, removed on drop.
#[derive(Debug)]
pub struct FixtureDir {
    path: PathBuf,
}

impl FixtureDir {
    /// The sysfs root to pass to [`Topology::discover_at`](te_topology::Topology::discover_at).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for FixtureDir {
    fn drop(&mut self) {
        // Best effort: a leftover temp dir is harmless.
        let _ = fs::remove_dir_all(&self.path);
    }
}

impl FixtureSpec {
    /// Reads a spec file.
    pub fn load(path: &Path) -> Result<FixtureSpec> {
        let text = fs::read_to_string(path).map_err(|e| Error::io(format!("reading fixture {}", path.display()), e))?;
        FixtureSpec::parse(&text).map_err(|e| {
            Error::io(
                format!("fixture {}", path.display()),
                io::Error::new(io::ErrorKind::InvalidData, e),
            )
        })
    }

    /// Parses and checks a spec.
    pub fn parse(text: &str) -> std::result::Result<FixtureSpec, String> {
        let spec: FixtureSpec = serde_json::from_str(text).map_err(|e| format!("malformed fixture spec: {e}"))?;
        for n in &spec.numa_nodes {
            CpuList::parse(&n.cpus).map_err(|e| format!("NUMA node {}: {e}", n.id))?;
        }
        for d in &spec.devices {
            if !spec.kinds.contains_key(&d.kind) {
                return Err(format!("device {}: unknown kind {:?}", d.path, d.kind));
            }
            PciPath::from_components(d.path.split('/'))
                .filter(|p| p.to_string() == d.path)
                .ok_or_else(|| format!("device path {:?} is not pciDDDD:BB/<bdf>/.../<bdf>", d.path))?;
        }
        Ok(spec)
    }

    /// Generates the tree into a fresh temporary directory.
    pub fn materialize_temp(&self) -> Result<FixtureDir> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let base = std::env::temp_dir();
        loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = base.join(format!("te-sysfs-{}-{n}", std::process::id()));
            match fs::create_dir(&path) {
                Ok(()) => {
                    let dir = FixtureDir { path };
                    self.materialize_into(dir.path())?;
                    return Ok(dir);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io(format!("creating {}", path.display()), e)),
            }
        }
    }

    /// Generates the tree under `root` (which must exist).
    pub fn materialize_into(&self, root: &Path) -> Result<()> {
        let w = Writer { root };
        let all_cpus = self
            .numa_nodes
            .iter()
            .map(|n| n.cpus.as_str())
            .collect::<Vec<_>>()
            .join(",");
        for node in &self.numa_nodes {
            let dir = format!("devices/system/node/node{}", node.id);
            w.file(&format!("{dir}/cpulist"), &node.cpus)?;
        }
        let cpus_of = |numa: i32| -> String {
            self.numa_nodes
                .iter()
                .find(|n| numa >= 0 && n.id == numa as u32)
                .map(|n| n.cpus.clone())
                .unwrap_or_else(|| all_cpus.clone())
        };
        for dev in &self.devices {
            let kind = self
                .kinds
                .get(&dev.kind)
                .ok_or_else(|| invalid(format!("device {}: unknown kind {:?}", dev.path, dev.kind)))?;
            let parts: Vec<&str> = dev.path.split('/').collect();
            // Bridges on the way down.
            for depth in 2..parts.len() {
                let bridge_dir = format!("devices/{}", parts[..depth].join("/"));
                if !root.join(&bridge_dir).join("class").exists() {
                    w.pci_function(
                        &bridge_dir,
                        "0x060400",
                        "0x1d0f",
                        "0x0000",
                        dev.numa,
                        &cpus_of(dev.numa),
                    )?;
                    w.link(&format!("bus/pci/devices/{}", parts[depth - 1]), &bridge_dir)?;
                }
            }
            let dir = format!("devices/{}", dev.path);
            let bdf = parts[parts.len() - 1];
            w.pci_function(
                &dir,
                &kind.class,
                &kind.vendor,
                &kind.device,
                dev.numa,
                &cpus_of(dev.numa),
            )?;
            w.link(&format!("bus/pci/devices/{bdf}"), &dir)?;
            if let Some(driver) = &kind.driver {
                w.dir(&format!("bus/pci/drivers/{driver}"))?;
                w.link(&format!("{dir}/driver"), &format!("bus/pci/drivers/{driver}"))?;
            }
            if let Some(ibdev) = &dev.ibdev {
                let port = kind
                    .port
                    .as_ref()
                    .ok_or_else(|| invalid(format!("device {}: kind {} has no port", dev.path, dev.kind)))?;
                let ib = format!("{dir}/infiniband/{ibdev}");
                w.file(&format!("{ib}/ports/1/rate"), &port.rate)?;
                w.file(&format!("{ib}/ports/1/link_layer"), &port.link_layer)?;
                w.file(
                    &format!("{ib}/ports/1/state"),
                    port.state.as_deref().unwrap_or("4: ACTIVE"),
                )?;
                w.link(&format!("{ib}/device"), &dir)?;
                w.link(&format!("class/infiniband/{ibdev}"), &ib)?;
            }
            if let Some(netdev) = &dev.netdev {
                let net = format!("{dir}/net/{netdev}");
                w.file(&format!("{net}/operstate"), "up")?;
                w.link(&format!("{net}/device"), &dir)?;
                w.link(&format!("class/net/{netdev}"), &net)?;
            }
        }
        for name in &self.virtual_net {
            let net = format!("devices/virtual/net/{name}");
            w.file(&format!("{net}/operstate"), "unknown")?;
            w.link(&format!("class/net/{name}"), &net)?;
        }
        Ok(())
    }
}

struct Writer<'a> {
    root: &'a Path,
}

impl Writer<'_> {
    fn dir(&self, rel: &str) -> Result<()> {
        let path = self.root.join(rel);
        fs::create_dir_all(&path).map_err(|e| Error::io(format!("creating {}", path.display()), e))
    }

    fn file(&self, rel: &str, text: &str) -> Result<()> {
        let path = self.root.join(rel);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
        }
        fs::write(&path, format!("{text}\n")).map_err(|e| Error::io(format!("writing {}", path.display()), e))
    }

    /// A relative symlink at `rel` pointing to `target` (both relative to the root), as sysfs has.
    fn link(&self, rel: &str, target: &str) -> Result<()> {
        let path = self.root.join(rel);
        let depth = rel.split('/').count() - 1;
        let relative = format!("{}{target}", "../".repeat(depth));
        if let Ok(existing) = fs::read_link(&path) {
            if existing == Path::new(&relative) {
                return Ok(());
            }
            return Err(invalid(format!(
                "{rel} would point to both {} and {relative} (a PCI address or name used twice)",
                existing.display()
            )));
        }
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
        }
        std::os::unix::fs::symlink(&relative, &path)
            .map_err(|e| Error::io(format!("linking {} -> {relative}", path.display()), e))
    }

    fn pci_function(&self, dir: &str, class: &str, vendor: &str, device: &str, numa: i32, cpus: &str) -> Result<()> {
        self.file(&format!("{dir}/class"), class)?;
        self.file(&format!("{dir}/vendor"), vendor)?;
        self.file(&format!("{dir}/device"), device)?;
        self.file(&format!("{dir}/numa_node"), &numa.to_string())?;
        self.file(&format!("{dir}/local_cpulist"), cpus)
    }
}

fn invalid(reason: String) -> Error {
    Error::io("fixture", io::Error::new(io::ErrorKind::InvalidData, reason))
}

/// Reads `path`: a sysfs directory, or a fixture spec (`*.json`) that is generated into a
/// temporary directory, read and removed again. The topology's `source` names `path`.
pub fn discover(path: impl AsRef<Path>) -> Result<Topology> {
    let path = path.as_ref();
    let meta = fs::metadata(path).map_err(|e| Error::io(format!("sysfs source {}", path.display()), e))?;
    if meta.is_dir() {
        return Topology::discover_from(path);
    }
    let spec = FixtureSpec::load(path)?;
    let dir = spec.materialize_temp()?;
    let mut topology = Topology::discover_at(dir.path())?;
    topology.source = path.display().to_string();
    Ok(topology)
}
