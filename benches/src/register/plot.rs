//! `--plot FILE.svg`: time against cap, one line per (ranks, order).

use std::path::Path;

use plotters::prelude::*;

use super::report::{cap_label, Cap, Cell};

/// Draws the sweep. The x axis lists the caps in the order they were swept.
pub fn draw(path: &Path, title: &str, cells: &[Cell], caps: &[Cap], orders: &[String]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("--plot {}: {e}", path.display());
    let ymax = cells.iter().map(Cell::median_s).fold(0.0, f64::max) * 1.1 + 1e-9;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let labels: Vec<String> = caps.iter().map(|c| cap_label(*c)).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(-0.3f64..(caps.len() as f64 - 0.7), 0f64..ymax)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("per-process cap (TE_MAX_CONCURRENT_REG_MR)")
        .y_desc("slowest rank, seconds")
        .x_labels(caps.len())
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .draw()
        .map_err(|e| err(&e))?;

    let mut ranks: Vec<usize> = cells.iter().map(|c| c.ranks).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let palette = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(23, 190, 207),
    ];
    let mut series = 0usize;
    for r in &ranks {
        for o in orders {
            let points: Vec<(f64, f64)> = caps
                .iter()
                .enumerate()
                .filter_map(|(i, cap)| {
                    cells
                        .iter()
                        .find(|c| c.ranks == *r && c.cap == *cap && &c.order == o)
                        .map(|c| (i as f64, c.median_s()))
                })
                .collect();
            if points.is_empty() {
                continue;
            }
            let color = palette[series % palette.len()];
            series += 1;
            let label = if ranks.len() > 1 {
                format!("{r} rank{}, {o}", if *r == 1 { "" } else { "s" })
            } else {
                o.clone()
            };
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            chart
                .draw_series(points.into_iter().map(|p| Circle::new(p, 3, color.filled())))
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
