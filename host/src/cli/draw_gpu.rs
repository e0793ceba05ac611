//! The pictures of `memattn draw` that show a flash kernel on the machine: `execution-model`
//! (grid, blocks, warps, lanes, SMs), `memory` (registers, shared memory, L2, HBM and what the
//! kernel keeps in each) and `flash-dataflow` (one block's tiles through the levels). Every tile
//! size, grid and shared-memory figure comes from the kernel's tile item and the variant table
//! (kernels-gpu `tiles.rs`, `variants.rs`), the registers from the committed ptxas report; the
//! GPU's own figures are NVIDIA's published ones, the table [`gpu`] keeps.

use super::draw::{lane_colour, text_width, tr, DrawArgs, GpuName, Lang, Svg};
use kernels_gpu::tiles::{FlashMmaTile, SMEM_OPT_IN_SM90};
use kernels_gpu::variants::{LaunchShape, Tile};
use kernels_gpu::KernelId;
use memattn_cli::error::Error;
use std::fmt::Write as _;

/// NVIDIA's published figures of one GPU (data sheets and the Hopper white paper), the same as
/// `GPUS` in `scripts/perf_model.py` and chapter 0's table (a test compares them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpu {
    pub name: &'static str,
    /// The PTX target ptxas compiled for it (the row of `ptxas-report.json` it runs).
    pub arch: &'static str,
    pub sms: u32,
    /// Scheduler partitions per SM: a warp lives on one of them.
    pub smsps_per_sm: u32,
    pub regs_per_sm: u32,
    pub max_warps_per_sm: u32,
    pub max_blocks_per_sm: u32,
    /// Shared memory per SM in KB (1024 bytes), and what one block may use with the opt-in.
    pub smem_per_sm_kb: u32,
    pub smem_per_block: u32,
    /// The driver's reserve per resident block.
    pub smem_reserved_per_block: u32,
    /// 32 banks of 4 bytes.
    pub smem_bytes_per_clock: u32,
    /// `None` where NVIDIA's figures for the part do not name it.
    pub l2_mb: Option<u32>,
    pub hbm: &'static str,
    pub hbm_tbps: f64,
}

pub const fn gpu(name: GpuName) -> Gpu {
    let h100 = Gpu {
        name: "H100 SXM",
        arch: "sm_90",
        sms: 132,
        smsps_per_sm: 4,
        regs_per_sm: 65_536,
        max_warps_per_sm: 64,
        max_blocks_per_sm: 32,
        smem_per_sm_kb: 228,
        smem_per_block: SMEM_OPT_IN_SM90,
        smem_reserved_per_block: 1024,
        smem_bytes_per_clock: 128,
        l2_mb: Some(50),
        hbm: "80 GB HBM3",
        hbm_tbps: 3.35,
    };
    match name {
        GpuName::H100 => h100,
        GpuName::H200 => Gpu { name: "H200", l2_mb: None, hbm: "141 GB HBM3e", hbm_tbps: 4.8, ..h100 },
    }
}

/// Blocks of one kernel resident on one SM and what limits them (registers, shared memory,
/// threads), by the rule of chapter 0 and `scripts/perf_model.py`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Residency {
    pub by_regs: u32,
    pub by_smem: u32,
    pub by_threads: u32,
    pub blocks: u32,
}

pub fn residency(g: &Gpu, regs: u32, threads: u32, smem: u32) -> Residency {
    let by_regs = g.regs_per_sm / (regs.max(1) * threads);
    let by_smem = g.smem_per_sm_kb * 1024 / (smem + g.smem_reserved_per_block);
    let by_threads = g.max_warps_per_sm * 32 / threads;
    Residency { by_regs, by_smem, by_threads, blocks: by_regs.min(by_smem).min(by_threads).min(g.max_blocks_per_sm) }
}

/// The registers per thread ptxas gave `kernel` for `arch` (the committed report).
fn ptxas_registers(kernel: &str, arch: &str) -> Option<u32> {
    let report = memattn_cli::ptx::ptxas_report().ok().flatten()?;
    report.kernels.iter().find(|k| k.name == kernel && k.arch == arch).map(|k| k.registers)
}

/// `16 KiB`, `0.25 KiB` (`0,25 KiB`).
fn kib(lang: Lang, bytes: u64) -> String {
    if bytes.is_multiple_of(1024) {
        format!("{} KiB", bytes / 1024)
    } else {
        lang.num(format!("{:.2} KiB", bytes as f64 / 1024.0))
    }
}

/// A number with a thin gap every three digits, as the guide writes them (`65 536`).
fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// The flash kernel `--dtype` and `--head-dim` choose (no window), with its name for messages.
fn flash_kernel(a: &DrawArgs, picture: &str) -> Result<KernelId, Error> {
    let elem = a.dtype.elem();
    let head_dim = a.head_dim.unwrap_or(128);
    KernelId::flash_for(elem, head_dim, (-1, -1)).ok_or_else(|| {
        Error::Usage(format!(
            "draw {picture}: no {} flash kernel for head dim {head_dim} (compiled head dims: {:?})",
            a.dtype.name(),
            KernelId::flash_head_dims(elem)
        ))
    })
}

/// The tensor-core tile of the chosen kernel: `memory` and `flash-dataflow` show its Q, K and V
/// tiles and fragments, which the f32 SIMT kernel does not have.
fn mma_kernel(a: &DrawArgs, picture: &str) -> Result<(KernelId, FlashMmaTile), Error> {
    let id = flash_kernel(a, picture)?;
    match id.variant().tile {
        Tile::FlashMma(t) => Ok((id, t)),
        _ => Err(Error::Usage(format!(
            "draw {picture}: shows the tensor-core kernels (--dtype bf16 or f16); {} is the f32 SIMT kernel, \
             whose K and V tiles chapter 3 of the guide reads",
            id.name()
        ))),
    }
}

