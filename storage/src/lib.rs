//! UMBP: a tiered KV-cache store (DRAM, SSD) built on te-core.
//!
//! A KV-cache page is one object holding every layer of one pool; readers restore a prefix layer
//! group by layer group with [`Store::batch_get_ranges`] (the ranges of the layers in the group,
//! each landing in the caller's per-layer buffer), writers offload a page with
//! [`Store::batch_put_ranges`] (ranges that tile the object). Objects live in a DRAM arena
//! registered with the transfer engine and, under pressure or by write-through, in an SSD log of
//! checksummed 4 KiB-aligned records. Every byte between the store and its callers moves through
//! te-core's engine, so the local-copy transport plans and coalesces the fragments.
//!
//! ```
//! # #[tokio::main]
//! # async fn main() -> umbp::Result<()> {
//! use umbp::{Range, RangedGet, Store};
//! let store = Store::builder().dram_capacity(64 << 20).open().await?;
//! store.put("page-0", &vec![7u8; 3 * 1728], 0).await?;
//! let mut layer = vec![0u8; 1728];
//! // SAFETY: `layer` outlives its registration (deregistered below).
//! unsafe { store.register_buffer(layer.as_mut_ptr() as u64, layer.len() as u64) }.await?;
//! let ranges = [Range::new(1728, 1728, layer.as_mut_ptr() as u64)];
//! let got = store.batch_get_ranges(&[RangedGet { key: "page-0", ranges: &ranges }])?;
//! assert_eq!(*got[0].as_ref().unwrap(), 1728);
//! store.deregister_buffer(layer.as_mut_ptr() as u64).await?;
//! store.close().await?;
//! # Ok(()) }
//! ```
//!
//! `cargo run -p umbp --example restore_prefix` restores a prefix of pages layer group by layer
//! group, the whole way round (offload, restore, verify).

#![warn(missing_docs)]

#[cfg(feature = "cluster")]
pub mod cluster;
pub mod config;
mod core;
pub mod error;
pub mod eviction;
pub mod range_map;
pub mod standalone;
pub mod store;
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

pub use crate::core::config::CoreConfig;
pub use crate::core::stats::CoreStats;
#[cfg(feature = "cluster")]
pub use cluster::{config::DirectoryMode, stats::ClusterStats, ClusterConfig};
pub use config::{ModeConfig, StoreBuilder, StoreConfig};
pub use error::{ClusterError, Result, StoreError, Tier};
pub use eviction::EvictionPolicy;
pub use range_map::Range;
pub use ssd::io::{DirectIo, IoBackend};
pub use standalone::config::StandaloneConfig;
pub use standalone::stats::StandaloneStats;
pub use standalone::KvBuffer;
pub use store::{RangedGet, RangedPut, Store, StoreStats};
