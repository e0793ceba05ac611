//! memattn's kernels (in the PTX VM, through the candle op) against attention written with
//! candle's own tensor ops: `softmax(q kᵀ · scale [+ mask]) v` with candle's matmul, max, exp and
//! sum, in f32 (on the same rounded inputs for bf16) — a check by code this project did not write.

use candle_core::{DType, Device, Tensor, D};

/// k/v heads repeated to q's with candle's ops (`repeat_kv`, as candle-transformers' models do):
/// `[b, s, hk, d]` -> `[b, s, hk * n_rep, d]`, query head `i` reading k/v head `i / n_rep`.
fn repeat_kv(x: &Tensor, n_rep: usize) -> candle_core::Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, s, hk, d) = x.dims4()?;
    x.unsqueeze(3)?.expand((b, s, hk, n_rep, d))?.reshape((b, s, hk * n_rep, d))
}

/// Attention with candle's ops; q `[b, sq, h, d]`, k and v `[b, skv, hk, d]` (hk dividing h,
/// repeated with [`repeat_kv`]). Returns o `[b, sq, h, d]` and lse `[b, h, sq]`, both f32.
fn candle_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
) -> candle_core::Result<(Tensor, Tensor)> {
    let n_rep = q.dim(2)? / k.dim(2)?;
    let (k, v) = (repeat_kv(k, n_rep)?, repeat_kv(v, n_rep)?);
    let (q, k, v) = (q.to_dtype(DType::F32)?, k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?);
    let q = q.transpose(1, 2)?.contiguous()?; // [b, h, sq, d]
    let k = k.transpose(1, 2)?.contiguous()?;
    let v = v.transpose(1, 2)?.contiguous()?;
    let mut s = (q.matmul(&k.t()?)? * scale)?; // [b, h, sq, skv]
    let (sq, skv) = (s.dim(2)?, s.dim(3)?);
    if causal {
        // Bottom-right aligned: query i sees key j iff j <= i + skv - sq.
        let mask: Vec<f32> = (0..sq)
            .flat_map(|i| {
                (0..skv)
                    .map(move |j| if j as i64 <= i as i64 + skv as i64 - sq as i64 { 0.0 } else { f32::NEG_INFINITY })
            })
            .collect();
        s = s.broadcast_add(&Tensor::from_vec(mask, (sq, skv), &Device::Cpu)?)?;
    }
    let m = s.max_keepdim(D::Minus1)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let l = e.sum_keepdim(D::Minus1)?;
    let p = e.broadcast_div(&l)?;
    let o = p.matmul(&v)?.transpose(1, 2)?.contiguous()?;
    let lse = (m + l.log()?)?.squeeze(D::Minus1)?;
    Ok((o, lse))
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap().abs().unwrap();
    d.flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

fn case(dtype: DType, causal: bool, (b, sq, skv, h, d): (usize, usize, usize, usize, usize), tol: f32) {
    gqa_case(dtype, causal, (b, sq, skv, h, h, d), tol)
}

fn gqa_case(dtype: DType, causal: bool, (b, sq, skv, h, hk, d): (usize, usize, usize, usize, usize, usize), tol: f32) {
    let dev = Device::Cpu;
    let r = |n| Tensor::randn(0f32, 1.0, n, &dev).unwrap().to_dtype(dtype).unwrap();
    let (q, k, v) = (r((b, sq, h, d)), r((b, skv, hk, d)), r((b, skv, hk, d)));
    let scale = 1.0 / (d as f32).sqrt();
    let (o, lse) = memattn_candle::flash_attn_with_lse(&q, &k, &v, scale, causal).unwrap();
    let (ro, rl) = candle_attention(&q, &k, &v, scale as f64, causal).unwrap();
    assert_eq!((o.dims(), o.dtype()), (q.dims(), dtype));
    assert_eq!(lse.dims(), &[b, h, sq]);
    let (eo, el) = (max_abs_diff(&o, &ro), max_abs_diff(&lse, &rl));
    println!("{dtype:?} causal={causal} [{b},{sq},{h},{d}] kv {skv} x {hk} heads: max |o - candle| = {eo:.2e}, max |lse - candle| = {el:.2e}");
    assert!(eo <= tol, "o differs from candle's attention by {eo} (> {tol})");
    assert!(el <= 1e-4, "lse differs from candle's attention by {el}");
    // The one-line-switch signature returns the same o.
    let o2 = memattn_candle::flash_attn(&q, &k, &v, scale, causal).unwrap();
    assert_eq!(max_abs_diff(&o, &o2), 0.0);
}

#[test]
fn f32_matches_candle_ops_causal_and_not() {
    case(DType::F32, false, (2, 19, 45, 2, 64), 2e-5);
    case(DType::F32, true, (1, 30, 47, 3, 64), 2e-5);
}

#[test]
fn bf16_matches_candle_ops_causal_and_not() {
    // bf16 output: one rounding of o (2^-8 relative at most) on top of the kernel's f32 accumulation.
    case(DType::BF16, false, (1, 21, 40, 2, 64), 1.6e-2);
    case(DType::BF16, true, (2, 17, 33, 2, 64), 1.6e-2);
}

/// Head dims without a kernel of their own (Stable Diffusion 1.5's 40 and 160, StableLM-3B's 80,
/// and 120, 200) run on the next compiled kernel with the head dim padded: every dtype, causal
/// and not, GQA (the KV-cache call at those head dims: `kvcache_append.rs`).
#[test]
fn padded_head_dims_match_candle_ops() {
    for d in [40, 80, 120, 160, 200] {
        case(DType::F32, true, (1, 19, 33, 2, d), 2e-5);
        gqa_case(DType::BF16, false, (2, 17, 21, 2, 1, d), 1.6e-2);
        // Causal with seq_q <= seq_kv: every row sees a key (candle's softmax of a fully
        // masked row is NaN, where memattn gives O = 0).
        case(DType::F16, true, (1, 13, 21, 2, d), 2e-3);
    }
    // Head dims that are not a multiple of 8, or past 256, are refused naming the rule.
    let dev = Device::Cpu;
    for d in [84, 264] {
        let q = Tensor::zeros((1, 4, 2, d), DType::F32, &dev).unwrap();
        let e = memattn_candle::flash_attn(&q, &q, &q, 0.1, false).unwrap_err().to_string();
        assert!(e.contains(&format!("head_dim {d}")) && e.contains("any other multiple of 8 up to 256"), "{e}");
    }
}

#[test]
fn strided_inputs_and_refusals() {
    let dev = Device::Cpu;
    // k and v as a BHSD tensor transposed to [b, s, h, d]: non-contiguous, last dim contiguous.
    let q = Tensor::randn(0f32, 1.0, (1, 16, 2, 64), &dev).unwrap();
    let kt = Tensor::randn(0f32, 1.0, (1, 2, 20, 64), &dev).unwrap();
    let k = kt.transpose(1, 2).unwrap();
    assert!(!k.is_contiguous());
    let o = memattn_candle::flash_attn(&q, &k, &k, 0.125, false).unwrap();
    let (ro, _) = candle_attention(&q, &k, &k, 0.125, false).unwrap();
    assert!(max_abs_diff(&o, &ro) <= 2e-5);
    // k/v heads that do not divide q's are refused (typed error from memattn), not run wrongly.
    let kv3 = Tensor::randn(0f32, 1.0, (1, 20, 3, 64), &dev).unwrap();
    let q4 = Tensor::randn(0f32, 1.0, (1, 16, 4, 64), &dev).unwrap();
    let e = memattn_candle::flash_attn(&q4, &kv3, &kv3, 0.125, false).unwrap_err().to_string();
    assert!(e.contains("3 heads do not divide q's 4 heads"), "{e}");
    let q84 = Tensor::randn(0f32, 1.0, (1, 16, 2, 84), &dev).unwrap();
    let e = memattn_candle::flash_attn(&q84, &q84, &q84, 0.1, false).unwrap_err().to_string();
    assert!(e.contains("head_dim 84") && e.contains("32, 64, 96, 128, 192 and 256"), "{e}");
    let qi = Tensor::zeros((1, 16, 2, 64), DType::U32, &dev).unwrap();
    let e = memattn_candle::flash_attn(&qi, &qi, &qi, 0.1, false).unwrap_err().to_string();
    assert!(e.contains("U32") && e.contains("bf16"), "{e}");
}

#[test]
fn gqa_matches_candle_ops_with_repeat_kv() {
    // 8 q heads over 2 and over 1 (MQA) k/v heads; candle's side repeats k/v with its own ops.
    gqa_case(DType::F32, true, (1, 21, 37, 8, 2, 64), 2e-5);
    gqa_case(DType::F32, false, (2, 9, 14, 4, 1, 64), 2e-5);
    gqa_case(DType::BF16, true, (1, 17, 30, 4, 2, 64), 1.6e-2);
}

#[test]
fn windowed_matches_candle_ops_with_a_band_mask() {
    let dev = Device::Cpu;
    let (sq, skv, h, d, left) = (23usize, 31usize, 2usize, 64usize, 5usize);
    let r = |n| Tensor::randn(0f32, 1.0, n, &dev).unwrap();
    let (q, k, v) = (r((1, sq, h, d)), r((1, skv, h, d)), r((1, skv, h, d)));
    let o = memattn_candle::flash_attn_windowed(&q, &k, &v, 0.125, Some(left), Some(0)).unwrap();
    // The same band with candle's ops: key j visible iff i + off - left <= j <= i + off.
    let off = skv as i64 - sq as i64;
    let mask: Vec<f32> = (0..sq as i64)
        .flat_map(|i| {
            (0..skv as i64)
                .map(move |j| if j >= i + off - left as i64 && j <= i + off { 0.0 } else { f32::NEG_INFINITY })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (sq, skv), &dev).unwrap();
    let (qt, kt, vt) = (
        q.transpose(1, 2).unwrap(),
        k.transpose(1, 2).unwrap().contiguous().unwrap(),
        v.transpose(1, 2).unwrap().contiguous().unwrap(),
    );
    let s = (qt.contiguous().unwrap().matmul(&kt.t().unwrap()).unwrap() * 0.125).unwrap().broadcast_add(&mask).unwrap();
    let p = candle_nn_softmax(&s);
    let ro = p.matmul(&vt).unwrap().transpose(1, 2).unwrap();
    let e = max_abs_diff(&o, &ro);
    println!("F32 window ({left}, 0) [1,{sq},{h},{d}] kv {skv}: max |o - candle| = {e:.2e}");
    assert!(e <= 2e-5, "{e}");
    // Without the left bound it is causal attention.
    let oc = memattn_candle::flash_attn_windowed(&q, &k, &v, 0.125, None, Some(0)).unwrap();
    assert_eq!(max_abs_diff(&oc, &memattn_candle::flash_attn(&q, &k, &v, 0.125, true).unwrap()), 0.0);
}

/// Softmax over the last dim with candle's max, exp and sum.
fn candle_nn_softmax(s: &Tensor) -> Tensor {
    let m = s.max_keepdim(D::Minus1).unwrap();
    let e = s.broadcast_sub(&m).unwrap().exp().unwrap();
    let l = e.sum_keepdim(D::Minus1).unwrap();
    e.broadcast_div(&l).unwrap()
}

#[test]
fn varlen_matches_per_sequence_candle_ops_attention() {
    let dev = Device::Cpu;
    // Three packed sequences (one empty), GQA 4/2, causal per sequence (seq_q <= seq_kv each).
    let (lq, lk) = ([7usize, 0, 19], [12usize, 3, 19]);
    let (h, hk, d) = (4usize, 2usize, 64usize);
    let prefix = |l: &[usize]| -> Vec<u32> {
        std::iter::once(0)
            .chain(l.iter().scan(0u32, |t, &x| {
                *t += x as u32;
                Some(*t)
            }))
            .collect()
    };
    let (cq, ck) = (prefix(&lq), prefix(&lk));
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    for (dtype, tol) in [(DType::F32, 2e-5f32), (DType::BF16, 1.6e-2)] {
        let r = |n| Tensor::randn(0f32, 1.0, n, &dev).unwrap().to_dtype(dtype).unwrap();
        let (q, k, v) = (r((tq, h, d)), r((tk, hk, d)), r((tk, hk, d)));
        let (sq_t, sk_t) = (Tensor::new(cq.as_slice(), &dev).unwrap(), Tensor::new(ck.as_slice(), &dev).unwrap());
        let (o, lse) =
            memattn_candle::flash_attn_varlen_with_lse(&q, &k, &v, &sq_t, &sk_t, 19, 19, 0.125, true).unwrap();
        assert_eq!((o.dims(), lse.dims()), (&[tq, h, d][..], &[h, tq][..]));
        let (mut eo, mut el) = (0f32, 0f32);
        for s in 0..lq.len() {
            if lq[s] == 0 {
                continue;
            }
            let (q0, k0) = (cq[s] as usize, ck[s] as usize);
            let qs = q.narrow(0, q0, lq[s]).unwrap().unsqueeze(0).unwrap();
            let ks = k.narrow(0, k0, lk[s]).unwrap().unsqueeze(0).unwrap();
            let vs = v.narrow(0, k0, lk[s]).unwrap().unsqueeze(0).unwrap();
            let (ro, rl) = candle_attention(&qs, &ks, &vs, 0.125, true).unwrap();
            eo = eo.max(max_abs_diff(&o.narrow(0, q0, lq[s]).unwrap().unsqueeze(0).unwrap(), &ro));
            el = el.max(max_abs_diff(&lse.narrow(1, q0, lq[s]).unwrap().unsqueeze(0).unwrap(), &rl));
        }
        println!("{dtype:?} varlen causal q {lq:?} kv {lk:?} {h}/{hk} heads: max |o - candle| = {eo:.2e}, max |lse - candle| = {el:.2e}");
        assert!(eo <= tol && el <= 1e-4, "o {eo}, lse {el}");
        // The one-line-switch signature returns the same o.
        let o2 = memattn_candle::flash_attn_varlen(&q, &k, &v, &sq_t, &sk_t, 19, 19, 0.125, true).unwrap();
        assert_eq!(max_abs_diff(&o, &o2), 0.0);
    }
    // Bad prefix sums are refused with the rule named.
    let q = Tensor::zeros((26, h, d), DType::F32, &dev).unwrap();
    let k = Tensor::zeros((34, hk, d), DType::F32, &dev).unwrap();
    let bad = Tensor::new(&[0u32, 7, 6, 26], &dev).unwrap();
    let sk_t = Tensor::new(ck.as_slice(), &dev).unwrap();
    let e = memattn_candle::flash_attn_varlen(&q, &k, &k, &bad, &sk_t, 19, 19, 0.125, true).unwrap_err().to_string();
    assert!(e.contains("non-decreasing"), "{e}");
    let e = memattn_candle::flash_attn_varlen(&q, &k, &k, &q, &sk_t, 19, 19, 0.125, true).unwrap_err().to_string();
    assert!(e.contains("1-d u32"), "{e}");
}

#[test]
fn kvcache_matches_candle_ops_over_the_gathered_pages() {
    let dev = Device::Cpu;
    let (b, h, hk, d, page, pages) = (2usize, 4usize, 2usize, 64usize, 8usize, 6usize);
    let lens = [13u32, 20];
    let table = [4u32, 1, 5, 0, 3, 2]; // [batch, max_pages = 3]
    for (dtype, tol) in [(DType::F32, 2e-5f32), (DType::BF16, 1.6e-2)] {
        let r = |n| Tensor::randn(0f32, 1.0, n, &dev).unwrap().to_dtype(dtype).unwrap();
        let q = r((b, 1, h, d));
        let seqlens = Tensor::new(&lens, &dev).unwrap();
        // Paged, 3 KV splits; then the same keys in a contiguous cache, memattn's split choice.
        let (kp, vp) = (r((pages, page, hk, d)), r((pages, page, hk, d)));
        let bt = Tensor::from_slice(&table, (b, 3), &dev).unwrap();
        let (o, lse) = memattn_candle::flash_attn_with_kvcache_with_lse(
            &q,
            &kp,
            &vp,
            None,
            None,
            &seqlens,
            Some(&bt),
            0.125,
            true,
            3,
        )
        .unwrap();
        let gather = |c: &Tensor, s: usize| -> Tensor {
            let ids = Tensor::new(&table[s * 3..s * 3 + 3], &dev).unwrap();
            c.index_select(&ids, 0).unwrap().reshape((3 * page, hk, d)).unwrap().narrow(0, 0, lens[s] as usize).unwrap()
        };
        let (kc, vc) = (r((b, 24, hk, d)), r((b, 24, hk, d)));
        let oc =
            memattn_candle::flash_attn_with_kvcache(&q, &kc, &vc, None, None, &seqlens, None, 0.125, true, 0).unwrap();
        let (mut eo, mut el, mut ec) = (0f32, 0f32, 0f32);
        for (s, &len) in lens.iter().enumerate() {
            let qs = q.narrow(0, s, 1).unwrap();
            let (ks, vs) = (gather(&kp, s).unsqueeze(0).unwrap(), gather(&vp, s).unsqueeze(0).unwrap());
            let (ro, rl) = candle_attention(&qs, &ks, &vs, 0.125, true).unwrap();
            eo = eo.max(max_abs_diff(&o.narrow(0, s, 1).unwrap(), &ro));
            el = el.max(max_abs_diff(&lse.narrow(0, s, 1).unwrap(), &rl));
            let n = len as usize;
            let (ks, vs) = (
                kc.narrow(0, s, 1).unwrap().narrow(1, 0, n).unwrap(),
                vc.narrow(0, s, 1).unwrap().narrow(1, 0, n).unwrap(),
            );
            let (ro, _) = candle_attention(&qs, &ks, &vs, 0.125, true).unwrap();
            ec = ec.max(max_abs_diff(&oc.narrow(0, s, 1).unwrap(), &ro));
        }
        println!("{dtype:?} kvcache paged (3 splits) lens {lens:?} {h}/{hk} heads: max |o - candle| = {eo:.2e}, max |lse - candle| = {el:.2e}; contiguous: {ec:.2e}");
        assert!(eo <= tol && ec <= tol && el <= 1e-4, "o {eo}, contiguous {ec}, lse {el}");
    }
    // A block-table entry past the cache's pages is refused with the rule named.
    let q = Tensor::zeros((b, 1, h, d), DType::F32, &dev).unwrap();
    let kp = Tensor::zeros((pages, page, hk, d), DType::F32, &dev).unwrap();
    let bad = Tensor::from_slice(&[4u32, 9, 5, 0, 3, 2], (b, 3), &dev).unwrap();
    let e = memattn_candle::flash_attn_with_kvcache(
        &q,
        &kp,
        &kp,
        None,
        None,
        &Tensor::new(&lens, &dev).unwrap(),
        Some(&bad),
        0.1,
        true,
        0,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("block_table[0][1] = 9 is past num_pages (6)"), "{e}");
}

/// `flash_attn_alibi`, `flash_attn_alibi_windowed`, `flash_attn_alibi_windowed_softcap` and
/// `flash_attn_varlen_alibi` against candle's ops with the bias written out as a tensor
/// (`-slope · |i + skv - sq - j|`, per batch and head), the band mask and the soft cap; and the
/// backward refused.
#[test]
fn alibi_matches_candle_ops_with_the_bias_as_a_tensor() {
    let dev = Device::Cpu;
    let (b, sq, skv, h, hk, d) = (2usize, 37usize, 70usize, 6usize, 2usize, 64usize);
    let r = |n| Tensor::randn(0f32, 1.0, n, &dev).unwrap();
    let (q, k, v) = (r((b, sq, h, d)), r((b, skv, hk, d)), r((b, skv, hk, d)));
    let scale = 1.0 / (d as f32).sqrt();
    // [batch, heads] slopes; the [heads] form is the first row repeated.
    let slopes: Vec<f32> = (0..b * h).map(|i| 0.05 + 0.03 * i as f32).collect();
    let st = Tensor::from_vec(slopes.clone(), (b, h), &dev).unwrap();
    // softmax(s + bias + mask) v with candle's ops, f32; `window` (left, right) as the band.
    let want = |cap: Option<f32>, window: (Option<usize>, Option<usize>), causal: bool| -> Tensor {
        let n_rep = h / hk;
        let (k, v) = (repeat_kv(&k, n_rep).unwrap(), repeat_kv(&v, n_rep).unwrap());
        let t = |x: &Tensor| x.transpose(1, 2).unwrap().contiguous().unwrap();
        let mut s = (t(&q).matmul(&t(&k).t().unwrap()).unwrap() * scale as f64).unwrap();
        if let Some(c) = cap {
            s = ((s / c as f64).unwrap().tanh().unwrap() * c as f64).unwrap();
        }
        let right = if causal { Some(0) } else { window.1 };
        let mut bias = Vec::with_capacity(b * h * sq * skv);
        for bb in 0..b {
            for hh in 0..h {
                for i in 0..sq {
                    for j in 0..skv {
                        let diag = i as i64 + skv as i64 - sq as i64;
                        let seen = window.0.is_none_or(|l| j as i64 >= diag - l as i64)
                            && right.is_none_or(|r| j as i64 <= diag + r as i64);
                        bias.push(if seen {
                            -slopes[bb * h + hh] * (diag - j as i64).abs() as f32
                        } else {
                            f32::NEG_INFINITY
                        });
                    }
                }
            }
        }
        let s = (s + Tensor::from_vec(bias, (b, h, sq, skv), &dev).unwrap()).unwrap();
        let m = s.max_keepdim(D::Minus1).unwrap();
        let e = s.broadcast_sub(&m).unwrap().exp().unwrap();
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
        p.matmul(&t(&v)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap()
    };
    let o = memattn_candle::flash_attn_alibi(&q, &k, &v, &st, scale, true).unwrap();
    let e = max_abs_diff(&o, &want(None, (None, None), true));
    assert!(e <= 2e-5, "flash_attn_alibi: {e}");
    let o = memattn_candle::flash_attn_alibi_windowed(&q, &k, &v, &st, scale, Some(20), Some(5)).unwrap();
    let e = max_abs_diff(&o, &want(None, (Some(20), Some(5)), false));
    assert!(e <= 2e-5, "flash_attn_alibi_windowed: {e}");
    let o =
        memattn_candle::flash_attn_alibi_windowed_softcap(&q, &k, &v, Some(&st), scale, Some(20), None, 3.0).unwrap();
    let e = max_abs_diff(&o, &want(Some(3.0), (Some(20), None), false));
    assert!(e <= 2e-5, "flash_attn_alibi_windowed_softcap: {e}");
    // Without the bias the result is far from it: the test sees ALiBi.
    let plain = memattn_candle::flash_attn(&q, &k, &v, scale, true).unwrap();
    assert!(max_abs_diff(&plain, &want(None, (None, None), true)) > 0.05);
    // bf16 within the usual 16-bit bound.
    let bf = |x: &Tensor| x.to_dtype(DType::BF16).unwrap();
    let o = memattn_candle::flash_attn_alibi(&bf(&q), &bf(&k), &bf(&v), &st, scale, true).unwrap();
    let e = max_abs_diff(&o, &want(None, (None, None), true));
    assert!(e <= 3e-2, "bf16 flash_attn_alibi: {e}");
    // Packed: the two batches as two sequences of the same lengths, one slope row each.
    let pack = |x: &Tensor| x.reshape((x.dim(0).unwrap() * x.dim(1).unwrap(), x.dim(2).unwrap(), d)).unwrap();
    let cu = |n: usize| Tensor::from_vec(vec![0u32, n as u32, 2 * n as u32], 3, &dev).unwrap();
    let o = memattn_candle::flash_attn_varlen_alibi(
        &pack(&q),
        &pack(&k),
        &pack(&v),
        &st,
        &cu(sq),
        &cu(skv),
        sq,
        skv,
        scale,
        true,
    )
    .unwrap();
    let e = max_abs_diff(&o, &pack(&want(None, (None, None), true)));
    assert!(e <= 2e-5, "flash_attn_varlen_alibi: {e}");
    // Refusals: slopes of the wrong dtype or count; the backward.
    let bad = Tensor::from_vec(vec![0.1f32; 5], 5, &dev).unwrap();
    let e = memattn_candle::flash_attn_alibi(&q, &k, &v, &bad, scale, true).unwrap_err().to_string();
    assert!(e.contains("5 slopes per sequence for q's 6 heads"), "{e}");
    let e = memattn_candle::flash_attn_alibi(&q, &k, &v, &bf(&st), scale, true).unwrap_err().to_string();
    assert!(e.contains("alibi_slopes must be an f32 tensor"), "{e}");
    let qv = candle_core::Var::from_tensor(&q).unwrap();
    let o = memattn_candle::flash_attn_alibi(qv.as_tensor(), &k, &v, &st, scale, true).unwrap();
    let e = o.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("ALiBi has no backward"), "{e}");
}

/// `flash_attn_varlen_paged_windowed` (a mixed batch: a prefill chunk of 37 tokens over 50 keys,
/// a chunk longer than its keys, two decode rows) against candle's ops per sequence over the
/// pages gathered with `index_select`, causal as `window_size_right = Some(0)`; refusals.
#[test]
fn varlen_paged_matches_candle_ops_over_the_gathered_pages() {
    let dev = Device::Cpu;
    let (h, hk, d, page) = (4usize, 2usize, 64usize, 8usize);
    let chunks = [37u32, 12, 1, 1];
    let keys = [50u32, 7, 19, 1];
    let max_blocks = 7;
    // Sequence s owns pages s, s + 4, s + 8, ... (interleaved in the pool), unused entries 0.
    let mut table = vec![0u32; chunks.len() * max_blocks];
    for (s, &n) in keys.iter().enumerate() {
        for p in 0..(n as usize).div_ceil(page) {
            table[s * max_blocks + p] = (s + 4 * p) as u32;
        }
    }
    let blocks = 4 * max_blocks;
    let prefix = |x: &[u32]| -> Vec<u32> {
        std::iter::once(0)
            .chain(x.iter().scan(0, |a, &n| {
                *a += n;
                Some(*a)
            }))
            .collect()
    };
    let total_q = chunks.iter().sum::<u32>() as usize;
    let r = |n: &[usize]| Tensor::randn(0f32, 1.0, n, &dev).unwrap().to_dtype(DType::BF16).unwrap();
    let (q, kc, vc) = (r(&[total_q, h, d]), r(&[blocks, page, hk, d]), r(&[blocks, page, hk, d]));
    let (cq, ck) = (Tensor::new(prefix(&chunks), &dev).unwrap(), Tensor::new(prefix(&keys), &dev).unwrap());
    let bt = Tensor::from_slice(&table, (chunks.len(), max_blocks), &dev).unwrap();
    let call = |q: &Tensor, page_block_size: usize, max_k: usize| {
        memattn_candle::flash_attn_varlen_paged_windowed(
            q,
            &kc,
            &vc,
            &cq,
            &ck,
            &bt,
            37,
            max_k,
            0.125,
            None,
            Some(0),
            page_block_size,
            None,
        )
    };
    let o = call(&q, page, 50).unwrap();
    assert_eq!(o.dims(), [total_q, h, d]);
    let mut err = 0f32;
    let mut row = 0;
    for (s, (&n, &len)) in chunks.iter().zip(&keys).enumerate() {
        let ids = Tensor::new(&table[s * max_blocks..(s + 1) * max_blocks], &dev).unwrap();
        let gather = |c: &Tensor| {
            c.index_select(&ids, 0)
                .unwrap()
                .reshape((max_blocks * page, hk, d))
                .unwrap()
                .narrow(0, 0, len as usize)
                .unwrap()
        };
        let qs = q.narrow(0, row, n as usize).unwrap().unsqueeze(0).unwrap();
        let (ro, _) =
            candle_attention(&qs, &gather(&kc).unsqueeze(0).unwrap(), &gather(&vc).unsqueeze(0).unwrap(), 0.125, true)
                .unwrap();
        let mine = o.narrow(0, row, n as usize).unwrap().unsqueeze(0).unwrap();
        // A chunk longer than its keys: its first rows see nothing (O = 0; candle's softmax of an
        // all -inf row is NaN, so only the rows that see a key are compared).
        let skip = n.saturating_sub(len) as usize;
        if skip > 0 {
            let z = mine.narrow(1, 0, skip).unwrap().to_dtype(DType::F32).unwrap().abs().unwrap();
            assert_eq!(z.flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap(), 0.0);
        }
        let seen = n as usize - skip;
        err = err.max(max_abs_diff(&mine.narrow(1, skip, seen).unwrap(), &ro.narrow(1, skip, seen).unwrap()));
        row += n as usize;
    }
    println!("bf16 varlen paged chunks {chunks:?} keys {keys:?}: max |o - candle| = {err:.2e}");
    assert!(err <= 1.6e-2, "{err}");
    // Refusals: f32, a page size that is not k's, keys over max_seqlen_k.
    let err =
        |q: &Tensor, page_block_size: usize, max_k: usize| call(q, page_block_size, max_k).unwrap_err().to_string();
    assert!(err(&q.to_dtype(DType::F32).unwrap(), page, 50).contains("bf16 or f16"));
    assert!(err(&q, 16, 50).contains("page_block_size is 16"));
    assert!(err(&q, page, 49).contains("over max_seqlen_k"));
}
