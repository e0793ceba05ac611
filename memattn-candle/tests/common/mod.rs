//! Helpers shared by memattn-candle's integration tests.
#![allow(dead_code)]

use candle_core::{Device, Tensor, D};

/// One query token's attention with candle's ops: q `[1, h, d]`, k and v `[n, hk, d]` (f32),
/// scores soft-capped, keys before `n - 1 - window` masked. Returns o `[1, h, d]`.
pub fn candle_decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: usize,
    softcap: f64,
) -> candle_core::Result<Tensor> {
    let (n, hk, d) = k.dims3()?;
    let h = q.dim(1)?;
    let rep = h / hk;
    // [n, hk, d] -> [h, n, d], query head i reading k/v head i / rep.
    let spread = |x: &Tensor| -> candle_core::Result<Tensor> {
        x.transpose(0, 1)?.unsqueeze(1)?.expand((hk, rep, n, d))?.reshape((h, n, d))
    };
    let (k, v) = (spread(k)?, spread(v)?);
    let q = q.transpose(0, 1)?.contiguous()?; // [h, 1, d]
    let s = (q.matmul(&k.t()?)? * scale)?; // [h, 1, n]
    let s = ((s / softcap)?.tanh()? * softcap)?;
    let lo = (n - 1).saturating_sub(window);
    let mask: Vec<f32> = (0..n).map(|j| if j >= lo { 0.0 } else { f32::NEG_INFINITY }).collect();
    let s = s.broadcast_add(&Tensor::from_vec(mask, (1, n), &Device::Cpu)?)?;
    let m = s.max_keepdim(D::Minus1)?;
    let e = s.broadcast_sub(&m)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v.contiguous()?)?.transpose(0, 1) // [1, h, d]
}
