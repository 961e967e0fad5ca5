//! Standalone mode: a client of the node's `umbp-server`, which owns the tiers; this process
//! keeps a local-copy engine only for [`crate::Store::engine`].

use std::sync::atomic::{AtomicBool, Ordering};

use te_base::PhaseReport;
use te_core::TransferEngine;

use super::backend::{Backend, CallerMemory};
use super::{blocking, local_engine, StoreStats};
use crate::core::{check_keys, RangedGet, RangedPut, Resolved};
use crate::error::{Result, StoreError};
use crate::standalone::client::Client;
use crate::standalone::config::StandaloneConfig;
use crate::standalone::KvBuffer;

/// A standalone worker's side: the client, and the engine `Store::engine` hands out.
pub(crate) struct Standalone {
    client: Client,
    engine: TransferEngine,
    closed: AtomicBool,
    /// What keeps each registered buffer's memory alive (`Store::register_buffer_owned`), by
    /// base, until it is deregistered. The server writes through its own mapping of the memfd,
    /// so this process's memory is never written under a call here.
    owners: parking_lot::Mutex<std::collections::HashMap<u64, Box<dyn std::any::Any + Send + Sync>>>,
}

impl Standalone {
    pub(crate) async fn connect(cfg: StandaloneConfig, engine_name: String) -> Result<Standalone> {
        let client = tokio::task::spawn_blocking(move || Client::connect(cfg))
            .await
            .map_err(|e| StoreError::Server { detail: e.to_string() })??;
        let engine = local_engine(engine_name).await?;
        engine.open_segment(engine.segment_name()).await?;
        Ok(Standalone {
            client,
            engine,
            closed: AtomicBool::new(false),
            owners: Default::default(),
        })
    }
}

#[async_trait::async_trait]
impl Backend for Standalone {
    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(StoreError::Closed);
        }
        Ok(())
    }

    fn engine(&self) -> &TransferEngine {
        &self.engine
    }

    fn is_standalone(&self) -> bool {
        true
    }

    fn alloc_buffer(&self, len: usize) -> Result<KvBuffer> {
        self.client.alloc(len)
    }

    async fn free_buffer(&self, buf: KvBuffer) -> Result<()> {
        self.client.free(buf)
    }

    fn key_handle_report(&self) -> Option<(Option<String>, u64, u64)> {
        let (bytes, calls) = self.client.get_request_bytes();
        Some((self.client.key_handle_report(), bytes, calls))
    }

    async fn register_buffer(&self, m: CallerMemory) -> Result<()> {
        self.check_open()?;
        self.client.register(m.addr, m.len)?;
        if let Some(owner) = m.owner {
            self.owners.lock().insert(m.addr, owner);
        }
        Ok(())
    }

    async fn deregister_buffer(&self, addr: u64) -> Result<bool> {
        let out = self.client.deregister(addr);
        self.owners.lock().remove(&addr);
        out
    }

    fn exists(&self, key: &str) -> Result<bool> {
        self.client.exists(key)
    }

    fn batch_exists_consecutive(&self, keys: &[&str]) -> Result<usize> {
        self.client.exists_consecutive(keys)
    }

    fn remove(&self, key: &str) -> Result<bool> {
        check_keys(std::iter::once(key))?;
        self.client.remove(key)
    }

    fn batch_get(&self, items: &[(&str, u64, u64)]) -> Result<Vec<Result<u64>>> {
        check_keys(items.iter().map(|i| i.0))?;
        self.client.get_whole(items)
    }

    fn object_lens(&self, keys: &[&str]) -> Result<Vec<Option<u64>>> {
        self.client.object_lens(keys)
    }

    async fn put(&self, key: &str, data: &[u8], depth: u32) -> Result<()> {
        check_keys(std::iter::once(key))?;
        blocking::off_worker(|| self.client.put_bytes(key, data, depth))
    }

    async fn get(&self, key: &str) -> Result<Vec<u8>> {
        check_keys(std::iter::once(key))?;
        blocking::off_worker(|| self.client.get_bytes(key))
    }

    fn compact(&self, force: bool) -> Result<u64> {
        self.client.compact(force)
    }

    fn flush(&self) -> Result<()> {
        self.client.flush()
    }

    async fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.client.close();
        self.owners.lock().clear();
        Ok(self.engine.shutdown().await?)
    }

    fn stats(&self) -> Result<StoreStats> {
        self.client.stats()
    }

    fn phase_report(&self) -> Result<Option<PhaseReport>> {
        self.client.phase_report()
    }

    fn reset_phase_report(&self) -> Result<()> {
        self.client.reset_phase_report()
    }

    /// The server resolves (and keeps key handles) on its side: nothing to reuse here.
    fn batch_get_ranges(&self, items: &[RangedGet<'_>], _resolved: Option<&mut Resolved>) -> Result<Vec<Result<u64>>> {
        check_keys(items.iter().map(|i| i.key))?;
        self.client.get_ranges(items)
    }

    fn batch_put_ranges(&self, items: &[RangedPut<'_>]) -> Result<Vec<Result<()>>> {
        // Keys are checked here in every mode: a bad key is BadKey, never a wire error.
        check_keys(items.iter().map(|i| i.key))?;
        self.client.put_ranges(items)
    }
}
