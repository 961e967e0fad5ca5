//! Which NICs (rails) a buffer is registered on, under the policy in force.

use serde::Serialize;

use super::discovery::{GpuVendor, RdmaNic, Topology};
use super::gpu_ordinals::GpuOrdinals;
use super::numa_lookup::numa_node_of;
use super::pci::PciAddress;
use super::policy::{NicPolicy, NicSelection, PRIORITY_MATRIX_VAR};
use super::priority_matrix::{MatrixEntry, MatrixKey, PriorityMatrix};
use super::rail_map::{RailMap, RailSource};
use te_base::config::Env;
use te_base::device::DevicePlugin;
use te_base::error::{Error, Result};
use te_base::memory::{MemoryKind, MemoryLocation};

/// Variable that filters and orders CUDA device ordinals.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// Variable that filters and orders HIP device ordinals.
pub const HIP_VISIBLE_DEVICES: &str = "HIP_VISIBLE_DEVICES";

/// The rails chosen for one buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RailSelection {
    /// Rail indices (positions in [`Topology::nics`]); empty only when the host has no NIC.
    pub rails: Vec<usize>,
    /// Why these.
    pub source: RailSource,
}

/// Places buffers on NICs: the topology, its rail map, the policy and the GPU ordinal maps.
///
/// Built once per engine; [`rails_for`](Self::rails_for) is called once per registered buffer.
///
/// ```
/// use te_base::config::MapEnv;
/// use te_topology::{NicPlacement, Topology};
/// use te_base::MemoryLocation;
///
/// let topology = Topology::discover()?; // a host without RDMA NICs is fine
/// let placement = NicPlacement::from_env(topology, &MapEnv::new([("TE_NIC_SELECTION", "local")]))?;
/// let chosen = placement.rails_for(MemoryLocation::HOST, None)?;
/// assert!(chosen.rails.len() <= placement.topology().nics.len());
/// # Ok::<(), te_base::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct NicPlacement {
    topology: Topology,
    map: RailMap,
    policy: NicPolicy,
    matrix: Option<PriorityMatrix>,
    cuda: GpuOrdinals,
    rocm: GpuOrdinals,
}

impl NicPlacement {
    /// Placement under `policy` with ordinals in bus-id order (no visible-devices filtering). Loads
    /// and checks the priority-matrix file when the policy names one.
    pub fn new(topology: Topology, policy: NicPolicy) -> Result<NicPlacement> {
        let map = RailMap::build(&topology);
        let cuda = GpuOrdinals::bus_order(&topology.gpu_bus_ids(GpuVendor::Nvidia));
        let rocm = GpuOrdinals::bus_order(&topology.gpu_bus_ids(GpuVendor::Amd));
        let matrix = match &policy.matrix_path {
            Some(path) => {
                let matrix = PriorityMatrix::load(path)?;
                matrix
                    .check_nics(&topology)
                    .map_err(|reason| Error::config(PRIORITY_MATRIX_VAR, path.display().to_string(), reason))?;
                Some(matrix)
            }
            None => None,
        };
        Ok(NicPlacement {
            topology,
            map,
            policy,
            matrix,
            cuda,
            rocm,
        })
    }

    /// Placement under the policy read from `env` ([`NicPolicy::from_env`]), with GPU ordinals
    /// filtered by `CUDA_VISIBLE_DEVICES` / `HIP_VISIBLE_DEVICES`.
    pub fn from_env(topology: Topology, env: &dyn Env) -> Result<NicPlacement> {
        let policy = NicPolicy::from_env(env)?;
        let mut placement = NicPlacement::new(topology, policy)?;
        placement.cuda = GpuOrdinals::from_visible_devices(
            &placement.topology.gpu_bus_ids(GpuVendor::Nvidia),
            env,
            CUDA_VISIBLE_DEVICES,
        )?;
        placement.rocm = GpuOrdinals::from_visible_devices(
            &placement.topology.gpu_bus_ids(GpuVendor::Amd),
            env,
            HIP_VISIBLE_DEVICES,
        )?;
        Ok(placement)
    }

    /// The device plugin's ordinal -> bus id mapping for `kind` (`Cuda` or `Rocm`), as the runtime
    /// reports it after its visible-devices filtering. Replaces the sysfs-derived guess.
    pub fn set_gpu_ordinals(&mut self, kind: MemoryKind, bus_ids: Vec<PciAddress>) -> Result<()> {
        let ordinals = GpuOrdinals::from_runtime(bus_ids);
        match kind {
            MemoryKind::Cuda => self.cuda = ordinals,
            MemoryKind::Rocm => self.rocm = ordinals,
            MemoryKind::Host => {
                return Err(Error::WrongMemoryKind {
                    transport: "topology".into(),
                    what: "host (GPU ordinals are for cuda or rocm)".into(),
                })
            }
        }
        Ok(())
    }

