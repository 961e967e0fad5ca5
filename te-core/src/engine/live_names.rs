//! The segment names of the engines alive in this process: a second engine under a name a live
//! one holds would shadow it in every metadata store this process shares (its descriptor
//! replaces the first's), so it is refused by name instead.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use te_base::{Error, Result};

use super::EngineInner;

static LIVE: Mutex<Option<HashMap<String, Weak<EngineInner>>>> = Mutex::new(None);

/// Records `engine` under its name, or refuses it when an engine of this process that is not
/// shut down holds the name.
pub(super) fn claim(engine: &Arc<EngineInner>) -> Result<()> {
    let mut live = LIVE.lock();
    let live = live.get_or_insert_with(HashMap::new);
    // Entries of engines dropped or shut down are stale: forget them as we pass.
    live.retain(|_, w| w.upgrade().is_some_and(|e| !e.is_closed()));
    if live.contains_key(&engine.name) {
        return Err(Error::SegmentNameTaken(engine.name.clone()));
    }
    live.insert(engine.name.clone(), Arc::downgrade(engine));
    Ok(())
}
