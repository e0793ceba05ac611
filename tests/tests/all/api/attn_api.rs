//! The attention API (`memattn::attn`) on caller-owned buffers: in the VM, and through cudarc on
//! the VM-backed CUDA driver (`vm-cuda`'s `libvm_cuda.so`) with the caller's own context and
//! stream. Results are checked against the f64 reference; every refusal is checked by its error.

use crate::common;
use common::{data, flash_into, vm_cuda};
use cudarc::driver::{CudaContext, CudaStream};
use memattn::attn::{AttnError, AttnOpts, Kernels, LseViewMut, PartialsView, SinksView, TensorView, TensorViewMut};
use memattn::{reference, Dtype, Problem};
use std::sync::Arc;

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
    fn opts(&self) -> AttnOpts<'static> {
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
    // Split-KV is a decode option: the prefill call refuses it.
    let (e, m) = err_of(run(t(&f), t(&f2), t(&f2), AttnOpts::new().num_splits(4)));
    assert!(matches!(e, AttnError::NotSupportedYet { .. }) && m.contains("split-KV"), "{m}");
    // k/v heads must divide q's, and k and v share a head count.
    let (e, m) = err_of(run(
        TensorView::vm(&f, Dtype::F32, [1, 4, 4, 64]).unwrap(),
        TensorView::vm(&f2, Dtype::F32, [1, 8, 3, 64]).unwrap(),
        TensorView::vm(&f2, Dtype::F32, [1, 8, 3, 64]).unwrap(),
        AttnOpts::new(),
    ));
    assert!(
        matches!(e, AttnError::Shape { tensor: "k", .. }) && m.contains("3 heads do not divide q's 4 heads"),
        "{m}"
    );
    let (e, m) = err_of(run(
        TensorView::vm(&f, Dtype::F32, [1, 4, 4, 64]).unwrap(),
        TensorView::vm(&f2, Dtype::F32, [1, 8, 2, 64]).unwrap(),
        TensorView::vm(&f2, Dtype::F32, [1, 4, 4, 64]).unwrap(),
        AttnOpts::new(),
    ));
    assert!(matches!(e, AttnError::Shape { tensor: "v", .. }) && m.contains("4 heads != k's 2"), "{m}");
    // A window side the kernels' i32 cannot hold; a negative or NaN soft cap.
    let (e, m) = err_of(run(t(&f), t(&f2), t(&f2), AttnOpts::new().window(Some(1 << 31), None)));
    assert!(matches!(e, AttnError::Window { side: "left", got: 2147483648 }) && m.contains("i32::MAX"), "{m}");
    for c in [-1.0, f32::NAN] {
        let (e, m) = err_of(run(t(&f), t(&f2), t(&f2), AttnOpts::new().softcap(c)));
        assert!(matches!(e, AttnError::Problem(_)) && m.contains("softcap"), "{m}");
    }
    // Sinks: one f32 per q head, on the kernels' device.
    let sinks3 = SinksView::vm(&f2, 3).unwrap();
    let (e, m) = err_of(run(t(&f), t(&f2), t(&f2), AttnOpts::new().sinks(&sinks3)));
    assert!(matches!(e, AttnError::Sinks { .. }) && m.contains("3 sink logits for q's 2 heads"), "{m}");
    let foreign_sinks = SinksView::vm(&foreign, h).unwrap();
    let (e, _) = err_of(run(t(&f), t(&f2), t(&f2), AttnOpts::new().sinks(&foreign_sinks)));
    assert!(matches!(e, AttnError::WrongDevice { tensor: "sinks", .. }), "{e}");
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
    // A head dim that is not a multiple of 8 has no flash kernel (48 would run on the d64 one,
    // padded): the error says which exist and the rule.
    let d52 = |buf| TensorView::vm(buf, Dtype::F32, [1, 8, 2, 52]).unwrap();
    let (_, m) = err_of(run(d52(&f), d52(&f2), d52(&f2), AttnOpts::new()));
    assert!(m.contains("head_dim 52") && m.contains("32, 64, 96, 128, 192 and 256"), "{m}");
    assert!(m.contains("any other multiple of 8 up to 256"), "{m}");
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

/// O and LSE of `p` (BSHD or packed; LSE `[b, h, sq]` or varlen `[h, total_q]`) against the f64
/// reference with every option, and the count of rows that see no key (LSE `-inf`, or the sink).
fn check_full(p: &Problem, x: (&[f32], &[f32], &[f32]), sinks: &[f32], o: &[f32], lse: &[f32]) -> usize {
    let (ro, rl) = reference::attention_with_sinks(p, x.0, x.1, x.2, sinks).unwrap();
    let tol = if p.dtype == Dtype::F32 { 2e-5 } else { 1.6e-2 };
    assert_eq!((o.len(), lse.len()), (ro.len(), rl.len()));
    for (i, (&g, &r)) in o.iter().zip(&ro).enumerate() {
        assert!((g as f64 - r).abs() <= tol, "o[{i}] = {g}, reference {r} ({p:?})");
    }
    let mut empty = 0;
    for (i, (&g, &r)) in lse.iter().zip(&rl).enumerate() {
        if r == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "lse[{i}]");
            empty += 1;
        } else {
            assert!((g as f64 - r).abs() <= 1e-4 * r.abs().max(1.0), "lse[{i}] = {g}, reference {r} ({p:?})");
        }
    }
    if p.sinks {
        // With sinks no row is -inf: the rows that see no key have LSE = sink[h] and O = 0.
        let h = p.heads as usize;
        let rows = p.rows() as usize;
        for (n, &r) in rl.iter().enumerate() {
            let hh = if p.varlen.is_some() { n / (rows / h) } else { (n / p.seq_q as usize) % h };
            if (r - sinks[hh] as f64).abs() < 1e-12 {
                empty += 1;
            }
        }
    }
    empty
}