/// An arrow from `a` to `b` with the marker [`ARROW_DEFS`] defines.
fn arrow(svg: &mut Svg, (x1, y1): (f64, f64), (x2, y2): (f64, f64), colour: &str) {
    let _ = writeln!(
        svg.body,
        r#"<line x1="{x1:.2}" y1="{y1:.2}" x2="{x2:.2}" y2="{y2:.2}" stroke="{colour}" stroke-width="2" marker-end="url(#arrow)"/>"#
    );
}

const ARROW_DEFS: &str = "<defs><marker id=\"arrow\" viewBox=\"0 0 10 10\" refX=\"9\" refY=\"5\" markerWidth=\"7\" \
     markerHeight=\"7\" orient=\"auto-start-reverse\"><path d=\"M 0 0 L 10 5 L 0 10 z\" fill=\"#444444\"/></marker></defs>\n";

/// A numbered step in a circle.
fn step(svg: &mut Svg, x: f64, y: f64, n: u32) {
    let _ = writeln!(svg.body, r##"<circle cx="{x:.2}" cy="{y:.2}" r="10" fill="#333333"/>"##);
    let _ = writeln!(
        svg.body,
        r##"<text x="{x:.2}" y="{:.2}" font-size="12" text-anchor="middle" fill="#ffffff" font-weight="bold">{n}</text>"##,
        y + 4.0
    );
}

// ---------------------------------------------------------------------------------------------
// execution-model
// ---------------------------------------------------------------------------------------------

/// The query rows warp `w` of a block owns, `first..=last` (block-relative): the f32 kernel
/// gives each row `threads_per_row` lanes, the tensor-core kernels `rows_per_warp` rows a warp.
pub fn warp_rows(tile: &Tile, w: u32) -> Option<(u32, u32)> {
    let per_warp = match tile {
        Tile::FlashF32(t) => 32 / t.threads_per_row,
        Tile::FlashMma(t) => t.rows_per_warp,
        _ => return None,
    };
    Some((w * per_warp, (w + 1) * per_warp - 1))
}

pub fn execution_model(a: &DrawArgs) -> Result<(String, String), Error> {
    let lang = a.lang;
    let id = flash_kernel(a, "execution-model")?;
    let v = id.variant();
    let seq_q = a.seq_q.or(a.seq).unwrap_or(256);
    if !(1..=65_536).contains(&seq_q) {
        return Err(Error::Usage(format!("draw execution-model: --seq-q must be 1 to 65536 (got {seq_q})")));
    }
    if !(1..=64).contains(&a.heads) || !(1..=8).contains(&a.batch) {
        return Err(Error::Usage(format!(
            "draw execution-model: --heads must be 1 to 64 and --batch 1 to 8 (got {} and {})",
            a.heads, a.batch
        )));
    }
    let shape = LaunchShape { batch: a.batch, heads: a.heads, seq_q, seq_kv: seq_q };
    // The row's launch geometry (grid and block for the shape), computed, not a launch.
    let dims = kernels_gpu::variants::Variant::launch(v, shape)
        .ok_or_else(|| Error::Usage(format!("draw execution-model: {} has no grid", id.name())))?;
    let [gx, gy, gz] = dims.grid;
    let (grid_rows, blocks) = (gy * gz, gx * gy * gz);
    if gx > 16 || grid_rows > 8 {
        return Err(Error::Usage(format!(
            "draw execution-model: the grid [{gx}, {gy}, {gz}] is too large to draw (at most 16 query tiles and \
             heads x batch at most 8); use a smaller --seq, --heads or --batch"
        )));
    }
    let threads = dims.block[0];
    let warps = threads / 32;
    let br = v.block_rows();
    let g = gpu(a.gpu);
    let regs = ptxas_registers(v.name, g.arch);
    let res = regs.map(|r| residency(&g, r, threads, dims.dynamic_smem_bytes));

    let (ox, w_all) = (40.0, 940.0);
    let name = v.name;
    let mut svg = Svg::new(1000, 0);
    let title = tr!(
        lang,
        "Execution model: {name} on batch {}, heads {}, seq_q {seq_q}: grid [{gx}, {gy}, {gz}] = {blocks} blocks of {threads} threads",
        "Ausführungsmodell: {name} bei Batch {}, Heads {}, seq_q {seq_q}: Grid [{gx}, {gy}, {gz}] = {blocks} Blöcke zu {threads} Threads",
        a.batch,
        a.heads
    );
    svg.text(ox, 24.0, 15, "start", &title);
    svg.text(
        ox,
        44.0,
        12,
        "start",
        &tr!(
            lang,
            "from the kernel's tile item (kernels-gpu/src/tiles.rs): Br = {br} query rows per block; grid (ceil(seq_q / Br), heads, batch)",
            "aus dem Kachel-Eintrag des Kernels (kernels-gpu/src/tiles.rs): Br = {br} Query-Zeilen je Block; Grid (ceil(seq_q / Br), Heads, Batch)"
        ),
    );

    // 1. The grid.
    let mut y = 80.0;
    svg.text(
        ox,
        y,
        13,
        "start",
        &tr!(
            lang,
            "1  The grid: one block per query tile (x), head (y) and sequence of the batch (z)",
            "1  Das Grid: ein Block je Query-Kachel (x), Head (y) und Sequenz des Batches (z)"
        ),
    );
    y += 12.0;
    let label_w = 110.0;
    let cell_w = ((w_all - label_w) / gx as f64).min(110.0);
    let cell_h = 36.0;
    for r in 0..grid_rows {
        let (head, batch) = (r % gy, r / gy);
        let yy = y + r as f64 * (cell_h + 4.0);
        svg.text(
            ox + label_w - 8.0,
            yy + 22.0,
            11,
            "end",
            &tr!(lang, "head {head}, batch {batch}", "Head {head}, Batch {batch}"),
        );
        for x in 0..gx {
            let xx = ox + label_w + x as f64 * cell_w;
            let first = x * br;
            let last = ((x + 1) * br).min(seq_q) - 1;
            let chosen = x == 0 && r == 0;
            svg.rect(
                [xx, yy, cell_w - 4.0, cell_h],
                if chosen { "#fdd0a2" } else { "#deebf7" },
                if chosen { "#000000" } else { "#6baed6" },
                &format!(
                    r#" data-block="{x} {head} {batch}" data-rows="{first}-{last}"{}"#,
                    if chosen { r#" stroke-width="2.5""# } else { "" }
                ),
            );
            let mid = xx + (cell_w - 4.0) / 2.0;
            svg.text(mid, yy + 15.0, 11, "middle", &format!("({x}, {head}, {batch})"));
            svg.text(mid, yy + 29.0, 10, "middle", &tr!(lang, "rows {first}-{last}", "Zeilen {first}-{last}"));
        }
    }
    y += grid_rows as f64 * (cell_h + 4.0) + 30.0;

    // 2. One block: its warps and lanes.
    svg.text(
        ox,
        y,
        13,
        "start",
        &tr!(
            lang,
            "2  Block (0, 0, 0): {threads} threads = {warps} warps of 32 lanes; thread t is lane t % 32 of warp t / 32",
            "2  Block (0, 0, 0): {threads} Threads = {warps} Warps zu 32 Lanes; Thread t ist Lane t % 32 von Warp t / 32"
        ),
    );
    y += 14.0;
    let lane_w = 24.0;
    let lx = ox + 70.0;
    for l in (0..32).step_by(4) {
        svg.text(lx + (l as f64 + 0.5) * lane_w, y + 8.0, 9, "middle", &tr!(lang, "lane {l}", "Lane {l}"));
    }
    y += 14.0;
    for w in 0..warps {
        let yy = y + w as f64 * 26.0;
        svg.text(lx - 8.0, yy + 16.0, 12, "end", &tr!(lang, "warp {w}", "Warp {w}"));
        for l in 0..32u32 {
            let t = 32 * w + l;
            let xx = lx + l as f64 * lane_w;
            svg.rect(
                [xx, yy, lane_w, 22.0],
                &lane_colour(l as usize),
                "#777777",
                &format!(r#" data-warp="{w}" data-lane="{l}" data-thread="{t}""#),
            );
            svg.text(xx + lane_w / 2.0, yy + 15.0, 9, "middle", &t.to_string());
        }
        if let Some((r0, r1)) = warp_rows(&v.tile, w) {
            svg.text(
                lx + 32.0 * lane_w + 10.0,
                yy + 16.0,
                11,
                "start",
                &tr!(lang, "query rows {r0}-{r1}", "Query-Zeilen {r0}-{r1}"),
            );
        }
    }
    y += warps as f64 * 26.0 + 8.0;
    let how = match v.tile {
        Tile::FlashF32(t) => tr!(
            lang,
            "f32 SIMT kernel: {} neighbouring lanes share a query row, each with {} of its {} dimensions",
            "f32-SIMT-Kernel: {} benachbarte Lanes teilen sich eine Query-Zeile, jede mit {} ihrer {} Dimensionen",
            t.threads_per_row,
            t.dims_per_thread(),
            t.head_dim
        ),
        Tile::FlashMma(t) => tr!(
            lang,
            "tensor-core kernel: a warp computes its {} rows with mma.sync m16n8k16; lane l holds rows l / 4 and l / 4 + 8 of each 16-row tile",
            "Tensor-Core-Kernel: ein Warp rechnet seine {} Zeilen mit mma.sync m16n8k16; Lane l hält die Zeilen l / 4 und l / 4 + 8 jeder 16-Zeilen-Kachel",
            t.rows_per_warp
        ),
        _ => String::new(),
    };
    svg.text(lx, y + 8.0, 11, "start", &how);
    y += 40.0;

    // 3. On the GPU: SMs and their scheduler partitions.
    let (sms, smsps, gname) = (g.sms, g.smsps_per_sm, g.name);
    svg.text(
        ox,
        y,
        13,
        "start",
        &tr!(
            lang,
            "3  On an {gname}: {sms} SMs with {smsps} scheduler partitions (SMSPs) each; a block stays on one SM, a warp on one SMSP",
            "3  Auf dem {gname}: {sms} SMs mit je {smsps} Scheduler-Partitionen (SMSPs); ein Block bleibt auf einem SM, ein Warp auf einer SMSP"
        ),
    );
    y += 12.0;
    // The SMs, one small square each.
    let per_row = 66;
    for s in 0..sms {
        let (c, r) = (s % per_row, s / per_row);
        svg.rect([ox + c as f64 * 14.0, y + r as f64 * 14.0, 11.0, 11.0], "#c7e9c0", "#74c476", "");
    }
    y += sms.div_ceil(per_row) as f64 * 14.0 + 18.0;
    let resident = res.map_or(1, |r| r.blocks.max(1));
    // One SM with the blocks of this kernel it holds at once; warp w of a block on SMSP w % 4.
    let sm_h = 30.0 + (resident * warps).div_ceil(smsps) as f64 * 18.0;
    svg.rect([ox, y, w_all, sm_h + 16.0], "#f7fcf5", "#41ab5d", r#" stroke-width="2""#);
    svg.text(
        ox + 8.0,
        y + 16.0,
        12,
        "start",
        &tr!(
            lang,
            "one SM holding {resident} blocks of this kernel at once; warp w of a block on SMSP w % {smsps}",
            "ein SM mit {resident} gleichzeitigen Blöcken dieses Kernels; Warp w eines Blocks auf SMSP w % {smsps}"
        ),
    );
    let part_w = (w_all - 16.0 - 8.0 * (smsps - 1) as f64) / smsps as f64;
    for p in 0..smsps {
        let px = ox + 8.0 + p as f64 * (part_w + 8.0);
        svg.rect([px, y + 24.0, part_w, sm_h - 16.0], "#ffffff", "#a1d99b", "");
        svg.text(px + 6.0, y + 38.0, 11, "start", &format!("SMSP {p}"));
        let mut k = 0;
        for b in 0..resident {
            for w in (0..warps).filter(|w| w % smsps == p) {
                svg.text(
                    px + 6.0,
                    y + 54.0 + k as f64 * 18.0,
                    11,
                    "start",
                    &tr!(lang, "block {b} · warp {w}", "Block {b} · Warp {w}"),
                );
                k += 1;
            }
        }
    }
    y += sm_h + 40.0;
    let mut summary = tr!(
        lang,
        "{name}: grid [{gx}, {gy}, {gz}], {blocks} blocks of {warps} warps",
        "{name}: Grid [{gx}, {gy}, {gz}], {blocks} Blöcke zu {warps} Warps"
    );
    match (regs, res) {
        (Some(regs), Some(r)) => {
            let smem = kib(lang, dims.dynamic_smem_bytes as u64);
            let (rs, smkb) = (grouped(g.regs_per_sm as u64), g.smem_per_sm_kb);
            let reserve = kib(lang, g.smem_reserved_per_block as u64);
            let (by_regs, by_smem, by_threads) = (r.by_regs, r.by_smem, r.by_threads);
            let arch = g.arch;
            let limits = tr!(
                lang,
                "blocks per SM: registers {rs} / ({regs} · {threads}) → {by_regs}; shared memory {smkb} KB / ({smem} + {reserve}) → {by_smem}; threads 2048 / {threads} → {by_threads} (registers: ptxas, {arch})",
                "Blöcke je SM: Register {rs} / ({regs} · {threads}) → {by_regs}; Shared Memory {smkb} KB / ({smem} + {reserve}) → {by_smem}; Threads 2048 / {threads} → {by_threads} (Register: ptxas, {arch})"
            );
            svg.text(ox, y, 12, "start", &limits);
            let places = sms * r.blocks;
            let pct = lang.num(format!("{:.1}", 100.0 * blocks as f64 / places as f64));
            let waves = blocks.div_ceil(places);
            let fill = tr!(
                lang,
                "{blocks} blocks for {places} places ({sms} SMs × {resident}): {pct} % of one wave; {waves} wave(s)",
                "{blocks} Blöcke für {places} Plätze ({sms} SMs × {resident}): {pct} % einer Welle; {waves} Welle(n)"
            );
            svg.text(ox, y + 20.0, 12, "start", &fill);
            let _ = write!(
                summary,
                "; {}",
                tr!(lang, "{resident} resident per SM on an {gname}", "{resident} je SM resident auf dem {gname}")
            );
        }
        _ => svg.text(
            ox,
            y,
            12,
            "start",
            &tr!(lang, "registers: not in the ptxas report", "Register: nicht im ptxas-Bericht"),
        ),
    }
    svg.h = (y + 44.0) as u32;
    Ok((svg.finish(&format!("{title}; {summary}")), summary))
}

// ---------------------------------------------------------------------------------------------
// memory
// ---------------------------------------------------------------------------------------------

/// Registers per thread a tensor-core flash tile keeps for its operands (f32 accumulator
/// fragments: 4 per 16 x 8 tile a lane; A fragments of Q: 4 per 16 x 16 k-step):
/// `(O accumulator, scores S/P, Q fragments)`.
pub fn mma_fragment_registers(t: &FlashMmaTile) -> (u32, u32, u32) {
    let m = t.m_tiles();
    (m * (t.head_dim / 8) * 4, m * (t.bc / 8) * 4, m * t.q_reg_ksteps * 4)
}

/// One level of the memory picture: its name, who sees it, two lines of the GPU's figures, up
/// to three lines of what the kernel keeps there, and its fill colour.
type Level = (String, String, [String; 2], [String; 3], &'static str);

pub fn memory(a: &DrawArgs) -> Result<(String, String), Error> {
    let lang = a.lang;
    let (id, t) = mma_kernel(a, "memory")?;
    let v = id.variant();
    let g = gpu(a.gpu);
    let name = v.name;
    let (br, bc, d) = (t.br, t.bc, t.head_dim);
    let regs = ptxas_registers(name, g.arch);
    let (o_regs, s_regs, q_regs) = mma_fragment_registers(&t);
    let (gname, sms) = (g.name, g.sms);
    let elem = 2u64; // bf16 and f16
    let q_tile = br as u64 * d as u64 * elem;
    let kv_tile = bc as u64 * d as u64 * elem;

    let (ox, w_all) = (40.0, 1100.0);
    let mut svg = Svg::new((ox + w_all + 20.0) as u32, 0);
    let title = tr!(
        lang,
        "Memory hierarchy of an {gname}, and what {name} keeps at each level",
        "Speicherhierarchie des {gname} und was {name} auf jeder Ebene hält"
    );
    svg.text(ox, 24.0, 15, "start", &title);
    svg.text(
        ox,
        44.0,
        12,
        "start",
        &tr!(
            lang,
            "NVIDIA's published figures (as in chapter 0 and scripts/perf_model.py); tiles from the kernel's tile item (Br {br}, Bc {bc}, d {d}), registers from ptxas",
            "Von NVIDIA veröffentlichte Kennzahlen (wie in Kapitel 0 und scripts/perf_model.py); Kacheln aus dem Kachel-Eintrag des Kernels (Br {br}, Bc {bc}, d {d}), Register aus ptxas"
        ),
    );
    let regs_kb = g.regs_per_sm / 256; // 32-bit registers: 4 bytes, in KB of 1024
    let total_mb = lang.num(format!("{:.1}", (g.regs_per_sm as f64 * 4.0 * sms as f64) / 1e6));
    let smem_block = g.smem_per_block / 1024;
    let smem_sm = g.smem_per_sm_kb;
    let clk = g.smem_bytes_per_clock;
    let regs_line = match regs {
        Some(r) => tr!(lang, "{r} registers per thread (ptxas, {})", "{r} Register je Thread (ptxas, {})", g.arch),
        None => tr!(lang, "registers: not in the ptxas report", "Register: nicht im ptxas-Bericht"),
    };
    let o_bytes = kib(lang, br as u64 * d as u64 * 4);
    let s_bytes = kib(lang, br as u64 * bc as u64 * 4);
    let ksteps = d / 16;
    let q_ks = t.q_reg_ksteps;
    let (qt, kvt) = (kib(lang, q_tile), kib(lang, kv_tile));
    let smem_all = kib(lang, v.dynamic_smem_bytes() as u64);
    let hbm_bw = lang.num(format!("{}", g.hbm_tbps));
    let hbm = g.hbm;
    let l2 = match g.l2_mb {
        Some(mb) => tr!(lang, "{mb} MB, shared by all {sms} SMs", "{mb} MB, geteilt von allen {sms} SMs"),
        None => tr!(
            lang,
            "size not in NVIDIA's {gname} figures; shared by all {sms} SMs",
            "Größe nicht in NVIDIAs Kennzahlen des {gname}; geteilt von allen {sms} SMs"
        ),
    };
    let levels: [Level; 4] = [
        (
            tr!(lang, "Registers", "Register"),
            tr!(lang, "one thread", "ein Thread"),
            [
                tr!(
                    lang,
                    "{} × 32 bit per SM ({regs_kb} KB), at most 255 per thread; {total_mb} MB on all {sms} SMs",
                    "{} × 32 Bit je SM ({regs_kb} KB), höchstens 255 je Thread; {total_mb} MB auf allen {sms} SMs",
                    grouped(g.regs_per_sm as u64)
                ),
                tr!(lang, "operands of the instructions: no memory access", "Operanden der Instruktionen: kein Speicherzugriff"),
            ],
            [
                format!("{regs_line}:"),
                tr!(
                    lang,
                    "O accumulator {o_regs} (Br × d f32 = {o_bytes} a block), scores S/P {s_regs} (Br × Bc = {s_bytes}), Q fragments {q_regs} ({q_ks} of the {ksteps} k-steps)",
                    "O-Akkumulator {o_regs} (Br × d f32 = {o_bytes} je Block), Scores S/P {s_regs} (Br × Bc = {s_bytes}), Q-Fragmente {q_regs} ({q_ks} der {ksteps} k-Schritte)"
                ),
                tr!(
                    lang,
                    "running max m and sum l per row; S and P never leave the registers",
                    "laufendes Maximum m und Summe l je Zeile; S und P verlassen die Register nie"
                ),
            ],
            "#fee6ce",
        ),
        (
            "Shared Memory".to_string(),
            tr!(lang, "one block", "ein Block"),
            [
                tr!(
                    lang,
                    "up to {smem_sm} KB per SM, {smem_block} KiB per block (opt-in)",
                    "bis {smem_sm} KB je SM, {smem_block} KiB je Block (Opt-in)"
                ),
                tr!(
                    lang,
                    "32 banks × 4 B: {clk} B per clock per SM",
                    "32 Bänke × 4 B: {clk} B je Takt und SM"
                ),
            ],
            [
                tr!(
                    lang,
                    "Q tile Br × d = {qt} (staged once), K tile and V tile Bc × d = {kvt} each: {smem_all} a block",
                    "Q-Kachel Br × d = {qt} (einmal geladen), K- und V-Kachel Bc × d = je {kvt}: {smem_all} je Block"
                ),
                tr!(
                    lang,
                    "ldmatrix reads them into fragments; the XOR swizzle keeps its phases free of bank conflicts",
                    "ldmatrix liest sie in Fragmente; der XOR-Swizzle hält seine Phasen frei von Bankkonflikten"
                ),
                String::new(),
            ],
            "#deebf7",
        ),
        (
            tr!(lang, "L2 cache", "L2-Cache"),
            tr!(lang, "all SMs", "alle SMs"),
            [l2, String::new()],
            [
                tr!(
                    lang,
                    "K and V rows on their way into shared memory (cp.async of 16-byte chunks)",
                    "K- und V-Zeilen auf dem Weg in den Shared Memory (cp.async in 16-Byte-Chunks)"
                ),
                tr!(
                    lang,
                    "every block of a head reads the same K and V",
                    "jeder Block eines Heads liest dieselben K und V"
                ),
                String::new(),
            ],
            "#e5f5e0",
        ),
        (
            tr!(lang, "HBM (device memory)", "HBM (Gerätespeicher)"),
            tr!(lang, "all SMs and the host", "alle SMs und der Host"),
            [format!("{hbm}, {hbm_bw} TB/s"), String::new()],
            [
                tr!(
                    lang,
                    "Q, K and V read; O (d values) and LSE (one f32) written once per query row",
                    "Q, K und V gelesen; O (d Werte) und LSE (ein f32) einmal je Query-Zeile geschrieben"
                ),
                tr!(
                    lang,
                    "S and P never: naive attention would store 4 · N · M bytes of scores per head",
                    "S und P nie: naive Attention würde 4 · N · M Bytes Scores je Head speichern"
                ),
                String::new(),
            ],
            "#efedf5",
        ),
    ];
    let mut y = 70.0;
    let band_h = 98.0;
    for (k, (level, who, figs, holds, fill)) in levels.iter().enumerate() {
        svg.rect([ox, y, w_all, band_h], fill, "#777777", &format!(r#" data-level="{k}""#));
        // A bar whose length grows with the level's distance from the SM: closer is faster and
        // smaller.
        svg.rect([ox + 12.0, y + band_h - 18.0, 40.0 + 45.0 * k as f64, 8.0], "#636363", "none", "");
        svg.text(ox + 12.0, y + 24.0, 15, "start", level);
        svg.text(ox + 12.0, y + 42.0, 11, "start", &tr!(lang, "seen by {who}", "sichtbar für {who}"));
        let xf = ox + 240.0;
        svg.text(xf, y + 20.0, 12, "start", &figs[0]);
        if !figs[1].is_empty() {
            svg.text(xf, y + 36.0, 12, "start", &figs[1]);
        }
        svg.text(xf, y + 56.0, 12, "start", &format!("{}: {}", tr!(lang, "in {name}", "in {name}"), holds[0]));
        for (i, h) in holds[1..].iter().enumerate().filter(|(_, h)| !h.is_empty()) {
            svg.text(xf + 14.0, y + 72.0 + 16.0 * i as f64, 12, "start", h);
        }
        y += band_h + 8.0;
    }
    let reads = tr!(
        lang,
        "faster and smaller towards the top; the flash kernel moves each Q, K, V and O byte between HBM and the SM once per block that needs it",
        "nach oben schneller und kleiner; der Flash-Kernel bewegt jedes Byte von Q, K, V und O einmal je Block, der es braucht, zwischen HBM und SM"
    );
    svg.text(ox, y + 14.0, 12, "start", &reads);
    svg.h = (y + 34.0) as u32;
    let summary = tr!(
        lang,
        "{name} on an {gname}: Q tile {qt}, K and V tiles {kvt} each in shared memory ({smem_all}); O accumulator {o_regs} and scores {s_regs} registers a thread",
        "{name} auf dem {gname}: Q-Kachel {qt}, K- und V-Kachel je {kvt} im Shared Memory ({smem_all}); O-Akkumulator {o_regs} und Scores {s_regs} Register je Thread"
    );
    Ok((svg.finish(&format!("{title}; {summary}")), summary))
}

// ---------------------------------------------------------------------------------------------
// flash-dataflow
// ---------------------------------------------------------------------------------------------

pub fn flash_dataflow(a: &DrawArgs) -> Result<(String, String), Error> {
    let lang = a.lang;
    let (id, t) = mma_kernel(a, "flash-dataflow")?;
    let v = id.variant();
    let name = v.name;
    let seq_kv = a.seq_kv.or(a.seq).unwrap_or(256);
    let (br, bc, d) = (t.br, t.bc, t.head_dim);
    let tiles = seq_kv.div_ceil(bc);
    if !(1..=16 * bc).contains(&seq_kv) {
        return Err(Error::Usage(format!(
            "draw flash-dataflow: --seq-kv must be 1 to {} (16 key tiles of Bc = {bc}; got {seq_kv})",
            16 * bc
        )));
    }
    let elem = 2u64;
    let (qt, kvt) = (br as u64 * d as u64 * elem, bc as u64 * d as u64 * elem);
    let (q_s, kv_s, o_acc, s_f32, p16) = (
        kib(lang, qt),
        kib(lang, kvt),
        kib(lang, br as u64 * d as u64 * 4),
        kib(lang, br as u64 * bc as u64 * 4),
        kib(lang, br as u64 * bc as u64 * 2),
    );
    let lse_b = br as u64 * 4;

    let mut svg = Svg::new(1150, 640);
    svg.body.push_str(ARROW_DEFS);
    let title = tr!(
        lang,
        "Flash-attention data flow of one block of {name}: Br = {br} query rows, key tiles of Bc = {bc}, d = {d}",
        "Datenfluss der Flash Attention in einem Block von {name}: Br = {br} Query-Zeilen, Key-Kacheln zu Bc = {bc}, d = {d}"
    );
    svg.text(30.0, 24.0, 15, "start", &title);
    let order = if t.keys_backward {
        tr!(lang, ", walked from the last to the first", ", von der letzten zur ersten")
    } else {
        String::new()
    };
    svg.text(
        30.0,
        44.0,
        12,
        "start",
        &tr!(
            lang,
            "seq_kv = {seq_kv}: {tiles} key tiles{order}; the numbers are the order of the steps; tile sizes from the kernel's tile item",
            "seq_kv = {seq_kv}: {tiles} Key-Kacheln{order}; die Zahlen sind die Reihenfolge der Schritte; Kachelgrößen aus dem Kachel-Eintrag des Kernels"
        ),
    );
    // Three columns: HBM, shared memory, registers.
    let cols = [(30.0, 250.0), (340.0, 260.0), (660.0, 470.0)];
    let heads = [
        tr!(lang, "HBM (device memory)", "HBM (Gerätespeicher)"),
        tr!(lang, "shared memory (one block)", "Shared Memory (ein Block)"),
        tr!(lang, "registers (the block's {} warps)", "Register (die {} Warps des Blocks)", t.warps),
    ];
    let top = 70.0;
    for ((x, w), h) in cols.iter().zip(&heads) {
        svg.rect([*x, top, *w, 570.0], "#fafafa", "#bbbbbb", "");
        svg.text(x + w / 2.0, top + 20.0, 14, "middle", h);
    }
    let (hx, hw) = cols[0];
    let (sx, sw) = cols[1];
    let (rx, rw) = cols[2];
    // HBM: Q with the block's rows, the key tiles of K and of V, O and LSE.
    svg.rect([hx + 20.0, top + 40.0, hw - 40.0, 70.0], "#f2f0f7", "#756bb1", "");
    svg.text(hx + 30.0, top + 56.0, 12, "start", "Q: seq_q × d");
    svg.rect([hx + 30.0, top + 64.0, hw - 60.0, 36.0], "#bcbddc", "#54278f", r#" data-tile="Q""#);
    svg.text(
        hx + hw / 2.0,
        top + 86.0,
        11,
        "middle",
        &tr!(lang, "the block's Br × d rows", "die Br × d Zeilen des Blocks"),
    );
    let tile_h = (100.0 / tiles as f64).min(20.0);
    let mut first_tile = [0.0; 2];
    for (k, (label, fill)) in [("K", "#c6dbef"), ("V", "#c7e9c0")].iter().enumerate() {
        let y0 = top + 150.0 + k as f64 * 140.0;
        svg.text(hx + 20.0, y0, 12, "start", &format!("{label}: seq_kv × d"));
        for j in 0..tiles {
            let y = y0 + 8.0 + j as f64 * tile_h;
            svg.rect([hx + 20.0, y, hw - 40.0, tile_h - 2.0], fill, "#555555", &format!(r#" data-tile="{label} {j}""#));
            if tile_h >= 14.0 {
                svg.text(hx + hw / 2.0, y + tile_h - 6.0, 10, "middle", &format!("{label}{j}"));
            }
        }
        first_tile[k] = y0 + 8.0 + tile_h / 2.0;
    }
    let s_never = top + 420.0;
    svg.rect([hx + 20.0, s_never, hw - 40.0, 40.0], "#ffffff", "#cb181d", r#" stroke-dasharray="4 3""#);
    svg.text(hx + hw / 2.0, s_never + 17.0, 11, "middle", &tr!(lang, "S, P: never here", "S, P: nie hier"));
    svg.text(
        hx + hw / 2.0,
        s_never + 32.0,
        10,
        "middle",
        &tr!(lang, "(naive: seq_q × seq_kv f32 per head)", "(naiv: seq_q × seq_kv f32 je Head)"),
    );
    let o_y = top + 500.0;
    svg.rect([hx + 20.0, o_y, hw - 40.0, 44.0], "#fee6ce", "#e6550d", r#" data-tile="O""#);
    svg.text(hx + 30.0, o_y + 18.0, 12, "start", &tr!(lang, "O: the block's Br × d", "O: die Br × d des Blocks"));
    svg.text(hx + 30.0, o_y + 35.0, 11, "start", &tr!(lang, "LSE: Br f32 ({lse_b} B)", "LSE: Br f32 ({lse_b} B)"));

    // Shared memory: the Q tile, one K and one V tile.
    let smem_total = kib(lang, v.dynamic_smem_bytes() as u64);
    svg.text(sx + sw / 2.0, top + 38.0, 11, "middle", &format!("(Br + 2 Bc) · d · 2 B = {smem_total}"));
    let smem = [
        (
            "Q",
            tr!(lang, "Q tile Br × d = {q_s}", "Q-Kachel Br × d = {q_s}"),
            tr!(lang, "staged once", "einmal geladen"),
            "#bcbddc",
            top + 50.0,
        ),
        (
            "K",
            tr!(lang, "K tile Bc × d = {kv_s}", "K-Kachel Bc × d = {kv_s}"),
            tr!(lang, "one per key tile", "eine je Key-Kachel"),
            "#c6dbef",
            top + 170.0,
        ),
        (
            "V",
            tr!(lang, "V tile Bc × d = {kv_s}", "V-Kachel Bc × d = {kv_s}"),
            tr!(lang, "one per key tile", "eine je Key-Kachel"),
            "#c7e9c0",
            top + 320.0,
        ),
    ];
    for (label, what, when, fill, y) in &smem {
        svg.rect([sx + 20.0, *y, sw - 40.0, 80.0], fill, "#333333", &format!(r#" data-smem="{label}""#));
        svg.text(sx + sw / 2.0, y + 34.0, 12, "middle", what);
        svg.text(sx + sw / 2.0, y + 54.0, 11, "middle", when);
    }

    // Registers: S, the online softmax, P and the O accumulator.
    let regs = [
        (
            tr!(lang, "S = Q Kᵀ: Br × Bc f32 = {s_f32}", "S = Q Kᵀ: Br × Bc f32 = {s_f32}"),
            tr!(
                lang,
                "ldmatrix, then mma.sync m16n8k16 on tensor cores",
                "ldmatrix, dann mma.sync m16n8k16 auf Tensor Cores"
            ),
            "#fde0dd",
            top + 170.0,
        ),
        (
            tr!(
                lang,
                "online softmax: running max m, sum l per row",
                "Online-Softmax: laufendes Maximum m, Summe l je Zeile"
            ),
            tr!(
                lang,
                "rescale l and O only when m grows by more than 2^8",
                "l und O nur umskaliert, wenn m um mehr als 2^8 wächst"
            ),
            "#fff7bc",
            top + 250.0,
        ),
        (
            tr!(lang, "P = exp2(S − m): 16-bit, Br × Bc = {p16}", "P = exp2(S − m): 16 Bit, Br × Bc = {p16}"),
            tr!(
                lang,
                "the accumulator layout is the A operand of the next mma",
                "das Akkumulator-Layout ist der A-Operand des nächsten mma"
            ),
            "#fde0dd",
            top + 330.0,
        ),
        (
            tr!(lang, "O accumulator: Br × d f32 = {o_acc}", "O-Akkumulator: Br × d f32 = {o_acc}"),
            tr!(lang, "O += P V (mma.sync), across all key tiles", "O += P V (mma.sync), über alle Key-Kacheln"),
            "#fee6ce",
            top + 410.0,
        ),
    ];
    for (k, (what, how, fill, y)) in regs.iter().enumerate() {
        svg.rect([rx + 20.0, *y, rw - 40.0, 66.0], fill, "#333333", &format!(r#" data-reg="{k}""#));
        svg.text(rx + 32.0, y + 26.0, 12, "start", what);
        svg.text(rx + 32.0, y + 46.0, 11, "start", how);
    }
    // The key loop: a dashed frame around what happens once per key tile.
    svg.rect(
        [sx + 10.0, top + 152.0, rx + rw - sx - 20.0, 334.0],
        "none",
        "#3182bd",
        r#" stroke-dasharray="6 4" stroke-width="1.5""#,
    );
    svg.text(
        sx + 20.0,
        top + 440.0,
        12,
        "start",
        &tr!(lang, "once per key tile: {tiles} times", "einmal je Key-Kachel: {tiles}-mal"),
    );
    // The steps, each arrow with its number.
    let out_y = top + 500.0;
    let between = |a: f64, b: f64| (a + b) / 2.0;
    arrow(&mut svg, (hx + hw - 30.0, top + 82.0), (sx + 20.0, top + 90.0), "#54278f");
    step(&mut svg, between(hx + hw, sx), top + 70.0, 1);
    arrow(&mut svg, (hx + hw - 20.0, first_tile[0]), (sx + 20.0, top + 210.0), "#3182bd");
    step(&mut svg, between(hx + hw, sx), between(first_tile[0], top + 210.0) - 16.0, 2);
    arrow(&mut svg, (sx + sw - 20.0, top + 90.0), (rx + 20.0, top + 195.0), "#444444");
    arrow(&mut svg, (sx + sw - 20.0, top + 210.0), (rx + 20.0, top + 211.0), "#444444");
    step(&mut svg, between(sx + sw, rx), top + 126.0, 3);
    arrow(&mut svg, (rx + rw / 2.0, top + 236.0), (rx + rw / 2.0, top + 250.0), "#444444");
    step(&mut svg, rx + rw / 2.0 + 30.0, top + 243.0, 4);
    arrow(&mut svg, (rx + rw / 2.0, top + 316.0), (rx + rw / 2.0, top + 330.0), "#444444");
    arrow(&mut svg, (hx + hw - 20.0, first_tile[1]), (sx + 20.0, top + 360.0), "#31a354");
    step(&mut svg, between(hx + hw, sx), between(first_tile[1], top + 360.0) - 16.0, 5);
    arrow(&mut svg, (rx + rw / 2.0, top + 396.0), (rx + rw / 2.0, top + 410.0), "#444444");
    arrow(&mut svg, (sx + sw - 20.0, top + 360.0), (rx + 20.0, top + 443.0), "#444444");
    step(&mut svg, between(sx + sw, rx), top + 380.0, 6);
    // After the loop: O / l and LSE, written once.
    svg.rect([rx + 20.0, out_y, rw - 40.0, 56.0], "#ffffff", "#e6550d", "");
    svg.text(
        rx + 32.0,
        out_y + 22.0,
        12,
        "start",
        &tr!(
            lang,
            "after the last tile: O = O / l, LSE = m + ln l",
            "nach der letzten Kachel: O = O / l, LSE = m + ln l"
        ),
    );
    svg.text(
        rx + 32.0,
        out_y + 42.0,
        11,
        "start",
        &tr!(
            lang,
            "written to HBM once, as 16-bit O and f32 LSE",
            "einmal ins HBM geschrieben, als 16-Bit-O und f32-LSE"
        ),
    );
    arrow(&mut svg, (rx + rw / 2.0, top + 476.0), (rx + rw / 2.0, out_y), "#444444");
    arrow(&mut svg, (rx + 20.0, out_y + 24.0), (hx + hw - 20.0, o_y + 22.0), "#e6550d");
    step(&mut svg, between(sx + sw, rx), out_y + 8.0, 7);
    let steps = [
        tr!(lang, "1 Q tile into shared memory, once", "1 Q-Kachel einmal in den Shared Memory"),
        tr!(lang, "2 K tile j (cp.async; the next one during 6)", "2 K-Kachel j (cp.async; die nächste während 6)"),
        tr!(lang, "3 S = Q Kᵀ on tensor cores", "3 S = Q Kᵀ auf Tensor Cores"),
        tr!(lang, "4 online softmax → P", "4 Online-Softmax → P"),
        tr!(lang, "5 V tile j (cp.async, during 3-4)", "5 V-Kachel j (cp.async, während 3-4)"),
        tr!(lang, "6 O += P V", "6 O += P V"),
        tr!(lang, "7 O and LSE to HBM, once", "7 O und LSE einmal ins HBM"),
    ];
    for (row, part) in [&steps[..4], &steps[4..]].iter().enumerate() {
        let mut x = 30.0;
        for s in part.iter() {
            svg.text(x, top + 598.0 + row as f64 * 16.0, 11, "start", s);
            x += text_width(s, 11.0, false) + 24.0;
        }
    }
    let kv_all = kib(lang, 2 * kvt * tiles as u64);
    let o_out = kib(lang, qt + lse_b);
    let summary = tr!(
        lang,
        "per block: Q tile {q_s} read once, K and V {kv_all} streamed in {tiles} tiles, O and LSE {o_out} written once; S and P ({s_f32} a tile) stay in registers",
        "je Block: Q-Kachel {q_s} einmal gelesen, K und V {kv_all} in {tiles} Kacheln gestreamt, O und LSE {o_out} einmal geschrieben; S und P ({s_f32} je Kachel) bleiben in Registern"
    );
    svg.text(30.0, top + 638.0, 12, "start", &summary);
    svg.h = (top + 656.0) as u32;
    Ok((svg.finish(&format!("{title}; {summary}")), format!("{name}: {summary}")))
}
