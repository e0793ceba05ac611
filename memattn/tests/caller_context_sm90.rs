//! A caller's CUDA context on an sm_90 device (the VM-backed driver with `VM_CUDA_ARCH=sm_90`),
//! as an engine holds one (`Kernels::cuda(&ctx)`, the README's program shape): it gets the
//! kernels a memattn device gets — the Hopper forward by default where the measured table picks
//! it, the `sm_90a` e4m3 decode, FP8 caches — and a decode step and a prefill call on its
//! stream allocate, free and wait for nothing (the driver's counters).
//! (A test binary of its own: the driver and its modelled GPU are chosen once per process.)

mod common;
use common::{data, vm_cuda};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use memattn::attn::{AttnOpts, Fp8CacheViewMut, Kernels, LseViewMut, TensorView, TensorViewMut};
use memattn::choice::{Arch, HopperPolicy};
use memattn::decode::Fp8Format;
use memattn::{reference, Dtype, Problem};
use std::sync::{Arc, OnceLock};

/// The VM-backed driver modelling an sm_90 GPU, and its context (once per process).
fn context() -> Arc<CudaContext> {
    static CTX: OnceLock<Arc<CudaContext>> = OnceLock::new();
    CTX.get_or_init(|| {
        // SAFETY: set before any thread of this binary reads the environment (the first call,
        // under the OnceLock) and never changed.
        unsafe {
            std::env::set_var("VM_CUDA_ARCH", "sm_90");
            std::env::remove_var(memattn::choice::HOPPER_ENV);
            std::env::set_var(memattn::driver::DRIVER_ENV, vm_cuda());
        }
        memattn::attn::cuda_context(0).expect("the VM-backed driver opens a context")
    })
    .clone()
}

/// One test at a time: the driver's counters are the process's.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The driver's counters: allocations, frees, host synchronisations, host-to-device copies,
/// device-to-host copies, launches.
fn counters() -> [u64; 6] {
    // SAFETY: the library cudarc loaded (MEMATTN_CUDA_DRIVER); the symbol writes six u64.
    let lib = unsafe { libloading::Library::new(vm_cuda()) }.unwrap();
    let f: libloading::Symbol<unsafe extern "C" fn(*mut u64)> = unsafe { lib.get(b"vmcuda_counters") }.unwrap();
    let mut out = [0u64; 6];
    unsafe { f(out.as_mut_ptr()) };
    out
}

fn bf(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

fn read(stream: &Arc<CudaStream>, o: &CudaSlice<bf16>) -> Vec<f32> {
    stream.clone_dtoh(o).unwrap().iter().map(|x| x.to_f32()).collect()
}

/// O and LSE against the f64 reference (bf16 outputs).
fn assert_close(what: &str, o: &[f32], lse: &[f32], ro: &[f64], rl: &[f64]) {
    for (i, (&g, &r)) in o.iter().zip(ro).enumerate() {
        assert!((g as f64 - r).abs() <= 1.6e-2, "{what}: o[{i}] = {g}, reference {r}");
    }
    for (i, (&g, &r)) in lse.iter().zip(rl).enumerate() {
        if r == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "{what}: lse[{i}]");
        } else {
            assert!((g as f64 - r).abs() <= 1e-4 * r.abs().max(1.0), "{what}: lse[{i}] = {g}, reference {r}");
        }
    }
}

/// One prefill call: q `[b, sq, h, d]`, k and v `[b, skv, hk, d]` already on the device, into
/// `o` and `lse`.
#[allow(clippy::too_many_arguments)]
fn prefill(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    p: &Problem,
    (q, k, v): (&CudaSlice<bf16>, &CudaSlice<bf16>, &CudaSlice<bf16>),
    o: &mut CudaSlice<bf16>,
    lse: &mut CudaSlice<f32>,
) {
    let (b, sq, skv) = (p.batch as usize, p.seq_q as usize, p.seq_kv as usize);
    let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    kernels
        .flash_attn_into(
            &TensorView::cuda(q, stream, [b, sq, h, d]).unwrap(),
            &TensorView::cuda(k, stream, [b, skv, hk, d]).unwrap(),
            &TensorView::cuda(v, stream, [b, skv, hk, d]).unwrap(),
            &mut TensorViewMut::cuda(o, stream, [b, sq, h, d]).unwrap(),
            &mut LseViewMut::cuda(lse, stream, b, h, sq).unwrap(),
            &AttnOpts::new().causal(p.causal),
        )
        .unwrap();
}

