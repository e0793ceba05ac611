//! candle-flash-attn 0.11.1's public API on [memattn-candle](memattn_candle): the same functions
//! with the same signatures, and [`FlashAttn`] with the same public fields, implementing
//! candle's `CustomOp3`. Patched in under candle-flash-attn's name, it replaces FlashAttention-2's
//! CUDA C++ (compiled by nvcc at build time) with memattn's prebuilt PTX kernels:
//!
//! ```toml
//! [patch.crates-io]
//! candle-flash-attn = { git = "https://github.com/memattn/memattn" }
//! ```
//!
//! Every function builds its op and applies it with `Tensor::apply_op3`, as candle-flash-attn's
//! do; the op delegates to [`memattn_candle::FlashAttn`] (or, for a paged cache, to
//! [`memattn_candle::flash_attn_varlen_paged_windowed`]). Masks, windows (bottom-right aligned),
//! ALiBi, soft cap and grouped-query heads follow candle-flash-attn's rules; a soft cap of 0 is
//! off, as in FlashAttention-2.
//!
//! What differs (README, "What differs"):
//! - more is accepted: f32 as well as bf16 and f16, candle's CPU device (the kernels run in
//!   memattn's PTX VM: slow, exact, for tests), `[batch, heads]` ALiBi slopes, and gradients
//!   (`Tensor::backward`) through the ops without ALiBi;
//! - `mm_prefix_ranges` of [`flash_attn_varlen_paged_windowed`] (ranges that bypass the mask) is
//!   refused with an error naming it when it holds any range: memattn has no kernel for it;
//! - on candle's CUDA device the ops need this crate's `cuda` feature (candle-flash-attn always
//!   builds for CUDA); without it a call on a CUDA device returns an error saying so;
//! - the paged forward takes bf16 and f16 only, as candle-flash-attn's does, but any page size
//!   (candle-flash-attn's wants a multiple of 32) and the head dims memattn has kernels for.
//!
//! [`FlashAttnVarLen`] is public here (candle-flash-attn keeps it private), with the fields it has
//! there.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

/// The op behind [`flash_attn`], [`flash_attn_windowed`] and the `flash_attn_alibi*` functions,
/// with candle-flash-attn's public fields. `window_size_right = Some(0)` with
/// `window_size_left = None` is causal attention.
pub struct FlashAttn {
    pub softmax_scale: f32,
    pub alibi_slopes: Option<Tensor>,
    pub window_size_left: Option<usize>,
    pub window_size_right: Option<usize>,
    pub softcap: Option<f32>,
}

/// FlashAttention-2 turns the soft cap off at 0 (candle-flash-attn passes `softcap.unwrap_or(0)`).
fn softcap_of(softcap: Option<f32>) -> Option<f32> {
    softcap.filter(|c| *c != 0.0)
}

/// The error of a call on candle's CUDA device in a build without this crate's `cuda` feature.
#[cfg(not(feature = "cuda"))]
fn no_cuda_feature(op: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{op} (memattn's candle-flash-attn): this tensor is on a CUDA device and the crate was built without its \
         `cuda` feature; add `candle-flash-attn = {{ version = \"0.11.1\", features = [\"cuda\"] }}` to the \
         engine's [dependencies] next to the [patch.crates-io] line"
    ))
}

impl FlashAttn {
    /// memattn-candle's op for these fields.
    fn op(&self) -> Result<memattn_candle::FlashAttn> {
        let window = (self.window_size_left, self.window_size_right);
        let op = memattn_candle::FlashAttn::new(self.softmax_scale, false, window, None)
            .with_alibi(self.alibi_slopes.as_ref())?;
        Ok(match softcap_of(self.softcap) {
            Some(c) => op.with_softcap(c),
            None => op,
        })
    }
}

impl CustomOp3 for FlashAttn {
    fn name(&self) -> &'static str {
        "flash-attn"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.op()?.cpu_fwd(q, q_l, k, k_l, v, v_l)
    }

    #[allow(unused_variables)] // without the `cuda` feature only the error is built
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        #[cfg(feature = "cuda")]
        return self.op()?.cuda_fwd(q, q_l, k, k_l, v, v_l);
        #[cfg(not(feature = "cuda"))]
        Err(no_cuda_feature("flash-attn"))
    }

    /// dq, dk, dv through memattn's backward (candle-flash-attn has none); refused with ALiBi.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        grad_o: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.op()?.bwd(q, k, v, o, grad_o)
    }
}

