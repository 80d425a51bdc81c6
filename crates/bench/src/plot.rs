//! Line charts of the papers' kind (latency against throughput, one line per policy), as PNG or
//! SVG, with an embedded font so no system font library is needed.

use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;

/// One line of a chart.
#[derive(Clone, Debug)]
pub struct Series {
    pub label: String,
    /// (x, y) points, drawn in the order given.
    pub points: Vec<(f64, f64)>,
}

#[derive(Clone, Debug)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Plot y on a log scale (tails span decades).
    pub log_y: bool,
}

static FONT: Once = Once::new();

fn register_font() {
    FONT.call_once(|| {
        // The embedded DejaVu Sans stands in for every family plotters asks for.
        for family in ["sans-serif", "serif", "monospace"] {
            let _ = plotters::style::register_font(family, FontStyle::Normal, dejavu::sans::regular());
            let _ = plotters::style::register_font(family, FontStyle::Bold, dejavu::sans::bold());
        }
    });
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Draws the chart to `path`: `.svg` writes SVG, anything else PNG (1000x640).
pub fn draw(chart: &Chart, path: &Path) -> Result<(), String> {
    register_font();
    let is_svg = path.extension().is_some_and(|e| e == "svg");
    if is_svg {
        let root = SVGBackend::new(path, (1000, 640)).into_drawing_area();
        draw_on(chart, root)
    } else {
        let root = BitMapBackend::new(path, (1000, 640)).into_drawing_area();
        draw_on(chart, root)
    }
}

fn draw_on<DB: DrawingBackend>(chart: &Chart, root: DrawingArea<DB, plotters::coord::Shift>) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let err = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let points: Vec<(f64, f64)> =
        chart.series.iter().flat_map(|s| s.points.iter().copied()).filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
    if points.is_empty() {
        return Err(format!("chart '{}' has no points", chart.title));
    }
    let x_max = points.iter().map(|p| p.0).fold(0.0f64, f64::max) * 1.05;
    let y_min_pos = points.iter().map(|p| p.1).filter(|&y| y > 0.0).fold(f64::INFINITY, f64::min);
    let y_max = points.iter().map(|p| p.1).fold(0.0f64, f64::max) * 1.1;
    // An all-zero series (no deadline missed) still gets a visible axis.
    let y_max = if y_max > 0.0 { y_max } else { 1.0 };
    let x_max = if x_max > 0.0 { x_max } else { 1.0 };
    // The legend gets a panel of its own on the right, so it never hides a curve.
    let label_chars = chart.series.iter().map(|s| s.label.chars().count()).max().unwrap_or(0) as u32;
    let legend_px = (label_chars * 8 + 48).clamp(120, 360);
    let (width, _) = root.dim_in_pixel();
    let (plot_area, legend_area) = root.split_horizontally(width.saturating_sub(legend_px));
    for (i, s) in chart.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let y = 80 + 24 * i as i32;
        legend_area.draw(&PathElement::new(vec![(4, y), (26, y)], color.stroke_width(3))).map_err(|e| err(&e))?;
        legend_area.draw(&Circle::new((15, y), 3, color.filled())).map_err(|e| err(&e))?;
        legend_area.draw(&Text::new(s.label.clone(), (32, y - 8), ("sans-serif", 15))).map_err(|e| err(&e))?;
    }
    let mut builder = ChartBuilder::on(&plot_area);
    builder.caption(&chart.title, ("sans-serif", 24)).margin(16).x_label_area_size(48).y_label_area_size(72);
    macro_rules! finish {
        ($ctx:expr) => {{
            let mut ctx = $ctx;
            ctx.configure_mesh()
                .x_desc(chart.x_label.as_str())
                .y_desc(chart.y_label.as_str())
                .label_style(("sans-serif", 15))
                .draw()
                .map_err(|e| err(&e))?;
            for (i, s) in chart.series.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                let pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .copied()
                    .filter(|p| p.0.is_finite() && p.1.is_finite() && (!chart.log_y || p.1 > 0.0))
                    .collect();
                ctx.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2))).map_err(|e| err(&e))?;
                ctx.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled()))).map_err(|e| err(&e))?;
            }
        }};
    }
    if chart.log_y {
        let lo = (y_min_pos * 0.8).max(1e-9);
        let hi = y_max.max(lo * 10.0);
        finish!(
            builder
                .build_cartesian_2d(0.0..x_max, (lo..hi).log_scale().with_key_points(log_ticks(lo, hi)))
                .map_err(|e| err(&e))?
        );
    } else {
        finish!(builder.build_cartesian_2d(0.0..x_max, 0.0..y_max).map_err(|e| err(&e))?);
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Ticks of a logarithmic axis: 1, 2 and 5 times each power of ten within [lo, hi].
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut ticks = Vec::new();
    let mut decade = 10f64.powf(lo.log10().floor());
    while decade <= hi {
        for m in [1.0, 2.0, 5.0] {
            let t = decade * m;
            if t >= lo && t <= hi {
                ticks.push(t);
            }
        }
        decade *= 10.0;
    }
    ticks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_png_and_svg() {
        let chart = Chart {
            title: "p99 latency vs throughput".into(),
            x_label: "throughput (req/s)".into(),
            y_label: "p99 (ms)".into(),
            series: vec![
                Series { label: "streams".into(), points: vec![(100.0, 1.0), (200.0, 2.5), (300.0, 9.0)] },
                Series { label: "paella".into(), points: vec![(100.0, 0.8), (200.0, 1.2), (300.0, 2.0)] },
            ],
            log_y: true,
        };
        let dir = std::env::temp_dir().join(format!("kairos-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["c.png", "c.svg"] {
            let p = dir.join(name);
            draw(&chart, &p).unwrap();
            let len = std::fs::metadata(&p).unwrap().len();
            assert!(len > 2000, "{name} is only {len} bytes");
        }
        let empty = Chart { series: vec![], ..chart };
        assert!(draw(&empty, &dir.join("e.png")).is_err());
        std::fs::remove_dir_all(dir).ok();
    }
}
