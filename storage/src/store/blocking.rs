//! Running the store's blocking batch calls from its `async` methods.
//!
//! The batch API (`batch_put`, `batch_get`, ...) blocks its caller until the transfers and the
//! tier I/O are done, which in standalone or distributed mode includes a socket round trip or a
//! remote read bounded only by the configured timeout. Called from a tokio worker, that would stall
//! every other task queued on it. `Store::put` and `Store::get` therefore run the blocking part
//! through [`off_worker`].

use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs `f`, which may block, without stalling the runtime's other tasks. On a multi-thread
/// runtime the calling worker hands its queued tasks to a fresh worker for the duration
/// (`tokio::task::block_in_place`), so the rest of the runtime keeps running. A current-thread
/// runtime has no other thread to hand them to, and `f` runs inline there (documented on the
/// async methods); outside a runtime `f` just runs.
pub(crate) fn off_worker<T>(f: impl FnOnce() -> T) -> T {
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}
