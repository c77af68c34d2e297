//! SVG line plots of memory over time: one chart per trace, one line per allocator.
//!
//! This module owns the plot's layout: the axes and their ticks, the title, the legend and the
//! colours. It is hand-written SVG, by choice: `plotters` (SVG backend only, no font feature)
//! builds and runs here without a font file, but it fixes none of what this module has to get
//! right: its ticks are decimal (1-2-5 × 10^n bytes gives 0.9, 1.9, 2.8 GiB), it neither wraps
//! nor elides a caption or a legend label that is too long, and it colours by series index. All
//! of that would be code of ours on top of it, for a plot that is a handful of polylines.
//!
//! * The y axis is in one binary unit (B, KiB, ..., chosen from the data), ticked at 1-2-5
//!   multiples of it (or quarters and halves below 1), and ends on a tick.
//! * Every text is measured (a conservative estimate of its width: no font is read) and given
//!   the room it needs: the chart grows to the right for the legend and downwards for a long
//!   legend; a long title wraps onto a second line, and whatever still does not fit is elided
//!   with `…`, the full text in a `<title>` (a tooltip in browsers).
//! * A series' colour is a function of its name alone ([`colour_for`]): the same allocator has
//!   the same colour in every chart, whichever other allocators a chart shows, and across runs.

use std::fmt::Write as _;

/// One line of a chart.
pub struct Series {
    /// Legend label. Its colour key is the label up to a ` (` (see [`colour_for`]).
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

/// Fixed colours of the names this project knows (the replay catalog's allocators, the
/// recorded baselines and the live curve): distinct, and never taken by a hashed name.
const KNOWN: [(&str, &str); 9] = [
    ("cistern", "#1f77b4"),
    ("cistern-novmm", "#17becf"),
    ("pytorch", "#d62728"),
    ("pytorch-expandable", "#ff7f0e"),
    ("cudamalloc", "#2ca02c"),
    ("ideal", "#7f7f7f"),
    ("pytorch-recorded", "#8c564b"),
    ("recorded", "#9467bd"),
    ("live", "#333333"),
];

/// Colours of other names, picked by a hash of the name.
const HASHED: [&str; 10] = [
    "#e377c2", "#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
    "#e6550d", "#31a354",
];

/// The colour of a series named `name`: a function of the name up to its first ` (` (so
/// `cistern (reserved)` is coloured as `cistern`), the same in every chart and every run.
pub fn colour_for(name: &str) -> &'static str {
    let key = name.split(" (").next().unwrap_or(name).trim();
    if let Some((_, c)) = KNOWN.iter().find(|(k, _)| *k == key) {
        return c;
    }
    // FNV-1a: stable across runs and platforms (std's hasher is randomly seeded).
    let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    HASHED[(h % HASHED.len() as u64) as usize]
}

