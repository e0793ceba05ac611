//! `memattn check --large`: the shapes users run (32k-token prefill, a 64k-token paged cache)
//! instead of the sweep's small ones, in the VM, in about 20 s on two cores.
//!
//! A forward case runs a sampled launch ([`RunSpec::sampled_blocks`]): only the query blocks that
//! hold the checked rows run, each over every key its rows see (all 32768 in the last block of
//! a causal run), and those rows are verified against the f64 reference; the other rows are
//! neither computed nor checked. What this catches that the small sweep cannot: a key or row
//! index past the small shapes' range, a split plan over a long cache, window tiles far from
//! the diagonal. The decode case runs whole (its grid is small) and is verified on every row.

use super::args::{CheckArgs, Cli};
use super::{open_device, print_json, save_evidence};
use memattn::decode::{DecodeKernel, DecodeProblem, Splits};
use memattn_cli::decode_run::{run_decode, DecodeSpec};
use memattn_cli::device::Backend;
use memattn_cli::error::{exit, Error};
use memattn_cli::problem::{KernelKind, Problem};
use memattn_cli::reference::RowSelection;
use memattn_cli::runner::{run, RunSpec};
use memattn_cli::Dtype;
use std::time::Instant;

/// Query tokens of the forward cases.
pub const LARGE_SEQ: u32 = 32768;
/// Cached tokens of the decode case.
pub const LARGE_CACHE: u32 = 65536;

/// One forward case: its problem and how many rows to check (each of a different block, mostly).
struct ForwardCase {
    name: &'static str,
    catches: &'static str,
    problem: Problem,
    rows: u64,
}

fn forward_cases() -> Vec<ForwardCase> {
    let p = |dtype, head_dim, heads, heads_kv| Problem {
        batch: 1,
        heads,
        heads_kv: Some(heads_kv),
        seq_q: LARGE_SEQ,
        seq_kv: LARGE_SEQ,
        head_dim,
        dtype,
        ..Problem::default()
    };
    vec![
        ForwardCase {
            name: "f32 causal 32k",
            catches: "f32 SIMT d64, causal over 32768 keys",
            problem: Problem { causal: true, ..p(Dtype::F32, 64, 1, 1) },
            rows: 16,
        },
        ForwardCase {
            name: "bf16 causal 32k gqa",
            catches: "tensor cores d128, causal over 32768 keys, GQA 2:1",
            problem: Problem { causal: true, ..p(Dtype::Bf16, 128, 2, 1) },
            rows: 16,
        },
        ForwardCase {
            name: "f16 window 32k",
            catches: "tensor cores d64, window (4095, 0): tiles far from the first key",
            problem: Problem { window: (4095, 0), ..p(Dtype::F16, 64, 1, 1) },
            rows: 16,
        },
        ForwardCase {
            name: "bf16 d256 causal 32k",
            catches: "tensor cores d256 (Q reloaded from shared memory), causal over 32768 keys",
            problem: Problem { causal: true, ..p(Dtype::Bf16, 256, 1, 1) },
            rows: 8,
        },
    ]
}

fn decode_case() -> DecodeProblem {
    DecodeProblem {
        batch: 1,
        heads: 8,
        heads_kv: 2,
        head_dim: 128,
        seq_q: 1,
        cache_seqlens: vec![LARGE_CACHE - 1],
        seq_new: 1,
        page_size: Some(16),
        dtype: Dtype::Bf16,
        causal: true,
        splits: Splits::Auto,
        kernel: DecodeKernel::Auto,
        ..DecodeProblem::default()
    }
}

