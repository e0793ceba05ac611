//! candle ops running memattn's prebuilt PTX attention kernels: no nvcc, no CUDA C++ at build time.
//!
//! [`flash_attn`], [`flash_attn_windowed`] and [`flash_attn_varlen`] have the signatures of
//! `candle_flash_attn`'s functions of those names, so switching is a one-line change of the
//! `use`; [`flash_attn_with_lse`] and [`flash_attn_varlen_with_lse`] also return the log-sum-exp
//! of each query row (natural log, f32), which candle-flash-attn drops.
//! [`flash_attn_with_kvcache`] (and `_with_lse`) is decode over a contiguous or paged KV cache
//! with split-KV (candle-flash-attn has no such function; the cache is read-only here, new
//! tokens are written with candle's ops first).
//!
//! | tensor | shape | notes |
//! | --- | --- | --- |
//! | `q` | `[batch, seq_q, heads, head_dim]`; varlen `[total_q, heads, head_dim]` | f32, bf16 or f16; head_dim 32, 64, 96, 128, 192 or 256; last dim contiguous (other strides are passed to the kernel as they are) |
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
//! memcheck: for tests and CI without a GPU). With the `cuda` feature, on a candle CUDA device it
//! launches on candle's own stream in candle's context; nothing waits for it.
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

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};
use memattn::attn::{AttnOpts, Kernels, TensorView};
use memattn::Dtype;
use std::sync::{Mutex, OnceLock};

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
    let o = q.apply_op3_no_bwd(k, v, &op)?;
    let (b, sq, h, _) = q.dims4()?;
    Ok((o, op.take_lse((b, h, sq))?))
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
    q.apply_op3_no_bwd(k, v, &op)
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
    let varlen =
        Varlen { cu_q: cu(seqlens_q, "seqlens_q")?, cu_k: cu(seqlens_k, "seqlens_k")?, max_seqlen_q, max_seqlen_k };
    let op = FlashAttn::new(softmax_scale, causal, (None, None), Some(varlen));
    let o = q.apply_op3_no_bwd(k, v, &op)?;
    let (total_q, h, _) = q.dims3()?;
    Ok((o, op.take_lse((h, total_q))?))
}

/// The packed-sequence arguments of [`flash_attn_varlen`].
#[derive(Clone, Debug, PartialEq)]
pub struct Varlen {
    pub cu_q: Vec<u32>,
    pub cu_k: Vec<u32>,
    pub max_seqlen_q: usize,
    pub max_seqlen_k: usize,
}

/// The candle op behind [`flash_attn`], [`flash_attn_windowed`] and [`flash_attn_varlen`]
/// (forward only). Its LSE is kept for the caller of `apply_op3`, which the `*_with_lse`
/// functions are.
pub struct FlashAttn {
    pub softmax_scale: f32,
    pub causal: bool,
    /// `(left, right)`, `None` unbounded.
    pub window: (Option<usize>, Option<usize>),
    /// Packed sequences (q, k, v are then 3-d `[total, heads, head_dim]`).
    pub varlen: Option<Varlen>,
    lse: Mutex<Option<Storage>>,
}

impl FlashAttn {
    pub fn new(
        softmax_scale: f32,
        causal: bool,
        window: (Option<usize>, Option<usize>),
        varlen: Option<Varlen>,
    ) -> FlashAttn {
        FlashAttn { softmax_scale, causal, window, varlen, lse: Mutex::new(None) }
    }

    /// The LSE of the last forward, as a tensor of `shape`.
    fn take_lse<S: Into<Shape>>(&self, shape: S) -> Result<Tensor> {
        take_lse_from(&self.lse, shape)
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
        Ok(AttnOpts::new()
            .softmax_scale(self.softmax_scale)
            .causal(self.causal)
            .window(side(self.window.0, "left")?, side(self.window.1, "right")?))
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
    ) -> Result<Option<(memattn::attn::DeviceTensor, memattn::attn::DeviceTensor)>> {
        let opts = self.opts()?;
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

fn wrap(e: memattn::attn::AttnError) -> candle_core::Error {
    candle_core::Error::wrap(e)
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

/// The process's VM kernels (the PTX is parsed once).
fn vm_kernels() -> Result<&'static Kernels> {
    static VM: OnceLock<std::result::Result<Kernels, String>> = OnceLock::new();
    VM.get_or_init(|| Kernels::vm().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| candle_core::Error::Msg(format!("memattn: the PTX VM did not start: {e}")))
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
        let (o, lse) = self.launch(kernels, None, [&views[0], &views[1], &views[2]], None)?.expect("allocating call");
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
}

/// Decode attention over a KV cache (FlashAttention-2's `flash_attn_with_kvcache` without the
/// append): `q` `[batch, seq_q, heads, head_dim]`; `k_cache`, `v_cache` contiguous
/// `[batch, seq_cache, heads_kv, head_dim]`, or with `block_table` (`[batch, max_pages]` u32)
/// a paged cache `[num_pages, page_size, heads_kv, head_dim]`; `cache_seqlens` `[batch]` u32 keys
/// per sequence. `num_splits` 0 lets memattn choose the KV split count (flash-decoding), `n`
/// is `n` splits. candle tensors are immutable, so new tokens are written into the cache with
/// candle's own ops (`slice_set`) before the call; the cache is only read here. The index
/// tensors are read to the host for validation (on a CUDA device that copy waits for them).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_with_kvcache(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
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
        cache_seqlens,
        block_table,
        softmax_scale,
        causal,
        num_splits,
    )?
    .0)
}

