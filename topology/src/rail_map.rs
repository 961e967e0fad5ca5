//! The rail map: which NICs are local to each GPU and to each NUMA node.
//!
//! A GPU's rails are the NICs under its nearest PCI ancestor (switch port, root port or root bus)
//! that has any NIC below it. When several GPUs pick the same ancestor, its NICs are split among
//! them in bus-id order, in contiguous runs, so that each GPU gets its own rails (4 of 32 on
//! p5.48xlarge) or, with fewer NICs than GPUs, GPUs share (one NIC per GPU pair on p4d.24xlarge).
//! A GPU with no NIC in its PCI subtree falls back to the NICs on its NUMA node, then to all NICs.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use super::discovery::Topology;
use super::pci::{PciAddress, PciAncestor};

/// Why a buffer got the rails it got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "source", rename_all = "snake_case")]
pub enum RailSource {
    /// NICs under the nearest PCI ancestor shared with the GPU, split among `sharing` GPUs.
    PciLocal {
        /// The ancestor (`0000:4c:01.0`, `pci0000:10`).
        ancestor: String,
        /// How many GPUs split that ancestor's NICs.
        sharing: usize,
    },
    /// NICs on the same NUMA node.
    SameNuma {
        /// The node.
        node: u32,
    },
    /// Every NIC: the policy is `all`, or nothing more local exists.
    All {
        /// Why every NIC was chosen.
        reason: String,
    },
    /// The operator's priority-matrix file named the rails.
    Override {
        /// The matrix key (`cuda:0`, `cpu:1`).
        key: String,
    },
    /// The host has no RDMA NIC.
    NoNics,
}

impl fmt::Display for RailSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RailSource::PciLocal { ancestor, sharing } => {
                write!(f, "pci-local under {ancestor}")?;
                if *sharing > 1 {
                    write!(f, " (split among {sharing} GPUs)")?;
                }
                Ok(())
            }
            RailSource::SameNuma { node } => write!(f, "same NUMA node {node}"),
            RailSource::All { reason } => write!(f, "all NICs ({reason})"),
            RailSource::Override { key } => write!(f, "override file entry {key}"),
            RailSource::NoNics => f.write_str("no RDMA NIC"),
        }
    }
}

/// The rails of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuRails {
    /// The GPU's bus id.
    pub gpu: PciAddress,
    /// Rail indices (positions in [`Topology::nics`]), ascending.
    pub rails: Vec<usize>,
    /// Why.
    pub source: RailSource,
}

/// The rails of host memory on one NUMA node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeRails {
    /// The NUMA node.
    pub node: u32,
    /// Rail indices, ascending.
    pub rails: Vec<usize>,
    /// Why.
    pub source: RailSource,
}

/// Local rails of every GPU and NUMA node of one host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RailMap {
    /// One entry per GPU, by bus id.
    pub gpus: Vec<GpuRails>,
    /// One entry per NUMA node, ascending.
    pub nodes: Vec<NodeRails>,
    /// Number of NICs (rails) on the host.
    pub nic_count: usize,
}

