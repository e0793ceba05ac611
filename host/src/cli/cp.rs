//! `memattn run --cp N`: context-parallel attention on in-process ranks (one VM device each),
//! verified against the single-device f64 reference, with each rank's bytes per step against
//! the analytic volume and the overlap model of every strategy.

use super::args::{Cli, RunArgs};
use super::{device_options, print_json, row_selection, save_evidence};
use memattn::attn::Kernels;
use memattn::cp::{self, CpError, CpGrads, CpOpts, CpOutput, Link, Strategy};
use memattn::device::vm::VmDevice;
use memattn::device::BackendChoice;
use memattn_cli::error::{exit, Error};
use memattn_cli::inputs::Qkv;
use memattn_cli::problem::{KernelKind, Problem};
use memattn_cli::report::describe_problem;

/// `run --cp` (flattened into `run`'s options).
#[derive(Debug, clap::Args)]
pub struct CpArgs {
    /// Context parallelism: split the sequence over N ranks (1 to 64), each an in-process rank
    /// with its own VM device, K/V blocks (ring, zigzag) or heads (ulysses) passed between them.
    ///
    /// The gathered output and LSE are checked against the single-device f64 reference (the
    /// rows of --check-rows; bf16/f16 by the 2x naive-in-dtype rule). Printed: per rank and
    /// step the blocks (full, diagonal, partial, skipped), the bytes sent and received and the
    /// compute time; per rank the bytes against the analytic volume (docs/semantics.md); and
    /// the overlap model of every strategy at --link-gbps: the fraction of ideal speed each
    /// would reach with the next block's transfer overlapping the current block's compute.
    /// Exit 0 when the result verified and every rank's bytes equal the analytic volume.
    /// Ranks run on the VM only (NCCL ranks on GPUs are not built yet: --backend cuda is
    /// refused). With --backward the backward follows the forward's road: ring and zigzag run
    /// the ring again, each K/V block travelling with the f32 sums of its dK and dV, which reach
    /// their owner after the last step (dq stays on its rank); Ulysses reverses its all-to-all
    /// around a single-device backward per rank's heads. dq, dk, dv (and d_sinks) are gathered
    /// and checked against the f64 gradients by the rule of `run --backward`, and each rank's
    /// bytes against their analytic volume (docs/semantics.md). Not with --output or --kernel
    /// naive.
    ///
    /// Example: memattn run --cp 4 --cp-strategy zigzag --causal --seq 1000 --heads 4 --heads-kv 2
    ///
    /// Example: memattn run --cp 3 --cp-strategy zigzag --backward --causal --seq 200 --heads 4 --heads-kv 2
    #[arg(long, value_name = "N", conflicts_with_all = ["output"])]
    pub cp: Option<usize>,
    /// With --cp: ring (contiguous slices, K/V travel rank to rank), zigzag (rank r holds pieces
    /// r and 2N-1-r of 2N: causal work balanced) or ulysses (all-to-all over heads; heads and
    /// heads_kv divisible by N).
    #[arg(long, value_name = "ring|zigzag|ulysses", default_value = "ring", requires = "cp")]
    pub cp_strategy: Strategy,
    /// With --cp: the overlap model's link, GB/s one way between two ranks (default 450: NVLink 4
    /// of H100/H200; PCIe 5.0 x16 is 64).
    #[arg(long, value_name = "GB/S", default_value_t = 450.0, requires = "cp")]
    pub link_gbps: f64,
    /// With --cp: the overlap model's sustained attention throughput per device, TFLOP/s
    /// (default 400, FlashAttention-2-class bf16 on an H100).
    #[arg(long, value_name = "TFLOP/S", default_value_t = 400.0, requires = "cp")]
    pub device_tflops: f64,
}

/// The most ranks `--cp` starts (each a thread with its own VM).
pub const MAX_RANKS: usize = 64;

