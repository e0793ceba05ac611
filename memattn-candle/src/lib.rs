//! candle ops running memattn's prebuilt PTX attention kernels: no nvcc, no CUDA C++ at build time.
//!
//! [`flash_attn`], [`flash_attn_windowed`] and [`flash_attn_varlen`] have the signatures of
//! `candle_flash_attn`'s functions of those names, so switching is a one-line change of the
//! `use`; [`flash_attn_with_lse`] and [`flash_attn_varlen_with_lse`] also return the log-sum-exp
//! of each query row (natural log, f32), which candle-flash-attn drops.
//! [`flash_attn_alibi`], [`flash_attn_alibi_windowed`], [`flash_attn_alibi_windowed_softcap`],
//! [`flash_attn_varlen_windowed`], [`flash_attn_varlen_alibi`], [`flash_attn_varlen_alibi_windowed`]
//! and [`flash_attn_varlen_alibi_windowed_softcap`] have candle-flash-attn's signatures too (ALiBi
//! is forward only). [`flash_attn_with_kvcache_opts`] takes FlashAttention-2's keyword arguments
//! ([`KvCacheOpts`]: window, soft cap, rotary, cache slots, left padding, ALiBi, sinks).
//! [`flash_attn_with_kvcache`] (and `_with_lse`) is FlashAttention-2's decode over a contiguous
//! or paged KV cache with split-KV, in FlashAttention-2's argument order (candle-flash-attn has no
//! such function): new tokens `k`, `v` are appended **in place** into the caller's `k_cache` and
//! `v_cache` tensors before attention (see the function for exactly what is written).
//!
//! | tensor | shape | notes |
//! | --- | --- | --- |
//! | `q` | `[batch, seq_q, heads, head_dim]`; varlen `[total_q, heads, head_dim]` | f32, bf16 or f16; head_dim 32, 64, 96, 128, 192 or 256, or any other multiple of 8 up to 256 (run on the next of those with the head dim padded: 40, 80 and 160 as StableLM-3B and Stable Diffusion 1.5 use them; nothing is copied); last dim contiguous (other strides are passed to the kernel as they are) |
//! | `k`, `v` | `[batch, seq_kv, heads_kv, head_dim]`; varlen `[total_kv, heads_kv, head_dim]` | same dtype as `q`; `heads_kv` divides `heads` (grouped-query attention: query head `i` reads k/v head `i / (heads / heads_kv)`, as candle's `repeat_kv` gives) |
//! | `seqlens_q`, `seqlens_k` (varlen) | `[batch + 1]` u32 | prefix sums, first 0, non-decreasing, ending at the totals |
//! | result | q's shape | q's dtype, contiguous |
//! | LSE | `[batch, heads, seq_q]`; varlen `[heads, total_q]` | f32, natural log |
//!
//! The causal mask and windows are bottom-right aligned (query `i` sees key `j` iff
//! `j <= i + seq_kv - seq_q`), as in candle-flash-attn and FlashAttention ≥ 2.1; for varlen per
//! sequence.
//!
//! On a candle CPU device the op runs the same PTX in memattn's PTX VM (slow, exact, with
//! memcheck: for tests and CI without a GPU; feature `vm`, default). With the `cuda` feature, on a
//! candle CUDA device it launches on candle's own stream in candle's context; nothing waits for it.
//! An engine built with candle-core's `cuda` feature uses `default-features = false, features =
//! ["cuda"]` (plus `"vm"` for the CPU device): the default `cuda-12080` would override the CUDA
//! version candle's build detects (README, "Features").
//!
//! memattn's refusals keep their type: [`attn_error`] returns the [`AttnError`] in a candle error.
//!
//! `Tensor::backward` differentiates [`flash_attn`], [`flash_attn_windowed`] and
//! [`flash_attn_varlen`] (and their `_with_lse` forms, through O) in f32, bf16 and f16; which
//! dtypes, head dims and devices have a backward is tabled under [`FlashAttn`]'s "Gradients".
//! [`flash_attn_with_kvcache`] is inference only.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! let q = Tensor::randn(0f32, 1.0, (1, 24, 2, 64), &Device::Cpu)?;
//! let k = Tensor::randn(0f32, 1.0, (1, 40, 2, 64), &Device::Cpu)?;
//! let v = Tensor::randn(0f32, 1.0, (1, 40, 2, 64), &Device::Cpu)?;
//! let (o, lse) = memattn_candle::flash_attn_with_lse(&q, &k, &v, 0.125, true)?;
//! assert_eq!((o.dims(), lse.dims(), lse.dtype()), (&[1, 24, 2, 64][..], &[1, 2, 24][..], DType::F32));
//! # Ok::<(), candle_core::Error>(())
//! ```

#![deny(missing_docs)]

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};
/// The memattn this crate runs on, for matching [`AttnError`]'s rule types without a second
/// dependency to keep in step.
pub use memattn;
/// memattn's error type, which [`attn_error`] finds in a candle error (its rule types are in
/// [`memattn::attn`] and [`memattn::problem`]).
pub use memattn::attn::AttnError;
use memattn::attn::{AttnOpts, Kernels, TensorView};
use memattn::Dtype;
use std::sync::{Arc, Mutex};

/// `softmax(q kᵀ · softmax_scale [causal mask]) v`, as `candle_flash_attn::flash_attn`.
/// `k`, `v` may have fewer heads than `q` (grouped-query attention, as in candle-flash-attn).
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32, causal: bool) -> Result<Tensor> {
    Ok(flash_attn_with_lse(q, k, v, softmax_scale, causal)?.0)
}

/// As [`flash_attn`], also returning the LSE of each query row: `[batch, heads, seq_q]` f32,
/// natural log (`-inf` for a row that sees no key).
pub fn flash_attn_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<(Tensor, Tensor)> {
    let op = FlashAttn::new(softmax_scale, causal, (None, None), None);
    let (o, lse) = op.apply(q, k, v)?;
    let (b, sq, h, _) = q.dims4()?;
    Ok((o, take_lse_from(&lse, (b, h, sq))?))
}

/// A sliding window, as `candle_flash_attn::flash_attn_windowed`: query `i` sees key `j` iff
/// `i + seq_kv - seq_q - left <= j <= i + seq_kv - seq_q + right` (bottom-right aligned); `None`
/// on a side is unbounded, so `(None, Some(0))` is causal attention and `(Some(w - 1), Some(0))`
/// a model config's `sliding_window = w`.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let op = FlashAttn::new(softmax_scale, false, (window_size_left, window_size_right), None);
    Ok(op.apply(q, k, v)?.0)
}

/// Attention over packed sequences of different lengths, as `candle_flash_attn::flash_attn_varlen`:
/// `q` `[total_q, heads, head_dim]`, `k`, `v` `[total_kv, heads_kv, head_dim]`; `seqlens_q` and
/// `seqlens_k` are u32 `[batch + 1]` prefix sums (first 0, non-decreasing, ending at the
/// totals): sequence `b` is rows `seqlens_q[b]..seqlens_q[b + 1]` of q and `seqlens_k[b]..` of k
/// and v. Masks apply per sequence, bottom-right aligned to its own lengths. The prefix sums are
/// read to the host for validation (on a CUDA device that copy waits for them).
#[allow(clippy::too_many_arguments)] // candle-flash-attn's signature
pub fn flash_attn_varlen(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    Ok(flash_attn_varlen_with_lse(q, k, v, seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)?.0)
}

/// As [`flash_attn_varlen`], also returning the LSE: `[heads, total_q]` f32, natural log.
#[allow(clippy::too_many_arguments)] // candle-flash-attn's signature
pub fn flash_attn_varlen_with_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<(Tensor, Tensor)> {
    let varlen = varlen_of(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)?;
    let op = FlashAttn::new(softmax_scale, causal, (None, None), Some(varlen));
    let (o, lse) = op.apply(q, k, v)?;
    let (total_q, h, _) = q.dims3()?;
    Ok((o, take_lse_from(&lse, (h, total_q))?))
}

/// ALiBi, as `candle_flash_attn::flash_attn_alibi`: the score of query `i` and key `j` gains
/// `-slope · |i + seq_kv - seq_q - j|` (after the scale), `alibi_slopes` f32 `[heads]` or
/// `[batch, heads]` (FlashAttention-2's `(nheads,)` or `(batch, nheads)`; docs/semantics.md).
/// Forward only: `backward()` through it is refused.
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let op = FlashAttn::new(softmax_scale, causal, (None, None), None).with_alibi(Some(alibi_slopes))?;
    Ok(op.apply(q, k, v)?.0)
}

/// [`flash_attn_alibi`] with a window, as `candle_flash_attn::flash_attn_alibi_windowed`
/// ([`flash_attn_windowed`]'s rule).
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let op = FlashAttn::new(softmax_scale, false, (window_size_left, window_size_right), None)
        .with_alibi(Some(alibi_slopes))?;
    Ok(op.apply(q, k, v)?.0)
}

/// Optional ALiBi, a window and a soft cap (`softcap · tanh(score / softcap)`, the bias added after
/// it), as `candle_flash_attn::flash_attn_alibi_windowed_softcap`.
#[allow(clippy::too_many_arguments)] // candle-flash-attn's signature
pub fn flash_attn_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let op = FlashAttn::new(softmax_scale, false, (window_size_left, window_size_right), None)
        .with_alibi(alibi_slopes)?
        .with_softcap(softcap);
    Ok(op.apply(q, k, v)?.0)
}

/// The cu_seqlens of a varlen call, checked and read to the host.
fn varlen_of(seqlens_q: &Tensor, seqlens_k: &Tensor, max_seqlen_q: usize, max_seqlen_k: usize) -> Result<Varlen> {
    let cu = |t: &Tensor, what: &str| -> Result<Vec<u32>> {
        if t.dtype() != DType::U32 || t.rank() != 1 {
            return Err(candle_core::Error::Msg(format!(
                "memattn flash_attn_varlen: {what} must be a 1-d u32 tensor of batch + 1 prefix sums, got {:?} {:?}",
                t.dtype(),
                t.dims()
            )));
        }
        t.to_vec1::<u32>()
    };
    Ok(Varlen { cu_q: cu(seqlens_q, "seqlens_q")?, cu_k: cu(seqlens_k, "seqlens_k")?, max_seqlen_q, max_seqlen_k })
}

/// [`flash_attn_varlen`] with a window, as `candle_flash_attn::flash_attn_varlen_windowed`.
#[allow(clippy::too_many_arguments)] // candle-flash-attn's signature
pub fn flash_attn_varlen_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let varlen = varlen_of(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)?;
    let op = FlashAttn::new(softmax_scale, false, (window_size_left, window_size_right), Some(varlen));
    Ok(op.apply(q, k, v)?.0)
}

/// [`flash_attn_varlen`] with ALiBi, as `candle_flash_attn::flash_attn_varlen_alibi`: slopes
/// `[heads]`, or `[batch, heads]` with one row per packed sequence.
#[allow(clippy::too_many_arguments)] // candle-flash-attn's signature
pub fn flash_attn_varlen_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    let varlen = varlen_of(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)?;
    let op = FlashAttn::new(softmax_scale, causal, (None, None), Some(varlen)).with_alibi(Some(alibi_slopes))?;
    Ok(op.apply(q, k, v)?.0)
}

/// [`flash_attn_varlen_alibi`] with a window, as `candle_flash_attn::flash_attn_varlen_alibi_windowed`.
#[allow(clippy::too_many_arguments)] // candle-flash-attn's signature
pub fn flash_attn_varlen_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    let varlen = varlen_of(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)?;
    let op = FlashAttn::new(softmax_scale, false, (window_size_left, window_size_right), Some(varlen))
        .with_alibi(Some(alibi_slopes))?;
    Ok(op.apply(q, k, v)?.0)
}

/// Optional ALiBi, a window and a soft cap over packed sequences, as
/// `candle_flash_attn::flash_attn_varlen_alibi_windowed_softcap`.
#[allow(clippy::too_many_arguments)] // candle-flash-attn's signature
pub fn flash_attn_varlen_alibi_windowed_softcap(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: Option<&Tensor>,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    softcap: f32,
) -> Result<Tensor> {
    let varlen = varlen_of(seqlens_q, seqlens_k, max_seqlen_q, max_seqlen_k)?;
    let op = FlashAttn::new(softmax_scale, false, (window_size_left, window_size_right), Some(varlen))
        .with_alibi(alibi_slopes)?
        .with_softcap(softcap);
    Ok(op.apply(q, k, v)?.0)
}

