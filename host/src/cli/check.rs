//! `memattn check`: a fixed sweep of the shapes that catch the usual attention-kernel bugs, for
//! one kernel family and dtype, with a pass/fail table.
//!
//! Each case runs verified against the f64 reference on every query row (outputs poisoned with
//! NaN first, VM memcheck on). The cases target one bug class each: lengths that are not a
//! multiple of any tile (off-by-one in a mask or a tail), `seq_q > seq_kv` with causal (fully
//! masked rows), single rows and keys, several blocks, heads and batches, BSHD and BHSD, GQA
//! ratios 1/4/8, windows whose edges fall inside a key tile, soft cap and sinks, varlen
//! batches with an empty and a length-1 sequence, and ALiBi (with GQA, soft cap and window,
//! varlen). `--backward` runs the backward's sweep instead
//! (`check_backward.rs`).

use super::args::{CheckArgs, Cli};
use super::{open_device, print_json, save_evidence};
use kernels_gpu::KernelId;
use memattn_cli::error::{exit, Error};
use memattn_cli::problem::{KernelKind, Layout, Problem};
use memattn_cli::reference::RowSelection;
use memattn_cli::runner::{run, RunSpec};
use memattn_cli::Dtype;

/// One case: what it is for and its problem.
struct Case {
    name: &'static str,
    catches: &'static str,
    problem: Problem,
}

/// The fixed sweep for `dtype` at head dim `d`.
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
    let varlen = |causal, window| -> Result<Problem, Error> {
        let base = Problem { heads: 4, heads_kv: Some(2), causal, window, ..p(1, 4, 1, 1) };
        Ok(Problem::varlen(base, &[100, 0, 1, 37, 65], &[64, 5, 1, 130, 65])?)
    };
    let c = |name, catches, problem| Case { name, catches, problem };
    Ok(vec![
        c("tails", "seq not a multiple of any tile (67 x 67)", p(1, 2, 67, 67)),
        c("tails causal", "causal mask at a tile tail (67 x 67)", Problem { causal: true, ..p(1, 2, 67, 67) }),
        c("seq_q < seq_kv", "bottom-right causal alignment (33 x 100)", Problem { causal: true, ..p(1, 2, 33, 100) }),
        c(
            "seq_q > seq_kv",
            "fully masked rows: O = 0, LSE = -inf (100 x 33)",
            Problem { causal: true, ..p(1, 2, 100, 33) },
        ),
        c("seq 1", "a single query and key", Problem { causal: true, ..p(1, 1, 1, 1) }),
        c("one query", "one query, a few keys", p(1, 1, 1, 5)),
        c(
            "blocks, heads, batch",
            "grid indexing, two query blocks at every tile (2 x 3 heads, 300 x 129)",
            Problem { causal: true, ..p(2, 3, 300, 129) },
        ),
        c(
            "bhsd",
            "strided layout [batch, heads, seq, d]",
            Problem { causal: true, layout: Layout::Bhsd, ..p(2, 2, 70, 130) },
        ),
        c("gqa 1", "heads_kv = heads", Problem { heads_kv: Some(8), causal: true, ..p(1, 8, 77, 150) }),
        c("gqa 4", "heads_kv = heads / 4", Problem { heads_kv: Some(2), causal: true, ..p(1, 8, 77, 150) }),
        c("gqa 8 (mqa)", "heads_kv = 1", Problem { heads_kv: Some(1), layout: Layout::Bhsd, ..p(1, 8, 77, 150) }),
        c("window in tile", "window edges inside key tiles (40, 3)", Problem { window: (40, 3), ..p(1, 2, 130, 200) }),
        c(
            "window causal",
            "sliding window crossing tile edges (127, 0)",
            Problem { window: (127, 0), ..p(1, 2, 200, 300) },
        ),
        c("window 0", "each row sees one key (0, 0)", Problem { window: (0, 0), ..p(1, 2, 100, 70) }),
        c(
            "window wide",
            "a window past every narrow-window row's bound (600, 0)",
            Problem { window: (600, 0), ..p(1, 2, 100, 700) },
        ),
        c(
            "softcap + sinks",
            "soft cap 5 and per-head sinks",
            Problem { softcap: 5.0, sinks: true, causal: true, ..p(1, 4, 70, 90) },
        ),
        c("varlen causal", "varlen with empty and length-1 sequences", varlen(true, (-1, -1))?),
        c("varlen window", "varlen with a window per sequence", varlen(false, (20, 5))?),
        c(
            "alibi causal gqa",
            "ALiBi bias per head (6 heads: the paper's interleaved slopes), GQA 3:1, 90 x 200",
            Problem { alibi: true, causal: true, heads_kv: Some(2), ..p(2, 6, 90, 200) },
        ),
        c(
            "alibi softcap window",
            "ALiBi after the soft cap, keys on both sides of the diagonal (150 x 100, window 40,10)",
            Problem { alibi: true, softcap: 5.0, window: (40, 10), ..p(1, 4, 150, 100) },
        ),
        c(
            "alibi varlen",
            "ALiBi distances within each packed sequence",
            Problem { alibi: true, ..varlen(true, (-1, -1))? },
        ),
    ])
}

