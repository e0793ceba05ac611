//! `memattn check --backward`: the backward's fixed sweep, at every head dim the backward kernels
//! of the dtype are compiled for, with a pass/fail table.
//!
//! Each case is one `run --backward` ([`run_backward`]): forward, then backward of `Σ dO ∘ O`,
//! outputs and gradients poisoned with NaN first, VM memcheck on, and O, LSE, dq, dk, dv (and
//! d_sinks) checked against the f64 reference gradients, every element (varlen: every sequence
//! on its own too). f32 is held to [`GRAD_REL_TOL`] of each tensor's scale; bf16/f16 to twice the
//! error of a naive backward in the same dtype, whole and per row
//! ([`memattn::verify::grad`]). The cases target one bug class each: lengths that are not a
//! multiple of any tile (a mask or tail off by one in the key-block or query-tile loop),
//! `seq_q > seq_kv` with causal (rows that see no key: dq 0, no NaN from LSE = -inf), single
//! rows and keys, several key blocks, query tiles, heads and batches (grid indexing, the dQ
//! atomics of several key blocks), BHSD strides, GQA and MQA (dK and dV summed over the group),
//! windows whose edges fall inside a key block, soft cap (the tanh derivative), sinks (their
//! mass in LSE and d_sinks), deterministic dQ (two repetitions, the same bits) and varlen
//! batches with an empty and a length-1 sequence.

use super::args::{CheckArgs, Cli};
use super::{open_device, print_json, save_evidence};
use kernels_gpu::KernelId;
use memattn_cli::backward_run::{check_supported, rule_of, run_backward, BackwardReport, TensorCheck, GRAD_REL_TOL};
use memattn_cli::error::{exit, Error};
use memattn_cli::problem::{KernelKind, Layout, Problem};
use memattn_cli::reference::RowSelection;
use memattn_cli::runner::RunSpec;
use memattn_cli::Dtype;

/// One case: what it is for, its problem and whether dQ is summed deterministically.
struct Case {
    name: &'static str,
    catches: &'static str,
    problem: Problem,
    deterministic: bool,
}

/// The fixed sweep for `dtype` at head dim `d`. The backward's tiles are 8 to 32 query rows and
/// 16 or 32 keys per block, so 33, 67, 77 and 100 are multiples of none.
fn cases(dtype: Dtype, d: u32) -> Result<Vec<Case>, Error> {
    let p = |batch, heads, sq, sk| Problem {
        batch,
        heads,
        seq_q: sq,
        seq_kv: sk,
        head_dim: d,
        dtype,
        ..Problem::default()
    };
    let varlen = |base: Problem| -> Result<Problem, Error> {
        let base = Problem { heads: 4, heads_kv: Some(2), ..base };
        Ok(Problem::varlen(base, &[100, 0, 1, 37, 65], &[64, 5, 1, 130, 65])?)
    };
    let c = |name, catches, problem| Case { name, catches, problem, deterministic: false };
    let det = |name, catches, problem| Case { name, catches, problem, deterministic: true };
    Ok(vec![
        c("tails", "seq not a multiple of any tile (67 x 67)", p(1, 2, 67, 67)),
        c(
            "tails causal",
            "causal mask at a key-block and query-tile tail",
            Problem { causal: true, ..p(1, 2, 67, 67) },
        ),
        c("seq_q < seq_kv", "bottom-right causal alignment (33 x 100)", Problem { causal: true, ..p(1, 2, 33, 100) }),
        c(
            "seq_q > seq_kv",
            "rows that see no key: dq = 0, LSE = -inf, no NaN (100 x 33)",
            Problem { causal: true, ..p(1, 2, 100, 33) },
        ),
        c("seq 1", "a single query and key (P = 1, dq = dk = 0)", Problem { causal: true, ..p(1, 1, 1, 1) }),
        c("one query", "one query, a few keys", p(1, 1, 1, 5)),
        c(
            "blocks, heads, batch",
            "grid indexing, dQ adds of several key blocks (2 x 3 heads, 150 x 129)",
            Problem { causal: true, ..p(2, 3, 150, 129) },
        ),
        c(
            "bhsd",
            "strided layout [batch, heads, seq, d]",
            Problem { causal: true, layout: Layout::Bhsd, ..p(2, 2, 70, 130) },
        ),
        c("gqa 4", "dk, dv summed over 4 query heads", Problem { heads_kv: Some(2), causal: true, ..p(1, 8, 77, 100) }),
        c(
            "gqa 8 (mqa)",
            "dk, dv summed over 8 query heads",
            Problem { heads_kv: Some(1), layout: Layout::Bhsd, ..p(1, 8, 77, 100) },
        ),
        c("window in tile", "window edges inside key blocks (40, 3)", Problem { window: (40, 3), ..p(1, 2, 90, 120) }),
        c(
            "window causal",
            "sliding window crossing block edges (47, 0)",
            Problem { window: (47, 0), ..p(1, 2, 100, 150) },
        ),
        c("window 0", "each row sees one key or none (0, 0)", Problem { window: (0, 0), ..p(1, 2, 100, 70) }),
        c(
            "softcap",
            "the soft cap's tanh derivative (cap 5)",
            Problem { softcap: 5.0, causal: true, ..p(1, 4, 70, 90) },
        ),
        c(
            "sinks",
            "sinks in LSE and d_sinks; 5 rows see only the sink",
            Problem { sinks: true, heads_kv: Some(2), causal: true, ..p(1, 4, 45, 40) },
        ),
        c(
            "everything",
            "soft cap, sinks, window and MQA together, two batches",
            Problem { softcap: 3.0, sinks: true, window: (20, 5), heads_kv: Some(1), ..p(2, 4, 50, 80) },
        ),
        det(
            "deterministic",
            "dQ per key block summed in order: same bits twice, right values",
            Problem { sinks: true, heads_kv: Some(2), causal: true, window: (50, -1), ..p(2, 4, 37, 100) },
        ),
        c(
            "varlen causal",
            "varlen with empty and length-1 sequences",
            varlen(Problem { causal: true, ..p(1, 4, 1, 1) })?,
        ),
        c(
            "varlen window sinks",
            "a window per sequence, d_sinks summed over sequences",
            varlen(Problem { window: (20, 5), sinks: true, ..p(1, 4, 1, 1) })?,
        ),
        det(
            "varlen deterministic",
            "deterministic dQ over packed sequences",
            varlen(Problem { causal: true, ..p(1, 4, 1, 1) })?,
        ),
    ])
}

