//! Calls that used to return Ok with a wrong answer: outputs that share memory with inputs or
//! with each other (refused with [`AttnError::Aliasing`]), a NaN partial LSE in `merge_states`
//! (NaN out, not an empty-looking row), and large soft caps (checked against the f64 reference
//! in every kernel family that applies one). All in the VM; each case is small.

use crate::common;
use common::{data, flash_into};
use memattn::attn::{
    AliasRule, AttnError, AttnOpts, Kernels, LseViewMut, PartialsView, SinksView, TensorView, TensorViewMut, VmBuffer,
};
use memattn::{reference, Dtype, Problem};

/// The two tensors an [`AliasRule::Overlap`] names, or the one of a [`AliasRule::SelfOverlap`].
fn alias_names(e: &AttnError) -> (&'static str, &'static str) {
    match e {
        AttnError::Aliasing { why: AliasRule::Overlap { written, other, .. } } => (*written, *other),
        AttnError::Aliasing { why: AliasRule::SelfOverlap { tensor, .. } } => (*tensor, *tensor),
        other => panic!("not an aliasing error: {other}"),
    }
}

/// A writable f32 view of `buf`.
fn out(buf: &VmBuffer, shape: [usize; 4]) -> TensorViewMut<'_> {
    TensorViewMut::vm(buf, Dtype::F32, shape).unwrap()
}

const B: usize = 1;
const SQ: usize = 8;
const H: usize = 2;
const D: usize = 64;
const QS: [usize; 4] = [B, SQ, H, D];
const N: usize = B * SQ * H * D;

