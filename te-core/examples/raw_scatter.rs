//! Register memory the engine did not allocate (a framework's tensor, a `Vec`) with
//! `register_raw`, then gather scattered pages into it with one batch of reads.
//!
//! ```text
//! cargo run -p te-core --example raw_scatter
//! ```
//! One process, the local-copy transport: the engine opens its own segment, as a KV-cache store
//! does to move pages between its arena and its callers' buffers.

use te_core::{HostBufferOptions, MemoryLocation, RegisterOptions, TransferEngine, TransferRequest};

/// A KV page of DeepSeek-V4-Pro's smallest pool.
const PAGE: u64 = 1728;
/// Pages in the exported "arena".
const PAGES: u64 = 1024;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let engine = TransferEngine::builder()
        .segment_name("raw-scatter")
        .transports(["local"])
        .build()
        .await?;

    // The arena: engine-allocated, exported, page p filled with the byte p % 251.
    let arena = engine
        .allocate((PAGE * PAGES) as usize, HostBufferOptions::default())
        .await?;
    for p in 0..PAGES {
        arena.write_at(p * PAGE, &vec![(p % 251) as u8; PAGE as usize])?;
    }

    // The destination: an ordinary Vec the engine does not own, registered for local use only.
    let wanted: Vec<u64> = (0..PAGES).filter(|p| p % 7 == 3).collect();
    let mut gathered = vec![0u8; (wanted.len() as u64 * PAGE) as usize];
    // SAFETY: `gathered` is neither moved, resized nor freed until the registration is
    // deregistered below, after the only transfer on it completed.
    let region = unsafe {
        engine.register_raw(
            gathered.as_mut_ptr() as u64,
            gathered.len() as u64,
            MemoryLocation::HOST,
            RegisterOptions::local_only(),
        )
    }
    .await?;

    // One batch: every wanted page of the arena to the next slot of `gathered`. The local-copy
    // transport plans the batch as a whole and copies it with its worker pool.
    let me = engine.open_segment("raw-scatter").await?;
    let reads: Vec<TransferRequest> = wanted
        .iter()
        .enumerate()
        .map(|(slot, &p)| {
            TransferRequest::read(
                region.addr() + slot as u64 * PAGE,
                me.id(),
                arena.addr() + p * PAGE,
                PAGE,
            )
        })
        .collect();
    let report = engine.transfer(&reads).await?;
    region.deregister().await?;

    for (slot, &p) in wanted.iter().enumerate() {
        let page = &gathered[slot * PAGE as usize..(slot + 1) * PAGE as usize];
        if page.iter().any(|&b| b != (p % 251) as u8) {
            return Err(format!("page {p} arrived wrong in slot {slot}").into());
        }
    }
    println!(
        "gathered {} scattered pages ({} bytes) in one batch, all correct",
        wanted.len(),
        report.bytes
    );
    engine.shutdown().await?;
    Ok(())
}
