//! ALiBi (`AttnOpts::alibi_slopes`): the paper's slopes as known answers; the forward (f32 SIMT
//! and the bf16 tensor-core kernels, dense and varlen) and the KV-cache decode (SIMT and tensor
//! cores) with `[heads]` and `[batch, heads]` slopes against the f64 reference, outputs poisoned
//! first; the refusals.

use crate::common;
use common::{data, flash_into};
use memattn::attn::{AlibiRule, AlibiView, AttnError, AttnOpts, Kernels, LseViewMut, TensorView, TensorViewMut};
use memattn::problem::alibi_slopes;
use memattn::{reference, Dtype, Problem};

#[test]
fn the_papers_slopes() {
    let p = |e: &[i32]| e.iter().map(|&e| 2f32.powi(e)).collect::<Vec<f32>>();
    assert_eq!(alibi_slopes(8), p(&[-1, -2, -3, -4, -5, -6, -7, -8]));
    assert_eq!(alibi_slopes(1), p(&[-8]));
    assert_eq!(alibi_slopes(4), p(&[-2, -4, -6, -8]));
    // Not a power of two: 4's slopes, then every other slope of 8's.
    assert_eq!(alibi_slopes(6), p(&[-2, -4, -6, -8, -1, -3]));
    // 12: 8's slopes, then every other slope of 16's (2^(-8i/16): 2^-0.5, 2^-1.5, ...).
    let twelve: Vec<f32> = [0.5f32, 1.5, 2.5, 3.5].iter().map(|e| 2f64.powf(-*e as f64) as f32).collect();
    assert_eq!(alibi_slopes(12)[8..], twelve[..]);
    assert!(alibi_slopes(0).is_empty());
}

/// The forward into poisoned buffers with `slopes` (`[heads]` or `[batch, heads]`), against the
/// f64 reference with the same slopes; also without slopes, which must differ (the bias matters
/// at these shapes).
fn forward_case(kernels: &Kernels, p: &Problem, slopes: &[f32]) {
    let (dt, h, hk, d) = (p.dtype, p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let (b, sq, skv) = (p.batch as usize, p.seq_q as usize, p.seq_kv as usize);
    let (q, k, v) = (data(b * sq * h * d, 21, dt), data(b * skv * hk * d, 22, dt), data(b * skv * hk * d, 23, dt));
    let sb = kernels.vm_upload(slopes).unwrap();
    let per_batch = slopes.len() != h;
    let sv = AlibiView::vm(&sb, per_batch.then_some(b), h).unwrap();
    let run = |alibi: bool| {
        let side = |w: i32| u32::try_from(w).ok();
        let mut opts = AttnOpts::new().causal(p.causal).window(side(p.window.0), side(p.window.1));
        if p.softcap > 0.0 {
            opts = opts.softcap(p.softcap);
        }
        if alibi {
            opts = opts.alibi_slopes(&sv);
        }
        flash_into(kernels, p, (&q, &k, &v), &opts)
    };
    let (o, lse) = run(true);
    let (ro, rl) = reference::attention_with_alibi(p, &q, &k, &v, &[], slopes).unwrap();
    let tol = if dt == Dtype::F32 { 2e-5 } else { 1.6e-2 };
    for (i, (&g, &r)) in o.iter().zip(&ro).enumerate() {
        assert!((g as f64 - r).abs() <= tol, "o[{i}] = {g}, reference {r} ({p:?})");
    }
    for (i, (&g, &r)) in lse.iter().zip(&rl).enumerate() {
        if r == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "lse[{i}]");
        } else {
            assert!((g as f64 - r).abs() <= 1e-4 * r.abs().max(1.0), "lse[{i}] = {g}, reference {r} ({p:?})");
        }
    }
    let (o0, _) = run(false);
    let moved = o.iter().zip(&o0).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(moved > 0.05, "ALiBi changed O by at most {moved}: the case does not test it ({p:?})");
}

#[test]
fn forward_with_per_head_and_per_sequence_slopes_matches_the_reference() {
    let kernels = Kernels::vm().unwrap();
    let base = Problem { batch: 2, heads: 6, heads_kv: Some(2), head_dim: 64, ..Problem::default() };
    let cases = [
        // f32 SIMT: causal, seq_q < seq_kv, the paper's slopes.
        (Problem { seq_q: 37, seq_kv: 90, causal: true, ..base }, alibi_slopes(6)),
        // f32: seq_q > seq_kv with a window on both sides and a soft cap, per-sequence slopes.
        (
            Problem { seq_q: 70, seq_kv: 45, window: (9, 4), softcap: 3.0, ..base },
            (0..12).map(|i| 0.05 + 0.07 * i as f32).collect(),
        ),
        // bf16 tensor cores at d64 and d128: two query blocks, GQA, per-sequence slopes.
        (
            Problem { seq_q: 150, seq_kv: 201, causal: true, dtype: Dtype::Bf16, ..base },
            (0..12).map(|i| 0.02 * (i + 1) as f32).collect(),
        ),
        (Problem { seq_q: 90, seq_kv: 60, head_dim: 128, softcap: 10.0, dtype: Dtype::F16, ..base }, alibi_slopes(6)),
    ];
    for (p, slopes) in &cases {
        forward_case(&kernels, p, slopes);
    }
}