#[test]
fn vm_prefill_outputs_sharing_memory_are_refused_and_disjoint_views_of_one_buffer_run() {
    let kernels = Kernels::vm().unwrap();
    let f = Dtype::F32;
    let (q, k, v) = (data(N, 1, f), data(N, 2, f), data(N, 3, f));
    let (qb, kb, vb) = (kernels.vm_upload(&q).unwrap(), kernels.vm_upload(&k).unwrap(), kernels.vm_upload(&v).unwrap());
    let ob = kernels.vm_upload(&vec![f32::NAN; N]).unwrap();
    let lb = kernels.vm_upload(&[f32::NAN; B * H * SQ]).unwrap();
    let run = |o: &mut TensorViewMut, lse: &mut LseViewMut, opts: &AttnOpts| {
        let (qv, kv, vv) = (
            TensorView::vm(&qb, f, QS).unwrap(),
            TensorView::vm(&kb, f, QS).unwrap(),
            TensorView::vm(&vb, f, QS).unwrap(),
        );
        kernels.flash_attn_into(&qv, &kv, &vv, o, lse, opts)
    };
    let o_on = |buf| out(buf, QS);
    let lse = || LseViewMut::vm(&lb, B, H, SQ).unwrap();
    let none = AttnOpts::new();

    // o on k's buffer.
    let e = run(&mut o_on(&kb), &mut lse(), &none).unwrap_err();
    assert_eq!(alias_names(&e), ("o", "k"), "{e}");
    assert!(e.to_string().contains("o (written") && e.to_string().contains("overlaps k"), "{e}");
    // o broadcast over batch, seq and heads; o with seq stride 1 (rows overlap by 63 elements);
    // heads landing on the next row's elements.
    for strides in [[0, 0, 0, 1], [SQ * H * D, 1, D, 1], [SQ * H * D, D, D, 1]] {
        let e = run(&mut o_on(&ob).with_strides(strides), &mut lse(), &none).unwrap_err();
        assert_eq!(alias_names(&e), ("o", "o"), "{strides:?}: {e}");
    }
    // lse inside o's bytes.
    let mut lse_in_o = LseViewMut::vm(&ob, B, H, SQ).unwrap();
    let e = run(&mut o_on(&ob), &mut lse_in_o, &none).unwrap_err();
    assert_eq!(alias_names(&e), ("o", "lse"), "{e}");
    // o over the sinks (one buffer: sinks first, o from element 1 on).
    let big = kernels.vm_upload(&vec![0.0; N + 1]).unwrap();
    let sinks = SinksView::vm(&big, H).unwrap();
    let mut o_after_one = TensorViewMut::vm(&big, f, QS).unwrap().offset(1).unwrap();
    let e = run(&mut o_after_one, &mut lse(), &AttnOpts::new().sinks(&sinks)).unwrap_err();
    assert_eq!(alias_names(&e), ("o", "sinks"), "{e}");

    // Varlen: o over the bytes of cu_seqlens_q.
    let cu = kernels.index_tensor(&[0, 3, SQ as u32], None).unwrap();
    let packed = [1, SQ, H, D];
    // SAFETY: the call refuses before any launch, so the memory is never touched.
    let mut o_on_cu = unsafe { TensorViewMut::from_raw(&kernels, None, cu.ptr(), (N * 4) as u64, f, packed) };
    let (qv, kv, vv) = (
        TensorView::vm(&qb, f, packed).unwrap(),
        TensorView::vm(&kb, f, packed).unwrap(),
        TensorView::vm(&vb, f, packed).unwrap(),
    );
    let e = kernels
        .flash_attn_varlen_into(
            &qv,
            &kv,
            &vv,
            &cu,
            &cu,
            SQ,
            SQ,
            &mut o_on_cu,
            &mut LseViewMut::vm(&lb, 1, H, SQ).unwrap(),
            &none,
        )
        .unwrap_err();
    assert_eq!(alias_names(&e), ("o", "cu_seqlens_q"), "{e}");

    // Naive: the scores workspace over q.
    let sb = kernels.vm_alloc((B * H * SQ * SQ * 4) as u64).unwrap();
    let mut scores_on_q = TensorViewMut::vm(&qb, f, [B, H, SQ, SQ]).unwrap();
    let (qv, kv, vv) =
        (TensorView::vm(&qb, f, QS).unwrap(), TensorView::vm(&kb, f, QS).unwrap(), TensorView::vm(&vb, f, QS).unwrap());
    let e = kernels.naive_attn_into(&qv, &kv, &vv, &mut o_on(&ob), &mut lse(), &mut scores_on_q, &none).unwrap_err();
    assert_eq!(alias_names(&e), ("scores", "q"), "{e}");
    let mut scores = TensorViewMut::vm(&sb, f, [B, H, SQ, SQ]).unwrap();
    kernels.naive_attn_into(&qv, &kv, &vv, &mut o_on(&ob), &mut lse(), &mut scores, &none).unwrap();

    // q and o in one buffer, side by side, with q = k = v: runs and matches the reference.
    let one = kernels.vm_upload(&[q.clone(), vec![f32::NAN; N]].concat()).unwrap();
    let qv = TensorView::vm(&one, f, QS).unwrap();
    let mut ov = TensorViewMut::vm(&one, f, QS).unwrap().offset(N).unwrap();
    kernels.flash_attn_into(&qv, &qv, &qv, &mut ov, &mut lse(), &none).unwrap();
    let got = one.read_f32(f, 2 * N).unwrap();
    let p = Problem {
        batch: 1,
        heads: H as u32,
        seq_q: SQ as u32,
        seq_kv: SQ as u32,
        head_dim: D as u32,
        ..Problem::default()
    };
    let (ro, _) = reference::attention(&p, &q, &q, &q).unwrap();
    let err = got[N..].iter().zip(&ro).map(|(&g, &r)| (g as f64 - r).abs()).fold(0.0, f64::max);
    assert!(err < 2e-5, "max error {err}");
    assert_eq!(&got[..N], &q[..], "q unchanged");
}

