//! The attention API (`memattn::attn`) on caller-owned buffers: in the VM, and through cudarc on
//! the VM-backed CUDA driver (`vm-cuda`'s `libvm_cuda.so`) with the caller's own context and
//! stream. Results are checked against the f64 reference; every refusal is checked by its error.

use cudarc::driver::{CudaContext, CudaStream};
use memattn::attn::{AttnError, AttnOpts, Kernels, LseViewMut, TensorView, TensorViewMut};
use memattn::{reference, Dtype, Problem};
use std::path::PathBuf;
use std::sync::Arc;

/// Deterministic inputs in [-1, 1), rounded to `dtype`.
fn data(n: usize, seed: u64, dtype: Dtype) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut x: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    dtype.round_all(&mut x);
    x
}

struct Case {
    b: usize,
    h: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dtype: Dtype,
    causal: bool,
    scale: f32,
}

impl Case {
    fn problem(&self) -> Problem {
        Problem {
            batch: self.b as u32,
            heads: self.h as u32,
            seq_q: self.sq as u32,
            seq_kv: self.skv as u32,
            head_dim: self.d as u32,
            causal: self.causal,
            scale: Some(self.scale),
            ..Problem::default()
        }
    }
    fn inputs(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (nq, nk) = (self.b * self.sq * self.h * self.d, self.b * self.skv * self.h * self.d);
        (data(nq, 1, self.dtype), data(nk, 2, self.dtype), data(nk, 3, self.dtype))
    }
    fn opts(&self) -> AttnOpts {
        AttnOpts::new().causal(self.causal).softmax_scale(self.scale)
    }
}

/// Asserts O and LSE against the f64 reference (O in BSHD order; LSE `[b, h, sq]`).
fn check(c: &Case, q: &[f32], k: &[f32], v: &[f32], o: &[f32], lse: &[f32]) {
    let (ro, rl) = reference::attention(&c.problem(), q, k, v).unwrap();
    let tol = if c.dtype == Dtype::F32 { 2e-5 } else { 1.6e-2 };
    assert_eq!(o.len(), ro.len());
    for (i, (&g, &r)) in o.iter().zip(&ro).enumerate() {
        assert!((g as f64 - r).abs() <= tol, "o[{i}] = {g}, reference {r}");
    }
    let mut masked = 0;
    for (i, (&g, &r)) in lse.iter().zip(&rl).enumerate() {
        if r == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "lse[{i}]");
            masked += 1;
        } else {
            assert!((g as f64 - r).abs() <= 1e-4 * r.abs().max(1.0), "lse[{i}] = {g}, reference {r}");
        }
    }
    if c.causal && c.sq > c.skv {
        assert!(masked > 0, "a causal case with seq_q > seq_kv has rows that see no key");
    }
}

#[test]
fn vm_f32_causal_into_caller_buffers_matches_the_reference() {
    // seq_q > seq_kv: rows that see nothing; lengths off the 16-row / 32-key tiles.
    let c = Case { b: 2, h: 2, sq: 37, skv: 29, d: 64, dtype: Dtype::F32, causal: true, scale: 0.3 };
    let kernels = Kernels::vm().unwrap();
    let (q, k, v) = c.inputs();
    let (qb, kb, vb) = (kernels.vm_upload(&q).unwrap(), kernels.vm_upload(&k).unwrap(), kernels.vm_upload(&v).unwrap());
    let ob = kernels.vm_upload(&vec![f32::NAN; q.len()]).unwrap();
    let lb = kernels.vm_upload(&vec![f32::NAN; c.b * c.h * c.sq]).unwrap();
    let (qs, ks) = ([c.b, c.sq, c.h, c.d], [c.b, c.skv, c.h, c.d]);
    kernels
        .flash_attn_into(
            &TensorView::vm(&qb, Dtype::F32, qs).unwrap(),
            &TensorView::vm(&kb, Dtype::F32, ks).unwrap(),
            &TensorView::vm(&vb, Dtype::F32, ks).unwrap(),
            &mut TensorViewMut::vm(&ob, Dtype::F32, qs).unwrap(),
            &mut LseViewMut::vm(&lb, c.b, c.h, c.sq).unwrap(),
            &c.opts(),
        )
        .unwrap();
    let o = ob.read_f32(Dtype::F32, q.len()).unwrap();
    let lse = lb.read_f32(Dtype::F32, c.b * c.h * c.sq).unwrap();
    check(&c, &q, &k, &v, &o, &lse);
}

