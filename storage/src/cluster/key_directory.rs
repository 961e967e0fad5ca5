//! The key directory, behind one interface: where each key's owner is recorded and asked. Two
//! designs, chosen once at join from `UMBP_CLUSTER_DIRECTORY` ([`build`]):
//!
//! - sharded over the peers (`sharded.rs`, the default): each key's entry at its three
//!   rendezvous peers, versioned, written before the put returns;
//! - in etcd (`etcd_keys.rs`, the design before issue 26, kept to measure against): one owner
//!   per key under `<prefix>/umbp/keys/`, followed by every peer's watch.
//!
//! Membership and the lease are not the key directory's: `directory.rs` keeps them in etcd for
//! both designs, and tells the key directory each new membership.
//!
//! One rule for I/O: every call blocks the calling thread, bounded by the deadline it is given
//! (or the cluster timeout where none is). The store's read and write paths are synchronous
//! threads that send their own messages; async callers (the control server, the directory's
//! tasks) go through `spawn_blocking`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use super::conn::ConnPool;
use super::membership::Membership;
use crate::error::ClusterError;

/// Keys the directory did not take for a fresh write (index into the keys, why): their put is
/// not acknowledged, and this peer's copies are dropped.
pub(crate) type Refused = Vec<(usize, String)>;

/// The directory's own counters, for the stats section (zero where a design has none).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DirectoryCounters {
    /// Index entries this peer holds.
    pub(crate) entries: u64,
    /// Directory messages sent to other peers.
    pub(crate) messages: u64,
    pub(crate) refused_identity: u64,
    pub(crate) refused_capped: u64,
    pub(crate) lookups_throttled: u64,
}

pub(crate) trait KeyDirectory: Send + Sync {
    /// Whether the entries live in etcd. Such a directory cannot be written while etcd is out of
    /// reach (a put stays local and is published when etcd is back), is followed through the
    /// membership watch (its subtree: [`KeyDirectory::etcd_subtree`]), and announces free
    /// capacity every keep-alive period; and its member, cut off from etcd, does not ask the
    /// others to renew its lease (the behaviour before issue 38, kept to measure against).
    fn lives_in_etcd(&self) -> bool;

    /// The subtree of `<prefix>/umbp/` whose events [`KeyDirectory::listed`] and
    /// [`KeyDirectory::changed`] take (etcd: `keys/`); `None`: the watch follows membership only.
    fn etcd_subtree(&self) -> Option<&'static str> {
        None
    }

    /// The whole subtree as listed (key below the subtree, value), replacing what was known.
    fn listed(&self, _entries: Vec<(String, String)>) {}

    /// The changes below the subtree one watch response carried, in order (key, new value or
    /// `None`: deleted).
    fn changed(&self, _changes: Vec<(String, Option<String>)>) {}

    /// Installs a new membership; returns the previous one when the members changed (the caller
    /// then runs [`KeyDirectory::rebalance`], off the watch task).
    fn set_membership(&self, m: Membership) -> Option<Arc<Membership>>;

    /// After a membership change from `old`: moves entries to where they now belong.
    fn rebalance(&self, old: &Membership, local_keys: &[String]) -> Result<(), ClusterError>;

    /// Records `keys` as owned here, by `end`. `fresh`: the keys were just written here (a new
    /// version each), else a re-publication of copies held. `Ok`: the keys a fresh write may not
    /// acknowledge. `Err`: the directory could not be written (every local key is published
    /// again within a lease period).
    fn publish(&self, keys: &[String], fresh: bool, end: Instant) -> Result<Refused, ClusterError>;

    /// Forgets `keys` as owned here; best effort (a leftover entry makes a reader's RESOLVE
    /// answer "missing", never wrong data).
    fn unpublish(&self, keys: &[String], end: Instant);

    /// The owner of each key and its control address; `None`: unknown, owned here, or its owner
    /// is not a live member.
    fn owners(&self, keys: &[&str], end: Instant) -> Vec<Option<(Arc<str>, SocketAddr)>>;

    /// The owner of `key` as the directory says, this peer included (visibility checks).
    fn owner_of(&self, key: &str, end: Instant) -> Option<Arc<str>>;

    fn counters(&self) -> DirectoryCounters;

    /// The design itself, for the control server: the sharded directory answers other peers'
    /// directory requests (PUBLISH, UNPUBLISH, LOOKUP, RETIRE, and RENEW's identity check),
    /// which speak its protocol; the server takes them only when this is a `Sharded`.
    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;
}

/// What a key directory is built from, besides the configuration.
pub(crate) struct Parts {
    pub(crate) name: Arc<str>,
    pub(crate) pool: Arc<ConnPool>,
    pub(crate) owner: std::sync::Weak<super::owner::Owner>,
    pub(crate) client: etcd_client::Client,
    /// The lease this peer's entries in etcd are written under (the membership's).
    pub(crate) lease: Arc<std::sync::atomic::AtomicI64>,
    pub(crate) runtime: tokio::runtime::Handle,
}
