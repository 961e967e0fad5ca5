//! The local copy's data path alone (`Peer::submit`, no engine), against a plain `memcpy` loop
//! over the same fragments, timed in the same run. The layout is te-bench local-copy's: fragment
//! `i` read from slot `i` of the source and written to a permuted slot of the destination, slots
//! `fragment + 64` bytes apart, so nothing coalesces.
//!
//! `cargo bench -p te-transport-local --bench submit [-- FRAGMENTS [REPEAT [SIZES [THREADS]]]]`
//! (SIZES and THREADS comma-separated; defaults 2048, 15, 1728,8448,37440, 1,2); prints one JSON
//! object per fragment size and copy-thread count with medians of REPEAT runs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use te_base::{
    BatchState, ExportedBuffer, MemoryLocation, Peer, Phase, PhaseStats, PhaseTimer, RegionId, RegionInfo,
    ResolvedRequest, SegmentDescriptor, SubmitContext, TransferOp, Transport, TransportEndpoint,
};
use te_transport_local::{LocalConfig, LocalTransport};

mod common;
use common::buffer;

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn slots(n: usize, frag: u64) -> Vec<(u64, u64)> {
    let stride = frag + 64;
    let mut mult = (n / 2 + 1) | 1;
    while gcd(mult, n) != 1 {
        mult += 2;
    }
    (0..n)
        .map(|i| (i as u64 * stride, ((i * mult) % n) as u64 * stride))
        .collect()
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let n: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(2048);
    let repeat: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(15);
    let list = |i: usize, default: &str| -> Vec<u64> {
        args.get(i)
            .map(String::as_str)
            .unwrap_or(default)
            .split(',')
            .map(|v| v.parse().expect("a comma-separated list of numbers"))
            .collect()
    };
    let (sizes, thread_counts) = (list(2, "1728,8448,37440"), list(3, "1,2"));
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    for &threads in &thread_counts {
        let threads = threads as usize;
        let t = LocalTransport::new(LocalConfig {
            copy_threads: threads,
            ..LocalConfig::default()
        })
        .expect("transport");
        for &frag in &sizes {
            let span = n * (frag as usize + 64);
            let (src, dst) = (buffer(span), buffer(span));
            let regions = [
                RegionInfo {
                    id: RegionId(frag * 10 + threads as u64 * 2),
                    base: src.addr(),
                    len: span as u64,
                    location: MemoryLocation::HOST,
                    exported: false,
                },
                RegionInfo {
                    id: RegionId(frag * 10 + threads as u64 * 2 + 1),
                    base: dst.addr(),
                    len: span as u64,
                    location: MemoryLocation::HOST,
                    exported: true,
                },
            ];
            rt.block_on(t.register(&regions)).expect("register");
            let mut d = SegmentDescriptor::new("bench", 1);
            d.transports.push(TransportEndpoint {
                transport: "local".into(),
                info: t.endpoint(),
            });
            d.buffers.push(ExportedBuffer {
                base: dst.addr(),
                len: span as u64,
                location: MemoryLocation::HOST,
                keys: Default::default(),
            });
            let peer: Arc<dyn Peer> = rt.block_on(t.connect(&d)).expect("connect");
            let layout = slots(n, frag);
            let reqs: Vec<ResolvedRequest> = layout
                .iter()
                .enumerate()
                .map(|(i, &(s, dd))| ResolvedRequest {
                    index: i as u32,
                    op: TransferOp::Write,
                    len: frag,
                    local_addr: src.addr() + s,
                    local_region: regions[0].id,
                    remote_addr: dst.addr() + dd,
                    remote_buffer: 0,
                })
                .collect();
            let lens: Box<[u64]> = reqs.iter().map(|r| r.len).collect();
            let stats = Arc::new(PhaseStats::default());
            let ctx = SubmitContext {
                timer: PhaseTimer::on(stats.clone()),
                background: false,
            };
            let run_transport = || {
                let copy = reqs.clone();
                let state = BatchState::new(lens.clone());
                let t0 = Instant::now();
                peer.submit(copy, &state, &ctx).expect("submit");
                let e = t0.elapsed();
                assert!(state.is_complete());
                e
            };
            let run_loop = || {
                let (s, dd) = (src.as_ptr(), dst.as_ptr());
                let t0 = Instant::now();
                for &(so, d) in &layout {
                    // SAFETY: both ranges lie inside their buffers; the buffers are distinct.
                    unsafe { std::ptr::copy_nonoverlapping(s.add(so as usize), dd.add(d as usize), frag as usize) };
                }
                std::hint::black_box(dd);
                t0.elapsed()
            };
            run_transport();
            run_loop();
            stats.reset();
            let (mut tt, mut ll) = (Vec::new(), Vec::new());
            for _ in 0..repeat {
                tt.push(run_transport());
                ll.push(run_loop());
            }
            let (tm, lm) = (median(&mut tt), median(&mut ll));
            let total = frag * n as u64;
            let phases = stats.report();
            let per_fragment = |p: Phase| phases.nanos[p as usize] as f64 / (repeat * n) as f64;
            println!(
                "{}",
                serde_json::json!({
                    "bench": "local-transport-submit",
                    "threads": threads,
                    "fragment_bytes": frag,
                    "fragments": n,
                    "ns_per_fragment": tm.as_nanos() as f64 / n as f64,
                    "overhead_ns_per_fragment": (tm.as_nanos() as f64 - lm.as_nanos() as f64) / n as f64,
                    "gbps": total as f64 / tm.as_secs_f64() / 1e9,
                    "memcpy_loop_gbps": total as f64 / lm.as_secs_f64() / 1e9,
                    "ratio_vs_memcpy_loop": lm.as_secs_f64() / tm.as_secs_f64(),
                    "resolve_and_plan_ns_per_fragment": per_fragment(Phase::Plan),
                    "copy_ns_per_fragment": per_fragment(Phase::Submit),
                })
            );
            rt.block_on(t.deregister(&regions)).expect("deregister");
        }
    }
}