/// Flash-attention v2 layer: `softmax(Q @ K^T . softmax_scale) @ V`, as
/// `candle_flash_attn::flash_attn`. `q` `(batch, seq_len_q, num_heads_q, head_size)`, `k`, `v`
/// `(batch, seq_len_kv, num_heads_kv, head_size)` (`num_heads_kv` divides `num_heads_q`); the
/// result has q's shape. `causal` is bottom-right aligned.
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, softmax_scale: f32, causal: bool) -> Result<Tensor> {
    flash_attn_alibi_windowed_softcap(q, k, v, None, softmax_scale, None, if causal { Some(0) } else { None }, 0.0)
}

/// [`flash_attn`] with a sliding window, as `candle_flash_attn::flash_attn_windowed`:
/// `window_size_left = None` with `window_size_right = Some(0)` is the causal mask.
pub fn flash_attn_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    flash_attn_alibi_windowed_softcap(q, k, v, None, softmax_scale, window_size_left, window_size_right, 0.0)
}

/// [`flash_attn`] with ALiBi slopes (f32 `(num_heads_q)`), as `candle_flash_attn::flash_attn_alibi`.
pub fn flash_attn_alibi(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    flash_attn_alibi_windowed_softcap(
        q,
        k,
        v,
        Some(alibi_slopes),
        softmax_scale,
        None,
        if causal { Some(0) } else { None },
        0.0,
    )
}

/// [`flash_attn_alibi`] with a window, as `candle_flash_attn::flash_attn_alibi_windowed`.
pub fn flash_attn_alibi_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    alibi_slopes: &Tensor,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
) -> Result<Tensor> {
    flash_attn_alibi_windowed_softcap(
        q,
        k,
        v,
        Some(alibi_slopes),
        softmax_scale,
        window_size_left,
        window_size_right,
        0.0,
    )
}

/// Optional ALiBi, a window and a Gemma-style soft cap, as
/// `candle_flash_attn::flash_attn_alibi_windowed_softcap`; the narrower functions above are this
/// one with no ALiBi, no window (or the causal one) and a soft cap of 0 (off).
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
    let op = FlashAttn {
        softmax_scale,
        alibi_slopes: alibi_slopes.cloned(),
        window_size_left,
        window_size_right,
        softcap: Some(softcap),
    };
    q.apply_op3(k, v, op)
}

/// The op behind the `flash_attn_varlen*` functions, with candle-flash-attn's fields: packed
/// sequences (`seqlens_q`, `seqlens_k` u32 `(batch + 1)` prefix sums), and with `block_table` a
/// paged K/V cache (`k`, `v` `(num_blocks, page_block_size, num_heads_kv, head_size)`).
pub struct FlashAttnVarLen {
    pub softmax_scale: f32,
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
    pub seqlens_q: Tensor,
    pub seqlens_k: Tensor,
    pub block_table: Option<Tensor>,
    /// Ranges that bypass the causal/window mask: not supported by memattn; a tensor holding
    /// any range makes the op return an error that names it.
    pub mm_prefix_ranges: Option<Tensor>,
    pub page_block_size: Option<usize>,
    pub alibi_slopes: Option<Tensor>,
    pub window_size_left: Option<usize>,
    pub window_size_right: Option<usize>,
    pub softcap: Option<f32>,
}

fn varlen_err(m: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("flash-attn-varlen (memattn's candle-flash-attn): {m}"))
}

impl FlashAttnVarLen {
    /// Refuses what memattn has no kernel for, before anything runs.
    fn check_supported(&self) -> Result<()> {
        if let Some(r) = &self.mm_prefix_ranges {
            if r.elem_count() > 0 {
                return Err(varlen_err(format!(
                    "mm_prefix_ranges {:?} is not supported: memattn's kernels have no ranges that bypass the \
                     causal/window mask (pass None)",
                    r.dims()
                )));
            }
        }
        if self.block_table.is_some() && self.alibi_slopes.is_some() {
            return Err(varlen_err(
                "ALiBi with a paged cache (block_table) is not supported by memattn's paged forward",
            ));
        }
        Ok(())
    }