pub fn check(cli: &Cli, a: &CheckArgs) -> Result<i32, Error> {
    if a.kernel.is_some_and(|k| k != KernelKind::Flash) || a.dtype.is_some() || a.head_dim.is_some() {
        return Err(Error::Usage(
            "check --large has its own fixed cases (f32, bf16 and f16 flash, bf16 decode); drop --kernel, --dtype and --head-dim"
                .into(),
        ));
    }
    let (mut dev, reason) = open_device(cli)?;
    if dev.backend() != Backend::Vm {
        return Err(Error::Usage(format!(
            "check --large runs sampled launches, which only the VM can (--backend vm); on {} run the shapes whole \
             with `memattn run --seq {LARGE_SEQ}`",
            dev.backend()
        )));
    }
    if !cli.json {
        println!(
            "check --large: {} forward cases at seq {LARGE_SEQ} (sampled launches: the blocks of the checked rows) and a \
             {LARGE_CACHE}-token paged decode, against the f64 reference",
            forward_cases().len()
        );
        println!(
            "{:<22} {:<7} {:>10} {:>10} {:>8} {:>14}  catches",
            "case", "result", "O rel RMS", "bound", "time", "VM thr-instr"
        );
    }
    let (mut failed, mut device_errors, mut not_run) = (0u32, 0u32, 0u32);
    let mut rows = Vec::new();
    let mut report = |name: &str,
                      catches: &str,
                      outcome: Result<(bool, f64, f64, Option<u64>, String), Error>,
                      secs: f64| {
        let (result, err, bound, instr, detail) = match outcome {
            Ok((ok, err, bound, instr, detail)) => {
                (if ok { "PASS" } else { "FAIL" }, Some(err), Some(bound), instr, detail)
            }
            // A case the device or host had no room for did not run: not a failure of the
            // kernel (as in `check`).
            Err(e) if e.is_resource() => ("NOT RUN", None, None, None, e.to_string()),
            Err(e) => {
                if e.exit_code() == exit::DEVICE {
                    device_errors += 1;
                }
                ("FAIL", None, None, None, e.to_string())
            }
        };
        match result {
            "FAIL" => failed += 1,
            "NOT RUN" => not_run += 1,
            _ => {}
        }
        if !cli.json {
            let fmt = |x: Option<f64>| x.map(|v| format!("{v:.2e}")).unwrap_or_else(|| "-".into());
            let i = instr.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
            println!("{name:<22} {result:<7} {:>10} {:>10} {:>7.1}s {i:>14}  {catches}", fmt(err), fmt(bound), secs);
            if !detail.is_empty() {
                println!("       {detail}");
            }
        }
        rows.push(serde_json::json!({
            "case": name, "catches": catches, "passed": result == "PASS", "ran": result != "NOT RUN",
            "rel_rms_err": err, "bound": bound,
            "vm_thread_instructions": instr, "seconds": secs, "detail": detail,
        }));
    };
    let started = Instant::now();
    for c in forward_cases() {
        let spec = RunSpec {
            seed: a.seed,
            check: RowSelection::Sample { count: c.rows, seed: a.seed },
            sampled_blocks: true,
            ..RunSpec::new(c.problem, KernelKind::Flash)
        };
        let t = Instant::now();
        let outcome = run(dev.as_mut(), &spec, None).map(|r| {
            let detail = if r.verified { r.warnings.join("; ") } else { r.verification.failures.join("; ") };
            (r.verified, r.rel_rms_err, r.tolerance.rel_rms, r.vm_thread_instructions, detail)
        });
        report(c.name, c.catches, outcome, t.elapsed().as_secs_f64());
    }
    let t = Instant::now();
    let spec =
        DecodeSpec { problem: decode_case(), seed: a.seed, warmup: None, repeats: None, indices_on_device: false };
    let outcome = run_decode(dev.as_mut(), &spec, None).map(|r| {
        let v = &r.verification;
        let detail = if r.verified { format!("{} KV splits", r.plan.num_splits) } else { v.failures.join("; ") };
        // Decode's bound is on the scaled max error (docs/semantics.md); the column shows it.
        (r.verified, v.o_max_scaled_err, v.o_bound, r.vm_thread_instructions, detail)
    });
    report(
        "bf16 paged decode 64k",
        "tensor-core decode d128, GQA 4:1, page 16, 65535 cached keys + 1 appended, split-KV",
        outcome,
        t.elapsed().as_secs_f64(),
    );
    let total = rows.len();
    let v = serde_json::json!({
        "command": "check", "large": true, "backend": dev.backend().name(), "backend_reason": reason,
        "cases": rows, "failed": failed, "not_run": not_run, "passed": failed == 0 && not_run == 0,
        "seconds": started.elapsed().as_secs_f64(),
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
        println!(
            "check --large: {} of {total} cases passed{not_run_note} in {:.0} s",
            total - failed as usize - not_run as usize,
            started.elapsed().as_secs_f64()
        );
    }
    // As `check`: 3 for a kernel error; else 1 for a case that ran and did not verify; else 3
    // when a case could not run; else 0.
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
