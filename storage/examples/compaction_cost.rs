//! What SSD compaction costs: write amplification (bytes rewritten per byte freed) and the latency
//! of restores (whole-object reads) while it runs, against the same restores idle.
//!
//! ```text
//! cargo run --release -p umbp --example compaction_cost -- [DIR|-] [OBJECTS] [REMOVE_PERCENT]
//! ```
//!
//! Stores OBJECTS (512) objects of 1 MiB in DIR (a fresh directory under /tmp) in 32 MiB
//! segments, SSD only, with background compaction off; removes REMOVE_PERCENT (60) of them spread
//! over every segment; times restores of 16 random live objects idle, then while `compact` runs
//! in another thread, and prints both with the compaction's figures.

use std::time::{Duration, Instant};

use umbp::Store;

const OBJ: usize = 1 << 20;
const PER_RESTORE: usize = 16;

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> umbp::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .filter(|a| !a.is_empty() && *a != "-")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join(format!("umbp-compaction-{}", std::process::id())));
    let objects: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(512);
    let remove_pct: usize = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(60);
    let _ = std::fs::remove_dir_all(&dir);
    let store = Store::builder()
        .dram_capacity(0)
        .ssd_dirs(vec![dir.clone()])
        .ssd_segment_bytes(32 << 20)
        .staging_bytes(PER_RESTORE as u64 * (OBJ as u64 + 4096))
        .staging_slots(2)
        .compact_below(0.0)
        .open()
        .await?;
    let mut src = vec![0u8; OBJ];
    // SAFETY: both buffers outlive the store's use of them (deregistered at close).
    unsafe { store.register_buffer(src.as_mut_ptr() as u64, OBJ as u64) }.await?;
    let mut dst = vec![0u8; PER_RESTORE * OBJ];
    // SAFETY: as above.
    unsafe { store.register_buffer(dst.as_mut_ptr() as u64, dst.len() as u64) }.await?;
    for i in 0..objects {
        src.iter_mut().enumerate().for_each(|(o, b)| *b = (o ^ i) as u8);
        store.batch_put(&[(&format!("obj-{i}"), src.as_ptr() as u64, OBJ as u64, 0)])?[0].clone()?;
    }
    store.flush()?;
    // Remove `remove_pct` of every hundred consecutive objects, so every segment has dead bytes.
    let removed = |i: usize| (i * 37) % 100 < remove_pct;
    for i in (0..objects).filter(|&i| removed(i)) {
        store.remove(&format!("obj-{i}"))?;
    }
    let live: Vec<String> = (0..objects)
        .filter(|&i| !removed(i))
        .map(|i| format!("obj-{i}"))
        .collect();
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut restore = |store: &Store| -> umbp::Result<f64> {
        let items: Vec<(&str, u64, u64)> = (0..PER_RESTORE)
            .map(|j| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let k = &live[(rng % live.len() as u64) as usize];
                (k.as_str(), dst.as_ptr() as u64 + (j * OBJ) as u64, OBJ as u64)
            })
            .collect();
        let t = Instant::now();
        for r in store.batch_get(&items)? {
            r?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    let mut idle = Vec::new();
    for _ in 0..40 {
        idle.push(restore(&store)?);
    }
    let before = store.stats().unwrap();
    let bg = store.clone();
    let started = Instant::now();
    let compaction = std::thread::spawn(move || {
        let n = bg.compact(true);
        (n, started.elapsed())
    });
    let mut busy = Vec::new();
    while !compaction.is_finished() && busy.len() < 10_000 {
        busy.push(restore(&store)?);
    }
    let (segments, took): (umbp::Result<u64>, Duration) = compaction.join().expect("compaction thread");
    let segments = segments?;
    let after = store.stats().unwrap();
    let written = after.core.ssd_compaction_written_bytes - before.core.ssd_compaction_written_bytes;
    let freed = after.core.ssd_compaction_freed_bytes - before.core.ssd_compaction_freed_bytes;
    println!(
        "objects {objects} x {} KiB, removed {remove_pct}%, segments compacted {segments} in {:.2} s",
        OBJ >> 10,
        took.as_secs_f64()
    );
    let net = freed.saturating_sub(written);
    println!(
        "compaction rewrote {:.1} MiB, deleted {:.1} MiB of segments, reclaimed {:.1} MiB net: write amplification {:.2} (rewritten per byte reclaimed), {:.2} per live byte; {:.1} MiB/s reclaimed",
        written as f64 / (1 << 20) as f64,
        freed as f64 / (1 << 20) as f64,
        net as f64 / (1 << 20) as f64,
        written as f64 / net.max(1) as f64,
        written as f64 / after.core.ssd_file_bytes.max(1) as f64,
        net as f64 / (1 << 20) as f64 / took.as_secs_f64()
    );
    println!(
        "files {:.1} MiB -> {:.1} MiB",
        before.core.ssd_file_bytes as f64 / (1 << 20) as f64,
        after.core.ssd_file_bytes as f64 / (1 << 20) as f64
    );
    let n_busy = busy.len();
    println!(
        "restore of {PER_RESTORE} x 1 MiB: idle p50 {:.2} ms p95 {:.2} ms ({} restores); during compaction p50 {:.2} ms p95 {:.2} ms ({n_busy} restores)",
        percentile(&mut idle, 0.5),
        percentile(&mut idle, 0.95),
        idle.len(),
        if busy.is_empty() { f64::NAN } else { percentile(&mut busy, 0.5) },
        if busy.is_empty() { f64::NAN } else { percentile(&mut busy, 0.95) },
    );
    store.close().await?;
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