/// GQA, windows, soft cap and sinks through `flash_attn_into` with poisoned outputs, checked
/// against the f64 reference. Lengths off the tiles, seq_q != seq_kv, rows that see no key.
#[test]
fn vm_gqa_window_softcap_sinks_match_the_reference() {
    let kernels = Kernels::vm().unwrap();
    let base = Problem { batch: 1, heads: 4, head_dim: 64, ..Problem::default() };
    // (problem, window as AttnOpts takes it)
    let cases = [
        // GQA 4/2, a window on both sides, soft cap; seq_q > seq_kv: rows 0..=5 see no key.
        Problem { seq_q: 27, seq_kv: 19, heads_kv: Some(2), window: (5, 2), softcap: 3.0, ..base },
        // MQA, causal with a left window, sinks, batch 2, seq_q < seq_kv.
        Problem {
            batch: 2,
            seq_q: 19,
            seq_kv: 27,
            heads_kv: Some(1),
            window: (4, -1),
            causal: true,
            sinks: true,
            ..base
        },
        // bf16 (the narrow-window tensor-core kernel), GQA, causal + window, soft cap and sinks;
        // seq_q > seq_kv: the first rows see nothing and get LSE = sink.
        Problem {
            seq_q: 70,
            seq_kv: 45,
            heads_kv: Some(2),
            window: (7, -1),
            causal: true,
            softcap: 20.0,
            sinks: true,
            dtype: Dtype::Bf16,
            ..base
        },
    ];
    for p in cases {
        let (dt, h, hk, d) = (p.dtype, p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
        let (b, sq, skv) = (p.batch as usize, p.seq_q as usize, p.seq_kv as usize);
        let (q, k, v) = (data(b * sq * h * d, 11, dt), data(b * skv * hk * d, 12, dt), data(b * skv * hk * d, 13, dt));
        let sinks: Vec<f32> = if p.sinks { (0..h).map(|i| 0.5 * i as f32 - 0.7).collect() } else { vec![] };
        let sb = kernels.vm_upload(&[sinks.clone(), vec![0.0]].concat()).unwrap();
        let sv = SinksView::vm(&sb, h).unwrap();
        let side = |w: i32| u32::try_from(w).ok();
        let mut opts = AttnOpts::new().causal(p.causal).window(side(p.window.0), side(p.window.1));
        if p.softcap > 0.0 {
            opts = opts.softcap(p.softcap);
        }
        if p.sinks {
            opts = opts.sinks(&sv);
        }
        let (o, lse) = flash_into(&kernels, &p, (&q, &k, &v), &opts);
        let empty = check_full(&p, (&q, &k, &v), &sinks, &o, &lse);
        if p.seq_q > p.seq_kv {
            assert!(empty > 0, "rows that see no key are part of the case: {p:?}");
        }
    }
}

/// Packed sequences (one empty), GQA and causal per sequence, f32 and bf16, against the f64
/// reference; cu_seqlens refusals by variant.
#[test]
fn vm_varlen_matches_the_reference_and_checks_cu_seqlens() {
    let kernels = Kernels::vm().unwrap();
    let (lq, lk) = ([5u32, 0, 17, 33], [9u32, 3, 17, 20]);
    let cu = |l: &[u32]| memattn::problem::Varlen::cu(l);
    let (cuq, cuk) = (kernels.index_tensor(&cu(&lq), None).unwrap(), kernels.index_tensor(&cu(&lk), None).unwrap());
    for (dt, window) in [(Dtype::F32, (-1, -1)), (Dtype::Bf16, (6, -1))] {
        let base = Problem {
            heads: 4,
            heads_kv: Some(2),
            head_dim: 64,
            causal: true,
            window,
            dtype: dt,
            ..Problem::default()
        };
        let p = Problem::varlen(base, &lq, &lk).unwrap();
        let (h, hk, d) = (4, 2, 64);
        let (tq, tk) = (p.total_q() as usize, p.total_kv() as usize);
        let (q, k, v) = (data(tq * h * d, 21, dt), data(tk * hk * d, 22, dt), data(tk * hk * d, 23, dt));
        let up = |x: &[f32]| kernels.vm_upload_as(dt, x).unwrap();
        let (qb, kb, vb) = (up(&q), up(&k), up(&v));
        let ob = kernels.vm_upload_as(dt, &vec![f32::NAN; q.len()]).unwrap();
        let lb = kernels.vm_upload(&vec![f32::NAN; h * tq]).unwrap();
        let opts = AttnOpts::new().causal(true).window_size(window.0, window.1);
        let (qt, kt, vt) = (
            TensorView::vm(&qb, dt, [1, tq, h, d]).unwrap(),
            TensorView::vm(&kb, dt, [1, tk, hk, d]).unwrap(),
            TensorView::vm(&vb, dt, [1, tk, hk, d]).unwrap(),
        );
        kernels
            .flash_attn_varlen_into(
                &qt,
                &kt,
                &vt,
                &cuq,
                &cuk,
                33,
                20,
                &mut TensorViewMut::vm(&ob, dt, [1, tq, h, d]).unwrap(),
                &mut LseViewMut::vm(&lb, 1, h, tq).unwrap(),
                &opts,
            )
            .unwrap();
        let o = ob.read_f32(dt, q.len()).unwrap();
        let lse = lb.read_f32(Dtype::F32, h * tq).unwrap();
        // Sequence 3 (33 queries, 20 keys, causal) has 13 rows per head that see no key.
        assert!(check_full(&p, (&q, &k, &v), &[], &o, &lse) >= 13 * 4);
        if dt == Dtype::Bf16 {
            continue;
        }
        // Refusals, each before launch.
        let run = |cq: &memattn::attn::IndexTensor, ck: &memattn::attn::IndexTensor, mq: usize, mk: usize| {
            kernels.flash_attn_varlen(&qt, &kt, &vt, cq, ck, mq, mk, &opts).map(|_| ()).unwrap_err()
        };
        let it = |x: &[u32]| kernels.index_tensor(x, None).unwrap();
        for (cq, ck, mq, mk, tensor, want) in [
            (it(&[1, 5, 5, 22, 55]), it(&cu(&lk)), 33, 20, "cu_seqlens_q", "must start at 0"),
            (it(&[0, 5, 4, 22, 55]), it(&cu(&lk)), 33, 20, "cu_seqlens_q", "non-decreasing"),
            (it(&[0, 5, 5, 22, 54]), it(&cu(&lk)), 33, 20, "cu_seqlens_q", "last prefix sum is 54, but q has 55"),
            (it(&cu(&lq)), it(&[0, 49]), 33, 49, "cu_seqlens_k", "cu_seqlens_q has 5"),
            (it(&cu(&lq)), it(&cu(&lk)), 32, 20, "cu_seqlens_q", "33 rows, over max_seqlen_q = 32"),
            (it(&cu(&lq)), it(&cu(&lk)), 33, 19, "cu_seqlens_k", "20 rows, over max_seqlen_k = 19"),
            (it(&[0]), it(&[0]), 33, 20, "cu_seqlens_q", "batch + 1 >= 2"),
        ] {
            let e = run(&cq, &ck, mq, mk);
            let m = e.to_string();
            assert!(matches!(e, AttnError::SeqLens { tensor: t, .. } if t == tensor) && m.contains(want), "{m}");
        }
        let other = Kernels::vm().unwrap();
        let foreign = other.index_tensor(&cu(&lq), None).unwrap();
        let e = run(&foreign, &cuk, 33, 20);
        assert!(matches!(e, AttnError::WrongDevice { tensor: "cu_seqlens_q", .. }), "{e}");
        let e = kernels.flash_attn_varlen(
            &qt,
            &kt,
            &TensorView::vm(&vb, dt, [1, tk - 1, hk, d]).unwrap(),
            &cuq,
            &cuk,
            33,
            20,
            &opts,
        );
        let m = e.map(|_| ()).unwrap_err().to_string();
        assert!(m.contains("total_kv 48 != k's total_kv 49"), "{m}");
    }
}

#[test]
fn vm_kvcache_paged_gqa_append_and_splits_match_the_reference() {
    use memattn::decode::{DecodeProblem, Splits};
    let kernels = Kernels::vm().unwrap();
    // Paged (7-key pages, shuffled), GQA 8/2, 3 sequences (one empty before the append),
    // 2 new tokens each, 2 queries (speculative), causal, 3 splits, per-head sinks (counted
    // once however many splits there are).
    let p = DecodeProblem {
        batch: 3,
        heads: 8,
        heads_kv: 2,
        seq_q: 2,
        cache_seqlens: vec![13, 0, 29],
        seq_new: 2,
        page_size: Some(7),
        splits: Splits::Fixed(3),
        sinks: true,
        ..DecodeProblem::default()
    };
    // With the indices on the host, then on the device (SIMT decode and the merge either way).
    for on_device in [false, true] {
        let l = common::kvcache_case(&kernels, &p, 5, on_device);
        assert!(l.iter().any(|k| k.starts_with("decode_fwd_f32")) && l.iter().any(|k| k.starts_with("merge_states")));
    }
    // bf16, contiguous, a left window with causal, soft cap, the automatic split count.
    let p = DecodeProblem {
        batch: 2,
        heads: 4,
        heads_kv: 1,
        cache_seqlens: vec![40, 17],
        dtype: Dtype::Bf16,
        window_left: 5,
        softcap: 4.0,
        ..DecodeProblem::default()
    };
    common::kvcache_case(&kernels, &p, 5, false);
}

#[test]
fn vm_merge_states_on_caller_buffers_matches_the_reference() {
    use memattn::decode::{merge_states_reference, Partials};
    let kernels = Kernels::vm().unwrap();
    let (splits, b, sq, h, d) = (3usize, 2usize, 3usize, 2usize, 64usize);
    let rows = b * h * sq;
    let o_part = data(splits * rows * d, 31, Dtype::F32);
    let mut lse_part: Vec<f32> = data(splits * rows, 32, Dtype::F32).iter().map(|x| 4.0 * x).collect();
    lse_part[rows + 1] = f32::NEG_INFINITY; // a split that saw no key
    for s in 0..splits {
        lse_part[s * rows + 4] = f32::NEG_INFINITY; // a row no split saw
    }
    let x = Partials {
        splits: splits as u32,
        batch: b as u32,
        heads: h as u32,
        seq_q: sq as u32,
        head_dim: d as u32,
        o: o_part.clone(),
        lse: lse_part.clone(),
    };
    let (ro, rl) = merge_states_reference(&x);
    let (op, lp) = (kernels.vm_upload(&o_part).unwrap(), kernels.vm_upload(&lse_part).unwrap());
    // o in BHSD strides: the combine writes any seq/head strides.
    let ob = kernels.vm_upload(&vec![f32::NAN; b * sq * h * d]).unwrap();
    let lb = kernels.vm_upload(&vec![f32::NAN; rows]).unwrap();
    let bhsd = [h * sq * d, d, sq * d, 1];
    kernels
        .merge_states_into(
            &PartialsView::vm(&op, &lp, splits, [b, sq, h, d]).unwrap(),
            &mut TensorViewMut::vm(&ob, Dtype::F32, [b, sq, h, d]).unwrap().with_strides(bhsd),
            &mut LseViewMut::vm(&lb, b, h, sq).unwrap(),
        )
        .unwrap();
    let o = ob.read_f32(Dtype::F32, b * sq * h * d).unwrap();
    let lse = lb.read_f32(Dtype::F32, rows).unwrap();
    for bi in 0..b {
        for i in 0..sq {
            for hh in 0..h {
                for c in 0..d {
                    let got = o[((bi * h + hh) * sq + i) * d + c] as f64;
                    let want = ro[((bi * sq + i) * h + hh) * d + c];
                    assert!((got - want).abs() < 1e-5, "o[{bi},{i},{hh},{c}] = {got}, reference {want}");
                }
            }
        }
    }
    for (r, (&g, &w)) in lse.iter().zip(&rl).enumerate() {
        if w == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "lse[{r}]");
        } else {
            assert!((g as f64 - w).abs() < 1e-5, "lse[{r}] = {g}, reference {w}");
        }
    }
    assert_eq!(lse[4], f32::NEG_INFINITY);
    // Refusals: f16 partials, an o of another shape.
    let e = kernels
        .merge_states_into(
            &PartialsView::vm(&op, &lp, splits, [b, sq, h, d]).unwrap(),
            &mut TensorViewMut::vm(&ob, Dtype::F32, [b, sq + 1, h, d]).unwrap(),
            &mut LseViewMut::vm(&lb, b, h, sq).unwrap(),
        )
        .unwrap_err();
    assert!(matches!(e, AttnError::Shape { tensor: "o", .. }), "{e}");
    let e = kernels
        .merge_states_into(
            &PartialsView::vm(&op, &lp, splits + 1, [b, sq, h, d]).unwrap(),
            &mut TensorViewMut::vm(&ob, Dtype::F32, [b, sq, h, d]).unwrap(),
            &mut LseViewMut::vm(&lb, b, h, sq).unwrap(),
        )
        .unwrap_err();
    assert!(matches!(e, AttnError::OutOfBounds { tensor: "o_part", .. }), "{e}");
}

