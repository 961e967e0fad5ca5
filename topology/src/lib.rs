//! Topology discovery and rail-local NIC selection, for the transports that bind to NICs (rdma,
//! efa), the engine's settings check and `te-bench topology`. A crate of its own so that te-base
//! stays what every transport needs.
//!
//! Registering a buffer costs time per NIC (per libfabric domain), and on EFA that cost grows with
//! the bytes already registered on the domain. Registering every GPU buffer on all 32 NICs of a
//! p5.48xlarge took 123.7 s for 48 x 391 MB buffers against 17.6 s on the GPU's 4 local rails. So
//! the engine registers each buffer only on the NICs its policy selects:
//!
//! - [`Topology`] reads the host from sysfs (root configurable): RDMA/EFA NICs with ports, rates
//!   and link layer, network interfaces, GPUs, NUMA nodes and their CPUs, and each device's PCI
//!   path.
//! - [`RailMap`] computes the local rails of every GPU (the NICs under its nearest PCI switch,
//!   split among the GPUs sharing it) and of every NUMA node.
//! - [`NicPolicy`] reads `TE_NIC_SELECTION=local|all` (alias `MC_EFA_NIC_SELECTION`),
//!   `TE_NIC_PRIORITY_MATRIX` (a Mooncake priority-matrix file, see [`PriorityMatrix`]) and
//!   `TE_STRIPE_MIN_BYTES`.
//! - [`NicPlacement`] answers "which rails does this buffer go on" ([`NicPlacement::rails_for`]),
//!   looking up the NUMA node of host memory with the kernel ([`numa_node_of`]).
//! - [`StripePlanner`] splits a large transfer across the rails both sides registered on, by link
//!   rate.
//! - [`BufferRails`] is the validated rail list a segment descriptor carries for each buffer.

mod buffer_rails;
mod cpulist;
mod discovery;
mod gpu_ordinals;
mod numa_lookup;
mod pci;
mod placement;
mod policy;
mod priority_matrix;
mod rail_map;
mod rail_placement;
mod striping;

pub use buffer_rails::{BufferRails, MAX_RAILS_PER_BUFFER};
pub use cpulist::CpuList;
pub use discovery::{
    Gpu, GpuVendor, NetInterface, NicKind, NumaNode, RdmaNic, RdmaPort, Topology, VENDOR_AMD, VENDOR_NVIDIA,
};
pub use gpu_ordinals::{GpuOrdinals, OrdinalOrigin};
pub use numa_lookup::{node_via_get_mempolicy, node_via_move_pages, numa_node_of};
pub use pci::{PciAddress, PciAncestor, PciPath};
pub use placement::{NicPlacement, RailSelection, CUDA_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES};
pub use policy::{
    NicPolicy, NicSelection, DEFAULT_STRIPE_MIN_BYTES, NIC_SELECTION_ALIAS, NIC_SELECTION_VAR, PRIORITY_MATRIX_VAR,
    STRIPE_MIN_BYTES_VAR,
};
pub use priority_matrix::{MatrixEntry, MatrixKey, PriorityMatrix};
pub use rail_map::{GpuRails, NodeRails, RailMap, RailSource};
pub use rail_placement::RailPlacement;
pub use striping::{common_rails, RailRate, Stripe, StripePlanner};

/// The variables this crate reads ([`NicPolicy::from_env`]).
pub const ENV_VARS: &[&str] = &[
    NIC_SELECTION_VAR,
    NIC_SELECTION_ALIAS,
    PRIORITY_MATRIX_VAR,
    STRIPE_MIN_BYTES_VAR,
];
