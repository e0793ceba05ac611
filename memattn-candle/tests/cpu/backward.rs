//! candle's autograd through `memattn_candle::flash_attn` (the op's `bwd`: memattn's backward
//! kernels in the PTX VM) against autograd through attention written with candle's own ops,
//! `softmax(q kᵀ · scale [+ mask]) v` with k/v repeated for GQA: gradients of one loss taken
//! two ways by code that shares nothing.
//!
//! f32: max relative error ≤ 1e-5. bf16 and f16, FlashAttention's rule: each gradient's max
//! abs error against candle-ops attention in f64 on the same rounded inputs is at most twice
//! that of candle-ops attention computed in the 16-bit dtype itself (the naive baseline), plus
//! a floor of half the dtype's unit roundoff times `max |reference|`.

use candle_core::{DType, Device, Tensor, Var, D};

/// Which keys a query sees: `(left, right)` bounds around the bottom-right diagonal, `None`
/// unbounded on that side (causal is `(None, Some(0))`).
type Window = (Option<usize>, Option<usize>);
const CAUSAL: Window = (None, Some(0));
const FULL: Window = (None, None);

/// Attention with candle's ops and candle's autograd, in the inputs' dtype; q `[b, sq, h, d]`,
/// k, v `[b, skv, hk, d]`.
fn candle_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, window: Window) -> candle_core::Result<Tensor> {
    let n_rep = q.dim(2)? / k.dim(2)?;
    let rep = |x: &Tensor| -> candle_core::Result<Tensor> {
        let (b, s, hk, d) = x.dims4()?;
        x.unsqueeze(3)?.expand((b, s, hk, n_rep, d))?.reshape((b, s, hk * n_rep, d))?.transpose(1, 2)?.contiguous()
    };
    let (k, v) = (rep(k)?, rep(v)?);
    let q = q.transpose(1, 2)?.contiguous()?;
    let mut s = (q.matmul(&k.t()?)? * scale)?;
    let (sq, skv) = (s.dim(2)?, s.dim(3)?);
    if window != FULL {
        // Bottom-right aligned: query i sees key j iff i + skv - sq - left <= j <= i + skv - sq + right.
        let (l, r) = (window.0.map(|w| w as i64), window.1.map(|w| w as i64));
        let diag = skv as i64 - sq as i64;
        let mask: Vec<f32> = (0..sq as i64)
            .flat_map(|i| {
                (0..skv as i64).map(move |j| {
                    let seen = l.is_none_or(|l| j >= i + diag - l) && r.is_none_or(|r| j <= i + diag + r);
                    if seen {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        s = s.broadcast_add(&Tensor::from_vec(mask, (sq, skv), &Device::Cpu)?.to_dtype(s.dtype())?)?;
    }
    let e = s.broadcast_sub(&s.max_keepdim(D::Minus1)?.detach())?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?.transpose(1, 2)?.contiguous()
}

/// The problem: batched `[b, s, h, d]` tensors, or packed sequences `[total, h, d]` with
/// u32 prefix sums.
#[derive(Clone)]
enum Layout {
    Batched,
    Varlen { cu_q: Vec<u32>, cu_k: Vec<u32> },
}

/// O through memattn's op.
fn memattn_o(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, window: Window, layout: &Layout) -> Tensor {
    match layout {
        Layout::Batched => memattn_candle::flash_attn_windowed(q, k, v, scale, window.0, window.1).unwrap(),
        Layout::Varlen { cu_q, cu_k } => {
            assert!(window == FULL || window == CAUSAL, "the varlen op takes the causal flag only");
            let max = |cu: &[u32]| cu.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap();
            let (tq, tk) = (
                Tensor::new(cu_q.as_slice(), &Device::Cpu).unwrap(),
                Tensor::new(cu_k.as_slice(), &Device::Cpu).unwrap(),
            );
            memattn_candle::flash_attn_varlen(q, k, v, &tq, &tk, max(cu_q), max(cu_k), scale, window == CAUSAL).unwrap()
        }
    }
}

/// O through candle-ops attention (per sequence for packed sequences, concatenated).
fn candle_o(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, window: Window, layout: &Layout) -> Tensor {
    match layout {
        Layout::Batched => candle_attention(q, k, v, scale as f64, window).unwrap(),
        Layout::Varlen { cu_q, cu_k } => {
            let outs: Vec<Tensor> = (0..cu_q.len() - 1)
                .map(|i| {
                    let seq = |t: &Tensor, cu: &[u32]| {
                        t.narrow(0, cu[i] as usize, (cu[i + 1] - cu[i]) as usize).unwrap().unsqueeze(0).unwrap()
                    };
                    let o = candle_attention(&seq(q, cu_q), &seq(k, cu_k), &seq(v, cu_k), scale as f64, window);
                    o.unwrap().squeeze(0).unwrap()
                })
                .collect();
            Tensor::cat(&outs, 0).unwrap()
        }
    }
}

/// dq, dk, dv of `sum(O ∘ W)` (O's dtype converted to W's for the product).
fn grads(o: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor, qkv: [&Var; 3], w: &Tensor) -> [Tensor; 3] {
    let [q, k, v] = qkv;
    let o = o(q.as_tensor(), k.as_tensor(), v.as_tensor());
    let g = (o.to_dtype(w.dtype()).unwrap() * w).unwrap().sum_all().unwrap().backward().unwrap();
    qkv.map(|x| g.get(x.as_tensor()).expect("a gradient for every input").clone())
}

fn max_abs(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    max_abs(&(a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap())
}

/// Random q `[.., sq, h, d]`, k, v `[.., skv, hk, d]` (batched or packed) and W, rounded to
/// `dtype` (W then held in f32).
fn inputs(
    dtype: DType,
    layout: &Layout,
    (b, sq, skv, h, hk, d): (usize, usize, usize, usize, usize, usize),
) -> ([Tensor; 3], Tensor) {
    let dev = Device::Cpu;
    // Fixed pseudo-random values (a SplitMix64 stream, uniform in [-1.7, 1.7), about unit
    // variance), so every run checks the same numbers.
    let state = std::cell::Cell::new(0x9e37_79b9_7f4a_7c15u64);
    let r = |shape: &[usize]| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                let mut z = state.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
                state.set(z);
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.4
            })
            .collect();
        Tensor::from_vec(v, shape, &dev).unwrap().to_dtype(dtype).unwrap()
    };
    let (qs, ks): (Vec<usize>, Vec<usize>) = match layout {
        Layout::Batched => (vec![b, sq, h, d], vec![b, skv, hk, d]),
        Layout::Varlen { cu_q, cu_k } => {
            (vec![*cu_q.last().unwrap() as usize, h, d], vec![*cu_k.last().unwrap() as usize, hk, d])
        }
    };
    ([r(&qs), r(&ks), r(&ks)], r(&qs).to_dtype(DType::F32).unwrap())
}

/// f32: memattn's gradients against candle's autograd, max relative error ≤ 1e-5.
fn case_f32(window: Window, layout: Layout, dims: (usize, usize, usize, usize, usize, usize)) {
    let ([q, k, v], w) = inputs(DType::F32, &layout, dims);
    let vars = [&q, &k, &v].map(|t| Var::from_tensor(t).unwrap());
    let scale = 1.0 / (dims.5 as f32).sqrt();
    let ours = grads(|q, k, v| memattn_o(q, k, v, scale, window, &layout), [&vars[0], &vars[1], &vars[2]], &w);
    let theirs = grads(|q, k, v| candle_o(q, k, v, scale, window, &layout), [&vars[0], &vars[1], &vars[2]], &w);
    for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
        let (g, want) = (&ours[i], &theirs[i]);
        assert_eq!((g.dims(), g.dtype()), (vars[i].dims(), DType::F32), "{name}");
        let e = max_abs_diff(g, want) / max_abs(want);
        println!("f32 window {window:?} {dims:?}: {name} max rel err {e:.2e}");
        assert!(e <= 1e-5, "{name}: memattn's gradient differs from candle's autograd by {e:e} (> 1e-5)");
    }
}

/// bf16/f16: FlashAttention's rule against candle-ops attention in f64 on the same inputs, the
/// baseline being candle-ops attention in `dtype`.
fn case_16(dtype: DType, window: Window, layout: Layout, dims: (usize, usize, usize, usize, usize, usize)) {
    let ([q, k, v], w) = inputs(dtype, &layout, dims);
    let vars = [&q, &k, &v].map(|t| Var::from_tensor(t).unwrap());
    let wide = [&q, &k, &v].map(|t| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap());
    let scale = 1.0 / (dims.5 as f32).sqrt();
    let ours = grads(|q, k, v| memattn_o(q, k, v, scale, window, &layout), [&vars[0], &vars[1], &vars[2]], &w);
    let naive = grads(|q, k, v| candle_o(q, k, v, scale, window, &layout), [&vars[0], &vars[1], &vars[2]], &w);
    let w64 = w.to_dtype(DType::F64).unwrap();
    let reference = grads(|q, k, v| candle_o(q, k, v, scale, window, &layout), [&wide[0], &wide[1], &wide[2]], &w64);
    // Half the unit roundoff: 2^-9 for bf16 (8 significant bits), 2^-12 for f16 (11).
    let floor_rel = if dtype == DType::BF16 { 2f64.powi(-9) } else { 2f64.powi(-12) };
    for (i, name) in ["dq", "dk", "dv"].into_iter().enumerate() {
        let (g, base, want) = (&ours[i], &naive[i], &reference[i]);
        assert_eq!((g.dims(), g.dtype()), (vars[i].dims(), dtype), "{name}");
        let (e, eb, scale_ref) = (max_abs_diff(g, want), max_abs_diff(base, want), max_abs(want));
        let bound = 2.0 * eb + floor_rel * scale_ref;
        println!(
            "{dtype:?} window {window:?} {dims:?}: {name} max err {e:.3e}, naive {dtype:?} {eb:.3e}, bound {bound:.3e} (max |ref| {scale_ref:.3e})"
        );
        assert!(e <= bound, "{name}: max error {e:e} against the f64 reference is over 2 x naive {eb:e} + floor");
    }
}

#[test]
fn causal_gqa_gradients_match_candle_autograd() {
    // seq_q < seq_kv (bottom-right causal), neither a tile multiple, 2 query heads per K/V head.
    case_f32(CAUSAL, Layout::Batched, (1, 20, 33, 4, 2, 64));
}

#[test]
fn d128_two_batches_gradients_match_candle_autograd() {
    case_f32(FULL, Layout::Batched, (2, 9, 16, 2, 2, 128));
}

#[test]
fn varlen_causal_gqa_gradients_match_candle_autograd_per_sequence() {
    let layout = Layout::Varlen { cu_q: vec![0, 13, 37], cu_k: vec![0, 20, 50] };
    case_f32(CAUSAL, layout, (0, 0, 0, 4, 2, 64));
}

#[test]
fn bf16_causal_gqa_gradients_within_twice_naive_bf16() {
    case_16(DType::BF16, CAUSAL, Layout::Batched, (1, 37, 50, 4, 2, 64));
}

#[test]
fn bf16_d128_two_batches_and_d32_mqa_window_within_twice_naive_bf16() {
    case_16(DType::BF16, FULL, Layout::Batched, (2, 37, 50, 2, 2, 128));
    case_16(DType::BF16, (Some(9), Some(3)), Layout::Batched, (1, 37, 50, 2, 1, 32));
}

#[test]
fn f16_causal_gqa_gradients_within_twice_naive_f16() {
    case_16(DType::F16, CAUSAL, Layout::Batched, (1, 37, 50, 4, 2, 64));
}

#[test]
fn bf16_varlen_causal_gradients_within_twice_naive_bf16() {
    let layout = Layout::Varlen { cu_q: vec![0, 13, 37], cu_k: vec![0, 20, 50] };
    case_16(DType::BF16, CAUSAL, layout, (0, 0, 0, 4, 2, 64));
}

/// Head dims padded to the next kernel's (Stable Diffusion 1.5's 40 and 160, StableLM-3B's 80,
/// and 120, 200): f32 on the SIMT backward, bf16 and f16 on the tensor-core one up to its
/// largest head dim (128).
#[test]
fn padded_head_dims_gradients_match_candle_autograd() {
    case_f32(CAUSAL, Layout::Batched, (1, 20, 33, 4, 2, 40));
    case_f32(FULL, Layout::Batched, (2, 9, 16, 2, 2, 80));
    case_f32(CAUSAL, Layout::Batched, (1, 10, 13, 2, 1, 160));
    case_f32(FULL, Layout::Batched, (1, 7, 12, 2, 2, 200));
    case_16(DType::BF16, CAUSAL, Layout::Batched, (1, 37, 50, 4, 2, 40));
    case_16(DType::F16, FULL, Layout::Batched, (1, 21, 30, 2, 1, 80));
    case_16(DType::BF16, (Some(9), Some(3)), Layout::Batched, (1, 20, 33, 2, 2, 120));
}

#[test]
fn head_dim_without_a_16bit_backward_is_an_error_naming_the_supported_ones() {
    let dev = Device::Cpu;
    let var =
        || Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 4, 1, 160), &dev).unwrap().to_dtype(DType::BF16).unwrap());
    let (q, k, v) = (var().unwrap(), var().unwrap(), var().unwrap());
    let o = memattn_candle::flash_attn(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.125, false).unwrap();
    let err = o.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap_err().to_string();
    // The library's own refusal, which lists the head dims it has bf16 backward kernels for.
    let library = memattn::attn::flash_attn_backward_workspace(memattn::Dtype::Bf16, [1, 4, 1, 160], 4, false)
        .unwrap_err()
        .to_string();
    println!("{err}");
    assert!(library.contains("head_dim"), "{library}");
    assert!(err.contains("backward") && err.contains(&library), "{err}");
}
