//! What an engine gets on its own CUDA context (`Kernels::cuda(&ctx)`), checked against f64:
//!
//! 1. the forward the device's generation runs by default (on an H100/H200 the Hopper forward,
//!    `flash_fwd_bf16_sm90_d128`), bf16, causal, GQA, lengths that are no tile multiple;
//! 2. a decode over an FP8 (e4m3) KV cache held in the engine's cudarc buffers;
//! 3. a decode step (append + split-KV decode + merge) and a prefill captured in one CUDA graph
//!    and replayed for three steps after a direct first step, the step's inputs updated in place
//!    between replays.
//!
//! Prints the kernels each part launched and exits 0 only when every result verified. On the
//! VM-backed driver (`MEMATTN_CUDA_DRIVER=target/debug/libvm_cuda.so`, add `VM_CUDA_ARCH=sm_90`
//! for a Hopper part), which has no stream capture, part 3 replays the step without a graph
//! and says so. `scripts/gpu-check.sh` runs it on a GPU:
//! `cargo build --release --example caller_context -p memattn`.

use cudarc::driver::{sys, CudaSlice, CudaStream};
use half::bf16;
use memattn::attn::{cuda_context, AttnOpts, Fp8CacheViewMut, Kernels, LseViewMut, TensorView, TensorViewMut};
use memattn::decode::Fp8Format;
use memattn::{reference, Dtype, Problem};
use std::sync::Arc;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Deterministic values in [-1, 1), rounded to bf16.
fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0).to_f32()
        })
        .collect()
}

fn bf(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// The largest |got - want| over a tensor, and whether every value is within `tol`.
fn check(what: &str, got: &[f32], want: &[f64], tol: f64) -> Res<()> {
    let worst = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0f64, f64::max);
    let nan = got.iter().any(|g| g.is_nan());
    println!("  {what}: max |error| {worst:.2e} (bound {tol:.1e}){}", if nan { ", NaN present" } else { "" });
    if nan || worst > tol {
        Err(format!("{what}: not verified").into())
    } else {
        Ok(())
    }
}

/// Attention of one query row over keys/values given by closures, in f64: (o, lse).
fn attend(
    d: usize,
    n: usize,
    q: &[f32],
    k: impl Fn(usize, usize) -> f64,
    v: impl Fn(usize, usize) -> f64,
) -> (Vec<f64>, f64) {
    let scale = 1.0 / (d as f64).sqrt();
    let s: Vec<f64> = (0..n).map(|j| scale * (0..d).map(|c| q[c] as f64 * k(j, c)).sum::<f64>()).collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = s.iter().map(|x| (x - m).exp()).sum();
    let o = (0..d).map(|c| (0..n).map(|j| (s[j] - m).exp() / sum * v(j, c)).sum()).collect();
    (o, m + sum.ln())
}

fn names(kernels: &Kernels) -> Res<String> {
    Ok(kernels.take_launches()?.iter().map(|l| l.kernel.name()).collect::<Vec<_>>().join(", "))
}

