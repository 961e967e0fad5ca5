//! UMBP: a tiered KV-cache store (DRAM, SSD) built on te-core.

pub mod config;
pub mod error;
pub mod eviction;
pub mod range_map;
pub mod dram {
    //! The DRAM tier.
    pub mod allocator;
    pub mod tier;
}
pub mod ssd {
    //! The SSD tier.
    pub mod aligned;
    pub mod io;
    pub mod log;
    pub mod record;
}