#[test]
fn varlen_slopes_follow_each_packed_sequence() {
    let kernels = Kernels::vm().unwrap();
    let (h, hk, d, dt) = (4usize, 2usize, 64usize, Dtype::Bf16);
    let (lq, lk) = ([40u32, 0, 1, 77], [60u32, 5, 1, 30]);
    let p = Problem::varlen(
        Problem {
            heads: h as u32,
            heads_kv: Some(hk as u32),
            head_dim: d as u32,
            causal: true,
            dtype: dt,
            ..Problem::default()
        },
        &lq,
        &lk,
    )
    .unwrap();
    let slopes: Vec<f32> = (0..4 * h).map(|i| 0.03 * (i + 1) as f32).collect();
    let (tq, tk) = (p.total_q() as usize, p.total_kv() as usize);
    let (q, k, v) = (data(tq * h * d, 31, dt), data(tk * hk * d, 32, dt), data(tk * hk * d, 33, dt));
    let up = |x: &[f32]| kernels.vm_upload_as(dt, x).unwrap();
    let (qb, kb, vb) = (up(&q), up(&k), up(&v));
    let ob = kernels.vm_upload_as(dt, &vec![f32::NAN; q.len()]).unwrap();
    let lb = kernels.vm_upload(&vec![f32::NAN; h * tq]).unwrap();
    let sb = kernels.vm_upload(&slopes).unwrap();
    let sv = AlibiView::vm(&sb, Some(4), h).unwrap();
    let cu = |l: &[u32]| memattn::problem::Varlen::cu(l);
    let (cq, ck) = (kernels.index_tensor(&cu(&lq), None).unwrap(), kernels.index_tensor(&cu(&lk), None).unwrap());
    kernels
        .flash_attn_varlen_into(
            &TensorView::vm(&qb, dt, [1, tq, h, d]).unwrap(),
            &TensorView::vm(&kb, dt, [1, tk, hk, d]).unwrap(),
            &TensorView::vm(&vb, dt, [1, tk, hk, d]).unwrap(),
            &cq,
            &ck,
            77,
            60,
            &mut TensorViewMut::vm(&ob, dt, [1, tq, h, d]).unwrap(),
            &mut LseViewMut::vm(&lb, 1, h, tq).unwrap(),
            &AttnOpts::new().causal(true).alibi_slopes(&sv),
        )
        .unwrap();
    let o = ob.read_f32(dt, q.len()).unwrap();
    let lse = lb.read_f32(Dtype::F32, h * tq).unwrap();
    let (ro, rl) = reference::attention_with_alibi(&p, &q, &k, &v, &[], &slopes).unwrap();
    for (i, (&g, &r)) in o.iter().zip(&ro).enumerate() {
        assert!((g as f64 - r).abs() <= 1.6e-2, "o[{i}] = {g}, reference {r}");
    }
    for (i, (&g, &r)) in lse.iter().zip(&rl).enumerate() {
        if r == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "lse[{i}]");
        } else {
            assert!((g as f64 - r).abs() <= 1e-4 * r.abs().max(1.0), "lse[{i}] = {g}, reference {r}");
        }
    }
}