/// With no variable set, a caller's context on sm_90 runs `flash_fwd_bf16_sm90_d128` (after its
/// tensor-map store) and the result is the reference's; at d64, where the Hopper forward
/// measured slower, the sm_80 kernel is planned.
#[test]
fn a_caller_context_on_sm90_runs_the_hopper_forward_by_default() {
    let _one = serial();
    let ctx = context();
    let stream = ctx.new_stream().unwrap();
    let kernels = Kernels::cuda(&ctx).unwrap();
    let target = kernels.target().unwrap();
    assert_eq!((target.arch, target.hopper), (Arch::Sm90, HopperPolicy::Measured));
    kernels.record_launches(true).unwrap();
    // Two query blocks, a key count that is no tile multiple, GQA 4/2, causal bottom-right.
    let p = Problem {
        batch: 2,
        heads: 4,
        heads_kv: Some(2),
        seq_q: 150,
        seq_kv: 201,
        head_dim: 128,
        causal: true,
        dtype: Dtype::Bf16,
        ..Problem::default()
    };
    let (b, sq, skv, h, hk, d) = (2usize, 150usize, 201usize, 4usize, 2usize, 128usize);
    let (q, k, v) = (
        data(b * sq * h * d, 1, Dtype::Bf16),
        data(b * skv * hk * d, 2, Dtype::Bf16),
        data(b * skv * hk * d, 3, Dtype::Bf16),
    );
    let (qd, kd, vd) =
        (stream.clone_htod(&bf(&q)).unwrap(), stream.clone_htod(&bf(&k)).unwrap(), stream.clone_htod(&bf(&v)).unwrap());
    let mut od = stream.clone_htod(&bf(&vec![f32::NAN; q.len()])).unwrap();
    let mut ld = stream.clone_htod(&vec![f32::NAN; b * h * sq]).unwrap();
    let planned = kernels
        .flash_attn_launches(
            &TensorView::cuda(&qd, &stream, [b, sq, h, d]).unwrap(),
            &TensorView::cuda(&kd, &stream, [b, skv, hk, d]).unwrap(),
            &TensorView::cuda(&vd, &stream, [b, skv, hk, d]).unwrap(),
            &AttnOpts::new().causal(true),
        )
        .unwrap();
    let names: Vec<&str> = planned.iter().map(|l| l.kernel.name()).collect();
    assert_eq!(names, ["tensor_maps_store", "flash_fwd_bf16_sm90_d128"]);
    prefill(&kernels, &stream, &p, (&qd, &kd, &vd), &mut od, &mut ld);
    let launched = kernels.take_launches().unwrap();
    let ran: Vec<&str> = launched.iter().map(|l| l.kernel.name()).collect();
    assert_eq!(ran, names, "the launches made are the launches planned");
    assert_eq!(launched[1].dims, planned[1].dims);
    let (o, lse) = (read(&stream, &od), stream.clone_dtoh(&ld).unwrap());
    let (ro, rl) = reference::attention(&p, &q, &k, &v).unwrap();
    assert_close("hopper d128", &o, &lse, &ro, &rl);

    // d64: the measured table keeps the sm_80 kernel.
    let d = 64;
    let qd = stream.clone_htod(&bf(&data(sq * h * d, 4, Dtype::Bf16))).unwrap();
    let kd = stream.clone_htod(&bf(&data(skv * hk * d, 5, Dtype::Bf16))).unwrap();
    let planned = kernels
        .flash_attn_launches(
            &TensorView::cuda(&qd, &stream, [1, sq, h, d]).unwrap(),
            &TensorView::cuda(&kd, &stream, [1, skv, hk, d]).unwrap(),
            &TensorView::cuda(&kd, &stream, [1, skv, hk, d]).unwrap(),
            &AttnOpts::new(),
        )
        .unwrap();
    assert_eq!(planned.iter().map(|l| l.kernel.name()).collect::<Vec<_>>(), ["flash_fwd_bf16_d64"]);
}

