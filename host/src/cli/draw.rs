//! `memattn draw`: SVG pictures computed from the kernels' own constants and functions (tile
//! items, the key-range rule, the fragment helpers, the swizzle, the online-softmax state), so a
//! picture changes when the code does. The SVG is written by hand (rectangles and text with fixed
//! number formatting), so the same options give the same bytes on every machine.

use super::args::{non_negative_u32, non_negative_u64, Cli};
use clap::{Args, ValueEnum};
use kernels_gpu::variants::Tile;
use kernels_gpu::{frag, mask, softmax, swizzle, KernelId};
use memattn_cli::dtype::Dtype;
use memattn_cli::error::Error;
use std::fmt::Write as _;
use std::path::PathBuf;

/// Which picture `memattn draw` renders.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Picture {
    /// The score matrix (queries down, keys across) cut into the flash kernel's tiles: which key
    /// tiles each block of Br query rows visits, which of them need masking and which it skips,
    /// by the same key-range rule the kernels use (kernels-gpu `mask::key_range`). Options:
    /// --dtype, --head-dim, --seq-q, --seq-kv, --causal, --window.
    Tiling,
    /// One query row's online softmax over its key tiles: the scores (seeded random data), the
    /// running max, the exponent base the kernels' lazy policy keeps, the rescale factor and the
    /// running sum after each tile, computed by the kernels' own `OnlineSoftmax`; the final
    /// log-sum-exp is compared with the direct f64 one. Options: --keys, --tile, --seed.
    OnlineSoftmax,
    /// The `mma.sync.m16n8k16` fragments: which lane (T0-T31) holds which element of A (16x16),
    /// B (16x8) and the f32 accumulator C/D (16x8), in which register, from the `ldmatrix` lane
    /// functions and the accumulator functions of kernels-gpu `frag.rs`.
    Fragment,
    /// A staged shared-memory tile of 16-bit values, without and with the XOR swizzle of
    /// kernels-gpu `swizzle.rs`: which 16-byte bank group (4 banks) each chunk of 8 values lands
    /// in, and the 8 chunks one `ldmatrix` phase reads. Options: --head-dim, --rows.
    Swizzle,
    /// One launch of a flash kernel as the GPU runs it: the grid of blocks a problem shape gives
    /// (from the kernel's tile item), one block's warps and lanes and the query rows each warp
    /// owns, and how the blocks of the launch fill the SMs and their 4 scheduler partitions
    /// (SMSPs), with the blocks per SM the kernel's ptxas registers and shared memory allow.
    /// Options: --dtype, --head-dim, --seq, --heads, --batch, --gpu.
    ExecutionModel,
    /// Registers, shared memory, L2 and HBM of a GPU (NVIDIA's figures, the table of
    /// `scripts/perf_model.py`) with what each level holds in a tensor-core flash kernel: the
    /// accumulators and scores in registers, the Q, K and V tiles in shared memory, S never in
    /// HBM. Options: --dtype (bf16, f16), --head-dim, --gpu.
    Memory,
    /// The data flow of a tensor-core flash kernel through one block: the Q tile staged once, K
    /// and V tiles streamed through shared memory, S = Q Kᵀ in registers, the online softmax,
    /// P·V into the O accumulator, O and LSE written once; tile sizes from the kernel's tile item.
    /// Options: --dtype (bf16, f16), --head-dim, --seq-kv.
    FlashDataflow,
}

impl Picture {
    fn name(self) -> &'static str {
        match self {
            Picture::Tiling => "tiling",
            Picture::OnlineSoftmax => "online-softmax",
            Picture::Fragment => "fragment",
            Picture::Swizzle => "swizzle",
            Picture::ExecutionModel => "execution-model",
            Picture::Memory => "memory",
            Picture::FlashDataflow => "flash-dataflow",
        }
    }
}

/// The language of a picture's labels and summary (the guide's chapters show each figure in
/// their own language). Numbers keep their digits; German writes the decimal comma.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Lang {
    #[default]
    En,
    De,
}

impl Lang {
    /// A number as this language writes it: `3.35` or `3,35`.
    pub fn num(self, s: String) -> String {
        match self {
            Lang::En => s,
            Lang::De => s.replace('.', ","),
        }
    }
}

/// `tr!(lang, "English {x}", "Deutsch {x}")`: the label in the picture's language.
macro_rules! tr {
    ($lang:expr, $en:literal, $de:literal $(, $arg:expr)* $(,)?) => {
        if $lang == $crate::cli::draw::Lang::De {
            format!($de $(, $arg)*)
        } else {
            format!($en $(, $arg)*)
        }
    };
}
pub(crate) use tr;

/// The GPUs `--gpu` names: NVIDIA's published figures, as `scripts/perf_model.py` (the
/// performance model, `GPUS`) and chapter 0 of the guide use them; a test checks the two tables
/// agree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum GpuName {
    #[default]
    #[value(name = "h100")]
    H100,
    #[value(name = "h200")]
    H200,
}

const DRAW_EXAMPLES: &str = "\
Examples:
  memattn draw tiling --dtype bf16 --seq 200 --causal --out tiling.svg
                          which key tiles each block of the bf16 d=64 kernel visits, causal
  memattn draw tiling --dtype f32 --seq-q 100 --seq-kv 300 --window 40,0 --out window.svg
  memattn draw online-softmax --keys 48 --tile 8 --seed 3 --out softmax.svg
  memattn draw fragment --out fragment.svg
  memattn draw swizzle --head-dim 64 --out swizzle.svg
  memattn draw execution-model --head-dim 128 --seq 256 --heads 2 --out execution.svg
                          grid, blocks, warps and lanes of the bf16 d=128 kernel on an H100
  memattn draw memory --gpu h200 --out memory.svg
  memattn draw flash-dataflow --head-dim 128 --seq-kv 256 --lang de --out datenfluss.svg
                          the data flow of one block, labelled in German