    /// memattn-candle's op for packed sequences without a block table.
    fn op(&self) -> Result<memattn_candle::FlashAttn> {
        let cu = |t: &Tensor, what: &str| -> Result<Vec<u32>> {
            if t.dtype() != candle_core::DType::U32 || t.rank() != 1 {
                return Err(varlen_err(format!(
                    "{what} must be a 1-d u32 tensor of batch + 1 prefix sums, got {:?} {:?}",
                    t.dtype(),
                    t.dims()
                )));
            }
            t.to_vec1::<u32>()
        };
        let varlen = memattn_candle::Varlen {
            cu_q: cu(&self.seqlens_q, "seqlens_q")?,
            cu_k: cu(&self.seqlens_k, "seqlens_k")?,
            max_seqlen_q: self.max_seqlen_q,
            max_seqlen_k: self.max_seqlen_k,
        };
        let window = (self.window_size_left, self.window_size_right);
        let op = memattn_candle::FlashAttn::new(self.softmax_scale, false, window, Some(varlen))
            .with_alibi(self.alibi_slopes.as_ref())?;
        Ok(match softcap_of(self.softcap) {
            Some(c) => op.with_softcap(c),
            None => op,
        })
    }

    /// The paged forward on tensors made from the op's storages.
    fn paged(&self, q: Tensor, k: Tensor, v: Tensor) -> Result<Tensor> {
        let block_table = self.block_table.as_ref().expect("paged op");
        let page = match self.page_block_size {
            Some(p) => p,
            None => return Err(varlen_err("a paged cache (block_table) needs page_block_size")),
        };
        memattn_candle::flash_attn_varlen_paged_windowed(
            &q,
            &k,
            &v,
            &self.seqlens_q,
            &self.seqlens_k,
            block_table,
            self.max_seqlen_q,
            self.max_seqlen_k,
            self.softmax_scale,
            self.window_size_left,
            self.window_size_right,
            page,
            softcap_of(self.softcap),
        )
    }
}

/// The storage offsets of a layout's elements, in row-major order.
fn element_offsets(l: &Layout) -> Vec<usize> {
    let mut offsets = vec![l.start_offset()];
    for (&n, &stride) in l.dims().iter().zip(l.stride()) {
        offsets = offsets.iter().flat_map(|&o| (0..n).map(move |i| o + i * stride)).collect();
    }
    offsets
}

/// A tensor over a storage the op was handed: its layout's elements, in order.
fn tensor_of(storage: Storage, l: &Layout) -> Result<Tensor> {
    // `from_storage` gives a contiguous tensor from element 0: long enough to reach the layout's last.
    let (flat_len, gather) = match l.contiguous_offsets() {
        Some((_, end)) => (end, None),
        None => {
            let offsets = element_offsets(l);
            (offsets.iter().max().map_or(0, |o| o + 1), Some(offsets))
        }
    };
    let flat = Tensor::from_storage(storage, flat_len, candle_core::op::BackpropOp::none(), false);
    match gather {
        None => flat.narrow(0, l.start_offset(), l.shape().elem_count())?.reshape(l.shape()),
        Some(offsets) => {
            let idx: Vec<u32> = offsets.into_iter().map(|o| o as u32).collect();
            let idx = Tensor::new(idx.as_slice(), flat.device())?;
            flat.index_select(&idx, 0)?.reshape(l.shape())
        }
    }
}

impl CustomOp3 for FlashAttnVarLen {
    fn name(&self) -> &'static str {
        "flash-attn-varlen"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.check_supported()?;
        if self.block_table.is_none() {
            return self.op()?.cpu_fwd(q, q_l, k, k_l, v, v_l);
        }
        let t = |s: &CpuStorage, l: &Layout| tensor_of(Storage::Cpu(s.clone()), l);
        let o = self.paged(t(q, q_l)?, t(k, k_l)?, t(v, v_l)?)?.contiguous()?;
        let (storage, layout) = o.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(s), Some((0, _))) => Ok((s.clone(), o.shape().clone())),
            _ => Err(varlen_err("the paged forward returned a tensor off the CPU device")),
        }
    }

    #[allow(unused_variables)] // without the `cuda` feature only the error is built
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        #[cfg(feature = "cuda")]
        {
            use candle_core::backend::BackendStorage;
            self.check_supported()?;
            if self.block_table.is_none() {
                return self.op()?.cuda_fwd(q, q_l, k, k_l, v, v_l);
            }
            let t = |s: &candle_core::CudaStorage, l: &Layout| -> Result<Tensor> {
                tensor_of(Storage::Cuda(s.try_clone(l)?), l)
            };
            let o = self.paged(t(q, q_l)?, t(k, k_l)?, t(v, v_l)?)?.contiguous()?;
            let (storage, layout) = o.storage_and_layout();
            match &*storage {
                Storage::Cuda(s) => Ok((s.try_clone(layout)?, o.shape().clone())),
                _ => Err(varlen_err("the paged forward returned a tensor off the CUDA device")),
            }
        }
        #[cfg(not(feature = "cuda"))]
        Err(no_cuda_feature("flash-attn-varlen"))
    }

    /// dq, dk, dv through memattn's varlen backward (candle-flash-attn has none); refused with
    /// ALiBi or a paged cache.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        grad_o: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if self.block_table.is_some() {
            return Err(candle_core::Error::BackwardNotSupported { op: "flash-attn-varlen with a paged cache" });
        }
        self.op()?.bwd(q, k, v, o, grad_o)
    }
}

