//! The core's counters: kept as atomics updated once per call (never per key), read as a
//! [`CoreStats`] snapshot.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of the store's own tiers since open (tier byte counters are updated once per call).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CoreStats {
    /// Objects in DRAM.
    pub dram_objects: u64,
    /// Bytes of DRAM allocated.
    pub dram_used_bytes: u64,
    /// Bytes the DRAM arena holds.
    pub dram_capacity_bytes: u64,
    /// Bytes delivered to callers from DRAM.
    pub dram_read_bytes: u64,
    /// Objects in the SSD log.
    pub ssd_objects: u64,
    /// Bytes read from SSD files (whole blocks).
    pub ssd_read_bytes: u64,
    /// Bytes written to SSD files.
    pub ssd_written_bytes: u64,
    /// Bytes delivered to callers from SSD.
    pub ssd_delivered_bytes: u64,
    /// Objects demoted from DRAM to SSD.
    pub demoted: u64,
    /// Objects evicted from DRAM without an SSD copy (no SSD tier).
    pub dropped: u64,
    /// Demotions that failed (the object stayed in DRAM).
    pub demotion_failed: u64,
    /// Objects promoted from SSD to DRAM.
    pub promoted: u64,
    /// Keys put successfully.
    pub puts_ok: u64,
    /// Keys whose put failed.
    pub puts_failed: u64,
    /// Torn tails truncated at open.
    pub ssd_torn_dropped: u64,
    /// Damaged records found at open (their keys read `Corrupt`).
    pub ssd_corrupt_records: u64,
    /// Bytes of SSD segment files.
    pub ssd_file_bytes: u64,
    /// Bytes the SSD tier may use.
    pub ssd_capacity_bytes: u64,
    /// Segments compacted and deleted.
    pub ssd_segments_compacted: u64,
    /// Bytes rewritten by compaction.
    pub ssd_compaction_written_bytes: u64,
    /// Segment bytes deleted by compaction.
    pub ssd_compaction_freed_bytes: u64,
    /// The SSD I/O engine (`uring`, `psync`), empty without SSD.
    pub ssd_io_engine: String,
    /// True when the SSD files use O_DIRECT.
    pub ssd_direct_io: bool,
    /// Keys of ranged/whole gets served by this store's own tiers.
    pub local_hits: u64,
    /// Keys of gets served by no tier (and, in distributed mode, no peer).
    pub misses: u64,
    /// Ranged calls that reused a key handle's last resolution (no key hashed or looked up).
    pub resolve_reused: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) dram_read_bytes: AtomicU64,
    pub(crate) ssd_delivered_bytes: AtomicU64,
    pub(crate) demoted: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) demotion_failed: AtomicU64,
    pub(crate) promoted: AtomicU64,
    pub(crate) puts_ok: AtomicU64,
    pub(crate) puts_failed: AtomicU64,
    pub(crate) local_hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) resolve_reused: AtomicU64,
}

impl Counters {
    /// The counted fields of a [`CoreStats`] (the tier sizes are filled by the core).
    pub(crate) fn snapshot(&self) -> CoreStats {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CoreStats {
            dram_read_bytes: l(&self.dram_read_bytes),
            ssd_delivered_bytes: l(&self.ssd_delivered_bytes),
            demoted: l(&self.demoted),
            dropped: l(&self.dropped),
            demotion_failed: l(&self.demotion_failed),
            promoted: l(&self.promoted),
            puts_ok: l(&self.puts_ok),
            puts_failed: l(&self.puts_failed),
            local_hits: l(&self.local_hits),
            misses: l(&self.misses),
            resolve_reused: l(&self.resolve_reused),
            ..Default::default()
        }
    }
}