/// Packed sequences against a paged KV cache, as candle-flash-attn's
/// `flash_attn_varlen_paged_windowed` (chunked prefill, vLLM's mixed batch of prefill chunks and
/// decode rows): `q` `(total_q, heads, head_dim)`, `k` and `v` the paged cache `(num_blocks,
/// page_block_size, heads_kv, head_dim)`, `seqlens_q` and `seqlens_k` `(batch + 1)` u32 prefix
/// sums of the query chunks and of the sequences' keys (their keys in the cache: the chunk's own
/// included), `block_table` `(batch, max_blocks)` u32. Windows as candle-flash-attn's
/// (`window_size_right = Some(0)` is causal, bottom-right against each sequence's keys), and an
/// optional soft cap. bf16 and f16 (memattn's `Kernels::flash_attn_varlen_paged`), on candle's
/// CPU device (the PTX VM) and, with the `cuda` feature, on a CUDA device (contiguous q, k, v on
/// candle's stream). The index tensors are read to the host and checked before the launch.
/// Returns `(total_q, heads, head_dim)` in q's dtype.
#[allow(clippy::too_many_arguments)] // candle-flash-attn's signature
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    let msg = |m: String| candle_core::Error::Msg(format!("memattn flash_attn_varlen_paged_windowed: {m}"));
    let on_cuda = match q.device() {
        candle_core::Device::Cpu => false,
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => true,
        #[allow(unreachable_patterns)] // with the `cuda` feature every other device is Metal
        other => {
            return Err(msg(format!(
                "q is on {:?}; this function runs on candle's CPU device (the PTX VM) and CUDA devices",
                other.location()
            )))
        }
    };
    let dtype = dtype_of(q.dtype())?;
    if !dtype.is_16bit() {
        return Err(msg(format!("q is {:?}; the paged forward takes bf16 or f16", q.dtype())));
    }
    let (total_q, h, d) = q.dims3()?;
    let (nb, page, hk, kd) = k.dims4()?;
    if v.dims() != k.dims() {
        return Err(msg(format!("v has shape {:?}, k {:?}: one shape", v.dims(), k.dims())));
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        return Err(msg(format!("k, v are {:?}, {:?} while q is {:?}", k.dtype(), v.dtype(), q.dtype())));
    }
    if page != page_block_size {
        return Err(msg(format!("page_block_size is {page_block_size}, but k has {page} rows per block")));
    }
    let cu_q = seqlens_q.to_vec1::<u32>()?;
    let cu_k = seqlens_k.to_vec1::<u32>()?;
    if cu_k.len() != cu_q.len() || cu_k.is_empty() {
        return Err(msg(format!("seqlens_k has {} entries, seqlens_q {}: batch + 1 each", cu_k.len(), cu_q.len())));
    }
    let mut used = Vec::with_capacity(cu_k.len() - 1);
    for (i, w) in cu_k.windows(2).enumerate() {
        let n = w[1].checked_sub(w[0]).ok_or_else(|| msg(format!("seqlens_k decreases at entry {}", i + 1)))?;
        if n as usize > max_seqlen_k {
            return Err(msg(format!("sequence {i} has {n} keys, over max_seqlen_k = {max_seqlen_k}")));
        }
        used.push(n);
    }
    let table = block_table.flatten_all()?.to_vec1::<u32>()?;
    let mut opts = AttnOpts::new().softmax_scale(softmax_scale).window(
        window_size_left.map(|w| u32::try_from(w).unwrap_or(u32::MAX)),
        window_size_right.map(|w| u32::try_from(w).unwrap_or(u32::MAX)),
    );
    if let Some(c) = softcap {
        opts = opts.softcap(c);
    }
    if on_cuda {
        #[cfg(feature = "cuda")]
        {
            let idx = [cu_q, used, table];
            return match q.dtype() {
                DType::BF16 => cuda::varlen_paged::<half::bf16>(q, k, v, &idx, max_seqlen_q, &opts),
                _ => cuda::varlen_paged::<half::f16>(q, k, v, &idx, max_seqlen_q, &opts),
            };
        }
    }
    let kernels = vm_kernels()?;
    let up = |t: &Tensor| -> Result<memattn::attn::VmBuffer> {
        let x = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        kernels.vm_upload_as(dtype, &x).map_err(wrap)
    };
    let (qb, kb, vb) = (up(q)?, up(k)?, up(v)?);
    let view = |b, shape| TensorView::vm(b, dtype, shape).map_err(wrap);
    let index = |x: &[u32]| kernels.index_tensor(x, None).map_err(wrap);
    let (cu_q, used, table) = (index(&cu_q)?, index(&used)?, index(&table)?);
    let (o, _lse) = kernels
        .flash_attn_varlen_paged(
            &view(&qb, [1, total_q, h, d])?,
            &view(&kb, [nb, page, hk, kd])?,
            &view(&vb, [nb, page, hk, kd])?,
            &cu_q,
            &used,
            &table,
            max_seqlen_q,
            &opts,
        )
        .map_err(wrap)?;
    Tensor::from_vec(o.to_vec_f32().map_err(wrap)?, (total_q, h, d), &candle_core::Device::Cpu)?.to_dtype(q.dtype())
}

/// The packed-sequence arguments of [`flash_attn_varlen`].
#[derive(Clone, Debug, PartialEq)]
pub struct Varlen {
    /// Cumulative query lengths, `batch + 1` entries from 0 (FlashAttention-2's `cu_seqlens_q`).
    pub cu_q: Vec<u32>,
    /// Cumulative key lengths, `batch + 1` entries from 0 (`cu_seqlens_k`).
    pub cu_k: Vec<u32>,
    /// The longest query sequence.
    pub max_seqlen_q: usize,
    /// The longest key sequence.
    pub max_seqlen_k: usize,
}

/// The candle op behind [`flash_attn`], [`flash_attn_windowed`] and [`flash_attn_varlen`]. Its
/// LSE is kept for the caller of `apply_op3`, which the `*_with_lse` functions are.
///
/// # Gradients
///
/// The op implements candle's `CustomOp3::bwd`, so `Tensor::backward` trains through it: dq,
/// dk and dv of O (FlashAttention-2's backward, [`Kernels::flash_attn_backward_into`], or
/// [`Kernels::flash_attn_varlen_backward_into`] for packed sequences), in the inputs' dtype,
/// with causal masks, windows and GQA (dk, dv of a K/V head summed over its query heads).
///
/// | function | dtypes | head dims | devices |
/// | --- | --- | --- | --- |
/// | [`flash_attn`], [`flash_attn_with_lse`], [`flash_attn_windowed`] | f32, bf16, f16 | f32 all; bf16/f16 those of `KernelId::flash_bwd_head_dims` (32, 64, 128 today); a multiple of 8 below the largest on the next of them, padded | CPU (PTX VM); CUDA with the `cuda` feature |
/// | [`flash_attn_varlen`], [`flash_attn_varlen_with_lse`] | the same | the same | the same |
/// | [`flash_attn_with_kvcache`] | not differentiable (no `bwd`) | | |
///
/// The backward recomputes O and LSE from q, k, v (one forward launch) instead of keeping them
/// with the op, so an op applied twice can never pair one call's gradient with another call's
/// LSE. Not differentiated: the returned LSE tensor (gradients flow through O only). A head dim
/// without a backward kernel in the dtype is refused by `backward()` with memattn's error,
/// which names the head dims there are, before anything runs. On a CUDA device the forward and
/// the backward are queued on candle's stream; that path is type-checked but has not been run
/// on a GPU.
pub struct FlashAttn {
    /// The scale of `q · k` before the softmax (usually `1 / sqrt(head_dim)`).
    pub softmax_scale: f32,
    /// Bottom-right causal mask: query `i` sees key `j` iff `j <= i + seq_kv - seq_q`.
    pub causal: bool,
    /// `(left, right)`, `None` unbounded.
    pub window: (Option<usize>, Option<usize>),
    /// Packed sequences (q, k, v are then 3-d `[total, heads, head_dim]`).
    pub varlen: Option<Varlen>,
    /// ALiBi slopes: f32 `[heads]` or `[batch, heads]` on q's device (the `*_alibi*` functions);
    /// forward only.
    pub alibi_slopes: Option<Tensor>,
    /// `softcap · tanh(score / softcap)` (Gemma 2); `None` is off.
    pub softcap: Option<f32>,
    lse: Arc<Mutex<Option<Storage>>>,
}

impl FlashAttn {
    /// The op for these settings, without packed sequences, ALiBi or a soft cap (set the public
    /// fields for those).
    pub fn new(
        softmax_scale: f32,
        causal: bool,
        window: (Option<usize>, Option<usize>),
        varlen: Option<Varlen>,
    ) -> FlashAttn {
        FlashAttn {
            softmax_scale,
            causal,
            window,
            varlen,
            alibi_slopes: None,
            softcap: None,
            lse: Arc::new(Mutex::new(None)),
        }
    }

    /// With ALiBi slopes (f32 `[heads]` or `[batch, heads]`, checked against q by the call).
    pub fn with_alibi(mut self, slopes: Option<&Tensor>) -> Result<FlashAttn> {
        if let Some(t) = slopes {
            if t.dtype() != DType::F32 || !matches!(t.rank(), 1 | 2) {
                return Err(candle_core::Error::Msg(format!(
                    "memattn flash_attn: alibi_slopes must be an f32 tensor [heads] or [batch, heads], got {:?} {:?}",
                    t.dtype(),
                    t.dims()
                )));
            }
            self.alibi_slopes = Some(t.contiguous()?);
        }
        Ok(self)
    }

    /// With a soft cap (`softcap · tanh(score / softcap)`).
    pub fn with_softcap(mut self, softcap: f32) -> FlashAttn {
        self.softcap = Some(softcap);
        self
    }

    /// The slopes' batch (for `[batch, heads]`) and heads.
    fn alibi_dims(&self) -> Option<(Option<usize>, usize)> {
        self.alibi_slopes.as_ref().map(|t| match t.dims() {
            &[b, h] => (Some(b), h),
            d => (None, d.iter().product()),
        })
    }

    /// Applies the op with candle's autograd (`apply_op3`, so `bwd` runs on `backward()`);
    /// returns O and the slot the forward's LSE lands in.
    fn apply(self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Arc<Mutex<Option<Storage>>>)> {
        let lse = self.lse.clone();
        Ok((q.apply_op3(k, v, self)?, lse))
    }

    fn opts(&self) -> Result<AttnOpts<'static>> {
        let side = |w: Option<usize>, what: &str| -> Result<Option<u32>> {
            w.map(|w| {
                u32::try_from(w).map_err(|_| {
                    candle_core::Error::Msg(format!("memattn: window_size_{what} {w} is over the kernels' limit"))
                })
            })
            .transpose()
        };
        let opts = AttnOpts::new()
            .softmax_scale(self.softmax_scale)
            .causal(self.causal)
            .window(side(self.window.0, "left")?, side(self.window.1, "right")?);
        Ok(match self.softcap {
            Some(c) => opts.softcap(c),
            None => opts,
        })
    }

    /// Shape and strides of an input as memattn's 4-d `[batch, seq, heads, head_dim]` view
    /// (packed 3-d tensors are batch 1).
    fn view_dims(&self, l: &Layout, what: &str) -> Result<([usize; 4], [usize; 4])> {
        if self.varlen.is_some() {
            match (l.dims(), l.stride()) {
                (&[t, h, d], &[s0, s1, s2]) => Ok(([1, t, h, d], [t * s0, s0, s1, s2])),
                (other, _) => Err(candle_core::Error::Msg(format!(
                    "memattn flash_attn_varlen: {what} must be 3-d [total, heads, head_dim], got shape {other:?}"
                ))),
            }
        } else {
            Ok((dims4(l, what)?, strides4(l)))
        }
    }

    /// Runs the op on memattn's kernels with the views (and index tensors on `stream`).
    fn launch(
        &self,
        kernels: &Kernels,
        stream: Option<&std::sync::Arc<memattn::attn::CudaStream>>,
        qkv: [&TensorView<'_>; 3],
        outs: Option<(&mut memattn::attn::TensorViewMut<'_>, &mut memattn::attn::LseViewMut<'_>)>,
        alibi: Option<&memattn::attn::AlibiView<'_>>,
    ) -> Result<Option<(memattn::attn::DeviceTensor, memattn::attn::DeviceTensor)>> {
        let opts = self.opts()?;
        let opts = match alibi {
            Some(a) => opts.alibi_slopes(a),
            None => opts,
        };
        let [q, k, v] = qkv;
        match &self.varlen {
            None => match outs {
                Some((o, lse)) => kernels.flash_attn_into(q, k, v, o, lse, &opts).map(|_| None),
                None => kernels.flash_attn(q, k, v, &opts).map(Some),
            },
            Some(va) => {
                let cq = kernels.index_tensor(&va.cu_q, stream).map_err(wrap)?;
                let ck = kernels.index_tensor(&va.cu_k, stream).map_err(wrap)?;
                let (mq, mk) = (va.max_seqlen_q, va.max_seqlen_k);
                match outs {
                    Some((o, lse)) => {
                        kernels.flash_attn_varlen_into(q, k, v, &cq, &ck, mq, mk, o, lse, &opts).map(|_| None)
                    }
                    None => kernels.flash_attn_varlen(q, k, v, &cq, &ck, mq, mk, &opts).map(Some),
                }
            }
        }
        .map_err(wrap)
    }
}

/// Keeps the LSE of an op's forward until [`take_lse_from`] hands it out.
fn keep_lse(slot: &Mutex<Option<Storage>>, lse: Storage) -> Result<()> {
    *slot.lock().map_err(|_| candle_core::Error::Msg("memattn: LSE lock poisoned".into()))? = Some(lse);
    Ok(())
}