Without --out the SVG goes to stdout (with --json inside one JSON object, key \"svg\"). --out takes
a .svg name. Exit codes: 0 written, 2 bad option or unwritable file.";

/// `memattn draw PICTURE`.
#[derive(Debug, Args)]
#[command(after_help = DRAW_EXAMPLES)]
pub struct DrawArgs {
    /// tiling, online-softmax, fragment, swizzle, execution-model, memory or flash-dataflow.
    #[arg(value_enum, value_name = "PICTURE")]
    pub picture: Picture,
    /// The language of the labels: en or de.
    #[arg(long, value_enum, default_value = "en", value_name = "en|de")]
    pub lang: Lang,
    /// Write the SVG here (atomically: a temporary file renamed over it) instead of stdout.
    #[arg(long, value_name = "FILE.svg")]
    pub out: Option<PathBuf>,
    /// tiling, execution-model, memory, flash-dataflow: the element type, which chooses the
    /// kernel (f32: SIMT, bf16/f16: tensor cores).
    #[arg(long, default_value = "bf16", value_name = "f32|bf16|f16")]
    pub dtype: Dtype,
    /// tiling, execution-model, memory, flash-dataflow: the kernel's head dim [default: 64;
    /// execution-model, memory and flash-dataflow: 128]; swizzle: the tile's row length in
    /// 16-bit values [default: 64].
    #[arg(long, value_name = "D", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub head_dim: Option<u32>,
    /// tiling: query rows and keys (both), 1 to 2048; execution-model: query rows [default 256];
    /// flash-dataflow: keys [default 256].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub seq: Option<u32>,
    /// tiling, execution-model: query rows [default: --seq, else 200 (execution-model: 256)].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub seq_q: Option<u32>,
    /// tiling: keys [default: --seq-q]; flash-dataflow: keys [default: --seq, else 256].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub seq_kv: Option<u32>,
    /// execution-model: attention heads (the grid's y), 1 to 64.
    #[arg(long, default_value_t = 2, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub heads: u32,
    /// execution-model: sequences of the batch (the grid's z), 1 to 8.
    #[arg(long, default_value_t = 1, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub batch: u32,
    /// execution-model, memory: the GPU whose figures are shown (h100: H100 SXM, h200).
    #[arg(long, value_enum, default_value = "h100", value_name = "h100|h200")]
    pub gpu: GpuName,
    /// tiling: bottom-right causal mask (docs/semantics.md).
    #[arg(long)]
    pub causal: bool,
    /// tiling: window L,R (-1 unbounded): query i sees key j iff
    /// i + seq_kv - seq_q - L <= j <= i + seq_kv - seq_q + R.
    #[arg(long, value_name = "L,R", allow_hyphen_values = true)]
    pub window: Option<String>,
    /// online-softmax: keys of the row, 1 to 256.
    #[arg(long, default_value_t = 48, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub keys: u32,
    /// online-softmax: keys per tile, 1 to --keys.
    #[arg(long, default_value_t = 8, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub tile: u32,
    /// online-softmax: seed of the scores.
    #[arg(long, default_value_t = 3, value_name = "SEED", allow_negative_numbers = true, value_parser = non_negative_u64)]
    pub seed: u64,
    /// online-softmax: the scores' rise per key (N(drift * k, 3²)), so the running max grows
    /// along the row and the lazy rescale shows; 0 gives independent N(0, 3²) scores, whose max
    /// settles in the first tiles and is rarely raised again.
    #[arg(long, default_value_t = 0.3, value_name = "X", allow_negative_numbers = true)]
    pub drift: f64,
    /// swizzle: rows of the tile shown, 8 to 32.
    #[arg(long, default_value_t = 16, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub rows: u32,
}

/// Runs `memattn draw`.
/// The options of other pictures that `a` sets (to a value other than their default): each
/// picture reads only its own, so another picture's option would be silently ignored.
fn foreign_options(a: &DrawArgs) -> Vec<&'static str> {
    use Picture::{ExecutionModel, FlashDataflow, Memory, Tiling};
    let kernel_pictures: &[Picture] = &[Tiling, ExecutionModel, Memory, FlashDataflow];
    let given: [(&str, bool, &[Picture]); 14] = [
        ("--dtype", a.dtype != Dtype::Bf16, kernel_pictures),
        ("--head-dim", a.head_dim.is_some(), &[Tiling, Picture::Swizzle, ExecutionModel, Memory, FlashDataflow]),
        ("--seq", a.seq.is_some(), &[Tiling, ExecutionModel, FlashDataflow]),
        ("--seq-q", a.seq_q.is_some(), &[Tiling, ExecutionModel]),
        ("--seq-kv", a.seq_kv.is_some(), &[Tiling, FlashDataflow]),
        ("--heads", a.heads != 2, &[ExecutionModel]),
        ("--batch", a.batch != 1, &[ExecutionModel]),
        ("--gpu", a.gpu != GpuName::H100, &[ExecutionModel, Memory]),
        ("--causal", a.causal, &[Picture::Tiling]),
        ("--window", a.window.is_some(), &[Picture::Tiling]),
        ("--keys", a.keys != 48, &[Picture::OnlineSoftmax]),
        ("--tile", a.tile != 8, &[Picture::OnlineSoftmax]),
        ("--seed", a.seed != 3, &[Picture::OnlineSoftmax]),
        ("--drift", a.drift != 0.3, &[Picture::OnlineSoftmax]),
    ];
    let mut out: Vec<&'static str> =
        given.iter().filter(|(_, set, pics)| *set && !pics.contains(&a.picture)).map(|(name, ..)| *name).collect();
    if a.rows != 16 && a.picture != Picture::Swizzle {
        out.push("--rows");
    }
    out
}