#[test]
fn vm_kvcache_bad_inputs_are_refused_before_launch() {
    let kernels = Kernels::vm().unwrap();
    let (b, h, hk, d, page, pages) = (2usize, 4usize, 2usize, 64usize, 8usize, 4usize);
    let cache = kernels.vm_upload(&data(pages * page * hk * d, 41, Dtype::F32)).unwrap();
    let cache2 = kernels.vm_upload(&data(pages * page * hk * d, 42, Dtype::F32)).unwrap();
    let qb = kernels.vm_upload(&data(b * 2 * h * d, 43, Dtype::F32)).unwrap();
    let newb = kernels.vm_upload(&data(b * hk * d, 44, Dtype::F32)).unwrap();
    let it = |x: &[u32]| kernels.index_tensor(x, None).unwrap();
    let (lens, table) = (it(&[10, 3]), it(&[3, 1, 0, 2]));
    let cshape = [pages, page, hk, d];
    let call = |q: TensorView,
                lens: &memattn::attn::IndexTensor,
                table: Option<&memattn::attn::IndexTensor>,
                kn: Option<&TensorView>,
                vn: Option<&TensorView>,
                opts: AttnOpts| {
        let mut kc = TensorViewMut::vm(&cache, Dtype::F32, cshape).unwrap();
        let mut vc = TensorViewMut::vm(&cache2, Dtype::F32, cshape).unwrap();
        kernels.flash_attn_with_kvcache(&q, &mut kc, &mut vc, kn, vn, lens, table, &opts).map(|_| ()).unwrap_err()
    };
    let q = || TensorView::vm(&qb, Dtype::F32, [b, 1, h, d]).unwrap();
    let new = TensorView::vm(&newb, Dtype::F32, [b, 1, hk, d]).unwrap();
    // The valid call runs (checked for values in the test above).
    let mut kc = TensorViewMut::vm(&cache, Dtype::F32, cshape).unwrap();
    let mut vc = TensorViewMut::vm(&cache2, Dtype::F32, cshape).unwrap();
    assert!(kernels
        .flash_attn_with_kvcache(&q(), &mut kc, &mut vc, None, None, &lens, Some(&table), &AttnOpts::new())
        .is_ok());
    drop((kc, vc));
    let sinks_buf = kernels.vm_upload(&[0.0; 4]).unwrap();
    let sinks = SinksView::vm(&sinks_buf, h - 1).unwrap();
    for (e, want) in [
        (call(q(), &lens, Some(&table), None, None, AttnOpts::new().sinks(&sinks)), "3 sink logits for q's 4 heads"),
        (
            call(q(), &lens, Some(&table), None, None, AttnOpts::new().num_splits(129)),
            "num_splits 129 is over the limit of 128",
        ),
        (call(q(), &it(&[10]), Some(&table), None, None, AttnOpts::new()), "1 entries for q's batch of 2"),
        // 17 keys need 3 pages of 8; the table has 2 per sequence.
        (call(q(), &it(&[17, 3]), Some(&table), None, None, AttnOpts::new()), "needs 3 pages of 8"),
        (
            call(q(), &lens, Some(&it(&[3, 9, 0, 2])), None, None, AttnOpts::new()),
            "block_table[0][1] = 9 is past num_pages (4)",
        ),
        // Appending to a page two sequences share.
        (
            call(q(), &it(&[9, 9]), Some(&it(&[3, 1, 0, 1])), Some(&new), Some(&new), AttnOpts::new()),
            "receives appended tokens",
        ),
        (call(q(), &lens, Some(&table), Some(&new), None, AttnOpts::new()), "v_new is missing while k_new is given"),
        (
            call(
                TensorView::vm(&qb, Dtype::F32, [b, 1, 3, d]).unwrap(),
                &lens,
                Some(&table),
                None,
                None,
                AttnOpts::new(),
            ),
            "2 KV heads do not divide q's 3",
        ),
        (
            call(q().with_strides([2 * h * d, h * d, d, 1]), &lens, Some(&table), None, None, AttnOpts::new()),
            "contiguous",
        ),
        (call(q(), &lens, Some(&it(&[3, 1, 0])), None, None, AttnOpts::new()), "block_table has 3 entries"),
        (
            call(
                TensorView::vm(&qb, Dtype::F32, [b, 1, h, 2 * d]).unwrap(),
                &lens,
                Some(&table),
                None,
                None,
                AttnOpts::new(),
            ),
            "head_dim 64 != q's 128",
        ),
    ] {
        assert!(e.to_string().contains(want), "{e} (wanted: {want})");
    }
    // A contiguous cache shorter than cache_seqlens + new tokens.
    let mut kc = TensorViewMut::vm(&cache, Dtype::F32, [b, 10, hk, d]).unwrap();
    let mut vc = TensorViewMut::vm(&cache2, Dtype::F32, [b, 10, hk, d]).unwrap();
    let e = kernels
        .flash_attn_with_kvcache(&q(), &mut kc, &mut vc, Some(&new), Some(&new), &lens, None, &AttnOpts::new())
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(e, AttnError::KvCache { .. }) && e.to_string().contains("exceeds the cache's 10 keys"), "{e}");
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
    let e = r.expect_err("VM buffers on CUDA kernels are refused");
    assert!(matches!(e, AttnError::WrongDevice { tensor: "q", .. }) && e.to_string().contains("CUDA context"), "{e}");
    let r = vm.flash_attn(&TensorView::cuda(&qd, &stream, qs).unwrap(), &t(&kb, ks), &t(&vb, ks), &c.opts());
    assert!(matches!(r, Err(AttnError::WrongDevice { tensor: "q", .. })), "{:?}", r.err());
}

