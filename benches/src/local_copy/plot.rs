//! `te-bench local-copy --plot FILE.svg`: GB/s against fragment size, per direction, for the
//! engine, its per-fragment baseline (the memcpy loop on the host, the runtime's own copies on a
//! device) and one contiguous copy of the same bytes, with the engine / baseline ratio.

use std::time::Duration;

use super::Measured;
use crate::size_plot::{Series, SizePlot};

/// One measured (direction, fragment size), as drawn.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Row {
    pub dir: String,
    pub frag: u64,
    pub engine_gbps: f64,
    pub baseline_gbps: f64,
    pub contiguous_gbps: f64,
    pub baseline: &'static str,
}

impl Row {
    pub fn new(dir: &str, frag: u64, m: &Measured) -> Row {
        let gbps = |d: Duration| m.total as f64 / d.as_secs_f64() / 1e9;
        Row {
            dir: dir.to_string(),
            frag,
            engine_gbps: gbps(m.engine),
            baseline_gbps: gbps(m.memcpy_loop),
            contiguous_gbps: gbps(m.contiguous),
            baseline: m.baseline,
        }
    }
}

/// Three lines and one ratio per direction, in the order the directions were measured.
pub(super) fn figure(title: &str, rows: &[Row]) -> SizePlot {
    let mut dirs: Vec<&str> = Vec::new();
    for r in rows {
        if !dirs.contains(&r.dir.as_str()) {
            dirs.push(&r.dir);
        }
    }
    let (mut lines, mut ratios) = (Vec::new(), Vec::new());
    for dir in &dirs {
        let of = |f: fn(&Row) -> f64| -> Vec<(u64, f64)> {
            rows.iter().filter(|r| r.dir == *dir).map(|r| (r.frag, f(r))).collect()
        };
        let baseline = rows.iter().find(|r| r.dir == *dir).map_or("baseline", |r| r.baseline);
        let suffix = if dirs.len() > 1 {
            format!(" ({dir})")
        } else {
            String::new()
        };
        lines.push(Series {
            label: format!("engine{suffix}"),
            points: of(|r| r.engine_gbps),
        });
        lines.push(Series {
            label: format!("{baseline}{suffix}"),
            points: of(|r| r.baseline_gbps),
        });
        lines.push(Series {
            label: format!("one contiguous copy of the same bytes{suffix}"),
            points: of(|r| r.contiguous_gbps),
        });
        ratios.push(Series {
            label: format!("ratio engine / {baseline}{suffix}"),
            points: of(|r| r.engine_gbps / r.baseline_gbps),
        });
    }
    SizePlot {
        title: title.to_string(),
        x_desc: "fragment size (bytes)".into(),
        lines,
        ratios,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(dir: &str, frag: u64, engine: f64, baseline: f64) -> Row {
        Row {
            dir: dir.into(),
            frag,
            engine_gbps: engine,
            baseline_gbps: baseline,
            contiguous_gbps: 8.0,
            baseline: "memcpy per fragment",
        }
    }

    #[test]
    fn one_direction_has_three_lines_and_a_ratio() {
        let f = figure("t", &[row("h2h", 1728, 2.0, 4.0), row("h2h", 37_440, 6.0, 3.0)]);
        assert_eq!(f.lines.len(), 3);
        assert_eq!(f.lines[0].label, "engine");
        assert_eq!(f.lines[1].label, "memcpy per fragment");
        assert_eq!(f.ratios[0].points, vec![(1728, 0.5), (37_440, 2.0)]);
    }

    #[test]
    fn each_direction_is_its_own_set_of_lines() {
        let f = figure("t", &[row("h2d", 4096, 1.0, 1.0), row("d2h", 4096, 1.0, 2.0)]);
        assert_eq!((f.lines.len(), f.ratios.len()), (6, 2));
        assert_eq!(f.lines[3].label, "engine (d2h)");
        assert_eq!(f.ratios[1].points, vec![(4096, 0.5)]);
    }
}
