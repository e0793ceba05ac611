//! One measured, verified KV-cache decode run on a [`Device`] (the `memattn decode` command): the
//! library's plan ([`memattn::decode`]), then upload, poison, launch, time, download and verify,
//! and `merge_states` on its own. The repetitions, the memory bracket and the timing are the
//! [`crate::harness`]'s; this module says what to upload, poison and launch, and verifies O, LSE
//! and the cache after the append.

use crate::error::Error;
use crate::harness::{allocated, measure, poison, repeat, Body, Repetitions, POISON};
use crate::runner::LaunchRecord;
use crate::timing::Timing;
use kernels_gpu::Family;
use kernels_gpu::KernelId;
use memattn::attn::{
    AttnError, AttnOpts, Fp8CacheViewMut, Kernels, LseViewMut, PartialsView, RotaryView, SinksView, TensorView,
    TensorViewMut,
};
use memattn::decode::*;
use memattn::device::Device;
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
    /// Give the library the index tensors without host copies, so it checks them on the device
    /// (`decode_check_*` first in the call) instead of on the host.
    pub indices_on_device: bool,
}

/// Everything a decode run measured. Field names are the `--json` contract.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecodeReport {
    pub backend: String,
    pub device: String,
    pub dtype: Dtype,
    /// The KV cache's element type: the dtype's name, or `fp8` (e4m3) / `fp8_e5m2`.
    pub kv_dtype: &'static str,
    /// Where the library checked the index tensors: `host` or `device`.
    pub indices_checked_on: &'static str,
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
    /// ALiBi with the paper's slopes.
    pub alibi: bool,
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
            Family::DecodeMma | Family::DecodeMmaSm90 => return "mma",
            Family::DecodeFwd => return "simt",
            Family::FlashMma => return "prefill",
            _ => {}
        }
    }
    "none"
}

