//! One measured, verified KV-cache decode run on a [`Device`] (the `memattn decode` command): the
//! library's plan ([`memattn::decode`]), then upload, poison, launch, time, download and verify,
//! and `merge_states` on its own.

use crate::error::Error;
use crate::runner::{poison, LaunchRecord, MAX_LAUNCHES, POISON};
use crate::timing::Timing;
use kernels_gpu::abi::Strides;
use kernels_gpu::decode_abi::MergeParams;
use kernels_gpu::tiles::MERGE;
use kernels_gpu::Family;
use kernels_gpu::KernelId;
use memattn::decode::*;
use memattn::device::{DevPtr, Device, DeviceError};
use memattn::dtype::Dtype;
use memattn::memory::MeasuredMemory;
use serde::Serialize;

/// What to run.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeSpec {
    pub problem: DecodeProblem,
    pub seed: u64,
    pub warmup: Option<u32>,
    pub repeats: Option<u32>,
}

/// Everything a decode run measured. Field names are the `--json` contract.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecodeReport {
    pub backend: String,
    pub device: String,
    pub dtype: Dtype,
    pub batch: u32,
    pub heads: u32,
    pub heads_kv: u32,
    pub head_dim: u32,
    pub seq_q: u32,
    pub cache_seqlens: Vec<u32>,
    pub new_tokens: u32,
    pub causal: bool,
    /// `[left, right]` of the sliding window (`-1`: unbounded).
    pub window: [i32; 2],
    pub softcap: f32,
    pub sinks: bool,
    /// The decode forward family that ran: `mma` (tensor cores) or `simt`.
    pub kernel: &'static str,
    pub cache: CacheLayout,
    pub inputs: String,
    pub plan: SplitPlan,
    pub verified: bool,
    pub verification: DecodeVerification,
    pub time_ms: f64,
    pub timing: Timing,
    pub flops: f64,
    pub tflops: f64,
    /// Bytes of K and V read per second (`kv_used` over the median time).
    pub kv_read_gb_per_s: f64,
    pub bytes: DecodeBytes,
    pub peak_device_bytes: u64,
    pub memory: MeasuredMemory,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_thread_instructions: Option<u64>,
    /// VM only: thread-instructions per key of the cache attended (`Σ seqlen_k` over the batch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_thread_instructions_per_cached_token: Option<f64>,
    pub launches: Vec<LaunchRecord>,
    #[serde(skip)]
    pub o: Vec<f32>,
    #[serde(skip)]
    pub lse: Vec<f32>,
    /// The cache after the run (with the appended tokens).
    #[serde(skip)]
    pub k_cache: Vec<f32>,
    #[serde(skip)]
    pub v_cache: Vec<f32>,
}

/// `mma` or `simt`: the family of the decode forward among `ids`.
fn kernel_family_name(ids: impl Iterator<Item = KernelId>) -> &'static str {
    for k in ids {
        match k.variant().family {
            Family::DecodeMma => return "mma",
            Family::DecodeFwd => return "simt",
            _ => {}
        }
    }
    "none"
}

