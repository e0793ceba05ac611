//! `memattn draw`: the guide's figures are what the command renders today (byte for byte), and
//! each picture shows values derived independently here (hand-counted tiles, the PTX ISA's
//! fragment layout, the bank of a swizzled chunk, an f64 log-sum-exp).

use crate::common;
use common::*;
use std::path::{Path, PathBuf};

/// Each committed figure and the options that render it (the guide's chapters 0, 3 and 4 show
/// them). Each is committed twice: `docs/guide/figures/NAME` with English labels for the English
/// chapters and `docs/guide/figures/de/NAME` (the same options and `--lang de`) for the German ones.
const FIGURES: &[(&str, &[&str])] = &[
    ("tiling-causal.svg", &["tiling", "--dtype", "bf16", "--seq", "200", "--causal"]),
    ("tiling-window.svg", &["tiling", "--dtype", "f32", "--seq-q", "100", "--seq-kv", "300", "--window", "40,0"]),
    ("online-softmax.svg", &["online-softmax"]),
    ("fragment.svg", &["fragment"]),
    ("swizzle.svg", &["swizzle", "--head-dim", "64"]),
    (
        "execution-model.svg",
        &["execution-model", "--dtype", "bf16", "--head-dim", "128", "--seq", "256", "--heads", "2"],
    ),
    ("memory.svg", &["memory", "--dtype", "bf16", "--head-dim", "128", "--gpu", "h100"]),
    ("flash-dataflow.svg", &["flash-dataflow", "--dtype", "bf16", "--head-dim", "128", "--seq-kv", "256"]),
];

/// The figures' languages: the folder under `docs/guide/figures` and the options that choose it.
const LANGS: &[(&str, &[&str])] = &[("", &[]), ("de/", &["--lang", "de"])];

fn figures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/guide/figures")
}

/// Renders to stdout (no `--out`) and returns the SVG.
fn render(args: &[&str]) -> String {
    let o = memattn(&[&["draw"], args].concat());
    assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
    stdout(&o)
}

/// The `data-` attributes of the element whose attribute `key` is `value`.
fn attr(svg: &str, key_value: &str, want: &str) -> String {
    let line = svg.lines().find(|l| l.contains(key_value)).unwrap_or_else(|| panic!("no element with {key_value}"));
    let tag = format!("{want}=\"");
    let start = line.find(&tag).unwrap_or_else(|| panic!("{line} has no {want}")) + tag.len();
    line[start..].split('"').next().unwrap().to_string()
}

