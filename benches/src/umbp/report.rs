//! Reporting a restore run: the offload line, then per rank count the medians, p95s and ratios
//! of the ranks' samples, as one text line (plus phases) or one JSON object.

use std::time::Duration;

use te_base::PhaseReport;
use umbp::StoreStats;

use super::ranks::Sample;
use super::setup::Pool;
use super::Args;
use crate::util::{median, print_json};

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// What the report lines need besides the samples: the run's geometry and the offload's outcome.
pub(super) struct RunInfo<'a> {
    pub(super) args: &'a Args,
    pub(super) standalone: bool,
    pub(super) ssd: bool,
    pub(super) pools: &'a [Pool],
    /// The pool with the smallest layers.
    pub(super) smallest: usize,
    /// Fragments per restore, all pools and in the smallest pool.
    pub(super) fragments: u64,
    pub(super) smallest_fragments: u64,
    /// Logical layers a restore simulates compute for.
    pub(super) compute_layers: u32,
    pub(super) page_bytes: u64,
    pub(super) put_gbps: f64,
    pub(super) put_bytes: u64,
    pub(super) put_failures: u64,
    pub(super) layer_read_ratio: Option<f64>,
}

/// The offload line (text mode only).
pub(super) fn put_line(info: &RunInfo<'_>) {
    let args = info.args;
    if !args.json {
        println!(
            "umbp tier={} pools={} pages/rank={} layer-group={} page={} B; put {:.2} GB/s ({} B ok, {} failed)",
            args.tier,
            info.pools.len(),
            args.pages,
            args.layer_group,
            info.page_bytes,
            info.put_gbps,
            info.put_bytes,
            info.put_failures
        );
    }
}

/// The figures of one rank count, over every rank's samples.
struct Summary {
    restore: Duration,
    restore95: Duration,
    ttfl: Duration,
    ttfl95: Duration,
    load: Duration,
    memcpy: Duration,
    /// Median load time over the memcpy loop's, all pools and the smallest pool's calls alone.
    over: Duration,
    small_over: Duration,
    mismatched: u64,
}

impl Summary {
    fn of(samples: &[Vec<Sample>]) -> Summary {
        let all: Vec<&Sample> = samples.iter().flatten().collect();
        let pick = |f: &dyn Fn(&Sample) -> Duration, q: f64| {
            let mut v: Vec<Duration> = all.iter().map(|s| f(s)).collect();
            v.sort_unstable();
            v[((v.len() - 1) as f64 * q).round() as usize]
        };
        let mut small_over: Vec<Duration> = all
            .iter()
            .map(|s| s.smallest_load.saturating_sub(s.smallest_memcpy))
            .collect();
        let mut over: Vec<Duration> = all.iter().map(|s| s.load.saturating_sub(s.memcpy)).collect();
        Summary {
            restore: pick(&|s| s.restore, 0.5),
            restore95: pick(&|s| s.restore, 0.95),
            ttfl: pick(&|s| s.ttfl, 0.5),
            ttfl95: pick(&|s| s.ttfl, 0.95),
            load: pick(&|s| s.load, 0.5),
            memcpy: pick(&|s| s.memcpy, 0.5),
            small_over: median(&mut small_over),
            over: median(&mut over),
            mismatched: all.iter().map(|s| s.mismatched).sum(),
        }
    }
}

