//! The store's error type. Call-level (shape) errors fail a whole call; data errors are reported
//! per key and leave the other keys' results intact.

use std::sync::Arc;

/// Result alias of the store.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Which tier a data error came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// The DRAM arena.
    Dram,
    /// The SSD log.
    Ssd,
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tier::Dram => "dram",
            Tier::Ssd => "ssd",
        })
    }
}

/// Everything the store can report.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Shape: a range lies (partly) outside its object.
    #[error(
        "key #{key_index}: range #{range_index} [{offset}, +{len}) falls outside the object of {object_len} bytes"
    )]
    RangeOutsideObject {
        /// Position of the key in the call.
        key_index: usize,
        /// Position of the range in that key's ranges.
        range_index: usize,
        /// Object offset of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the object.
        object_len: u64,
    },

    /// Shape: two ranges of one key overlap in the object.
    #[error("key #{key_index}: ranges #{first} and #{second} overlap in the object")]
    RangesOverlap {
        /// Position of the key in the call.
        key_index: usize,
        /// One of the overlapping ranges.
        first: usize,
        /// The other.
        second: usize,
    },

    /// Shape: the ranges of a put do not cover the object exactly.
    #[error("key #{key_index}: ranges do not tile the object of {object_len} bytes: [{gap_start}, {gap_end}) is not covered")]
    RangesDoNotTile {
        /// Position of the key in the call.
        key_index: usize,
        /// Size of the object.
        object_len: u64,
        /// First uncovered byte.
        gap_start: u64,
        /// One past the last uncovered byte.
        gap_end: u64,
    },

    /// Shape: a range or object of zero bytes.
    #[error("key #{key_index}: range #{range_index} has zero length")]
    ZeroLength {
        /// Position of the key in the call.
        key_index: usize,
        /// Position of the range (0 for a whole object).
        range_index: usize,
    },

    /// Shape: a range's caller memory is not inside a buffer registered with the store.
    #[error(
        "key #{key_index}: range #{range_index} caller memory [{addr:#x}, +{len}) is not registered with the store"
    )]
    Unregistered {
        /// Position of the key in the call.
        key_index: usize,
        /// Position of the range.
        range_index: usize,
        /// Caller address.
        addr: u64,
        /// Length.
        len: u64,
    },

    /// Shape: an empty key, or one longer than the store accepts.
    #[error("key #{key_index} has length {len} (must be 1..={max})")]
    BadKey {
        /// Position of the key in the call.
        key_index: usize,
        /// Its length.
        len: usize,
        /// The longest key accepted.
        max: usize,
    },

    /// Shape: the same key appears twice in one put call.
    #[error("key #{key_index} repeats key #{first_index} in the same put call")]
    DuplicateKey {
        /// The repeated position.
        key_index: usize,
        /// Where it first appeared.
        first_index: usize,
    },

    /// Data: the key is in no tier.
    #[error("key {key:?} not found")]
    NotFound {
        /// The key.
        key: String,
    },

    /// Data: stored bytes failed their checksum; nothing of them was returned.
    #[error("key {key:?}: corrupt record in the {tier} tier: {detail}")]
    Corrupt {
        /// The key.
        key: String,
        /// Where.
        tier: Tier,
        /// What failed.
        detail: String,
    },

    /// Data: no tier has room for the object, even after eviction.
    #[error("key {key:?}: no space for {len} bytes in any tier")]
    NoSpace {
        /// The key.
        key: String,
        /// Bytes needed.
        len: u64,
    },

    /// Data: the caller's buffer is shorter than the object.
    #[error("key {key:?}: object of {need} bytes does not fit the {have}-byte buffer")]
    BufferTooSmall {
        /// The key.
        key: String,
        /// Object length.
        need: u64,
        /// Buffer length.
        have: u64,
    },

    /// Data: the object was replaced by a larger one on every one of `Store::get`'s tries (puts
    /// of one key never conflict with each other).
    #[error("key {key:?}: the object kept changing while it was read")]
    WriteConflict {
        /// The key.
        key: String,
    },

    /// Data: the object needs more staging memory than one slot has (`UMBP_SSD_STAGING_BYTES`).
    #[error("key {key:?}: {need} bytes of SSD staging needed, one slot holds {limit} (raise UMBP_SSD_STAGING_BYTES)")]
    TooLarge {
        /// The key.
        key: String,
        /// Staging bytes needed.
        need: u64,
        /// Bytes of one slot.
        limit: u64,
    },

    /// An I/O error of the SSD tier, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },

    /// An error of the transfer engine (registration, submission, configuration).
    #[error(transparent)]
    Engine(#[from] te_base::Error),

    /// The store was closed.
    #[error("the store is closed")]
    Closed,

    /// Standalone mode: the server cannot be reached, or the connection broke mid-call. The next
    /// call reconnects (with backoff) and re-registers this process's buffers.
    #[error("the umbp-server went away: {detail}")]
    ServerGone {
        /// What failed.
        detail: String,
    },

    /// Standalone mode: this memory cannot be shared with the server (only buffers allocated with
    /// `Store::alloc_buffer`, sealed memfds, can be).
    #[error("memory [{addr:#x}, +{len}) cannot be shared with the umbp-server: {reason}")]
    NotShareable {
        /// Address.
        addr: u64,
        /// Length.
        len: u64,
        /// Why.
        reason: String,
    },

    /// Standalone mode: a malformed frame or a protocol violation.
    #[error("protocol error: {detail}")]
    Protocol {
        /// What was wrong.
        detail: String,
    },

    /// Standalone mode: the server refused the request (peer credentials, an unsealed memfd, an
    /// unknown session, limits).
    #[error("refused by the umbp-server: {reason}")]
    Refused {
        /// Why.
        reason: String,
    },

    /// Standalone mode: an error on the server with no typed equivalent on this side.
    #[error("umbp-server error: {detail}")]
    Server {
        /// The server's message.
        detail: String,
    },

    /// Data (distributed mode): the key's owner could not serve it (unreachable, did not answer
    /// within the cluster timeout, refused, failed mid-read). The key's bytes in the caller's
    /// buffer are not data. Other keys of the call are unaffected.
    #[error("key {key:?}: its owner {peer} could not serve it: {reason}")]
    Remote {
        /// The key.
        key: String,
        /// The owner's name.
        peer: String,
        /// What went wrong.
        reason: String,
    },

    /// Data (distributed mode): the put of this key was not acknowledged because the key
    /// directory did not take it: both of its directory peers were unreachable within the
    /// cluster timeout, or (with `UMBP_CLUSTER_DIRECTORY=etcd`) another peer owns the key. A get
    /// may still return the previous version (docs/umbp.md, "the last acknowledged write wins").
    /// Other keys of the call are unaffected.
    #[error("key {key:?}: put not acknowledged: {reason}")]
    Unacknowledged {
        /// The key.
        key: String,
        /// Why the directory did not take it.
        reason: String,
    },

    /// Distributed mode could not start, be reached or serve (etcd, the control listener, this
    /// peer's standing).
    #[error("cluster: {0}")]
    Cluster(#[from] ClusterError),
}

/// What goes wrong in distributed mode's control work (etcd, the control runtime, this peer's
/// standing, the sharded directory's placement). A key-level failure of a remote get or put is
/// [`StoreError::Remote`] or [`StoreError::Unacknowledged`], which carry their reason as text
/// for the key they name.
/// A failure of the cluster's control work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// etcd answered a request with an error.
    #[error("etcd: {what}: {message}")]
    Etcd {
        /// The request (e.g. "granting a lease").
        what: &'static str,
        /// etcd's error, as its client reports it.
        message: String,
    },
    /// etcd did not answer a request within the cluster timeout.
    #[error("etcd: {what}: no answer within {ms} ms")]
    EtcdTimeout {
        /// The request.
        what: &'static str,
        /// The timeout (`UMBP_CLUSTER_TIMEOUT_MS`).
        ms: u64,
    },
    /// A task of the cluster's runtime ended before its work was done (the runtime shut down
    /// or the task panicked).
    #[error("{what}: the cluster's task ended: {message}")]
    Task {
        /// The work.
        what: &'static str,
        /// How it ended.
        message: String,
    },
    /// This peer's lease is not known to stand, so it serves no reads (`standing.rs`).
    #[error(
        "this peer's lease is not known to stand (frozen or cut off from etcd and its peers for longer than its TTL, or re-joining): no reads until it has re-joined"
    )]
    NotStanding,
    /// Keys too few of their directory peers took (the sharded directory; a write quorum for a
    /// fresh write, any one for a re-publication).
    #[error("{keys} keys were not taken by enough of their directory peers")]
    Unplaced {
        /// How many.
        keys: usize,
    },
}

impl ClusterError {
    /// An etcd error answering `what`.
    pub(crate) fn etcd(what: &'static str, e: impl std::fmt::Display) -> ClusterError {
        ClusterError::Etcd {
            what,
            message: e.to_string(),
        }
    }
}

/// A failed engine batch is an engine error (`te_base::Error::BatchFailed`), so `?` on
/// `Batch::wait` works in store code as on any engine call.
impl From<te_base::BatchError> for StoreError {
    fn from(e: te_base::BatchError) -> Self {
        StoreError::Engine(e.into())
    }
}

impl StoreError {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        StoreError::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn question_mark_carries_engine_errors_into_the_store_error() {
        fn wait() -> Result<(), te_base::BatchError> {
            Err(te_base::BatchError {
                progress: te_base::BatchProgress::default(),
                failures: vec![(0, te_base::Error::Cancelled)],
            })
        }
        fn store_call() -> Result<()> {
            wait()?;
            Ok(())
        }
        assert!(matches!(
            store_call(),
            Err(StoreError::Engine(te_base::Error::BatchFailed(b))) if b.failures.len() == 1
        ));
    }
}
