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
    /// Ranks run on VMs (one each) or, with --cp-comm nccl, on GPUs (one each). With --backward the backward follows the forward's road: ring and zigzag run
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
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = super::args::non_negative_usize, conflicts_with_all = ["output"])]
    pub cp: Option<usize>,
    /// With --cp: ring (contiguous slices, K/V travel rank to rank), zigzag (rank r holds pieces
    /// r and 2N-1-r of 2N: causal work balanced) or ulysses (all-to-all over heads; heads and
    /// heads_kv divisible by N).
    #[arg(long, value_name = "ring|zigzag|ulysses", default_value = "ring", requires = "cp")]
    pub cp_strategy: Strategy,
    /// With --cp: how the ranks talk. in-process (default): channels between threads, one VM
    /// per rank. nccl-rules: the NCCL adapter (memattn::cp::Grouped: queued sends flushed by the
    /// next receive as counts, headers and payloads, in groups) over an in-memory transport that
    /// enforces NCCL's rules (a send completes only when received; a group that would hang fails
    /// after a time limit), one VM per rank: what nccl runs, checked without GPUs; the results
    /// are bit-identical to in-process. nccl: one GPU per rank (GPUs 0..N-1; --backend cuda or
    /// auto), NCCL loaded at run time (a libnccl.so on the library path); the messages pass
    /// through host memory, as the other transports' do.
    ///
    /// Example: memattn run --cp 3 --cp-comm nccl-rules --cp-strategy zigzag --causal --seq 300 --heads 2
    #[arg(long, value_name = "in-process|nccl-rules|nccl", default_value = "in-process", requires = "cp")]
    pub cp_comm: CpComm,
    /// With --cp: the overlap model's link, GB/s one way between two ranks (default 450: NVLink 4
    /// of H100/H200; PCIe 5.0 x16 is 64).
    #[arg(long, value_name = "GB/S", default_value_t = 450.0, allow_negative_numbers = true, requires = "cp")]
    pub link_gbps: f64,
    /// With --cp: the overlap model's sustained attention throughput per device, TFLOP/s
    /// (default 400, FlashAttention-2-class bf16 on an H100).
    #[arg(long, value_name = "TFLOP/S", default_value_t = 400.0, allow_negative_numbers = true, requires = "cp")]
    pub device_tflops: f64,
}

/// The most ranks `--cp` starts (each a thread with its own VM).
pub const MAX_RANKS: usize = 64;

/// How `--cp` ranks talk (`--cp-comm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CpComm {
    InProcess,
    NcclRules,
    Nccl,
}

impl CpComm {
    fn name(self) -> &'static str {
        match self {
            CpComm::InProcess => "in-process",
            CpComm::NcclRules => "nccl-rules",
            CpComm::Nccl => "nccl",
        }
    }
}

/// One rank's communicator and, for GPU ranks, its device (VM ranks open theirs on their thread).
type RankSlot = (Box<dyn cp::Communicator>, std::sync::Mutex<Option<Box<dyn memattn::device::Device>>>);

/// The ranks of `--cp-comm`: their communicators and, for NCCL, their GPUs.
fn rank_slots(
    cli: &Cli,
    comm: CpComm,
    world: usize,
    opts: &memattn::device::DeviceOptions,
) -> Result<Vec<RankSlot>, Error> {
    let vm =
        |comms: Vec<Box<dyn cp::Communicator>>| comms.into_iter().map(|c| (c, std::sync::Mutex::new(None))).collect();
    match comm {
        CpComm::InProcess => Ok(vm(cp::InProcess::world(world).into_iter().map(|c| Box::new(c) as _).collect())),
        CpComm::NcclRules => Ok(vm(cp::Rendezvous::communicators(world, std::time::Duration::from_secs(600))
            .into_iter()
            .map(|c| Box::new(c) as _)
            .collect())),
        CpComm::Nccl => nccl_slots(cli, world, opts),
    }
}

#[cfg(feature = "nccl")]
fn nccl_slots(cli: &Cli, world: usize, opts: &memattn::device::DeviceOptions) -> Result<Vec<RankSlot>, Error> {
    use memattn::device::DeviceError;
    use memattn_cli::cuda_device::CudaDevice;
    if cli.backend == BackendChoice::Vm {
        return Err(Error::Usage(
            "--cp-comm nccl runs one rank per GPU: not with --backend vm (nccl-rules runs NCCL's adapter on VMs)"
                .into(),
        ));
    }
    let gpus = CudaDevice::count()?;
    if gpus < world {
        return Err(Error::Device(DeviceError::Unavailable(format!(
            "--cp {world} --cp-comm nccl needs {world} GPUs (one per rank); the driver sees {gpus}"
        ))));
    }
    let mut devices = Vec::with_capacity(world);
    let mut streams = Vec::with_capacity(world);
    for ordinal in 0..world {
        let d = CudaDevice::on_ordinal(opts, ordinal)?;
        streams.push(d.new_stream()?);
        devices.push(d);
    }
    let comms = cp::nccl::world(streams).map_err(|e| Error::Device(DeviceError::Unavailable(e.to_string())))?;
    // Each rank's transport end to end (a world of one rank transfers nothing otherwise).
    for c in &comms {
        c.transport().check_loopback(1 << 20).map_err(|e| Error::Device(DeviceError::Unavailable(e.to_string())))?;
    }
    if !cli.json {
        eprintln!("nccl: {world} communicators; each rank's 1 MiB loopback through NCCL arrived intact");
    }
    Ok(comms
        .into_iter()
        .zip(devices)
        .map(|(c, d)| (Box::new(c) as Box<dyn cp::Communicator>, std::sync::Mutex::new(Some(Box::new(d) as _))))
        .collect())
}