/// The LSE an op's last forward kept, as a tensor of `shape`.
fn take_lse_from<S: Into<Shape>>(slot: &Mutex<Option<Storage>>, shape: S) -> Result<Tensor> {
    let lse = slot.lock().map_err(|_| candle_core::Error::Msg("memattn: LSE lock poisoned".into()))?.take();
    let lse = lse.ok_or_else(|| candle_core::Error::Msg("memattn: the op produced no LSE".into()))?;
    Ok(Tensor::from_storage(lse, shape, BackpropOp::none(), false))
}

/// O computed in f32, as CPU storage of the inputs' dtype.
fn cpu_storage(o: Vec<f32>, dtype: DType) -> CpuStorage {
    match dtype {
        DType::BF16 => CpuStorage::BF16(o.iter().map(|&x| half::bf16::from_f32(x)).collect()),
        DType::F16 => CpuStorage::F16(o.iter().map(|&x| half::f16::from_f32(x)).collect()),
        _ => CpuStorage::F32(o),
    }
}

/// memattn's typed error as a candle error that keeps the type: candle's `Error::Cuda`, the one
/// variant that boxes a `std::error::Error` and shows its message as it is (`Error::wrap` boxes a
/// `Display`, which cannot be downcast). [`attn_error`] finds it again.
fn wrap(e: AttnError) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e)).bt()
}

/// The [`AttnError`] a call of this crate failed with, when memattn refused it or its device
/// failed: a shape, dtype, head dim, index or aliasing rule with its values, or a device error.
/// `None` for the errors of the candle side (argument checks of this crate, candle's own).
///
/// It looks through the wrappers candle adds on the way up: a backtrace (`RUST_BACKTRACE`),
/// `Error::context`, a path, and `candle_core::Context::context` on a `Result` of a candle error.
/// On either device the error rides in candle's `Error::Cuda` variant (candle's only variant
/// that keeps a `std::error::Error`), so use this function, not that variant's name, to tell a
/// refusal of memattn's from a failure of candle's CUDA backend.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use memattn_candle::{attn_error, AttnError};
/// let q = Tensor::zeros((1, 4, 2, 84), candle_core::DType::F32, &Device::Cpu)?; // 84: no multiple of 8
/// let e = memattn_candle::flash_attn(&q, &q, &q, 0.1, false).unwrap_err();
/// let e = e.context("layer 3");
/// assert!(matches!(
///     attn_error(&e),
///     Some(AttnError::Problem(memattn_candle::memattn::problem::ProblemError::UnsupportedHeadDim { got: 84, .. }))
/// ));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attn_error(e: &candle_core::Error) -> Option<&AttnError> {
    use candle_core::Error as E;
    match e {
        E::Cuda(b) => b.downcast_ref::<AttnError>(),
        E::WrappedContext { wrapped, .. } => wrapped
            .downcast_ref::<AttnError>()
            .or_else(|| wrapped.downcast_ref::<candle_core::Error>().and_then(attn_error)),
        E::Context { inner, .. } | E::WithPath { inner, .. } | E::WithBacktrace { inner, .. } => attn_error(inner),
        _ => None,
    }
}

fn no_kernel(d: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!("memattn flash_attn: dtype {d:?} has no kernel (f32, bf16 and f16 have)"))
}

fn dtype_of(d: DType) -> Result<Dtype> {
    match d {
        DType::F32 => Ok(Dtype::F32),
        DType::BF16 => Ok(Dtype::Bf16),
        DType::F16 => Ok(Dtype::F16),
        other => Err(no_kernel(other)),
    }
}

fn dims4(l: &Layout, what: &str) -> Result<[usize; 4]> {
    match l.dims() {
        &[a, b, c, d] => Ok([a, b, c, d]),
        other => Err(candle_core::Error::Msg(format!(
            "memattn flash_attn: {what} must be 4-d [batch, seq, heads, head_dim], got shape {other:?}"
        ))),
    }
}

fn strides4(l: &Layout) -> [usize; 4] {
    let s = l.stride();
    [s[0], s[1], s[2], s[3]]
}

/// What the first op on candle's CPU device prints to stderr, once per process (unless
/// [`VM_NOTICE_QUIET_ENV`] is set): the CPU device runs the kernels in the PTX VM.
pub const VM_NOTICE: &str = "memattn-candle: attention on candle's CPU device runs memattn's PTX kernels in the \
     PTX VM on the CPU, 4-20x slower than candle's own CPU ops: right for tests, not for CPU \
     deployment (set MEMATTN_CANDLE_VM_QUIET=1 to silence this notice)";

/// Set (to any value) in the environment, it silences [`VM_NOTICE`].
pub const VM_NOTICE_QUIET_ENV: &str = "MEMATTN_CANDLE_VM_QUIET";

/// The process's VM kernels (the PTX is parsed once); the first call says [`VM_NOTICE`].
#[cfg(feature = "vm")]
fn vm_kernels() -> Result<&'static Kernels> {
    static NOTICE: std::sync::Once = std::sync::Once::new();
    NOTICE.call_once(|| {
        if std::env::var_os(VM_NOTICE_QUIET_ENV).is_none() {
            eprintln!("{VM_NOTICE}");
        }
    });
    static VM: std::sync::OnceLock<std::result::Result<Kernels, String>> = std::sync::OnceLock::new();
    VM.get_or_init(|| Kernels::vm().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| candle_core::Error::Msg(format!("memattn: the PTX VM did not start: {e}")))
}

/// Without the `vm` feature there are no kernels for candle's CPU device.
#[cfg(not(feature = "vm"))]
fn vm_kernels() -> Result<&'static Kernels> {
    Err(candle_core::Error::Msg(
        "memattn: this tensor is on candle's CPU device, whose ops run in memattn's PTX VM, and \
         memattn-candle was built without its feature `vm`; use a CUDA device (feature `cuda`) or \
         turn `vm` on"
            .into(),
    ))
}

/// The storage's elements from the layout's start on, as f32 (16-bit values exactly).
fn host_f32(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let start = l.start_offset();
    Ok(match s {
        CpuStorage::F32(x) => x[start..].to_vec(),
        CpuStorage::BF16(x) => x[start..].iter().map(|v| v.to_f32()).collect(),
        CpuStorage::F16(x) => x[start..].iter().map(|v| v.to_f32()).collect(),
        other => return Err(no_kernel(other.dtype())),
    })
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "memattn-flash-attn"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let kernels = vm_kernels()?;
        let mut bufs = Vec::with_capacity(3);
        for ((s, l), what) in [(s1, l1), (s2, l2), (s3, l3)].into_iter().zip(["q", "k", "v"]) {
            let dtype = dtype_of(s.dtype())?;
            let (shape, strides) = self.view_dims(l, what)?;
            bufs.push((kernels.vm_upload_as(dtype, &host_f32(s, l)?).map_err(wrap)?, dtype, shape, strides));
        }
        let views: Vec<TensorView<'_>> = bufs
            .iter()
            .map(|(b, dtype, shape, strides)| TensorView::vm(b, *dtype, *shape).map(|v| v.with_strides(*strides)))
            .collect::<std::result::Result<_, _>>()
            .map_err(wrap)?;
        // ALiBi slopes on the VM (a CPU tensor: no device read).
        let slopes = match &self.alibi_slopes {
            Some(t) => Some(kernels.vm_upload(&t.flatten_all()?.to_vec1::<f32>()?).map_err(wrap)?),
            None => None,
        };
        let alibi = match (&slopes, self.alibi_dims()) {
            (Some(b), Some((batch, heads))) => Some(memattn::attn::AlibiView::vm(b, batch, heads).map_err(wrap)?),
            _ => None,
        };
        let (o, lse) = self
            .launch(kernels, None, [&views[0], &views[1], &views[2]], None, alibi.as_ref())?
            .expect("allocating call");
        let out = cpu_storage(o.to_vec_f32().map_err(wrap)?, s1.dtype());
        keep_lse(&self.lse, Storage::Cpu(CpuStorage::F32(lse.to_vec_f32().map_err(wrap)?)))?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match s1.dtype() {
            DType::F32 => cuda::fwd::<f32>(self, s1, l1, s2, l2, s3, l3),
            DType::BF16 => cuda::fwd::<half::bf16>(self, s1, l1, s2, l2, s3, l3),
            DType::F16 => cuda::fwd::<half::f16>(self, s1, l1, s2, l2, s3, l3),
            other => Err(no_kernel(other)),
        }
    }

    /// dq, dk, dv of O for the upstream gradient `grad_o` (see the type's "Gradients").
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _o: &Tensor,
        grad_o: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if self.alibi_slopes.is_some() {
            return Err(bwd_err("ALiBi has no backward (the forward and decode kernels take it)".into()));
        }
        let dtype = dtype_of(q.dtype())
            .map_err(|_| bwd_err(format!("q is {:?}; f32, bf16 and f16 have a backward", q.dtype())))?;
        for (t, what) in [(k, "k"), (v, "v")] {
            if t.dtype() != q.dtype() {
                return Err(bwd_err(format!("{what} is {:?} while q is {:?}", t.dtype(), q.dtype())));
            }
        }
        // The upstream gradient in the inputs' dtype (the backward kernels read d_o in q's).
        let grad_o = grad_o.to_dtype(q.dtype())?;
        // A head dim without a backward kernel in this dtype is refused here, with the library's
        // error naming the head dims there are, before the forward is recomputed.
        let (qs, _) = self.view_dims(q.layout(), "q")?;
        let seq_kv = match &self.varlen {
            Some(va) => va.max_seqlen_k,
            None => self.view_dims(k.layout(), "k")?.0[1],
        };
        memattn::attn::flash_attn_backward_workspace(dtype, qs, seq_kv, false)
            .map_err(|e| wrap(e).context("memattn flash_attn backward"))?;
        let (dq, dk, dv) = match q.device() {
            candle_core::Device::Cpu => self.vm_bwd(dtype, q, k, v, &grad_o)?,
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(_) => match dtype {
                Dtype::F32 => cuda::bwd::<f32>(self, q, k, v, &grad_o)?,
                Dtype::Bf16 => cuda::bwd::<half::bf16>(self, q, k, v, &grad_o)?,
                Dtype::F16 => cuda::bwd::<half::f16>(self, q, k, v, &grad_o)?,
            },
            _ => {
                return Err(candle_core::Error::BackwardNotSupported {
                    op: "memattn-flash-attn on this device (the backward runs on candle's CPU device and, with the `cuda` feature, on a CUDA device)",
                })
            }
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

impl FlashAttn {
    /// The backward on candle's CPU device: contiguous copies of q, k, v and `grad_o` in the
    /// VM (in `dtype`), the forward recomputed there for O and LSE, then memattn's backward.
    fn vm_bwd(
        &self,
        dtype: Dtype,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        grad_o: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let kernels = vm_kernels()?;
        let upload = |t: &Tensor, what: &str| -> Result<(memattn::attn::VmBuffer, [usize; 4])> {
            let t = t.contiguous()?;
            let (shape, _) = self.view_dims(t.layout(), what)?;
            // 16-bit values are exact in f32 and are stored back in `dtype`.
            let x = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            Ok((kernels.vm_upload_as(dtype, &x).map_err(wrap)?, shape))
        };
        let ((qb, qs), (kb, ks), (vb, _), (gb, _)) =
            (upload(q, "q")?, upload(k, "k")?, upload(v, "v")?, upload(grad_o, "the gradient of O")?);
        let (qn, kn) = (qs.iter().product::<usize>(), ks.iter().product::<usize>());
        // Batch, heads and rows of the LSE (varlen: batch 1 and total_q rows).
        let [b, sq, h, _] = qs;
        // Poisoned outputs: an element the kernels do not write reads back as NaN.
        let alloc = |n: usize, dt: Dtype| kernels.vm_upload_as(dt, &vec![f32::NAN; n]).map_err(wrap);
        let (o, lse) = (alloc(qn, dtype)?, alloc(b * h * sq, Dtype::F32)?);
        let (dq, dk, dv) = (alloc(qn, dtype)?, alloc(kn, dtype)?, alloc(kn, dtype)?);
        let view = |buf, shape| TensorView::vm(buf, dtype, shape).map_err(wrap);
        let view_mut = |buf, shape| memattn::attn::TensorViewMut::vm(buf, dtype, shape).map_err(wrap);
        let (qv, kv, vv) = (view(&qb, qs)?, view(&kb, ks)?, view(&vb, ks)?);
        {
            let mut lse_out = memattn::attn::LseViewMut::vm(&lse, b, h, sq).map_err(wrap)?;
            self.launch(kernels, None, [&qv, &kv, &vv], Some((&mut view_mut(&o, qs)?, &mut lse_out)), None)?;
        }
        let (ov, lv, gv) = (view(&o, qs)?, memattn::attn::LseView::vm(&lse, b, h, sq).map_err(wrap)?, view(&gb, qs)?);
        let (mut dqv, mut dkv, mut dvv) = (view_mut(&dq, qs)?, view_mut(&dk, ks)?, view_mut(&dv, ks)?);
        let opts = self.opts()?;
        match &self.varlen {
            None => kernels.flash_attn_backward_into(&qv, &kv, &vv, &ov, &lv, &gv, &mut dqv, &mut dkv, &mut dvv, &opts),
            Some(va) => {
                let cq = kernels.index_tensor(&va.cu_q, None).map_err(wrap)?;
                let ck = kernels.index_tensor(&va.cu_k, None).map_err(wrap)?;
                kernels.flash_attn_varlen_backward_into(
                    &qv,
                    &kv,
                    &vv,
                    &cq,
                    &ck,
                    va.max_seqlen_q,
                    va.max_seqlen_k,
                    &ov,
                    &lv,
                    &gv,
                    &mut dqv,
                    &mut dkv,
                    &mut dvv,
                    &opts,
                    &memattn::attn::BwdOpts::new(),
                )
            }
        }
        .map_err(wrap)?;
        let back = |buf: &memattn::attn::VmBuffer, n: usize, like: &Tensor| -> Result<Tensor> {
            let x = Tensor::from_vec(buf.read_f32(dtype, n).map_err(wrap)?, like.shape(), like.device())?;
            // Values of `dtype` read as f32: the conversion back is exact.
            x.to_dtype(like.dtype())
        };
        Ok((back(&dq, qn, q)?, back(&dk, kn, k)?, back(&dv, kn, v)?))
    }
}

fn bwd_err(why: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("memattn flash_attn backward: {why}"))
}