/// Runs one decode call on `dev` with `inputs` (or random inputs from `spec.seed`), verified
/// against the f64 reference; the cache after the append is checked bit for bit.
pub fn run_decode<D: Device + ?Sized>(
    dev: &mut D,
    spec: &DecodeSpec,
    inputs: Option<&DecodeInputs>,
) -> Result<DecodeReport, Error> {
    let p = &spec.problem;
    p.validate()?;
    let generated;
    let (x, inputs_desc) = match inputs {
        Some(x) => (x, "given".to_string()),
        None => {
            generated = DecodeInputs::random(p, spec.seed);
            (
                &generated,
                format!("random normal (seed {}){}", spec.seed, if p.dtype.is_16bit() { ", rounded" } else { "" }),
            )
        }
    };
    x.validate(p)?;
    let plan = p.plan()?;
    let launches = planned_launches(p, &plan)?;
    let caps = dev.caps()?;
    for (k, l) in &launches {
        for a in 0..3 {
            if l.grid[a] == 0 || l.grid[a] > caps.max_grid[a] {
                return Err(Error::Usage(format!(
                    "`{}` needs grid {:?}, over the device's limit {:?} in dimension {a}",
                    k.name(),
                    l.grid,
                    caps.max_grid
                )));
            }
        }
    }
    let ids: Vec<KernelId> = launches.iter().map(|l| l.0).collect();
    dev.ptx()
        .check_tiles(&ids)
        .map_err(|message| DeviceError::PtxLoad { origin: dev.ptx().origin.clone(), message })?;
    let bytes = DecodeBytes::new(p, x, &plan);
    if bytes.total > caps.free_memory_bytes {
        return Err(Error::Usage(format!(
            "the decode call needs {} of device memory, {} are free",
            crate::units::human_bytes(bytes.total),
            crate::units::human_bytes(caps.free_memory_bytes)
        )));
    }
    let (def_warmup, def_repeats) = dev.default_warmup_repeats();
    let warmup = spec.warmup.unwrap_or(def_warmup);
    let repeats = spec.repeats.unwrap_or(def_repeats).max(1);
    if warmup > MAX_LAUNCHES || repeats > MAX_LAUNCHES {
        return Err(Error::Usage(format!(
            "warm-up {warmup} and repeats {repeats}: each must be at most {MAX_LAUNCHES}"
        )));
    }
    dev.memory_begin()?;
    let mut allocated: Vec<DevPtr> = Vec::new();
    let body = (|| -> Result<_, DeviceError> {
        let mut alloc = |dev: &mut D, n: u64| -> Result<DevPtr, DeviceError> {
            if n == 0 {
                return Ok(0);
            }
            let ptr = dev.alloc(n)?;
            allocated.push(ptr);
            Ok(ptr)
        };
        let q = alloc(dev, bytes.q)?;
        let kc = alloc(dev, bytes.kv_cache / 2)?;
        let vc = alloc(dev, bytes.kv_cache / 2)?;
        let kn = alloc(dev, bytes.new_kv / 2)?;
        let vn = alloc(dev, bytes.new_kv / 2)?;
        let bt = alloc(dev, bytes.block_table)?;
        let sl = alloc(dev, bytes.cache_seqlens)?;
        let sk = alloc(dev, bytes.sinks)?;
        let o = alloc(dev, bytes.o)?;
        let lse = alloc(dev, bytes.lse)?;
        let o_part = alloc(dev, bytes.workspace / (p.head_dim as u64 + 1) * p.head_dim as u64)?;
        let lse_part = alloc(dev, bytes.workspace / (p.head_dim as u64 + 1))?;
        dev.upload_bytes(q, &p.dtype.encode(&x.q))?;
        dev.upload_bytes(kc, &p.dtype.encode(&x.k_cache))?;
        dev.upload_bytes(vc, &p.dtype.encode(&x.v_cache))?;
        if kn != 0 {
            dev.upload_bytes(kn, &p.dtype.encode(&x.k_new))?;
            dev.upload_bytes(vn, &p.dtype.encode(&x.v_new))?;
        }
        if bt != 0 {
            let b: Vec<u8> = x.block_table.iter().flat_map(|v| v.to_le_bytes()).collect();
            dev.upload_bytes(bt, &b)?;
        }
        let s: Vec<u8> = p.cache_seqlens.iter().flat_map(|v| v.to_le_bytes()).collect();
        dev.upload_bytes(sl, &s)?;
        if sk != 0 {
            dev.upload(sk, &x.sinks)?;
        }
        dev.memory_mark_allocated()?;
        let bufs = DecodeBuffers {
            q,
            k_cache: kc,
            v_cache: vc,
            k_new: kn,
            v_new: vn,
            block_table: bt,
            cache_seqlens: sl,
            o,
            lse,
            o_part,
            lse_part,
            sinks: sk,
        };
        let params = decode_params(p, x.layout, plan.num_splits, &bufs);
        let merge =
            merge_params(p, plan.num_splits, &bufs, Strides::bshd(p.seq_q as u64, p.heads as u64, p.head_dim as u64));
        let (pb, mb) = (params.to_bytes(), merge.to_bytes());
        let mut samples = Vec::new();
        let mut records = Vec::new();
        for rep in 0..warmup as u64 + repeats as u64 {
            poison(dev, o, bytes.o, p.dtype)?;
            dev.fill_u32(lse, p.rows(), POISON)?;
            if o_part != 0 {
                dev.fill_u32(o_part, bytes.workspace / (p.head_dim as u64 + 1) * p.head_dim as u64 / 4, POISON)?;
                dev.fill_u32(lse_part, bytes.workspace / (p.head_dim as u64 + 1) / 4, POISON)?;
            }
            dev.synchronize()?;
            dev.timer_start()?;
            let mut these = Vec::new();
            for (k, dims) in &launches {
                let arg: &[u8] = if k.variant().family == kernels_gpu::Family::MergeStates { &mb } else { &pb };
                let info = dev.launch(k.name(), dims, &[arg])?;
                these.push(LaunchRecord {
                    kernel: k.name().to_string(),
                    grid: dims.grid,
                    block: dims.block,
                    dynamic_smem_bytes: dims.dynamic_smem_bytes,
                    thread_instructions: info.thread_instructions,
                });
            }
            let ms = dev.timer_stop()?;
            if rep >= warmup as u64 {
                samples.push(ms);
            }
            records = these;
        }
        let mut ob = vec![0u8; bytes.o as usize];
        dev.download_bytes(o, &mut ob)?;
        let mut lv = vec![0f32; p.rows() as usize];
        dev.download(lse, &mut lv)?;
        let mut kb = vec![0u8; (bytes.kv_cache / 2) as usize];
        let mut vb = vec![0u8; (bytes.kv_cache / 2) as usize];
        dev.download_bytes(kc, &mut kb)?;
        dev.download_bytes(vc, &mut vb)?;
        Ok((samples, records, p.dtype.decode(&ob), lv, p.dtype.decode(&kb), p.dtype.decode(&vb)))
    })();
    let mut free_err = None;
    for ptr in allocated.into_iter().rev() {
        if let Err(e) = dev.free(ptr) {
            free_err.get_or_insert(e);
        }
    }
    let memory = dev.memory_end();
    let (samples, records, o, lse, k_after, v_after) = body?;
    if let Some(e) = free_err {
        return Err(e.into());
    }
    let memory = memory?;
    let r = reference(p, x);
    let mut v = verify_decode(p, &o, &lse, &r);
    if p.seq_new > 0 {
        let (ke, ve) = x.appended(p);
        let same = |a: &[f32], b: &[f32]| {
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
        };
        let ok = same(&k_after, &ke) && same(&v_after, &ve);
        v.cache_ok = Some(ok);
        if !ok {
            v.failures.push("the cache after the append differs from k_new/v_new written at cache_seqlens".into());
            v.passed = false;
        }
    }
    let timing = Timing::new(warmup, dev.clock_name(), samples);
    let flops: f64 =
        (0..p.batch as usize).map(|b| (0..p.seq_q).map(|i| p.keys_seen(b, i) as f64).sum::<f64>()).sum::<f64>()
            * 4.0
            * p.heads as f64
            * p.head_dim as f64;
    let instr: Option<u64> = records.iter().map(|r| r.thread_instructions).sum();
    let cached: u64 = (0..p.batch as usize).map(|b| p.seqlen_k(b) as u64).sum();
    Ok(DecodeReport {
        backend: dev.backend().name().to_string(),
        device: dev.name(),
        dtype: p.dtype,
        batch: p.batch,
        heads: p.heads,
        heads_kv: p.heads_kv,
        head_dim: p.head_dim,
        seq_q: p.seq_q,
        cache_seqlens: p.cache_seqlens.clone(),
        new_tokens: p.seq_new,
        causal: p.causal,
        window: [p.window_left, p.window_right],
        softcap: p.softcap,
        sinks: p.sinks,
        kernel: kernel_family_name(launches.iter().map(|l| l.0)),
        cache: x.layout,
        inputs: inputs_desc,
        plan,
        verified: v.passed,
        verification: v,
        time_ms: timing.median_ms,
        tflops: crate::timing::tflops(flops, timing.median_ms),
        kv_read_gb_per_s: bytes.kv_used as f64 / (timing.median_ms * 1e-3) / 1e9,
        timing,
        flops,
        bytes,
        peak_device_bytes: memory.peak_delta_bytes,
        memory,
        vm_thread_instructions: instr,
        vm_thread_instructions_per_cached_token: instr.filter(|_| cached > 0).map(|n| n as f64 / cached as f64),
        launches: records,
        o,
        lse,
        k_cache: k_after,
        v_cache: v_after,
    })
}

