//! The distributed path's counters, as a section of `StoreStats`.

/// Counters of reads from and writes to other peers since open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterStats {
    /// Keys read from another peer.
    pub remote_hits: u64,
    /// Bytes delivered from other peers (exactly the requested spans).
    pub remote_bytes: u64,
    /// Engine requests issued to other peers.
    pub remote_requests: u64,
    /// Control-protocol bytes sent and received (RESOLVE, PLACES, VALIDATE, VERDICTS).
    pub remote_control_bytes: u64,
    /// Remote keys whose placement changed while they were read (returned as misses).
    pub remote_stale: u64,
    /// Remote keys whose owner failed them (`StoreError::Remote`).
    pub remote_errors: u64,
    /// Directory entries this peer holds now: its shard (sharded directory) or its copy of
    /// every key (etcd directory).
    pub directory_entries: u64,
    /// Directory messages (PUBLISH, UNPUBLISH, LOOKUP) this peer sent to other peers.
    pub directory_messages: u64,
    /// PUBLISH/UNPUBLISH this peer refused because they named an owner other than the member
    /// the connection proved, came from no member, or from one not in the membership.
    pub directory_refused_identity: u64,
    /// PUBLISH this peer refused (wholly or partly) at `UMBP_CLUSTER_MAX_ENTRIES_PER_SOURCE`.
    pub directory_refused_capped: u64,
    /// LOOKUPs this peer delayed or refused at `UMBP_CLUSTER_LOOKUP_KEYS_PER_S`.
    pub directory_lookups_throttled: u64,
    /// Times this peer's lease lapsed (it was frozen or cut off past its TTL, or etcd lost it)
    /// and it re-joined under a new lease, every local key published again.
    pub lease_rejoins: u64,
}
