//! Same-host transport: two processes on one host move bytes with one copy, by the kernel's
//! cross-memory attach (`process_vm_writev` / `process_vm_readv`), instead of through the TCP
//! stack.
//!
//! - Every engine binds a Unix control socket (`TE_SHM_SOCKET`, default an abstract name) and
//!   advertises its host identity (boot id, pid namespace), pid, uid, socket and a random
//!   instance token in its segment descriptor. Only engines with the same identity reach it.
//! - `connect` opens the control socket, checks the kernel's peer credentials (`SO_PEERCRED`:
//!   the pid the descriptor names, our uid or one of `TE_SHM_ALLOW_UIDS`), proves the shared key
//!   when one is configured, learns the target's exported ranges and reads one probe byte from it
//!   by `process_vm_readv`. If any of this is not permitted the connect fails with
//!   `NotAvailable` and the reason (logged once), and the engine carries the peer on its next
//!   route (tcp).
//! - Memory the engine allocated is a sealed memfd (`TE_SHM_MEMFD`, default on): the target
//!   sends each exported one once over the control socket (`SCM_RIGHTS`), the initiator checks
//!   its seals, maps it shared and copies into it with the local transport's kernels. Other
//!   memory (`register_raw`) goes by cross-memory attach; the route is chosen per region.
//! - A batch is copied with one system call per up to 1,024 requests of one direction (adjacent
//!   ones coalesced) on the submitting thread, or, when larger than `TE_SHM_INLINE_BYTES`, cut
//!   into ~1 MiB chunks that the copy threads (`TE_SHM_COPY_THREADS`, default 2) and, up to
//!   256 MiB, the submitting thread claim one at a time. Each request is checked against the descriptor, the local
//!   registrations and the target's live export list.
//! - Deregistration on the target is pushed to every connected initiator and returns once each
//!   confirmed it (copies in flight on it finish first) or was cut at `TE_SHM_TIMEOUT_MS`.
//! - Notifications travel on the control socket after the batch they follow.
//! - A target process that exits is known by a copy's ESRCH (the kernel detaches a killed
//!   process's memory long before it closes its sockets), its pidfd, or a control hang-up with
//!   ESRCH on the probe byte: what is left of its batches fails at once and for good, not over
//!   to tcp, which reaches the same dead process.
//!
//! See `docs/shm.md` for the design, the measurements and the trust model.

mod cma;
mod config;
mod connection;
mod endpoint;
mod peer;
mod serve;
mod socket;
mod transport;
pub mod wire;

pub use cma::PtraceScope;
pub use config::{ShmConfig, DEFAULT_PTRACE_SCOPE_FILE, ENV_VARS};
pub use endpoint::{HostIdentity, ShmEndpoint};
pub use transport::{install, RouteCounters, ShmTransport};

/// Whether the engine should allocate host memory as sealed memfds for this transport
/// (`TE_SHM_MEMFD`, default on): te-core's `allocate` asks this when the shm transport runs.
pub fn memfd_allocation(env: &dyn te_base::config::Env) -> te_base::Result<bool> {
    Ok(te_base::config::parse_bool(env, config::MEMFD_VAR)?.unwrap_or(true))
}

/// The shm transport as te-core lists it.
pub const DESCRIPTOR: te_base::TransportDescriptor = te_base::TransportDescriptor {
    name: "shm",
    reach: te_base::Reach::SameHost,
    env_vars: ENV_VARS,
    check_env: |env| ShmConfig::from_env(env).map(drop),
    install: |ctx| Box::pin(install(ctx)),
};
