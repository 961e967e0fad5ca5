//! Batch memory registration that scales: a bounded pool of persistent workers, size-ordered
//! dispatch, all-or-nothing batch semantics, and the cap derived from the node's ranks and cores.
//! (The simulated provider calibrated from real nodes is in the `te-testkit` crate.)
//!
//! Every transport's batch registration and deregistration goes through a [`RegistrationPool`]
//! (usually [`RegistrationPool::global`]), either directly or via [`register_regions`] with a
//! [`RegistrationProvider`].
//!
//! Configuration (strict: a malformed value is an error naming the variable):
//! - `TE_MAX_CONCURRENT_REG_MR` (alias `MC_MAX_CONCURRENT_REG_MR`; both set differently is an
//!   error): registrations in flight per process; 0 = unbounded. Unset: `max(1, cores / local
//!   ranks)` when a local rank count is known (`TE_LOCAL_RANKS`, `LOCAL_WORLD_SIZE`,
//!   `OMPI_COMM_WORLD_LOCAL_SIZE`, `SLURM_NTASKS_PER_NODE`), cores being what the affinity mask and
//!   cgroup quota allow; unbounded otherwise. See [`CapDecision`].
//! - `TE_REG_ORDER=ascending|descending|given`: dispatch order; ascending by default when capped.

pub mod config;
pub mod cpus;
pub mod item;
pub mod order;
pub mod pool;
pub mod provider;

pub use config::{CapDecision, CapSource, RegistrationConfig, CAP_ALIAS, CAP_VAR, LOCAL_RANK_VARS, ORDER_VAR};
pub use cpus::CpuBudget;
pub use item::RegistrationItem;
pub use order::RegOrder;
pub use pool::{RegistrationPool, UNBOUNDED_WORKER_CEILING};
pub use provider::{deregister_regions, register_regions, DomainHandles, RegistrationProvider};
