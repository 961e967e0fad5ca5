//! What the parent tells each rank process, and what the rank answers. One JSON line each way.

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use te_base::registration::RegOrder;
use te_testkit::{NodeLoad, SimConfig, SimCostModel};

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
    /// The local copy transport (registration is a table entry).
    Local,
    /// The TCP transport.
    Tcp,
}

impl TransportChoice {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Sim => "sim",
            TransportChoice::Efa => "efa",
            TransportChoice::Rdma => "rdma",
            TransportChoice::Local => "local",
            TransportChoice::Tcp => "tcp",
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
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimSpec {
    pub scale: f64,
    pub host_base_ms: f64,
    pub host_ms_per_gib: f64,
    pub device_base_ms: f64,
    pub device_ms_per_gib: f64,
    pub device_ms_per_prior_gib: f64,
    pub oversubscription_penalty: f64,
    /// Cores the ranks share (the penalty's reference).
    pub cores: usize,
    /// Shared counter of registrations in flight across ranks.
    pub node_load_path: String,
}

impl SimSpec {
    /// The provider configuration for `domains` domains, counting load in the shared file.
    pub fn config(&self, domains: usize) -> Result<SimConfig, String> {
        let load = NodeLoad::open(Path::new(&self.node_load_path)).map_err(|e| e.to_string())?;
        Ok(SimConfig {
            model: SimCostModel {
                host_base_ms: self.host_base_ms,
                host_ms_per_gib: self.host_ms_per_gib,
                device_base_ms: self.device_base_ms,
                device_ms_per_gib: self.device_ms_per_gib,
                device_ms_per_prior_gib: self.device_ms_per_prior_gib,
                oversubscription_penalty: self.oversubscription_penalty,
            },
            domains,
            scale: self.scale,
            cores: self.cores,
            node_load: Some(Arc::new(load)),
        })
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
