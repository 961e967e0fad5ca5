//! The segment names of the engines alive in this process, per metadata namespace: a second
//! engine publishing a name a live one holds in the same store would shadow it (its descriptor
//! replaces the first's), so it is refused by name instead. Namespaces are the stores'
//! [`MetadataStore::scope`](te_base::MetadataStore::scope) (the in-process store every engine
//! shares by default is one; a store without a scope, such as each engine's own peer-to-peer
//! store, is not checked).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use te_base::{Error, Result};

use super::EngineInner;

type Key = (usize, String);

static LIVE: Mutex<Option<HashMap<Key, Weak<EngineInner>>>> = Mutex::new(None);

/// Records `engine` under its store and name, or refuses it when an engine of this process that
/// is not shut down holds the name in the same store.
pub(super) fn claim(engine: &Arc<EngineInner>) -> Result<()> {
    let Some(store) = engine.metadata.scope() else {
        return Ok(());
    };
    let mut live = LIVE.lock();
    let live = live.get_or_insert_with(HashMap::new);
    // Entries of engines dropped or shut down are stale: forget them as we pass.
    live.retain(|_, w| w.upgrade().is_some_and(|e| !e.is_closed()));
    let key = (store, engine.name.clone());
    if live.contains_key(&key) {
        return Err(Error::SegmentNameTaken(engine.name.clone()));
    }
    live.insert(key, Arc::downgrade(engine));
    Ok(())
}
