//! Where segment descriptors are published and found: in-process, peer-to-peer, etcd, HTTP key-value.

use async_trait::async_trait;

use crate::error::Result;
use crate::segment::SegmentDescriptor;

/// A change to one watched segment's descriptor (see [`MetadataStore::watch`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum DescriptorEvent {
    /// The descriptor was published or replaced; this is the new one, validated.
    Changed(SegmentDescriptor),
    /// The descriptor was removed (withdrawn, or its owner's lease ran out).
    Removed,
}

/// A stream of changes to one segment's descriptor. Events may be coalesced (a follower only
/// needs the latest descriptor), never reordered.
#[async_trait]
pub trait DescriptorWatch: Send + 'static {
    /// Waits for the next change; `None` once the watch ended (the store closed).
    async fn next(&mut self) -> Option<DescriptorEvent>;
}

/// A store of segment descriptors shared by the engines of a cluster.
#[async_trait]
pub trait MetadataStore: Send + Sync + 'static {
    /// Backend name for reports (`in-process`, `p2p`, `etcd`).
    fn name(&self) -> &'static str;

    /// Which namespace of names this store publishes into, as seen inside this process: engines
    /// whose stores give the same value see each other's descriptors under one name (clones of
    /// one in-process store), so a second live engine under a taken name would shadow the first
    /// and is refused. `None` (the default): no such check (a peer-to-peer store is one engine's
    /// own; names there are reached through their listener).
    fn scope(&self) -> Option<usize> {
        None
    }

    /// Publishes (or replaces) `descriptor` under its name.
    async fn publish(&self, descriptor: &SegmentDescriptor) -> Result<()>;

    /// Fetches and validates the descriptor of `name`. [`crate::Error::UnknownSegment`] if absent.
    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor>;

    /// Removes the descriptor of `name` (no error if absent).
    async fn remove(&self, name: &str) -> Result<()>;

    /// Follows the descriptor of `name` from now on, pushed by the store (never by polling).
    /// `Ok(None)` when this backend cannot watch: the engine then re-fetches the descriptor when
    /// its connection to the segment is lost (peer-to-peer metadata).
    async fn watch(&self, name: &str) -> Result<Option<Box<dyn DescriptorWatch>>> {
        let _ = name;
        Ok(None)
    }

    /// Removes the descriptor of `name` only while it is the one engine `instance` published, so
    /// an engine that goes away late never withdraws a successor that reused its name. Backends
    /// that can compare and delete in one step override this check-then-remove.
    async fn withdraw(&self, name: &str, instance: u64) -> Result<()> {
        match self.fetch(name).await {
            Ok(d) if d.instance == instance => self.remove(name).await,
            Ok(_) | Err(crate::Error::UnknownSegment(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}