/// The KV-cache call through cudarc on the VM-backed driver (paged cache, append, GQA, 3
/// splits, index tensors and the split workspace on the caller's stream) against the f64
/// reference, and a varlen call bit for bit against the VM.
#[test]
fn cuda_kvcache_and_varlen_on_the_callers_stream() {
    use memattn::decode::{reference as decode_ref, verify_decode, CacheLayout, DecodeInputs, DecodeProblem, Splits};
    let (ctx, stream) = cuda();
    let kernels = Kernels::cuda(&ctx).unwrap();
    let p = DecodeProblem {
        batch: 2,
        heads: 4,
        heads_kv: 2,
        cache_seqlens: vec![11, 30],
        seq_new: 1,
        page_size: Some(8),
        splits: Splits::Fixed(3),
        ..DecodeProblem::default()
    };
    let x = DecodeInputs::random(&p, 9);
    let CacheLayout::Paged { page_size, num_pages, .. } = x.layout else { unreachable!("paged") };
    let (b, h, hk, d) = (2, 4, 2, 64);
    let cache_shape = [num_pages as usize, page_size as usize, hk, d];
    let (qd, knd, vnd) =
        (stream.clone_htod(&x.q).unwrap(), stream.clone_htod(&x.k_new).unwrap(), stream.clone_htod(&x.v_new).unwrap());
    let (mut kcd, mut vcd) = (stream.clone_htod(&x.k_cache).unwrap(), stream.clone_htod(&x.v_cache).unwrap());
    let seqlens = kernels.index_tensor(&p.cache_seqlens, Some(&stream)).unwrap();
    let table = kernels.index_tensor(&x.block_table, Some(&stream)).unwrap();
    let (o, lse) = kernels
        .flash_attn_with_kvcache(
            &TensorView::cuda(&qd, &stream, [b, 1, h, d]).unwrap(),
            &mut TensorViewMut::cuda(&mut kcd, &stream, cache_shape).unwrap(),
            &mut TensorViewMut::cuda(&mut vcd, &stream, cache_shape).unwrap(),
            Some(&TensorView::cuda(&knd, &stream, [b, 1, hk, d]).unwrap()),
            Some(&TensorView::cuda(&vnd, &stream, [b, 1, hk, d]).unwrap()),
            &seqlens,
            Some(&table),
            &AttnOpts::new().causal(true).num_splits(3),
        )
        .unwrap();
    let v = verify_decode(&p, &o.to_vec_f32().unwrap(), &lse.to_vec_f32().unwrap(), &decode_ref(&p, &x));
    assert!(v.passed, "{:?}", v.failures);
    let (ke, _) = x.appended(&p);
    let k_after: Vec<f32> = stream.clone_dtoh(&kcd).unwrap();
    assert!(k_after.iter().zip(&ke).all(|(a, e)| a.to_bits() == e.to_bits() || (a.is_nan() && e.is_nan())));
    // vLLM's joint layout through cudarc: one allocation [2, num_pages, page_size, heads_kv, d]
    // split into its k and v halves (`split_at_mut`); the same call, the same reference, and
    // both halves hold the appended caches.
    let half = x.k_cache.len();
    let mut joint = stream.clone_htod(&[&x.k_cache[..], &x.v_cache[..]].concat()).unwrap();
    {
        let (mut jk, mut jv) = joint.split_at_mut(half);
        let (o, lse) = kernels
            .flash_attn_with_kvcache(
                &TensorView::cuda(&qd, &stream, [b, 1, h, d]).unwrap(),
                &mut TensorViewMut::cuda(&mut jk, &stream, cache_shape).unwrap(),
                &mut TensorViewMut::cuda(&mut jv, &stream, cache_shape).unwrap(),
                Some(&TensorView::cuda(&knd, &stream, [b, 1, hk, d]).unwrap()),
                Some(&TensorView::cuda(&vnd, &stream, [b, 1, hk, d]).unwrap()),
                &seqlens,
                Some(&table),
                &AttnOpts::new().causal(true).num_splits(3),
            )
            .unwrap();
        let v = verify_decode(&p, &o.to_vec_f32().unwrap(), &lse.to_vec_f32().unwrap(), &decode_ref(&p, &x));
        assert!(v.passed, "joint: {:?}", v.failures);
    }
    let (ke, ve) = x.appended(&p);
    let after: Vec<f32> = stream.clone_dtoh(&joint).unwrap();
    let same = |got: &[f32], want: &[f32]| {
        got.iter().zip(want).all(|(a, e)| a.to_bits() == e.to_bits() || (a.is_nan() && e.is_nan()))
    };
    assert!(same(&after[..half], &ke) && same(&after[half..], &ve), "the joint allocation after the append");
    // An index tensor made for another stream is refused.
    let other = ctx.new_stream().unwrap();
    let foreign = kernels.index_tensor(&p.cache_seqlens, Some(&other)).unwrap();
    let e = kernels
        .flash_attn_with_kvcache(
            &TensorView::cuda(&qd, &stream, [b, 1, h, d]).unwrap(),
            &mut TensorViewMut::cuda(&mut kcd, &stream, cache_shape).unwrap(),
            &mut TensorViewMut::cuda(&mut vcd, &stream, cache_shape).unwrap(),
            None,
            None,
            &foreign,
            Some(&table),
            &AttnOpts::new(),
        )
        .unwrap_err();
    assert!(matches!(e, AttnError::StreamMismatch { tensor: "cache_seqlens", .. }), "{e}");

    // Varlen through cudarc equals the VM bit for bit.
    let (lq, lk) = ([3u32, 12], [7u32, 12]);
    let cu = |l: &[u32]| memattn::problem::Varlen::cu(l);
    let (tq, tk) = (15, 19);
    let (q, k) = (data(tq * h * d, 51, Dtype::F32), data(tk * hk * d, 52, Dtype::F32));
    let (qd, kd) = (stream.clone_htod(&q).unwrap(), stream.clone_htod(&k).unwrap());
    let (cq, ck) = (
        kernels.index_tensor(&cu(&lq), Some(&stream)).unwrap(),
        kernels.index_tensor(&cu(&lk), Some(&stream)).unwrap(),
    );
    let opts = AttnOpts::new().causal(true);
    let (o, lse) = kernels
        .flash_attn_varlen(
            &TensorView::cuda(&qd, &stream, [1, tq, h, d]).unwrap(),
            &TensorView::cuda(&kd, &stream, [1, tk, hk, d]).unwrap(),
            &TensorView::cuda(&kd, &stream, [1, tk, hk, d]).unwrap(),
            &cq,
            &ck,
            12,
            12,
            &opts,
        )
        .unwrap();
    let vm = Kernels::vm().unwrap();
    let (qb, kb) = (vm.vm_upload(&q).unwrap(), vm.vm_upload(&k).unwrap());
    let (vq, vk) = (vm.index_tensor(&cu(&lq), None).unwrap(), vm.index_tensor(&cu(&lk), None).unwrap());
    let kt = TensorView::vm(&kb, Dtype::F32, [1, tk, hk, d]).unwrap();
    let (vo, vl) = vm
        .flash_attn_varlen(&TensorView::vm(&qb, Dtype::F32, [1, tq, h, d]).unwrap(), &kt, &kt, &vq, &vk, 12, 12, &opts)
        .unwrap();
    let bits = |x: Vec<f32>| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(o.to_vec_f32().unwrap()), bits(vo.to_vec_f32().unwrap()));
    assert_eq!(bits(lse.to_vec_f32().unwrap()), bits(vl.to_vec_f32().unwrap()));
}

