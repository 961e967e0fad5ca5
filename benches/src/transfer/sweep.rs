//! `te-bench transfer --block-sizes 4K,64K,1M [--plot FILE.svg]`: the transfer measurement at
//! each block size over one connection and one pair of buffers, every size moving the same
//! `--total-bytes` (so the working set is the same at every point), each size's `--repeat` runs
//! interleaved with its `--baseline` runs at that block size. One row per size (table or
//! `--json`), then the plot: GB/s against block size for ours and the baseline, and their ratio
//! (the median of each repetition's ratio to the baseline run beside it: `ratio_gbps_paired`).

use super::baseline::median_f64;
use super::{measure_point, row, Args, Session, WRITE_SEED};
use crate::size_plot::{self, Series, SizePlot};
use crate::util::{parse_sizes, print_json, SizeListError};

/// The swept block sizes in the order given (non-empty, no zero, no repeats).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSizes(Vec<u64>);

/// What is wrong with a `--block-sizes` list or its `--total-bytes`.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SweepError {
    #[error("--block-sizes: {0}")]
    List(#[from] SizeListError),
    #[error("--total-bytes ({total}) must be a multiple of every block size, and {block} does not divide it")]
    NotAMultiple { total: u64, block: u64 },
}

/// Parses `4K,16K,1M` (see [`parse_sizes`]).
pub fn parse_block_sizes(s: &str) -> Result<BlockSizes, SweepError> {
    Ok(BlockSizes(parse_sizes(s)?))
}

impl BlockSizes {
    pub fn sizes(&self) -> &[u64] {
        &self.0
    }

    pub fn first(&self) -> u64 {
        self.0[0]
    }

    /// Every point moves `total` bytes, so each block size must divide it.
    pub fn check_total(&self, total: u64) -> Result<(), SweepError> {
        match self.0.iter().find(|&&b| total == 0 || !total.is_multiple_of(b)) {
            Some(&block) => Err(SweepError::NotAMultiple { total, block }),
            None => Ok(()),
        }
    }
}

/// One swept size's medians, as drawn.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Point {
    pub block: u64,
    pub gbps: f64,
    pub baseline_gbps: Option<f64>,
    /// Ours / the baseline: the median of each repetition's ratio to the baseline run beside it.
    pub ratio: Option<f64>,
}

pub(super) async fn run(args: &Args, peer: &str, s: &Session, sizes: &BlockSizes) -> Result<(), String> {
    if !args.json {
        println!(
            "{} {} sweep, {} B per point, median of {} run(s) each{}",
            args.transport,
            args.op,
            args.total_bytes,
            args.repeat,
            args.baseline
                .and_then(|b| clap::ValueEnum::to_possible_value(&b))
                .map(|b| format!(", baseline {} interleaved", b.get_name()))
                .unwrap_or_default()
        );
        println!(
            "{:>10} {:>9} {:>12} {:>7} {:>7} {:>12} {:>9} {:>9} {:>9}",
            "block_B", "GB/s", "baseline", "ratio", "paired", "requests/s", "p50_us", "p99_us", "mismatch"
        );
    }
    let mut points = Vec::with_capacity(sizes.sizes().len());
    let mut baseline_tool = None;
    let mut mismatched = 0u64;
    for (i, &block) in sizes.sizes().iter().enumerate() {
        let point_args = Args {
            block_bytes: block,
            ..args.clone()
        };
        // A pattern no earlier size wrote, so each size's check stands on its own.
        let (m, b) = measure_point(&point_args, s, WRITE_SEED + 1 + i as u64).await?;
        let mut v = row(&point_args, peer, &m, b.as_ref());
        v["sweep_block_sizes"] = serde_json::json!(sizes.sizes());
        let point = Point {
            block,
            gbps: median_f64(m.gbps_runs.clone()),
            baseline_gbps: b.as_ref().and_then(|b| b.gbps),
            ratio: m.ratio_paired,
        };
        if args.json {
            print_json(&v);
        } else {
            println!(
                "{:>10} {:>9.3} {:>12} {:>7} {:>7} {:>12.0} {:>9.1} {:>9.1} {:>9}",
                block,
                point.gbps,
                point.baseline_gbps.map_or_else(|| "-".into(), |g| format!("{g:.3}")),
                point
                    .baseline_gbps
                    .map_or_else(|| "-".into(), |g| format!("{:.2}x", point.gbps / g)),
                point.ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}x")),
                m.requests_per_s,
                m.p50_us,
                m.p99_us,
                m.mismatched_bytes.map_or_else(|| "-".into(), |n| n.to_string())
            );
        }
        if !args.json {
            if let Some(r) = v.get("ratio_gbps_best") {
                println!(
                    "{:>10} also {}: {:.3} GB/s; ours / the better baseline {:.2}x",
                    "",
                    m.also.as_ref().map_or("-", |a| a.tool),
                    m.also.as_ref().and_then(|a| a.gbps).unwrap_or(0.0),
                    r.as_f64().unwrap_or(0.0)
                );
            }
        }
        mismatched += m.mismatched_bytes.unwrap_or(0);
        baseline_tool = b.map(|b| b.tool);
        points.push(point);
    }
    if let Some(path) = &args.plot {
        let ours = match &args.provider {
            Some(p) => format!("te {} ({p})", args.transport),
            None => format!("te {}", args.transport),
        };
        let title = format!(
            "te-bench transfer {} {}, {} MiB per point, median of {}",
            args.transport,
            args.op,
            args.total_bytes as f64 / (1u64 << 20) as f64,
            args.repeat
        );
        let plot = figure(&title, &ours, baseline_tool, &points);
        size_plot::draw(path, &plot).map_err(|e| e.to_string())?;
        eprintln!("plot written to {}", path.display());
    }
    if mismatched > 0 {
        return Err(format!("--verify: {mismatched} mismatched bytes over the sweep"));
    }
    Ok(())
}

