//! Local and distributed mode: a store core in this process, and a [`Layer`] over it that says
//! what the mode changes. Local mode changes nothing; a cluster peer reads missed keys from their
//! owners, places overflow on other peers, and leaves the directory on remove and close
//! ([`super::cluster_layer`]).

use std::sync::Arc;

use te_base::PhaseReport;
use te_core::TransferEngine;

use super::backend::{Backend, CallerMemory};
use super::{blocking, StoreStats};
use crate::core::hooks::{NoMisses, NoOverflow};
use crate::core::{whole_object_puts, whole_object_ranges, Core, RangedGet, RangedPut, Resolved};
use crate::error::{Result, StoreError};
use crate::standalone::KvBuffer;

/// What a mode over an in-process core changes; the defaults are the core's own calls.
#[async_trait::async_trait]
pub(crate) trait Layer: Send + Sync {
    fn core(&self) -> &Arc<Core>;
    /// Whether the core's copies may be read now (a cluster peer: while its lease stands).
    fn check_local_reads(&self) -> Result<()> {
        Ok(())
    }
    fn remove(&self, key: &str) -> Result<bool> {
        self.core().remove(key)
    }
    fn batch_get_ranges(&self, items: &[RangedGet<'_>], resolved: Option<&mut Resolved>) -> Result<Vec<Result<u64>>> {
        self.core().batch_get_ranges(items, resolved, &mut NoMisses)
    }
    fn batch_put_ranges(&self, items: &[RangedPut<'_>]) -> Result<Vec<Result<()>>> {
        self.core().batch_put_ranges(items, &mut NoOverflow)
    }
    async fn close(&self) -> Result<()> {
        self.core().close().await.map(|_| ())
    }
    fn stats(&self) -> StoreStats {
        StoreStats {
            core: self.core().stats(),
            ..Default::default()
        }
    }
    /// The cluster peer, when the layer is one.
    #[cfg(feature = "cluster")]
    fn cluster(&self) -> Option<&crate::cluster::Peer> {
        None
    }
}

/// Local mode: the core alone.
pub(crate) struct Local(pub Arc<Core>);

impl Layer for Local {
    fn core(&self) -> &Arc<Core> {
        &self.0
    }
}

/// A mode made of a core and a layer over it.
pub(crate) struct OverCore<L>(pub L);

impl<L: Layer> OverCore<L> {
    fn core(&self) -> &Core {
        self.0.core()
    }
}

#[async_trait::async_trait]
impl<L: Layer> Backend for OverCore<L> {
    fn check_open(&self) -> Result<()> {
        self.core().check_open()
    }

    fn engine(&self) -> &TransferEngine {
        self.core().engine()
    }

    fn alloc_buffer(&self, len: usize) -> Result<KvBuffer> {
        KvBuffer::new(len)
    }

    async fn free_buffer(&self, buf: KvBuffer) -> Result<()> {
        self.core().deregister_buffer(buf.addr()).await.map(|_| ())
    }

    async fn register_buffer(&self, m: CallerMemory) -> Result<()> {
        // SAFETY: a CallerMemory is made only under register_buffer's contract.
        unsafe { self.core().register_buffer(m.addr, m.len, m.owner) }.await
    }

    async fn deregister_buffer(&self, addr: u64) -> Result<bool> {
        self.core().deregister_buffer(addr).await
    }

    fn exists(&self, key: &str) -> Result<bool> {
        self.0.check_local_reads()?;
        self.core().exists(key)
    }

    fn batch_exists_consecutive(&self, keys: &[&str]) -> Result<usize> {
        self.0.check_local_reads()?;
        self.core().batch_exists_consecutive(keys)
    }

    fn remove(&self, key: &str) -> Result<bool> {
        self.0.remove(key)
    }

    fn batch_get(&self, items: &[(&str, u64, u64)]) -> Result<Vec<Result<u64>>> {
        self.0.check_local_reads()?;
        self.core().batch_get(items)
    }

    fn object_lens(&self, keys: &[&str]) -> Result<Vec<Option<u64>>> {
        self.0.check_local_reads()?;
        self.core().object_lens(keys.iter().copied())
    }

    async fn put(&self, key: &str, data: &[u8], depth: u32) -> Result<()> {
        let addr = data.as_ptr() as u64;
        let len = data.len() as u64;
        if len == 0 {
            return Err(StoreError::ZeroLength {
                key_index: 0,
                range_index: 0,
            });
        }
        let core = self.core();
        let temp = core.temp_register(addr, len).await?;
        let items = [(key, addr, len, depth)];
        let out = blocking::off_worker(|| {
            let ranges = whole_object_ranges(&items);
            self.batch_put_ranges(&whole_object_puts(&items, &ranges))
        });
        core.temp_release(temp).await?;
        out?.remove(0)
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.0.check_local_reads()?;
        let core = self.core();
        let Some(mut len) = core.object_lens(std::iter::once(key))?[0] else {
            return Err(StoreError::NotFound { key: key.to_owned() });
        };
        // The object may be replaced by a larger one between the size lookup and the read: retry
        // with the new size a bounded number of times.
        for _ in 0..8 {
            let mut out = vec![0u8; len.max(1) as usize];
            let addr = out.as_mut_ptr() as u64;
            let temp = core.temp_register(addr, out.len() as u64).await?;
            let got = blocking::off_worker(|| core.batch_get(&[(key, addr, out.len() as u64)]));
            core.temp_release(temp).await?;
            match got?.remove(0) {
                Ok(n) => {
                    out.truncate(n as usize);
                    return Ok(out);
                }
                Err(StoreError::BufferTooSmall { need, .. }) => len = need,
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::WriteConflict { key: key.to_owned() })
    }

    fn compact(&self, force: bool) -> Result<u64> {
        self.core().compact(force)
    }

    fn flush(&self) -> Result<()> {
        self.core().flush()
    }

    async fn close(&self) -> Result<()> {
        self.0.close().await
    }

    fn stats(&self) -> Result<StoreStats> {
        Ok(self.0.stats())
    }

    fn phase_report(&self) -> Result<Option<PhaseReport>> {
        Ok(self.core().phase_report())
    }

    fn reset_phase_report(&self) -> Result<()> {
        self.core().reset_phase_report();
        Ok(())
    }

    fn batch_get_ranges(&self, items: &[RangedGet<'_>], resolved: Option<&mut Resolved>) -> Result<Vec<Result<u64>>> {
        self.0.batch_get_ranges(items, resolved)
    }

    fn batch_put_ranges(&self, items: &[RangedPut<'_>]) -> Result<Vec<Result<()>>> {
        self.0.batch_put_ranges(items)
    }

    #[cfg(feature = "cluster")]
    fn cluster(&self) -> Option<&crate::cluster::Peer> {
        self.0.cluster()
    }
}