pub fn run(
    cli: &Cli,
    a: &RunArgs,
    kernel: KernelKind,
    problem: Problem,
    inputs: Option<memattn_cli::inputs::Qkv>,
) -> Result<i32, Error> {
    let world = a.cp.cp.unwrap_or(1);
    let strategy = a.cp.cp_strategy;
    if world == 0 || world > MAX_RANKS {
        return Err(Error::Usage(format!("--cp must be 1 to {MAX_RANKS} ranks (got {world})")));
    }
    if kernel != KernelKind::Flash {
        return Err(Error::Usage("--cp runs the flash kernels (--kernel naive has no LSE to merge)".into()));
    }
    if cli.backend == BackendChoice::Cuda {
        return Err(Error::Usage(
            "--cp runs in-process ranks on the VM; NCCL ranks on GPUs are not built yet (use --backend vm or auto)"
                .into(),
        ));
    }
    for (name, v) in [("--link-gbps", a.cp.link_gbps), ("--device-tflops", a.cp.device_tflops)] {
        if !(v.is_finite() && v > 0.0) {
            return Err(Error::Usage(format!("{name} must be a positive number (got {v})")));
        }
    }
    if problem.layout != memattn_cli::problem::Layout::Bshd {
        return Err(Error::Usage("--cp takes the bshd layout (each rank's rows are contiguous slices)".into()));
    }
    let backward = a.backward.backward;
    if backward {
        memattn_cli::backward_run::check_supported(&problem, kernel)?;
    }
    let link = Link { gbps: a.cp.link_gbps, tflops: a.cp.device_tflops };
    // The strategy's rule (Ulysses' heads) before anything runs.
    cp::model(&problem, strategy, world, link)
        .map_err(|e| Error::Usage(format!("--cp {world} --cp-strategy {strategy}: {e}")))?;
    let x = inputs.unwrap_or_else(|| Qkv::random(&problem, a.problem.seed));
    let mut opts = device_options(cli)?;
    opts.backend = BackendChoice::Vm;
    // The ranks share the machine's cores.
    if opts.vm_workers.is_none() {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        opts.vm_workers = Some((cores / world).max(1));
    }
    if !cli.json {
        eprintln!("backend: vm - {world} in-process ranks, one VM each (--cp)");
        println!("problem: {}", describe_problem(&problem));
        println!("context parallel: {world} ranks, strategy {strategy}");
    }
    let (h, hk) = (problem.heads as usize, problem.kv_heads() as usize);
    let d_o = if backward { memattn_cli::backward_run::random_d_o(&problem, a.problem.seed) } else { Vec::new() };
    let started = std::time::Instant::now();
    let both: Result<Vec<(CpOutput, Option<CpGrads>)>, CpError> = cp::run_in_process(world, |comm| {
        let rank = cp::Communicator::rank(comm);
        let err = |source| CpError::attn(rank, source);
        let dev = VmDevice::new(&opts).map_err(|e| CpError::Comm { rank, why: format!("opening the VM: {e}") })?;
        let kernels = Kernels::on_device(Box::new(dev));
        let up = |keys: bool, heads: usize, t: &[f32]| {
            kernels.upload_as(problem.dtype, &cp::shard(&problem, strategy, world, rank, keys, heads, t)).map_err(err)
        };
        let (q, k, v) = (up(false, h, &x.q)?, up(true, hk, &x.k)?, up(true, hk, &x.v)?);
        let out = cp::attention(&kernels, comm, &problem, strategy, &q, &k, &v, &x.sinks, &CpOpts::default())?;
        let grads = if backward {
            let g = up(false, h, &d_o)?;
            Some(cp::attention_backward(
                &kernels, comm, &problem, strategy, &q, &k, &v, &out.o, &out.lse, &g, &x.sinks,
            )?)
        } else {
            None
        };
        Ok((out, grads))
    })
    .into_iter()
    .collect();
    let wall_s = started.elapsed().as_secs_f64();
    let both = both.map_err(|e| Error::Usage(format!("--cp: {e}")))?;
    let (outs, grads): (Vec<CpOutput>, Vec<Option<CpGrads>>) = both.into_iter().unzip();
    let grads: Vec<CpGrads> = grads.into_iter().flatten().collect();
    let (o, lse) = cp::gather(&problem, strategy, &outs);
    let selection = row_selection(&a.problem)?;
    let reference = memattn::reference::reference(&problem, &x, &selection);
    let tol = memattn_cli::verify::tolerance_for(&problem, &x, &reference);
    let verification = memattn_cli::verify::verify(&problem, &o, &lse, &reference, &tol);
    let mut ranks = Vec::new();
    let mut bytes_ok = true;
    for (rank, out) in outs.iter().enumerate() {
        let (sent, recv) = cp::analytic_bytes(&problem, strategy, world, rank, false);
        let ok = out.stats.bytes_sent() == sent && out.stats.bytes_received() == recv;
        bytes_ok &= ok;
        let steps: Vec<serde_json::Value> = out
            .stats
            .steps
            .iter()
            .map(|s| {
                serde_json::json!({
                    "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received, "compute_s": s.compute_s,
                    "visible_pairs": s.visible_pairs,
                    "blocks": s.blocks.iter().map(|b| format!("{b:?}").to_lowercase()).collect::<Vec<_>>(),
                })
            })
            .collect();
        ranks.push(serde_json::json!({
            "rank": rank, "bytes_sent": out.stats.bytes_sent(), "bytes_received": out.stats.bytes_received(),
            "analytic_bytes_sent": sent, "analytic_bytes_received": recv, "bytes_match": ok,
            "compute_s": out.stats.compute_s(), "steps": steps,
        }));
    }
    let models: Vec<serde_json::Value> = Strategy::ALL
        .iter()
        .map(|&s| match cp::model(&problem, s, world, link) {
            Ok(e) => serde_json::json!({
                "strategy": s.name(), "fraction_of_ideal": e.fraction, "seconds": e.seconds,
                "ideal_seconds": e.ideal_seconds, "max_bytes_sent": e.max_bytes_sent,
            }),
            Err(e) => serde_json::json!({ "strategy": s.name(), "not_applicable": e.to_string() }),
        })
        .collect();
    // The backward: the gathered gradients by the rule of `run --backward`, and each rank's
    // backward bytes against their analytic volume.
    let mut grad_checks = Vec::new();
    let mut bwd_ranks = Vec::new();
    if backward {
        let (dq, dk, dv, d_sinks) = cp::gather_grads(&problem, strategy, &grads);
        let want = memattn::reference::grad::attention_backward(&problem, &x.q, &x.k, &x.v, &d_o, &x.sinks)
            .map_err(Error::Usage)?;
        let baseline = if problem.dtype == memattn::Dtype::F32 {
            None
        } else {
            Some(
                memattn::verify::grad::naive_backward_in_dtype(&problem, &x.q, &x.k, &x.v, &d_o, &x.sinks)
                    .map_err(Error::Usage)?,
            )
        };
        let outputs =
            memattn_cli::backward_run::BackwardOutputs { o: o.clone(), lse: lse.clone(), dq, dk, dv, d_sinks };
        grad_checks = memattn_cli::backward_run::verify(&problem, &outputs, &want, baseline.as_ref());
        for (rank, g) in grads.iter().enumerate() {
            let (sent, recv) = cp::analytic_backward_bytes(&problem, strategy, world, rank);
            let ok = g.stats.bytes_sent() == sent && g.stats.bytes_received() == recv;
            bytes_ok &= ok;
            bwd_ranks.push(serde_json::json!({
                "rank": rank, "bytes_sent": g.stats.bytes_sent(), "bytes_received": g.stats.bytes_received(),
                "analytic_bytes_sent": sent, "analytic_bytes_received": recv, "bytes_match": ok,
                "compute_s": g.stats.compute_s(),
            }));
        }
    }
    let grads_ok = grad_checks.iter().all(|c| c.passed);
    let verified = verification.passed && bytes_ok && grads_ok;
    let v = serde_json::json!({
        "command": "run", "cp": world, "cp_strategy": strategy.name(), "problem": problem.shape_json(),
        "dtype": problem.dtype, "verified": verified, "result_verified": verification.passed,
        "bytes_match_analytic": bytes_ok, "failures": verification.failures,
        "o_rel_rms_err": verification.o.rel_rms_err, "lse_max_abs_err": verification.lse.max_abs_err,
        "checked_rows": verification.checked_rows, "total_rows": verification.total_rows,
        "tolerance_rule": tol.rule, "wall_s": wall_s, "ranks": ranks,
        "backward": if backward { serde_json::json!({
            "checks": grad_checks, "rule": memattn_cli::backward_run::rule_of(problem.dtype),
            "gradients_verified": grads_ok, "ranks": bwd_ranks,
        }) } else { serde_json::Value::Null },
        "overlap_model": { "link_gbps": link.gbps, "device_tflops": link.tflops, "strategies": models },
    });
    save_evidence(cli, &v)?;
    if cli.json {
        print_json(&v);
    } else {
        print!("{}", summary(&outs, &v, world));
    }
    Ok(if verified { exit::SUCCESS } else { exit::VERIFICATION_FAILED })
}