#[test]
fn vm_kvcache_calls_that_write_shared_memory_are_refused() {
    let kernels = Kernels::vm().unwrap();
    let f = Dtype::F32;
    let (b, h, hk, d, cap) = (1usize, 2usize, 1usize, 64usize, 16usize);
    let cshape = [b, cap, hk, d];
    let row = hk * d;
    let kc = kernels.vm_upload(&data(2 * b * cap * row, 11, f)).unwrap();
    let vc = kernels.vm_upload(&data(b * cap * row, 12, f)).unwrap();
    let qb = kernels.vm_upload(&data(b * h * d, 13, f)).unwrap();
    let newb = kernels.vm_upload(&data(b * row, 14, f)).unwrap();
    let ob = kernels.vm_alloc((b * h * d * 4) as u64).unwrap();
    let lb = kernels.vm_alloc((b * h * 4) as u64).unwrap();
    let lens = kernels.index_tensor(&[5], None).unwrap();
    let q = || TensorView::vm(&qb, f, [b, 1, h, d]).unwrap();
    let new = TensorView::vm(&newb, f, [b, 1, hk, d]).unwrap();
    let o = || TensorViewMut::vm(&ob, f, [b, 1, h, d]).unwrap();
    let lse = || LseViewMut::vm(&lb, b, h, 1).unwrap();
    let none = AttnOpts::new();
    let call = |k: &mut TensorViewMut, v: &mut TensorViewMut, kn: Option<&TensorView>, o: &mut TensorViewMut| {
        kernels.flash_attn_with_kvcache_into(&q(), k, v, kn, kn, &lens, None, o, &mut lse(), &none)
    };
    let kv = |buf| out(buf, cshape);

    // k_cache and v_cache on one buffer: allowed when only read, refused when appending.
    call(&mut kv(&kc), &mut kv(&kc), None, &mut o()).unwrap();
    let e = call(&mut kv(&kc), &mut kv(&kc), Some(&new), &mut o()).unwrap_err();
    assert_eq!(alias_names(&e), ("k_cache", "v_cache"), "{e}");
    // Two halves of one buffer do not overlap: the append runs.
    let mut v_half = kv(&kc).offset(b * cap * row).unwrap();
    call(&mut kv(&kc), &mut v_half, Some(&new), &mut o()).unwrap();
    // k_new viewing the very rows it is appended to.
    let k_rows = TensorView::vm(&kc, f, [b, 1, hk, d]).unwrap().offset(5 * row).unwrap();
    let e = call(&mut kv(&kc), &mut kv(&vc), Some(&k_rows), &mut o()).unwrap_err();
    assert_eq!(alias_names(&e), ("k_cache", "k_new"), "{e}");
    // o over q, o over a cache that is only read.
    let mut o_on_q = TensorViewMut::vm(&qb, f, [b, 1, h, d]).unwrap();
    let e = call(&mut kv(&kc), &mut kv(&vc), None, &mut o_on_q).unwrap_err();
    assert_eq!(alias_names(&e), ("o", "q"), "{e}");
    let mut o_on_v = TensorViewMut::vm(&vc, f, [b, 1, h, d]).unwrap();
    let e = call(&mut kv(&kc), &mut kv(&vc), None, &mut o_on_v).unwrap_err();
    assert_eq!(alias_names(&e), ("o", "v_cache"), "{e}");

    // A plan, then a run whose layer tensors overlap: checked on every run.
    let plan = kernels.plan_kvcache(&q(), &kv(&kc), &kv(&vc), None, None, &lens, None, &o(), &lse(), &none).unwrap();
    kernels.run_kvcache(&plan, &q(), &mut kv(&kc), &mut kv(&vc), None, None, &mut o(), &mut lse()).unwrap();
    let mut lse_on_k = LseViewMut::vm(&kc, b, h, 1).unwrap();
    let e =
        kernels.run_kvcache(&plan, &q(), &mut kv(&kc), &mut kv(&vc), None, None, &mut o(), &mut lse_on_k).unwrap_err();
    assert_eq!(alias_names(&e), ("lse", "k_cache"), "{e}");
}

