//! Domains: one per transport instance, holding its live region table, and the process-wide
//! registry through which a peer in the same process finds the domain it targets.
//!
//! A segment's endpoint info names the process (pid plus a random value drawn once per process,
//! so a pid reused in another container or host never matches) and the domain. Domain ids are
//! never reused within a process, so a descriptor of a transport that is gone cannot reach a new
//! one.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use te_base::{Error, Result};

use crate::table::RegionTable;

/// The registered regions of one transport instance.
#[derive(Debug)]
pub(crate) struct Domain {
    id: u64,
    open: AtomicBool,
    /// Resolved under one shared lock per batch; held while the batch copies, so a region cannot
    /// be deregistered (and freed) under a copy that reads or writes it.
    pub table: RwLock<RegionTable>,
    /// Where notifications sent to this domain's segment go (the engine's inbox).
    pub inbox: Arc<te_base::NotifyInbox>,
}

impl Domain {
    /// A new, open domain, listed in the process registry.
    pub fn create(inbox: Arc<te_base::NotifyInbox>) -> Arc<Domain> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let domain = Arc::new(Domain {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            open: AtomicBool::new(true),
            table: RwLock::new(RegionTable::default()),
            inbox,
        });
        REGISTRY.write().insert(domain.id, Arc::downgrade(&domain));
        domain
    }

    /// The domain's process-unique id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// False once the transport shut down.
    #[inline]
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Marks the domain closed and unlists it: no new peer can connect, existing peers fail.
    pub fn close(&self) {
        self.open.store(false, Ordering::Release);
        REGISTRY.write().remove(&self.id);
    }

    /// The live, open domain `id` of this process, if any.
    pub fn lookup(id: u64) -> Option<Arc<Domain>> {
        REGISTRY.read().get(&id).and_then(Weak::upgrade).filter(|d| d.is_open())
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // Ids are never reused, so the entry under our id is ours.
        REGISTRY.write().remove(&self.id);
    }
}

static REGISTRY: LazyLock<RwLock<HashMap<u64, Weak<Domain>>>> = LazyLock::new(Default::default);

/// This process's token: `<pid>-<64 random bits in hex>`, drawn once.
pub(crate) fn process_token() -> &'static str {
    static TOKEN: LazyLock<String> = LazyLock::new(|| {
        // RandomState is seeded from the OS's random source once per process; mixing in the
        // time keeps two processes apart even if that source were weak.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let random = RandomState::new().hash_one((std::process::id(), nanos));
        format!("{}-{random:016x}", std::process::id())
    });
    &TOKEN
}

/// The endpoint info the local transport publishes in a segment descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalEndpoint {
    /// The owning process: pid and a random value drawn once per process.
    pub process: String,
    /// The transport instance (domain) within that process.
    pub domain: u64,
}

impl LocalEndpoint {
    /// The endpoint of domain `domain` of this process.
    pub(crate) fn here(domain: u64) -> Self {
        LocalEndpoint {
            process: process_token().to_owned(),
            domain,
        }
    }

    /// Parses endpoint info read from a descriptor of segment `segment`.
    pub fn parse(segment: &str, info: &serde_json::Value) -> Result<Self> {
        LocalEndpoint::deserialize(info).map_err(|e| {
            Error::InvalidDescriptor(format!(
                "segment '{segment}': malformed local transport endpoint {info}: {e}"
            ))
        })
    }

    /// True if the endpoint belongs to this process.
    pub fn is_this_process(&self) -> bool {
        self.process == process_token()
    }

    /// As JSON, for the descriptor.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "process": self.process, "domain": self.domain })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_are_found_until_closed_or_dropped() {
        let a = Domain::create(te_base::NotifyInbox::new(Default::default()));
        let b = Domain::create(te_base::NotifyInbox::new(Default::default()));
        assert_ne!(a.id(), b.id());
        assert!(Arc::ptr_eq(&Domain::lookup(a.id()).unwrap(), &a));
        a.close();
        assert!(Domain::lookup(a.id()).is_none());
        let id = b.id();
        drop(b);
        assert!(Domain::lookup(id).is_none());
    }

    #[test]
    fn endpoint_round_trips_and_rejects_garbage() {
        let e = LocalEndpoint::here(7);
        assert!(e.is_this_process());
        assert!(e.process.starts_with(&format!("{}-", std::process::id())));
        assert_eq!(LocalEndpoint::parse("s", &e.to_json()).unwrap(), e);
        for bad in [
            serde_json::json!(null),
            serde_json::json!({"process": 1, "domain": 2}),
            serde_json::json!({"process": "x"}),
            serde_json::json!({"process": "x", "domain": -1}),
            serde_json::json!({"process": "x", "domain": 1, "extra": true}),
        ] {
            let err = LocalEndpoint::parse("seg-x", &bad).unwrap_err();
            assert!(err.to_string().contains("seg-x"), "{err}");
        }
        let other = LocalEndpoint {
            process: format!("{}-0000000000000000", std::process::id()),
            domain: 7,
        };
        assert!(!other.is_this_process());
    }
}
