//! Human-readable output: byte sizes, the run summary, and the compare/sweep tables.

use crate::memory::AnalyticBytes;
use crate::problem::{KernelKind, Problem};
use crate::runner::RunReport;
use std::fmt::Write;

pub use crate::units::human_bytes;

/// One line describing a problem.
pub fn describe_problem(p: &Problem) -> String {
    format!(
        "batch {} heads {} seq_q {} seq_kv {} head_dim {} {} {}{} scale {:.6}",
        p.batch,
        p.heads,
        p.seq_q,
        p.seq_kv,
        p.head_dim,
        p.dtype,
        p.layout,
        if p.causal { " causal" } else { "" },
        p.softmax_scale()
    ) + &describe_options(p)
}

/// The inference options of `docs/semantics.md` that differ from plain attention, as
/// ` heads_kv 2 window 255,0 softcap 50 sinks` (empty when none is set).
pub fn describe_options(p: &Problem) -> String {
    let mut s = String::new();
    if p.kv_heads() != p.heads {
        let _ = write!(s, " heads_kv {}", p.kv_heads());
    }
    if p.window.0 >= 0 || (!p.causal && p.window.1 >= 0) {
        let _ = write!(s, " window {},{}", p.window.0, p.window_right());
    }
    if p.softcap > 0.0 {
        let _ = write!(s, " softcap {}", p.softcap);
    }
    if p.sinks {
        s.push_str(" sinks");
    }
    if let Some(v) = p.varlen {
        let list = |l: &[u32]| l.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
        let _ = write!(s, " varlen seqlens_q {} seqlens_kv {}", list(v.seqlens_q), list(v.seqlens_kv));
    }
    s
}

/// The memory plan stated before a run.
pub fn expected_memory(kernel: KernelKind, a: &AnalyticBytes) -> String {
    format!("expected device memory for {kernel}: {} = {}", human_bytes(a.total), a.breakdown())
}

/// The summary of one run.
pub fn run_summary(r: &RunReport) -> String {
    let mut s = String::new();
    let v = &r.verification;
    let _ = writeln!(s, "backend      {} ({})", r.backend, r.device);
    let _ = writeln!(
        s,
        "kernel       {} [{}]",
        r.kernel,
        r.launches.iter().map(|l| l.kernel.as_str()).collect::<Vec<_>>().join(" -> ")
    );
    let _ = writeln!(s, "inputs       {}", r.inputs);
    let _ = writeln!(
        s,
        "verified     {}  (checked {} of {} query rows{})",
        if r.verified { "PASS" } else { "FAIL" },
        v.checked_rows,
        v.total_rows,
        if v.checked_rows < v.total_rows { ", seeded random sample" } else { "" }
    );
    let _ = writeln!(
        s,
        "  O          max abs {:.3e}  max rel {:.3e}  rel RMS {:.3e}  (bounds: rel RMS <= {:.3e}, max abs <= {:.3e})",
        r.max_abs_err, r.max_rel_err, r.rel_rms_err, r.tolerance.rel_rms, r.tolerance.max_abs
    );
    if let (Some(b), Some(bm)) = (r.tolerance.baseline_rel_rms_err, r.tolerance.baseline_max_abs_err) {
        let _ = writeln!(
            s,
            "  naive {:<4} rel RMS {:.3e}  max abs {:.3e}  (CPU, same inputs); kernel/naive rel RMS {}",
            r.dtype.name(),
            b,
            bm,
            r.error_ratio.map(|x| format!("{x:.2}")).unwrap_or_else(|| "-".into())
        );
    }
    let _ = writeln!(s, "  bounds     {}", r.tolerance.rule);
    let _ = writeln!(
        s,
        "  LSE        max abs {:.3e}  max rel {:.3e}  rel RMS {:.3e}  (-inf rows must match exactly: {} mismatches)",
        r.lse_err.max_abs_err, r.lse_err.max_rel_err, r.lse_err.rel_rms_err, v.lse_inf_mismatches
    );
    for f in &v.failures {
        let _ = writeln!(s, "  failure:   {f}");
    }
    let _ = writeln!(
        s,
        "time         {:.3} ms median of {} (warm-up {}), {}",
        r.time_ms, r.timing.repeats, r.timing.warmup, r.timing.clock
    );
    let _ = writeln!(s, "throughput   {:.3e} TFLOP/s ({:.3e} useful FLOP, unmasked pairs only)", r.tflops, r.flops);
    if let Some(n) = r.vm_thread_instructions {
        let _ = writeln!(s, "VM           {n} thread instructions per run");
    }
    if let (Some(rd), Some(wr)) = (r.vm_global_bytes_read, r.vm_global_bytes_written) {
        let _ = writeln!(
            s,
            "             {} read from global memory, {} written (every thread's loads and stores, no cache)",
            human_bytes(rd),
            human_bytes(wr)
        );
    }
    for l in r.launches.iter().filter(|l| !l.bank_conflicts.is_empty()) {
        let (w, i) = l.bank_conflicts.iter().fold((0, 0), |(w, i), b| (w + b.wavefronts, i + b.ideal));
        let _ = writeln!(
            s,
            "banks        {}: {w} shared-memory wavefronts for a minimum of {i} ({:.2}x)",
            l.kernel,
            w as f64 / i.max(1) as f64
        );
        let mut worst: Vec<_> = l.bank_conflicts.iter().filter(|b| b.wavefronts > b.ideal).collect();
        worst.sort_by_key(|b| std::cmp::Reverse(b.wavefronts - b.ideal));
        for b in worst.iter().take(3) {
            let _ = writeln!(
                s,
                "               {}: {} wavefronts for {} ({:.1}-way), {} warp-wide executions",
                b.at,
                b.wavefronts,
                b.ideal,
                b.wavefronts as f64 / b.ideal.max(1) as f64,
                b.executions
            );
        }
        if worst.is_empty() {
            let _ = writeln!(s, "               no bank conflicts: every shared access took one wavefront per phase");
        }
    }
    for l in r.launches.iter().filter(|l| !l.sectors.is_empty()) {
        for line in crate::runner::sector_report(&l.kernel, &l.sectors, 3) {
            let _ = writeln!(s, "{line}");
        }
    }
    let a = &r.analytic_bytes;
    let _ = writeln!(s, "memory       expected {:>12}  = {}", human_bytes(a.total), a.breakdown());
    let _ = writeln!(
        s,
        "             measured {:>12}  peak added by the run ({}; before {}, after {})",
        human_bytes(r.peak_device_bytes),
        r.memory.source,
        human_bytes(r.memory.before_bytes),
        human_bytes(r.memory.after_bytes)
    );
    let diff = r.peak_device_bytes as i128 - a.total as i128;
    let _ = writeln!(
        s,
        "             measured - expected = {} bytes{}",
        diff,
        if diff == 0 { " (exact match)" } else { "" }
    );
    if let (Some(mx), Some(mean)) = (r.memory.gpu_util_max_percent, r.memory.gpu_util_mean_percent) {
        let _ =
            writeln!(s, "GPU util     max {mx}%  mean {mean:.0}%  ({} NVML samples)", r.memory.samples.unwrap_or(0));
    }
    for n in &r.memory.notes {
        let _ = writeln!(s, "note         {n}");
    }
    for w in &r.warnings {
        let _ = writeln!(s, "warning      {w}");
    }
    s
}

