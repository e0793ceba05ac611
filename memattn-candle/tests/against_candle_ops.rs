//! memattn's kernels (in the PTX VM, through the candle op) against attention written with
//! candle's own tensor ops: `softmax(q kᵀ · scale [+ mask]) v` with candle's matmul, max, exp and
//! sum, in f32 (on the same rounded inputs for bf16) — a check by code this project did not write.

use candle_core::{DType, Device, Tensor, D};

/// Attention with candle's ops; q `[b, sq, h, d]`, k and v `[b, skv, h, d]`. Returns o
/// `[b, sq, h, d]` and lse `[b, h, sq]`, both f32.
fn candle_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
) -> candle_core::Result<(Tensor, Tensor)> {
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
    let dev = Device::Cpu;
    let r = |n| Tensor::randn(0f32, 1.0, n, &dev).unwrap().to_dtype(dtype).unwrap();
    let (q, k, v) = (r((b, sq, h, d)), r((b, skv, h, d)), r((b, skv, h, d)));
    let scale = 1.0 / (d as f32).sqrt();
    let (o, lse) = memattn_candle::flash_attn_with_lse(&q, &k, &v, scale, causal).unwrap();
    let (ro, rl) = candle_attention(&q, &k, &v, scale as f64, causal).unwrap();
    assert_eq!((o.dims(), o.dtype()), (q.dims(), dtype));
    assert_eq!(lse.dims(), &[b, h, sq]);
    let (eo, el) = (max_abs_diff(&o, &ro), max_abs_diff(&lse, &rl));
    println!("{dtype:?} causal={causal} [{b},{sq},{h},{d}] kv {skv}: max |o - candle| = {eo:.2e}, max |lse - candle| = {el:.2e}");
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
    // bf16 output: one rounding of o (2^-9 relative) on top of the kernel's f32 accumulation.
    case(DType::BF16, false, (1, 21, 40, 2, 64), 1.6e-2);
    case(DType::BF16, true, (2, 17, 33, 2, 64), 1.6e-2);
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
    // Grouped-query attention is refused (typed error from memattn), not run wrongly.
    let kv1 = Tensor::randn(0f32, 1.0, (1, 20, 1, 64), &dev).unwrap();
    let e = memattn_candle::flash_attn(&q, &kv1, &kv1, 0.125, false).unwrap_err().to_string();
    assert!(e.contains("grouped-query") && e.contains("not supported"), "{e}");
    let q80 = Tensor::randn(0f32, 1.0, (1, 16, 2, 80), &dev).unwrap();
    let e = memattn_candle::flash_attn(&q80, &q80, &q80, 0.1, false).unwrap_err().to_string();
    assert!(e.contains("head_dim 80") && e.contains("32, 64, 96, 128, 192 and 256"), "{e}");
    let qi = Tensor::zeros((1, 16, 2, 64), DType::U32, &dev).unwrap();
    let e = memattn_candle::flash_attn(&qi, &qi, &qi, 0.1, false).unwrap_err().to_string();
    assert!(e.contains("U32") && e.contains("bf16"), "{e}");
}