pub fn draw(cli: &Cli, a: &DrawArgs) -> Result<i32, Error> {
    let foreign = foreign_options(a);
    if !foreign.is_empty() {
        return Err(Error::Usage(format!(
            "draw {}: {} belong{} to other pictures and would be ignored (`memattn draw --help` lists each picture's options)",
            a.picture.name(),
            foreign.join(", "),
            if foreign.len() == 1 { "s" } else { "" }
        )));
    }
    if let Some(out) = &a.out {
        // The picture is SVG: a file named for another format would hold SVG all the same.
        if !out.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg")) {
            return Err(Error::Usage(format!(
                "--out {}: draw writes SVG; name the file .svg (convert it to another format with an SVG tool)",
                out.display()
            )));
        }
        super::check_output(cli, "--out file", out, &[])?;
    }
    let (svg, summary) = render(a)?;
    match &a.out {
        Some(out) => {
            memattn_cli::files::write_atomic(out, svg.as_bytes(), "--out file")?;
            if cli.json {
                super::print_json(&serde_json::json!({
                    "picture": a.picture.name(), "out": out.display().to_string(),
                    "bytes": svg.len(), "summary": summary,
                }));
            } else {
                println!("wrote {} ({} bytes): {summary}", out.display(), svg.len());
            }
        }
        // --json keeps its promise of one JSON object on stdout: the SVG travels inside it.
        None if cli.json => super::print_json(&serde_json::json!({
            "picture": a.picture.name(), "svg": svg, "bytes": svg.len(), "summary": summary,
        })),
        None => print!("{svg}"),
    }
    Ok(0)
}

/// The SVG of a picture and a one-line summary of what it shows.
pub fn render(a: &DrawArgs) -> Result<(String, String), Error> {
    match a.picture {
        Picture::Tiling => tiling(a),
        Picture::OnlineSoftmax => online_softmax(a),
        Picture::Fragment => Ok(fragment(a.lang)),
        Picture::Swizzle => swizzle_picture(a),
        Picture::ExecutionModel => super::draw_gpu::execution_model(a),
        Picture::Memory => super::draw_gpu::memory(a),
        Picture::FlashDataflow => super::draw_gpu::flash_dataflow(a),
    }
}

// ---------------------------------------------------------------------------------------------
// A minimal SVG writer.
// ---------------------------------------------------------------------------------------------

pub(super) struct Svg {
    w: u32,
    pub(super) h: u32,
    pub(super) body: String,
    /// The rightmost end of any text, estimated (see [`text_width`]): `finish` widens the picture
    /// to it, so no label is clipped, in any language.
    right: f64,
}

/// The width of `s` at `size` px, estimated from the advance widths of DejaVu Sans (the widest
/// common sans-serif, so the estimate is generous for the others): narrow letters and
/// punctuation about 0.3 em, wide ones 0.8 to 1, capitals and digits about 0.65 to 0.75, the
/// rest 0.6. Monospace is 0.6 em a character.
pub fn text_width(s: &str, size: f64, mono: bool) -> f64 {
    if mono {
        return s.chars().count() as f64 * 0.6 * size;
    }
    let em: f64 = s
        .chars()
        .map(|c| match c {
            'i' | 'j' | 'l' | '\'' | '.' | ',' | ':' | ';' | '|' | '!' | ' ' | 'I' | '·' => 0.32,
            'f' | 't' | 'r' | '(' | ')' | '[' | ']' | '-' | '/' => 0.42,
            'm' | 'w' | 'M' | 'W' | '—' => 0.98,
            'A'..='Z' | 'ä' | 'ö' | 'ü' | 'Ä' | 'Ö' | 'Ü' | 'ß' => 0.76,
            '0'..='9' => 0.64,
            _ => 0.62,
        })
        .sum();
    em * size
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

impl Svg {
    pub(super) fn new(w: u32, h: u32) -> Self {
        Svg { w, h, body: String::new(), right: 0.0 }
    }
    pub(super) fn rect(&mut self, [x, y, w, h]: [f64; 4], fill: &str, stroke: &str, extra: &str) {
        let _ = writeln!(
            self.body,
            r#"<rect x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{h:.2}" fill="{fill}" stroke="{stroke}"{extra}/>"#
        );
    }
    pub(super) fn text(&mut self, x: f64, y: f64, size: u32, anchor: &str, s: &str) {
        let w = text_width(s, size as f64, false);
        let end = match anchor {
            "middle" => x + w / 2.0,
            "end" => x,
            _ => x + w,
        };
        self.right = self.right.max(end);
        let _ = writeln!(
            self.body,
            r#"<text x="{x:.2}" y="{y:.2}" font-size="{size}" text-anchor="{anchor}">{}</text>"#,
            esc(s)
        );
    }
    /// A line of a table: monospace, with its spaces kept (SVG collapses them otherwise).
    pub(super) fn text_mono(&mut self, x: f64, y: f64, size: u32, s: &str) {
        self.right = self.right.max(x + text_width(s, size as f64, true));
        let _ = writeln!(
            self.body,
            r#"<text x="{x:.2}" y="{y:.2}" font-size="{size}" font-family="monospace" xml:space="preserve">{}</text>"#,
            esc(s)
        );
    }
    pub(super) fn line(&mut self, (x1, y1): (f64, f64), (x2, y2): (f64, f64), stroke: &str, width: f64, dash: bool) {
        let d = if dash { r#" stroke-dasharray="4 3""# } else { "" };
        let _ = writeln!(
            self.body,
            r#"<line x1="{x1:.2}" y1="{y1:.2}" x2="{x2:.2}" y2="{y2:.2}" stroke="{stroke}" stroke-width="{width}"{d}/>"#
        );
    }
    pub(super) fn polyline(&mut self, pts: &[(f64, f64)], stroke: &str, dash: bool) {
        let p: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.2},{y:.2}")).collect();
        let d = if dash { r#" stroke-dasharray="5 3""# } else { "" };
        let _ = writeln!(
            self.body,
            r#"<polyline points="{}" fill="none" stroke="{stroke}" stroke-width="2"{d}/>"#,
            p.join(" ")
        );
    }
    /// The picture's width: as asked, or wider where a text would reach past the edge.
    pub(super) fn width(&self) -> u32 {
        self.w.max((self.right + 20.0).ceil() as u32)
    }
    pub(super) fn finish(self, title: &str) -> String {
        format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
             font-family=\"sans-serif\">\n<title>{t}</title>\n<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n{b}</svg>\n",
            w = self.width(),
            h = self.h,
            t = esc(title),
            b = self.body
        )
    }
}

/// A fill colour for lane `lane` of 32 (hues around the circle).
pub(super) fn lane_colour(lane: usize) -> String {
    format!("hsl({}, 70%, {}%)", (lane * 360 / 32 + (lane % 2) * 180) % 360, 78 + (lane % 4) as u32 * 3)
}

const BANK_COLOURS: [&str; 8] =
    ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5"];

// ---------------------------------------------------------------------------------------------
// tiling
// ---------------------------------------------------------------------------------------------

/// How a block treats one key tile, by the rule of the flash kernels (`flash_fwd_f32`,
/// `flash_fwd_mma`): it visits the tiles that meet `[first row's start, last row's end)`, and
/// masks a visited tile that reaches past the first row's end or starts before the last row's
/// start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileVisit {
    Skipped,
    Unmasked,
    Masked,
}