fn summary(outs: &[CpOutput], v: &serde_json::Value, world: usize) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>4} {:>4}  {:<28} {:>14} {:>14} {:>11}",
        "rank", "step", "blocks", "sent B", "received B", "compute ms"
    );
    for (rank, out) in outs.iter().enumerate() {
        for (t, st) in out.stats.steps.iter().enumerate() {
            let blocks: Vec<String> = st.blocks.iter().map(|b| format!("{b:?}").to_lowercase()).collect();
            let _ = writeln!(
                s,
                "{rank:>4} {t:>4}  {:<28} {:>14} {:>14} {:>11.2}",
                blocks.join(","),
                st.bytes_sent,
                st.bytes_received,
                st.compute_s * 1e3
            );
        }
    }
    for r in v["ranks"].as_array().into_iter().flatten() {
        let _ = writeln!(s, "{}", rank_bytes("rank", r, ""));
    }
    let m = &v["overlap_model"];
    let _ = writeln!(
        s,
        "overlap model, {world} ranks at {} GB/s per link and {} TFLOP/s per device (fraction of ideal speed):",
        m["link_gbps"], m["device_tflops"]
    );
    for e in m["strategies"].as_array().into_iter().flatten() {
        match e["fraction_of_ideal"].as_f64() {
            Some(f) => {
                let _ = writeln!(
                    s,
                    "  {:<8} {:>5.1} %  ({:.3} ms modelled, {:.3} ms ideal)",
                    e["strategy"].as_str().unwrap_or(""),
                    f * 100.0,
                    e["seconds"].as_f64().unwrap_or(0.0) * 1e3,
                    e["ideal_seconds"].as_f64().unwrap_or(0.0) * 1e3
                );
            }
            None => {
                let _ = writeln!(
                    s,
                    "  {:<8} n/a: {}",
                    e["strategy"].as_str().unwrap_or(""),
                    e["not_applicable"].as_str().unwrap_or("")
                );
            }
        }
    }
    let _ = writeln!(
        s,
        "checked {} of {} rows against the f64 reference ({}): O rel RMS {:.3e}",
        v["checked_rows"],
        v["total_rows"],
        v["tolerance_rule"].as_str().unwrap_or(""),
        v["o_rel_rms_err"].as_f64().unwrap_or(f64::NAN)
    );
    for f in v["failures"].as_array().into_iter().flatten() {
        let _ = writeln!(s, "  FAIL {}", f.as_str().unwrap_or(""));
    }
    let b = &v["backward"];
    if !b.is_null() {
        for r in b["ranks"].as_array().into_iter().flatten() {
            let _ = writeln!(s, "{}", rank_bytes("backward rank", r, ""));
        }
        let _ = writeln!(s, "gradients against f64 ({}):", b["rule"].as_str().unwrap_or(""));
        for c in b["checks"].as_array().into_iter().flatten() {
            let _ = writeln!(
                s,
                "  {:<8} max |err| {:.3e}  bound {:.3e}  {}",
                c["tensor"].as_str().unwrap_or(""),
                c["max_abs_err"].as_f64().unwrap_or(f64::NAN),
                c["bound"].as_f64().unwrap_or(f64::NAN),
                if c["passed"] == true { "ok" } else { "FAIL" }
            );
        }
    }
    let _ = writeln!(s, "{}", if v["verified"] == true { "VERIFIED" } else { "NOT VERIFIED" });
    s
}

/// One rank's bytes against the analytic volume: `{what} R: sent .. B (analytic .. B{why}),
/// received ..`.
fn rank_bytes(what: &str, r: &serde_json::Value, why: &str) -> String {
    format!(
        "{what} {}: sent {} B (analytic {} B{why}), received {} B (analytic {} B){}",
        r["rank"],
        r["bytes_sent"],
        r["analytic_bytes_sent"],
        r["bytes_received"],
        r["analytic_bytes_received"],
        if r["bytes_match"] == true { "" } else { "  MISMATCH" }
    )
}