/// `s` as SVG text: control and invisible characters written as escapes ([`printable`]: XML
/// forbids most control characters, and names may come from a trace file), then XML's
/// specials.
///
/// [`printable`]: crate::table::printable
fn escape(s: &str) -> String {
    crate::table::printable(s)
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A width in pixels no rendering of `s` at `size` px in a sans-serif font exceeds: 0.62 em a
/// character (wider than any Latin letter but W and M of common sans fonts, and the bold
/// title's), 1 em for wide (CJK) characters.
fn text_width(s: &str, size: f64) -> f64 {
    s.chars()
        .map(|c| if c as u32 >= 0x1100 { 1.0 } else { 0.62 })
        .sum::<f64>()
        * size
}

/// `s` cut to at most `width` px at `size` px, with `…` where it was cut.
fn elide(s: &str, width: f64, size: f64) -> String {
    if text_width(s, size) <= width {
        return s.to_string();
    }
    let mut out = String::new();
    let budget = width - text_width("…", size);
    for c in s.chars() {
        let mut next = out.clone();
        next.push(c);
        if text_width(&next, size) > budget {
            break;
        }
        out = next;
    }
    out.push('…');
    out
}

/// `s` on at most `lines` lines of at most `width` px, broken at spaces (or `/`) where it can,
/// the last line elided. Returns the lines and whether anything was elided.
fn wrap(s: &str, width: f64, size: f64, lines: usize) -> (Vec<String>, bool) {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        if out.len() + 1 == lines || text_width(rest, size) <= width {
            let last = elide(rest, width, size);
            let cut = last != rest;
            out.push(last);
            return (out, cut);
        }
        // The longest prefix that fits, ending before a space or after a `/`.
        let mut fit = 0;
        let mut brk = None;
        for (i, c) in rest.char_indices() {
            let end = i + c.len_utf8();
            if text_width(&rest[..end], size) > width {
                break;
            }
            fit = end;
            if c == ' ' {
                brk = Some((i, end));
            } else if c == '/' {
                brk = Some((end, end));
            }
        }
        // A space right after what fits is as good a break as one inside it.
        if rest[fit..].starts_with(' ') {
            brk = Some((fit, fit + 1));
        }
        // Nothing fits (a very narrow width): one character, so that the loop ends.
        let one = rest.chars().next().map_or(1, char::len_utf8);
        let (line_end, next) = brk.unwrap_or((fit.max(one), fit.max(one)));
        out.push(rest[..line_end].trim_end().to_string());
        rest = rest[next..].trim_start();
    }
    (out, false)
}

/// A `<text>` element; `full` (the uncut text) becomes its `<title>` when given.
fn text_el(out: &mut String, x: f64, y: f64, attrs: &str, shown: &str, full: Option<&str>) {
    let tip = full.map_or(String::new(), |f| format!("<title>{}</title>", escape(f)));
    let _ = writeln!(
        out,
        r#"<text x="{x:.1}" y="{y:.1}"{attrs}>{tip}{}</text>"#,
        escape(shown)
    );
}

/// Binary units of the y axis.
const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

/// The y axis of bytes up to `max`: its unit (index in [`UNITS`]), its step and its top, in
/// bytes. The unit is the largest one `max` reaches; the step is the smallest of 1/4, 1/2, 1,
/// 2, 5, 10, 20, ... units giving at most 6 intervals; the top is the first tick at or above
/// `max` (and above 0).
fn byte_axis(max: f64) -> (usize, f64, f64) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let mut u = 0;
    while u + 1 < UNITS.len() && max >= 1024f64.powi(u as i32 + 1) {
        u += 1;
    }
    let unit = 1024f64.powi(u as i32);
    let in_unit = max / unit;
    // Quarters and halves only above bytes (no fraction of a byte).
    let mut candidates: Vec<f64> = if u > 0 { vec![0.25, 0.5] } else { vec![] };
    let mut mag = 1.0;
    while candidates.len() < 40 {
        candidates.extend([mag, 2.0 * mag, 5.0 * mag]);
        mag *= 10.0;
    }
    let step = candidates
        .into_iter()
        .find(|s| (in_unit / s).ceil() <= 6.0)
        .unwrap_or(mag);
    let top = ((in_unit / step).ceil().max(1.0)) * step;
    (u, step * unit, top * unit)
}

/// A tick label in `unit`: the shortest exact decimal of a multiple of 1/4 unit.
fn byte_label(v: f64, u: usize) -> String {
    let x = v / 1024f64.powi(u as i32);
    let s = format!("{x:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s} {}", UNITS[u])
}

/// The x axis of a count up to `max`: 1-2-5 × 10^n step, at most 8 intervals; step and top.
fn count_axis(max: f64) -> (f64, f64) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let mut mag = 1.0;
    loop {
        for s in [mag, 2.0 * mag, 5.0 * mag] {
            if (max / s).ceil() <= 8.0 {
                return (s, (max / s).ceil().max(1.0) * s);
            }
        }
        mag *= 10.0;
    }
}

