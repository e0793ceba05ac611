//! Pictures of device memory, drawn with `plotters` to SVG or PNG (by the file's extension).
//!
//! - [`sweep_chart`]: peak device memory and time against the swept value, one line per kernel;
//!   memory in KiB/MiB/GiB on a log axis, a horizontal line at the device memory limit, runs that
//!   did not fit drawn hollow at the bytes they would need.
//! - [`plan_chart`]: the plan of an inference workload against context length, weights, KV cache
//!   and attention workspace stacked, naive and flash side by side, the limit line.
//!
//! Text is drawn with DejaVu Sans, embedded in the binary (`host/assets/`), so PNG output needs no
//! system font library.

use crate::plan::{terms, Model, Workload};
use crate::problem::KernelKind;
use crate::units::human_bytes;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

fn register_font() -> Result<(), String> {
    static ONCE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .map_err(|_| "the embedded font does not load".to_string())
    })
    .clone()
}

/// `1073741824` -> `1 GiB`, `1536` -> `1.5 KiB` (axis labels: no trailing zeros).
pub fn axis_bytes(b: f64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut x = b;
    let mut u = 0;
    while x >= 1024.0 && u < UNITS.len() - 1 {
        x /= 1024.0;
        u += 1;
    }
    let s = format!("{x:.1}");
    let s = s.strip_suffix(".0").unwrap_or(&s);
    format!("{s} {}", UNITS[u])
}

/// `32768` -> `32k`, `1000` -> `1000`.
pub fn axis_count(v: f64) -> String {
    if v >= 1024.0 && (v / 1024.0).fract() == 0.0 {
        format!("{}k", v / 1024.0)
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    }
}