/// Plan once, run per layer (`plan_kvcache` / `run_kvcache`): three layers with their own caches,
/// queries and new tokens (paged, GQA, bf16 on the tensor-core decode kernel, 3 splits through
/// the plan's one workspace), each checked against the f64 reference, the appended caches bit for
/// bit, and the outputs equal bit for bit to the one-shot call on copies of the same inputs. A
/// run on another shape, or without the planned new tokens, is refused naming the tensor.
#[test]
fn vm_kvcache_plan_once_run_per_layer() {
    use memattn::decode::{reference as decode_ref, verify_decode, CacheLayout, DecodeInputs, DecodeProblem, Splits};
    let kernels = Kernels::vm().unwrap();
    let p = DecodeProblem {
        batch: 2,
        heads: 4,
        heads_kv: 2,
        head_dim: 64,
        cache_seqlens: vec![19, 5],
        seq_new: 1,
        page_size: Some(8),
        dtype: Dtype::Bf16,
        causal: true,
        splits: Splits::Fixed(3),
        ..DecodeProblem::default()
    };
    let dt = p.dtype;
    let (b, sq, h, hk, d) = (2usize, 1usize, 4usize, 2usize, 64usize);
    // Layer l: layer 0's inputs (so one block table) with other values, NaN rows kept NaN.
    let base = DecodeInputs::random(&p, 40);
    let layers: Vec<DecodeInputs> = (0..3)
        .map(|l| {
            let f = |v: &[f32], c: f32| -> Vec<f32> {
                v.iter().enumerate().map(|(i, x)| dt.round(x * c + ((i * 7 + l * 3) % 5) as f32 * 0.01)).collect()
            };
            let c = 1.0 - 0.6 * l as f32;
            DecodeInputs {
                q: f(&base.q, c),
                k_cache: f(&base.k_cache, -c),
                v_cache: f(&base.v_cache, c),
                k_new: f(&base.k_new, c),
                v_new: f(&base.v_new, -c),
                ..base.clone()
            }
        })
        .collect();
    let CacheLayout::Paged { page_size, num_pages, .. } = layers[0].layout else { panic!("paged") };
    let cache_shape = [num_pages as usize, page_size as usize, hk, d];
    let seqlens = kernels.index_tensor(&p.cache_seqlens, None).unwrap();
    let table = kernels.index_tensor(&layers[0].block_table, None).unwrap();
    let up = |v: &[f32]| kernels.vm_upload_as(dt, v).unwrap();
    let bufs: Vec<_> =
        layers.iter().map(|x| (up(&x.q), up(&x.k_cache), up(&x.v_cache), up(&x.k_new), up(&x.v_new))).collect();
    let ob = kernels.vm_upload_as(dt, &vec![f32::NAN; b * sq * h * d]).unwrap();
    let lb = kernels.vm_upload(&vec![f32::NAN; b * h * sq]).unwrap();
    let opts = AttnOpts::new().causal(true).num_splits(3);
    let ns = [b, 1, hk, d];
    let (q0, k0, v0) = (
        TensorView::vm(&bufs[0].0, dt, [b, sq, h, d]).unwrap(),
        TensorViewMut::vm(&bufs[0].1, dt, cache_shape).unwrap(),
        TensorViewMut::vm(&bufs[0].2, dt, cache_shape).unwrap(),
    );
    let (kn0, vn0) = (TensorView::vm(&bufs[0].3, dt, ns).unwrap(), TensorView::vm(&bufs[0].4, dt, ns).unwrap());
    let (mut ov, mut lv) = (TensorViewMut::vm(&ob, dt, [b, sq, h, d]).unwrap(), LseViewMut::vm(&lb, b, h, sq).unwrap());
    let plan =
        kernels.plan_kvcache(&q0, &k0, &v0, Some(&kn0), Some(&vn0), &seqlens, Some(&table), &ov, &lv, &opts).unwrap();
    assert_eq!(plan.num_splits(), 3);
    for (l, (x, (qb, kc, vc, kn, vn))) in layers.iter().zip(&bufs).enumerate() {
        ob.write_f32(dt, &vec![f32::NAN; b * sq * h * d]).unwrap();
        lb.write_f32(Dtype::F32, &vec![f32::NAN; b * h * sq]).unwrap();
        let q = TensorView::vm(qb, dt, [b, sq, h, d]).unwrap();
        let (knv, vnv) = (TensorView::vm(kn, dt, ns).unwrap(), TensorView::vm(vn, dt, ns).unwrap());
        let mut k = TensorViewMut::vm(kc, dt, cache_shape).unwrap();
        let mut v = TensorViewMut::vm(vc, dt, cache_shape).unwrap();
        kernels.run_kvcache(&plan, &q, &mut k, &mut v, Some(&knv), Some(&vnv), &mut ov, &mut lv).unwrap();
        let (o, lse) = (ob.read_f32(dt, b * sq * h * d).unwrap(), lb.read_f32(Dtype::F32, b * h * sq).unwrap());
        let check = verify_decode(&p, &o, &lse, &decode_ref(&p, x));
        assert!(check.passed, "layer {l}: {:?}", check.failures);
        let (ke, ve) = x.appended(&p);
        let bits = |buf: &memattn::attn::VmBuffer, want: &[f32]| {
            buf.read_f32(dt, want.len()).unwrap().iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits())
        };
        assert!(bits(kc, &ke) && bits(vc, &ve), "layer {l}: the caches after the append");
        // The one-shot call on fresh copies of the same inputs gives the same bits.
        let (qc, kc2, vc2, kn2, vn2) = (up(&x.q), up(&x.k_cache), up(&x.v_cache), up(&x.k_new), up(&x.v_new));
        let (o2, l2) = kernels
            .flash_attn_with_kvcache(
                &TensorView::vm(&qc, dt, [b, sq, h, d]).unwrap(),
                &mut TensorViewMut::vm(&kc2, dt, cache_shape).unwrap(),
                &mut TensorViewMut::vm(&vc2, dt, cache_shape).unwrap(),
                Some(&TensorView::vm(&kn2, dt, ns).unwrap()),
                Some(&TensorView::vm(&vn2, dt, ns).unwrap()),
                &seqlens,
                Some(&table),
                &opts,
            )
            .unwrap();
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same(&o, &o2.to_vec_f32().unwrap()) && same(&lse, &l2.to_vec_f32().unwrap()), "layer {l}");
    }
    // A run on another shape, or without the planned new tokens, is refused.
    let small = kernels.vm_upload_as(dt, &vec![0.0; h * d]).unwrap();
    let (mut k, mut v) = (
        TensorViewMut::vm(&bufs[1].1, dt, cache_shape).unwrap(),
        TensorViewMut::vm(&bufs[1].2, dt, cache_shape).unwrap(),
    );
    let q1 = TensorView::vm(&small, dt, [1, 1, h, d]).unwrap();
    let e = kernels.run_kvcache(&plan, &q1, &mut k, &mut v, Some(&kn0), Some(&vn0), &mut ov, &mut lv).unwrap_err();
    assert!(
        matches!(e, AttnError::Shape { tensor: "q", .. }) && e.to_string().contains("the plan was made for"),
        "{e}"
    );
    let e = kernels.run_kvcache(&plan, &q0, &mut k, &mut v, None, None, &mut ov, &mut lv).unwrap_err();
    assert!(e.to_string().contains("the plan was made with new tokens"), "{e}");
    // Another kernels handle cannot run this plan.
    let other = Kernels::vm().unwrap();
    let e = other.run_kvcache(&plan, &q0, &mut k, &mut v, Some(&kn0), Some(&vn0), &mut ov, &mut lv).unwrap_err();
    assert!(matches!(e, AttnError::WrongDevice { .. }), "{e}");
}

