//! The local-copy transport: memory to memory between segments of one process, host memory by the
//! CPU and device memory through the device plugins the engine loaded.
//!
//! Built as the seed's fixed design. One [`Peer::submit`](te_base::Peer::submit) handles a whole
//! batch:
//! - **Resolve** every request under one read lock of each region table (sorted by base, binary
//!   search, last region remembered): the local side in the initiator's own table by region id
//!   and address, the remote side in the *target's live* table. A remote range that is not inside
//!   one registered, exported region fails with `Error::OutOfBounds` and is never served; the
//!   other requests of the batch go on. The locks are held until the copies are done, so a region
//!   cannot be deregistered (and freed) under a copy.
//! - **Run in request order** while the batch stays on the submitting thread: each request is
//!   resolved and copied at once, consecutive contiguous requests merged into one copy, without
//!   sorting and without any overlap check, since running requests one after another in index
//!   order is already the promised outcome (see below). Sorting would not pay here: it costs more
//!   per fragment than the memcpy calls it could merge away.
//! - **Plan** the rest of a large batch once a copy helper is awake (checked every 256
//!   requests): order it by destination (a radix sort of compact keys; already sorted batches
//!   cost one pass), prove that no two destinations overlap and no source meets a destination,
//!   coalesce exactly adjacent fragments — source and destination both contiguous — into one
//!   copy, and cut the copies into parts of equal bytes for the helpers. Batches with device
//!   requests, and batches not in ascending request index, are planned whole.
//! - **Copy** with non-temporal stores (AVX-512, AVX2 or SSE2, detected at run time; an ordinary
//!   copy elsewhere) for copies of `TE_NT_COPY_MIN_BYTES` (2 KiB) and more, an ordinary `memcpy`
//!   below, prefetching the start of the next copy while one runs, and one store fence per worker
//!   at the end.
//! - **Fan out** over a persistent pool of `TE_COPY_THREADS - 1` helpers (the submitting thread
//!   works too; 1 means inline) batches of `TE_COPY_FANOUT_MIN_BYTES` (4 MiB) and more. Helpers
//!   are told when the batch arrives, and the rest of the batch is shared only with a helper that
//!   is already awake ([`LocalConfig::fanout_needs_awake_helper`]), so a batch never waits for a
//!   helper that cannot get a core. Background submissions stay inline.
//! - **Complete** the batch once: failures by index, then one counter update for the rest.
//!
//! Phase timings go to `Phase::Plan` (taking the locks; resolving and planning a planned batch)
//! and `Phase::Submit` (the copies, and the resolution interleaved with them in request order)
//! when the caller's timer is on; when it is off the clock is never read. Nothing is allocated per
//! fragment: planning vectors are per-thread scratch reused from batch to batch.
//!
//! # Requests that touch the same memory
//!
//! Requests of one batch are unordered, as on any transport. When two requests write the same
//! destination bytes, or one reads bytes another writes (a segment copying within its own
//! memory), the outcome is exactly that of the requests run one after another in ascending
//! request index, each with `memmove` semantics, so a request may even copy onto an overlapping
//! range of itself; there is never a data race. The request-order path gives that by
//! construction (a copy that overlaps itself uses `memmove` and no streaming stores); the planner
//! detects such a batch and, instead of coalescing or splitting it, runs it the same way on the
//! submitting thread without streaming stores.
//!
//! # Device memory
//!
//! [`install`] takes the engine's loaded device plugins (`InstallContext::devices`); each memory
//! kind with a plugin (CUDA, ROCm) is advertised in the capabilities, local and remote. A request
//! whose source or destination region was registered as device memory (the location the engine
//! classified once, at registration; the data path never asks a driver) goes to that plugin:
//! - per batch, device requests are grouped by (plugin, direction, device) — the device side of a
//!   host<->device copy, the source device of a device->device copy — sorted by destination and
//!   coalesced like host fragments;
//! - each group is one `copy_async` call with all its fragments (the plugin turns that into one
//!   batched driver call where the driver has one), started before the host part of the batch is
//!   copied, then waited on by the submitting thread with the region locks still held, so the batch
//!   is complete when `submit` returns as for host memory;
//! - a plugin error fails the requests of its group only.
//!
//! A batch whose requests touch the same memory (see above) runs request by request in index
//! order, device requests through the plugin's synchronous copy; a device request whose own
//! source and destination overlap fails (device copies have no `memmove` semantics). A device
//! region of a kind with no plugin fails its requests with `Error::WrongMemoryKind`, naming the
//! plugin that is not loaded, and device->device between two runtimes is refused the same way.
//! Host-to-host batches take exactly the path described above.
//!
//! The engine installs the transport with [`install`]; [`copy`], [`plan`] and [`parts`] are
//! public for the benchmarks.

pub mod config;
pub mod copy;
mod device;
mod domain;
mod notify;
pub mod parts;
mod peer;
pub mod plan;
mod pool;
mod resolve;
mod sequential;
mod shared;
mod table;
mod transport;

use std::sync::Arc;

pub use config::LocalConfig;
pub use copy::NtKernel;
pub use domain::LocalEndpoint;
pub use transport::LocalTransport;

/// The transport's name in descriptors and reports.
pub const NAME: &str = "local";

/// Creates the local-copy transport from the engine's configuration (`TE_COPY_THREADS`,
/// `TE_NT_COPY_MIN_BYTES`), serving device memory through `ctx.devices`. Fails only on malformed
/// configuration or if a helper thread cannot be started; the local copy is usable on every host.
pub async fn install(ctx: &te_base::InstallContext) -> te_base::Result<Arc<dyn te_base::Transport>> {
    let config = LocalConfig::from_env(&*ctx.env)?;
    Ok(Arc::new(LocalTransport::with_inbox(
        config,
        NtKernel::detect(),
        &ctx.devices,
        ctx.notifications.clone(),
    )?))
}

/// The local copy as te-core lists it.
pub const DESCRIPTOR: te_base::TransportDescriptor = te_base::TransportDescriptor {
    name: NAME,
    reach: te_base::Reach::InProcess,
    env_vars: config::ENV_VARS,
    check_env: |env| LocalConfig::from_env(env).map(drop),
    install: |ctx| Box::pin(install(ctx)),
};
