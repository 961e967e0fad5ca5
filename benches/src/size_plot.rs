//! GB/s against a byte size on a log-2 axis, the plot of `te-bench transfer --block-sizes` and
//! `te-bench local-copy --plot`: one solid line per path, and the ratio of ours to its baseline as
//! a dashed line on the right-hand axis, each point labelled with its value.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

/// One line: (size in bytes, value) points.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(u64, f64)>,
}

/// What one plot shows.
#[derive(Clone, Debug, PartialEq)]
pub struct SizePlot {
    pub title: String,
    pub x_desc: String,
    /// GB/s, left axis.
    pub lines: Vec<Series>,
    /// Ratios (ours / baseline), right axis.
    pub ratios: Vec<Series>,
}

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("--plot {}: no point to draw", path.display())]
    Empty { path: PathBuf },
    #[error("--plot {}: {message}", path.display())]
    Draw { path: PathBuf, message: String },
}

/// `4096` -> `4K`, `1728` -> `1728`, `1048576` -> `1M`: the size parser's own spelling.
pub fn size_label(bytes: u64) -> String {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
];

/// Writes the plot as SVG to `path`.
pub fn draw(path: &Path, plot: &SizePlot) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let all = || plot.lines.iter().chain(&plot.ratios).flat_map(|s| s.points.iter());
    let (Some(min), Some(max)) = (
        all().map(|p| p.0).filter(|&b| b > 0).min(),
        all().map(|p| p.0).filter(|&b| b > 0).max(),
    ) else {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
        });
    };
    let (lo, hi) = ((min as f64).log2() - 0.3, (max as f64).log2() + 0.3);
    let finite = |v: f64| if v.is_finite() { v } else { 0.0 };
    let ymax = plot
        .lines
        .iter()
        .flat_map(|s| s.points.iter().map(|p| finite(p.1)))
        .fold(0.0, f64::max)
        * 1.15
        + 1e-9;
    let rmax = (plot
        .ratios
        .iter()
        .flat_map(|s| s.points.iter().map(|p| finite(p.1)))
        .fold(1.0, f64::max)
        * 1.25)
        .max(1.25);

    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(&plot.title, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .right_y_label_area_size(if plot.ratios.is_empty() { 0 } else { 64 })
        .build_cartesian_2d(lo..hi, 0f64..ymax)
        .map_err(|e| err(&e))?
        .set_secondary_coord(lo..hi, 0f64..rmax);
    // Ticks at whole powers of two, labelled as sizes (asking for half steps makes plotters
    // put a tick on every whole one; the formatter leaves the halves blank).
    let ticks = 2 * ((hi.floor() - lo.ceil()) as usize) + 1;
    let x_label = |x: &f64| {
        let k = x.round();
        if (x - k).abs() < 1e-6 && (0.0..63.0).contains(&k) {
            size_label(1u64 << k as u32)
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .x_desc(plot.x_desc.as_str())
        .y_desc("GB/s (solid)")
        .x_labels(ticks)
        .x_label_formatter(&x_label)
        .draw()
        .map_err(|e| err(&e))?;
    let log2 = |b: u64| (b.max(1) as f64).log2();
    for (i, s) in plot.lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let points: Vec<(f64, f64)> = s.points.iter().map(|&(b, v)| (log2(b), v)).collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(s.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        chart
            .draw_series(points.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    if !plot.ratios.is_empty() {
        chart
            .configure_secondary_axes()
            .y_desc("ratio (dashed)")
            .draw()
            .map_err(|e| err(&e))?;
        // Parity: where ours equals its baseline.
        chart
            .draw_secondary_series(DashedLineSeries::new(
                [(lo, 1.0), (hi, 1.0)],
                2,
                5,
                BLACK.mix(0.35).stroke_width(1),
            ))
            .map_err(|e| err(&e))?;
        for (i, s) in plot.ratios.iter().enumerate() {
            let color = PALETTE[(plot.lines.len() + i) % PALETTE.len()];
            let points: Vec<(f64, f64)> = s.points.iter().map(|&(b, v)| (log2(b), v)).collect();
            chart
                .draw_secondary_series(DashedLineSeries::new(points.clone(), 8, 5, color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(s.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 6, y)], color.stroke_width(2)));
            chart
                .draw_secondary_series(points.iter().map(|&p| Cross::new(p, 4, color.stroke_width(2))))
                .map_err(|e| err(&e))?;
            chart
                .draw_secondary_series(points.iter().map(|&(x, r)| {
                    // Just above and right of its cross.
                    EmptyElement::at((x, r))
                        + Text::new(
                            format!("{r:.2}x"),
                            (5, -18),
                            ("sans-serif", 13).into_font().color(&color),
                        )
                }))
                .map_err(|e| err(&e))?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(label: &str, points: &[(u64, f64)]) -> Series {
        Series {
            label: label.into(),
            points: points.to_vec(),
        }
    }

    #[test]
    fn sizes_are_labelled_as_the_size_parser_reads_them() {
        assert_eq!(size_label(4096), "4K");
        assert_eq!(size_label(1 << 20), "1M");
        assert_eq!(size_label(3 << 30), "3G");
        assert_eq!(size_label(1728), "1728");
        assert_eq!(size_label(512), "512");
        for b in [4096u64, 1 << 20, 1728, 37_440] {
            assert_eq!(te_core::config::parse_byte_size(&size_label(b)), Ok(b));
        }
    }

    #[test]
    fn the_plot_is_an_svg_with_every_series_and_ratio() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sweep.svg");
        let plot = SizePlot {
            title: "sweep title".into(),
            x_desc: "block size".into(),
            lines: vec![
                series("ours-line", &[(4096, 1.5), (65_536, 3.0), (1 << 20, 4.0)]),
                series("baseline-line", &[(4096, 2.0), (65_536, 2.5), (1 << 20, 3.5)]),
            ],
            ratios: vec![series(
                "ratio-line",
                &[(4096, 0.75), (65_536, 1.2), (1 << 20, 4.0 / 3.5)],
            )],
        };
        draw(&path, &plot).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.trim_start().starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
        for text in [
            "sweep title",
            "block size",
            "ours-line",
            "baseline-line",
            "ratio-line",
            "0.75x",
            "1.20x",
            "4K",
            "64K",
            "1M",
        ] {
            assert!(svg.contains(text), "no {text:?} in the SVG");
        }
    }

    #[test]
    fn a_plot_without_points_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let plot = SizePlot {
            title: "t".into(),
            x_desc: "x".into(),
            lines: vec![series("empty", &[])],
            ratios: Vec::new(),
        };
        assert!(matches!(
            draw(&dir.path().join("x.svg"), &plot),
            Err(PlotError::Empty { .. })
        ));
    }
}