/// The check of `r` closest to (or furthest over) its bound: `(tensor, max abs err, bound)`.
fn worst(r: &BackwardReport) -> (&'static str, f64, f64) {
    let ratio = |c: &TensorCheck| {
        if c.passed {
            c.max_abs_err / c.bound.max(f64::MIN_POSITIVE)
        } else {
            f64::INFINITY
        }
    };
    let all = r.checks.iter().chain(r.sequences.iter().flat_map(|s| &s.checks));
    all.max_by(|a, b| ratio(a).total_cmp(&ratio(b))).map_or(("-", 0.0, 0.0), |c| (c.tensor, c.max_abs_err, c.bound))
}

/// Why `r` did not verify, in a line.
fn failures(r: &BackwardReport) -> String {
    let mut why: Vec<String> = Vec::new();
    let say = |c: &TensorCheck, at: &str| {
        let nan = if c.mismatched_non_finite > 0 {
            format!(", {} non-finite (unwritten or NaN)", c.mismatched_non_finite)
        } else {
            String::new()
        };
        let rows = match &c.two_x {
            Some(t) if t.rows_over > 0 => format!(", {} rows over their bound", t.rows_over),
            _ => String::new(),
        };
        format!("{}{at}: max abs err {:.3e} > bound {:.3e}{nan}{rows}", c.tensor, c.max_abs_err, c.bound)
    };
    for c in r.checks.iter().filter(|c| !c.passed) {
        why.push(say(c, ""));
    }
    for s in &r.sequences {
        for c in s.checks.iter().filter(|c| !c.passed) {
            why.push(say(c, &format!(" of sequence {}", s.sequence)));
        }
    }
    if r.bitwise_reproducible == Some(false) {
        why.push(format!("the gradients' bits differ between the {} repetitions", r.repetitions));
    }
    why.join("; ")
}