/// The visit of key tile `j` (of `bc` keys) by the block whose rows are `q0..=last`.
pub fn tile_visit(window: (bool, i32, i32), q0: u32, last: u32, seq_q: u32, seq_kv: u32, bc: u32, j: u32) -> TileVisit {
    let (causal, left, right) = window;
    let (first_start, first_end) = mask::key_range(causal, left, right, q0, seq_q, seq_kv);
    let (last_start, last_end) = mask::key_range(causal, left, right, last, seq_q, seq_kv);
    let block_end = last_end.max(0) as u32;
    let j_first = first_start as u32 / bc;
    let n_tiles = block_end.div_ceil(bc);
    if j < j_first || j >= n_tiles {
        return TileVisit::Skipped;
    }
    let kv0 = (j * bc) as i64;
    if kv0 + bc as i64 > first_end || kv0 < last_start {
        TileVisit::Masked
    } else {
        TileVisit::Unmasked
    }
}

const MAX_DRAW_SEQ: u32 = 2048;

fn tiling(a: &DrawArgs) -> Result<(String, String), Error> {
    let seq_q = a.seq_q.or(a.seq).unwrap_or(200);
    let seq_kv = a.seq_kv.or(a.seq).unwrap_or(seq_q);
    for (name, v) in [("--seq-q", seq_q), ("--seq-kv", seq_kv)] {
        if !(1..=MAX_DRAW_SEQ).contains(&v) {
            return Err(Error::Usage(format!("draw tiling: {name} must be 1 to {MAX_DRAW_SEQ} (got {v})")));
        }
    }
    let (left, right) = match &a.window {
        Some(w) => super::parse_window(w, "--window", ',')?,
        None => (-1, -1),
    };
    let elem = a.dtype.elem();
    let dims = KernelId::flash_head_dims(elem);
    let head_dim = a.head_dim.unwrap_or(64);
    let id = KernelId::flash_for(elem, head_dim, (left, if a.causal { 0 } else { right })).ok_or_else(|| {
        Error::Usage(format!(
            "draw tiling: no {} flash kernel for head dim {} (compiled head dims: {dims:?})",
            a.dtype.name(),
            head_dim
        ))
    })?;
    let (br, bc) = match id.variant().tile {
        Tile::FlashF32(t) => (t.br, t.bc),
        Tile::FlashMma(t) => (t.br, t.bc),
        other => return Err(Error::Usage(format!("draw tiling: {} has no flash tile ({other:?})", id.name()))),
    };
    let win = (a.causal, left, right);
    let blocks = seq_q.div_ceil(br);
    let tiles = seq_kv.div_ceil(bc);
    let scale = 600.0 / seq_q.max(seq_kv) as f64;
    let (ox, oy) = (90.0, 88.0);
    let (pw, ph) = (seq_kv as f64 * scale, seq_q as f64 * scale);
    let mut svg = Svg::new((ox + pw.max(600.0) + 40.0) as u32, (oy + ph + 120.0) as u32);
    let (mut unmasked, mut masked, mut skipped) = (0, 0, 0);
    for b in 0..blocks {
        let q0 = b * br;
        let last = (q0 + br).min(seq_q) - 1;
        for j in 0..tiles {
            let v = tile_visit(win, q0, last, seq_q, seq_kv, bc, j);
            let fill = match v {
                TileVisit::Skipped => {
                    skipped += 1;
                    "#eeeeee"
                }
                TileVisit::Unmasked => {
                    unmasked += 1;
                    "#9ecae1"
                }
                TileVisit::Masked => {
                    masked += 1;
                    "#fdd0a2"
                }
            };
            let x = ox + (j * bc) as f64 * scale;
            let y = oy + q0 as f64 * scale;
            let w = ((j * bc + bc).min(seq_kv) - j * bc) as f64 * scale;
            let h = (last + 1 - q0) as f64 * scale;
            let visit = format!("{v:?}").to_lowercase();
            svg.rect(
                [x, y, w, h],
                fill,
                "#555555",
                &format!(r#" data-block="{b}" data-tile="{j}" data-visit="{visit}""#),
            );
        }
    }
    // What each row sees: one dark bar per row.
    for i in 0..seq_q {
        let (s, e) = mask::key_range(a.causal, left, right, i, seq_q, seq_kv);
        if e > s {
            svg.rect(
                [ox + s as f64 * scale, oy + i as f64 * scale, (e - s) as f64 * scale, scale],
                "#08519c",
                "none",
                r#" fill-opacity="0.55""#,
            );
        }
    }
    for b in 0..=blocks {
        let y = oy + (b * br).min(seq_q) as f64 * scale;
        svg.line((ox, y), (ox + pw, y), "#000000", 1.5, false);
        if b < blocks && blocks <= 40 {
            let mid = oy + ((b * br) as f64 + ((b * br + br).min(seq_q) - b * br) as f64 / 2.0) * scale + 4.0;
            svg.text(ox - 6.0, mid, 11, "end", &tr!(a.lang, "block {b}", "Block {b}"));
        }
    }
    for j in 0..=tiles {
        let x = ox + (j * bc).min(seq_kv) as f64 * scale;
        svg.line((x, oy), (x, oy + ph), "#000000", 1.5, false);
        if j < tiles && tiles <= 32 {
            let mid = ox + ((j * bc) as f64 + ((j * bc + bc).min(seq_kv) - j * bc) as f64 / 2.0) * scale;
            svg.text(mid, oy - 6.0, 11, "middle", &tr!(a.lang, "tile {j}", "Kachel {j}"));
        }
    }
    let lang = a.lang;
    let mask_name = match (a.causal, left, right) {
        (false, -1, -1) => tr!(lang, "no mask", "keine Maske"),
        (true, -1, _) => tr!(lang, "causal (bottom-right)", "kausal (unten rechts ausgerichtet)"),
        (true, l, _) => tr!(lang, "causal, window {l},0", "kausal, Fenster {l},0"),
        (false, l, r) => tr!(lang, "window {l},{r}", "Fenster {l},{r}"),
    };
    let name = id.name();
    let head = tr!(
        lang,
        "{name}: Br = {br} query rows per block, Bc = {bc} keys per tile",
        "{name}: Br = {br} Query-Zeilen je Block, Bc = {bc} Keys je Kachel"
    );
    let shape = format!("seq_q {seq_q}, seq_kv {seq_kv}, {mask_name}");
    svg.text(ox, 22.0, 15, "start", &head);
    svg.text(ox, 42.0, 13, "start", &shape);
    let head = format!("{head}; {shape}");
    svg.text(
        ox,
        60.0,
        12,
        "start",
        &tr!(
            lang,
            "queries down, keys across; dark: the keys each query row sees (mask::key_range)",
            "Queries nach unten, Keys nach rechts; dunkel: die Keys, die jede Query-Zeile sieht (mask::key_range)"
        ),
    );
    let (visited, all) = (unmasked + masked, blocks * tiles);
    let summary = tr!(
        lang,
        "visited {visited} of {all} tiles ({unmasked} unmasked, {masked} masked), {skipped} skipped",
        "{visited} von {all} Kacheln besucht ({unmasked} ohne Maske, {masked} maskiert), {skipped} übersprungen"
    );
    let ly = oy + ph + 30.0;
    let legend = [
        ("#9ecae1", tr!(lang, "visited, no mask", "besucht, ohne Maske")),
        ("#fdd0a2", tr!(lang, "visited, masked", "besucht, maskiert")),
        ("#eeeeee", tr!(lang, "skipped", "übersprungen")),
    ];
    for (k, (fill, what)) in legend.iter().enumerate() {
        let x = ox + k as f64 * 190.0;
        svg.rect([x, ly - 12.0, 16.0, 16.0], fill, "#555555", "");
        svg.text(x + 22.0, ly + 1.0, 13, "start", what);
    }
    svg.text(ox, ly + 30.0, 13, "start", &summary);
    Ok((svg.finish(&format!("{head}; {summary}")), format!("{}: {summary}", id.name())))
}

// ---------------------------------------------------------------------------------------------
// online-softmax
// ---------------------------------------------------------------------------------------------

/// One tile of a row's online softmax, as the kernels' `OnlineSoftmax` leaves it (natural-log
/// units: the log2-domain values divided by `log2 e`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoftmaxStep {
    pub tile_max: f64,
    /// The true running max after this tile.
    pub running_max: f64,
    /// The exponent base the lazy policy keeps (at most `RESCALE_THRESHOLD / log2 e` below it).
    pub base: f64,
    /// Factor applied to `l` and to the output accumulator (1 when the base was kept).
    pub alpha: f64,
    pub rescaled: bool,
    /// Running sum `l = Σ e^(s - base)` after the tile.
    pub l: f64,
}