fn main() -> Res<()> {
    let ctx = cuda_context(0)?;
    let stream = ctx.new_stream()?;
    let kernels = Kernels::cuda(&ctx)?;
    kernels.record_launches(true)?;
    println!("{} on {:?}: {}", env!("CARGO_PKG_NAME"), ctx.name().unwrap_or_default(), kernels.target()?);

    // 1. The default forward.
    let p = Problem {
        batch: 2,
        heads: 8,
        heads_kv: Some(2),
        seq_q: 300,
        seq_kv: 421,
        head_dim: 128,
        causal: true,
        dtype: Dtype::Bf16,
        ..Problem::default()
    };
    let (b, sq, skv, h, hk, d) = (2usize, 300usize, 421usize, 8usize, 2usize, 128usize);
    let (q, k, v) = (data(b * sq * h * d, 1), data(b * skv * hk * d, 2), data(b * skv * hk * d, 3));
    let (qd, kd, vd) = (stream.clone_htod(&bf(&q))?, stream.clone_htod(&bf(&k))?, stream.clone_htod(&bf(&v))?);
    let mut od = stream.clone_htod(&bf(&vec![f32::NAN; q.len()]))?;
    let mut ld = stream.clone_htod(&vec![f32::NAN; b * h * sq])?;
    prefill(&kernels, &stream, [b, sq, skv, h, hk, d], (&qd, &kd, &vd), &mut od, &mut ld)?;
    println!("1. forward, bf16 d128 causal GQA 8/2: {}", names(&kernels)?);
    let (ro, rl) = reference::attention(&p, &q, &k, &v)?;
    let o: Vec<f32> = stream.clone_dtoh(&od)?.iter().map(|x| x.to_f32()).collect();
    check("O", &o, &ro, 1.6e-2)?;
    let lse = stream.clone_dtoh(&ld)?;
    check("LSE", &lse, &rl, 1e-3)?;

    // 2. An e4m3 cache in the engine's buffers.
    let f = Fp8Format::E4m3;
    let (cap, lens, scales) = (64usize, [61u32, 9], [0.5f32, 2.0]);
    let kv_vals = data(b * cap * hk * d, 4);
    let k_bytes = memattn::decode::fp8_encode_cache(f, &kv_vals, &scales, hk, d);
    let v_bytes = memattn::decode::fp8_encode_cache(f, &data(b * cap * hk * d, 5), &scales, hk, d);
    let q1 = data(b * h * d, 6);
    let q1d = stream.clone_htod(&bf(&q1))?;
    let (mut kc, mut vc) = (stream.clone_htod(&k_bytes)?, stream.clone_htod(&v_bytes)?);
    let mut o1 = stream.clone_htod(&bf(&vec![f32::NAN; b * h * d]))?;
    let mut l1 = stream.clone_htod(&vec![f32::NAN; b * h])?;
    let (ks, vs) =
        (kernels.fp8_scales_on(&scales, hk, Some(&stream))?, kernels.fp8_scales_on(&scales, hk, Some(&stream))?);
    let lens_t = kernels.index_tensor(&lens, Some(&stream))?;
    {
        let qv = TensorView::cuda(&q1d, &stream, [b, 1, h, d])?;
        let mut kv = Fp8CacheViewMut::cuda(&mut kc, &stream, f, [b, cap, hk, d])?;
        let mut vv = Fp8CacheViewMut::cuda(&mut vc, &stream, f, [b, cap, hk, d])?;
        let mut ov = TensorViewMut::cuda(&mut o1, &stream, [b, 1, h, d])?;
        let mut lv = LseViewMut::cuda(&mut l1, &stream, b, h, 1)?;
        let opts = AttnOpts::new();
        let plan = kernels.plan_kvcache_fp8(&qv, &kv, &vv, &ks, &vs, None, None, &lens_t, None, &ov, &lv, &opts)?;
        kernels.run_kvcache_fp8(&plan, &qv, &mut kv, &mut vv, None, None, &mut ov, &mut lv)?;
    }
    println!("2. decode over an e4m3 cache: {}", names(&kernels)?);
    let deq = |bytes: &[u8], s: usize, j: usize, kh: usize, c: usize| {
        memattn::decode::fp8_value_f64(f, bytes[((s * cap + j) * hk + kh) * d + c]) * scales[kh] as f64
    };
    let (mut ro, mut rl) = (Vec::new(), Vec::new());
    for s in 0..b {
        for head in 0..h {
            let kh = head / (h / hk);
            let qr = &q1[(s * h + head) * d..][..d];
            let n = lens[s] as usize;
            let (o, l) = attend(d, n, qr, |j, c| deq(&k_bytes, s, j, kh, c), |j, c| deq(&v_bytes, s, j, kh, c));
            ro.extend(o);
            rl.push(l);
        }
    }
    let o: Vec<f32> = stream.clone_dtoh(&o1)?.iter().map(|x| x.to_f32()).collect();
    check("O", &o, &ro, 2e-2)?;
    check("LSE", &stream.clone_dtoh(&l1)?, &rl, 1e-3)?;

    // 3. A decode step and a prefill in one CUDA graph.
    graph_steps(&ctx, &kernels, &stream)?;
    println!("verified: every part");
    Ok(())
}

/// `flash_attn_into` of bf16 q, k, v with the causal mask (`[b, sq, skv, h, hk, d]`).
fn prefill(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    [b, sq, skv, h, hk, d]: [usize; 6],
    (q, k, v): (&CudaSlice<bf16>, &CudaSlice<bf16>, &CudaSlice<bf16>),
    o: &mut CudaSlice<bf16>,
    lse: &mut CudaSlice<f32>,
) -> Res<()> {
    kernels.flash_attn_into(
        &TensorView::cuda(q, stream, [b, sq, h, d])?,
        &TensorView::cuda(k, stream, [b, skv, hk, d])?,
        &TensorView::cuda(v, stream, [b, skv, hk, d])?,
        &mut TensorViewMut::cuda(o, stream, [b, sq, h, d])?,
        &mut LseViewMut::cuda(lse, stream, b, h, sq)?,
        &AttnOpts::new().causal(true),
    )?;
    Ok(())
}

/// The buffers of the graph part's step: a paged bf16 cache, the step's inputs and outputs, and
/// the prefill's tensors.
struct Step {
    kc: CudaSlice<bf16>,
    vc: CudaSlice<bf16>,
    qd: CudaSlice<bf16>,
    knd: CudaSlice<bf16>,
    vnd: CudaSlice<bf16>,
    od: CudaSlice<bf16>,
    ld: CudaSlice<f32>,
    prefill_in: [CudaSlice<bf16>; 3],
    pod: CudaSlice<bf16>,
    pld: CudaSlice<f32>,
}