/// Decode attention over a KV cache, FlashAttention-2's `flash_attn_with_kvcache`, with its
/// arguments in FlashAttention-2's order: `q, k_cache, v_cache, k, v, cache_seqlens,
/// block_table`, then the scale, the causal flag and the split count.
///
/// - `q`: `[batch, seq_q, heads, head_dim]` (`seq_q` 1 for plain decode, more for speculative
///   decoding), contiguous.
/// - `k_cache`, `v_cache`: contiguous `[batch, seq_cache, heads_kv, head_dim]`, or, with a
///   `block_table`, a paged cache `[num_pages, page_size, heads_kv, head_dim]`; `heads_kv`
///   divides `heads` (GQA).
/// - `k`, `v`: new tokens `[batch, seq_new, heads_kv, head_dim]`, both or neither.
/// - `cache_seqlens`: `[batch]` u32, the keys each sequence holds in the cache before the call.
/// - `block_table`: `[batch, max_pages]` u32 page indices (paged cache only).
/// - `num_splits`: 0 lets memattn choose the KV split count (flash-decoding), `n` is `n` splits.
///
/// # What is written
///
/// With `k` and `v` given, **`k_cache` and `v_cache` are modified in place**, as in
/// FlashAttention-2: for each sequence `b`, `k[b]` and `v[b]` are written into cache rows
/// `cache_seqlens[b] .. cache_seqlens[b] + seq_new` (through `block_table` for a paged cache),
/// and attention then runs over the `cache_seqlens[b] + seq_new` keys. No other element of the
/// caches is written, and `cache_seqlens` is not advanced: the caller adds `seq_new` for the next
/// step. Every tensor sharing the caches' storage (clones, views) sees the new rows. The caches
/// must not share storage with `q`, `k`, `v` (refused with an error). They may be views of one
/// storage whose bytes do not overlap (vLLM's joint layout: `kv.i(0)?` and `kv.i(1)?` of one
/// `[2, num_pages, page_size, heads_kv, head_dim]` tensor); overlapping views are refused with
/// memattn's [`AttnError::Aliasing`], which names the shared bytes. Without `k` and `v` the
/// caches are only read.
///
/// # Index checks
///
/// Every index (capacity, page numbers, slots, left padding, no appended page referenced twice)
/// is checked before it is used, in one of two places:
/// - on a candle CPU device, on the host, before anything is written (an error from this call);
/// - on a CUDA device (feature `cuda`), **on the device**: `cache_seqlens`, `block_table`,
///   `cache_batch_idx` and `cache_leftpad` are never copied to the host (no synchronisation per
///   layer and step, so the loop can be captured in a CUDA graph). The call is planned from the
///   cache's size, as FlashAttention-2 plans it; its first kernel checks the indices, and on a
///   violation the call writes NaN into O and LSE and does not touch the caches, and so does
///   every later call until [`check_kv_status`] reads the violation (as a typed error) and clears
///   it. Call it when a result is about to be used, e.g. before sampling.
///
/// On a candle CPU device the call runs in memattn's PTX VM (the caches are copied in, the
/// appended rows copied back); on a CUDA device (feature `cuda`) memattn's kernels write the
/// caches in candle's memory on candle's stream.
#[allow(clippy::too_many_arguments)] // FlashAttention-2's signature
pub fn flash_attn_with_kvcache(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    k: Option<&Tensor>,
    v: Option<&Tensor>,
    cache_seqlens: &Tensor,
    block_table: Option<&Tensor>,
    softmax_scale: f32,
    causal: bool,
    num_splits: usize,
) -> Result<Tensor> {
    Ok(flash_attn_with_kvcache_with_lse(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        block_table,
        softmax_scale,
        causal,
        num_splits,
    )?
    .0)
}

/// As [`flash_attn_with_kvcache`] (the same arguments and the same in-place append), also
/// returning the LSE: `[batch, heads, seq_q]` f32, natural log.
#[allow(clippy::too_many_arguments)] // FlashAttention-2's signature
pub fn flash_attn_with_kvcache_with_lse(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    k: Option<&Tensor>,
    v: Option<&Tensor>,
    cache_seqlens: &Tensor,
    block_table: Option<&Tensor>,
    softmax_scale: f32,
    causal: bool,
    num_splits: usize,
) -> Result<(Tensor, Tensor)> {
    flash_attn_with_kvcache_opts(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        block_table,
        softmax_scale,
        causal,
        num_splits,
        &KvCacheOpts::default(),
    )
}

/// FlashAttention-2's keyword arguments of `flash_attn_with_kvcache` that
/// [`flash_attn_with_kvcache`] has no place for (docs/semantics.md for each rule):
/// - `window_size_left`/`right` (`None` unbounded) and `softcap`;
/// - `rotary_cos`, `rotary_sin` (`[seqlen_ro, rotary_dim / 2]` in q's dtype) and
///   `rotary_interleaved`: q and the new keys rotated at their positions before the append;
/// - `cache_batch_idx` (u32 `[batch]`: each sequence's cache slot) and `cache_leftpad` (u32
///   `[batch]`: the row its keys begin at), contiguous caches only;
/// - `alibi_slopes` (f32 `[heads]` or `[batch, heads]`) and `sinks` (f32 `[heads]`, gpt-oss).
///
/// Index tensors are checked where `cache_seqlens` is ([`flash_attn_with_kvcache`]'s "Index
/// checks").
#[derive(Clone, Copy, Debug, Default)]
pub struct KvCacheOpts<'a> {
    /// Keys left of the diagonal a query sees; `None` unbounded.
    pub window_size_left: Option<usize>,
    /// Keys right of the diagonal a query sees; `None` unbounded.
    pub window_size_right: Option<usize>,
    /// `softcap · tanh(score / softcap)`; `None` is off.
    pub softcap: Option<f32>,
    /// Rotary cosines, `[seqlen_ro, rotary_dim / 2]` in q's dtype.
    pub rotary_cos: Option<&'a Tensor>,
    /// Rotary sines, shaped as `rotary_cos`.
    pub rotary_sin: Option<&'a Tensor>,
    /// GPT-J pairs (adjacent dims) instead of GPT-NeoX halves.
    pub rotary_interleaved: bool,
    /// u32 `[batch]`: each sequence's cache slot (contiguous caches).
    pub cache_batch_idx: Option<&'a Tensor>,
    /// u32 `[batch]`: the row each sequence's keys begin at (contiguous caches).
    pub cache_leftpad: Option<&'a Tensor>,
    /// f32 `[heads]` or `[batch, heads]`: ALiBi slopes.
    pub alibi_slopes: Option<&'a Tensor>,
    /// f32 `[heads]`: a sink logit per head in the softmax's denominator.
    pub sinks: Option<&'a Tensor>,
}

/// [`flash_attn_with_kvcache_with_lse`] with FlashAttention-2's keyword arguments
/// ([`KvCacheOpts`]): the same in-place append, O and the LSE.
#[allow(clippy::too_many_arguments)] // FlashAttention-2's signature
pub fn flash_attn_with_kvcache_opts(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    k: Option<&Tensor>,
    v: Option<&Tensor>,
    cache_seqlens: &Tensor,
    block_table: Option<&Tensor>,
    softmax_scale: f32,
    causal: bool,
    num_splits: usize,
    opts: &KvCacheOpts<'_>,
) -> Result<(Tensor, Tensor)> {
    // On the CPU the values are read (no device to wait for) and checked on the host; on a
    // device the tensors are kept, read there by the kernels and checked by the first of them.
    let on_cpu = cache_seqlens.device().is_cpu();
    let u32s = |t: &Tensor, what: &str, rank: usize| -> Result<Vec<u32>> {
        if t.dtype() != DType::U32 || t.rank() != rank {
            return Err(kv_err(format!("{what} must be a {rank}-d u32 tensor, got {:?} {:?}", t.dtype(), t.dims())));
        }
        if !t.device().same_device(cache_seqlens.device()) {
            return Err(kv_err(format!(
                "{what} is on {:?}, cache_seqlens on {:?}",
                t.device(),
                cache_seqlens.device()
            )));
        }
        match on_cpu {
            true => t.flatten_all()?.to_vec1::<u32>(),
            false => Ok(Vec::new()),
        }
    };
    let on_device = |t: Option<&Tensor>| -> Result<Option<Tensor>> {
        t.filter(|_| !on_cpu).map(|t| t.flatten_all()?.contiguous()).transpose()
    };
    let num_splits =
        u32::try_from(num_splits).map_err(|_| kv_err(format!("num_splits {num_splits} is over the limit")))?;
    let f32_tensor = |t: &Tensor, what: &str| -> Result<Tensor> {
        if t.dtype() != DType::F32 || !matches!(t.rank(), 1 | 2) {
            return Err(kv_err(format!("{what} must be a 1-d or 2-d f32 tensor, got {:?} {:?}", t.dtype(), t.dims())));
        }
        t.contiguous()
    };
    let rotary = match (opts.rotary_cos, opts.rotary_sin) {
        (Some(c), Some(s)) => {
            for (t, what) in [(c, "rotary_cos"), (s, "rotary_sin")] {
                if t.dtype() != q.dtype() || t.rank() != 2 {
                    return Err(kv_err(format!(
                        "{what} must be a 2-d [seqlen_ro, rotary_dim / 2] tensor of q's dtype {:?}, got {:?} {:?}",
                        q.dtype(),
                        t.dtype(),
                        t.dims()
                    )));
                }
            }
            Some((c.contiguous()?, s.contiguous()?, opts.rotary_interleaved))
        }
        (None, None) => None,
        _ => return Err(kv_err("rotary_cos and rotary_sin come together".into())),
    };
    let extras = KvExtras {
        window: (opts.window_size_left, opts.window_size_right),
        softcap: opts.softcap,
        cache_batch_idx: opts.cache_batch_idx.map(|t| u32s(t, "cache_batch_idx", 1)).transpose()?,
        cache_leftpad: opts.cache_leftpad.map(|t| u32s(t, "cache_leftpad", 1)).transpose()?,
        sinks: opts.sinks.map(|t| f32_tensor(t, "sinks")).transpose()?,
        alibi_slopes: opts.alibi_slopes.map(|t| f32_tensor(t, "alibi_slopes")).transpose()?,
        rotary,
    };
    let op = FlashAttnKvCache {
        softmax_scale,
        causal,
        num_splits,
        cache_seqlens: u32s(cache_seqlens, "cache_seqlens", 1)?,
        block_table: block_table.map(|t| u32s(t, "block_table", 2)).transpose()?,
        device_indices: match on_cpu {
            true => None,
            false => Some(DeviceIndices {
                cache_seqlens: on_device(Some(cache_seqlens))?.expect("given"),
                block_table: on_device(block_table)?,
                cache_batch_idx: on_device(opts.cache_batch_idx)?,
                cache_leftpad: on_device(opts.cache_leftpad)?,
            }),
        },
        extras,
        lse: Mutex::new(None),
    };
    let (b, sq, h, _) = q.dims4()?;
    match (k, v) {
        (None, None) => {
            let o = q.apply_op3_no_bwd(k_cache, v_cache, &op)?;
            Ok((o, take_lse_from(&op.lse, (b, h, sq))?))
        }
        (Some(k), Some(v)) => append::run(&op, q, k_cache, v_cache, k, v),
        (Some(_), None) => Err(kv_err("v is missing while k is given (new keys and values come together)".into())),
        (None, Some(_)) => Err(kv_err("k is missing while v is given (new keys and values come together)".into())),
    }
}

/// Reads (and clears) the status of the KV-cache calls on `device` whose indices were checked on
/// the device ([`flash_attn_with_kvcache`]'s "Index checks"), after waiting for them: `Ok` when
/// every index held, else the first violation, naming the rule and the sequence. This is the
/// one read back to the host of that path. On a CPU device the indices were checked on the host
/// before each call, so there is nothing to read.
pub fn check_kv_status(device: &candle_core::Device) -> Result<()> {
    match device {
        candle_core::Device::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => cuda::kernels_for(d.cuda_stream().context())?.check_kv_status().map_err(wrap),
        other => Err(kv_err(format!("no memattn kernels on {other:?}"))),
    }
}

fn kv_err(why: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("memattn flash_attn_with_kvcache: {why}"))
}