/// The scores of `memattn draw online-softmax` (seeded, key `k` drawn from N(drift k, 3²)), its steps and the final LSE
/// `(online through the kernels' f32 state, direct in f64)`.
pub fn online_steps(keys: u32, tile: u32, seed: u64, drift: f64) -> (Vec<f64>, Vec<SoftmaxStep>, f64, f64) {
    let mut rng = memattn_cli::rng::SplitMix64::new(seed);
    let scores: Vec<f64> = (0..keys).map(|k| 3.0 * rng.normal() + drift * k as f64).collect();
    let log2e = softmax::LOG2E as f64;
    let mut st = softmax::OnlineSoftmax::new();
    let mut steps = Vec::new();
    let mut running = f64::NEG_INFINITY;
    for chunk in scores.chunks(tile as usize) {
        let s2: Vec<f32> = chunk.iter().map(|&s| (s * log2e) as f32).collect();
        let tile_max = s2.iter().copied().fold(f32::NEG_INFINITY, softmax::fmax);
        let rescaled = st.must_raise(tile_max);
        let r = if rescaled { st.raise_max(tile_max) } else { st.keep() };
        for &s in &s2 {
            st.prob(s, r);
        }
        running = running.max(tile_max as f64 / log2e);
        steps.push(SoftmaxStep {
            tile_max: tile_max as f64 / log2e,
            running_max: running,
            base: st.m as f64 / log2e,
            alpha: r.alpha as f64,
            rescaled,
            l: st.l as f64,
        });
    }
    let (_, lse) = st.finish(st.l);
    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let direct = m + scores.iter().map(|s| (s - m).exp()).sum::<f64>().ln();
    (scores, steps, lse as f64, direct)
}