/// The sweep as lines: ours, the baseline where one ran, and the ratio ours / baseline.
pub(crate) fn figure(title: &str, ours: &str, baseline: Option<&str>, points: &[Point]) -> SizePlot {
    let mut lines = vec![Series {
        label: ours.to_string(),
        points: points.iter().map(|p| (p.block, p.gbps)).collect(),
    }];
    let mut ratios = Vec::new();
    if let Some(tool) = baseline {
        let base: Vec<(u64, f64)> = points
            .iter()
            .filter_map(|p| p.baseline_gbps.map(|g| (p.block, g)))
            .collect();
        let ratio: Vec<(u64, f64)> = points.iter().filter_map(|p| p.ratio.map(|r| (p.block, r))).collect();
        lines.push(Series {
            label: format!("baseline: {tool}"),
            points: base,
        });
        ratios.push(Series {
            label: format!("ratio {ours} / {tool}, median of per-run ratios"),
            points: ratio,
        });
    }
    SizePlot {
        title: title.to_string(),
        x_desc: "block size (bytes per request)".into(),
        lines,
        ratios,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(argv: &[&str]) -> Result<Args, String> {
        let mut all = vec!["transfer"];
        all.extend_from_slice(argv);
        Cli::try_parse_from(all).map(|c| c.args).map_err(|e| e.to_string())
    }

    #[test]
    fn block_sizes_use_the_project_size_parser() {
        assert_eq!(
            parse_block_sizes("4K,16K,64K,256K,1M,4M").unwrap().sizes(),
            &[4096, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
        );
        assert_eq!(
            parse_block_sizes("4K,4K"),
            Err(SweepError::List(SizeListError::Repeated(4096)))
        );
        assert!(matches!(parse_block_sizes("4Q"), Err(SweepError::List(_))));
    }

    #[test]
    fn every_block_size_must_divide_the_total() {
        let sizes = parse_block_sizes("4K,1M").unwrap();
        assert_eq!(sizes.check_total(64 << 20), Ok(()));
        assert_eq!(
            sizes.check_total(3 << 12),
            Err(SweepError::NotAMultiple {
                total: 3 << 12,
                block: 1 << 20
            })
        );
        assert!(sizes.check_total(0).is_err());
        assert!(parse_block_sizes("3K").unwrap().check_total(64 << 20).is_err());
    }

    #[test]
    fn the_command_line_takes_a_sweep_and_its_plot() {
        let a = parse(&["--block-sizes", "4K,1M", "--plot", "x.svg", "--baseline", "cma"]).unwrap();
        assert_eq!(a.block_sizes.unwrap().sizes(), &[4096, 1 << 20]);
        assert_eq!(a.plot.unwrap().to_str(), Some("x.svg"));
        // One block size or a sweep, not both; a plot only of a sweep; no sweep of the target
        // or of the metrics A/B.
        assert!(parse(&["--block-sizes", "4K", "--block-bytes", "4K"]).is_err());
        assert!(parse(&["--plot", "x.svg"]).is_err());
        assert!(parse(&["--block-sizes", "4K", "--serve"]).is_err());
        assert!(parse(&["--block-sizes", "4K", "--metrics-ab"]).is_err());
        let err = parse(&["--block-sizes", "4K,4K"]).err().unwrap_or_default();
        assert!(err.contains("listed twice"), "{err}");
    }

    #[test]
    fn the_figure_has_ours_the_baseline_and_the_ratio() {
        let points = [
            Point {
                block: 4096,
                gbps: 1.0,
                baseline_gbps: Some(2.0),
                ratio: Some(0.5),
            },
            Point {
                block: 1 << 20,
                gbps: 3.0,
                baseline_gbps: Some(2.0),
                ratio: Some(1.5),
            },
        ];
        let f = figure("t", "te tcp", Some("kernel cross-memory copy"), &points);
        assert_eq!(f.lines.len(), 2);
        assert_eq!(f.lines[1].points, vec![(4096, 2.0), (1 << 20, 2.0)]);
        assert_eq!(f.ratios[0].points, vec![(4096, 0.5), (1 << 20, 1.5)]);
        let alone = figure("t", "te tcp", None, &points);
        assert_eq!((alone.lines.len(), alone.ratios.len()), (1, 0));
    }
}