impl RailMap {
    /// Computes the map of `topology`. Pure and deterministic.
    pub fn build(topology: &Topology) -> RailMap {
        let nic_count = topology.nics.len();
        let all: Vec<usize> = (0..nic_count).collect();
        let on_node = |node: Option<u32>| -> Vec<usize> {
            match node {
                Some(n) => (0..nic_count).filter(|&i| topology.nics[i].numa == Some(n)).collect(),
                None => Vec::new(),
            }
        };

        // Nearest ancestor with NICs below it, per GPU.
        let mut by_ancestor: BTreeMap<PciAncestor, (Vec<usize>, Vec<usize>)> = BTreeMap::new();
        let mut gpu_rails: Vec<Option<GpuRails>> = vec![None; topology.gpus.len()];
        for (gi, gpu) in topology.gpus.iter().enumerate() {
            let found = gpu.pci.ancestors().find_map(|anc| {
                let nics: Vec<usize> = (0..nic_count)
                    .filter(|&i| topology.nics[i].pci.as_ref().is_some_and(|p| p.is_below(&anc)))
                    .collect();
                (!nics.is_empty()).then_some((anc, nics))
            });
            match found {
                Some((anc, nics)) => by_ancestor.entry(anc).or_insert_with(|| (nics, Vec::new())).1.push(gi),
                None => {
                    let local = on_node(gpu.numa);
                    gpu_rails[gi] = Some(if !local.is_empty() {
                        GpuRails {
                            gpu: gpu.bus_id(),
                            rails: local,
                            source: RailSource::SameNuma {
                                node: gpu.numa.unwrap_or_default(),
                            },
                        }
                    } else if nic_count > 0 {
                        GpuRails {
                            gpu: gpu.bus_id(),
                            rails: all.clone(),
                            source: RailSource::All {
                                reason: "no NIC in the GPU's PCI subtree or on its NUMA node".into(),
                            },
                        }
                    } else {
                        GpuRails {
                            gpu: gpu.bus_id(),
                            rails: Vec::new(),
                            source: RailSource::NoNics,
                        }
                    });
                }
            }
        }
        for (anc, (nics, mut gpus)) in by_ancestor {
            // GPU indices follow bus-id order already; sort anyway so the split never depends on it.
            gpus.sort_by_key(|&g| topology.gpus[g].bus_id());
            for (pos, &gi) in gpus.iter().enumerate() {
                gpu_rails[gi] = Some(GpuRails {
                    gpu: topology.gpus[gi].bus_id(),
                    rails: split_share(&nics, pos, gpus.len()).to_vec(),
                    source: RailSource::PciLocal {
                        ancestor: anc.to_string(),
                        sharing: gpus.len(),
                    },
                });
            }
        }

        let nodes = topology
            .numa_nodes
            .iter()
            .map(|n| {
                let local = on_node(Some(n.id));
                if !local.is_empty() {
                    NodeRails {
                        node: n.id,
                        rails: local,
                        source: RailSource::SameNuma { node: n.id },
                    }
                } else {
                    NodeRails {
                        node: n.id,
                        rails: all.clone(),
                        source: if nic_count == 0 {
                            RailSource::NoNics
                        } else {
                            RailSource::All {
                                reason: format!("no NIC on NUMA node {}", n.id),
                            }
                        },
                    }
                }
            })
            .collect();

        RailMap {
            gpus: gpu_rails.into_iter().flatten().collect(),
            nodes,
            nic_count,
        }
    }

    /// The rails of the GPU with this bus id.
    pub fn gpu(&self, bus_id: PciAddress) -> Option<&GpuRails> {
        self.gpus.iter().find(|g| g.gpu == bus_id)
    }

    /// The rails of host memory on NUMA node `node`.
    pub fn node(&self, node: u32) -> Option<&NodeRails> {
        self.nodes.iter().find(|n| n.node == node)
    }

    /// Every rail, ascending.
    pub fn all(&self) -> Vec<usize> {
        (0..self.nic_count).collect()
    }
}

/// The share of `nics` for the GPU at position `pos` of `sharing` GPUs: a contiguous run when there
/// are at least as many NICs as GPUs, else one NIC shared by neighbouring GPUs.
fn split_share(nics: &[usize], pos: usize, sharing: usize) -> &[usize] {
    let n = nics.len();
    if n >= sharing {
        &nics[pos * n / sharing..(pos + 1) * n / sharing]
    } else {
        let i = pos * n / sharing;
        &nics[i..i + 1]
    }
}

#[cfg(test)]
mod tests {
    use super::split_share;

    #[test]
    fn shares_are_even_and_cover_every_nic() {
        let nics: Vec<usize> = (0..8).collect();
        assert_eq!(split_share(&nics, 0, 2), &[0, 1, 2, 3]);
        assert_eq!(split_share(&nics, 1, 2), &[4, 5, 6, 7]);
        let three: Vec<usize> = (0..3).collect();
        assert_eq!(split_share(&three, 0, 2), &[0]);
        assert_eq!(split_share(&three, 1, 2), &[1, 2]);
        let one = [7];
        assert_eq!(split_share(&one, 0, 2), &[7]);
        assert_eq!(split_share(&one, 1, 2), &[7]);
        let two = [0, 1];
        let shares: Vec<&[usize]> = (0..4).map(|p| split_share(&two, p, 4)).collect();
        assert_eq!(shares, [&[0][..], &[0], &[1], &[1]]);
    }
}