/// An e4m3 KV cache on a caller's context: the scales and the cache are cudarc buffers, the
/// decode is the `sm_90a` row, and every output row is attention over the cache's dequantised
/// bytes, computed here in f64.
#[test]
fn an_fp8_cache_decodes_on_a_caller_context() {
    let _one = serial();
    let ctx = context();
    let stream = ctx.new_stream().unwrap();
    let kernels = Kernels::cuda(&ctx).unwrap();
    kernels.record_launches(true).unwrap();
    let f = Fp8Format::E4m3;
    let (b, h, hk, d, cap) = (2usize, 4usize, 2usize, 128usize, 40usize);
    let lens = [37u32, 5];
    let scales = [0.5f32, 2.0];
    let values = data(b * cap * hk * d, 21, Dtype::F32);
    let k_bytes = memattn::decode::fp8_encode_cache(f, &values, &scales, hk, d);
    let v_values: Vec<f32> = values.iter().map(|x| 0.7 * x + 0.1).collect();
    let v_bytes = memattn::decode::fp8_encode_cache(f, &v_values, &scales, hk, d);
    let q = data(b * h * d, 22, Dtype::Bf16);
    let qd = stream.clone_htod(&bf(&q)).unwrap();
    let mut kc = stream.clone_htod(&k_bytes).unwrap();
    let mut vc = stream.clone_htod(&v_bytes).unwrap();
    let mut od = stream.clone_htod(&bf(&vec![f32::NAN; b * h * d])).unwrap();
    let mut ld = stream.clone_htod(&vec![f32::NAN; b * h]).unwrap();
    let ks = kernels.fp8_scales_on(&scales, hk, Some(&stream)).unwrap();
    let vs = kernels.fp8_scales_on(&scales, hk, Some(&stream)).unwrap();
    // Without a stream the scales cannot be copied to a CUDA context: named, not a panic.
    let e = kernels.fp8_scales(&scales, hk).unwrap_err().to_string();
    assert!(e.contains("fp8_scales_on"), "{e}");
    let lens_t = kernels.index_tensor(&lens, Some(&stream)).unwrap();
    let shape = [b, cap, hk, d];
    let qv = TensorView::cuda(&qd, &stream, [b, 1, h, d]).unwrap();
    let mut kv = Fp8CacheViewMut::cuda(&mut kc, &stream, f, shape).unwrap();
    let mut vv = Fp8CacheViewMut::cuda(&mut vc, &stream, f, shape).unwrap();
    let mut ov = TensorViewMut::cuda(&mut od, &stream, [b, 1, h, d]).unwrap();
    let mut lv = LseViewMut::cuda(&mut ld, &stream, b, h, 1).unwrap();
    let opts = AttnOpts::new();
    let plan = kernels.plan_kvcache_fp8(&qv, &kv, &vv, &ks, &vs, None, None, &lens_t, None, &ov, &lv, &opts).unwrap();
    kernels.run_kvcache_fp8(&plan, &qv, &mut kv, &mut vv, None, None, &mut ov, &mut lv).unwrap();
    drop((kv, vv, ov, lv, qv));
    let ran: Vec<&str> = kernels.take_launches().unwrap().iter().map(|l| l.kernel.name()).collect();
    assert!(ran.contains(&"decode_mma_fp8_e4m3_sm90_d128"), "{ran:?}");
    let (o, lse) = (read(&stream, &od), stream.clone_dtoh(&ld).unwrap());
    let deq = |bytes: &[u8], s: usize, j: usize, kh: usize, c: usize| {
        memattn::decode::fp8_value_f64(f, bytes[((s * cap + j) * hk + kh) * d + c]) * scales[kh] as f64
    };
    let scale = 1.0 / (d as f64).sqrt();
    for s in 0..b {
        let n = lens[s] as usize;
        for head in 0..h {
            let kh = head / (h / hk);
            let qr = &q[(s * h + head) * d..][..d];
            let scores: Vec<f64> = (0..n)
                .map(|j| scale * (0..d).map(|c| qr[c] as f64 * deq(&k_bytes, s, j, kh, c)).sum::<f64>())
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|x| (x - m).exp()).sum();
            let row = s * h + head;
            assert!((lse[row] as f64 - (m + sum.ln())).abs() < 1e-3, "seq {s} head {head}: lse {}", lse[row]);
            for c in 0..d {
                let want: f64 = (0..n).map(|j| (scores[j] - m).exp() / sum * deq(&v_bytes, s, j, kh, c)).sum();
                let got = o[row * d + c] as f64;
                assert!(
                    (got - want).abs() < 2e-2 * want.abs().max(1.0),
                    "seq {s} head {head} dim {c}: {got} vs {want}"
                );
            }
        }
    }
}