/// README.md's "Use from Rust" block is `examples/readme.rs`, whole, so the block compiles (the
/// example is built with the tests) and runs (CI runs it on the VM-backed driver).
#[test]
fn readme_rust_block_is_the_readme_example() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let example = std::fs::read_to_string(root.join("memattn/examples/readme.rs")).unwrap();
    let block = readme
        .split("```rust\n")
        .skip(1)
        .map(|b| b.split("\n```").next().unwrap())
        .find(|b| b.contains("\"Use from Rust\" program"))
        .expect("README.md has a ```rust block with the \"Use from Rust\" program");
    assert_eq!(block.trim_end(), example.trim_end(), "README.md's block differs from memattn/examples/readme.rs");
}

/// `DeviceOptions::vm_max_launch_time`: a launch past the limit is an error naming it, in about
/// that time, and the same call without the limit verifies.
#[test]
fn vm_launch_time_limit_stops_a_long_launch() {
    use memattn::device::{vm::VmDevice, BackendChoice, DeviceOptions};
    use memattn::ptx::PtxSource;
    let (b, s, h, d) = (1usize, 512usize, 4usize, 64usize);
    let x = data(b * s * h * d, 3, Dtype::F32);
    let shape = [b, s, h, d];
    let attempt = |limit: Option<std::time::Duration>| {
        let mut opts = DeviceOptions::new(BackendChoice::Vm, PtxSource::embedded());
        opts.vm_max_launch_time = limit;
        let mut dev = VmDevice::new(&opts).unwrap();
        Kernels::scoped(&mut dev, |k| -> Result<Vec<f32>, AttnError> {
            let buf = k.upload_as(Dtype::F32, &x)?;
            let view = TensorView::device(&buf, Dtype::F32, shape)?;
            let (o, _) = k.flash_attn(&view, &view, &view, &AttnOpts::new())?;
            o.to_vec_f32()
        })
    };
    let t = std::time::Instant::now();
    let e = attempt(Some(std::time::Duration::from_millis(20))).unwrap_err().to_string();
    assert!(e.contains("launch time limit exceeded"), "{e}");
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "took {:?}", t.elapsed());
    let o = attempt(None).unwrap();
    let p = Problem {
        batch: 1,
        heads: h as u32,
        seq_q: s as u32,
        seq_kv: s as u32,
        head_dim: d as u32,
        ..Problem::default()
    };
    // A few rows against the f64 reference (q = k = v).
    let (ro, _) = reference::attention(&p, &x, &x, &x).unwrap();
    let err = o.iter().zip(&ro).map(|(&a, &r)| (a as f64 - r).abs()).fold(0.0, f64::max);
    assert!(err < 1e-4, "{err}");
}

