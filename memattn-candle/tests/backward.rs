//! candle's autograd through `memattn_candle::flash_attn` (the op's `bwd`: memattn's backward
//! kernels in the PTX VM) against autograd through attention written with candle's own ops,
//! `softmax(q kᵀ · scale [+ causal mask]) v` with k/v repeated for GQA: gradients of one loss
//! taken two ways by code that shares nothing.

use candle_core::{DType, Device, Tensor, Var, D};

/// Attention with candle's ops and candle's autograd; q `[b, sq, h, d]`, k, v `[b, skv, hk, d]`.
fn candle_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> candle_core::Result<Tensor> {
    let n_rep = q.dim(2)? / k.dim(2)?;
    let rep = |x: &Tensor| -> candle_core::Result<Tensor> {
        let (b, s, hk, d) = x.dims4()?;
        x.unsqueeze(3)?.expand((b, s, hk, n_rep, d))?.reshape((b, s, hk * n_rep, d))?.transpose(1, 2)?.contiguous()
    };
    let (k, v) = (rep(k)?, rep(v)?);
    let q = q.transpose(1, 2)?.contiguous()?;
    let mut s = (q.matmul(&k.t()?)? * scale)?;
    let (sq, skv) = (s.dim(2)?, s.dim(3)?);
    if causal {
        // Bottom-right aligned: query i sees key j iff j <= i + skv - sq.
        let mask: Vec<f32> = (0..sq)
            .flat_map(|i| (0..skv).map(move |j| if j + sq <= i + skv { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        s = s.broadcast_add(&Tensor::from_vec(mask, (sq, skv), &Device::Cpu)?)?;
    }
    let e = s.broadcast_sub(&s.max_keepdim(D::Minus1)?.detach())?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?.transpose(1, 2)?.contiguous()
}

/// max |a - b| / max |b|.
fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let max = |t: Tensor| t.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    max((a - b).unwrap()) / max(b.clone())
}

/// Gradients of `sum(O ∘ W)` (W random) with respect to q, k, v, both ways; compared.
fn case(causal: bool, (b, sq, skv, h, hk, d): (usize, usize, usize, usize, usize, usize)) {
    let dev = Device::Cpu;
    let var = |shape: (usize, usize, usize, usize)| Var::randn(0f32, 1.0, shape, &dev).unwrap();
    let (q, k, v) = (var((b, sq, h, d)), var((b, skv, hk, d)), var((b, skv, hk, d)));
    let w = Tensor::randn(0f32, 1.0, (b, sq, h, d), &dev).unwrap();
    let scale = 1.0 / (d as f32).sqrt();
    let loss = |o: Tensor| (o * &w).unwrap().sum_all().unwrap();
    let ours = loss(memattn_candle::flash_attn(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale, causal).unwrap())
        .backward()
        .unwrap();
    let theirs = loss(candle_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale as f64, causal).unwrap())
        .backward()
        .unwrap();
    for (name, x) in [("dq", &q), ("dk", &k), ("dv", &v)] {
        let (g, want) = (ours.get(x.as_tensor()).unwrap(), theirs.get(x.as_tensor()).unwrap());
        assert_eq!(g.dims(), x.dims(), "{name}");
        let e = rel_err(g, want);
        println!("causal={causal} [{b},{sq},{h},{d}] kv {skv} x {hk}: {name} max rel err {e:.2e}");
        assert!(e <= 1e-5, "{name}: memattn's gradient differs from candle's autograd by {e:e} (> 1e-5)");
    }
}

#[test]
fn causal_gqa_gradients_match_candle_autograd() {
    // seq_q < seq_kv (bottom-right causal), neither a tile multiple, 2 query heads per K/V head.
    case(true, (1, 20, 33, 4, 2, 64));
}

#[test]
fn d128_two_batches_gradients_match_candle_autograd() {
    case(false, (2, 9, 16, 2, 2, 128));
}

#[test]
fn unsupported_backward_is_an_error_not_a_wrong_gradient() {
    let dev = Device::Cpu;
    let var = |dt| Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 4, 1, 64), &dev).unwrap().to_dtype(dt).unwrap());
    let (q, k, v) = (var(DType::BF16).unwrap(), var(DType::BF16).unwrap(), var(DType::BF16).unwrap());
    let o = memattn_candle::flash_attn(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.125, false).unwrap();
    let err = o.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(err.contains("f32 only"), "{err}");

    let var = |shape: (usize, usize, usize)| Var::randn(0f32, 1.0, shape, &dev).unwrap();
    let (q, k, v) = (var((5, 1, 64)), var((5, 1, 64)), var((5, 1, 64)));
    let cu = Tensor::new(&[0u32, 2, 5], &dev).unwrap();
    let o = memattn_candle::flash_attn_varlen(q.as_tensor(), k.as_tensor(), v.as_tensor(), &cu, &cu, 3, 3, 0.125, true)
        .unwrap();
    let err = o.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(err.contains("packed sequences"), "{err}");
}