pub fn check(cli: &Cli, a: &CheckArgs) -> Result<i32, Error> {
    let kernel = a.kernel.unwrap_or(KernelKind::Flash);
    let dtype = a.dtype.unwrap_or(Dtype::F32);
    if kernel != KernelKind::Flash {
        return Err(Error::Usage(
            "check --backward sweeps the flash backward's kernels; the naive backward (P and dS materialised, the \
             baseline) runs one problem at a time with `run --backward --kernel naive`; leave out --kernel naive"
                .into(),
        ));
    }
    if let Some(r) = a.max_error_ratio {
        return Err(Error::Usage(format!(
            "check --backward: --max-error-ratio {r} guards the forward sweep's error against naive attention; the \
             backward judges every gradient by its own rule (bf16/f16: 2x the naive backward in the dtype), so leave it out"
        )));
    }
    // The kernel table says which head dims have a backward in this dtype: new kernels join the
    // sweep without a change here, and a dtype without any is refused before anything runs.
    let compiled = KernelId::flash_bwd_head_dims(dtype.elem());
    check_supported(
        &Problem { dtype, head_dim: compiled.first().copied().unwrap_or(64), ..Problem::default() },
        kernel,
    )
    .map_err(|e| Error::Usage(format!("check {e}")))?;
    let dims: Vec<u32> = match a.head_dim {
        Some(d) if KernelId::flash_bwd(dtype.elem(), d).is_some() => vec![d],
        Some(d) => {
            return Err(Error::Usage(format!(
                "check --backward: head_dim {d} has no {dtype} backward kernel; they are compiled for head_dim {} \
                 (any other multiple of 8 below the largest runs on the next of them, padded)",
                memattn_cli::problem::list_and(&compiled)
            )))
        }
        None => compiled,
    };
    let mut all = Vec::new();
    for &d in &dims {
        for c in cases(dtype, d)? {
            c.problem.validate_shape(kernel)?;
            check_supported(&c.problem, kernel)?;
            all.push((d, c));
        }
    }
    let (mut dev, reason) = open_device(cli)?;
    if !cli.json {
        println!(
            "check --backward: {kernel} {dtype}, head dims {dims:?}, {} cases, every element of O, LSE, dq, dk, dv (and \
             d_sinks) against the f64 reference gradients",
            all.len()
        );
        println!("rule: {}", rule_of(dtype));
        println!("{:<5} {:<22} {:<7} {:<8} {:>10} {:>10}  catches", "d", "case", "result", "worst", "max err", "bound");
    }
    let (mut failed, mut device_errors, mut not_run) = (0, 0, 0);
    let mut rows = Vec::new();
    for (d, c) in &all {
        let spec = RunSpec {
            seed: a.seed,
            check: RowSelection::All,
            // Deterministic cases compare the bits of two repetitions; one run is enough else.
            warmup: Some(c.deterministic as u32),
            repeats: Some(1),
            ..RunSpec::new(c.problem, kernel)
        };
        let (result, report, detail) = match run_backward(dev.as_mut(), &spec, None, None, c.deterministic) {
            Ok(r) if r.verified => ("PASS", Some(r), String::new()),
            Ok(r) => {
                let why = failures(&r);
                ("FAIL", Some(r), why)
            }
            // A case the device or host had no room for did not run: not a failure of the kernel.
            Err(e) if e.is_resource() => ("NOT RUN", None, e.to_string()),
            // The cases are valid problems, checked above: a refusal here is the library's (a
            // dtype or option its backward does not take yet), and the sweep cannot say more.
            Err(e) if e.exit_code() == exit::BAD_INPUT => {
                return Err(Error::Usage(format!("check --backward: {dtype} d{d} case `{}` was refused: {e}", c.name)));
            }
            Err(e) => {
                if e.exit_code() == exit::DEVICE {
                    device_errors += 1;
                }
                ("FAIL", None, e.to_string())
            }
        };
        match result {
            "FAIL" => failed += 1,
            "NOT RUN" => not_run += 1,
            _ => {}
        }
        let (tensor, err, bound) = report.as_ref().map_or(("-", f64::NAN, f64::NAN), worst);
        if !cli.json {
            let fmt = |x: f64| if x.is_nan() { "-".to_string() } else { format!("{x:.2e}") };
            println!(
                "{:<5} {:<22} {:<7} {:<8} {:>10} {:>10}  {}",
                d,
                c.name,
                result,
                tensor,
                fmt(err),
                fmt(bound),
                c.catches
            );
            if result != "PASS" {
                println!("      {detail}");
            }
        }
        rows.push(serde_json::json!({
            "head_dim": d, "case": c.name, "catches": c.catches, "passed": result == "PASS",
            "ran": result != "NOT RUN", "deterministic": c.deterministic,
            "worst_tensor": tensor, "max_abs_err": report.as_ref().map(|_| err), "bound": report.as_ref().map(|_| bound),
            "detail": detail, "shape": c.problem.shape_json(),
            "checks": report.as_ref().map(|r| &r.checks),
            "sequences": report.as_ref().map(|r| &r.sequences),
            "bitwise_reproducible": report.as_ref().and_then(|r| r.bitwise_reproducible),
        }));
    }
    let v = serde_json::json!({
        "command": "check", "backward": true, "backend": dev.backend().name(), "backend_reason": reason,
        "kernel": kernel, "dtype": dtype, "head_dims": dims, "rule": rule_of(dtype), "f32_rel_tol": GRAD_REL_TOL,
        "cases": rows, "failed": failed, "not_run": not_run, "passed": failed == 0 && not_run == 0,
    });
    save_evidence(cli, &v)?;
    if cli.json {
        print_json(&v);
    } else {
        let not_run_note = if not_run > 0 {
            format!(", {not_run} not run (not enough device or host memory for them)")
        } else {
            String::new()
        };
        println!("check --backward: {} of {} cases passed{not_run_note}", all.len() - failed - not_run, all.len());
    }
    // As `check`: 3 for a kernel error; else 1 for a case that ran and did not verify; else 3
    // when a case could not run for want of a resource; 0 only when every case ran and verified.
    Ok(if device_errors > 0 {
        exit::DEVICE
    } else if failed > 0 {
        exit::VERIFICATION_FAILED
    } else if not_run > 0 {
        exit::DEVICE
    } else {
        exit::SUCCESS
    })
}
