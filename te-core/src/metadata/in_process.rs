//! The embedded default: descriptors shared by every engine of this process.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use parking_lot::RwLock;
use te_base::{Error, MetadataStore, Result, SegmentDescriptor};

/// A metadata store in this process's memory. [`InProcessStore::global`] is the one engines use
/// by default, so engines built in one process find each other without any service.
#[derive(Debug, Default, Clone)]
pub struct InProcessStore {
    map: Arc<RwLock<HashMap<String, SegmentDescriptor>>>,
}

impl InProcessStore {
    /// A fresh, empty store (isolated from the global one).
    pub fn new() -> Self {
        Self::default()
    }

    /// The process-wide store.
    pub fn global() -> Self {
        static GLOBAL: OnceLock<InProcessStore> = OnceLock::new();
        GLOBAL.get_or_init(InProcessStore::new).clone()
    }
}

#[async_trait]
impl MetadataStore for InProcessStore {
    fn name(&self) -> &'static str {
        "in-process"
    }

    async fn publish(&self, descriptor: &SegmentDescriptor) -> Result<()> {
        descriptor.validate()?;
        self.map.write().insert(descriptor.name.clone(), descriptor.clone());
        Ok(())
    }

    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        self.map
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| Error::UnknownSegment(name.to_string()))
    }

    async fn remove(&self, name: &str) -> Result<()> {
        self.map.write().remove(name);
        Ok(())
    }

    async fn withdraw(&self, name: &str, instance: u64) -> Result<()> {
        let mut map = self.map.write();
        if map.get(name).is_some_and(|d| d.instance == instance) {
            map.remove(name);
        }
        Ok(())
    }
}