/// BSHD host data transposed to BHSD.
fn to_bhsd(x: &[f32], b: usize, s: usize, h: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let src = ((bi * s + si) * h + hi) * d;
                let dst = ((bi * h + hi) * s + si) * d;
                out[dst..dst + d].copy_from_slice(&x[src..src + d]);
            }
        }
    }
    out
}

#[test]
fn vm_bf16_bhsd_strided_views_allocating_call_match_the_reference() {
    let c = Case { b: 1, h: 3, sq: 20, skv: 45, d: 64, dtype: Dtype::Bf16, causal: false, scale: 0.125 };
    let kernels = Kernels::vm().unwrap();
    let (q, k, v) = c.inputs();
    let up = |x: &[f32], s| kernels.vm_upload_as(Dtype::Bf16, &to_bhsd(x, c.b, s, c.h, c.d)).unwrap();
    let (qb, kb, vb) = (up(&q, c.sq), up(&k, c.skv), up(&v, c.skv));
    let bhsd = |s: usize| [c.h * s * c.d, c.d, s * c.d, 1];
    let view = |buf, s: usize| TensorView::vm(buf, Dtype::Bf16, [c.b, s, c.h, c.d]).unwrap().with_strides(bhsd(s));
    let (o, lse) = kernels.flash_attn(&view(&qb, c.sq), &view(&kb, c.skv), &view(&vb, c.skv), &c.opts()).unwrap();
    assert_eq!((o.dtype(), o.shape(), lse.shape()), (Dtype::Bf16, [1, 20, 3, 64], [1, 3, 20, 1]));
    check(&c, &q, &k, &v, &o.to_vec_f32().unwrap(), &lse.to_vec_f32().unwrap());
}

fn err_of(r: Result<(), AttnError>) -> (AttnError, String) {
    let e = r.expect_err("the call must be refused");
    let s = e.to_string();
    (e, s)
}