const B: usize = 2;
const H: usize = 8;
const HK: usize = 2;
const D: usize = 128;
const PAGE: usize = 16;
const PER_SEQ: usize = 4;
const PREFILL: [usize; 6] = [1, 77, 150, H, HK, D];

impl Step {
    /// One decode step (append, split-KV decode, merge) and one prefill, queued on `stream`.
    fn run(&mut self, kernels: &Kernels, plan: &memattn::attn::KvCachePlan<'_>, stream: &Arc<CudaStream>) -> Res<()> {
        let shape = [B * PER_SEQ, PAGE, HK, D];
        kernels.run_kvcache(
            plan,
            &TensorView::cuda(&self.qd, stream, [B, 1, H, D])?,
            &mut TensorViewMut::cuda(&mut self.kc, stream, shape)?,
            &mut TensorViewMut::cuda(&mut self.vc, stream, shape)?,
            Some(&TensorView::cuda(&self.knd, stream, [B, 1, HK, D])?),
            Some(&TensorView::cuda(&self.vnd, stream, [B, 1, HK, D])?),
            &mut TensorViewMut::cuda(&mut self.od, stream, [B, 1, H, D])?,
            &mut LseViewMut::cuda(&mut self.ld, stream, B, H, 1)?,
        )?;
        let [q, k, v] = &self.prefill_in;
        prefill(kernels, stream, PREFILL, (q, k, v), &mut self.pod, &mut self.pld)
    }

    /// Writes step `t`'s query and new token (returned as f32) without waiting.
    fn set_inputs(&mut self, t: usize, stream: &Arc<CudaStream>) -> Res<[Vec<f32>; 3]> {
        let row = HK * D;
        let (q, kn, vn) =
            (data(B * H * D, 5000 + t as u64), data(B * row, 6000 + t as u64), data(B * row, 7000 + t as u64));
        stream.memcpy_htod(&bf(&q), &mut self.qd)?;
        stream.memcpy_htod(&bf(&kn), &mut self.knd)?;
        stream.memcpy_htod(&bf(&vn), &mut self.vnd)?;
        Ok([q, kn, vn])
    }
}