/// Flash-attention v2 over packed sequences, as `candle_flash_attn::flash_attn_varlen`: `q`
/// `(total_q, num_heads_q, head_size)`, `k`, `v` `(total_kv, num_heads_kv, head_size)`,
/// `seqlens_q`, `seqlens_k` u32 `(batch + 1)` prefix sums (`0, len_1, len_1 + len_2, ...`).
/// The result has q's shape.
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
    flash_attn_varlen_alibi_windowed_softcap(
        q,
        k,
        v,
        None,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        None,
        if causal { Some(0) } else { None },
        0.0,
    )
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
    flash_attn_varlen_alibi_windowed_softcap(
        q,
        k,
        v,
        None,
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_size_left,
        window_size_right,
        0.0,
    )
}

/// Packed query chunks against a paged K/V cache, as
/// `candle_flash_attn::flash_attn_varlen_paged_windowed`: `k`, `v` `(num_blocks,
/// page_block_size, num_heads_kv, head_size)`, `block_table` u32 `(batch, max_blocks)`,
/// `seqlens_k` the prefix sums of each sequence's keys in the cache. bf16 and f16.
/// `mm_prefix_ranges` holding any range is refused with an error (memattn has no kernel for
/// ranges that bypass the mask); `None` or an empty tensor runs.
#[allow(clippy::too_many_arguments)] // candle-flash-attn's signature
pub fn flash_attn_varlen_paged_windowed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    block_table: &Tensor,
    mm_prefix_ranges: Option<&Tensor>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    softmax_scale: f32,
    window_size_left: Option<usize>,
    window_size_right: Option<usize>,
    page_block_size: usize,
    softcap: Option<f32>,
) -> Result<Tensor> {
    let op = FlashAttnVarLen {
        softmax_scale,
        max_seqlen_q,
        max_seqlen_k,
        seqlens_q: seqlens_q.clone(),
        seqlens_k: seqlens_k.clone(),
        block_table: Some(block_table.clone()),
        mm_prefix_ranges: mm_prefix_ranges.cloned(),
        page_block_size: Some(page_block_size),
        alibi_slopes: None,
        window_size_left,
        window_size_right,
        softcap,
    };
    // Refused before the op is applied, so nothing is copied for a call that cannot run.
    op.check_supported()?;
    q.apply_op3(k, v, op)
}

/// [`flash_attn_varlen`] with ALiBi slopes, as `candle_flash_attn::flash_attn_varlen_alibi`.
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
    flash_attn_varlen_alibi_windowed_softcap(
        q,
        k,
        v,
        Some(alibi_slopes),
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        None,
        if causal { Some(0) } else { None },
        0.0,
    )
}

/// [`flash_attn_varlen_alibi`] with a window, as
/// `candle_flash_attn::flash_attn_varlen_alibi_windowed`.
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
    flash_attn_varlen_alibi_windowed_softcap(
        q,
        k,
        v,
        Some(alibi_slopes),
        seqlens_q,
        seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        window_size_left,
        window_size_right,
        0.0,
    )
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
    let op = FlashAttnVarLen {
        softmax_scale,
        max_seqlen_q,
        max_seqlen_k,
        seqlens_q: seqlens_q.clone(),
        seqlens_k: seqlens_k.clone(),
        block_table: None,
        mm_prefix_ranges: None,
        page_block_size: None,
        alibi_slopes: alibi_slopes.cloned(),
        window_size_left,
        window_size_right,
        softcap: Some(softcap),
    };
    q.apply_op3(k, v, op)
}