/// Graph-capturable steps: after one warm-up, 20 paged decode steps (plan once, run per step,
/// appending a token each) and 5 prefill calls (the Hopper forward) on the caller's stream make
/// no allocation, no free and no host synchronisation — the driver counts them. The inputs
/// each step changes are copied host-to-device without waiting, as an engine (or a graph's
/// update) would. Every step's output is then checked against f64 attention.
#[test]
fn twenty_decode_steps_and_five_prefills_allocate_free_and_wait_for_nothing() {
    let _one = serial();
    let ctx = context();
    let stream = ctx.new_stream().unwrap();
    let kernels = Kernels::cuda(&ctx).unwrap();
    let (b, h, hk, d, page, pages_per_seq, steps) = (2usize, 4usize, 2usize, 128usize, 16usize, 3usize, 20usize);
    let start = [5u32, 17];
    let num_pages = b * pages_per_seq;
    let table: Vec<u32> = vec![5, 1, 3, 0, 4, 2];
    let row = hk * d;
    let place = |s: usize, j: usize| (table[s * pages_per_seq + j / page] as usize * page + j % page) * row;
    let mut k_host = vec![0f32; num_pages * page * row];
    let mut v_host = k_host.clone();
    let mut keys: Vec<Vec<Vec<f32>>> = vec![Vec::new(); b];
    let mut vals: Vec<Vec<Vec<f32>>> = vec![Vec::new(); b];
    for s in 0..b {
        for j in 0..start[s] as usize {
            let (kr, vr) =
                (data(row, 100 + (s * 64 + j) as u64, Dtype::Bf16), data(row, 900 + (s * 64 + j) as u64, Dtype::Bf16));
            k_host[place(s, j)..][..row].copy_from_slice(&kr);
            v_host[place(s, j)..][..row].copy_from_slice(&vr);
            keys[s].push(kr);
            vals[s].push(vr);
        }
    }
    let mut kc = stream.clone_htod(&bf(&k_host)).unwrap();
    let mut vc = stream.clone_htod(&bf(&v_host)).unwrap();
    let table_dev = stream.clone_htod(&table).unwrap();
    let lens_dev = stream.clone_htod(&start).unwrap();
    // Device-only index tensors: the plan reads no value, each run checks them on the device;
    // the step advances the lengths in place, as a replayed graph's update would.
    let lens_t = kernels.index_tensor_from_cuda(&lens_dev, b, &stream).unwrap();
    let table_t = kernels.index_tensor_from_cuda(&table_dev, b * pages_per_seq, &stream).unwrap();
    // Every step's inputs and outputs, allocated before the loop.
    let mut qd = stream.alloc_zeros::<bf16>(b * h * d).unwrap();
    let mut knd = stream.alloc_zeros::<bf16>(b * row).unwrap();
    let mut vnd = stream.alloc_zeros::<bf16>(b * row).unwrap();
    let mut outs: Vec<(CudaSlice<bf16>, CudaSlice<f32>)> = (0..steps)
        .map(|_| {
            (
                stream.clone_htod(&bf(&vec![f32::NAN; b * h * d])).unwrap(),
                stream.clone_htod(&vec![f32::NAN; b * h]).unwrap(),
            )
        })
        .collect();
    let cache_shape = [num_pages, page, hk, d];
    let opts = AttnOpts::new().num_splits(2);
    let plan = {
        let (o0, l0) = &mut outs[0];
        kernels
            .plan_kvcache(
                &TensorView::cuda(&qd, &stream, [b, 1, h, d]).unwrap(),
                &TensorViewMut::cuda(&mut kc, &stream, cache_shape).unwrap(),
                &TensorViewMut::cuda(&mut vc, &stream, cache_shape).unwrap(),
                Some(&TensorView::cuda(&knd, &stream, [b, 1, hk, d]).unwrap()),
                Some(&TensorView::cuda(&vnd, &stream, [b, 1, hk, d]).unwrap()),
                &lens_t,
                Some(&table_t),
                &TensorViewMut::cuda(o0, &stream, [b, 1, h, d]).unwrap(),
                &LseViewMut::cuda(l0, &stream, b, h, 1).unwrap(),
                &opts,
            )
            .unwrap()
    };
    assert_eq!(plan.num_splits(), 2);
    // The prefill's tensors, and its warm-up call (the first Hopper call on a stream makes the
    // stream's 384-byte tensor-map slot, once).
    let pp = Problem {
        batch: 1,
        heads: 4,
        heads_kv: Some(2),
        seq_q: 70,
        seq_kv: 133,
        head_dim: 128,
        causal: true,
        dtype: Dtype::Bf16,
        ..Problem::default()
    };
    let pq = data(70 * 4 * 128, 31, Dtype::Bf16);
    let (pk, pv) = (data(133 * 2 * 128, 32, Dtype::Bf16), data(133 * 2 * 128, 33, Dtype::Bf16));
    let (pqd, pkd, pvd) = (
        stream.clone_htod(&bf(&pq)).unwrap(),
        stream.clone_htod(&bf(&pk)).unwrap(),
        stream.clone_htod(&bf(&pv)).unwrap(),
    );
    let mut pouts: Vec<(CudaSlice<bf16>, CudaSlice<f32>)> = (0..6)
        .map(|_| {
            (
                stream.clone_htod(&bf(&vec![f32::NAN; pq.len()])).unwrap(),
                stream.clone_htod(&vec![f32::NAN; 4 * 70]).unwrap(),
            )
        })
        .collect();
    {
        let (o, l) = &mut pouts[5];
        prefill(&kernels, &stream, &pp, (&pqd, &pkd, &pvd), o, l);
    }
    stream.synchronize().unwrap();

    kernels.record_launches(true).unwrap();
    let before = counters();
    let mut queries = Vec::new();
    for t in 0..steps {
        let q = data(b * h * d, 5000 + t as u64, Dtype::Bf16);
        let kn = data(b * row, 6000 + t as u64, Dtype::Bf16);
        let vn = data(b * row, 7000 + t as u64, Dtype::Bf16);
        stream.memcpy_htod(&bf(&q), &mut qd).unwrap();
        stream.memcpy_htod(&bf(&kn), &mut knd).unwrap();
        stream.memcpy_htod(&bf(&vn), &mut vnd).unwrap();
        let lens: Vec<u32> = start.iter().map(|&l| l + t as u32).collect();
        // SAFETY: `lens_t` owns `b` u32 at this address in this context; the copy is ordered
        // on `stream` before the step's launches.
        unsafe { cudarc::driver::result::memcpy_htod_async(lens_t.ptr(), &lens, stream.cu_stream()) }.unwrap();
        let (o, l) = &mut outs[t];
        kernels
            .run_kvcache(
                &plan,
                &TensorView::cuda(&qd, &stream, [b, 1, h, d]).unwrap(),
                &mut TensorViewMut::cuda(&mut kc, &stream, cache_shape).unwrap(),
                &mut TensorViewMut::cuda(&mut vc, &stream, cache_shape).unwrap(),
                Some(&TensorView::cuda(&knd, &stream, [b, 1, hk, d]).unwrap()),
                Some(&TensorView::cuda(&vnd, &stream, [b, 1, hk, d]).unwrap()),
                &mut TensorViewMut::cuda(o, &stream, [b, 1, h, d]).unwrap(),
                &mut LseViewMut::cuda(l, &stream, b, h, 1).unwrap(),
            )
            .unwrap();
        for s in 0..b {
            keys[s].push(kn[s * row..][..row].to_vec());
            vals[s].push(vn[s * row..][..row].to_vec());
        }
        queries.push((q, keys.clone(), vals.clone()));
        if t % 4 == 0 {
            let (o, l) = &mut pouts[t / 4];
            prefill(&kernels, &stream, &pp, (&pqd, &pkd, &pvd), o, l);
        }
    }
    let after = counters();
    let ran: Vec<&str> = kernels.take_launches().unwrap().iter().map(|l| l.kernel.name()).collect();
    let count = |name: &str| ran.iter().filter(|&&k| k == name).count();
    assert_eq!((count("tensor_maps_store"), count("flash_fwd_bf16_sm90_d128")), (5, 5), "{ran:?}");
    assert_eq!(count("decode_check_bf16"), 20, "{ran:?}");
    let [allocs, frees, syncs, _htod, dtoh, launches] = std::array::from_fn(|i| after[i] - before[i]);
    assert_eq!(
        (allocs, frees, syncs, dtoh),
        (0, 0, 0, 0),
        "allocations, frees, host synchronisations, reads inside the loop"
    );
    assert!(launches >= 20 * 3 + 5 * 2, "{launches} launches");
    eprintln!("20 decode steps + 5 prefills: {launches} launches, 0 allocations, 0 frees, 0 host synchronisations");

    kernels.check_kv_status().unwrap();
    let scale = 1.0 / (d as f64).sqrt();
    for (t, ((q, keys, vals), (od, ld))) in queries.iter().zip(&outs).enumerate() {
        let (o, lse) = (read(&stream, od), stream.clone_dtoh(ld).unwrap());
        for s in 0..b {
            let n = keys[s].len();
            for head in 0..h {
                let kh = head / (h / hk);
                let qr = &q[(s * h + head) * d..][..d];
                let scores: Vec<f64> = (0..n)
                    .map(|j| {
                        scale
                            * qr.iter().zip(&keys[s][j][kh * d..][..d]).map(|(&a, &c)| a as f64 * c as f64).sum::<f64>()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                let r = s * h + head;
                assert!((lse[r] as f64 - (m + sum.ln())).abs() < 1e-3, "step {t} seq {s} head {head} lse");
                for c in 0..d {
                    let want: f64 = (0..n).map(|j| (scores[j] - m).exp() / sum * vals[s][j][kh * d + c] as f64).sum();
                    let got = o[r * d + c] as f64;
                    assert!((got - want).abs() < 2e-2, "step {t} seq {s} head {head} dim {c}: {got} vs {want}");
                }
            }
        }
    }
    let (ro, rl) = reference::attention(&pp, &pq, &pk, &pv).unwrap();
    for (i, (od, ld)) in pouts.iter().enumerate() {
        assert_close(&format!("prefill {i}"), &read(&stream, od), &stream.clone_dtoh(ld).unwrap(), &ro, &rl);
    }
}