/// The candle op behind [`flash_attn_with_kvcache`] without new tokens (forward only, the cache
/// read-only); with new tokens the same settings run as an in-place op on the caches.
pub struct FlashAttnKvCache {
    /// The scale of `q · k` before the softmax.
    pub softmax_scale: f32,
    /// Bottom-right causal mask over the cache and the new tokens.
    pub causal: bool,
    /// 0: memattn's choice.
    pub num_splits: u32,
    /// The host's values (a CPU device; empty on a CUDA device, see `device_indices`).
    pub cache_seqlens: Vec<u32>,
    /// `[batch, max_pages]`, row-major; `None`: a contiguous cache. Host values as
    /// `cache_seqlens`.
    pub block_table: Option<Vec<u32>>,
    /// On a CUDA device: the index tensors themselves (flattened, contiguous), read by the
    /// kernels and checked on the device, never copied to the host.
    pub device_indices: Option<DeviceIndices>,
    /// The options of [`flash_attn_with_kvcache_opts`] (none for [`flash_attn_with_kvcache`]).
    pub extras: KvExtras,
    lse: Mutex<Option<Storage>>,
}

/// A KV-cache call's index tensors on a device ([`FlashAttnKvCache::device_indices`]).
#[derive(Clone, Debug)]
pub struct DeviceIndices {
    /// u32 `[batch]`: keys in each sequence's cache before the call.
    pub cache_seqlens: Tensor,
    /// u32 `[batch, max_pages]`: a paged cache's block table.
    pub block_table: Option<Tensor>,
    /// u32 `[batch]`: each sequence's cache slot.
    pub cache_batch_idx: Option<Tensor>,
    /// u32 `[batch]`: the row each sequence's keys begin at.
    pub cache_leftpad: Option<Tensor>,
}

/// [`FlashAttnKvCache`]'s options beyond FlashAttention-2's positional arguments: the scalars, the
/// index vectors (read to the host, as `cache_seqlens` is) and the small tensors.
#[derive(Clone, Debug, Default)]
pub struct KvExtras {
    /// `(left, right)` keys around the diagonal, `None` unbounded.
    pub window: (Option<usize>, Option<usize>),
    /// `softcap · tanh(score / softcap)`; `None` is off.
    pub softcap: Option<f32>,
    /// Each sequence's cache slot (host values).
    pub cache_batch_idx: Option<Vec<u32>>,
    /// The row each sequence's keys begin at (host values).
    pub cache_leftpad: Option<Vec<u32>>,
    /// f32 `[heads]`.
    pub sinks: Option<Tensor>,
    /// f32 `[heads]` or `[batch, heads]`.
    pub alibi_slopes: Option<Tensor>,
    /// `[seqlen_ro, rotary_dim / 2]` cos and sin in q's dtype, and GPT-J pairs.
    pub rotary: Option<(Tensor, Tensor, bool)>,
}

impl KvExtras {
    fn rotary_interleaved(&self) -> bool {
        self.rotary.as_ref().is_some_and(|r| r.2)
    }
    fn alibi_2d(&self) -> bool {
        self.alibi_slopes.as_ref().is_some_and(|t| t.rank() == 2)
    }
    /// Read guards of the option tensors' storages (sinks, slopes, cos, sin), held over a launch.
    #[cfg(feature = "cuda")]
    fn guards(&self) -> [Option<(impl std::ops::Deref<Target = Storage> + '_, &Layout)>; 4] {
        [
            self.sinks.as_ref().map(|t| t.storage_and_layout()),
            self.alibi_slopes.as_ref().map(|t| t.storage_and_layout()),
            self.rotary.as_ref().map(|r| r.0.storage_and_layout()),
            self.rotary.as_ref().map(|r| r.1.storage_and_layout()),
        ]
    }
}

impl FlashAttnKvCache {
    fn opts(&self) -> AttnOpts<'static> {
        let side = |w: Option<usize>| w.map(|w| u32::try_from(w).unwrap_or(u32::MAX));
        let opts = AttnOpts::new()
            .softmax_scale(self.softmax_scale)
            .causal(self.causal)
            .num_splits(self.num_splits)
            .window(side(self.extras.window.0), side(self.extras.window.1));
        match self.extras.softcap {
            Some(c) => opts.softcap(c),
            None => opts,
        }
    }

    /// [`Self::opts`] with the index tensors and device views of the extras.
    fn opts_with<'a>(&self, ix: &'a KvIndices, v: &'a ExtraViews<'a>) -> AttnOpts<'a> {
        let mut o: AttnOpts<'a> = self.opts();
        if let Some(t) = &ix.slots {
            o = o.cache_batch_idx(t);
        }
        if let Some(t) = &ix.leftpad {
            o = o.cache_leftpad(t);
        }
        if let Some(s) = &v.sinks {
            o = o.sinks(s);
        }
        if let Some(a) = &v.alibi {
            o = o.alibi_slopes(a);
        }
        if let Some(r) = &v.rotary {
            o = o.rotary(r);
        }
        o
    }

    /// The call's index tensors on a CUDA device, copied device to device on `stream` into
    /// tensors without host values: the kernels check them ([`check_kv_status`]).
    #[cfg(feature = "cuda")]
    fn cuda_indices(&self, kernels: &Kernels, stream: &Arc<memattn::attn::CudaStream>) -> Result<KvIndices> {
        let d = self
            .device_indices
            .as_ref()
            .ok_or_else(|| kv_err("the index tensors are not on the CUDA device of q".into()))?;
        let ix = |t: &Tensor| -> Result<memattn::attn::IndexTensor> {
            let (st, l) = t.storage_and_layout();
            let Storage::Cuda(cs) = &*st else {
                return Err(kv_err(format!("an index tensor is on {:?}, not a CUDA device", t.device())));
            };
            let n = l.shape().elem_count();
            let view = cs.as_cuda_slice::<u32>()?.slice(l.start_offset()..l.start_offset() + n);
            kernels.index_tensor_from_cuda(&view, n, stream).map_err(wrap)
        };
        let opt = |t: &Option<Tensor>| t.as_ref().map(ix).transpose();
        Ok(KvIndices {
            seqlens: ix(&d.cache_seqlens)?,
            table: opt(&d.block_table)?,
            slots: opt(&d.cache_batch_idx)?,
            leftpad: opt(&d.cache_leftpad)?,
        })
    }

    /// The call's index tensors in the VM, from the host values (checked on the host).
    fn indices(&self, kernels: &Kernels) -> Result<KvIndices> {
        let ix = |t: &Option<Vec<u32>>| t.as_ref().map(|t| kernels.index_tensor(t, None)).transpose().map_err(wrap);
        Ok(KvIndices {
            seqlens: kernels.index_tensor(&self.cache_seqlens, None).map_err(wrap)?,
            table: ix(&self.block_table)?,
            slots: ix(&self.extras.cache_batch_idx)?,
            leftpad: ix(&self.extras.cache_leftpad)?,
        })
    }

    /// The extras' tensors copied into the VM (sinks and slopes f32, rotary tables in `dtype`).
    fn vm_extras(&self, kernels: &Kernels, dtype: Dtype) -> Result<VmExtras> {
        let up = |t: &Tensor, dt: Dtype| -> Result<(memattn::attn::VmBuffer, [usize; 2])> {
            let dims = match t.dims() {
                &[a] => [1, a],
                &[a, b] => [a, b],
                other => return Err(kv_err(format!("an option tensor of shape {other:?} (1-d or 2-d)"))),
            };
            let x = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            Ok((kernels.vm_upload_as(dt, &x).map_err(wrap)?, dims))
        };
        let x = &self.extras;
        Ok([
            x.sinks.as_ref().map(|t| up(t, Dtype::F32)).transpose()?,
            x.alibi_slopes.as_ref().map(|t| up(t, Dtype::F32)).transpose()?,
            x.rotary.as_ref().map(|r| up(&r.0, dtype)).transpose()?,
            x.rotary.as_ref().map(|r| up(&r.1, dtype)).transpose()?,
        ])
    }
}

/// The option tensors in the VM (sinks, slopes, cos, sin), each with its 2-d shape.
type VmExtras = [Option<(memattn::attn::VmBuffer, [usize; 2])>; 4];

/// A KV-cache call's index tensors on the device.
struct KvIndices {
    seqlens: memattn::attn::IndexTensor,
    table: Option<memattn::attn::IndexTensor>,
    slots: Option<memattn::attn::IndexTensor>,
    leftpad: Option<memattn::attn::IndexTensor>,
}

/// Device views of a KV-cache call's option tensors.
#[derive(Default)]
struct ExtraViews<'a> {
    sinks: Option<memattn::attn::SinksView<'a>>,
    alibi: Option<memattn::attn::AlibiView<'a>>,
    rotary: Option<memattn::attn::RotaryView<'a>>,
}

impl<'a> ExtraViews<'a> {
    /// Views of [`FlashAttnKvCache::vm_extras`]' buffers (`per_batch_alibi`: `[batch, heads]`).
    fn vm(bufs: &'a VmExtras, dtype: Dtype, interleaved: bool, alibi_2d: bool) -> Result<Self> {
        let mut v = ExtraViews::default();
        if let Some((b, [_, h])) = &bufs[0] {
            v.sinks = Some(memattn::attn::SinksView::vm(b, *h).map_err(wrap)?);
        }
        if let Some((b, [rows, h])) = &bufs[1] {
            v.alibi = Some(memattn::attn::AlibiView::vm(b, alibi_2d.then_some(*rows), *h).map_err(wrap)?);
        }
        if let (Some((c, [n, half])), Some((sn, _))) = (&bufs[2], &bufs[3]) {
            let t = |b| TensorView::vm(b, dtype, [*n, *half, 1, 1]).map_err(wrap);
            v.rotary = Some(memattn::attn::RotaryView::new(t(c)?, t(sn)?, interleaved));
        }
        Ok(v)
    }
}

impl CustomOp3 for FlashAttnKvCache {
    fn name(&self) -> &'static str {
        "memattn-flash-attn-with-kvcache"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let kernels = vm_kernels()?;
        let mut bufs = Vec::with_capacity(3);
        for ((s, l), what) in [(s1, l1), (s2, l2), (s3, l3)].into_iter().zip(["q", "k_cache", "v_cache"]) {
            let dtype = dtype_of(s.dtype())?;
            bufs.push((
                kernels.vm_upload_as(dtype, &host_f32(s, l)?).map_err(wrap)?,
                dtype,
                dims4(l, what)?,
                strides4(l),
            ));
        }
        let view = |i: usize| {
            let (b, dtype, shape, strides) = &bufs[i];
            TensorView::vm(b, *dtype, *shape).map(|v| v.with_strides(*strides)).map_err(wrap)
        };
        let view_mut = |i: usize| {
            let (b, dtype, shape, strides) = &bufs[i];
            memattn::attn::TensorViewMut::vm(b, *dtype, *shape).map(|v| v.with_strides(*strides)).map_err(wrap)
        };
        let ix = self.indices(kernels)?;
        let extras = self.vm_extras(kernels, bufs[0].1)?;
        let ev = ExtraViews::vm(&extras, bufs[0].1, self.extras.rotary_interleaved(), self.extras.alibi_2d())?;
        let (o, lse) = kernels
            .flash_attn_with_kvcache(
                &view(0)?,
                &mut view_mut(1)?,
                &mut view_mut(2)?,
                None,
                None,
                &ix.seqlens,
                ix.table.as_ref(),
                &self.opts_with(&ix, &ev),
            )
            .map_err(wrap)?;
        let out = cpu_storage(o.to_vec_f32().map_err(wrap)?, s1.dtype());
        keep_lse(&self.lse, Storage::Cpu(CpuStorage::F32(lse.to_vec_f32().map_err(wrap)?)))?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        match s1.dtype() {
            DType::F32 => cuda::kvcache_fwd::<f32>(self, s1, l1, s2, l2, s3, l3),
            DType::BF16 => cuda::kvcache_fwd::<half::bf16>(self, s1, l1, s2, l2, s3, l3),
            DType::F16 => cuda::kvcache_fwd::<half::f16>(self, s1, l1, s2, l2, s3, l3),
            other => Err(no_kernel(other)),
        }
    }
}

/// [`flash_attn_with_kvcache`] with new tokens: two nested candle in-place ops, one on `k_cache`
/// (reading `k` and `q`) and inside it one on `v_cache` (reading `v`), so both caches are
/// borrowed mutably from candle while memattn appends and attends.
mod append {
    use super::*;
    use candle_core::{InplaceOp2, InplaceOp3};
    use std::cell::RefCell;

    /// A storage and its layout.
    pub(super) type Operand<'a, S> = (&'a S, &'a Layout);
    /// o and lse of one call.
    type Outs = RefCell<Option<(Storage, Storage)>>;