#[test]
fn vm_merge_states_outputs_over_the_partials_are_refused() {
    let kernels = Kernels::vm().unwrap();
    let (splits, shape) = (2usize, [1usize, 1, 1, 4]);
    let op = kernels.vm_upload(&data(splits * 4, 21, Dtype::F32)).unwrap();
    let lp = kernels.vm_upload(&[0.0, 1.0]).unwrap();
    let (ob, lb) = (kernels.vm_alloc(16).unwrap(), kernels.vm_alloc(4).unwrap());
    let parts = || PartialsView::vm(&op, &lp, splits, shape).unwrap();
    let e = kernels
        .merge_states_into(
            &parts(),
            &mut TensorViewMut::vm(&op, Dtype::F32, shape).unwrap(),
            &mut LseViewMut::vm(&lb, 1, 1, 1).unwrap(),
        )
        .unwrap_err();
    assert_eq!(alias_names(&e), ("o", "o_part"), "{e}");
    let e = kernels
        .merge_states_into(
            &parts(),
            &mut TensorViewMut::vm(&ob, Dtype::F32, shape).unwrap(),
            &mut LseViewMut::vm(&lp, 1, 1, 1).unwrap(),
        )
        .unwrap_err();
    assert_eq!(alias_names(&e), ("lse", "lse_part"), "{e}");
}

/// A NaN partial LSE makes its row NaN (O and LSE), as FlashAttention's combine does; the other
/// rows, a row with one `-inf` split and a row of only `-inf` splits keep their values.
#[test]
fn vm_merge_states_nan_lse_gives_a_nan_row() {
    let kernels = Kernels::vm().unwrap();
    let (splits, rows, d) = (2usize, 4usize, 2usize);
    // Row 0: NaN in split 1. Row 1: ordinary. Row 2: split 0 empty. Row 3: both empty.
    let lse_part = [0.0, 0.5, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NAN, 3f32.ln(), 0.0, f32::NEG_INFINITY];
    let o_part: Vec<f32> = (0..splits * rows * d).map(|i| i as f32).collect();
    let (op, lp) = (kernels.vm_upload(&o_part).unwrap(), kernels.vm_upload(&lse_part).unwrap());
    let (ob, lb) = (kernels.vm_upload(&[7.0; 8]).unwrap(), kernels.vm_upload(&[7.0; 4]).unwrap());
    kernels
        .merge_states_into(
            &PartialsView::vm(&op, &lp, splits, [1, rows, 1, d]).unwrap(),
            &mut TensorViewMut::vm(&ob, Dtype::F32, [1, rows, 1, d]).unwrap(),
            &mut LseViewMut::vm(&lb, 1, 1, rows).unwrap(),
        )
        .unwrap();
    let (o, lse) = (ob.read_f32(Dtype::F32, rows * d).unwrap(), lb.read_f32(Dtype::F32, rows).unwrap());
    assert!(o[0].is_nan() && o[1].is_nan() && lse[0].is_nan(), "row 0: {:?} {}", &o[..2], lse[0]);
    // Row 1: weights e^0.5 / (e^0.5 + 3) and 3 / (e^0.5 + 3) of o_part rows 1 and 5.
    let (w0, w1) = (0.5f64.exp() / (0.5f64.exp() + 3.0), 3.0 / (0.5f64.exp() + 3.0));
    for c in 0..d {
        let want = w0 * o_part[2 + c] as f64 + w1 * o_part[10 + c] as f64;
        assert!((o[2 + c] as f64 - want).abs() < 1e-5, "row 1 dim {c}: {} vs {want}", o[2 + c]);
    }
    assert!((lse[1] as f64 - (0.5f64.exp() + 3.0).ln()).abs() < 1e-5);
    assert_eq!((o[4], o[5], lse[2]), (o_part[12], o_part[13], 0.0));
    assert_eq!((o[6], o[7], lse[3]), (0.0, 0.0, f32::NEG_INFINITY));
}

