//! What the parent tells each rank process, and what the rank answers. One JSON line each way.

use serde::{Deserialize, Serialize};
use te_base::registration::{RegOrder, SimConfig, SimCostModel};

/// The providers the benchmark knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TransportChoice {
    /// The simulated provider (cost model calibrated on p5.48xlarge).
    Sim,
    /// libfabric / EFA memory registration.
    Efa,
    /// RDMA verbs memory registration.
    Rdma,
}

impl TransportChoice {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Sim => "sim",
            TransportChoice::Efa => "efa",
            TransportChoice::Rdma => "rdma",
        }
    }
}

/// Where the replayed buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LocationChoice {
    /// Host memory.
    Host,
    /// CUDA device memory (rank r uses device r).
    Cuda,
}

/// Serializable mirror of [`SimCostModel`].
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct SimSpec {
    pub scale: f64,
    pub host_base_ms: f64,
    pub host_ms_per_gib: f64,
    pub device_base_ms: f64,
    pub device_ms_per_gib: f64,
    pub device_ms_per_prior_gib: f64,
    pub locked_fraction: f64,
}

impl SimSpec {
    /// The provider configuration for `domains` domains.
    pub fn config(&self, domains: usize) -> SimConfig {
        SimConfig {
            model: SimCostModel {
                host_base_ms: self.host_base_ms,
                host_ms_per_gib: self.host_ms_per_gib,
                device_base_ms: self.device_base_ms,
                device_ms_per_gib: self.device_ms_per_gib,
                device_ms_per_prior_gib: self.device_ms_per_prior_gib,
                locked_fraction: self.locked_fraction,
            },
            domains,
            scale: self.scale,
        }
    }
}

/// One rank's job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankSpec {
    pub rank: usize,
    pub transport: TransportChoice,
    pub location: LocationChoice,
    /// Buffer sizes in the order the server passes them.
    pub sizes: Vec<u64>,
    /// Domains (NICs) each buffer lands on.
    pub domains: usize,
    /// Per-process cap; 0 = unbounded.
    pub cap: usize,
    pub order: String,
    /// CPUs every rank is restricted to (one shared set), if any.
    pub cpus: Option<Vec<u32>>,
    pub sim: SimSpec,
}

impl RankSpec {
    /// The dispatch order.
    pub fn order(&self) -> Result<RegOrder, String> {
        self.order.parse()
    }
}

/// One rank's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankResult {
    pub rank: usize,
    /// Wall seconds from the start signal until the whole batch was registered.
    pub wall_s: f64,
    /// Node seconds of modelled work (sim only).
    pub work_node_s: f64,
}