#[test]
fn vm_bad_inputs_are_refused_before_launch_with_the_limit_named() {
    let kernels = Kernels::vm().unwrap();
    let other = Kernels::vm().unwrap();
    let (b, s, h, d) = (1, 8, 2, 64);
    let n = b * s * h * d;
    let f = kernels.vm_upload(&data(n, 4, Dtype::F32)).unwrap();
    let f2 = kernels.vm_upload(&data(n, 5, Dtype::F32)).unwrap();
    let bf = kernels.vm_upload_as(Dtype::Bf16, &data(n + 64, 6, Dtype::Bf16)).unwrap();
    let out = kernels.vm_alloc((n * 4) as u64).unwrap();
    let foreign = other.vm_upload(&data(n, 7, Dtype::F32)).unwrap();
    let shape = [b, s, h, d];
    let t = |buf| TensorView::vm(buf, Dtype::F32, shape).unwrap();
    let lse_buf = kernels.vm_alloc(4 * 64).unwrap();
    let run = |q: TensorView, k: TensorView, v: TensorView, opts: AttnOpts| {
        let mut o = TensorViewMut::vm(&out, q.dtype(), q.shape()).unwrap();
        let [b, s, h, _] = q.shape();
        let mut lse = LseViewMut::vm(&lse_buf, b, h, s).unwrap();
        kernels.flash_attn_into(&q, &k, &v, &mut o, &mut lse, &opts)
    };
    let ok = run(t(&f), t(&f2), t(&f2), AttnOpts::new());
    assert!(ok.is_ok(), "{ok:?}");

    let (e, m) = err_of(run(t(&f), TensorView::vm(&bf, Dtype::Bf16, shape).unwrap(), t(&f2), AttnOpts::new()));
    assert!(matches!(e, AttnError::Dtype { tensor: "k", .. }) && m.contains("bf16"), "{m}");
    let (e, m) = err_of(run(t(&f), TensorView::vm(&f2, Dtype::F32, [2, 4, h, d]).unwrap(), t(&f2), AttnOpts::new()));
    assert!(matches!(e, AttnError::Shape { tensor: "k", .. }) && m.contains("batch 2 != q's batch 1"), "{m}");
    let (e, m) =
        err_of(run(t(&f), TensorView::vm(&f2, Dtype::F32, [b, s, 1, 2 * d]).unwrap(), t(&f2), AttnOpts::new()));
    assert!(matches!(e, AttnError::Shape { tensor: "k", .. }) && m.contains("head_dim 128"), "{m}");
    let (e, m) = err_of(run(t(&f), t(&f2), TensorView::vm(&f2, Dtype::F32, [b, 4, h, d]).unwrap(), AttnOpts::new()));
    assert!(matches!(e, AttnError::Shape { tensor: "v", .. }) && m.contains("seq_kv 4"), "{m}");
    // Grouped-query attention, windows, softcap and splits are not in the kernels yet.
    let gqa = TensorView::vm(&f2, Dtype::F32, [b, s, 1, d]).unwrap();
    let (e, _) = err_of(run(t(&f), gqa, TensorView::vm(&f2, Dtype::F32, [b, s, 1, d]).unwrap(), AttnOpts::new()));
    assert!(matches!(e, AttnError::NotSupportedYet { feature } if feature.contains("grouped-query")), "{e}");
    for (opts, what) in [
        (AttnOpts::new().window(Some(4), Some(0)), "window"),
        (AttnOpts::new().softcap(30.0), "softcap"),
        (AttnOpts::new().num_splits(4), "split-KV"),
    ] {
        let (e, m) = err_of(run(t(&f), t(&f2), t(&f2), opts));
        assert!(matches!(e, AttnError::NotSupportedYet { .. }) && m.contains(what), "{m}");
    }
    // One split is what the kernels do: accepted.
    assert!(run(t(&f), t(&f2), t(&f2), AttnOpts::new().num_splits(1)).is_ok());
    let (e, m) = err_of(run(t(&f), t(&f2).with_strides([n, h * d, d, 2]), t(&f2), AttnOpts::new()));
    assert!(matches!(e, AttnError::InnerStride { tensor: "k", stride: 2 }), "{m}");
    // A view past the end of its buffer (seq stride doubled).
    let (e, m) = err_of(run(t(&f), t(&f2).with_strides([n, 2 * h * d, d, 1]), t(&f2), AttnOpts::new()));
    assert!(
        matches!(e, AttnError::OutOfBounds { tensor: "k", .. }) && m.contains(&format!("has {} bytes", n * 4)),
        "{m}"
    );
    let (e, m) = err_of(run(t(&f), t(&f2).offset(1).unwrap(), t(&f2), AttnOpts::new()));
    assert!(matches!(e, AttnError::OutOfBounds { tensor: "k", .. }), "{m}");
    // A buffer of another VM instance.
    let (e, m) = err_of(run(t(&f), t(&foreign), t(&f2), AttnOpts::new()));
    assert!(matches!(e, AttnError::WrongDevice { tensor: "k", .. }) && m.contains("VM instance"), "{m}");
    // Head dim 48 has no flash kernel: the error says which exist.
    let d96 = |buf| TensorView::vm(buf, Dtype::F32, [1, 8, 2, 48]).unwrap();
    let (_, m) = err_of(run(d96(&f), d96(&f2), d96(&f2), AttnOpts::new()));
    assert!(m.contains("head_dim 48") && m.contains("32, 64, 96, 128, 192 and 256"), "{m}");
    let (_, m) = err_of(run(t(&f), t(&f2), t(&f2), AttnOpts::new().softmax_scale(f32::INFINITY)));
    assert!(m.contains("finite"), "{m}");
    // Tensor-core kernels: base pointers 16-byte aligned, strides multiples of 8 elements.
    let bt = |off: usize| TensorView::vm(&bf, Dtype::Bf16, shape).unwrap().offset(off).unwrap();
    let (e, m) = err_of(run(bt(0), bt(4), bt(0), AttnOpts::new()));
    assert!(
        matches!(e, AttnError::Misaligned { tensor: "k", what: "the base pointer", .. })
            && m.contains("flash_fwd_bf16_d64"),
        "{m}"
    );
    let (e, m) = err_of(run(bt(0), bt(0).with_strides([n, h * d + 4, d, 1]), bt(0), AttnOpts::new()));
    assert!(matches!(e, AttnError::Misaligned { tensor: "k", what: "the seq stride", .. }), "{m}");
    // LSE must be [b, h, seq_q].
    let lb = kernels.vm_alloc(4 * 64).unwrap();
    let mut lse = LseViewMut::vm(&lb, b, h, s + 1).unwrap();
    let mut o = TensorViewMut::vm(&out, Dtype::F32, shape).unwrap();
    let r = kernels.flash_attn_into(&t(&f), &t(&f2), &t(&f2), &mut o, &mut lse, &AttnOpts::new());
    let (e, m) = err_of(r);
    assert!(matches!(e, AttnError::Shape { tensor: "lse", .. }) && m.contains("[1, 2, 8]"), "{m}");
}