/// As [`flash_attn_with_kvcache`], also returning the LSE: `[batch, heads, seq_q]` f32, natural log.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_with_kvcache_with_lse(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    cache_seqlens: &Tensor,
    block_table: Option<&Tensor>,
    softmax_scale: f32,
    causal: bool,
    num_splits: usize,
) -> Result<(Tensor, Tensor)> {
    let u32s = |t: &Tensor, what: &str, rank: usize| -> Result<Vec<u32>> {
        if t.dtype() != DType::U32 || t.rank() != rank {
            return Err(candle_core::Error::Msg(format!(
                "memattn flash_attn_with_kvcache: {what} must be a {rank}-d u32 tensor, got {:?} {:?}",
                t.dtype(),
                t.dims()
            )));
        }
        t.flatten_all()?.to_vec1::<u32>()
    };
    let num_splits = u32::try_from(num_splits)
        .map_err(|_| candle_core::Error::Msg(format!("memattn: num_splits {num_splits} is over the limit")))?;
    let op = FlashAttnKvCache {
        softmax_scale,
        causal,
        num_splits,
        cache_seqlens: u32s(cache_seqlens, "cache_seqlens", 1)?,
        block_table: block_table.map(|t| u32s(t, "block_table", 2)).transpose()?,
        lse: Mutex::new(None),
    };
    let o = q.apply_op3_no_bwd(k_cache, v_cache, &op)?;
    let (b, sq, h, _) = q.dims4()?;
    Ok((o, take_lse_from(&op.lse, (b, h, sq))?))
}

/// The candle op behind [`flash_attn_with_kvcache`] (forward only, the cache read-only).
pub struct FlashAttnKvCache {
    pub softmax_scale: f32,
    pub causal: bool,
    /// 0: memattn's choice.
    pub num_splits: u32,
    pub cache_seqlens: Vec<u32>,
    /// `[batch, max_pages]`, row-major; `None`: a contiguous cache.
    pub block_table: Option<Vec<u32>>,
    lse: Mutex<Option<Storage>>,
}

impl FlashAttnKvCache {
    fn opts(&self) -> AttnOpts<'static> {
        AttnOpts::new().softmax_scale(self.softmax_scale).causal(self.causal).num_splits(self.num_splits)
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
        let seqlens = kernels.index_tensor(&self.cache_seqlens, None).map_err(wrap)?;
        let table = self.block_table.as_ref().map(|t| kernels.index_tensor(t, None)).transpose().map_err(wrap)?;
        let (o, lse) = kernels
            .flash_attn_with_kvcache(
                &view(0)?,
                &mut view_mut(1)?,
                &mut view_mut(2)?,
                None,
                None,
                &seqlens,
                table.as_ref(),
                &self.opts(),
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

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::CudaStorage;
    use memattn::attn::{Element, LseViewMut, TensorViewMut};
    use std::collections::HashMap;
    use std::sync::Arc;

    /// memattn's kernels per CUDA context (loaded once per context).
    fn kernels_for(ctx: &Arc<candle_core::cuda_backend::cudarc::driver::CudaContext>) -> Result<Arc<Kernels>> {
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
            op.launch(&kernels, Some(&stream), [&q, &k, &v], Some((&mut ov, &mut lv)))?;
        }
        let lse = CudaStorage::wrap_cuda_slice(lse, s1.device.clone());
        keep_lse(&op.lse, Storage::Cuda(lse))?;
        Ok((CudaStorage::wrap_cuda_slice(o, s1.device.clone()), l1.shape().clone()))
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
        let seqlens = kernels.index_tensor(&op.cache_seqlens, Some(&stream)).map_err(wrap)?;
        let table =
            op.block_table.as_ref().map(|t| kernels.index_tensor(t, Some(&stream))).transpose().map_err(wrap)?;
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
                    &seqlens,
                    table.as_ref(),
                    &mut ov,
                    &mut lv,
                    &op.opts(),
                )
                .map_err(wrap)?;
        }
        let lse = CudaStorage::wrap_cuda_slice(lse, s1.device.clone());
        keep_lse(&op.lse, Storage::Cuda(lse))?;
        Ok((CudaStorage::wrap_cuda_slice(o, s1.device.clone()), l1.shape().clone()))
    }
}
