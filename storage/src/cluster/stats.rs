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
}