/// A plain text table with right-aligned columns (first column left-aligned).
pub fn table(header: &[String], rows: &[Vec<String>]) -> String {
    let cols = header.len();
    let mut w = vec![0usize; cols];
    for r in std::iter::once(header).chain(rows.iter().map(|r| r.as_slice())) {
        for (i, c) in r.iter().enumerate().take(cols) {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let mut s = String::new();
    let line = |s: &mut String, r: &[String]| {
        for (i, c) in r.iter().enumerate().take(cols) {
            if i == 0 {
                let _ = write!(s, "{c:<width$}", width = w[0]);
            } else {
                let _ = write!(s, "  {c:>width$}", width = w[i]);
            }
        }
        s.push('\n');
    };
    line(&mut s, header);
    let total: usize = w.iter().sum::<usize>() + 2 * (cols.saturating_sub(1));
    s.push_str(&"-".repeat(total));
    s.push('\n');
    for r in rows {
        line(&mut s, r);
    }
    s
}

/// The kernels of one run, compact: `naive_{scores,softmax,pv}_f32` for the three naive steps.
pub fn entries_label<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.collect();
    if names.len() < 2 {
        return names.concat();
    }
    let first = names[0];
    // The longest common prefix that ends at an `_` (`naive_` for the forward's three steps,
    // `naive_bwd_` for the backward's four).
    let common = names
        .iter()
        .fold(first.len(), |n, other| first.bytes().zip(other.bytes()).take(n).take_while(|(a, b)| a == b).count());
    let prefix = first[..common].rfind('_').map(|i| &first[..=i]).unwrap_or("");
    let suffix = first.rfind('_').map(|i| &first[i..]).unwrap_or("");
    if names.iter().all(|n| n.starts_with(prefix) && n.ends_with(suffix) && n.len() > prefix.len() + suffix.len()) {
        let middles: Vec<&str> = names.iter().map(|n| &n[prefix.len()..n.len() - suffix.len()]).collect();
        format!("{prefix}{{{}}}{suffix}", middles.join(","))
    } else {
        names.join("+")
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    pub fn entries_label_is_compact() {
        let naive = ["naive_scores_f32", "naive_softmax_f32", "naive_pv_f32"];
        assert_eq!(entries_label(naive.into_iter()), "naive_{scores,softmax,pv}_f32");
        assert_eq!(entries_label(["flash_fwd_bf16_d64"].into_iter()), "flash_fwd_bf16_d64");
        assert_eq!(entries_label(["a_x", "b_y"].into_iter()), "a_x+b_y");
        let bwd = ["naive_bwd_p_f32", "naive_bwd_ds_f32", "naive_bwd_dq_f32", "naive_bwd_dkv_f32"];
        assert_eq!(entries_label(bwd.into_iter()), "naive_bwd_{p,ds,dq,dkv}_f32");
    }
    pub fn bytes_are_human() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
    }
}
