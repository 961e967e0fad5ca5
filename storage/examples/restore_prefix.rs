//! Restore a prefix of KV-cache pages from UMBP layer group by layer group, as an inference
//! server does before it can start the next forward pass.
//!
//! ```text
//! cargo run -p umbp --example restore_prefix
//! ```
//! A page is one store object holding every layer of one pool back to back; the KV cache is one
//! buffer per layer, holding that layer of every page. The writer offloads its pages with one
//! `batch_put_ranges` call (each page's ranges point into the per-layer buffers). The reader
//! then restores the first `PREFIX` pages in groups of `GROUP` layers: one `batch_get_ranges`
//! call per group asks, for every page, only the ranges of the group's layers, so the first
//! group's layers can be computed on while the next group is still loading.

use std::time::Instant;

use umbp::{Range, RangedGet, RangedPut, Store};

/// Layers of the pool (one buffer each).
const LAYERS: usize = 8;
/// Bytes of one layer of one page (DeepSeek-V4-Pro's smallest pool).
const LAYER_BYTES: u64 = 1728;
/// Pages stored.
const PAGES: usize = 16;
/// Pages of the prefix to restore.
const PREFIX: usize = 12;
/// Layers per layer group.
const GROUP: usize = 4;

/// The byte at `i` of layer `l` of page `p`: different for every position, so a misplaced
/// range shows.
fn byte(p: usize, l: usize, i: usize) -> u8 {
    (p * 31 + l * 7 + i) as u8
}

/// Per-layer buffers `[layer][page]` (each a `Vec` the store does not own), registered with
/// the store so ranges may point into them.
async fn layer_buffers(store: &Store) -> umbp::Result<Vec<Vec<u8>>> {
    let mut bufs = vec![vec![0u8; PAGES * LAYER_BYTES as usize]; LAYERS];
    for b in &mut bufs {
        // SAFETY: the buffers are neither moved, resized nor freed until they are deregistered
        // at the end of `main` (their heap memory stays put when the outer Vec moves).
        unsafe { store.register_buffer(b.as_mut_ptr() as u64, b.len() as u64) }.await?;
    }
    Ok(bufs)
}

/// The range of layer `l` of page `p` inside its page object, landing in `bufs[l]`.
fn range(bufs: &[Vec<u8>], p: usize, l: usize) -> Range {
    let addr = bufs[l].as_ptr() as u64 + p as u64 * LAYER_BYTES;
    Range::new(l as u64 * LAYER_BYTES, LAYER_BYTES, addr)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A local store: DRAM tier only, whatever UMBP_SSD_DIRS says.
    let store = Store::builder().dram_capacity(64 << 20).ssd_dirs(vec![]).open().await?;

    // Writer: fill the per-layer buffers, then offload every page in one call.
    let mut written = layer_buffers(&store).await?;
    for (l, buf) in written.iter_mut().enumerate() {
        for (i, b) in buf.iter_mut().enumerate() {
            let (p, at) = (i / LAYER_BYTES as usize, i % LAYER_BYTES as usize);
            *b = byte(p, l, at);
        }
    }
    let keys: Vec<String> = (0..PAGES).map(|p| format!("seq-42/page-{p}")).collect();
    let page_ranges: Vec<Vec<Range>> = (0..PAGES)
        .map(|p| (0..LAYERS).map(|l| range(&written, p, l)).collect())
        .collect();
    let puts: Vec<RangedPut<'_>> = keys
        .iter()
        .zip(&page_ranges)
        .enumerate()
        .map(|(p, (key, ranges))| RangedPut {
            key,
            object_len: LAYERS as u64 * LAYER_BYTES,
            ranges,
            // Depth in the prefix: eviction drops the deepest pages first.
            depth: p as u32,
        })
        .collect();
    for r in store.batch_put_ranges(&puts)? {
        r?;
    }

    // Reader: fresh buffers, the prefix restored group by group.
    let restored = layer_buffers(&store).await?;
    let t0 = Instant::now();
    let mut first_group = None;
    let mut bytes = 0;
    for group in (0..LAYERS).collect::<Vec<_>>().chunks(GROUP) {
        let ranges: Vec<Vec<Range>> = (0..PREFIX)
            .map(|p| group.iter().map(|&l| range(&restored, p, l)).collect())
            .collect();
        let gets: Vec<RangedGet<'_>> = keys[..PREFIX]
            .iter()
            .zip(&ranges)
            .map(|(key, ranges)| RangedGet { key, ranges })
            .collect();
        // Per key: the bytes delivered, or that key's error (missing, corrupt).
        for r in store.batch_get_ranges(&gets)? {
            bytes += r?;
        }
        first_group.get_or_insert(t0.elapsed());
        // Here the model would run the group's layers while the next group loads.
    }
    let total = t0.elapsed();

    // Every restored byte of the prefix matches what was written; the pages past it stay zero.
    let mut mismatched = 0;
    for (l, buf) in restored.iter().enumerate() {
        for (i, &b) in buf.iter().enumerate() {
            let (p, at) = (i / LAYER_BYTES as usize, i % LAYER_BYTES as usize);
            let want = if p < PREFIX { byte(p, l, at) } else { 0 };
            mismatched += usize::from(b != want);
        }
    }
    println!(
        "restored {PREFIX} of {PAGES} pages, {LAYERS} layers of {LAYER_BYTES} B in {} groups of {GROUP}: \
         {bytes} B, first group after {} us, all after {} us, {mismatched} bytes mismatched",
        LAYERS.div_ceil(GROUP),
        first_group.unwrap_or_default().as_micros(),
        total.as_micros(),
    );

    for buf in written.iter().chain(&restored) {
        store.deregister_buffer(buf.as_ptr() as u64).await?;
    }
    store.close().await?;
    if mismatched != 0 {
        return Err(format!("{mismatched} restored bytes differ from what was written").into());
    }
    Ok(())
}