/// A count tick: exact, with `k` / `M` / `G` when that keeps it short.
fn count_label(v: f64) -> String {
    let v = v.round();
    for (div, suffix) in [(1e9, "G"), (1e6, "M"), (1e3, "k")] {
        if v >= div * 10.0 || (v >= div && (v / div * 10.0).fract() == 0.0) {
            let s = format!("{:.1}", v / div);
            return format!("{}{suffix}", s.trim_end_matches('0').trim_end_matches('.'));
        }
    }
    format!("{v}")
}

// Layout, in px.
const FONT: f64 = 12.0;
const TITLE_FONT: f64 = 14.0;
const PLOT_W: f64 = 610.0;
const PLOT_H: f64 = 270.0;
const MARGIN_RIGHT: f64 = 12.0;
const MARGIN_BOTTOM: f64 = 50.0;
const LEGEND_ROW: f64 = 18.0;
/// The legend's swatch and the gap before its label.
const SWATCH: f64 = 30.0;
/// A legend label longer than this is elided (full text in its `<title>`).
const LEGEND_TEXT_MAX: f64 = 300.0;

/// Writes `charts` as one SVG file for `--plot PATH`, and says so on stderr unless `quiet`
/// (the JSON output keeps stderr for errors).
pub fn write_file(path: &std::path::Path, charts: &[Chart], quiet: bool) -> Result<(), String> {
    std::fs::write(path, render(charts)).map_err(|e| format!("--plot {}: {e}", path.display()))?;
    if !quiet {
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Renders charts stacked vertically into one SVG document.
pub fn render(charts: &[Chart]) -> String {
    // The widths every chart shares: the y labels' column and the legend's.
    let y_label_w = charts
        .iter()
        .map(|c| {
            let ymax = max_of(c, |p| p.1);
            let (u, step, top) = byte_axis(ymax);
            let mut w: f64 = 0.0;
            let mut y = 0.0;
            while y <= top + step / 2.0 {
                w = w.max(text_width(&byte_label(y, u), FONT));
                y += step;
            }
            w
        })
        .fold(40.0, f64::max);
    let ml = 12.0 + y_label_w + 8.0;
    let legend_text_w = charts
        .iter()
        .flat_map(|c| c.series.iter())
        .map(|s| text_width(&s.name, FONT).min(LEGEND_TEXT_MAX))
        .fold(0.0, f64::max);
    let legend_x = ml + PLOT_W + 12.0;
    let w = (legend_x + SWATCH + legend_text_w + MARGIN_RIGHT)
        .max(ml + PLOT_W + 40.0)
        .ceil();
    let title_w = w - 24.0;

    let mut body = String::new();
    let mut oy = 0.0;
    for chart in charts {
        oy = chart_svg(&mut body, chart, oy, ml, legend_x, title_w);
    }
    let total_h = oy.max(1.0).ceil();
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{total_h}" viewBox="0 0 {w} {total_h}" font-family="sans-serif" font-size="{FONT}">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    out.push_str(&body);
    out.push_str("</svg>\n");
    out
}

fn max_of(chart: &Chart, f: impl Fn(&(f64, f64)) -> f64) -> f64 {
    chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(&f))
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
}

/// Writes one chart whose top is at `oy`; returns its bottom.
fn chart_svg(
    out: &mut String,
    chart: &Chart,
    oy: f64,
    ml: f64,
    legend_x: f64,
    title_w: f64,
) -> f64 {
    // Title: up to two lines, elided beyond.
    let (lines, cut) = wrap(&chart.title, title_w, TITLE_FONT, 2);
    let full = (cut || lines.len() > 1).then_some(chart.title.as_str());
    let mut ty = oy + 22.0;
    for line in &lines {
        text_el(
            out,
            12.0,
            ty,
            r#" font-size="14" font-weight="bold""#,
            line,
            full,
        );
        ty += TITLE_FONT * 1.3;
    }
    let mt = ty - oy + 4.0;
    let legend_h = chart.series.len() as f64 * LEGEND_ROW + 8.0;
    let ph = PLOT_H.max(legend_h);
    let top = oy + mt;

    let (xstep, xmax) = count_axis(max_of(chart, |p| p.0));
    let (unit, ystep, ymax) = byte_axis(max_of(chart, |p| p.1));
    let sx = |x: f64| ml + x / xmax * PLOT_W;
    let sy = |y: f64| top + ph - y / ymax * ph;

    let _ = writeln!(
        out,
        r##"<rect x="{ml:.1}" y="{top:.1}" width="{PLOT_W}" height="{ph:.1}" fill="none" stroke="#888"/>"##
    );
    let ticks = |step: f64, max: f64| {
        let n = (max / step).round() as usize;
        (0..=n).map(move |i| i as f64 * step)
    };
    for y in ticks(ystep, ymax) {
        let py = sy(y);
        let _ = writeln!(
            out,
            r##"<line x1="{ml:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#eee"/>"##,
            ml + PLOT_W
        );
        text_el(
            out,
            ml - 6.0,
            py + 4.0,
            r#" text-anchor="end""#,
            &byte_label(y, unit),
            None,
        );
    }
    for x in ticks(xstep, xmax) {
        text_el(
            out,
            sx(x),
            top + ph + 16.0,
            r#" text-anchor="middle""#,
            &count_label(x),
            None,
        );
    }
    let xl = elide(&chart.x_label, PLOT_W, FONT);
    let xl_full = (xl != chart.x_label).then_some(chart.x_label.as_str());
    text_el(
        out,
        ml + PLOT_W / 2.0,
        top + ph + MARGIN_BOTTOM - 12.0,
        r#" text-anchor="middle""#,
        &xl,
        xl_full,
    );

    for (si, s) in chart.series.iter().enumerate() {
        let colour = colour_for(&s.name);
        let mut pts = String::new();
        for &(x, y) in &s.points {
            if x.is_finite() && y.is_finite() {
                let _ = write!(pts, "{:.1},{:.1} ", sx(x), sy(y));
            }
        }
        let dash = if s.dashed {
            r#" stroke-dasharray="5,3""#
        } else {
            ""
        };
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5"{dash} points="{}"/>"#,
            pts.trim_end()
        );
        let ly = top + 14.0 + si as f64 * LEGEND_ROW;
        let _ = writeln!(
            out,
            r#"<line x1="{legend_x:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{colour}" stroke-width="2"{dash}/>"#,
            legend_x + 24.0
        );
        let label = elide(&s.name, LEGEND_TEXT_MAX, FONT);
        let full = (label != s.name).then_some(s.name.as_str());
        text_el(out, legend_x + SWATCH, ly + 4.0, "", &label, full);
    }
    top + ph + MARGIN_BOTTOM
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

    /// A trace's name comes from its file: control characters in it must not make the SVG
    /// invalid XML (XML 1.0 forbids them even escaped as `&#x1b;`).
    #[test]
    fn control_characters_in_names_keep_the_svg_valid() {
        let svg = render(&[Chart {
            title: "evil\x1b[2J\x07 & <trace>".into(),
            x_label: "operation".into(),
            series: vec![line("a\u{0}b\r\n (reserved)", 1e9)],
        }]);
        let doc = roxmltree::Document::parse(&svg).expect("the SVG parses as XML");
        let texts: Vec<&str> = doc.descendants().filter_map(|n| n.text()).collect();
        assert!(
            texts.contains(&"evil\\u{1b}[2J\\u{7} & <trace>"),
            "{texts:?}"
        );
        assert!(texts.contains(&"a\\u{0}b\\r\\n (reserved)"), "{texts:?}");
    }

    #[test]
    fn byte_ticks_are_round_in_a_binary_unit() {
        const G: f64 = (1u64 << 30) as f64;
        const M: f64 = (1u64 << 20) as f64;
        let ticks = |max: f64| {
            let (u, step, top) = byte_axis(max);
            let n = (top / step).round() as usize;
            (0..=n)
                .map(|i| byte_label(i as f64 * step, u))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            ticks(3.7 * G),
            ["0 GiB", "1 GiB", "2 GiB", "3 GiB", "4 GiB"]
        );
        assert_eq!(
            ticks(11.0 * G),
            ["0 GiB", "2 GiB", "4 GiB", "6 GiB", "8 GiB", "10 GiB", "12 GiB"]
        );
        assert_eq!(
            ticks(1.2 * G),
            ["0 GiB", "0.25 GiB", "0.5 GiB", "0.75 GiB", "1 GiB", "1.25 GiB"]
        );
        assert_eq!(ticks(700.0 * M)[1], "200 MiB");
        assert_eq!(ticks(3.0), ["0 B", "1 B", "2 B", "3 B"]);
        assert_eq!(ticks(0.0), ["0 B", "1 B"]);
    }

    #[test]
    fn count_ticks_are_round_and_short() {
        assert_eq!(count_axis(100.0), (20.0, 100.0));
        assert_eq!(count_axis(7.0), (1.0, 7.0));
        assert_eq!(count_axis(0.0), (1.0, 1.0));
        assert_eq!(count_axis(1_234_567.0), (200_000.0, 1_400_000.0));
        assert_eq!(count_label(1_200_000.0), "1.2M");
        assert_eq!(count_label(20_000.0), "20k");
        assert_eq!(count_label(1500.0), "1.5k");
        assert_eq!(count_label(1234.0), "1234");
    }

    #[test]
    fn a_long_title_wraps_then_elides() {
        let (lines, cut) = wrap("aaaa bbbb cccc", text_width("aaaa bbbb", 10.0), 10.0, 2);
        assert_eq!(lines, ["aaaa bbbb", "cccc"]);
        assert!(!cut);
        let (lines, cut) = wrap(&"x".repeat(100), 100.0, 10.0, 2);
        assert_eq!(lines.len(), 2);
        assert!(cut && lines[1].ends_with('…'));
        assert!(lines.iter().all(|l| text_width(l, 10.0) <= 100.0));
    }

    #[test]
    fn colours_depend_on_the_name_alone() {
        assert_eq!(colour_for("cistern (reserved)"), colour_for("cistern"));
        assert_ne!(colour_for("cistern"), colour_for("pytorch"));
        let known: Vec<&str> = KNOWN.iter().map(|k| k.1).collect();
        let mut dedup = known.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), known.len(), "known colours must be distinct");
        assert!(!known.contains(&colour_for("pytorch:max_split_size_mb:128")));
        assert_eq!(
            colour_for("pytorch:max_split_size_mb:128 (reserved)"),
            colour_for("pytorch:max_split_size_mb:128")
        );
    }

    /// Every `<text>`'s box, estimated independently of the layout code (0.6 em a character,
    /// the font's height above the baseline, a quarter below), lies inside the viewBox.
    fn assert_text_inside(svg: &str) {
        let doc = roxmltree::Document::parse(svg).expect("the SVG parses as XML");
        let root = doc.root_element();
        let vb: Vec<f64> = root
            .attribute("viewBox")
            .unwrap()
            .split(' ')
            .map(|v| v.parse().unwrap())
            .collect();
        let (w, h) = (vb[2], vb[3]);
        let mut n = 0;
        for t in root.descendants().filter(|n| n.has_tag_name("text")) {
            n += 1;
            let x: f64 = t.attribute("x").unwrap().parse().unwrap();
            let y: f64 = t.attribute("y").unwrap().parse().unwrap();
            let size: f64 = t.attribute("font-size").unwrap_or("12").parse().unwrap();
            let shown: String = t
                .children()
                .filter(|c| c.is_text())
                .map(|c| c.text().unwrap())
                .collect();
            let tw = shown.chars().count() as f64 * size * 0.6;
            let (x0, x1) = match t.attribute("text-anchor") {
                Some("end") => (x - tw, x),
                Some("middle") => (x - tw / 2.0, x + tw / 2.0),
                _ => (x, x + tw),
            };
            assert!(
                x0 >= 0.0 && x1 <= w && y - size >= 0.0 && y + size / 4.0 <= h,
                "{shown:?} at ({x0:.0}..{x1:.0}, {y:.0}) is outside the {w}x{h} viewBox"
            );
        }
        assert!(n > 0);
    }

    fn line(name: &str, top: f64) -> Series {
        Series {
            name: name.into(),
            points: vec![(0.0, 0.0), (1000.0, top)],
            dashed: false,
        }
    }

    #[test]
    fn long_titles_and_many_series_stay_inside_the_picture() {
        let long = "rmm-random-with-a-very-long-name seed 42 from /data/traces/2026/cluster-a/\
                    node-17/job-123456789/rank-3/memory_snapshot_after_the_optimizer_step.pickle \
                    and even more words after it so that two lines cannot hold it all";
        let charts = vec![
            Chart {
                title: long.into(),
                x_label: "operation".into(),
                series: (0..30)
                    .map(|i| line(&format!("pytorch:max_split_size_mb:{i} (reserved)"), 3.7e9))
                    .collect(),
            },
            Chart {
                title: "short".into(),
                x_label: "operation".into(),
                series: vec![line(&"a-very-long-allocator-name-".repeat(8), 1e12)],
            },
        ];
        let svg = render(&charts);
        assert_text_inside(&svg);
        // What was cut is kept whole in a tooltip.
        let doc = roxmltree::Document::parse(&svg).unwrap();
        let titles: Vec<&str> = doc
            .descendants()
            .filter(|n| n.has_tag_name("title"))
            .filter_map(|n| n.text())
            .collect();
        assert!(titles.contains(&long), "{titles:?}");
        assert!(titles
            .iter()
            .any(|t| t.starts_with("a-very-long-allocator-name-a-very")));
    }

    #[test]
    fn an_allocator_keeps_its_colour_whatever_else_a_chart_shows() {
        let stroke_of = |svg: &str, label: &str| -> String {
            let doc = roxmltree::Document::parse(svg).unwrap();
            let nodes: Vec<_> = doc.descendants().collect();
            let i = nodes
                .iter()
                .position(|n| n.has_tag_name("text") && n.text() == Some(label))
                .unwrap_or_else(|| panic!("no legend entry {label}"));
            // The legend swatch is the line just before its label.
            let swatch = nodes[..i]
                .iter()
                .rev()
                .find(|n| n.has_tag_name("line"))
                .unwrap();
            swatch.attribute("stroke").unwrap().to_string()
        };
        let a = render(&[Chart {
            title: "a".into(),
            x_label: "operation".into(),
            series: vec![
                line("cistern (reserved)", 1e9),
                line("pytorch (reserved)", 2e9),
            ],
        }]);
        let b = render(&[Chart {
            title: "b".into(),
            x_label: "operation".into(),
            series: vec![
                line("pytorch-expandable (reserved)", 1e9),
                line("cudamalloc (reserved)", 1e9),
                line("pytorch (reserved)", 2e9),
                line("cistern (reserved)", 1e9),
            ],
        }]);
        for name in ["cistern (reserved)", "pytorch (reserved)"] {
            assert_eq!(stroke_of(&a, name), stroke_of(&b, name), "{name}");
        }
        assert_ne!(
            stroke_of(&b, "cistern (reserved)"),
            stroke_of(&b, "pytorch (reserved)")
        );
    }
}