/// Largest |o - ref| of a flash_attn_into run of `p` (q, k, v from fixed seeds).
fn prefill_error(kernels: &Kernels, p: &Problem) -> f64 {
    let dt = p.dtype;
    let (b, sq, skv, h, d) =
        (p.batch as usize, p.seq_q as usize, p.seq_kv as usize, p.heads as usize, p.head_dim as usize);
    let (q, k, v) = (data(b * sq * h * d, 31, dt), data(b * skv * h * d, 32, dt), data(b * skv * h * d, 33, dt));
    let mut opts = AttnOpts::new().softmax_scale(p.softmax_scale()).causal(p.causal);
    if p.softcap > 0.0 {
        opts = opts.softcap(p.softcap);
    }
    let (o, lse) = flash_into(kernels, p, (&q, &k, &v), &opts);
    let (ro, rl) = reference::attention(p, &q, &k, &v).unwrap();
    for (i, (&g, &r)) in lse.iter().zip(&rl).enumerate() {
        assert!((g as f64 - r).abs() <= 1e-4 * r.abs().max(1.0), "lse[{i}] = {g}, reference {r} ({p:?})");
    }
    o.iter()
        .zip(&ro)
        .map(|(&g, &r)| if g.is_finite() { (g as f64 - r).abs() } else { f64::INFINITY })
        .fold(0.0, f64::max)
}

const CAPS: [f32; 5] = [1e2, 1e3, 1e4, 1e5, 1e6];

/// Soft caps from 1e2 to 1e6 on the f32 flash kernel (bound 2e-5, the f32 bound of every other
/// test) and the bf16 tensor-core kernel (at most twice the same kernel's error without a cap: a
/// cap of 1e6 changes these scores by under 1e-12 relative). A scale of 1 gives scores of a few
/// units, so `score / cap` runs from about 1e-2 down to 1e-6.
#[test]
fn vm_prefill_large_soft_caps_match_the_reference() {
    let kernels = Kernels::vm().unwrap();
    let base = Problem {
        batch: 1,
        heads: 2,
        seq_q: 16,
        seq_kv: 24,
        head_dim: 64,
        scale: Some(1.0),
        causal: true,
        ..Problem::default()
    };
    for cap in CAPS {
        let err = prefill_error(&kernels, &Problem { softcap: cap, ..base });
        assert!(err <= 2e-5, "f32, soft cap {cap}: max error {err}");
    }
    let bf = Problem { dtype: Dtype::Bf16, ..base };
    let uncapped = prefill_error(&kernels, &bf);
    for cap in CAPS {
        let err = prefill_error(&kernels, &Problem { softcap: cap, ..bf });
        assert!(err <= 2.0 * uncapped, "bf16, soft cap {cap}: max error {err}, {uncapped} without a cap");
    }
}

/// The same caps through the KV-cache call: the f32 SIMT decode kernel and the bf16 tensor-core
/// one, with two splits (so the combine runs too), against the f64 decode reference.
#[test]
fn vm_decode_large_soft_caps_match_the_reference() {
    use memattn::decode::{reference as decode_ref, verify_decode, DecodeInputs, DecodeProblem, Splits};
    let kernels = Kernels::vm().unwrap();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for cap in CAPS {
            let p = DecodeProblem {
                batch: 1,
                heads: 2,
                heads_kv: 1,
                cache_seqlens: vec![37],
                scale: Some(1.0),
                softcap: cap,
                dtype,
                splits: Splits::Fixed(2),
                ..DecodeProblem::default()
            };
            let x = DecodeInputs::random(&p, 7);
            let (h, d, seq_cache) = (2usize, 64usize, 37usize);
            let up = |v: &[f32]| kernels.vm_upload_as(dtype, v).unwrap();
            let (qb, kc, vc) = (up(&x.q), up(&x.k_cache), up(&x.v_cache));
            let ob = kernels.vm_upload_as(dtype, &vec![f32::NAN; h * d]).unwrap();
            let lb = kernels.vm_upload(&vec![f32::NAN; h]).unwrap();
            let lens = kernels.index_tensor(&p.cache_seqlens, None).unwrap();
            let cshape = [1, seq_cache, 1, d];
            kernels
                .flash_attn_with_kvcache_into(
                    &TensorView::vm(&qb, dtype, [1, 1, h, d]).unwrap(),
                    &mut TensorViewMut::vm(&kc, dtype, cshape).unwrap(),
                    &mut TensorViewMut::vm(&vc, dtype, cshape).unwrap(),
                    None,
                    None,
                    &lens,
                    None,
                    &mut TensorViewMut::vm(&ob, dtype, [1, 1, h, d]).unwrap(),
                    &mut LseViewMut::vm(&lb, 1, h, 1).unwrap(),
                    &AttnOpts::new().softmax_scale(1.0).softcap(cap).num_splits(2),
                )
                .unwrap();
            let (o, lse) = (ob.read_f32(dtype, h * d).unwrap(), lb.read_f32(Dtype::F32, h).unwrap());
            let v = verify_decode(&p, &o, &lse, &decode_ref(&p, &x));
            assert!(v.passed, "{dtype} soft cap {cap}: {:?}", v.failures);
        }
    }
}