/// `0.25` -> `0.25`, `1500` -> `1500` (time axis, ms).
pub fn axis_ms(v: f64) -> String {
    if v >= 100.0 || (v >= 1.0 && v.fract() == 0.0) {
        format!("{v:.0}")
    } else if v >= 1.0 {
        let s = format!("{v:.1}");
        s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
    } else {
        let s = format!("{v:.6}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// 1, 2, 5 times the powers of ten between `lo` and `hi` (log-axis ticks that read as numbers).
pub fn ticks_125(lo: f64, hi: f64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut e = lo.log10().floor() as i32;
    while 10f64.powi(e) <= hi {
        for m in [1.0, 2.0, 5.0] {
            let v = m * 10f64.powi(e);
            if v >= lo && v <= hi {
                out.push(v);
            }
        }
        e += 1;
    }
    out
}

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("plot: {e:?}")
}

enum Format {
    Svg,
    Png,
}

fn format_of(path: &Path) -> Result<Format, String> {
    match path.extension().and_then(|e| e.to_str()).map(|e| e.to_ascii_lowercase()) {
        Some(e) if e == "svg" => Ok(Format::Svg),
        Some(e) if e == "png" => Ok(Format::Png),
        _ => Err(format!("plot {}: the file name must end in .svg or .png", path.display())),
    }
}

/// Why a picture was not written: the drawing failed (bad input), or writing the file did
/// (the file writer's error: a host resource limit such as `ulimit -f` or a full disk is a
/// resource error, exit 3, as for every other file the command writes).
#[derive(Debug)]
pub enum ChartError {
    Draw(String),
    File(crate::files::FileError),
}

impl From<ChartError> for crate::error::Error {
    fn from(e: ChartError) -> Self {
        match e {
            ChartError::Draw(m) => crate::error::Error::Usage(m),
            ChartError::File(f) => crate::error::Error::File(f),
        }
    }
}

impl From<String> for ChartError {
    fn from(m: String) -> Self {
        ChartError::Draw(m)
    }
}

/// Draws with `draw` on an SVG or PNG of `w x h` pixels in memory, then writes the file with the
/// command's one atomic writer ([`crate::files::write_atomic`]: a reader never sees half a
/// picture, and a failed write leaves what was there).
fn render(
    path: &Path,
    w: u32,
    h: u32,
    draw: impl Fn(DrawingArea<SVGBackend, Shift>) -> Result<(), String>,
    png: impl Fn(DrawingArea<BitMapBackend, Shift>) -> Result<(), String>,
) -> Result<(), ChartError> {
    register_font()?;
    let fmt = format_of(path)?;
    let bytes = match fmt {
        Format::Svg => {
            let mut svg = String::new();
            {
                let area = SVGBackend::with_string(&mut svg, (w, h)).into_drawing_area();
                area.fill(&WHITE).map_err(err)?;
                draw(area.clone())?;
                area.present().map_err(err)?;
            }
            svg.into_bytes()
        }
        Format::Png => {
            let mut rgb = vec![0u8; w as usize * h as usize * 3];
            {
                let area = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
                area.fill(&WHITE).map_err(err)?;
                png(area.clone())?;
                area.present().map_err(err)?;
            }
            let mut out = Vec::new();
            image::ImageEncoder::write_image(
                image::codecs::png::PngEncoder::new(&mut out),
                &rgb,
                w,
                h,
                image::ColorType::Rgb8,
            )
            .map_err(err)?;
            out
        }
    };
    crate::files::write_atomic(path, &bytes, "plot").map_err(ChartError::File)
}

/// One kernel's points of a sweep: `(x, bytes, ran, time_ms)`; `bytes` is what a run that did
/// not fit would need.
#[derive(Clone, Debug, PartialEq)]
pub struct SweepSeries {
    pub name: String,
    pub rgb: (u8, u8, u8),
    pub points: Vec<(f64, f64, bool, Option<f64>)>,
}

/// The sweep picture: memory (left) and time (right) against `x_label`.
pub fn sweep_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    series: &[SweepSeries],
    limit: Option<u64>,
) -> Result<(), ChartError> {
    macro_rules! body {
        ($area:expr) => {{
            let root = $area.titled(title, ("sans-serif", 20)).map_err(err)?;
            let (left, right) = root.split_horizontally(root.dim_in_pixel().0 / 2);
            let xs: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).collect();
            let (x0, x1) = xs.iter().fold((f64::INFINITY, 0f64), |(a, b), &x| (a.min(x), b.max(x)));
            if xs.is_empty() {
                return Err("plot: no points".into());
            }
            let (x0, x1) = (x0 / 1.3, x1 * 1.3);
            // Ticks at the swept values only: a log axis over a short range has no round numbers.
            let mut keys: Vec<f64> = xs.clone();
            keys.sort_by(f64::total_cmp);
            keys.dedup();
            // Memory panel.
            let mut ys: Vec<f64> =
                series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).filter(|y| *y > 0.0).collect();
            if let Some(l) = limit {
                ys.push(l as f64);
            }
            let (y0, y1) = ys.iter().fold((f64::INFINITY, 0f64), |(a, b), &y| (a.min(y), b.max(y)));
            let (y0, y1) = (y0 / 2.0, y1 * 2.0);
            let mut c = ChartBuilder::on(&left)
                .caption("peak device memory (hollow: did not run, bytes it would need)", ("sans-serif", 14))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(80)
                .build_cartesian_2d(
                    (x0..x1).log_scale().base(2.0).with_key_points(keys.clone()),
                    (y0..y1).log_scale().base(2.0),
                )
                .map_err(err)?;
            c.configure_mesh()
                .x_desc(x_label)
                .y_desc("device memory")
                .x_label_formatter(&|v| axis_count(*v))
                .y_label_formatter(&|v| axis_bytes(*v))
                .y_labels(8)
                .draw()
                .map_err(err)?;
            if let Some(l) = limit {
                let red = RGBColor(200, 0, 0);
                c.draw_series(std::iter::once(PathElement::new(
                    vec![(x0, l as f64), (x1, l as f64)],
                    red.stroke_width(2),
                )))
                .map_err(err)?
                .label(format!("device limit {}", human_bytes(l)))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], red.stroke_width(2)));
            }
            for s in series {
                let col = RGBColor(s.rgb.0, s.rgb.1, s.rgb.2);
                let ran: Vec<(f64, f64)> = s.points.iter().filter(|p| p.2).map(|p| (p.0, p.1)).collect();
                c.draw_series(LineSeries::new(ran.clone(), col.stroke_width(2)))
                    .map_err(err)?
                    .label(s.name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
                c.draw_series(s.points.iter().map(|p| {
                    let style = if p.2 { col.filled() } else { col.stroke_width(2) };
                    Circle::new((p.0, p.1), 5, style)
                }))
                .map_err(err)?;
            }
            c.configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 13))
                .draw()
                .map_err(err)?;
            // Time panel.
            let ts: Vec<f64> =
                series.iter().flat_map(|s| s.points.iter().filter_map(|p| p.3)).filter(|t| *t > 0.0).collect();
            if !ts.is_empty() {
                let (t0, t1) = ts.iter().fold((f64::INFINITY, 0f64), |(a, b), &t| (a.min(t), b.max(t)));
                let mut c = ChartBuilder::on(&right)
                    .caption("time per run (ms, median)", ("sans-serif", 14))
                    .margin(12)
                    .x_label_area_size(40)
                    .y_label_area_size(70)
                    .build_cartesian_2d(
                        (x0..x1).log_scale().base(2.0).with_key_points(keys.clone()),
                        (t0 / 2.0..t1 * 2.0).log_scale().with_key_points(ticks_125(t0 / 2.0, t1 * 2.0)),
                    )
                    .map_err(err)?;
                c.configure_mesh()
                    .x_desc(x_label)
                    .y_desc("ms")
                    .x_label_formatter(&|v| axis_count(*v))
                    .y_label_formatter(&|v| axis_ms(*v))
                    .draw()
                    .map_err(err)?;
                for s in series {
                    let col = RGBColor(s.rgb.0, s.rgb.1, s.rgb.2);
                    let pts: Vec<(f64, f64)> = s.points.iter().filter_map(|p| p.3.map(|t| (p.0, t))).collect();
                    c.draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))
                        .map_err(err)?
                        .label(s.name.clone())
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col.stroke_width(2)));
                    c.draw_series(pts.iter().map(|&p| Circle::new(p, 5, col.filled()))).map_err(err)?;
                }
                c.configure_series_labels()
                    .position(SeriesLabelPosition::UpperLeft)
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .label_font(("sans-serif", 13))
                    .draw()
                    .map_err(err)?;
            }
            Ok(())
        }};
    }
    render(path, 1200, 520, |a| body!(a), |a| body!(a))
}