/// Prints the figures of one rank count: `before` and `after` are the store's stats around it,
/// `phases` its per-phase timings when recorded.
pub(super) fn rank_count(
    info: &RunInfo<'_>,
    ranks: usize,
    samples: &[Vec<Sample>],
    before: &StoreStats,
    after: &StoreStats,
    phases: Option<PhaseReport>,
) {
    let (args, pools, smallest, ssd) = (info.args, info.pools, info.smallest, info.ssd);
    let s = Summary::of(samples);
    let bytes_per_restore = info.page_bytes * args.pages as u64;
    let gbps = bytes_per_restore as f64 / s.load.as_secs_f64() / 1e9;
    let ns_per_fragment = s.over.as_nanos() as f64 / info.fragments as f64;
    let ns_per_fragment_smallest = s.small_over.as_nanos() as f64 / info.smallest_fragments as f64;
    let ssd_read = after.core.ssd_read_bytes - before.core.ssd_read_bytes;
    let delivered = (after.core.ssd_delivered_bytes - before.core.ssd_delivered_bytes).max(1);
    if args.json {
        let phases = phases.map(|p| {
            let mut m = serde_json::Map::new();
            for ph in te_base::Phase::ALL {
                m.insert(ph.name().into(), serde_json::json!(p.us_per_call(ph)));
            }
            m.insert("calls".into(), serde_json::json!(p.calls));
            m.insert(
                "items_per_call".into(),
                serde_json::json!(p.items as f64 / p.calls.max(1) as f64),
            );
            serde_json::Value::Object(m)
        });
        print_json(&serde_json::json!({
            "bench": "umbp",
            "mode": if info.standalone { "standalone" } else { "local" },
            "tier": args.tier,
            "ranks": ranks,
            "pages": args.pages,
            "layer_group": args.layer_group,
            "calls_per_group": args.calls_per_group,
            "requests": args.requests,
            "compute_ms": info.compute_layers as f64 * args.compute_us_per_layer as f64 / 1e3,
            "restore_ms_p50": ms(s.restore),
            "restore_ms_p95": ms(s.restore95),
            "ttfl_us_p50": us(s.ttfl),
            "ttfl_us_p95": us(s.ttfl95),
            "load_ms_p50": ms(s.load),
            "load_gbps": gbps,
            "memcpy_loop_ms": ms(s.memcpy),
            "load_over_memcpy": s.load.as_secs_f64() / s.memcpy.as_secs_f64(),
            "fragments": info.fragments,
            "bytes": bytes_per_restore,
            "ns_per_fragment": ns_per_fragment,
            "smallest_pool": pools[smallest].name,
            "smallest_layer_bytes": pools[smallest].layer_bytes,
            "ns_per_fragment_smallest": ns_per_fragment_smallest,
            "mismatched_bytes": s.mismatched,
            "verified": args.verify,
            "put_gbps": info.put_gbps,
            "put_failures": info.put_failures,
            "ssd_read_bytes": ssd_read,
            "ssd_read_over_delivered": if ssd { Some(ssd_read as f64 / delivered as f64) } else { None },
            "ssd_layer_read_ratio": info.layer_read_ratio,
            "ssd_io_engine": after.core.ssd_io_engine,
            "ssd_direct_io": after.core.ssd_direct_io,
            "phases_us_per_call": phases,
        }));
        return;
    }
    println!(
        "{}ranks={ranks}: restore {:.2} ms (p95 {:.2}), TTFL {:.0} us (p95 {:.0}), load {:.2} ms = {:.2} GB/s, memcpy loop {:.2} ms (load/memcpy {:.2}x), overhead {:.0} ns/fragment ({:.0} ns at {} B), mismatched {}{}",
        if info.standalone { "standalone " } else { "" },
        ms(s.restore),
        ms(s.restore95),
        us(s.ttfl),
        us(s.ttfl95),
        ms(s.load),
        gbps,
        ms(s.memcpy),
        s.load.as_secs_f64() / s.memcpy.as_secs_f64(),
        ns_per_fragment,
        ns_per_fragment_smallest,
        pools[smallest].layer_bytes,
        if args.verify { s.mismatched.to_string() } else { "(not verified)".into() },
        if ssd {
            format!(
                ", SSD ({}, O_DIRECT {}) read {:.2}x delivered, one layer alone {:.2}x its bytes",
                after.core.ssd_io_engine,
                after.core.ssd_direct_io,
                ssd_read as f64 / delivered as f64,
                info.layer_read_ratio.unwrap_or(0.0)
            )
        } else {
            String::new()
        }
    );
    if let Some(p) = phases {
        let parts: Vec<String> = te_base::Phase::ALL
            .iter()
            .map(|&ph| format!("{} {:.1}", ph.name(), p.us_per_call(ph)))
            .collect();
        println!(
            "  phases (us/call over {} calls, {:.0} ranges/call): {}",
            p.calls,
            p.items as f64 / p.calls.max(1) as f64,
            parts.join(", ")
        );
    }
}