#[test]
fn decode_with_slopes_matches_the_reference_on_both_kernels() {
    use memattn::decode::{
        reference as decode_ref, verify_decode, CacheLayout, DecodeInputs, DecodeKernel, DecodeProblem,
    };
    let kernels = Kernels::vm().unwrap();
    let base = DecodeProblem {
        batch: 3,
        heads: 8,
        heads_kv: 2,
        seq_q: 3,
        cache_seqlens: vec![200, 0, 57],
        seq_new: 2,
        alibi: true,
        ..DecodeProblem::default()
    };
    let cases = [
        (DecodeProblem { page_size: Some(16), ..base.clone() }, false),
        (DecodeProblem { dtype: Dtype::Bf16, kernel: DecodeKernel::Mma, head_dim: 128, ..base.clone() }, true),
        (DecodeProblem { dtype: Dtype::F16, softcap: 20.0, window_left: 50, ..base.clone() }, true),
        (DecodeProblem { dtype: Dtype::Bf16, kernel: DecodeKernel::Simt, page_size: Some(7), ..base.clone() }, false),
    ];
    for (p, per_batch) in cases {
        let mut x = DecodeInputs::random(&p, 9);
        if per_batch {
            // Per sequence and head, up to 0.24 per key: rows dominated by one key, whose P is
            // rounded to 16 bits.
            x.alibi_slopes = (0..p.batch * p.heads).map(|i| 0.01 * (i + 1) as f32).collect();
        }
        let dt = p.dtype;
        let (b, sq, h, hk, d) =
            (p.batch as usize, p.seq_q as usize, p.heads as usize, p.heads_kv as usize, p.head_dim as usize);
        let up = |v: &[f32]| kernels.vm_upload_as(dt, &[v, &[0.0][..]].concat()).unwrap();
        let (qb, kc, vc, kn, vn) = (up(&x.q), up(&x.k_cache), up(&x.v_cache), up(&x.k_new), up(&x.v_new));
        let cache_shape = match x.layout {
            CacheLayout::Contiguous { seq_cache } => [b, seq_cache as usize, hk, d],
            CacheLayout::Paged { page_size, num_pages, .. } => [num_pages as usize, page_size as usize, hk, d],
        };
        let seqlens = kernels.index_tensor(&p.cache_seqlens, None).unwrap();
        let table = kernels.index_tensor(&x.block_table, None).unwrap();
        let ob = kernels.vm_upload_as(dt, &vec![f32::NAN; b * sq * h * d]).unwrap();
        let lb = kernels.vm_upload(&vec![f32::NAN; b * h * sq]).unwrap();
        let sb = kernels.vm_upload(&x.alibi_slopes).unwrap();
        let sv = AlibiView::vm(&sb, per_batch.then_some(b), h).unwrap();
        let mut opts = AttnOpts::new()
            .causal(p.causal)
            .window_size(p.window_left, p.window_right)
            .decode_kernel(p.kernel)
            .num_splits(3)
            .alibi_slopes(&sv);
        if p.softcap > 0.0 {
            opts = opts.softcap(p.softcap);
        }
        let new_shape = [b, p.seq_new as usize, hk, d];
        kernels
            .flash_attn_with_kvcache_into(
                &TensorView::vm(&qb, dt, [b, sq, h, d]).unwrap(),
                &mut TensorViewMut::vm(&kc, dt, cache_shape).unwrap(),
                &mut TensorViewMut::vm(&vc, dt, cache_shape).unwrap(),
                Some(&TensorView::vm(&kn, dt, new_shape).unwrap()),
                Some(&TensorView::vm(&vn, dt, new_shape).unwrap()),
                &seqlens,
                (!x.block_table.is_empty()).then_some(&table),
                &mut TensorViewMut::vm(&ob, dt, [b, sq, h, d]).unwrap(),
                &mut LseViewMut::vm(&lb, b, h, sq).unwrap(),
                &opts,
            )
            .unwrap();
        let o = ob.read_f32(dt, b * sq * h * d).unwrap();
        let lse = lb.read_f32(Dtype::F32, b * h * sq).unwrap();
        let v = verify_decode(&p, &o, &lse, &decode_ref(&p, &x));
        assert!(v.passed, "{p:?}: {:?}", v.failures);
        // The same call's reference without the bias is far from it: the bias is tested.
        let flat =
            decode_ref(&DecodeProblem { alibi: false, ..p.clone() }, &DecodeInputs { alibi_slopes: vec![], ..x });
        assert!(!verify_decode(&p, &o, &lse, &flat).passed, "{p:?}: the output does not depend on ALiBi");
    }
}

#[test]
fn slopes_that_do_not_fit_and_the_backward_are_refused() {
    let kernels = Kernels::vm().unwrap();
    let (b, s, h, d) = (2usize, 20usize, 4usize, 64usize);
    let qb = kernels.vm_upload(&data(b * s * h * d, 1, Dtype::F32)).unwrap();
    let ob = kernels.vm_alloc((b * s * h * d * 4) as u64).unwrap();
    let lb = kernels.vm_alloc((b * h * s * 4) as u64).unwrap();
    let sb = kernels.vm_upload(&[0.5; 12]).unwrap();
    let qv = TensorView::vm(&qb, Dtype::F32, [b, s, h, d]).unwrap();
    let call = |sv: &AlibiView<'_>| {
        kernels.flash_attn_into(
            &qv,
            &qv,
            &qv,
            &mut TensorViewMut::vm(&ob, Dtype::F32, [b, s, h, d]).unwrap(),
            &mut LseViewMut::vm(&lb, b, h, s).unwrap(),
            &AttnOpts::new().alibi_slopes(sv),
        )
    };
    let e = call(&AlibiView::vm(&sb, None, 3).unwrap()).unwrap_err();
    assert_eq!(e, AttnError::Alibi { why: AlibiRule::Heads { got: 3, heads: 4 } }, "{e}");
    let e = call(&AlibiView::vm(&sb, Some(3), 4).unwrap()).unwrap_err();
    assert_eq!(e, AttnError::Alibi { why: AlibiRule::Batch { got: 3, batch: 2 } }, "{e}");
    assert!(e.to_string().contains("give [heads] or [batch, heads]"), "{e}");
    // A view past the buffer's end is refused as any tensor is.
    assert!(call(&AlibiView::vm(&sb, Some(4), 4).unwrap()).is_err());
    call(&AlibiView::vm(&sb, Some(2), 4).unwrap()).unwrap();
    // The backward has no ALiBi.
    let sv = AlibiView::vm(&sb, None, 4).unwrap();
    let lse = memattn::attn::LseView::vm(&lb, b, h, s).unwrap();
    let e = kernels
        .flash_attn_backward(&qv, &qv, &qv, &qv, &lse, &qv, &AttnOpts::new().alibi_slopes(&sv), &Default::default())
        .unwrap_err();
    assert_eq!(e, AttnError::Alibi { why: AlibiRule::Unsupported { call: "the backward" } }, "{e}");
}