/// `AttnOpts::cache_batch_idx` / `cache_leftpad` through the library: a call with both verifies
/// against the f64 reference (the CLI and the device tests cover more), and each misuse is a
/// typed error before launch: with a block table, a slot past the cache, the prefill calls.
#[test]
fn vm_cache_slots_and_left_padding_are_checked_and_run() {
    use memattn::decode::{reference, DecodeInputs, DecodeProblem};
    use memattn::error::KvCacheRule;
    let kernels = Kernels::vm().unwrap();
    let p = DecodeProblem {
        batch: 2,
        heads: 4,
        heads_kv: 2,
        head_dim: 64,
        cache_seqlens: vec![30, 45],
        cache_batch_idx: Some(vec![2, 0]),
        cache_leftpad: Some(vec![4, 10]),
        ..DecodeProblem::default()
    };
    let x = DecodeInputs::random(&p, 8);
    let seq_cache = x.k_cache.len() / (3 * 2 * 64);
    let up = |v: &[f32]| kernels.upload_as(Dtype::F32, v).unwrap();
    let (q, kc, vc) = (up(&x.q), up(&x.k_cache), up(&x.v_cache));
    let it = |v: &[u32]| kernels.index_tensor(v, None).unwrap();
    let (lens, slots, pad) = (it(&p.cache_seqlens), it(&[2, 0]), it(&[4, 10]));
    let qv = TensorView::device(&q, Dtype::F32, [2, 1, 4, 64]).unwrap();
    let cache_shape = [3, seq_cache, 2, 64];
    let mut kv = TensorViewMut::device(&kc, Dtype::F32, cache_shape).unwrap();
    let mut vv = TensorViewMut::device(&vc, Dtype::F32, cache_shape).unwrap();
    let opts = AttnOpts::new().causal(true).cache_batch_idx(&slots).cache_leftpad(&pad);
    let (o, lse) = kernels.flash_attn_with_kvcache(&qv, &mut kv, &mut vv, None, None, &lens, None, &opts).unwrap();
    let r = reference(&p, &x);
    let err = o.to_vec_f32().unwrap().iter().zip(&r.o).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
    assert!(err < 1e-5, "{err}");
    let lerr = lse.to_vec_f32().unwrap().iter().zip(&r.lse).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
    assert!(lerr < 1e-5, "{lerr}");
    // A slot past the cache's 3.
    let far = it(&[3, 0]);
    let e = kernels
        .flash_attn_with_kvcache(&qv, &mut kv, &mut vv, None, None, &lens, None, &AttnOpts::new().cache_batch_idx(&far))
        .unwrap_err();
    assert!(matches!(e, AttnError::KvCache { why: KvCacheRule::SlotPastEnd { batch: 0, slot: 3, slots: 3 } }), "{e}");
    // With a block table.
    let table = it(&[0, 1]);
    let mut pk = TensorViewMut::device(&kc, Dtype::F32, [6, 16, 2, 64]).unwrap();
    let mut pv = TensorViewMut::device(&vc, Dtype::F32, [6, 16, 2, 64]).unwrap();
    let short = it(&[10, 12]);
    let e = kernels
        .flash_attn_with_kvcache(
            &qv,
            &mut pk,
            &mut pv,
            None,
            None,
            &short,
            Some(&table),
            &AttnOpts::new().cache_leftpad(&pad),
        )
        .unwrap_err();
    assert!(matches!(e, AttnError::KvCache { why: KvCacheRule::SlotsWithPages { tensor: "cache_leftpad" } }), "{e}");
    // The prefill calls refuse both.
    let view = TensorView::device(&q, Dtype::F32, [2, 1, 4, 64]).unwrap();
    let e = kernels.flash_attn(&view, &view, &view, &AttnOpts::new().cache_leftpad(&pad)).unwrap_err();
    assert!(matches!(e, AttnError::NotSupportedYet { .. }), "{e}");
}