/// `libvm_cuda.so`, which cargo builds next to this test (a dev-dependency of memattn).
fn vm_cuda() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps, deps.parent().unwrap()]
        .iter()
        .map(|d| d.join("libvm_cuda.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("libvm_cuda.so is not next to {}", exe.display()))
}

/// The caller's own context and a stream of its own, on the VM-backed driver.
fn cuda() -> (Arc<CudaContext>, Arc<CudaStream>) {
    memattn::device::cuda::use_driver_library(&vm_cuda()).unwrap();
    memattn::device::cuda::probe().unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    (ctx, stream)
}

#[test]
fn cuda_path_on_the_callers_stream_equals_the_vm_bit_for_bit() {
    let c = Case { b: 1, h: 2, sq: 33, skv: 50, d: 64, dtype: Dtype::F32, causal: true, scale: 0.2 };
    let (q, k, v) = c.inputs();
    let (ctx, stream) = cuda();
    let kernels = Kernels::cuda(&ctx).unwrap();
    let (qd, kd, vd) = (stream.clone_htod(&q).unwrap(), stream.clone_htod(&k).unwrap(), stream.clone_htod(&v).unwrap());
    let mut od = stream.clone_htod(&vec![f32::NAN; q.len()]).unwrap();
    let mut ld = stream.clone_htod(&vec![f32::NAN; c.b * c.h * c.sq]).unwrap();
    let (qs, ks) = ([c.b, c.sq, c.h, c.d], [c.b, c.skv, c.h, c.d]);
    {
        let mut o = TensorViewMut::cuda(&mut od, &stream, qs).unwrap();
        let mut lse = LseViewMut::cuda(&mut ld, &stream, c.b, c.h, c.sq).unwrap();
        kernels
            .flash_attn_into(
                &TensorView::cuda(&qd, &stream, qs).unwrap(),
                &TensorView::cuda(&kd, &stream, ks).unwrap(),
                &TensorView::cuda(&vd, &stream, ks).unwrap(),
                &mut o,
                &mut lse,
                &c.opts(),
            )
            .unwrap();
    }
    let o: Vec<f32> = stream.clone_dtoh(&od).unwrap();
    let lse: Vec<f32> = stream.clone_dtoh(&ld).unwrap();
    check(&c, &q, &k, &v, &o, &lse);

    // The same problem in the VM: the same PTX, the same bits.
    let vm = Kernels::vm().unwrap();
    let (qb, kb, vb) = (vm.vm_upload(&q).unwrap(), vm.vm_upload(&k).unwrap(), vm.vm_upload(&v).unwrap());
    let t = |b, s| TensorView::vm(b, Dtype::F32, s).unwrap();
    let (vo, vl) = vm.flash_attn(&t(&qb, qs), &t(&kb, ks), &t(&vb, ks), &c.opts()).unwrap();
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&o), bits(&vo.to_vec_f32().unwrap()));
    assert_eq!(bits(&lse), bits(&vl.to_vec_f32().unwrap()));

    // The allocating call on CUDA allocates on q's stream.
    let (ao, al) = kernels
        .flash_attn(
            &TensorView::cuda(&qd, &stream, qs).unwrap(),
            &TensorView::cuda(&kd, &stream, ks).unwrap(),
            &TensorView::cuda(&vd, &stream, ks).unwrap(),
            &c.opts(),
        )
        .unwrap();
    assert!(ao.as_cuda().is_some() && ao.as_vm().is_none());
    assert_eq!(bits(&o), bits(&ao.to_vec_f32().unwrap()));
    assert_eq!(bits(&lse), bits(&al.to_vec_f32().unwrap()));

    // Refusals: views for another stream, and VM buffers given to CUDA kernels.
    let other = ctx.new_stream().unwrap();
    let r = kernels.flash_attn(
        &TensorView::cuda(&qd, &stream, qs).unwrap(),
        &TensorView::cuda(&kd, &other, ks).unwrap(),
        &TensorView::cuda(&vd, &stream, ks).unwrap(),
        &c.opts(),
    );
    assert!(matches!(r, Err(AttnError::StreamMismatch { tensor: "k", .. })), "{:?}", r.err());
    let r = kernels.flash_attn(&t(&qb, qs), &t(&kb, ks), &t(&vb, ks), &c.opts());
    let e = r.err().expect("VM buffers on CUDA kernels are refused");
    assert!(matches!(e, AttnError::WrongDevice { tensor: "q", .. }) && e.to_string().contains("CUDA context"), "{e}");
    let r = vm.flash_attn(&TensorView::cuda(&qd, &stream, qs).unwrap(), &t(&kb, ks), &t(&vb, ks), &c.opts());
    assert!(matches!(r, Err(AttnError::WrongDevice { tensor: "q", .. })), "{:?}", r.err());
}