/// Contexts the plan chart samples: geometric from `lo` to `hi`, with `at` included.
fn contexts(lo: u32, hi: u32, at: u32) -> Vec<u32> {
    let n = 64;
    let mut v: Vec<u32> =
        (0..=n).map(|i| (lo as f64 * (hi as f64 / lo as f64).powf(i as f64 / n as f64)).round() as u32).collect();
    v.push(at);
    v.sort_unstable();
    v.dedup();
    v
}

/// The plan picture: device memory against context length for naive (left) and flash (right),
/// weights + KV cache + attention workspace + largest activation stacked, the limit line, and the
/// planned context marked.
pub fn plan_chart(path: &Path, m: &Model, w: &Workload, limit: u64, model: &str) -> Result<(), ChartError> {
    let lo = w.new_tokens.max(64);
    let hi = (w.context as u64 * 4).clamp(lo as u64 * 4, u32::MAX as u64) as u32;
    let cs = contexts(lo, hi, w.context);
    let title = format!(
        "memattn plan: {model}, batch {}, {} weights, {} KV cache, {} new token(s); limit {}",
        w.batch,
        w.dtype,
        w.kv_dtype,
        w.new_tokens,
        human_bytes(limit)
    );
    let panels: Vec<(KernelKind, Vec<[f64; 5]>)> = KernelKind::ALL
        .iter()
        .map(|&k| {
            let rows = cs
                .iter()
                .map(|&c| {
                    let t = terms(m, &Workload { context: c, kernel: k, ..*w });
                    let a = t.weights as f64;
                    let b = a + t.kv_cache as f64;
                    let d = b + t.workspace.total as f64;
                    let e = d + t.activation.bytes as f64;
                    [c as f64, a, b, d, e]
                })
                .collect();
            (k, rows)
        })
        .collect();
    let planned = terms(m, w).total as f64;
    // The axis counts whole units (GiB for a GPU-sized plan) so its ticks are round numbers.
    let (unit, unit_name) = [(1u64 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B")]
        .into_iter()
        .find(|(u, _)| (limit as f64).max(planned) >= *u as f64)
        .unwrap_or((1, "B"));
    let unit = unit as f64;
    let panels: Vec<(KernelKind, Vec<[f64; 5]>)> = panels
        .into_iter()
        .map(|(k, rows)| {
            (k, rows.into_iter().map(|r| [r[0], r[1] / unit, r[2] / unit, r[3] / unit, r[4] / unit]).collect())
        })
        .collect();
    let limit_u = limit as f64 / unit;
    let ymax = (limit_u * 1.6).max(planned / unit * 1.2);
    let layers: [(&str, RGBColor, usize); 4] = [
        ("weights", RGBColor(120, 120, 120), 1),
        ("KV cache", RGBColor(31, 119, 180), 2),
        ("attention workspace (S or LSE)", RGBColor(214, 39, 40), 3),
        ("largest activation", RGBColor(255, 160, 40), 4),
    ];
    macro_rules! body {
        ($area:expr) => {{
            let root = $area.titled(&title, ("sans-serif", 18)).map_err(err)?;
            let halves = root.split_evenly((1, 2));
            for (area, (kernel, rows)) in halves.iter().zip(&panels) {
                let fit = crate::plan::longest_context(m, &Workload { kernel: *kernel, ..*w }, limit);
                let cap = match fit {
                    Some(c) if c == u32::MAX => format!("{kernel}: no context limit (windowed cache)"),
                    Some(c) => format!("{kernel}: longest context that fits {c} tokens"),
                    None => format!("{kernel}: nothing fits"),
                };
                let mut c = ChartBuilder::on(area)
                    .caption(cap, ("sans-serif", 15))
                    .margin(12)
                    .x_label_area_size(40)
                    .y_label_area_size(80)
                    .build_cartesian_2d(
                        (cs[0] as f64..*cs.last().unwrap_or(&hi) as f64).log_scale().base(2.0),
                        0f64..ymax,
                    )
                    .map_err(err)?;
                c.configure_mesh()
                    .x_desc("context (tokens per sequence)")
                    .y_desc(format!("device memory ({unit_name})"))
                    .x_label_formatter(&|v| axis_count(*v))
                    .y_label_formatter(&|v| {
                        let s = format!("{v:.1}");
                        format!("{} {unit_name}", s.strip_suffix(".0").unwrap_or(&s))
                    })
                    .draw()
                    .map_err(err)?;
                // Top layer first, so each lower layer is painted over it.
                for (name, col, idx) in layers.iter().rev() {
                    let pts: Vec<(f64, f64)> = rows.iter().map(|r| (r[0], r[*idx].min(ymax))).collect();
                    let col = *col;
                    c.draw_series(AreaSeries::new(pts, 0.0, col.mix(0.85)).border_style(col.stroke_width(1)))
                        .map_err(err)?
                        .label(*name)
                        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], col.filled()));
                }
                let red = RGBColor(200, 0, 0);
                let x0 = cs[0] as f64;
                let x1 = *cs.last().unwrap_or(&hi) as f64;
                c.draw_series(std::iter::once(PathElement::new(
                    vec![(x0, limit_u), (x1, limit_u)],
                    red.stroke_width(3),
                )))
                .map_err(err)?
                .label(format!("limit {}", human_bytes(limit)))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], red.stroke_width(3)));
                let at = w.context as f64;
                c.draw_series(std::iter::once(PathElement::new(vec![(at, 0.0), (at, ymax)], BLACK.stroke_width(1))))
                    .map_err(err)?
                    .label(format!("planned context {}", w.context))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x + 7, y - 6), (x + 7, y + 6)], BLACK.stroke_width(1))
                    });
                c.configure_series_labels()
                    .position(SeriesLabelPosition::UpperLeft)
                    .background_style(WHITE.mix(0.9))
                    .border_style(BLACK)
                    .label_font(("sans-serif", 13))
                    .draw()
                    .map_err(err)?;
            }
            Ok(())
        }};
    }
    render(path, 1300, 560, |a| body!(a), |a| body!(a))
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn axis_labels_read_as_units() {
        assert_eq!(axis_bytes(1024.0 * 1024.0), "1 MiB");
        assert_eq!(axis_bytes(1536.0), "1.5 KiB");
        assert_eq!(axis_bytes(80.0 * 1073741824.0), "80 GiB");
        assert_eq!(axis_count(32768.0), "32k");
        assert_eq!(axis_ms(0.02), "0.02");
        assert_eq!(axis_ms(200.0), "200");
        assert_eq!(
            ticks_125(0.15, 1200.0),
            vec![0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0]
        );
    }
}