/// `AttnOpts::rotary` through the library: a call verifies against the f64 reference over the
/// rotated inputs, and the misuses are typed errors before launch: tables with too few rows,
/// tables in another dtype, no new tokens, the prefill calls.
#[test]
fn vm_rotary_tables_are_checked_and_run() {
    use memattn::attn::RotaryView;
    use memattn::decode::{reference, DecodeInputs, DecodeProblem, Rotary};
    use memattn::error::KvCacheRule;
    let kernels = Kernels::vm().unwrap();
    let p = DecodeProblem {
        batch: 1,
        heads: 2,
        heads_kv: 1,
        head_dim: 64,
        seq_q: 2,
        cache_seqlens: vec![21],
        seq_new: 2,
        rotary: Some(Rotary { dim: 32, interleaved: true }),
        ..DecodeProblem::default()
    };
    let x = DecodeInputs::random(&p, 4);
    let rows = p.rotary_rows() as usize;
    assert_eq!(rows, 23);
    let up = |v: &[f32]| kernels.upload_as(Dtype::F32, v).unwrap();
    let (q, kc, vc, kn, vn) = (up(&x.q), up(&x.k_cache), up(&x.v_cache), up(&x.k_new), up(&x.v_new));
    let (cos, sin) = (up(&x.rotary_cos), up(&x.rotary_sin));
    let lens = kernels.index_tensor(&p.cache_seqlens, None).unwrap();
    let qv = TensorView::device(&q, Dtype::F32, [1, 2, 2, 64]).unwrap();
    let (knv, vnv) = (
        TensorView::device(&kn, Dtype::F32, [1, 2, 1, 64]).unwrap(),
        TensorView::device(&vn, Dtype::F32, [1, 2, 1, 64]).unwrap(),
    );
    let cache_shape = [1, 23, 1, 64];
    let mut kv = TensorViewMut::device(&kc, Dtype::F32, cache_shape).unwrap();
    let mut vv = TensorViewMut::device(&vc, Dtype::F32, cache_shape).unwrap();
    let table = |rows: usize| TensorView::device(&cos, Dtype::F32, [rows, 16, 1, 1]).unwrap();
    let rot = RotaryView::new(table(rows), TensorView::device(&sin, Dtype::F32, [rows, 16, 1, 1]).unwrap(), true);
    let opts = AttnOpts::new().causal(true).rotary(&rot);
    let (o, _) =
        kernels.flash_attn_with_kvcache(&qv, &mut kv, &mut vv, Some(&knv), Some(&vnv), &lens, None, &opts).unwrap();
    let r = reference(&p, &x);
    let err = o.to_vec_f32().unwrap().iter().zip(&r.o).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
    assert!(err < 1e-5, "{err}");
    // One row short of the last position.
    let short = RotaryView::new(table(rows - 1), table(rows - 1), true);
    let e = kernels
        .flash_attn_with_kvcache(
            &qv,
            &mut kv,
            &mut vv,
            Some(&knv),
            Some(&vnv),
            &lens,
            None,
            &AttnOpts::new().causal(true).rotary(&short),
        )
        .unwrap_err();
    assert!(matches!(e, AttnError::KvCache { why: KvCacheRule::RotaryTables { need: 23, rows: 22, .. } }), "{e}");
    // Tables in bf16 for an f32 call.
    let bf = kernels.upload_as(Dtype::Bf16, &x.rotary_cos).unwrap();
    let bft = RotaryView::new(
        TensorView::device(&bf, Dtype::Bf16, [rows, 16, 1, 1]).unwrap(),
        TensorView::device(&bf, Dtype::Bf16, [rows, 16, 1, 1]).unwrap(),
        true,
    );
    let e = kernels
        .flash_attn_with_kvcache(
            &qv,
            &mut kv,
            &mut vv,
            Some(&knv),
            Some(&vnv),
            &lens,
            None,
            &AttnOpts::new().rotary(&bft),
        )
        .unwrap_err();
    assert!(matches!(e, AttnError::Dtype { tensor: "rotary_cos", .. }), "{e}");
    // No new tokens.
    let e = kernels.flash_attn_with_kvcache(&qv, &mut kv, &mut vv, None, None, &lens, None, &opts).unwrap_err();
    assert!(matches!(e, AttnError::KvCache { why: KvCacheRule::RotaryWithoutNewTokens }), "{e}");
    // The prefill calls.
    let e = kernels.flash_attn(&qv, &qv, &qv, &opts).unwrap_err();
    assert!(matches!(e, AttnError::NotSupportedYet { .. }), "{e}");
}