/// Four decode steps over a paged bf16 cache (one token appended a step), each followed by a
/// prefill: step 0 runs directly (it loads the kernels and makes the stream's tensor-map slot),
/// then one step is captured as a CUDA graph and replayed for steps 1 to 3, the step's query,
/// new token and lengths written in place before each replay.
fn graph_steps(ctx: &Arc<cudarc::driver::CudaContext>, kernels: &Kernels, stream: &Arc<CudaStream>) -> Res<()> {
    let (row, steps) = (HK * D, 4usize);
    let start = [21u32, 40];
    let table: Vec<u32> = vec![7, 1, 3, 5, 0, 2, 4, 6];
    let slot = |s: usize, j: usize| (table[s * PER_SEQ + j / PAGE] as usize * PAGE + j % PAGE) * row;
    let mut kh = vec![0f32; B * PER_SEQ * PAGE * row];
    let mut vh = kh.clone();
    let (mut keys, mut vals) = (vec![Vec::new(); B], vec![Vec::new(); B]);
    for s in 0..B {
        for j in 0..start[s] as usize {
            let (kr, vr) = (data(row, 100 + (s * 64 + j) as u64), data(row, 700 + (s * 64 + j) as u64));
            kh[slot(s, j)..][..row].copy_from_slice(&kr);
            vh[slot(s, j)..][..row].copy_from_slice(&vr);
            keys[s].push(kr);
            vals[s].push(vr);
        }
    }
    let (table_dev, lens_dev) = (stream.clone_htod(&table)?, stream.clone_htod(&start)?);
    let lens_t = kernels.index_tensor_from_cuda(&lens_dev, B, stream)?;
    let table_t = kernels.index_tensor_from_cuda(&table_dev, table.len(), stream)?;
    let [_, sq, skv, ..] = PREFILL;
    let (pq, pk, pv) = (data(sq * H * D, 11), data(skv * row, 12), data(skv * row, 13));
    let mut st = Step {
        kc: stream.clone_htod(&bf(&kh))?,
        vc: stream.clone_htod(&bf(&vh))?,
        qd: stream.alloc_zeros::<bf16>(B * H * D)?,
        knd: stream.alloc_zeros::<bf16>(B * row)?,
        vnd: stream.alloc_zeros::<bf16>(B * row)?,
        od: stream.alloc_zeros::<bf16>(B * H * D)?,
        ld: stream.alloc_zeros::<f32>(B * H)?,
        prefill_in: [stream.clone_htod(&bf(&pq))?, stream.clone_htod(&bf(&pk))?, stream.clone_htod(&bf(&pv))?],
        pod: stream.alloc_zeros::<bf16>(pq.len())?,
        pld: stream.alloc_zeros::<f32>(H * sq)?,
    };
    let shape = [B * PER_SEQ, PAGE, HK, D];
    let plan = kernels.plan_kvcache(
        &TensorView::cuda(&st.qd, stream, [B, 1, H, D])?,
        &TensorViewMut::cuda(&mut st.kc, stream, shape)?,
        &TensorViewMut::cuda(&mut st.vc, stream, shape)?,
        Some(&TensorView::cuda(&st.knd, stream, [B, 1, HK, D])?),
        Some(&TensorView::cuda(&st.vnd, stream, [B, 1, HK, D])?),
        &lens_t,
        Some(&table_t),
        &TensorViewMut::cuda(&mut st.od, stream, [B, 1, H, D])?,
        &LseViewMut::cuda(&mut st.ld, stream, B, H, 1)?,
        &AttnOpts::new().num_splits(2),
    )?;
    let mut graph = None;
    let mut how = "as a CUDA graph";
    let mut results = Vec::new();
    for t in 0..steps {
        let lens: Vec<u32> = start.iter().map(|&l| l + t as u32).collect();
        let [q, kn, vn] = st.set_inputs(t, stream)?;
        // SAFETY: `lens_t` owns `B` u32 at this address in this context; ordered on `stream`.
        unsafe { cudarc::driver::result::memcpy_htod_async(lens_t.ptr(), &lens, stream.cu_stream()) }?;
        if t == 1 {
            // cudarc's event tracking records and waits on events around each buffer use; a
            // graph holds launches, so it is turned off from here (every buffer outlives the
            // replays).
            // SAFETY: as said.
            unsafe { ctx.disable_event_tracking() };
            match stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) {
                Ok(()) => {
                    let r = st.run(kernels, &plan, stream);
                    let g = stream.end_capture(sys::CUgraphInstantiate_flags(0));
                    r?;
                    graph = Some(g?.ok_or("the capture made no graph")?);
                    println!("3. captured one step: {}", names(kernels)?);
                }
                Err(e) => {
                    println!("3. no stream capture on this driver ({e}): steps 1-3 run without a graph");
                    how = "without a graph";
                }
            }
        }
        match &graph {
            Some(g) => g.launch()?,
            None => st.run(kernels, &plan, stream)?,
        }
        for s in 0..B {
            keys[s].push(kn[s * row..][..row].to_vec());
            vals[s].push(vn[s * row..][..row].to_vec());
        }
        let o: Vec<f32> = stream.clone_dtoh(&st.od)?.iter().map(|x| x.to_f32()).collect();
        let lse = stream.clone_dtoh(&st.ld)?;
        results.push((q, keys.clone(), vals.clone(), o, lse));
    }
    let launched = names(kernels)?;
    println!(
        "   {steps} decode steps + prefills, steps 1-3 {how}{}",
        if graph.is_some() { String::new() } else { format!(": {launched}") }
    );
    kernels.check_kv_status()?;
    for (t, (q, keys, vals, o, lse)) in results.iter().enumerate() {
        let (mut ro, mut rl) = (Vec::new(), Vec::new());
        for s in 0..B {
            for head in 0..H {
                let g = head / (H / HK);
                let n = keys[s].len();
                let (r, l) = attend(
                    D,
                    n,
                    &q[(s * H + head) * D..][..D],
                    |j, c| keys[s][j][g * D + c] as f64,
                    |j, c| vals[s][j][g * D + c] as f64,
                );
                ro.extend(r);
                rl.push(l);
            }
        }
        check(&format!("step {t} O"), o, &ro, 2e-2)?;
        check(&format!("step {t} LSE"), lse, &rl, 1e-3)?;
    }
    let p = Problem {
        batch: 1,
        heads: H as u32,
        heads_kv: Some(HK as u32),
        seq_q: sq as u32,
        seq_kv: skv as u32,
        head_dim: D as u32,
        causal: true,
        dtype: Dtype::Bf16,
        ..Problem::default()
    };
    let (ro, rl) = reference::attention(&p, &pq, &pk, &pv)?;
    let o: Vec<f32> = stream.clone_dtoh(&st.pod)?.iter().map(|x| x.to_f32()).collect();
    check("prefill O (last step)", &o, &ro, 1.6e-2)?;
    check("prefill LSE (last step)", &stream.clone_dtoh(&st.pld)?, &rl, 1e-3)?;
    Ok(())
}