/// One row of the timeline picture: a label and its bars `(start, end, colour index)`.
#[derive(Clone, Debug, PartialEq)]
pub struct TimelineRow {
    pub label: String,
    pub bars: Vec<(f64, f64, usize)>,
}

/// The timeline picture (`memattn run --timeline`): one row per warp (top to bottom), a
/// coloured bar per phase along the clock (`x_label`), and the legend `legend` (name and
/// colour of each colour index) on the right.
pub fn timeline_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    rows: &[TimelineRow],
    legend: &[(&str, (u8, u8, u8))],
) -> Result<(), ChartError> {
    if rows.is_empty() {
        return Err("plot: no warps to draw".to_string().into());
    }
    let x_max = rows.iter().flat_map(|r| r.bars.iter().map(|b| b.1)).fold(0f64, f64::max).max(1.0);
    let n = rows.len();
    let row_px = if n <= 32 {
        22
    } else if n <= 128 {
        12
    } else {
        6
    };
    let (w, h) = (1400u32, (n as u32 * row_px + 140).clamp(360, 8000));
    macro_rules! body {
        ($area:expr) => {{
            let root = $area.titled(title, ("sans-serif", 18)).map_err(err)?;
            let (plot, key) = root.split_horizontally(w - 180);
            let label_size = if n <= 128 { 90 } else { 10 };
            let mut c = ChartBuilder::on(&plot)
                .margin(10)
                .x_label_area_size(40)
                .y_label_area_size(label_size)
                .build_cartesian_2d(0f64..x_max * 1.01, -0.5f64..n as f64 - 0.5)
                .map_err(err)?;
            let labels: Vec<String> = rows.iter().map(|r| r.label.clone()).collect();
            c.configure_mesh()
                .disable_y_mesh()
                .x_desc(x_label)
                .y_labels(n.min(64))
                .y_label_formatter(&|v| {
                    // Row i is centred on n - 1 - i: the first warp on top.
                    let i = n as f64 - 1.0 - v.round();
                    if n <= 128 && i >= 0.0 && (i as usize) < n {
                        labels[i as usize].clone()
                    } else {
                        String::new()
                    }
                })
                .x_label_formatter(&|v| axis_count(*v))
                .draw()
                .map_err(err)?;
            for (i, r) in rows.iter().enumerate() {
                let y0 = (n - 1 - i) as f64 - 0.4;
                let y1 = (n - 1 - i) as f64 + 0.4;
                c.draw_series(r.bars.iter().map(|&(a, b, k)| {
                    let (cr, cg, cb) = legend.get(k).map(|l| l.1).unwrap_or((0, 0, 0));
                    Rectangle::new([(a, y0), (b, y1)], RGBColor(cr, cg, cb).filled())
                }))
                .map_err(err)?;
            }
            for (k, (name, (cr, cg, cb))) in legend.iter().filter(|l| !l.0.is_empty()).enumerate() {
                let y = 60 + 24 * k as i32;
                key.draw(&Rectangle::new([(10, y), (28, y + 14)], RGBColor(*cr, *cg, *cb).filled())).map_err(err)?;
                key.draw(&Text::new(name.to_string(), (36, y), ("sans-serif", 14))).map_err(err)?;
            }
            Ok(())
        }};
    }
    render(path, w, h, |a| body!(a), |a| body!(a))
}