/// vLLM's joint KV layout: one allocation `[2, num_pages, page_size, heads_kv, head_dim]`, k_cache
/// its first half and v_cache its second. The paged decode appends into both halves of the one
/// buffer and matches the f64 reference; both halves hold exactly the appended caches after it.
#[test]
fn vm_kvcache_paged_append_into_one_joint_kv_allocation_matches_the_reference() {
    use memattn::decode::{reference as decode_ref, verify_decode, CacheLayout, DecodeInputs, DecodeProblem, Splits};
    let kernels = Kernels::vm().unwrap();
    // Paged (5-key pages, shuffled), GQA 4/2, 3 sequences (one empty before the append), 2 new
    // tokens each, causal, 2 splits.
    let p = DecodeProblem {
        batch: 3,
        heads: 4,
        heads_kv: 2,
        cache_seqlens: vec![9, 0, 12],
        seq_new: 2,
        page_size: Some(5),
        splits: Splits::Fixed(2),
        ..DecodeProblem::default()
    };
    let x = DecodeInputs::random(&p, 21);
    let CacheLayout::Paged { page_size, num_pages, .. } = x.layout else { panic!("a paged case") };
    let (b, h, hk, d) = (p.batch as usize, p.heads as usize, p.heads_kv as usize, p.head_dim as usize);
    let cache_shape = [num_pages as usize, page_size as usize, hk, d];
    let half = cache_shape.iter().product::<usize>();
    assert_eq!((x.k_cache.len(), x.v_cache.len()), (half, half));
    // Real values: the cached keys and the new tokens are not zeros.
    assert!(x.k_cache.iter().chain(&x.v_cache).any(|v| v.is_finite() && *v != 0.0));
    assert!(x.k_new.iter().chain(&x.v_new).all(|v| v.is_finite()) && x.k_new.iter().any(|v| *v != 0.0));
    let f = Dtype::F32;
    let joint = kernels.vm_upload(&[&x.k_cache[..], &x.v_cache[..]].concat()).unwrap();
    let (qb, knb, vnb) =
        (kernels.vm_upload(&x.q).unwrap(), kernels.vm_upload(&x.k_new).unwrap(), kernels.vm_upload(&x.v_new).unwrap());
    let ob = kernels.vm_upload(&vec![f32::NAN; b * h * d]).unwrap();
    let lb = kernels.vm_upload(&vec![f32::NAN; b * h]).unwrap();
    let lens = kernels.index_tensor(&p.cache_seqlens, None).unwrap();
    let table = kernels.index_tensor(&x.block_table, None).unwrap();
    let new_shape = [b, 2, hk, d];
    kernels
        .flash_attn_with_kvcache_into(
            &TensorView::vm(&qb, f, [b, 1, h, d]).unwrap(),
            &mut TensorViewMut::vm(&joint, f, cache_shape).unwrap(),
            &mut TensorViewMut::vm(&joint, f, cache_shape).unwrap().offset(half).unwrap(),
            Some(&TensorView::vm(&knb, f, new_shape).unwrap()),
            Some(&TensorView::vm(&vnb, f, new_shape).unwrap()),
            &lens,
            Some(&table),
            &mut TensorViewMut::vm(&ob, f, [b, 1, h, d]).unwrap(),
            &mut LseViewMut::vm(&lb, b, h, 1).unwrap(),
            &AttnOpts::new().causal(true).num_splits(2),
        )
        .unwrap();
    let (o, lse) = (ob.read_f32(f, b * h * d).unwrap(), lb.read_f32(f, b * h).unwrap());
    let v = verify_decode(&p, &o, &lse, &decode_ref(&p, &x));
    assert!(v.passed, "{:?}", v.failures);
    let (ke, ve) = x.appended(&p);
    let got = joint.read_f32(f, 2 * half).unwrap();
    let same = |got: &[f32], want: &[f32]| {
        got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
    };
    assert!(same(&got[..half], &ke), "the k half after the append");
    assert!(same(&got[half..], &ve), "the v half after the append");
}

