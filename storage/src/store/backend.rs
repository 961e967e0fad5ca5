//! What a mode is: one [`Backend`], built once from [`crate::config::ModeConfig`] when the store
//! opens. [`crate::Store`] checks that it is open and forwards; the standalone server serves the
//! same trait object. Local and distributed mode are a core in this process with a layer over it
//! ([`super::over_core`]); standalone mode is a client of the node's server
//! ([`super::standalone_client`]).

use std::any::Any;

use te_base::PhaseReport;
use te_core::TransferEngine;

use super::StoreStats;
use crate::core::{RangedGet, RangedPut, Resolved};
use crate::error::Result;
use crate::standalone::KvBuffer;

/// Caller memory to register, with what keeps it alive (if the store is to hold that).
pub(crate) struct CallerMemory {
    pub addr: u64,
    pub len: u64,
    pub owner: Option<Box<dyn Any + Send + Sync>>,
}

impl CallerMemory {
    /// # Safety
    ///
    /// `[addr, addr + len)` must be host memory that stays valid until it is deregistered (or the
    /// store closed) and, with an `owner`, while the owner is alive; the caller must not read bytes
    /// a running get writes into, nor change bytes a running put reads
    /// ([`crate::Store::register_buffer`]'s contract).
    pub unsafe fn new(addr: u64, len: u64, owner: Option<Box<dyn Any + Send + Sync>>) -> Self {
        CallerMemory { addr, len, owner }
    }
}

/// The store's calls as one mode carries them out. The open check is the caller's
/// ([`crate::Store`] makes it where its documentation says so).
#[async_trait::async_trait]
pub(crate) trait Backend: Send + Sync {
    /// [`crate::StoreError::Closed`] once closed.
    fn check_open(&self) -> Result<()>;
    fn engine(&self) -> &TransferEngine;
    fn is_standalone(&self) -> bool {
        false
    }
    fn alloc_buffer(&self, len: usize) -> Result<KvBuffer>;
    async fn free_buffer(&self, buf: KvBuffer) -> Result<()>;
    fn key_handle_report(&self) -> Option<(Option<String>, u64, u64)> {
        None
    }
    async fn register_buffer(&self, memory: CallerMemory) -> Result<()>;
    async fn deregister_buffer(&self, addr: u64) -> Result<bool>;
    fn exists(&self, key: &str) -> Result<bool>;
    fn batch_exists_consecutive(&self, keys: &[&str]) -> Result<usize>;
    fn remove(&self, key: &str) -> Result<bool>;
    fn batch_get(&self, items: &[(&str, u64, u64)]) -> Result<Vec<Result<u64>>>;
    fn object_lens(&self, keys: &[&str]) -> Result<Vec<Option<u64>>>;
    async fn put(&self, key: &str, data: &[u8], depth: u32) -> Result<()>;
    async fn get(&self, key: &str) -> Result<Vec<u8>>;
    fn compact(&self, force: bool) -> Result<u64>;
    fn flush(&self) -> Result<()>;
    async fn close(&self) -> Result<()>;
    fn stats(&self) -> Result<StoreStats>;
    fn phase_report(&self) -> Result<Option<PhaseReport>>;
    fn reset_phase_report(&self) -> Result<()>;
    /// With `resolved`, reuses (and refreshes) what was resolved for this key set before (the
    /// standalone server's key handles); a mode without a local core ignores it.
    fn batch_get_ranges(&self, items: &[RangedGet<'_>], resolved: Option<&mut Resolved>) -> Result<Vec<Result<u64>>>;
    fn batch_put_ranges(&self, items: &[RangedPut<'_>]) -> Result<Vec<Result<()>>>;
    /// The cluster peer, in distributed mode.
    #[cfg(feature = "cluster")]
    fn cluster(&self) -> Option<&crate::cluster::Peer> {
        None
    }
}