#[test]
fn committed_figures_are_what_draw_renders_now() {
    let dir = tempdir();
    for (sub, lang) in LANGS {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
        for (file, args) in FIGURES {
            let name = format!("{sub}{file}");
            let out = dir.join(&name);
            let o = memattn(&[&["draw"], *args, lang, &["--out", out.to_str().unwrap()]].concat());
            assert_eq!(code(&o), 0, "{name}: {}", stderr(&o));
            assert!(stdout(&o).starts_with(&format!("wrote {}", out.display())), "{}", stdout(&o));
            let fresh = std::fs::read(&out).unwrap();
            let committed = std::fs::read(figures().join(&name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(
                fresh == committed,
                "docs/guide/figures/{name} is stale: rerun `memattn draw {} {} --out docs/guide/figures/{name}`",
                args.join(" "),
                lang.join(" ")
            );
        }
        // Every committed figure has its command here.
        for e in std::fs::read_dir(figures().join(sub)).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                continue;
            }
            let name = e.file_name().into_string().unwrap();
            assert!(
                FIGURES.iter().any(|(f, _)| *f == name),
                "docs/guide/figures/{sub}{name} has no command in FIGURES"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// No label of a committed figure reaches past its right edge (a clipped title): each text's
/// width is bounded below by 0.45 em a character (sans-serif letters are 0.5 to 0.6 em on
/// average, monospace 0.6), and the end of each start-anchored text, or half of a centred one,
/// must lie inside the picture.
#[test]
fn no_label_of_a_figure_is_clipped() {
    let mut clipped = Vec::new();
    for (sub, lang) in LANGS {
        for (file, args) in FIGURES {
            let svg = render(&[*args, lang].concat());
            let width: f64 = attr(&svg, "<svg ", "width").parse().unwrap();
            for line in svg.lines().filter(|l| l.starts_with("<text ")) {
                let num = |k: &str| attr(line, "<text ", k).parse::<f64>().unwrap();
                let (x, size) = (num("x"), num("font-size"));
                let text = line.split('>').nth(1).unwrap_or("").split('<').next().unwrap_or("");
                let chars = text.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").chars().count();
                let em = if line.contains("monospace") { 0.6 } else { 0.45 };
                let w = chars as f64 * em * size;
                let end = if line.contains(r#"text-anchor="middle""#) {
                    x + w / 2.0
                } else if line.contains(r#"text-anchor="end""#) {
                    x
                } else {
                    x + w
                };
                if end > width {
                    clipped.push(format!("{sub}{file}: `{text}` ends at about {end:.0} of {width}"));
                }
            }
        }
    }
    assert!(clipped.is_empty(), "labels reach past the picture:\n{}", clipped.join("\n"));
}

fn tempdir() -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-draw-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Causal, 200 x 200, bf16 d=64 (Br 128, Bc 64): block 0 (rows 0-127) sees keys up to 127, so it
/// visits tiles 0 and 1 (both masked: row 0 sees key 0 only) and skips 2 and 3; block 1 (rows
/// 128-199) sees keys 0-128 on its first row, so tiles 0 and 1 need no mask, tile 2 holds its
/// diagonal and tile 3 reaches past key 199.
#[test]
fn tiling_counts_the_tiles_a_block_visits() {
    let svg = render(&["tiling", "--dtype", "bf16", "--seq", "200", "--causal"]);
    assert!(svg.contains("flash_fwd_bf16_d64: Br = 128 query rows per block, Bc = 64 keys per tile"), "{svg}");
    assert!(svg.contains("visited 6 of 8 tiles (2 unmasked, 4 masked), 2 skipped"));
    let visit = |b: u32, j: u32| attr(&svg, &format!(r#"data-block="{b}" data-tile="{j}""#), "data-visit");
    let want = [["masked", "masked", "skipped", "skipped"], ["unmasked", "unmasked", "masked", "masked"]];
    for (b, row) in want.iter().enumerate() {
        for (j, w) in row.iter().enumerate() {
            assert_eq!(visit(b as u32, j as u32), *w, "block {b} tile {j}");
        }
    }
    // A left window of 40 keys with more keys than queries (f32 d=64: Br 32, Bc 64): row i sees
    // keys i + 160 to i + 200, so block 0 (rows 0-31, keys 160-231) visits tiles 2 and 3 only.
    let svg = render(&["tiling", "--dtype", "f32", "--seq-q", "100", "--seq-kv", "300", "--window", "40,0"]);
    assert!(svg.contains("visited 7 of 20 tiles (0 unmasked, 7 masked), 13 skipped"), "{svg}");
    let visit = |b: u32, j: u32| attr(&svg, &format!(r#"data-block="{b}" data-tile="{j}""#), "data-visit");
    assert_eq!([visit(0, 1), visit(0, 2), visit(0, 3), visit(0, 4)], ["skipped", "masked", "masked", "skipped"]);
}

/// The PTX ISA's m16n8k16 layout (group g = lane / 4, t = lane % 4): A a0 (g, 2t), a1 (g + 8, 2t),
/// a2 (g, 2t + 8), a3 (g + 8, 2t + 8); B b0 (k 2t, n g), b1 (k 2t + 8, n g); C d0 (g, 2t),
/// d1 (g, 2t + 1), d2 (g + 8, 2t), d3 (g + 8, 2t + 1).
#[test]
fn fragment_cells_follow_the_isa_layout_once_each() {
    let svg = render(&["fragment"]);
    let mut cells = 0;
    for lane in 0..32usize {
        let (g, t) = (lane / 4, lane % 4);
        let mut want: Vec<(String, String)> = Vec::new();
        for h in 0..2 {
            for (i, (r, c)) in [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)].iter().enumerate() {
                want.push((format!("A {r} {}", c + h), format!("a{i}")));
            }
            want.push((format!("B {} {g}", 2 * t + h), "b0".into()));
            want.push((format!("B {} {g}", 2 * t + 8 + h), "b1".into()));
        }
        for (e, (r, c)) in [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)].iter().enumerate() {
            want.push((format!("C {r} {c}"), format!("d{e}")));
        }
        for (cell, reg) in want {
            let key = format!(r#"data-cell="{cell}""#);
            assert_eq!(svg.matches(&key).count(), 1, "{cell} drawn once");
            assert_eq!(attr(&svg, &key, "data-lane"), lane.to_string(), "{cell}");
            assert_eq!(attr(&svg, &key, "data-reg"), reg, "{cell}");
            cells += 1;
        }
    }
    assert_eq!(cells, 512);
    assert_eq!(svg.matches("data-cell=").count(), 512);
}

/// Rows of 64 16-bit values are 128 bytes, one line of 32 banks: unswizzled, chunk c of any row
/// is in bank group c; swizzled, chunk c of row r is stored at position c ^ (r % 8).
#[test]
fn swizzle_places_each_chunk_in_its_bank_group() {
    let svg = render(&["swizzle", "--head-dim", "64"]);
    for row in 0..16 {
        for chunk in 0..8 {
            let key = |s: bool| format!(r#"data-swizzled="{s}" data-row="{row}" data-chunk="{chunk}""#);
            assert_eq!(attr(&svg, &key(false), "data-group"), chunk.to_string());
            assert_eq!(
                attr(&svg, &key(true), "data-group"),
                (chunk ^ (row % 8)).to_string(),
                "row {row} chunk {chunk}"
            );
        }
    }
    assert!(svg.contains("hits 1 distinct bank groups without the swizzle (8-way conflict) and 8 with it"));
    // d = 96: rows of 192 bytes; rows 2i and 2i + 1 fall on opposite halves of a line already.
    let svg = render(&["swizzle", "--head-dim", "96"]);
    assert!(svg.contains("hits 2 distinct bank groups without the swizzle (4-way conflict) and 8 with it"), "{svg}");
}

/// The final LSE of the kernels' f32 online-softmax state equals the direct f64 log-sum-exp of the
/// same scores, drawn here from the same seeded generator.
#[test]
fn online_softmax_ends_at_the_direct_log_sum_exp() {
    for (keys, tile, seed, drift) in [(48u32, 8u32, 3u64, 0.3f64), (37, 5, 11, 0.0), (1, 1, 0, 0.3)] {
        let mut rng = memattn_cli::rng::SplitMix64::new(seed);
        let s: Vec<f64> = (0..keys).map(|k| 3.0 * rng.normal() + drift * k as f64).collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let direct = m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        let args = ["--json", "draw", "online-softmax", "--keys", &keys.to_string(), "--tile", &tile.to_string()];
        let extra = ["--seed".to_string(), seed.to_string(), "--drift".into(), drift.to_string(), "--out".into()];
        let out = tempdir().join(format!("os-{keys}.svg"));
        let mut all: Vec<&str> = args.to_vec();
        all.extend(extra.iter().map(String::as_str));
        all.push(out.to_str().unwrap());
        let o = memattn(&all);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let summary = json(&o)["summary"].as_str().unwrap().to_string();
        let online: f64 = summary
            .strip_prefix("LSE = base + ln l = ")
            .and_then(|r| r.split(' ').next())
            .and_then(|x| x.parse().ok())
            .unwrap_or_else(|| panic!("{summary}"));
        assert!((online - direct).abs() <= 1e-5 * direct.abs().max(1.0), "{online} vs {direct} ({summary})");
        let svg = std::fs::read_to_string(&out).unwrap();
        assert_eq!(svg.matches("<circle").count(), keys as usize, "one dot per score");
        assert!(
            svg.contains(&format!("{}", keys.div_ceil(tile)))
                && summary.contains(&format!("of {} tiles", keys.div_ceil(tile)))
        );
    }
    // The rising scores make the lazy policy raise the base more than once; independent scores
    // settle after the first tile.
    let v = json(&memattn(&["--json", "draw", "online-softmax", "--out", tempdir().join("d.svg").to_str().unwrap()]));
    assert!(v["summary"].as_str().unwrap().ends_with("3 of 6 tiles rescaled"), "{v}");
}

#[test]
fn bad_options_are_exit_2_naming_the_limit() {
    let cases: &[(&[&str], &str)] = &[
        (&["tiling", "--seq", "0"], "--seq-q must be 1 to 2048 (got 0)"),
        (&["tiling", "--head-dim", "50"], "no bf16 flash kernel for head dim 50"),
        (&["tiling", "--window", "-3,0"], "the left side is -3"),
        (&["swizzle", "--head-dim", "80"], "--head-dim must be a multiple of 32 from 32 to 256"),
        (&["swizzle", "--rows", "4"], "--rows must be 8 to 32 (got 4)"),
        (&["online-softmax", "--tile", "0"], "--tile must be 1 to --keys (48) (got 0)"),
        (&["online-softmax", "--keys", "300"], "--keys must be 1 to 256 (got 300)"),
        (&["online-softmax", "--drift", "nan"], "--drift must be a number from -1 to 1"),
        (&["fragment", "--out", "/nonexistent-dir/x.svg"], "--out file"),
        (&["execution-model", "--seq", "5000"], "too large to draw"),
        (&["execution-model", "--heads", "0"], "--heads must be 1 to 64"),
        (&["flash-dataflow", "--seq-kv", "2000"], "--seq-kv must be 1 to 1024"),
        (&["memory", "--head-dim", "50"], "no bf16 flash kernel for head dim 50"),
    ];
    for (args, want) in cases {
        let o = memattn(&[&["draw"], *args].concat());
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
        assert!(stdout(&o).is_empty(), "{args:?}: nothing written on stdout");
    }
}

/// `--json` keeps its promise of one JSON object on stdout (the SVG inside it, identical to the
/// plain output), and `--out` names an .svg file: `x.png` is refused (exit 2) and not created,
/// where SVG was written under a PNG name.
#[test]
fn json_wraps_the_svg_and_out_must_be_svg() {
    let plain = render(&["fragment"]);
    let o = memattn(&["--json", "draw", "fragment"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["picture"], "fragment");
    assert_eq!(v["svg"].as_str().unwrap(), plain);
    assert_eq!(v["bytes"].as_u64().unwrap() as usize, plain.len());
    let dir = tempdir();
    let png = dir.join("x.png");
    let o = memattn(&["draw", "tiling", "--out", png.to_str().unwrap()]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("name the file .svg"), "{}", stderr(&o));
    assert!(!png.exists());
}

/// An option of another picture is refused naming it (exit 2), where it was silently ignored;
/// a picture's own options still draw.
#[test]
fn options_of_other_pictures_are_refused() {
    for (args, named) in [
        (&["draw", "fragment", "--keys", "10"][..], "--keys"),
        (&["draw", "tiling", "--rows", "8"][..], "--rows"),
        (&["draw", "swizzle", "--causal"][..], "--causal"),
        (&["draw", "online-softmax", "--head-dim", "128"][..], "--head-dim"),
        (&["draw", "memory", "--seq", "300"][..], "--seq"),
        (&["draw", "tiling", "--gpu", "h200"][..], "--gpu"),
    ] {
        let o = memattn(args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(named) && stderr(&o).contains("other pictures"), "{}", stderr(&o));
    }
    render(&["swizzle", "--rows", "8", "--head-dim", "128"]);
    render(&["online-softmax", "--keys", "10", "--tile", "5"]);
}

/// The bf16 d=128 kernel's tile (kernels-gpu `FLASH_MMA_D128`): Br 64 rows in 4 warps of 16, so
/// 256 queries, 2 heads and 1 sequence are a grid [4, 2, 1]; thread t is lane t % 32 of warp
/// t / 32. Its sm_90 registers (the ptxas report, read here from the JSON) and 48 KiB of shared
/// memory give the blocks per SM by chapter 0's rule.
#[test]
fn execution_model_shows_the_launch_of_the_tile() {
    let svg = render(&["execution-model", "--head-dim", "128", "--seq", "256", "--heads", "2"]);
    assert!(svg.contains("grid [4, 2, 1] = 8 blocks of 128 threads"), "{svg}");
    assert_eq!(svg.matches("data-block=").count(), 8);
    assert_eq!(attr(&svg, r#"data-block="3 1 0""#, "data-rows"), "192-255");
    assert_eq!(svg.matches("data-thread=").count(), 128);
    assert_eq!(attr(&svg, r#"data-thread="37""#, "data-warp"), "1");
    assert_eq!(attr(&svg, r#"data-thread="37""#, "data-lane"), "5");
    assert!(svg.contains("query rows 48-63"), "warp 3 owns the last 16 rows");
    let report =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels-gpu/ptx/ptxas-report.json"))
            .unwrap();
    let row = report
        .lines()
        .find(|l| l.contains(r#""name": "flash_fwd_bf16_d128", "arch": "sm_90""#))
        .expect("an sm_90 row for flash_fwd_bf16_d128");
    let regs: u32 = row.split(r#""registers": "#).nth(1).unwrap().split(',').next().unwrap().parse().unwrap();
    let by_regs = 65_536 / (regs * 128);
    let by_smem = 228 * 1024 / (48 * 1024 + 1024);
    let blocks = by_regs.min(by_smem).min(16);
    assert!(svg.contains(&format!("registers 65 536 / ({regs} · 128) → {by_regs}")), "{svg}");
    assert!(svg.contains(&format!("one SM holding {blocks} blocks of this kernel at once")));
    assert_eq!(svg.matches("· warp ").count() as u32, 4 * blocks, "every warp of the resident blocks on an SMSP");
    // The f32 kernel gives each row 4 lanes: a warp owns 8 of its 32 rows.
    let svg = render(&["execution-model", "--dtype", "f32", "--head-dim", "64", "--seq", "100", "--heads", "1"]);
    assert!(svg.contains("grid [4, 1, 1]") && svg.contains("query rows 24-31"), "{svg}");
}

/// The GPU figures of `memory` are those of `scripts/perf_model.py` (its `GPUS` table): SMs,
/// shared memory per SM and HBM bandwidth; the tiles are the d=128 kernel's (Br 64, Bc 64:
/// Q, K and V tiles of 64 x 128 x 2 B = 16 KiB each).
#[test]
fn memory_figures_agree_with_the_performance_model() {
    let model =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/perf_model.py")).unwrap();
    for (gpu, key) in [("h100", "'H100-SXM': dict("), ("h200", "'H200': dict(")] {
        let at = model.find(key).unwrap_or_else(|| panic!("perf_model.py has no {key}"));
        let entry = &model[at..at + model[at..].find(")\n").unwrap()];
        let field = |name: &str| -> String {
            let f = entry.split(&format!("{name}=")).nth(1).unwrap_or_else(|| panic!("{key} has no {name}"));
            f.split([',', ')']).next().unwrap().trim().to_string()
        };
        let svg = render(&["memory", "--gpu", gpu]);
        assert!(svg.contains(&format!("all {} SMs", field("sms"))), "{gpu}: {svg}");
        let smem_kb = field("smem_per_sm").trim_end_matches(" * 1024").to_string();
        assert!(svg.contains(&format!("up to {smem_kb} KB per SM")), "{gpu}");
        assert!(svg.contains(&format!(", {} TB/s", field("hbm_tbps"))), "{gpu}");
        assert!(svg.contains(&format!("{} × 32 bit per SM", field("regs_per_sm").replace("65536", "65 536"))), "{gpu}");
    }
    let svg = render(&["memory"]);
    assert!(
        svg.contains("Q tile Br × d = 16 KiB (staged once), K tile and V tile Bc × d = 16 KiB each: 48 KiB a block")
    );
    assert!(svg.contains("O accumulator 64 (Br × d f32 = 32 KiB a block), scores S/P 32"), "{svg}");
    // The f32 kernel has no staged Q tile or fragments: refused, naming why.
    let o = memattn(&["draw", "memory", "--dtype", "f32"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("shows the tensor-core kernels"), "{}", stderr(&o));
}

/// 256 keys in tiles of Bc = 64 are 4 key tiles; per block K and V stream 2 x 4 x 64 x 128 x 2 B
/// = 128 KiB and O and LSE are 64 x 128 x 2 + 64 x 4 B = 16.25 KiB. 300 keys need a fifth tile.
#[test]
fn flash_dataflow_streams_the_key_tiles() {
    let o = memattn(&["--json", "draw", "flash-dataflow"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let summary = v["summary"].as_str().unwrap();
    assert_eq!(
        summary,
        "flash_fwd_bf16_d128: per block: Q tile 16 KiB read once, K and V 128 KiB streamed in 4 tiles, \
         O and LSE 16.25 KiB written once; S and P (16 KiB a tile) stay in registers"
    );
    let svg = v["svg"].as_str().unwrap();
    assert!(svg.contains(r#"data-tile="K 3""#) && !svg.contains(r#"data-tile="K 4""#));
    let svg = render(&["flash-dataflow", "--seq-kv", "300", "--head-dim", "64"]);
    assert!(svg.contains(r#"data-tile="V 4""#) && svg.contains("Br = 128 query rows, key tiles of Bc = 64, d = 64"));
    let de = render(&["flash-dataflow", "--lang", "de"]);
    assert!(de.contains("O und LSE 16,25 KiB einmal geschrieben"), "German labels and decimal comma");
}