/// Runs one decode call on `dev` with `inputs` (or random inputs from `spec.seed`), verified
/// against the f64 reference; the cache after the append is checked bit for bit.
pub fn run_decode(
    dev: &mut dyn Device,
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
    check_decode_scores(p, x)?;
    let plan = p.plan()?;
    let launches = planned_launches(p, &plan, dev.target()?)?;
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
    dev.check_tiles(&ids)?;
    let bytes = DecodeBytes::new(p, x, &plan);
    if bytes.total > caps.free_memory_bytes {
        return Err(Error::DeviceMemory { what: "decode call", needed: bytes.total, free: caps.free_memory_bytes });
    }
    let reps = Repetitions::resolve(dev, spec.warmup, spec.repeats)?;
    let m = measure(dev, reps, None, |k| decode_measured(k, p, x, &plan, reps, spec.indices_on_device))?;
    let instr = m.vm_thread_instructions();
    let (o, lse, k_after, v_after) = m.out;
    let (timing, memory) = (m.timing, m.memory);
    let r = reference(p, x);
    let mut v = verify_decode(p, &o, &lse, &r);
    if p.kv_fp8.is_some() {
        // What quantisation costs: the kernel's O against attention over the unquantised cache.
        let exact = reference(&DecodeProblem { kv_fp8: None, ..p.clone() }, x);
        v.quantisation_rel_rms = Some(rel_rms(&o, &exact.o));
    }
    if p.seq_new > 0 {
        // The kernels rotate the new keys (rounded to the dtype), then quantise them: rotate
        // first, as the reference does.
        let (ke, ve) = x.rotated(p).dequantised(p).appended(&DecodeProblem { rotary: None, ..p.clone() });
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
    let flops: f64 =
        (0..p.batch as usize).map(|b| (0..p.seq_q).map(|i| p.keys_seen(b, i) as f64).sum::<f64>()).sum::<f64>()
            * 4.0
            * p.heads as f64
            * p.head_dim as f64;
    let cached: u64 = (0..p.batch as usize).map(|b| p.seqlen_k(b) as u64).sum();
    Ok(DecodeReport {
        backend: dev.backend().name().to_string(),
        device: dev.name(),
        dtype: p.dtype,
        kv_dtype: p.kv_fp8.map_or(p.dtype.name(), |f| f.name()),
        indices_checked_on: if spec.indices_on_device { "device" } else { "host" },
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
        alibi: p.alibi,
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
        launches: m.launches,
        o,
        lse,
        k_cache: k_after,
        v_cache: v_after,
    })
}

/// Refuses a decode call whose f32 scores overflow (exit 2), as `run` does
/// ([`crate::runner::check_score_range`]): the cheap bound `max(|scale|, 1) * max|q| * max|k|`
/// first, and only when it is over [`crate::runner::MAX_SCORE`] every score a query sees, with
/// the cache after the append.
pub fn check_decode_scores(p: &DecodeProblem, x: &DecodeInputs) -> Result<(), Error> {
    use crate::runner::MAX_SCORE;
    let d = p.head_dim as usize;
    let norm = |r: &[f32]| r.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt();
    let max_norm = |t: &[f32]| t.chunks_exact(d.max(1)).map(norm).fold(0f64, f64::max);
    let scale = (p.softmax_scale() as f64).abs().max(1.0);
    let k_max = max_norm(&x.k_cache).max(max_norm(&x.k_new));
    if max_norm(&x.q) * k_max * scale < MAX_SCORE {
        return Ok(());
    }
    let (k_after, _) = x.appended(p);
    let h = p.heads as usize;
    for b in 0..p.batch as usize {
        for i in 0..p.seq_q {
            let (start, end) = p.key_range(b, i);
            for head in 0..h {
                let q = &x.q[((b * p.seq_q as usize + i as usize) * h + head) * d..][..d];
                let kv_head = head / p.group().max(1) as usize;
                for j in start..end {
                    let Some(at) = x.row_offset(p, b, j) else { continue };
                    let k = &k_after[at + kv_head * d..][..d];
                    let dot: f64 = q.iter().zip(k).map(|(&a, &c)| a as f64 * c as f64).sum();
                    let s = dot.abs() * scale;
                    if s >= MAX_SCORE {
                        return Err(Error::Usage(format!(
                            "scores overflow f32: |{}q.k| = {s:.3e} for sequence {b} head {head} query {i} key {j} \
                             (softmax scale {:e}), over the limit {MAX_SCORE:.3e} (f32::MAX / 2, which leaves room \
                             for the kernels' log2(e) factor); use a smaller --scale or smaller inputs",
                            if scale > 1.0 { "scale*" } else { "" },
                            p.softmax_scale()
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Runs `merge_states` on `dev` through the library's [`Kernels::merge_states_into`]: combines
/// `x` into O (`dtype`, `[batch, seq_q, heads, head_dim]`, returned as f32 values) and LSE
/// (`[batch, heads, seq_q]`). Outputs are poisoned before the launch.
pub fn merge_states(dev: &mut dyn Device, x: &Partials, dtype: Dtype) -> Result<(Vec<f32>, Vec<f32>), Error> {
    x.check()?;
    let r = Kernels::scoped(dev, |k| -> Result<_, AttnError> {
        let rows = x.rows();
        let es = dtype.size_bytes();
        let (b, sq, h, d) = (x.batch as usize, x.seq_q as usize, x.heads as usize, x.head_dim as usize);
        let op = k.upload_as(Dtype::F32, &x.o)?;
        let lp = k.upload_as(Dtype::F32, &x.lse)?;
        let o = k.alloc(rows * x.head_dim as u64 * es)?;
        let lse = k.alloc(rows * 4)?;
        k.with_device(|dev| {
            poison(dev, o.ptr(), rows * x.head_dim as u64 * es, dtype)?;
            dev.fill_u32(lse.ptr(), rows, POISON)
        })?;
        k.merge_states_into(
            &PartialsView::vm(&op, &lp, x.splits as usize, [b, sq, h, d])?,
            &mut TensorViewMut::device(&o, dtype, [b, sq, h, d])?,
            &mut LseViewMut::vm(&lse, b, h, sq)?,
        )?;
        Ok((
            dtype.decode(&o.read_bytes((rows * x.head_dim as u64 * es) as usize)?),
            lse.read_f32(Dtype::F32, rows as usize)?,
        ))
    });
    Ok(r?)
}

/// The cache views of a run: in the dtype of the call, or FP8.
enum Caches<'a> {
    Same(TensorViewMut<'a>, TensorViewMut<'a>),
    Fp8(Fp8CacheViewMut<'a>, Fp8CacheViewMut<'a>),
}

/// What a measured decode run downloads after its last repetition: O, LSE and the caches after
/// the append.
type DecodeOutputs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// The views of the new tokens' K and V buffers (`[batch, seq_new, heads_kv, d]`), if any.
fn new_token_views<'a>(
    new: &'a Option<(memattn::attn::DeviceBuffer, memattn::attn::DeviceBuffer)>,
    dtype: Dtype,
    shape: [usize; 4],
) -> Result<Option<(TensorView<'a>, TensorView<'a>)>, AttnError> {
    Ok(match new {
        Some((kn, vn)) => Some((TensorView::device(kn, dtype, shape)?, TensorView::device(vn, dtype, shape)?)),
        None => None,
    })
}

/// Uploads the decode call's tensors on `k`, plans it once through the library
/// ([`Kernels::plan_kvcache`], with the split count of `plan`), then hands the harness
/// ([`repeat`]) its steps: poison O, LSE and the split workspace, run the plan
/// ([`Kernels::run_kvcache`]). Downloads O, LSE and the caches after the last repetition.
fn decode_measured(
    k: &Kernels,
    p: &DecodeProblem,
    x: &DecodeInputs,
    plan: &SplitPlan,
    reps: Repetitions,
    indices_on_device: bool,
) -> Body<DecodeOutputs> {
    // Without host copies the library checks the indices on the device.
    let index = |values: &[u32]| -> Result<memattn::attn::IndexTensor, AttnError> {
        let t = k.index_tensor(values, None)?;
        Ok(if indices_on_device { t.device_only() } else { t })
    };
    let (b, sq, h, hk, d) =
        (p.batch as usize, p.seq_q as usize, p.heads as usize, p.heads_kv as usize, p.head_dim as usize);
    let up = |data: &[f32]| k.upload_as(p.dtype, data);
    let q = up(&x.q)?;
    // An FP8 cache goes up as its bytes, `encode(x / scale)`; the others in the dtype.
    let up_cache = |data: &[f32], scales: &[f32]| match p.kv_fp8 {
        Some(f) => {
            let buf = k.alloc(data.len() as u64)?;
            buf.write_bytes(&fp8_encode_cache(f, data, scales, hk, d))?;
            Ok(buf)
        }
        None => up(data),
    };
    let (kc, vc) = (up_cache(&x.k_cache, &x.k_scale)?, up_cache(&x.v_cache, &x.v_scale)?);
    let scales = match p.kv_fp8 {
        Some(_) => Some((k.fp8_scales(&x.k_scale, hk)?, k.fp8_scales(&x.v_scale, hk)?)),
        None => None,
    };
    let new = if p.seq_new > 0 { Some((up(&x.k_new)?, up(&x.v_new)?)) } else { None };
    let cache_seqlens = index(&p.cache_seqlens)?;
    let (cache_shape, block_table) = match x.layout {
        CacheLayout::Contiguous { seq_cache } => ([p.cache_slots() as usize, seq_cache as usize, hk, d], None),
        CacheLayout::Paged { page_size, num_pages, .. } => {
            ([num_pages as usize, page_size as usize, hk, d], Some(index(&x.block_table)?))
        }
    };
    // The rotary tables' rows: one per position the call rotates; with the indices on the device
    // the call is planned for every sequence at the capacity, so the tables extend to the last
    // position that allows: the inputs' rows, then the usual angles (rows the call never reads).
    // Tables longer than the call needs (FlashAttention-2's seqlen_ro may exceed it) are used as
    // given.
    let given_rows = p.rotary.map_or(0, |r| (x.rotary_cos.len() / (r.dim as usize / 2).max(1)) as u32);
    let rotary_rows = match (p.rotary, indices_on_device) {
        (Some(_), true) => p
            .rotary_rows()
            .max(p.at_capacity(x.layout.capacity(), u32::try_from(p.cache_slots()).unwrap_or(u32::MAX)).rotary_rows()),
        _ => p.rotary_rows(),
    }
    .max(given_rows);
    let rotary_tables = match p.rotary {
        Some(r) if rotary_rows > given_rows => {
            let (mut cos, mut sin) = memattn::decode::rope_tables(rotary_rows, r.dim, 10000.0, p.dtype);
            cos[..x.rotary_cos.len()].copy_from_slice(&x.rotary_cos);
            sin[..x.rotary_sin.len()].copy_from_slice(&x.rotary_sin);
            Some((up(&cos)?, up(&sin)?))
        }
        Some(_) => Some((up(&x.rotary_cos)?, up(&x.rotary_sin)?)),
        None => None,
    };
    let slots = p.cache_batch_idx.as_ref().map(|t| index(t)).transpose()?;
    let leftpad = p.cache_leftpad.as_ref().map(|t| index(t)).transpose()?;
    let sinks = if p.sinks { Some(k.upload_as(Dtype::F32, &x.sinks)?) } else { None };
    let alibi = if p.alibi { Some(k.upload_as(Dtype::F32, &x.alibi_slopes)?) } else { None };
    let es = p.dtype.size_bytes();
    let o = k.alloc((b * sq * h * d) as u64 * es)?;
    let lse = k.alloc(p.rows() * 4)?;

    let qv = TensorView::device(&q, p.dtype, [b, sq, h, d])?;
    let mut caches = match p.kv_fp8 {
        Some(f) => {
            Caches::Fp8(Fp8CacheViewMut::device(&kc, f, cache_shape)?, Fp8CacheViewMut::device(&vc, f, cache_shape)?)
        }
        None => Caches::Same(
            TensorViewMut::device(&kc, p.dtype, cache_shape)?,
            TensorViewMut::device(&vc, p.dtype, cache_shape)?,
        ),
    };
    let new_views = new_token_views(&new, p.dtype, [b, p.seq_new as usize, hk, d])?;
    let (kn, vn) = match &new_views {
        Some((kn, vn)) => (Some(kn), Some(vn)),
        None => (None, None),
    };
    let mut ov = TensorViewMut::device(&o, p.dtype, [b, sq, h, d])?;
    let mut lv = LseViewMut::vm(&lse, b, h, sq)?;
    let sinks_view = match &sinks {
        Some(s) => Some(SinksView::vm(s, h)?),
        None => None,
    };
    let mut opts = AttnOpts::new()
        .causal(p.causal)
        .window_size(p.window_left, p.window_right)
        .num_splits(plan.num_splits)
        .decode_kernel(p.kernel);
    if let Some(scale) = p.scale {
        opts = opts.softmax_scale(scale);
    }
    if p.softcap != 0.0 {
        opts = opts.softcap(p.softcap);
    }
    if let Some(s) = &sinks_view {
        opts = opts.sinks(s);
    }
    let alibi_view = match &alibi {
        // [heads] or [batch, heads] slopes.
        Some(a) => Some(memattn::attn::AlibiView::vm(a, (x.alibi_slopes.len() != h).then_some(b), h)?),
        None => None,
    };
    if let Some(a) = &alibi_view {
        opts = opts.alibi_slopes(a);
    }
    if let Some(t) = &slots {
        opts = opts.cache_batch_idx(t);
    }
    if let Some(t) = &leftpad {
        opts = opts.cache_leftpad(t);
    }
    let rotary_view = match (&rotary_tables, p.rotary) {
        (Some((c, s)), Some(r)) => {
            let shape = [rotary_rows as usize, (r.dim / 2) as usize, 1, 1];
            Some(RotaryView::new(
                TensorView::device(c, p.dtype, shape)?,
                TensorView::device(s, p.dtype, shape)?,
                r.interleaved,
            ))
        }
        _ => None,
    };
    if let Some(r) = &rotary_view {
        opts = opts.rotary(r);
    }
    let bt = block_table.as_ref();
    let planned = match (&caches, &scales) {
        (Caches::Same(kcv, vcv), _) => k.plan_kvcache(&qv, kcv, vcv, kn, vn, &cache_seqlens, bt, &ov, &lv, &opts)?,
        (Caches::Fp8(kcv, vcv), Some((ks, vs))) => {
            k.plan_kvcache_fp8(&qv, kcv, vcv, ks, vs, kn, vn, &cache_seqlens, bt, &ov, &lv, &opts)?
        }
        (Caches::Fp8(..), None) => unreachable!("an FP8 cache has its scales"),
    };
    allocated(k)?;

    let poison_outputs = |k: &Kernels| {
        k.with_device(|dev| {
            poison(dev, o.ptr(), o.bytes(), p.dtype)?;
            dev.fill_u32(lse.ptr(), p.rows(), POISON)
        })?;
        planned.fill_workspace_u32(POISON)
    };
    let launch = || match &mut caches {
        Caches::Same(kcv, vcv) => k.run_kvcache(&planned, &qv, kcv, vcv, kn, vn, &mut ov, &mut lv),
        Caches::Fp8(kcv, vcv) => k.run_kvcache_fp8(&planned, &qv, kcv, vcv, kn, vn, &mut ov, &mut lv),
    };
    let repeated = repeat(k, reps, poison_outputs, launch, |_| Ok(()))?;
    // Indices checked on the device: a violation is reported here, and O is NaN.
    k.check_kv_status()?;
    let read = |buf: &memattn::attn::DeviceBuffer| -> Result<Vec<f32>, AttnError> {
        Ok(p.dtype.decode(&buf.read_bytes(buf.bytes() as usize)?))
    };
    // An FP8 cache's values: `decode(byte) * scale` of its KV head.
    let read_cache = |buf: &memattn::attn::DeviceBuffer, scales: &[f32]| -> Result<Vec<f32>, AttnError> {
        match p.kv_fp8 {
            Some(f) => Ok(buf
                .read_bytes(buf.bytes() as usize)?
                .iter()
                .enumerate()
                .map(|(i, &c)| kernels_gpu::fp8::decode(f, c) * DecodeInputs::fp8_scale(scales, (i / d) % hk))
                .collect()),
            None => read(buf),
        }
    };
    let (k_after, v_after) = (read_cache(&kc, &x.k_scale)?, read_cache(&vc, &x.v_scale)?);
    Ok((repeated, (read(&o)?, lse.read_f32(Dtype::F32, p.rows() as usize)?, k_after, v_after)))
}

/// What a shared-prefix decode run measured (`memattn decode --shared-prefix N`). Field names
/// are the `--json` contract.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SharedPrefixReport {
    /// Keys of the shared prefix (the first cached keys of every sequence).
    pub prefix: u32,
    /// Suffix keys cached per sequence (`cache_seqlens[b] - prefix`).
    pub suffix_seqlens: Vec<u32>,
    /// The decode forward family that ran: `mma` (tensor cores) or `simt`.
    pub kernel: &'static str,
    pub verified: bool,
    /// Judged against the f64 reference of each sequence as one plain decode over `prefix ++
    /// suffix`.
    pub verification: DecodeVerification,
    pub time_ms: f64,
    pub timing: Timing,
    /// Bytes of the prefix's K and V.
    pub prefix_bytes: u64,
    /// VM only: global bytes read by the decode over the prefix (the call's first launch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_launch_bytes_read: Option<u64>,
    /// VM only: global bytes read by every launch of the call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_read: Option<u64>,
    /// What reading the prefix once per sequence costs (`batch · prefix_bytes`), as a plain
    /// decode of every sequence over its own copy of the prefix does.
    pub per_request_prefix_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_thread_instructions: Option<u64>,
    pub launches: Vec<LaunchRecord>,
    #[serde(skip)]
    pub o: Vec<f32>,
    #[serde(skip)]
    pub lse: Vec<f32>,
}

/// Runs the decode `spec` (random inputs from `spec.seed`) as a shared-prefix call: the first
/// `prefix` cached keys of every sequence are made one shared prefix
/// ([`SharedPrefix::split`]), uploaded once, and the library's
/// [`Kernels::flash_attn_with_shared_prefix_into`] attends to it and to each sequence's suffix;
/// verified against the f64 reference of the whole problem.
pub fn run_shared_prefix(dev: &mut dyn Device, spec: &DecodeSpec, prefix: u32) -> Result<SharedPrefixReport, Error> {
    let p = &spec.problem;
    p.validate()?;
    let mut x = DecodeInputs::random(p, spec.seed);
    let sp = SharedPrefix::split(p, &mut x, prefix)?;
    x.validate(p)?;
    check_decode_scores(p, &x)?;
    let reps = Repetitions::resolve(dev, spec.warmup, spec.repeats)?;
    let m = measure(dev, reps, None, |k| shared_prefix_measured(k, p, &sp, reps))?;
    let instr = m.vm_thread_instructions();
    let (o, lse) = m.out;
    let v = verify_decode(p, &o, &lse, &reference(p, &x));
    let prefix_bytes = sp.prefix_bytes(p.dtype.size_bytes());
    let bytes_read = m.launches.iter().map(|l| l.global_bytes_read).sum::<Option<u64>>();
    Ok(SharedPrefixReport {
        prefix,
        suffix_seqlens: sp.suffix.cache_seqlens.clone(),
        kernel: kernel_family_name(m.launches.iter().filter_map(|l| KernelId::from_name(&l.kernel))),
        verified: v.passed,
        verification: v,
        time_ms: m.timing.median_ms,
        timing: m.timing,
        prefix_bytes,
        prefix_launch_bytes_read: m.launches.first().and_then(|l| l.global_bytes_read),
        bytes_read,
        per_request_prefix_bytes: p.batch as u64 * prefix_bytes,
        vm_thread_instructions: instr,
        launches: m.launches,
        o,
        lse,
    })
}

/// Uploads the prefix, the suffix caches and the query of `sp` on `k`, then hands the harness
/// its steps: poison O and LSE, run the shared-prefix call. Downloads O and LSE.
fn shared_prefix_measured(
    k: &Kernels,
    p: &DecodeProblem,
    sp: &SharedPrefix,
    reps: Repetitions,
) -> Body<(Vec<f32>, Vec<f32>)> {
    let s = &sp.suffix;
    let x = &sp.suffix_inputs;
    let (b, sq, h, hk, d) =
        (p.batch as usize, p.seq_q as usize, p.heads as usize, p.heads_kv as usize, p.head_dim as usize);
    let up = |data: &[f32]| k.upload_as(p.dtype, data);
    let (q, pk, pv) = (up(&x.q)?, up(&sp.prefix_k)?, up(&sp.prefix_v)?);
    // A suffix cache of 0 rows (every suffix empty, no new tokens) is one row long: views of it
    // read nothing.
    let CacheLayout::Contiguous { seq_cache } = x.layout else {
        return Err(AttnError::NotSupportedYet { feature: "a paged suffix cache in the command" });
    };
    let seq_cache = (seq_cache as usize).max(1);
    let cache_shape = [b, seq_cache, hk, d];
    let pad = |c: &[f32]| [c, &vec![0.0; b * seq_cache * hk * d - c.len()][..]].concat();
    let (kc, vc) = (up(&pad(&x.k_cache))?, up(&pad(&x.v_cache))?);
    let new = if s.seq_new > 0 { Some((up(&x.k_new)?, up(&x.v_new)?)) } else { None };
    let cache_seqlens = k.index_tensor(&s.cache_seqlens, None)?;
    let sinks = if p.sinks { Some(k.upload_as(Dtype::F32, &x.sinks)?) } else { None };
    let o = k.alloc((b * sq * h * d) as u64 * p.dtype.size_bytes())?;
    let lse = k.alloc(p.rows() * 4)?;
    let qv = TensorView::device(&q, p.dtype, [b, sq, h, d])?;
    let prefix_shape = [1, sp.prefix as usize, hk, d];
    let (pkv, pvv) = (TensorView::device(&pk, p.dtype, prefix_shape)?, TensorView::device(&pv, p.dtype, prefix_shape)?);
    let mut kcv = TensorViewMut::device(&kc, p.dtype, cache_shape)?;
    let mut vcv = TensorViewMut::device(&vc, p.dtype, cache_shape)?;
    let new_views = new_token_views(&new, p.dtype, [b, s.seq_new as usize, hk, d])?;
    let (kn, vn) = match &new_views {
        Some((kn, vn)) => (Some(kn), Some(vn)),
        None => (None, None),
    };
    let mut ov = TensorViewMut::device(&o, p.dtype, [b, sq, h, d])?;
    let mut lv = LseViewMut::vm(&lse, b, h, sq)?;
    let sinks_view = sinks.as_ref().map(|s| SinksView::vm(s, h)).transpose()?;
    let mut opts = AttnOpts::new().causal(p.causal).decode_kernel(p.kernel);
    if let Splits::Fixed(n) = p.splits {
        opts = opts.num_splits(n);
    }
    if let Some(scale) = p.scale {
        opts = opts.softmax_scale(scale);
    }
    if p.softcap != 0.0 {
        opts = opts.softcap(p.softcap);
    }
    if let Some(s) = &sinks_view {
        opts = opts.sinks(s);
    }
    allocated(k)?;
    let poison_outputs = |k: &Kernels| {
        k.with_device(|dev| {
            poison(dev, o.ptr(), o.bytes(), p.dtype)?;
            dev.fill_u32(lse.ptr(), p.rows(), POISON)
        })
    };
    let launch = || {
        k.flash_attn_with_shared_prefix_into(
            &qv,
            &pkv,
            &pvv,
            &mut kcv,
            &mut vcv,
            kn,
            vn,
            &cache_seqlens,
            None,
            &mut ov,
            &mut lv,
            &opts,
        )
    };
    let repeated = repeat(k, reps, poison_outputs, launch, |_| Ok(()))?;
    let read = |buf: &memattn::attn::DeviceBuffer| -> Result<Vec<f32>, AttnError> {
        Ok(p.dtype.decode(&buf.read_bytes(buf.bytes() as usize)?))
    };
    Ok((repeated, (read(&o)?, lse.read_f32(Dtype::F32, p.rows() as usize)?)))
}