/// Runs `merge_states` on `dev`: combines `x` into O (`dtype`, `[batch, seq_q, heads,
/// head_dim]`, returned as f32 values) and LSE (`[batch, heads, seq_q]`). Outputs are poisoned
/// before the launch.
pub fn merge_states<D: Device + ?Sized>(
    dev: &mut D,
    x: &Partials,
    dtype: Dtype,
) -> Result<(Vec<f32>, Vec<f32>), Error> {
    x.check()?;
    let k = KernelId::find(kernels_gpu::Family::MergeStates, dtype.elem(), None)
        .ok_or_else(|| Error::Usage(format!("no merge_states kernel for {dtype}")))?;
    let rows = x.rows();
    let es = dtype.size_bytes();
    let dims = MERGE.launch(rows);
    let mut ptrs = Vec::new();
    let r = (|| -> Result<_, DeviceError> {
        let mut alloc = |dev: &mut D, n: u64| -> Result<DevPtr, DeviceError> {
            let p = dev.alloc(n)?;
            ptrs.push(p);
            Ok(p)
        };
        let op = alloc(dev, x.o.len() as u64 * 4)?;
        let lp = alloc(dev, x.lse.len() as u64 * 4)?;
        let o = alloc(dev, rows * x.head_dim as u64 * es)?;
        let lse = alloc(dev, rows * 4)?;
        dev.upload(op, &x.o)?;
        dev.upload(lp, &x.lse)?;
        poison(dev, o, rows * x.head_dim as u64 * es, dtype)?;
        dev.fill_u32(lse, rows, POISON)?;
        let m = MergeParams {
            o_part: op,
            lse_part: lp,
            o,
            lse,
            o_strides: Strides::bshd(x.seq_q as u64, x.heads as u64, x.head_dim as u64),
            splits: x.splits,
            batch: x.batch,
            heads: x.heads,
            seq_q: x.seq_q,
            head_dim: x.head_dim,
            _pad: 0,
        };
        dev.launch(k.name(), &dims, &[&m.to_bytes()])?;
        let mut ob = vec![0u8; (rows * x.head_dim as u64 * es) as usize];
        dev.download_bytes(o, &mut ob)?;
        let mut lv = vec![0f32; rows as usize];
        dev.download(lse, &mut lv)?;
        Ok((dtype.decode(&ob), lv))
    })();
    for p in ptrs.into_iter().rev() {
        dev.free(p)?;
    }
    Ok(r?)
}
