//! The core's settings: tiers, eviction, staging and debugging (the `UMBP_*` variables of local
//! mode, each declared once in `config::keys`; `StoreBuilder::config` resolves them into this).

use crate::eviction::EvictionPolicy;
use crate::ssd::log::SsdOptions;

/// Resolved settings of the store's own tiers.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// DRAM arena bytes; 0 means no DRAM tier.
    pub dram_capacity: u64,
    /// Allocation unit of the arena.
    pub dram_page_bytes: u64,
    /// Fraction of the arena at which eviction starts.
    pub dram_high_watermark: f64,
    /// Fraction eviction brings the arena down to.
    pub dram_low_watermark: f64,
    /// Eviction policy of the DRAM tier.
    pub eviction: EvictionPolicy,
    /// The SSD tier, if any.
    pub ssd: Option<SsdOptions>,
    /// Bytes of one staging slot.
    pub ssd_staging_bytes: u64,
    /// Number of staging slots.
    pub ssd_staging_slots: usize,
    /// Puts also go to the SSD log before returning.
    pub write_through: bool,
    /// Whole-object SSD reads are copied into DRAM.
    pub promote_on_read: bool,
    /// Per-phase timings of ranged calls.
    pub ranged_call_debug: bool,
}