fn online_softmax(a: &DrawArgs) -> Result<(String, String), Error> {
    if !(1..=256).contains(&a.keys) {
        return Err(Error::Usage(format!("draw online-softmax: --keys must be 1 to 256 (got {})", a.keys)));
    }
    if !(a.drift.is_finite() && a.drift.abs() <= 1.0) {
        return Err(Error::Usage(format!(
            "draw online-softmax: --drift must be a number from -1 to 1 (got {})",
            a.drift
        )));
    }
    if a.tile == 0 || a.tile > a.keys {
        return Err(Error::Usage(format!(
            "draw online-softmax: --tile must be 1 to --keys ({}) (got {})",
            a.keys, a.tile
        )));
    }
    let (scores, steps, lse, direct) = online_steps(a.keys, a.tile, a.seed, a.drift);
    let lang = a.lang;
    let (ox, oy, pw, ph) = (70.0, 60.0, 760.0, 300.0);
    let lo = scores.iter().copied().fold(f64::INFINITY, f64::min).floor() - 1.0;
    let hi = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max).ceil() + 1.0;
    let n = scores.len() as f64;
    let x_of = |k: f64| ox + (k + 0.5) * pw / n;
    let y_of = |s: f64| oy + ph - (s - lo) / (hi - lo) * ph;
    let rows = steps.len() as u32;
    let mut svg = Svg::new((ox + pw + 40.0) as u32, (oy + ph + 90.0 + 18.0 * rows as f64 + 40.0) as u32);
    svg.rect([ox, oy, pw, ph], "none", "#000000", "");
    let mut yt = lo.ceil();
    while yt <= hi {
        svg.line((ox - 4.0, y_of(yt)), (ox, y_of(yt)), "#000000", 1.0, false);
        svg.text(ox - 7.0, y_of(yt) + 4.0, 11, "end", &format!("{yt:.0}"));
        yt += 2.0;
    }
    for (t, step) in steps.iter().enumerate() {
        let k0 = t as f64 * a.tile as f64;
        let k1 = (k0 + a.tile as f64).min(n);
        let (x0, x1) = (ox + k0 * pw / n, ox + k1 * pw / n);
        if t > 0 {
            svg.line((x0, oy), (x0, oy + ph), "#999999", 1.0, true);
        }
        svg.text((x0 + x1) / 2.0, oy + ph + 16.0, 11, "middle", &tr!(lang, "tile {t}", "Kachel {t}"));
        if step.rescaled {
            svg.text((x0 + x1) / 2.0, oy - 6.0, 11, "middle", &tr!(lang, "rescale", "umskaliert"));
        }
    }
    for (k, &s) in scores.iter().enumerate() {
        let _ =
            writeln!(svg.body, r##"<circle cx="{:.2}" cy="{:.2}" r="3" fill="#3182bd"/>"##, x_of(k as f64), y_of(s));
    }
    let step_line = |f: &dyn Fn(&SoftmaxStep) -> f64| -> Vec<(f64, f64)> {
        let mut pts = Vec::new();
        for (t, step) in steps.iter().enumerate() {
            let k0 = t as f64 * a.tile as f64;
            let k1 = (k0 + a.tile as f64).min(n);
            pts.push((ox + k0 * pw / n, y_of(f(step))));
            pts.push((ox + k1 * pw / n, y_of(f(step))));
        }
        pts
    };
    svg.polyline(&step_line(&|s| s.running_max), "#e6550d", true);
    svg.polyline(&step_line(&|s| s.base), "#31a354", false);
    let (keys, tile, seed, drift) = (a.keys, a.tile, a.seed, lang.num(a.drift.to_string()));
    let title = tr!(
        lang,
        "Online softmax of one row: {keys} keys in tiles of {tile}, score of key k drawn from N({drift} k, 3²), seed {seed}",
        "Online-Softmax einer Zeile: {keys} Keys in Kacheln zu {tile}, Score von Key k aus N({drift} k, 3²), Seed {seed}"
    );
    svg.text(ox, 22.0, 15, "start", &title);
    svg.text(
        ox,
        42.0,
        12,
        "start",
        &tr!(
            lang,
            "dots: scores; dashed orange: running max m; green: the exponent base the kernels keep (raised only when m grows by more than 8 in log2 units)",
            "Punkte: Scores; orange gestrichelt: laufendes Maximum m; grün: die Exponentenbasis der Kernel (nur angehoben, wenn m um mehr als 8 in log2-Einheiten wächst)"
        ),
    );
    let mut y = oy + ph + 44.0;
    // Each column as wide as its number (4, 8, 13, 6, 13, 13 characters) or its heading.
    let head: [String; 6] = match lang {
        Lang::En => ["tile", "tile max", "running max m", "base", "rescale alpha", "running sum l"],
        Lang::De => ["Kachel", "Kachel-Max.", "lauf. Max. m", "Basis", "Umskal. alpha", "lauf. Summe l"],
    }
    .map(String::from);
    let w: Vec<usize> = head.iter().zip([4, 8, 13, 6, 13, 13]).map(|(h, n)| h.chars().count().max(n)).collect();
    let row = |cells: [String; 6]| -> String {
        let padded: Vec<String> = cells.iter().zip(&w).map(|(c, &n)| format!("{c:>n$}")).collect();
        padded.join("   ")
    };
    svg.text_mono(ox, y, 12, &row(head.clone()));
    for (t, s) in steps.iter().enumerate() {
        y += 18.0;
        let alpha =
            if s.rescaled { lang.num(format!("{:.6}", s.alpha)) } else { tr!(lang, "kept (1)", "behalten (1)") };
        let n = |x: f64, p: usize| lang.num(format!("{x:.p$}"));
        svg.text_mono(
            ox,
            y,
            12,
            &row([t.to_string(), n(s.tile_max, 3), n(s.running_max, 3), n(s.base, 3), alpha, n(s.l, 6)]),
        );
    }
    let (rescaled, n_tiles) = (steps.iter().filter(|s| s.rescaled).count(), steps.len());
    let (lse, direct) = (lang.num(format!("{lse:.6}")), lang.num(format!("{direct:.6}")));
    let summary = tr!(
        lang,
        "LSE = base + ln l = {lse} (kernels' f32 state) vs {direct} (direct, f64); {rescaled} of {n_tiles} tiles rescaled",
        "LSE = Basis + ln l = {lse} (f32-Zustand der Kernel) gegen {direct} (direkt, f64); {rescaled} von {n_tiles} Kacheln umskaliert"
    );
    svg.text(ox, y + 28.0, 13, "start", &summary);
    Ok((svg.finish(&format!("{title}; {summary}")), summary))
}

