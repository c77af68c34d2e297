//! SVG line plots of memory over time: one chart per trace, one line per allocator.
//!
//! Hand-written SVG (no plotting dependency): a plot is a handful of polylines, axes with tick
//! labels, and a legend. The output opens in any browser.

use std::fmt::Write as _;

/// One line of a chart.
pub struct Series {
    /// Legend label.
    pub name: String,
    /// `(x, y)` points, x increasing.
    pub points: Vec<(f64, f64)>,
    /// Dashed (used for live bytes and recorded baselines).
    pub dashed: bool,
}

/// One chart.
pub struct Chart {
    /// Title above the chart.
    pub title: String,
    /// Label of the x axis.
    pub x_label: String,
    /// The lines.
    pub series: Vec<Series>,
}

const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Formats bytes for an axis tick.
fn tick_bytes(v: f64) -> String {
    cistern::format_bytes(v.max(0.0) as u64)
}

/// A "nice" step for about `n` ticks over `span`.
fn nice_step(span: f64, n: f64) -> f64 {
    if span <= 0.0 || !span.is_finite() {
        return 1.0;
    }
    let raw = span / n;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f < 1.5 {
        1.0
    } else if f < 3.0 {
        2.0
    } else if f < 7.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// Renders charts stacked vertically into one SVG document.
pub fn render(charts: &[Chart]) -> String {
    let (w, h) = (900.0, 360.0);
    let (ml, mr, mt, mb) = (90.0, 200.0, 40.0, 50.0);
    let total_h = h * charts.len().max(1) as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{total_h}" viewBox="0 0 {w} {total_h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (ci, chart) in charts.iter().enumerate() {
        let oy = ci as f64 * h;
        let pw = w - ml - mr;
        let ph = h - mt - mb;
        let xmax = chart
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .fold(1.0f64, f64::max);
        let ymax = chart
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .fold(1.0f64, f64::max)
            * 1.05;
        let sx = |x: f64| ml + x / xmax * pw;
        let sy = |y: f64| oy + mt + ph - y / ymax * ph;
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" font-size="14" font-weight="bold">{}</text>"#,
            ml,
            oy + 24.0,
            escape(&chart.title)
        );
        // Axes and ticks.
        let _ = writeln!(
            out,
            r##"<rect x="{ml}" y="{}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>"##,
            oy + mt
        );
        let ystep = nice_step(ymax, 5.0);
        let mut y = 0.0;
        while y <= ymax {
            let py = sy(y);
            let _ = writeln!(
                out,
                r##"<line x1="{ml}" y1="{py:.1}" x2="{}" y2="{py:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                ml + pw,
                ml - 6.0,
                py + 4.0,
                tick_bytes(y)
            );
            y += ystep;
        }
        let xstep = nice_step(xmax, 6.0);
        let mut x = 0.0;
        while x <= xmax {
            let px = sx(x);
            let _ = writeln!(
                out,
                r#"<text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                oy + mt + ph + 16.0,
                x as u64
            );
            x += xstep;
        }
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            ml + pw / 2.0,
            oy + h - 12.0,
            escape(&chart.x_label)
        );
        // Lines and legend.
        for (si, s) in chart.series.iter().enumerate() {
            let color = PALETTE[si % PALETTE.len()];
            let mut pts = String::new();
            for &(x, y) in &s.points {
                let _ = write!(pts, "{:.1},{:.1} ", sx(x), sy(y));
            }
            let dash = if s.dashed {
                r#" stroke-dasharray="5,3""#
            } else {
                ""
            };
            let _ = writeln!(
                out,
                r#"<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{}"/>"#,
                pts.trim_end()
            );
            let ly = oy + mt + 14.0 + si as f64 * 18.0;
            let _ = writeln!(
                out,
                r#"<line x1="{}" y1="{ly:.1}" x2="{}" y2="{ly:.1}" stroke="{color}" stroke-width="2"{dash}/><text x="{}" y="{:.1}">{}</text>"#,
                ml + pw + 12.0,
                ml + pw + 36.0,
                ml + pw + 42.0,
                ly + 4.0,
                escape(&s.name)
            );
        }
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_lines_and_escapes_names() {
        let svg = render(&[Chart {
            title: "a <b>".into(),
            x_label: "operation".into(),
            series: vec![
                Series {
                    name: "cistern".into(),
                    points: vec![(0.0, 0.0), (10.0, 1e9)],
                    dashed: false,
                },
                Series {
                    name: "live".into(),
                    points: vec![(0.0, 0.0), (10.0, 5e8)],
                    dashed: true,
                },
            ],
        }]);
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a &lt;b&gt;"));
        assert!(svg.contains("stroke-dasharray"));
    }

    #[test]
    fn steps_are_nice() {
        assert_eq!(nice_step(100.0, 5.0), 20.0);
        assert_eq!(nice_step(7.0, 6.0), 1.0);
        assert_eq!(nice_step(0.0, 5.0), 1.0);
    }
}