#[cfg(not(feature = "nccl"))]
fn nccl_slots(_: &Cli, _: usize, _: &memattn::device::DeviceOptions) -> Result<Vec<RankSlot>, Error> {
    Err(Error::Usage("this memattn was built without NCCL (cargo build -p memattn-cli --features nccl)".into()))
}

/// A rank's failure as the command's error: what the device or the machine could not do (out of
/// memory, a memcheck finding, a launch fault) is exit 3 as without --cp; a refused problem or
/// option exit 2.
fn cp_error(e: CpError) -> Error {
    use memattn::attn::AttnError;
    match e {
        CpError::Attn { rank, source } => match *source {
            AttnError::Device(d) => {
                if !matches!(d, memattn::device::DeviceError::Setting(_)) {
                    eprintln!("--cp: rank {rank} failed on its device");
                }
                Error::Device(d)
            }
            AttnError::Problem(p) => Error::Usage(format!("--cp: rank {rank}: {p}")),
            other => Error::Usage(format!("--cp: rank {rank}: {other}")),
        },
        e => Error::Usage(format!("--cp: {e}")),
    }
}

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
    let comm_kind = a.cp.cp_comm;
    if cli.backend == BackendChoice::Cuda && comm_kind != CpComm::Nccl {
        return Err(Error::Usage(format!(
            "--cp-comm {} runs its ranks on VMs: not with --backend cuda (--cp-comm nccl runs one rank per GPU)",
            comm_kind.name()
        )));
    }
    for (name, v) in [("--link-gbps", a.cp.link_gbps), ("--device-tflops", a.cp.device_tflops)] {
        if !(v.is_finite() && v > 0.0) {
            return Err(Error::Usage(format!("{name} must be a positive number (got {v})")));
        }
    }
    if problem.alibi {
        return Err(Error::Usage(
            "--cp has no ALiBi (its blocks are launched with shifted diagonals; leave out --alibi)".into(),
        ));
    }
    if problem.layout != memattn_cli::problem::Layout::Bshd {
        return Err(Error::Usage("--cp takes the bshd layout (each rank's rows are contiguous slices)".into()));
    }
    let backward = a.backward.backward;
    if backward {
        memattn_cli::backward_run::check_supported(&problem, kernel)?;
    }
    // The host copies the run holds at its peak, probed before any is made (a problem too
    // large for the host is exit 3 naming the bytes, as without --cp, never an abort): the f32
    // inputs, the ranks' encoded shards, the ranks' and the gathered O and LSE, and with
    // --backward dO and the gradients.
    let (q_elems, kv_elems) = (problem.q_elems(), problem.kv_elems());
    let inputs_elems = q_elems.saturating_add(kv_elems.saturating_mul(2));
    let es = problem.dtype.size_bytes();
    let mut host_bytes = inputs_elems
        .saturating_mul(4 + 4 + es)
        .saturating_add(q_elems.saturating_mul(4 + 4 + es).saturating_add(problem.rows().saturating_mul(8)));
    if backward {
        host_bytes =
            host_bytes.saturating_add(q_elems.saturating_mul(4 + es)).saturating_add(inputs_elems.saturating_mul(8));
    }
    memattn_cli::runner::probe_host_memory(host_bytes, "the host copies of the --cp run")?;
    let link = Link { gbps: a.cp.link_gbps, tflops: a.cp.device_tflops };
    // The strategy's rule (Ulysses' heads) before anything runs.
    cp::model(&problem, strategy, world, link)
        .map_err(|e| Error::Usage(format!("--cp {world} --cp-strategy {strategy}: {e}")))?;
    let x = inputs.unwrap_or_else(|| Qkv::random(&problem, a.problem.seed));
    let mut opts = device_options(cli)?;
    let slots = rank_slots(cli, comm_kind, world, &opts)?;
    opts.backend = BackendChoice::Vm;
    // The ranks share the machine's cores.
    if opts.vm_workers.is_none() {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        opts.vm_workers = Some((cores / world).max(1));
    }
    if !cli.json {
        match comm_kind {
            CpComm::Nccl => eprintln!("backend: cuda - {world} ranks, one GPU each, over NCCL (--cp)"),
            CpComm::NcclRules => {
                eprintln!("backend: vm - {world} ranks, one VM each, over NCCL's rules in memory (--cp)")
            }
            CpComm::InProcess => eprintln!("backend: vm - {world} in-process ranks, one VM each (--cp)"),
        }
        println!("problem: {}", describe_problem(&problem));
        println!("context parallel: {world} ranks, strategy {strategy}");
    }
    let (h, hk) = (problem.heads as usize, problem.kv_heads() as usize);
    let d_o = if backward { memattn_cli::backward_run::random_d_o(&problem, a.problem.seed) } else { Vec::new() };
    let started = std::time::Instant::now();
    let both: Result<Vec<(CpOutput, Option<CpGrads>)>, CpError> = cp::run_ranks(slots, |(comm, device)| {
        let comm = &**comm;
        let rank = comm.rank();
        let err = |source| CpError::attn(rank, source);
        let dev = match device.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(d) => d,
            None => {
                Box::new(VmDevice::new(&opts).map_err(|e| CpError::Comm { rank, why: format!("opening the VM: {e}") })?)
            }
        };
        let kernels = Kernels::on_device(dev);
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
    let both = both.map_err(cp_error)?;
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
        "command": "run", "cp": world, "cp_strategy": strategy.name(), "cp_comm": comm_kind.name(), "problem": problem.shape_json(),
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