// ---------------------------------------------------------------------------------------------
// fragment
// ---------------------------------------------------------------------------------------------

/// Which lane and register hold each element of the three `mma.sync.m16n8k16` operands, as
/// `(operand, row, col) -> (lane, register name)`: A (16 x 16, rows m, cols k) and B (16 x 8, rows
/// k, cols n, the first key tile of `Q Kᵀ`) from the `ldmatrix` lane functions
/// (`frag::ldsm_a_lane`, `frag::ldsm_b_lane`; register `i` of lane `l` receives row `l / 4`,
/// columns `2 (l % 4)`, `+1` of matrix `i`), C/D from `frag::acc_row` and `frag::acc_col`.
pub fn fragment_cells() -> Vec<(char, usize, usize, usize, String)> {
    let mut out = Vec::new();
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        for i in 0..4 {
            let (row, chunk) = frag::ldsm_a_lane(8 * i + g);
            for h in 0..2 {
                out.push(('A', row, 8 * chunk + 2 * t + h, lane, format!("a{i}")));
            }
        }
        for i in 0..2 {
            let (key, chunk) = frag::ldsm_b_lane(8 * i + g);
            for h in 0..2 {
                out.push(('B', 8 * chunk + 2 * t + h, key, lane, format!("b{i}")));
            }
        }
        for e in 0..4 {
            out.push(('C', g + 8 * frag::acc_row(e), 2 * t + frag::acc_col(0, e), lane, format!("d{e}")));
        }
    }
    out
}

