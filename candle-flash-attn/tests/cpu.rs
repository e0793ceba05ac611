//! The drop-in on candle's CPU device (memattn's PTX VM): each road gives what memattn-candle's
//! op gives (the same kernels, bit for bit, gradients too), causal attention equals attention
//! written with candle's tensor ops, a soft cap of 0 is off, and `mm_prefix_ranges` with a range
//! is refused.

use candle_core::{DType, Device, Result, Tensor, D};

fn randn(shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// Causal attention (bottom-right aligned) with candle's own ops, `[b, s, h, d]` in and out.
fn candle_ops_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (q, k, v) =
        (q.transpose(1, 2)?.contiguous()?, k.transpose(1, 2)?.contiguous()?, v.transpose(1, 2)?.contiguous()?);
    let (sq, sk) = (q.dim(2)?, k.dim(2)?);
    let mask: Vec<f32> =
        (0..sq).flat_map(|i| (0..sk).map(move |j| if j <= i + sk - sq { 0.0 } else { f32::NEG_INFINITY })).collect();
    let mask = Tensor::from_vec(mask, (sq, sk), &Device::Cpu)?;
    let att = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?;
    let att = candle_core::Tensor::exp(&att.broadcast_sub(&att.max_keepdim(D::Minus1)?)?)?;
    let att = att.broadcast_div(&att.sum_keepdim(D::Minus1)?)?;
    att.matmul(&v)?.transpose(1, 2)
}

#[test]
fn flash_attn_is_memattn_candles_and_candle_ops_attention() -> Result<()> {
    let (q, k, v) = (randn(&[1, 6, 4, 32])?, randn(&[1, 9, 2, 32])?, randn(&[1, 9, 2, 32])?);
    let o = candle_flash_attn::flash_attn(&q, &k, &v, 0.3, true)?;
    assert_eq!(max_abs_diff(&o, &memattn_candle::flash_attn(&q, &k, &v, 0.3, true)?)?, 0.0);
    let rep = |t: &Tensor| -> Result<Tensor> {
        let (b, s, h, d) = t.dims4()?;
        t.unsqueeze(3)?.expand((b, s, h, 2, d))?.reshape((b, s, h * 2, d))
    };
    let reference = candle_ops_attention(&q, &rep(&k)?, &rep(&v)?, 0.3)?;
    assert!(max_abs_diff(&o, &reference)? < 1e-5);
    // The same op through the public struct, and a soft cap of 0 (FlashAttention-2's "off").
    let op = candle_flash_attn::FlashAttn {
        softmax_scale: 0.3,
        alibi_slopes: None,
        window_size_left: None,
        window_size_right: Some(0),
        softcap: None,
    };
    assert_eq!(max_abs_diff(&o, &q.apply_op3(&k, &v, op)?)?, 0.0);
    let capped = candle_flash_attn::flash_attn_alibi_windowed_softcap(&q, &k, &v, None, 0.3, None, Some(0), 0.0)?;
    assert_eq!(max_abs_diff(&o, &capped)?, 0.0);
    Ok(())
}

#[test]
fn varlen_is_memattn_candles() -> Result<()> {
    let (q, k, v) = (randn(&[7, 2, 32])?, randn(&[11, 2, 32])?, randn(&[11, 2, 32])?);
    let cu_q = Tensor::new(&[0u32, 3, 7], &Device::Cpu)?;
    let cu_k = Tensor::new(&[0u32, 5, 11], &Device::Cpu)?;
    let ours = candle_flash_attn::flash_attn_varlen(&q, &k, &v, &cu_q, &cu_k, 4, 6, 0.25, true)?;
    let theirs = memattn_candle::flash_attn_varlen(&q, &k, &v, &cu_q, &cu_k, 4, 6, 0.25, true)?;
    assert_eq!(max_abs_diff(&ours, &theirs)?, 0.0);
    Ok(())
}

/// Two sequences (20 and 9 keys in 16-row pages, 3 and 2 new queries) over a strided q view.
#[test]
fn paged_is_memattn_candles_and_mm_prefix_ranges_are_refused() -> Result<()> {
    let q = randn(&[2, 5, 32])?.to_dtype(DType::BF16)?.transpose(0, 1)?; // (5, 2, 32), not contiguous
    let k = randn(&[4, 16, 2, 32])?.to_dtype(DType::BF16)?;
    let v = randn(&[4, 16, 2, 32])?.to_dtype(DType::BF16)?;
    let cu_q = Tensor::new(&[0u32, 3, 5], &Device::Cpu)?;
    let cu_k = Tensor::new(&[0u32, 20, 29], &Device::Cpu)?;
    let table = Tensor::new(&[[0u32, 2], [3, 1]], &Device::Cpu)?;
    let call = |ranges: Option<&Tensor>| {
        candle_flash_attn::flash_attn_varlen_paged_windowed(
            &q,
            &k,
            &v,
            &cu_q,
            &cu_k,
            &table,
            ranges,
            3,
            20,
            0.2,
            None,
            Some(0),
            16,
            None,
        )
    };
    let ours = call(None)?;
    let theirs = memattn_candle::flash_attn_varlen_paged_windowed(
        &q.contiguous()?,
        &k,
        &v,
        &cu_q,
        &cu_k,
        &table,
        3,
        20,
        0.2,
        None,
        Some(0),
        16,
        None,
    )?;
    assert_eq!(ours.dims(), &[5, 2, 32]);
    assert_eq!(max_abs_diff(&ours, &theirs)?, 0.0);
    // An empty ranges tensor is no range: the call runs.
    let none = Tensor::zeros((2, 0, 2), DType::I32, &Device::Cpu)?;
    assert_eq!(max_abs_diff(&call(Some(&none))?, &ours)?, 0.0);
    let one = Tensor::new(&[[[0i32, 2]], [[0, 1]]], &Device::Cpu)?;
    let err = call(Some(&one)).expect_err("mm_prefix_ranges is refused").to_string();
    assert!(err.contains("mm_prefix_ranges") && err.contains("not supported"), "{err}");
    Ok(())
}

/// Gradients through the drop-in's op are memattn-candle's (candle-flash-attn has no backward).
#[test]
fn gradients_are_memattn_candles() -> Result<()> {
    let q = candle_core::Var::from_tensor(&randn(&[1, 5, 2, 32])?)?;
    let (k, v) = (randn(&[1, 7, 2, 32])?, randn(&[1, 7, 2, 32])?);
    let ours = candle_flash_attn::flash_attn(q.as_tensor(), &k, &v, 0.2, true)?.sum_all()?.backward()?;
    let theirs = memattn_candle::flash_attn(q.as_tensor(), &k, &v, 0.2, true)?.sum_all()?.backward()?;
    let (a, b) = (ours.get(q.as_tensor()).expect("dq"), theirs.get(q.as_tensor()).expect("dq"));
    assert_eq!(max_abs_diff(a, b)?, 0.0);
    Ok(())
}