/// Two views into one allocation that share bytes are refused before anything is written, and
/// the error names the bytes they share.
#[test]
fn vm_kvcache_append_into_overlapping_views_of_one_allocation_is_refused_naming_the_shared_bytes() {
    let kernels = Kernels::vm().unwrap();
    let f = Dtype::F32;
    let (b, h, hk, d, pages, page) = (1usize, 2usize, 1usize, 64usize, 4usize, 8usize);
    let cshape = [pages, page, hk, d];
    let (half, page_elems) = (pages * page * hk * d, page * hk * d);
    let joint_values = data(2 * half, 31, f);
    let joint = kernels.vm_upload(&joint_values).unwrap();
    let qb = kernels.vm_upload(&data(b * h * d, 32, f)).unwrap();
    let newb = kernels.vm_upload(&data(b * hk * d, 33, f)).unwrap();
    let ob = kernels.vm_upload(&vec![f32::NAN; b * h * d]).unwrap();
    let lb = kernels.vm_upload(&vec![f32::NAN; b * h]).unwrap();
    let lens = kernels.index_tensor(&[3], None).unwrap();
    let table = kernels.index_tensor(&[2, 0, 3, 1], None).unwrap();
    let new = TensorView::vm(&newb, f, [b, 1, hk, d]).unwrap();
    // v_cache begins one page before the end of k_cache: the last page of k is the first of v.
    let mut k = TensorViewMut::vm(&joint, f, cshape).unwrap();
    let mut v = TensorViewMut::vm(&joint, f, cshape).unwrap().offset(half - page_elems).unwrap();
    let e = kernels
        .flash_attn_with_kvcache_into(
            &TensorView::vm(&qb, f, [b, 1, h, d]).unwrap(),
            &mut k,
            &mut v,
            Some(&new),
            Some(&new),
            &lens,
            Some(&table),
            &mut TensorViewMut::vm(&ob, f, [b, 1, h, d]).unwrap(),
            &mut LseViewMut::vm(&lb, b, h, 1).unwrap(),
            &AttnOpts::new(),
        )
        .unwrap_err();
    let AttnError::Aliasing { why: AliasRule::Overlap { written, other, written_bytes, other_bytes } } = &e else {
        panic!("not an overlap: {e}")
    };
    assert_eq!((*written, *other), ("k_cache", "v_cache"), "{e}");
    let base = written_bytes[0];
    let (half_b, page_b) = ((half * 4) as u64, (page_elems * 4) as u64);
    assert_eq!(*written_bytes, [base, base + half_b], "{e}");
    assert_eq!(*other_bytes, [base + half_b - page_b, base + 2 * half_b - page_b], "{e}");
    // The shared bytes are k's last page.
    let shared = format!("they share bytes {:#x}..{:#x} ({} bytes)", base + half_b - page_b, base + half_b, page_b);
    assert!(e.to_string().contains(&shared), "{e}\nwants: {shared}");
    // Nothing was written: the buffer and the poisoned outputs are as they were.
    let after = joint.read_f32(f, 2 * half).unwrap();
    assert!(after.iter().zip(&joint_values).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(ob.read_f32(f, b * h * d).unwrap().iter().all(|x| x.is_nan()));
}
