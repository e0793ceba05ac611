//! A small SVG writer for the sweep plot: peak device memory and time against the swept value,
//! one line per kernel, two panels side by side. Runs that could not execute (over device memory)
//! are drawn as hollow markers at the bytes they would need.

use std::fmt::Write;

/// One point of a series; `would_need` marks a run that did not execute.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub x: f64,
    pub y: Option<f64>,
    pub did_not_run: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    pub color: &'static str,
    pub points: Vec<Point>,
}

pub struct Panel {
    pub title: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

const W: f64 = 520.0;
const H: f64 = 380.0;
const ML: f64 = 80.0;
const MR: f64 = 20.0;
const MT: f64 = 40.0;
const MB: f64 = 60.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn nice_label(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-2..1e4).contains(&a) {
        format!("{v:.2e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn log2_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut t = Vec::new();
    let mut e = lo.log2().floor();
    while e <= hi.log2().ceil() {
        t.push(2f64.powf(e));
        e += 1.0;
    }
    t
}

/// Renders panels left to right, log-2 x axis, log-10 y axis.
pub fn svg(title: &str, x_label: &str, panels: &[Panel]) -> String {
    let total_w = W * panels.len() as f64;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{}" font-family="sans-serif" font-size="12">"#,
        H + 30.0
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ =
        writeln!(s, r#"<text x="{}" y="20" text-anchor="middle" font-size="15">{}</text>"#, total_w / 2.0, esc(title));
    for (pi, panel) in panels.iter().enumerate() {
        let ox = W * pi as f64;
        let oy = 20.0;
        let pts: Vec<&Point> = panel.series.iter().flat_map(|s| s.points.iter()).filter(|p| p.y.is_some()).collect();
        if pts.is_empty() {
            continue;
        }
        let (xmin, xmax) = pts.iter().fold((f64::INFINITY, 0f64), |(a, b), p| (a.min(p.x), b.max(p.x)));
        let (ymin, ymax) = pts
            .iter()
            .filter_map(|p| p.y)
            .filter(|y| *y > 0.0)
            .fold((f64::INFINITY, 0f64), |(a, b), y| (a.min(y), b.max(y)));
        let (lx0, lx1) = (xmin.max(1e-300).log2(), (xmax.max(xmin * 2.0)).log2());
        let (ly0, ly1) = ((ymin.max(1e-300)).log10().floor(), (ymax.max(ymin * 10.0)).log10().ceil());
        let px = |x: f64| ox + ML + (x.log2() - lx0) / (lx1 - lx0).max(1e-9) * (W - ML - MR);
        let py = |y: f64| oy + MT + (1.0 - (y.max(1e-300).log10() - ly0) / (ly1 - ly0).max(1e-9)) * (H - MT - MB);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-size="13">{}</text>"#,
            ox + W / 2.0,
            oy + 25.0,
            esc(&panel.title)
        );
        let _ = writeln!(
            s,
            r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#444"/>"##,
            ox + ML,
            oy + MT,
            W - ML - MR,
            H - MT - MB
        );
        for t in log2_ticks(xmin, xmax) {
            if t < xmin * 0.999 || t > xmax * 1.001 {
                continue;
            }
            let x = px(t);
            let _ = writeln!(
                s,
                r##"<line x1="{x}" y1="{}" x2="{x}" y2="{}" stroke="#ddd"/><text x="{x}" y="{}" text-anchor="middle">{}</text>"##,
                oy + MT,
                oy + H - MB,
                oy + H - MB + 16.0,
                nice_label(t)
            );
        }
        let mut e = ly0;
        while e <= ly1 {
            let y = py(10f64.powf(e));
            let _ = writeln!(
                s,
                r##"<line x1="{}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                ox + ML,
                ox + W - MR,
                ox + ML - 4.0,
                y + 4.0,
                nice_label(10f64.powf(e))
            );
            e += 1.0;
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            ox + ML + (W - ML - MR) / 2.0,
            oy + H - 20.0,
            esc(x_label)
        );
        let _ = writeln!(
            s,
            r#"<text transform="translate({},{}) rotate(-90)" text-anchor="middle">{}</text>"#,
            ox + 16.0,
            oy + MT + (H - MT - MB) / 2.0,
            esc(&panel.y_label)
        );
        for (si, ser) in panel.series.iter().enumerate() {
            let ran: Vec<String> = ser
                .points
                .iter()
                .filter(|p| !p.did_not_run)
                .filter_map(|p| p.y.map(|y| format!("{:.1},{:.1}", px(p.x), py(y))))
                .collect();
            if ran.len() > 1 {
                let _ = writeln!(
                    s,
                    r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
                    ser.color,
                    ran.join(" ")
                );
            }
            for p in &ser.points {
                if let Some(y) = p.y {
                    let fill = if p.did_not_run { "white" } else { ser.color };
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{fill}" stroke="{}"/>"#,
                        px(p.x),
                        py(y),
                        ser.color
                    );
                }
            }
            let ly = oy + MT + 14.0 + 16.0 * si as f64;
            let _ = writeln!(
                s,
                r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
                ox + ML + 10.0,
                ox + ML + 30.0,
                ser.color,
                ox + ML + 35.0,
                ly + 4.0,
                esc(&ser.name)
            );
        }
        if panel.series.iter().any(|s| s.points.iter().any(|p| p.did_not_run)) {
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" font-size="11">hollow: did not run (bytes it would need)</text>"#,
                ox + ML + 10.0,
                oy + H - MB - 8.0
            );
        }
    }
    s.push_str("</svg>\n");
    s
}
