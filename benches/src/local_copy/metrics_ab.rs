//! `te-bench local-copy --metrics-ab`: the same scattered copy through two engines of this
//! process, one exporting metrics (`TE_METRICS_LISTEN` on loopback) and one not, repetitions
//! interleaved (the order alternating) so both see the same machine; reports each one's median
//! and the ratio (of the medians, and the median of each repetition's on/off ratio). With
//! `--metrics-ab-control` neither engine exports metrics: the spread of that ratio around 1 is the
//! noise floor of the machine. The engine's promise: with metrics off the data path does no extra work, and
//! with them on the cost is per batch, not per fragment.

use std::time::Duration;

use indicatif::ProgressBar;
use te_core::TransferEngine;

use super::{host_setup, run_engine, verify, zero, Args};
use crate::util::{median, paired_ratio, print_json};

/// Measures every size; `engines` is [metrics off, metrics on].
pub(super) fn run(
    engines: [&TransferEngine; 2],
    rt: &tokio::runtime::Runtime,
    sizes: &[u64],
    fragments_for: impl Fn(u64) -> usize,
    args: &Args,
    bar: &ProgressBar,
) -> Result<(), String> {
    if !args.json {
        println!(
            "local copy, metrics off vs on (interleaved, median of {} runs each): ratio = on / off time",
            args.repeat
        );
        println!(
            "{:>9} {:>9} {:>14} {:>14} {:>8} {:>8}",
            "frag_B", "frags", "off_ns/frag", "on_ns/frag", "ratio", "paired"
        );
    }
    for &frag in sizes {
        let n = fragments_for(frag);
        let [off, on] = engines;
        let (off_setup, off_reqs) = host_setup(off, rt, frag, n)?;
        let (on_setup, on_reqs) = host_setup(on, rt, frag, n)?;
        // Untimed warm-up into every destination; with --verify, each engine's copy is checked.
        let mut mismatched = 0u64;
        for (engine, setup, reqs) in [(off, &off_setup, &off_reqs), (on, &on_setup, &on_reqs)] {
            for (dst, r) in setup.dsts.iter().zip(reqs) {
                if args.verify {
                    zero(dst);
                }
                run_engine(engine, r)?;
                if args.verify {
                    mismatched += verify(setup, dst, frag);
                }
            }
        }
        if mismatched > 0 {
            return Err(format!("--verify: {mismatched} mismatched bytes at {frag} B fragments"));
        }
        let (mut t_off, mut t_on) = (Vec::new(), Vec::new());
        for rep in 0..args.repeat {
            let d = rep % 2;
            if rep % 2 == 0 {
                t_off.push(run_engine(off, &off_reqs[d])?);
                t_on.push(run_engine(on, &on_reqs[d])?);
            } else {
                t_on.push(run_engine(on, &on_reqs[d])?);
                t_off.push(run_engine(off, &off_reqs[d])?);
            }
            bar.inc(1);
        }
        let paired = paired_ratio(&t_off, &t_on);
        let (m_off, m_on) = (median(&mut t_off), median(&mut t_on));
        let per = |d: Duration| d.as_nanos() as f64 / n as f64;
        let ratio = m_on.as_secs_f64() / m_off.as_secs_f64();
        if args.json {
            print_json(&serde_json::json!({
                "bench": "local-copy-metrics-ab",
                "fragment_bytes": frag,
                "fragments": n,
                "repeat": args.repeat,
                "off_ns_per_fragment": per(m_off),
                "on_ns_per_fragment": per(m_on),
                "off_us_per_batch": m_off.as_secs_f64() * 1e6,
                "on_us_per_batch": m_on.as_secs_f64() * 1e6,
                "ratio_on_vs_off": ratio,
                "paired_ratio_median": paired,
                "control": args.metrics_ab_control,
                "exporting": [off.metrics_addr().is_some(), on.metrics_addr().is_some()],
                "verified": args.verify,
            }));
        } else {
            bar.suspend(|| {
                println!(
                    "{:>9} {:>9} {:>14.1} {:>14.1} {:>8.3} {:>8.3}",
                    frag,
                    n,
                    per(m_off),
                    per(m_on),
                    ratio,
                    paired
                )
            });
        }
    }
    Ok(())
}