    /// Takes the ordinal -> bus id mapping from a loaded device plugin (CUDA or HIP): ordinal `i` is
    /// the runtime's device `i`, after its visible-devices filtering. A bus id the plugin reports
    /// malformed is an [`Error::Transport`] naming the plugin.
    pub fn use_device_plugin(&mut self, plugin: &dyn DevicePlugin) -> Result<()> {
        let bus_ids = (0..plugin.device_count())
            .map(|device| {
                let raw = plugin.pci_bus_id(device)?;
                raw.parse::<PciAddress>()
                    .map_err(|e| Error::transport(plugin.name(), format!("device {device}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        self.set_gpu_ordinals(plugin.memory_kind(), bus_ids)
    }

    /// The rails a buffer at `location` is registered on. For host memory with no NUMA node in the
    /// location, `addr` (the buffer's first byte) is looked up with the kernel (`move_pages` /
    /// `get_mempolicy`); without it, or when the kernel cannot say, every NIC is used.
    pub fn rails_for(&self, location: MemoryLocation, addr: Option<u64>) -> Result<RailSelection> {
        if self.topology.nics.is_empty() {
            return Ok(RailSelection {
                rails: Vec::new(),
                source: RailSource::NoNics,
            });
        }
        if self.policy.selection == NicSelection::All {
            return Ok(self.all("policy is all"));
        }
        let location = match (location, addr) {
            (MemoryLocation::Host { numa: None }, Some(addr)) => match numa_node_of(addr)? {
                Some(node) => MemoryLocation::Host { numa: Some(node) },
                None => return Ok(self.all("the kernel does not report the buffer's NUMA node")),
            },
            (loc, _) => loc,
        };
        if let Some(selection) = self.matrix_rails(location) {
            return Ok(selection);
        }
        Ok(match location {
            MemoryLocation::Host { numa: None } => self.all("host buffer of unknown NUMA node"),
            MemoryLocation::Host { numa: Some(node) } => match self.map.node(node) {
                Some(n) => RailSelection {
                    rails: n.rails.clone(),
                    source: n.source.clone(),
                },
                None => self.all(&format!("NUMA node {node} is not in the topology")),
            },
            MemoryLocation::Cuda { device } => self.gpu_rails(&self.cuda, "cuda", device),
            MemoryLocation::Rocm { device } => self.gpu_rails(&self.rocm, "rocm", device),
        })
    }

    /// The placement in force as a Mooncake priority matrix: for every NUMA node and GPU ordinal,
    /// the selected rails as preferred and the other NICs as available.
    pub fn priority_matrix(&self) -> Result<PriorityMatrix> {
        let mut matrix = PriorityMatrix::default();
        if self.topology.nics.is_empty() {
            return Ok(matrix);
        }
        let mut locations: Vec<MemoryLocation> = self
            .topology
            .numa_nodes
            .iter()
            .map(|n| MemoryLocation::Host { numa: Some(n.id) })
            .collect();
        locations.extend((0..self.cuda.len() as u32).map(|device| MemoryLocation::Cuda { device }));
        locations.extend((0..self.rocm.len() as u32).map(|device| MemoryLocation::Rocm { device }));
        for location in locations {
            let Some(key) = MatrixKey::for_location(location) else {
                continue;
            };
            let chosen = self.rails_for(location, None)?.rails;
            let name = |i: usize| self.topology.nics[i].name.clone();
            matrix.insert(
                key,
                MatrixEntry {
                    preferred: chosen.iter().map(|&i| name(i)).collect(),
                    available: (0..self.topology.nics.len())
                        .filter(|i| !chosen.contains(i))
                        .map(name)
                        .collect(),
                },
            );
        }
        Ok(matrix)
    }

    /// The discovered topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The computed rail map (before policy and override).
    pub fn rail_map(&self) -> &RailMap {
        &self.map
    }

    /// The policy in force.
    pub fn policy(&self) -> &NicPolicy {
        &self.policy
    }

    /// The override matrix, if one is installed.
    pub fn matrix(&self) -> Option<&PriorityMatrix> {
        self.matrix.as_ref()
    }

    /// The CUDA ordinal map in force.
    pub fn cuda_ordinals(&self) -> &GpuOrdinals {
        &self.cuda
    }

    /// The HIP ordinal map in force.
    pub fn rocm_ordinals(&self) -> &GpuOrdinals {
        &self.rocm
    }

    /// The NIC of rail `rail`.
    pub fn nic(&self, rail: usize) -> Option<&RdmaNic> {
        self.topology.nics.get(rail)
    }

    fn all(&self, reason: &str) -> RailSelection {
        RailSelection {
            rails: self.map.all(),
            source: RailSource::All { reason: reason.into() },
        }
    }

    fn matrix_rails(&self, location: MemoryLocation) -> Option<RailSelection> {
        let key = MatrixKey::for_location(location)?;
        let entry = self.matrix.as_ref()?.get(key)?;
        let names = if entry.preferred.is_empty() {
            &entry.available
        } else {
            &entry.preferred
        };
        // Names were checked against the topology when the matrix was installed.
        let mut rails: Vec<usize> = names.iter().filter_map(|n| self.topology.nic_index(n)).collect();
        rails.sort_unstable();
        Some(RailSelection {
            rails,
            source: RailSource::Override { key: key.to_string() },
        })
    }

    fn gpu_rails(&self, ordinals: &GpuOrdinals, kind: &str, device: u32) -> RailSelection {
        let Some(bus) = ordinals.bus_id(device) else {
            return self.all(&format!("{kind}:{device} has no known PCI bus id"));
        };
        match self.map.gpu(bus) {
            Some(g) => RailSelection {
                rails: g.rails.clone(),
                source: g.source.clone(),
            },
            None => self.all(&format!("{kind}:{device} ({bus}) is not in the topology")),
        }
    }
}