    pub(super) fn run(
        op: &FlashAttnKvCache,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)];
        for (name, t) in &named[1..] {
            if !t.device().same_device(q.device()) {
                return Err(kv_err(format!(
                    "{name} is on {:?}, q on {:?} (all tensors on one device)",
                    t.device(),
                    q.device()
                )));
            }
        }
        // The caches are locked for writing while the others are read: a storage shared with q,
        // k or v would be written while read (or deadlock on its lock), so it is refused first.
        // k_cache and v_cache may be two views of one storage (vLLM's joint layout, e.g. `kv.i(0)`
        // and `kv.i(1)` of one `[2, num_pages, page_size, heads_kv, head_dim]` tensor): one
        // in-place op then holds that storage, and memattn refuses views that share bytes.
        let key = |t: &Tensor| &*t.storage_and_layout().0 as *const Storage as usize;
        let keys = named.map(|(_, t)| key(t));
        let joint = keys[1] == keys[2];
        for w in [1, 2] {
            if let Some(o) = (0..named.len()).find(|&o| o != w && keys[o] == keys[w] && !(joint && o + w == 3)) {
                return Err(kv_err(format!(
                    "{} shares its storage with {}: the caches are written in place, so neither may share storage with q, k or v",
                    named[w.min(o)].0,
                    named[w.max(o)].0
                )));
            }
        }
        let outs = if joint {
            let op = AppendJoint { op, v_layout: v_cache.layout().clone(), v, outs: RefCell::new(None) };
            k_cache.inplace_op3(k, q, &op)?;
            op.outs
        } else {
            let outer = AppendK { op, v_cache, v, outs: RefCell::new(None) };
            k_cache.inplace_op3(k, q, &outer)?;
            outer.outs
        };
        let (o, lse) = outs.into_inner().ok_or_else(|| kv_err("the op produced no output".into()))?;
        let (b, sq, h, _) = q.dims4()?;
        Ok((
            Tensor::from_storage(o, q.shape().clone(), BackpropOp::none(), false),
            Tensor::from_storage(lse, (b, h, sq), BackpropOp::none(), false),
        ))
    }

    /// The op on `k_cache`; its operands are `k` and `q`.
    struct AppendK<'t> {
        op: &'t FlashAttnKvCache,
        v_cache: &'t Tensor,
        v: &'t Tensor,
        outs: Outs,
    }

    /// The op on `v_cache` (operand `v`), run inside [`AppendK`] with its storages.
    struct AppendV<'a, S> {
        op: &'a FlashAttnKvCache,
        k_cache: RefCell<&'a mut S>,
        k_layout: &'a Layout,
        k: Operand<'a, S>,
        q: Operand<'a, S>,
        outs: &'a Outs,
    }

    /// The op on the one storage of joint caches (`k_cache` its view with the op's layout,
    /// `v_cache` the view with `v_layout`); its operands are `k` and `q`, and `v` is read inside.
    struct AppendJoint<'t> {
        op: &'t FlashAttnKvCache,
        v_layout: Layout,
        v: &'t Tensor,
        outs: Outs,
    }

    impl InplaceOp3 for AppendJoint<'_> {
        fn name(&self) -> &'static str {
            "memattn-flash-attn-with-kvcache (joint k_cache and v_cache)"
        }

        fn cpu_fwd(
            &self,
            kv: &mut CpuStorage,
            lk: &Layout,
            k: &CpuStorage,
            lkn: &Layout,
            q: &CpuStorage,
            lq: &Layout,
        ) -> Result<()> {
            let (vs, lvn) = self.v.storage_and_layout();
            let Storage::Cpu(vs) = &*vs else {
                return Err(kv_err("v is not on the CPU while the caches are (all tensors on one device)".into()));
            };
            let caches = CpuCaches::Joint(kv, lk, &self.v_layout);
            *self.outs.borrow_mut() = Some(cpu_append_attend(self.op, (q, lq), caches, (k, lkn), (vs, lvn))?);
            Ok(())
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            kv: &mut candle_core::CudaStorage,
            lk: &Layout,
            k: &candle_core::CudaStorage,
            lkn: &Layout,
            q: &candle_core::CudaStorage,
            lq: &Layout,
        ) -> Result<()> {
            let (vs, lvn) = self.v.storage_and_layout();
            let Storage::Cuda(vs) = &*vs else {
                return Err(kv_err("v is not on the CUDA device of the caches (all tensors on one device)".into()));
            };
            let caches = cuda::Caches::Joint(kv, lk, &self.v_layout);
            let outs = match q.dtype() {
                DType::F32 => cuda::append_fwd::<f32>(self.op, (q, lq), caches, (k, lkn), (vs, lvn)),
                DType::BF16 => cuda::append_fwd::<half::bf16>(self.op, (q, lq), caches, (k, lkn), (vs, lvn)),
                DType::F16 => cuda::append_fwd::<half::f16>(self.op, (q, lq), caches, (k, lkn), (vs, lvn)),
                other => Err(no_kernel(other)),
            }?;
            *self.outs.borrow_mut() = Some(outs);
            Ok(())
        }
    }

    impl InplaceOp3 for AppendK<'_> {
        fn name(&self) -> &'static str {
            "memattn-flash-attn-with-kvcache (k_cache)"
        }

        fn cpu_fwd(
            &self,
            kc: &mut CpuStorage,
            lk: &Layout,
            k: &CpuStorage,
            lkn: &Layout,
            q: &CpuStorage,
            lq: &Layout,
        ) -> Result<()> {
            let inner = AppendV {
                op: self.op,
                k_cache: RefCell::new(kc),
                k_layout: lk,
                k: (k, lkn),
                q: (q, lq),
                outs: &self.outs,
            };
            self.v_cache.inplace_op2(self.v, &inner)
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            kc: &mut candle_core::CudaStorage,
            lk: &Layout,
            k: &candle_core::CudaStorage,
            lkn: &Layout,
            q: &candle_core::CudaStorage,
            lq: &Layout,
        ) -> Result<()> {
            let inner = AppendV {
                op: self.op,
                k_cache: RefCell::new(kc),
                k_layout: lk,
                k: (k, lkn),
                q: (q, lq),
                outs: &self.outs,
            };
            self.v_cache.inplace_op2(self.v, &inner)
        }
    }

    impl InplaceOp2 for AppendV<'_, CpuStorage> {
        fn name(&self) -> &'static str {
            "memattn-flash-attn-with-kvcache (v_cache)"
        }

        fn cpu_fwd(&self, vc: &mut CpuStorage, lv: &Layout, v: &CpuStorage, lvn: &Layout) -> Result<()> {
            let mut kc = self.k_cache.borrow_mut();
            let caches = CpuCaches::Two((&mut **kc, self.k_layout), (vc, lv));
            let outs = cpu_append_attend(self.op, self.q, caches, self.k, (v, lvn))?;
            *self.outs.borrow_mut() = Some(outs);
            Ok(())
        }
    }

    #[cfg(feature = "cuda")]
    impl InplaceOp2 for AppendV<'_, candle_core::CudaStorage> {
        fn name(&self) -> &'static str {
            "memattn-flash-attn-with-kvcache (v_cache)"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
            Err(kv_err("v_cache is on the CPU, k_cache on a CUDA device (all tensors on one device)".into()))
        }

        fn cuda_fwd(
            &self,
            vc: &mut candle_core::CudaStorage,
            lv: &Layout,
            v: &candle_core::CudaStorage,
            lvn: &Layout,
        ) -> Result<()> {
            let mut kc = self.k_cache.borrow_mut();
            let caches = cuda::Caches::Two((&mut **kc, self.k_layout), (vc, lv));
            let outs = match self.q.0.dtype() {
                DType::F32 => cuda::append_fwd::<f32>(self.op, self.q, caches, self.k, (v, lvn)),
                DType::BF16 => cuda::append_fwd::<half::bf16>(self.op, self.q, caches, self.k, (v, lvn)),
                DType::F16 => cuda::append_fwd::<half::f16>(self.op, self.q, caches, self.k, (v, lvn)),
                other => Err(no_kernel(other)),
            }?;
            *self.outs.borrow_mut() = Some(outs);
            Ok(())
        }
    }

    /// The cache rows (of `[rows, heads_kv * head_dim]`) that receive sequence `b`'s new tokens,
    /// for copying them back from the VM: `cache_seqlens[b] + t` through the block table.
    fn appended_rows(op: &FlashAttnKvCache, batch: usize, seq_new: usize, rows_per: usize) -> Result<Vec<usize>> {
        let mut rows = Vec::with_capacity(batch * seq_new);
        for (b, &len) in op.cache_seqlens.iter().enumerate().take(batch) {
            for t in 0..seq_new {
                let pos = len as usize + t;
                let row = match &op.block_table {
                    None => Some(b * rows_per + pos),
                    Some(table) => {
                        let max_pages = table.len() / batch.max(1);
                        table.get(b * max_pages + pos / rows_per).map(|&p| p as usize * rows_per + pos % rows_per)
                    }
                };
                rows.push(row.ok_or_else(|| kv_err(format!("no cache row for token {pos} of sequence {b}")))?);
            }
        }
        Ok(rows)
    }

    /// Writes `rows` (each `row_len` elements) of the VM cache `buf`, whose view begins
    /// `buf_start` elements into it, into the caller's storage.
    fn copy_rows_back(
        (s, l): (&mut CpuStorage, &Layout),
        (buf, buf_start): (&memattn::attn::VmBuffer, usize),
        rows: &[usize],
        row_len: usize,
    ) -> Result<()> {
        let dtype = dtype_of(s.dtype())?;
        let start = l.start_offset();
        let vm = buf.read_f32(dtype, buf_start + l.shape().elem_count()).map_err(wrap)?;
        for &r in rows {
            let (from, to) = (buf_start + r * row_len, start + r * row_len);
            let src = vm.get(from..from + row_len).ok_or_else(|| kv_err(format!("cache row {r} is past the cache")))?;
            let out_of_range = || kv_err(format!("cache row {r} is past the cache's storage"));
            match s {
                CpuStorage::F32(x) => x.get_mut(to..to + row_len).ok_or_else(out_of_range)?.copy_from_slice(src),
                CpuStorage::BF16(x) => {
                    for (d, &v) in x.get_mut(to..to + row_len).ok_or_else(out_of_range)?.iter_mut().zip(src) {
                        *d = half::bf16::from_f32(v);
                    }
                }
                CpuStorage::F16(x) => {
                    for (d, &v) in x.get_mut(to..to + row_len).ok_or_else(out_of_range)?.iter_mut().zip(src) {
                        *d = half::f16::from_f32(v);
                    }
                }
                other => return Err(no_kernel(other.dtype())),
            }
        }
        Ok(())
    }

    /// The caches of a CPU call: two storages, or one storage both are views of (joint).
    pub(super) enum CpuCaches<'a> {
        Two((&'a mut CpuStorage, &'a Layout), (&'a mut CpuStorage, &'a Layout)),
        /// The storage, k_cache's layout and v_cache's.
        Joint(&'a mut CpuStorage, &'a Layout, &'a Layout),
    }

    /// The CPU path: every tensor into the VM (joint caches as one buffer with both views in
    /// it, so memattn checks that they share no byte), memattn's append and attention there,
    /// then the appended rows back into the caller's caches.
    fn cpu_append_attend(
        op: &FlashAttnKvCache,
        q: Operand<'_, CpuStorage>,
        caches: CpuCaches<'_>,
        k: Operand<'_, CpuStorage>,
        v: Operand<'_, CpuStorage>,
    ) -> Result<(Storage, Storage)> {
        let kernels = vm_kernels()?;
        let upload = |(s, l): Operand<'_, CpuStorage>, what: &str| -> Result<_> {
            let dtype = dtype_of(s.dtype())?;
            Ok((kernels.vm_upload_as(dtype, &host_f32(s, l)?).map_err(wrap)?, dtype, dims4(l, what)?, strides4(l)))
        };
        let bufs = [upload(q, "q")?, upload(k, "k")?, upload(v, "v")?];
        // The caches' buffers, and for each cache its buffer, dtype, shape, strides and first
        // element in the buffer.
        let (kl, vl) = match &caches {
            CpuCaches::Two((_, kl), (_, vl)) | CpuCaches::Joint(_, kl, vl) => (*kl, *vl),
        };
        let cache_bufs = match &caches {
            CpuCaches::Two(kc, vc) => vec![upload((&*kc.0, kc.1), "k_cache")?.0, upload((&*vc.0, vc.1), "v_cache")?.0],
            // The whole storage (`host_f32` reads from the start offset on): both views in it.
            CpuCaches::Joint(s, _, _) => {
                let whole = host_f32(s, &Layout::contiguous(1))?;
                vec![kernels.vm_upload_as(dtype_of(s.dtype())?, &whole).map_err(wrap)?]
            }
        };
        let joint = cache_bufs.len() == 1;
        let cache = |i: usize| -> Result<_> {
            let l = [kl, vl][i];
            let what = ["k_cache", "v_cache"][i];
            let (buf, start) = if joint { (&cache_bufs[0], l.start_offset()) } else { (&cache_bufs[i], 0) };
            Ok((buf, dims4(l, what)?, strides4(l), start))
        };
        let (kc, vc) = (cache(0)?, cache(1)?);
        let dtype = bufs[0].1;
        let view = |i: usize| {
            let (b, dtype, shape, strides) = &bufs[i];
            TensorView::vm(b, *dtype, *shape).map(|v| v.with_strides(*strides)).map_err(wrap)
        };
        fn cache_mut(
            (b, shape, strides, start): (&memattn::attn::VmBuffer, [usize; 4], [usize; 4], usize),
            dtype: Dtype,
        ) -> Result<memattn::attn::TensorViewMut<'_>> {
            memattn::attn::TensorViewMut::vm(b, dtype, shape)
                .and_then(|v| v.with_strides(strides).offset(start))
                .map_err(wrap)
        }
        let [b, sq, h, d] = bufs[0].2;
        let [_, rows_per, hk, _] = kc.1;
        // Poisoned outputs: an element the kernels do not write reads back as NaN.
        let o = kernels.vm_upload_as(dtype, &vec![f32::NAN; b * sq * h * d]).map_err(wrap)?;
        let lse = kernels.vm_upload(&vec![f32::NAN; b * h * sq]).map_err(wrap)?;
        let ix = op.indices(kernels)?;
        let extras = op.vm_extras(kernels, dtype)?;
        let ev = ExtraViews::vm(&extras, dtype, op.extras.rotary_interleaved(), op.extras.alibi_2d())?;
        kernels
            .flash_attn_with_kvcache_into(
                &view(0)?,
                &mut cache_mut(kc, dtype)?,
                &mut cache_mut(vc, dtype)?,
                Some(&view(1)?),
                Some(&view(2)?),
                &ix.seqlens,
                ix.table.as_ref(),
                &mut memattn::attn::TensorViewMut::vm(&o, dtype, [b, sq, h, d]).map_err(wrap)?,
                &mut memattn::attn::LseViewMut::vm(&lse, b, h, sq).map_err(wrap)?,
                &op.opts_with(&ix, &ev),
            )
            .map_err(wrap)?;
        // memattn checked every index before it wrote; the same rows come back.
        let rows = appended_rows(op, b, bufs[1].2[1], rows_per)?;
        match caches {
            CpuCaches::Two(ks, vs) => {
                copy_rows_back(ks, (kc.0, 0), &rows, hk * d)?;
                copy_rows_back(vs, (vc.0, 0), &rows, hk * d)?;
            }
            CpuCaches::Joint(s, kl, vl) => {
                // The buffer is the whole storage: each view's rows at its own offset in both.
                copy_rows_back((&mut *s, kl), (kc.0, kc.3), &rows, hk * d)?;
                copy_rows_back((s, vl), (vc.0, vc.3), &rows, hk * d)?;
            }
        }
        let o = cpu_storage(o.read_f32(dtype, b * sq * h * d).map_err(wrap)?, q.0.dtype());
        let lse = CpuStorage::F32(lse.read_f32(Dtype::F32, b * h * sq).map_err(wrap)?);
        Ok((Storage::Cpu(o), Storage::Cpu(lse)))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, ValidAsZeroBits};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::CudaStorage;
    use memattn::attn::{Element, LseViewMut, TensorViewMut};
    use std::collections::HashMap;
    use std::sync::{Arc, OnceLock};

    /// memattn's kernels per CUDA context (loaded once per context).
    pub(super) fn kernels_for(
        ctx: &Arc<candle_core::cuda_backend::cudarc::driver::CudaContext>,
    ) -> Result<Arc<Kernels>> {
        static CACHE: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();
        let mut map = CACHE
            .get_or_init(Default::default)
            .lock()
            .map_err(|_| candle_core::Error::Msg("memattn: kernel cache lock poisoned".into()))?;
        let key = ctx.cu_ctx() as usize;
        if let Some(k) = map.get(&key) {
            return Ok(k.clone());
        }
        let k = Arc::new(Kernels::cuda(ctx).map_err(wrap)?);
        map.insert(key, k.clone());
        Ok(k)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn fwd<T: Element + CudaDType + DeviceRepr + ValidAsZeroBits>(
        op: &FlashAttn,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let stream = s1.device.cuda_stream();
        let kernels = kernels_for(stream.context())?;
        let (qs, ks, vs) = (s1.as_cuda_slice::<T>()?, s2.as_cuda_slice::<T>()?, s3.as_cuda_slice::<T>()?);
        let view = |s, l: &Layout, what| -> Result<TensorView<'_>> {
            let (shape, strides) = op.view_dims(l, what)?;
            TensorView::cuda(s, &stream, shape)
                .and_then(|v| v.with_strides(strides).offset(l.start_offset()))
                .map_err(wrap)
        };
        let (q, k, v) = (view(qs, l1, "q")?, view(ks, l2, "k")?, view(vs, l3, "v")?);
        let [b, sq, h, d] = q.shape();
        // Not memset: the kernels write every element of o and lse (a row that sees no key gets
        // o = 0, lse = -inf). SAFETY: both are read only after that launch, on this stream.
        let mut o = unsafe { stream.alloc::<T>(b * sq * h * d) }.map_err(candle_core::Error::wrap)?;
        let mut lse = unsafe { stream.alloc::<f32>(b * h * sq) }.map_err(candle_core::Error::wrap)?;
        {
            let mut ov = TensorViewMut::cuda(&mut o, &stream, [b, sq, h, d]).map_err(wrap)?;
            let mut lv = LseViewMut::cuda(&mut lse, &stream, b, h, sq).map_err(wrap)?;
            // ALiBi slopes: the tensor's own device memory (a contiguous f32 tensor on q's device).
            let guard = op.alibi_slopes.as_ref().map(|t| t.storage_and_layout());
            let slopes = match &guard {
                Some((st, l)) => match &**st {
                    Storage::Cuda(cs) => Some(cs.as_cuda_slice::<f32>()?.slice(l.start_offset()..)),
                    other => {
                        return Err(candle_core::Error::Msg(format!(
                            "memattn flash_attn: alibi_slopes is on {:?} while q is on a CUDA device",
                            other.device().location()
                        )))
                    }
                },
                None => None,
            };
            let alibi = match (&slopes, op.alibi_dims()) {
                (Some(s), Some((batch, heads))) => {
                    Some(memattn::attn::AlibiView::cuda(s, &stream, batch, heads).map_err(wrap)?)
                }
                _ => None,
            };
            op.launch(&kernels, Some(&stream), [&q, &k, &v], Some((&mut ov, &mut lv)), alibi.as_ref())?;
        }
        let lse = CudaStorage::wrap_cuda_slice(lse, s1.device.clone());
        keep_lse(&op.lse, Storage::Cuda(lse))?;
        Ok((CudaStorage::wrap_cuda_slice(o, s1.device.clone()), l1.shape().clone()))
    }

    /// The backward on candle's CUDA device, on candle's stream: the forward recomputed into
    /// fresh O and LSE, then memattn's backward into fresh dq, dk, dv (q's dtype, contiguous).
    /// Nothing waits: candle's later work on the stream is ordered after the launches.
    pub(super) fn bwd<T: Element + CudaDType + DeviceRepr + ValidAsZeroBits>(
        op: &FlashAttn,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        grad_o: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let storages = [q, k, v, grad_o].map(|t| t.storage_and_layout());
        let cuda = |i: usize, what: &str| -> Result<(&CudaStorage, &Layout)> {
            match (&*storages[i].0, storages[i].1) {
                (Storage::Cuda(s), l) => Ok((s, l)),
                (other, _) => {
                    Err(bwd_err(format!("{what} is on {:?} while q is on a CUDA device", other.device().location())))
                }
            }
        };
        let ((qs, lq), (ks, lk), (vs, lv), (gs, lg)) =
            (cuda(0, "q")?, cuda(1, "k")?, cuda(2, "v")?, cuda(3, "the gradient of O")?);
        let device = qs.device.clone();
        let stream = device.cuda_stream();
        let kernels = kernels_for(stream.context())?;
        let view = |s, l, what| op_view::<T>(op, s, l, &stream, what);
        let (qv, kv, vv, gv) =
            (view(qs, lq, "q")?, view(ks, lk, "k")?, view(vs, lv, "v")?, view(gs, lg, "the gradient of O")?);
        let (q_shape, k_shape) = (qv.shape(), kv.shape());
        let [b, sq, h, _] = q_shape;
        let (qn, kn) = (q_shape.iter().product::<usize>(), k_shape.iter().product::<usize>());
        // Not memset: the forward writes every element of o and lse, the backward every element
        // of dq, dk and dv. SAFETY: each is read only after the launch that writes it, on this
        // stream.
        let mut o = unsafe { stream.alloc::<T>(qn) }.map_err(candle_core::Error::wrap)?;
        let mut lse = unsafe { stream.alloc::<f32>(b * h * sq) }.map_err(candle_core::Error::wrap)?;
        let mut dq = unsafe { stream.alloc::<T>(qn) }.map_err(candle_core::Error::wrap)?;
        let mut dk = unsafe { stream.alloc::<T>(kn) }.map_err(candle_core::Error::wrap)?;
        let mut dv = unsafe { stream.alloc::<T>(kn) }.map_err(candle_core::Error::wrap)?;
        {
            let mut ov = TensorViewMut::cuda(&mut o, &stream, q_shape).map_err(wrap)?;
            let mut lv = LseViewMut::cuda(&mut lse, &stream, b, h, sq).map_err(wrap)?;
            op.launch(&kernels, Some(&stream), [&qv, &kv, &vv], Some((&mut ov, &mut lv)), None)?;
        }
        {
            let ov = TensorView::cuda(&o, &stream, q_shape).map_err(wrap)?;
            let lv = memattn::attn::LseView::cuda(&lse, &stream, b, h, sq).map_err(wrap)?;
            let mut dqv = TensorViewMut::cuda(&mut dq, &stream, q_shape).map_err(wrap)?;
            let mut dkv = TensorViewMut::cuda(&mut dk, &stream, k_shape).map_err(wrap)?;
            let mut dvv = TensorViewMut::cuda(&mut dv, &stream, k_shape).map_err(wrap)?;
            let opts = op.opts()?;
            match &op.varlen {
                None => {
                    kernels.flash_attn_backward_into(&qv, &kv, &vv, &ov, &lv, &gv, &mut dqv, &mut dkv, &mut dvv, &opts)
                }
                Some(va) => {
                    let cq = kernels.index_tensor(&va.cu_q, Some(&stream)).map_err(wrap)?;
                    let ck = kernels.index_tensor(&va.cu_k, Some(&stream)).map_err(wrap)?;
                    kernels.flash_attn_varlen_backward_into(
                        &qv,
                        &kv,
                        &vv,
                        &cq,
                        &ck,
                        va.max_seqlen_q,
                        va.max_seqlen_k,
                        &ov,
                        &lv,
                        &gv,
                        &mut dqv,
                        &mut dkv,
                        &mut dvv,
                        &opts,
                        &memattn::attn::BwdOpts::new(),
                    )
                }
            }
            .map_err(wrap)?;
        }
        let tensor = |g, like: &Tensor| {
            let s = Storage::Cuda(CudaStorage::wrap_cuda_slice(g, device.clone()));
            Tensor::from_storage(s, like.shape().clone(), BackpropOp::none(), false)
        };
        Ok((tensor(dq, q), tensor(dk, k), tensor(dv, v)))
    }

    /// A view of an input of `op` (its 4-d or packed shape), with candle's strides and offset.
    fn op_view<'a, T: Element + CudaDType>(
        op: &FlashAttn,
        s: &'a CudaStorage,
        l: &Layout,
        stream: &'a Arc<memattn::attn::CudaStream>,
        what: &str,
    ) -> Result<TensorView<'a>> {
        let (shape, strides) = op.view_dims(l, what)?;
        TensorView::cuda(s.as_cuda_slice::<T>()?, stream, shape)
            .and_then(|v| v.with_strides(strides).offset(l.start_offset()))
            .map_err(wrap)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn kvcache_fwd<T: Element + CudaDType + DeviceRepr + ValidAsZeroBits>(
        op: &FlashAttnKvCache,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        use candle_core::cuda_backend::cudarc::driver::DevicePtr;
        let stream = s1.device.cuda_stream();
        let kernels = kernels_for(stream.context())?;
        let qs = s1.as_cuda_slice::<T>()?;
        let q = TensorView::cuda(qs, &stream, dims4(l1, "q")?)
            .and_then(|v| v.with_strides(strides4(l1)).offset(l1.start_offset()))
            .map_err(wrap)?;
        // The caches are only read (no new tokens), so candle's immutable storage is viewed as
        // the API's cache views; the guards order the launch after the slices' last writes.
        let (ks, vs) = (s2.as_cuda_slice::<T>()?, s3.as_cuda_slice::<T>()?);
        let (kp, _kg) = ks.device_ptr(&stream);
        let (vp, _vg) = vs.device_ptr(&stream);
        let es = std::mem::size_of::<T>() as u64;
        let cache_view = |ptr: u64, len: usize, l: &Layout, what| -> Result<TensorViewMut<'static>> {
            // SAFETY: `ptr` is the start of a live slice of `len` elements of this context,
            // borrowed (with its guard) until after the launch below; with no new tokens the
            // kernels only read it.
            let v = unsafe {
                TensorViewMut::from_raw(&kernels, Some(&stream), ptr, len as u64 * es, T::DTYPE, dims4(l, what)?)
            };
            v.with_strides(strides4(l)).offset(l.start_offset()).map_err(wrap)
        };
        let mut kc = cache_view(kp, ks.len(), l2, "k_cache")?;
        let mut vc = cache_view(vp, vs.len(), l3, "v_cache")?;
        let ix = op.cuda_indices(&kernels, &stream)?;
        let guards = op.extras.guards();
        let slices = extra_slices::<T, _>(&guards)?;
        let ev = extra_views(&slices, &stream, &op.extras)?;
        let [b, sq, h, d] = q.shape();
        // Not memset: the kernels write every element of o and lse (a row that sees no key gets
        // o = 0, lse = -inf). SAFETY: both are read only after that launch, on this stream.
        let mut o = unsafe { stream.alloc::<T>(b * sq * h * d) }.map_err(candle_core::Error::wrap)?;
        let mut lse = unsafe { stream.alloc::<f32>(b * h * sq) }.map_err(candle_core::Error::wrap)?;
        {
            let mut ov = TensorViewMut::cuda(&mut o, &stream, [b, sq, h, d]).map_err(wrap)?;
            let mut lv = LseViewMut::cuda(&mut lse, &stream, b, h, sq).map_err(wrap)?;
            kernels
                .flash_attn_with_kvcache_into(
                    &q,
                    &mut kc,
                    &mut vc,
                    None,
                    None,
                    &ix.seqlens,
                    ix.table.as_ref(),
                    &mut ov,
                    &mut lv,
                    &op.opts_with(&ix, &ev),
                )
                .map_err(wrap)?;
        }
        let lse = CudaStorage::wrap_cuda_slice(lse, s1.device.clone());
        keep_lse(&op.lse, Storage::Cuda(lse))?;
        Ok((CudaStorage::wrap_cuda_slice(o, s1.device.clone()), l1.shape().clone()))
    }

    /// memattn's append and attention on candle's caches, in candle's memory on candle's stream.
    #[allow(clippy::too_many_arguments)]
    /// The caches of a CUDA call: two storages, or one storage both are views of (joint).
    pub(super) enum Caches<'a> {
        Two((&'a mut CudaStorage, &'a Layout), (&'a mut CudaStorage, &'a Layout)),
        /// The storage, k_cache's layout and v_cache's.
        Joint(&'a mut CudaStorage, &'a Layout, &'a Layout),
    }

    pub(super) fn append_fwd<T: Element + CudaDType + DeviceRepr + ValidAsZeroBits>(
        op: &FlashAttnKvCache,
        (qs, lq): (&CudaStorage, &Layout),
        caches: Caches<'_>,
        (ks, lk): (&CudaStorage, &Layout),
        (vs, lv): (&CudaStorage, &Layout),
    ) -> Result<(Storage, Storage)> {
        let device = qs.device.clone();
        let stream = device.cuda_stream();
        let kernels = kernels_for(stream.context())?;
        let (q, k, v) =
            (view::<T>(qs, lq, &stream, "q")?, view::<T>(ks, lk, &stream, "k")?, view::<T>(vs, lv, &stream, "v")?);
        // Joint caches: the storage split where the later view begins, each view in its part (a
        // view reaching into the other part is refused by memattn's bounds check).
        let (mut first, mut second);
        let (mut kc, mut vc) = match caches {
            Caches::Two((kcs, lkc), (vcs, lvc)) => {
                (view_mut::<T>(kcs, lkc, &stream, "k_cache")?, view_mut::<T>(vcs, lvc, &stream, "v_cache")?)
            }
            Caches::Joint(s, lkc, lvc) => {
                let k_first = lkc.start_offset() <= lvc.start_offset();
                let (lo, hi) = if k_first { (lkc, lvc) } else { (lvc, lkc) };
                let slice = s.as_cuda_slice_mut::<T>()?;
                let len = slice.len();
                (first, second) = slice.try_split_at_mut(hi.start_offset()).ok_or_else(|| {
                    kv_err(format!("a cache view begins at element {}, past its storage's {len}", hi.start_offset()))
                })?;
                let part = |slice, l: &Layout, start: usize, what: &str| {
                    TensorViewMut::cuda(slice, &stream, dims4(l, what)?)
                        .and_then(|v| v.with_strides(strides4(l)).offset(start))
                        .map_err(wrap)
                };
                let lo_view = part(&mut first, lo, lo.start_offset(), if k_first { "k_cache" } else { "v_cache" })?;
                let hi_view = part(&mut second, hi, 0, if k_first { "v_cache" } else { "k_cache" })?;
                if k_first {
                    (lo_view, hi_view)
                } else {
                    (hi_view, lo_view)
                }
            }
        };
        let ix = op.cuda_indices(&kernels, &stream)?;
        let guards = op.extras.guards();
        let slices = extra_slices::<T, _>(&guards)?;
        let ev = extra_views(&slices, &stream, &op.extras)?;
        let [b, sq, h, d] = q.shape();
        // Not memset: the kernels write every element of o and lse (a row that sees no key gets
        // o = 0, lse = -inf). SAFETY: both are read only after that launch, on this stream.
        let mut o = unsafe { stream.alloc::<T>(b * sq * h * d) }.map_err(candle_core::Error::wrap)?;
        let mut lse = unsafe { stream.alloc::<f32>(b * h * sq) }.map_err(candle_core::Error::wrap)?;
        {
            let mut ov = TensorViewMut::cuda(&mut o, &stream, [b, sq, h, d]).map_err(wrap)?;
            let mut lv = LseViewMut::cuda(&mut lse, &stream, b, h, sq).map_err(wrap)?;
            kernels
                .flash_attn_with_kvcache_into(
                    &q,
                    &mut kc,
                    &mut vc,
                    Some(&k),
                    Some(&v),
                    &ix.seqlens,
                    ix.table.as_ref(),
                    &mut ov,
                    &mut lv,
                    &op.opts_with(&ix, &ev),
                )
                .map_err(wrap)?;
        }
        Ok((
            Storage::Cuda(CudaStorage::wrap_cuda_slice(o, device.clone())),
            Storage::Cuda(CudaStorage::wrap_cuda_slice(lse, device)),
        ))
    }

    /// The option tensors' slices on candle's device: sinks and slopes f32, rotary tables `T`.
    #[allow(clippy::type_complexity)]
    fn extra_slices<'g, T: Element + CudaDType, G: std::ops::Deref<Target = Storage>>(
        g: &'g [Option<(G, &'g Layout)>; 4],
    ) -> Result<(Option<CudaView<'g, f32>>, Option<CudaView<'g, f32>>, Option<CudaView<'g, T>>, Option<CudaView<'g, T>>)>
    {
        fn cuda(st: &Storage) -> Result<&CudaStorage> {
            match st {
                Storage::Cuda(c) => Ok(c),
                other => Err(kv_err(format!(
                    "an option tensor is on {:?} while q is on a CUDA device",
                    other.device().location()
                ))),
            }
        }
        let f = |i: usize| -> Result<Option<CudaView<'g, f32>>> {
            g[i].as_ref().map(|(st, l)| Ok(cuda(st)?.as_cuda_slice::<f32>()?.slice(l.start_offset()..))).transpose()
        };
        let t = |i: usize| -> Result<Option<CudaView<'g, T>>> {
            g[i].as_ref().map(|(st, l)| Ok(cuda(st)?.as_cuda_slice::<T>()?.slice(l.start_offset()..))).transpose()
        };
        Ok((f(0)?, f(1)?, t(2)?, t(3)?))
    }

    /// Views of [`extra_slices`] for a launch on `stream`.
    #[allow(clippy::type_complexity)]
    fn extra_views<'a, T: Element + CudaDType>(
        s: &'a (Option<CudaView<'a, f32>>, Option<CudaView<'a, f32>>, Option<CudaView<'a, T>>, Option<CudaView<'a, T>>),
        stream: &'a Arc<memattn::attn::CudaStream>,
        x: &KvExtras,
    ) -> Result<ExtraViews<'a>> {
        let mut v = ExtraViews::default();
        if let (Some(sl), Some(t)) = (&s.0, &x.sinks) {
            v.sinks = Some(memattn::attn::SinksView::cuda(sl, stream, t.elem_count()).map_err(wrap)?);
        }
        if let (Some(sl), Some(t)) = (&s.1, &x.alibi_slopes) {
            let (batch, heads) = match t.dims() {
                &[b, h] => (Some(b), h),
                d => (None, d.iter().product()),
            };
            v.alibi = Some(memattn::attn::AlibiView::cuda(sl, stream, batch, heads).map_err(wrap)?);
        }
        if let (Some(c), Some(sn), Some((ct, _, inter))) = (&s.2, &s.3, &x.rotary) {
            let (n, half) = ct.dims2()?;
            let view = |sl| TensorView::cuda(sl, stream, [n, half, 1, 1]).map_err(wrap);
            v.rotary = Some(memattn::attn::RotaryView::new(view(c)?, view(sn)?, *inter));
        }
        Ok(v)
    }

    /// A view of candle's storage with its layout (strides and start offset).
    fn view<'a, T: Element + CudaDType>(
        s: &'a CudaStorage,
        l: &Layout,
        stream: &'a Arc<memattn::attn::CudaStream>,
        what: &str,
    ) -> Result<TensorView<'a>> {
        let v = TensorView::cuda(s.as_cuda_slice::<T>()?, stream, dims4(l, what)?);
        v.and_then(|v| v.with_strides(strides4(l)).offset(l.start_offset())).map_err(wrap)
    }

    /// [`super::flash_attn_varlen_paged_windowed`] on candle's CUDA device and stream: q, k and v
    /// viewed in candle's memory (contiguous), the index tensors uploaded from their host copies
    /// (`[cu_seqlens_q, seqused_k, block_table]`), O allocated on the stream.
    pub(super) fn varlen_paged<T: Element + CudaDType + DeviceRepr + ValidAsZeroBits>(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        idx: &[Vec<u32>; 3],
        max_seqlen_q: usize,
        opts: &AttnOpts<'_>,
    ) -> Result<Tensor> {
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let storages = [&q, &k, &v].map(|t| t.storage_and_layout());
        let cuda = |i: usize| -> Result<(&CudaStorage, &Layout)> {
            match (&*storages[i].0, storages[i].1) {
                (Storage::Cuda(s), l) => Ok((s, l)),
                (other, _) => Err(candle_core::Error::Msg(format!(
                    "memattn flash_attn_varlen_paged_windowed: k and v must be on q's CUDA device, not {:?}",
                    other.device().location()
                ))),
            }
        };
        let ((qs, lq), (ks, lk), (vs, lv)) = (cuda(0)?, cuda(1)?, cuda(2)?);
        let device = qs.device.clone();
        let stream = device.cuda_stream();
        let kernels = kernels_for(stream.context())?;
        let (tq, h, d) = q.dims3()?;
        fn view4<'a, T: Element + CudaDType>(
            s: &'a CudaStorage,
            l: &Layout,
            stream: &'a Arc<memattn::attn::CudaStream>,
            shape: [usize; 4],
        ) -> Result<TensorView<'a>> {
            let v = TensorView::cuda(s.as_cuda_slice::<T>()?, stream, shape).map_err(wrap)?;
            v.offset(l.start_offset()).map_err(wrap)
        }
        let kd = k.dims4()?;
        let qv = view4::<T>(qs, lq, &stream, [1, tq, h, d])?;
        let kv = view4::<T>(ks, lk, &stream, [kd.0, kd.1, kd.2, kd.3])?;
        let vv = view4::<T>(vs, lv, &stream, [kd.0, kd.1, kd.2, kd.3])?;
        let ix = |x: &[u32]| kernels.index_tensor(x, Some(&stream)).map_err(wrap);
        let (cu, used, table) = (ix(&idx[0])?, ix(&idx[1])?, ix(&idx[2])?);
        let (o, _lse) =
            kernels.flash_attn_varlen_paged(&qv, &kv, &vv, &cu, &used, &table, max_seqlen_q, opts).map_err(wrap)?;
        let slice = o.as_cuda().ok_or_else(|| candle_core::Error::Msg("memattn: O is not on a CUDA device".into()))?;
        // O's bytes as candle's storage of T (the same stream; no copy through the host).
        let n = tq * h * d;
        // SAFETY: O holds exactly n elements of T (q's dtype), written by the launch above; the
        // allocation is read only by the copy that follows it on this stream.
        let src = unsafe { slice.transmute::<T>(n) }
            .ok_or_else(|| candle_core::Error::Msg("memattn: O is smaller than total_q x heads x d".into()))?;
        let mut out = unsafe { stream.alloc::<T>(n) }.map_err(candle_core::Error::wrap)?;
        stream.memcpy_dtod(&src, &mut out).map_err(candle_core::Error::wrap)?;
        let st = CudaStorage::wrap_cuda_slice(out, device);
        Ok(Tensor::from_storage(Storage::Cuda(st), (tq, h, d), candle_core::op::BackpropOp::none(), false))
    }

    /// A writable view of candle's storage with its layout (strides and start offset).
    fn view_mut<'a, T: Element + CudaDType>(
        s: &'a mut CudaStorage,
        l: &Layout,
        stream: &'a Arc<memattn::attn::CudaStream>,
        what: &str,
    ) -> Result<TensorViewMut<'a>> {
        let v = TensorViewMut::cuda(s.as_cuda_slice_mut::<T>()?, stream, dims4(l, what)?);
        v.and_then(|v| v.with_strides(strides4(l)).offset(l.start_offset())).map_err(wrap)
    }
}
