//! The embedded default: descriptors shared by every engine of this process. Watches are
//! `tokio::sync::watch` channels per name: a follower sees the latest descriptor, changes it
//! missed coalesced, with bounded memory.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use parking_lot::RwLock;
use te_base::{DescriptorEvent, DescriptorWatch, Error, MetadataStore, Result, SegmentDescriptor};
use tokio::sync::watch;

/// A metadata store in this process's memory. [`InProcessStore::global`] is the one engines use
/// by default, so engines built in one process find each other without any service.
#[derive(Debug, Default, Clone)]
pub struct InProcessStore {
    map: Arc<RwLock<HashMap<String, SegmentDescriptor>>>,
    /// Per watched name: the latest descriptor (`None`: removed).
    watchers: Arc<RwLock<HashMap<String, watch::Sender<Option<SegmentDescriptor>>>>>,
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

    /// Tells the watchers of `name` (if any) its current descriptor; forgets a channel nobody
    /// listens to any more.
    fn notify(&self, name: &str, now: Option<&SegmentDescriptor>) {
        let mut watchers = self.watchers.write();
        if let Some(tx) = watchers.get(name) {
            if tx.receiver_count() == 0 {
                watchers.remove(name);
            } else {
                tx.send_replace(now.cloned());
            }
        }
    }
}

/// A watch on one name of an [`InProcessStore`].
struct InProcessWatch(watch::Receiver<Option<SegmentDescriptor>>);

#[async_trait]
impl DescriptorWatch for InProcessWatch {
    async fn next(&mut self) -> Option<DescriptorEvent> {
        self.0.changed().await.ok()?;
        Some(match &*self.0.borrow_and_update() {
            Some(d) => DescriptorEvent::Changed(d.clone()),
            None => DescriptorEvent::Removed,
        })
    }
}

#[async_trait]
impl MetadataStore for InProcessStore {
    fn name(&self) -> &'static str {
        "in-process"
    }

    /// Clones share one map: its address.
    fn scope(&self) -> Option<usize> {
        Some(Arc::as_ptr(&self.map) as *const () as usize)
    }

    async fn publish(&self, descriptor: &SegmentDescriptor) -> Result<()> {
        descriptor.validate()?;
        self.map.write().insert(descriptor.name.clone(), descriptor.clone());
        self.notify(&descriptor.name, Some(descriptor));
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
        if self.map.write().remove(name).is_some() {
            self.notify(name, None);
        }
        Ok(())
    }

    async fn watch(&self, name: &str) -> Result<Option<Box<dyn DescriptorWatch>>> {
        // The map is read under the watchers' lock: a publish racing with this either is in the
        // value read here or notifies the channel created here (it takes this lock after writing).
        let rx = {
            let mut watchers = self.watchers.write();
            let tx = watchers
                .entry(name.to_string())
                .or_insert_with(|| watch::channel(self.map.read().get(name).cloned()).0);
            tx.subscribe()
        };
        Ok(Some(Box::new(InProcessWatch(rx))))
    }

    async fn withdraw(&self, name: &str, instance: u64) -> Result<()> {
        let removed = {
            let mut map = self.map.write();
            map.get(name).is_some_and(|d| d.instance == instance) && map.remove(name).is_some()
        };
        if removed {
            self.notify(name, None);
        }
        Ok(())
    }
}