fn fragment(lang: Lang) -> (String, String) {
    let cell = 34.0;
    let (oy, gap) = (90.0, 60.0);
    let origin = |op: char| -> f64 {
        match op {
            'A' => 40.0,
            'B' => 40.0 + 16.0 * cell + gap,
            _ => 40.0 + 24.0 * cell + 2.0 * gap,
        }
    };
    let w = (40.0 + 32.0 * cell + 2.0 * gap + 40.0) as u32;
    let mut svg = Svg::new(w, (oy + 16.0 * cell + 80.0) as u32);
    let title = tr!(
        lang,
        "mma.sync.m16n8k16: which lane (T0-T31) holds which element, in which register",
        "mma.sync.m16n8k16: welche Lane (T0-T31) welches Element hält, in welchem Register"
    );
    svg.text(40.0, 24.0, 16, "start", &title);
    svg.text(
        40.0,
        44.0,
        12,
        "start",
        &tr!(
            lang,
            "from kernels-gpu frag.rs (ldsm_a_lane, ldsm_b_lane, acc_row, acc_col); a 16-bit register holds two neighbours (k, k+1)",
            "aus kernels-gpu frag.rs (ldsm_a_lane, ldsm_b_lane, acc_row, acc_col); ein Register der 16-Bit-Operanden hält zwei Nachbarn (k, k+1)"
        ),
    );
    for (op, label, cols) in [
        ('A', tr!(lang, "A: 16 x 16 (rows m, cols k), 16-bit", "A: 16 x 16 (Zeilen m, Spalten k), 16 Bit"), 16),
        ('B', tr!(lang, "B: 16 x 8 (rows k, cols n)", "B: 16 x 8 (Zeilen k, Spalten n)"), 8),
        ('C', "C/D: 16 x 8 f32".to_string(), 8),
    ] {
        svg.text(origin(op), oy - 12.0, 13, "start", &label);
        for c in 0..cols {
            svg.text(origin(op) + (c as f64 + 0.5) * cell, oy + 16.0 * cell + 14.0, 10, "middle", &c.to_string());
        }
    }
    for r in 0..16 {
        svg.text(origin('A') - 4.0, oy + (r as f64 + 0.6) * cell, 10, "end", &r.to_string());
    }
    let cells = fragment_cells();
    for (op, row, col, lane, reg) in &cells {
        let (x, y) = (origin(*op) + *col as f64 * cell, oy + *row as f64 * cell);
        svg.rect(
            [x, y, cell, cell],
            &lane_colour(*lane),
            "#666666",
            &format!(r#" data-cell="{op} {row} {col}" data-lane="{lane}" data-reg="{reg}""#),
        );
        svg.text(x + cell / 2.0, y + 14.0, 11, "middle", &format!("T{lane}"));
        svg.text(x + cell / 2.0, y + 27.0, 10, "middle", reg);
    }
    let n = cells.len();
    let summary =
        tr!(lang, "{n} elements: A 256, B 128, C/D 128, 32 lanes", "{n} Elemente: A 256, B 128, C/D 128, 32 Lanes");
    (svg.finish(&format!("{title}; {summary}")), summary)
}

// ---------------------------------------------------------------------------------------------
// swizzle
// ---------------------------------------------------------------------------------------------

/// The bank group (0..8) and chunk position of logical chunk `chunk` of row `row`, plain
/// (`swizzled = false`) or through `swizzle::swizzled_offset`.
pub fn chunk_place(d: usize, row: usize, chunk: usize, swizzled: bool) -> (u32, usize) {
    let off = if swizzled { swizzle::swizzled_offset(d, row, chunk) } else { row * d * 2 + chunk * swizzle::CHUNK };
    (swizzle::bank_group(off as u32), (off - row * d * 2) / swizzle::CHUNK)
}

fn swizzle_picture(a: &DrawArgs) -> Result<(String, String), Error> {
    let d = a.head_dim.unwrap_or(64) as usize;
    let lang = a.lang;
    if !(32..=256).contains(&d) || !d.is_multiple_of(32) {
        return Err(Error::Usage(format!(
            "draw swizzle: --head-dim must be a multiple of 32 from 32 to 256 (the swizzle permutes aligned groups of 4 or 8 chunks; got {d})"
        )));
    }
    if !(8..=32).contains(&a.rows) {
        return Err(Error::Usage(format!("draw swizzle: --rows must be 8 to 32 (got {})", a.rows)));
    }
    let rows = a.rows as usize;
    let chunks = d / 8;
    let cell = if chunks > 16 { 24.0 } else { 36.0 };
    let (ox, oy) = (70.0, 80.0);
    let panel_h = rows as f64 * 22.0;
    let w = (ox + chunks as f64 * cell + 40.0).max(820.0) as u32;
    let mut svg = Svg::new(w, (oy + 2.0 * panel_h + 170.0) as u32);
    let title = tr!(
        lang,
        "Shared-memory tile, rows of {d} 16-bit values = {chunks} chunks of 16 bytes; colour: bank group (4 banks)",
        "Kachel im Shared Memory, Zeilen aus {d} 16-Bit-Werten = {chunks} Chunks zu 16 Byte; Farbe: Bank-Gruppe (4 Bänke)"
    );
    svg.text(ox, 22.0, 15, "start", &title);
    svg.text(
        ox,
        42.0,
        12,
        "start",
        &tr!(
            lang,
            "each cell is one physical chunk position, labelled with the logical chunk stored there; thick: logical chunk 0 of rows 0-7 (one ldmatrix phase)",
            "jede Zelle ist eine physische Chunk-Position, beschriftet mit dem logischen Chunk darin; dick: logischer Chunk 0 der Zeilen 0-7 (eine ldmatrix-Phase)"
        ),
    );
    let mut phase = [Vec::new(), Vec::new()];
    for (p, swizzled) in [false, true].into_iter().enumerate() {
        let y0 = oy + p as f64 * (panel_h + 60.0);
        let label = if swizzled {
            tr!(lang, "with swizzle::swizzled_offset", "mit swizzle::swizzled_offset")
        } else {
            tr!(lang, "without swizzle (row-major)", "ohne Swizzle (zeilenweise)")
        };
        svg.text(ox, y0 - 8.0, 13, "start", &label);
        for row in 0..rows {
            svg.text(ox - 6.0, y0 + row as f64 * 22.0 + 15.0, 10, "end", &tr!(lang, "row {row}", "Zeile {row}"));
            for chunk in 0..chunks {
                let (group, pos) = chunk_place(d, row, chunk, swizzled);
                let (x, y) = (ox + pos as f64 * cell, y0 + row as f64 * 22.0);
                let hit = chunk == 0 && row < 8;
                if hit {
                    phase[p].push(group);
                }
                let extra = format!(
                    r#" data-swizzled="{swizzled}" data-row="{row}" data-chunk="{chunk}" data-group="{group}"{}"#,
                    if hit { r#" stroke-width="3""# } else { "" }
                );
                svg.rect(
                    [x, y, cell, 22.0],
                    BANK_COLOURS[group as usize],
                    if hit { "#000000" } else { "#888888" },
                    &extra,
                );
                svg.text(x + cell / 2.0, y + 15.0, 10, "middle", &format!("c{chunk}"));
            }
        }
    }
    let distinct = |v: &Vec<u32>| v.iter().collect::<std::collections::BTreeSet<_>>().len();
    let ly = oy + 2.0 * panel_h + 80.0;
    for (g, c) in BANK_COLOURS.iter().enumerate() {
        let x = ox + g as f64 * 90.0;
        svg.rect([x, ly - 12.0, 16.0, 16.0], c, "#555555", "");
        let (b0, b1) = (4 * g, 4 * g + 3);
        svg.text(x + 20.0, ly + 1.0, 11, "start", &tr!(lang, "banks {b0}-{b1}", "Bänke {b0}-{b1}"));
    }
    let (plain, ways, swizzled) = (distinct(&phase[0]), 8 / distinct(&phase[0]), distinct(&phase[1]));
    let summary = tr!(
        lang,
        "one ldmatrix phase (chunk 0 of rows 0-7) hits {plain} distinct bank groups without the swizzle ({ways}-way conflict) and {swizzled} with it",
        "eine ldmatrix-Phase (Chunk 0 der Zeilen 0-7) trifft ohne Swizzle {plain} verschiedene Bank-Gruppen ({ways}-facher Konflikt), mit Swizzle {swizzled}"
    );
    svg.text(ox, ly + 30.0, 13, "start", &summary);
    Ok((svg.finish(&format!("{title}; {summary}")), summary))
}