pub fn check(cli: &Cli, a: &CheckArgs) -> Result<i32, Error> {
    if a.backward && a.large {
        return Err(Error::Usage("check: --backward and --large are separate sweeps; give one".into()));
    }
    if a.backward {
        return super::check_backward::check(cli, a);
    }
    if a.large {
        return super::check_large::check(cli, a);
    }
    let kernel = a.kernel.unwrap_or(KernelKind::Flash);
    let dtype = a.dtype.unwrap_or(Dtype::F32);
    if !kernel.supports(dtype) {
        return Err(Error::Usage(format!("check: there is no {kernel} kernel in {dtype}")));
    }
    if a.max_error_ratio.is_some() && !dtype.is_16bit() {
        return Err(Error::Usage(format!(
            "check: --max-error-ratio compares with naive attention in bf16 or f16; {dtype} is judged by fixed bounds"
        )));
    }
    let dims: Vec<u32> = match a.head_dim {
        Some(d) => vec![d],
        // Naive runs any head dim; it is checked at the flash kernels' so the two compare.
        None => KernelId::flash_head_dims(dtype.elem()).to_vec(),
    };
    let mut all = Vec::new();
    for &d in &dims {
        for c in cases(dtype, d)? {
            c.problem.validate_shape(kernel)?;
            all.push((d, c));
        }
    }
    let (mut dev, reason) = open_device(cli)?;
    if !cli.json {
        println!(
            "check: {kernel} {dtype}, head dims {dims:?}, {} cases, every query row against the f64 reference",
            all.len()
        );
        println!(
            "{:<6} {:<22} {:<7} {:>10} {:>10} {:>9}  catches",
            "d", "case", "result", "O rel RMS", "bound", "err/naive"
        );
    }
    let (mut failed, mut device_errors, mut not_run) = (0, 0, 0);
    let mut rows = Vec::new();
    let mut ratios: Vec<(f64, u32, &str)> = Vec::new();
    let arch = dev.target()?;
    // The cases are independent: on the VM, where a case's host work (inputs, the f64 reference)
    // and small launches leave cores idle, a second device runs cases next to the first; the
    // table is printed in case order all the same.
    let mut devices = vec![dev];
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if devices[0].backend() == memattn_cli::device::Backend::Vm && cli.vm_workers.is_none() && cores > 1 {
        if let Ok(second) = memattn_cli::device::open(&super::device_options(cli)?) {
            devices.push(second.device);
        }
    }
    let outcomes = std::sync::Mutex::new(std::collections::BTreeMap::new());
    let ready = std::sync::Condvar::new();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let run_case = |dev: &mut dyn memattn_cli::device::Device, c: &Case| {
        let spec = RunSpec {
            seed: a.seed,
            check: RowSelection::All,
            reference_alongside: true,
            ..RunSpec::new(c.problem, kernel)
        };
        run(dev, &spec, None)
    };
    std::thread::scope(|s| -> Result<(), Error> {
        // One device (a GPU's, whose context is current on this thread, or a VM's alone) runs
        // the cases here, one after the other; two run them on a thread each.
        let (mut here, spawned) = match devices.as_mut_slice() {
            [one] => (Some(one), None),
            all_devices => (None, Some(all_devices)),
        };
        for dev in spawned.into_iter().flatten() {
            let (all, outcomes, ready, next, run_case) = (&all, &outcomes, &ready, &next, &run_case);
            s.spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((_, c)) = all.get(i) else { break };
                // A panic reaches the printing thread, which would otherwise wait for this case.
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_case(dev.as_mut(), c)));
                outcomes.lock().unwrap_or_else(|e| e.into_inner()).insert(i, outcome);
                ready.notify_all();
            });
        }
        for (i, (d, c)) in all.iter().enumerate() {
            // Which rows of the variant table the case runs (a narrow window picks its own d64 row).
            let entries: Vec<&str> = c.problem.launches_on(kernel, arch)?.iter().map(|l| l.kernel.name()).collect();
            let outcome = if let Some(dev) = here.as_mut() {
                run_case(dev.as_mut(), c)
            } else {
                let mut done = outcomes.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(o) = done.remove(&i) {
                        break o.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                    }
                    done = ready.wait(done).unwrap_or_else(|e| e.into_inner());
                }
            };
            let (result, err, bound, ratio, detail) = match outcome {
                Ok(r) => {
                    let res = if r.verified { "PASS" } else { "FAIL" };
                    let ratio = error_ratio(dtype, r.max_abs_err, &r.tolerance);
                    (res, Some(r.rel_rms_err), Some(r.tolerance.rel_rms), ratio, r.verification.failures.join("; "))
                }
                // A case the device or host had no room for did not run: not a failure of the kernel.
                Err(e) if e.is_resource() => ("NOT RUN", None, None, None, e.to_string()),
                Err(e) => {
                    if e.exit_code() == exit::DEVICE {
                        device_errors += 1;
                    }
                    ("FAIL", None, None, None, e.to_string())
                }
            };
            if let Some(x) = ratio {
                ratios.push((x, *d, c.name));
            }
            match result {
                "FAIL" => failed += 1,
                "NOT RUN" => not_run += 1,
                _ => {}
            }
            let fmt = |x: Option<f64>| x.map(|v| format!("{v:.2e}")).unwrap_or_else(|| "-".into());
            if !cli.json {
                let r = ratio.map(|x| format!("{x:.2}")).unwrap_or_else(|| "-".into());
                println!(
                    "{:<6} {:<22} {:<7} {:>10} {:>10} {:>9}  {}",
                    d,
                    c.name,
                    result,
                    fmt(err),
                    fmt(bound),
                    r,
                    c.catches
                );
                if result != "PASS" {
                    println!("       {detail}");
                }
            }
            rows.push(serde_json::json!({
                "head_dim": d, "case": c.name, "catches": c.catches, "passed": result == "PASS",
                "ran": result != "NOT RUN",
                "rel_rms_err": err, "bound": bound, "error_ratio": ratio, "detail": detail,
                "shape": c.problem.shape_json(),
                "kernels": entries,
            }));
        }
        Ok(())
    })?;
    let dev = devices.swap_remove(0);
    // The error ratio against naive attention in the dtype: its worst case and median, and the
    // drift limit when one was given.
    ratios.sort_by(|a, b| a.0.total_cmp(&b.0));
    let worst = ratios.last().copied();
    let median = (!ratios.is_empty()).then(|| ratios[ratios.len() / 2].0);
    let drift = match (worst, a.max_error_ratio) {
        (Some((w, d, name)), Some(limit)) if w > limit => Some(format!(
            "error ratio drift: case '{name}' at head dim {d} has {w:.2} times the max error of naive attention in \
             {dtype}, over --max-error-ratio {limit}"
        )),
        _ => None,
    };
    let v = serde_json::json!({
        "command": "check", "backend": dev.backend().name(), "backend_reason": reason,
        "kernel": kernel, "dtype": dtype, "cases": rows, "failed": failed, "not_run": not_run,
        "worst_error_ratio": worst.map(|w| serde_json::json!({"ratio": w.0, "head_dim": w.1, "case": w.2})),
        "median_error_ratio": median, "max_error_ratio": a.max_error_ratio, "drift": drift,
        "passed": failed == 0 && not_run == 0 && drift.is_none(),
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
        if let (Some((w, d, name)), Some(m)) = (worst, median) {
            println!(
                "err/naive: max error over naive attention's in {dtype} on the same inputs (FlashAttention's rule \
                 allows 2): worst {w:.2} ('{name}', head dim {d}), median {m:.2}{}",
                a.max_error_ratio.map(|l| format!(", limit {l}")).unwrap_or_default()
            );
        }
        if let Some(msg) = &drift {
            println!("{msg}");
        }
        println!("check: {} of {} cases passed{not_run_note}", all.len() - failed - not_run, all.len());
    }
    // 3 for a kernel error; else 1 for a case that ran and did not verify; else 3 when a case
    // could not run for want of a resource; 0 only when every case ran and verified.
    Ok(if device_errors > 0 {
        exit::DEVICE
    } else if failed > 0 || drift.is_some() {
        exit::VERIFICATION_FAILED
    } else if not_run > 0 {
        exit::DEVICE
    } else {
        exit::SUCCESS
    })
}

/// bf16/f16: the case's O max abs error over naive attention's in the dtype (the
/// [`memattn_cli::verify::tolerance_for`] baseline), the baseline floored at one rounding of the
/// largest output (`u · max|ref|`, half the bound's floor) so that a case whose baseline happens
/// to be exact does not divide by zero. `None` for f32 (fixed bounds, no baseline).
fn error_ratio(dtype: Dtype, max_abs_err: f64, tol: &memattn_cli::dtype::Tolerance) -> Option<f64> {
    if !dtype.is_16bit() {
        return None;
    }
    // tol.max_abs = max(2 · baseline, 2u · max|ref|): half of it is the floored baseline.
    let baseline = tol.max_abs / 2.0;
    (baseline > 0.0).then(|| max_abs_err / baseline)
}
