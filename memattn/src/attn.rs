//! The attention API for programs that own their device memory: views of the caller's buffers,
//! options, a [`Kernels`] handle per device context, and [`Kernels::flash_attn`] /
//! [`Kernels::flash_attn_into`] launching memattn's prebuilt PTX.
//!
//! # Semantics
//!
//! | what | meaning |
//! | --- | --- |
//! | tensors | `q`, `o`: `[batch, seq_q, heads, head_dim]`; `k`, `v`: `[batch, seq_kv, heads, head_dim]`, given as a shape in that logical order plus element strides, so BSHD (`[b, s, h, d]` in memory) and BHSD (`[b, h, s, d]` in memory) and any other strides with a contiguous last dimension are the same call ([`TensorView::with_strides`]) |
//! | dtypes | `f32` (SIMT kernels), `bf16` and `f16` (tensor cores, f32 accumulation); q, k, v and o share one dtype; `lse` is always `f32` |
//! | head dims | 32, 64, 96, 128, 192 and 256 (the flash kernels of the variant table, every dtype); any other multiple of 8 up to 256 runs on the next of them with its head dim padded: the kernel reads and writes only the tensors' own `head_dim` columns (the columns up to its own are zero in its tiles), so nothing is copied and the result is exact (forward, KV cache over a 16-bit or f32 cache, backward where the dtype has a backward kernel at least that wide: f32 up to 256, bf16/f16 up to 128) |
//! | softmax scale | [`AttnOpts::softmax_scale`]; default `1 / sqrt(head_dim)` |
//! | causal mask | bottom-right aligned, as in FlashAttention 2.1 and later: query `i` sees key `j` iff `j <= i + seq_kv - seq_q`; a row that sees no key gets `o = 0`, `lse = -inf` |
//! | `lse` | `[batch, heads, seq_q]` f32, contiguous: `ln Σ_j exp(scale · q·k_j)` over the keys the row sees — **natural log**, as FlashAttention returns it. FlashInfer's kernels return base-2 LSE (`log2`): divide by `ln 2` to compare |
//! | grouped-query attention | `k`, `v` may have fewer heads than `q` (`heads_kv` dividing `heads`; MQA is 1): query head `i` reads k/v head `i / (heads / heads_kv)` |
//! | window | [`AttnOpts::window`] `(left, right)` or FlashAttention's [`AttnOpts::window_size`] (`-1` unbounded): query `i` sees key `j` iff `i + seq_kv - seq_q - left <= j <= i + seq_kv - seq_q + right`, bottom-right aligned; with `causal` the right side is 0 |
//! | soft cap | [`AttnOpts::softcap`] `c`: scores are `c · tanh(scale · q·k / c)` (Gemma 2) |
//! | sinks | [`AttnOpts::sinks`]: one f32 logit per q head joins the softmax denominator only; LSE includes it; a row that sees no key then has `o = 0`, `lse = sink` |
//! | varlen | [`Kernels::flash_attn_varlen`]: packed `[total, heads, d]` sequences with `cu_seqlens` prefix sums ([`IndexTensor`]); masks per sequence; `lse` `[heads, total_q]` |
//! | KV cache | [`Kernels::flash_attn_with_kvcache`]: decode over a contiguous or paged cache, optional append of new tokens, split-KV (flash-decoding) combined by [`Kernels::merge_states_into`]; `q`, caches and new tokens contiguous |
//! | not in the kernels | split-KV in the prefill calls (`num_splits` over 1 there), head dims that are not a multiple of 8 or are over 256, and padded head dims over an FP8 cache: refused with [`AttnError::NotSupportedYet`] or the limit named, never a silently different result |
//!
//! # Streams and synchronisation
//!
//! On a GPU, a view made from a cudarc slice ([`TensorView::cuda`]) carries the caller's
//! [`CudaStream`]; the kernel is launched on that stream, in that stream's context, and the call
//! returns without waiting for it. cudarc's own multi-stream tracking is honoured (the view waits
//! for the slice's last write on the device and records its read/write when dropped). Nothing
//! synchronises the host except reading results back, which the caller asks for.
//!
//! In the VM ([`Kernels::vm`]) buffers are [`VmBuffer`]s and a launch runs to completion, with
//! the VM's memcheck on every access: the same PTX, usable in a CI without a GPU.
//!
//! # Example (runs in the VM)
//!
//! ```
//! use memattn::attn::{AttnOpts, Kernels, TensorView};
//! use memattn::Dtype;
//!
//! let kernels = Kernels::vm()?;
//! let (b, s, h, d) = (1, 24, 2, 64);
//! let x: Vec<f32> = (0..b * s * h * d).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
//! let q = kernels.vm_upload(&x)?;
//! let k = kernels.vm_upload(&x)?;
//! let v = kernels.vm_upload(&x)?;
//! let shape = [b, s, h, d];
//! let (o, lse) = kernels.flash_attn(
//!     &TensorView::vm(&q, Dtype::F32, shape)?,
//!     &TensorView::vm(&k, Dtype::F32, shape)?,
//!     &TensorView::vm(&v, Dtype::F32, shape)?,
//!     &AttnOpts::new().causal(true),
//! )?;
//! let o = o.to_vec_f32()?; // [b, s, h, d]
//! let lse = lse.to_vec_f32()?; // [b, h, s]
//! // The first query row sees only key 0 (causal, seq_q == seq_kv): o equals v's first row.
//! assert!((o[0] - x[0]).abs() < 1e-6);
//! assert!((lse[0] - (0.125 * x[..d].iter().map(|a| a * a).sum::<f32>())).abs() < 1e-5);
//! # Ok::<(), memattn::attn::AttnError>(())
//! ```

pub(crate) mod alias;
pub(crate) mod backward;
mod kvcache;
pub(crate) mod naive_backward;
mod paged;
pub use alias::AliasRule;
pub use backward::{
    flash_attn_backward_workspace, flash_attn_backward_workspace_on, BwdOpts, BwdWorkspace, Gradients, LseView,
    SinksViewMut,
};
/// cudarc's stream, re-exported: views are made for one (the same cudarc crate as the caller's).
pub use cudarc::driver::CudaStream;
pub use kvcache::{Fp8CacheViewMut, Fp8Scales, KvCachePlan, PartialsView};
pub use naive_backward::{naive_attn_backward_workspace, NaiveBwdWorkspace};

use crate::caps::DeviceCaps;
use crate::device::cuda::CudaModule;
#[cfg(feature = "vm")]
use crate::device::vm::VmDevice;
use crate::device::{Backend, DevPtr, Device, DeviceError, LaunchInfo};
#[cfg(feature = "vm")]
use crate::device::{BackendChoice, DeviceOptions};
use crate::dtype::Dtype;
use crate::problem::{AttnBuffers, KernelKind, Layout, Problem, ProblemError, Varlen};
use crate::ptx::PtxSource;
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use kernels_gpu::abi::{AttnParams, Strides};
use kernels_gpu::KernelId;
use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::Mutex;

/// Why an attention call was refused or failed. Every message names the limit it hit.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AttnError {
    /// A shape that does not fit the others or the kernels.
    #[error("{tensor} has shape {got:?}: {why}")]
    Shape {
        /// The tensor's name.
        tensor: &'static str,
        /// Its shape as given.
        got: [usize; 4],
        /// The rule it breaks.
        why: ShapeRule,
    },
    /// q, k, v and o must share one dtype.
    #[error("{tensor} is {got}, but q is {expected} (q, k, v and o share one dtype)")]
    Dtype {
        /// The tensor's name.
        tensor: &'static str,
        /// Its dtype.
        got: Dtype,
        /// q's dtype.
        expected: Dtype,
    },
    /// A view whose element type does not match the dtype asked for.
    #[error("{what}: the buffer holds {got}-byte elements, dtype {dtype} has {need}")]
    ElementSize {
        /// The view's name.
        what: &'static str,
        /// Bytes per element of the buffer.
        got: usize,
        /// The dtype asked for.
        dtype: Dtype,
        /// Bytes per element of that dtype.
        need: u64,
    },
    /// The kernels read `head_dim` contiguously.
    #[error("{tensor}: the last dimension (head_dim) must be contiguous, stride 1 (got stride {stride})")]
    InnerStride {
        /// The tensor's name.
        tensor: &'static str,
        /// Its head_dim stride in elements (not 1).
        stride: usize,
    },
    /// The tensor-core kernels load 16-byte chunks.
    #[error("{tensor}: {what} is {got}, but `{entry}` needs {need}")]
    Misaligned {
        /// The tensor's name.
        tensor: &'static str,
        /// What is misaligned: the base pointer or a stride.
        what: &'static str,
        /// Its value, formatted (an address, or a stride in elements).
        got: String,
        /// The kernel entry point that needs the alignment.
        entry: &'static str,
        /// The alignment it needs, as a phrase.
        need: &'static str,
    },
    /// A view reaching past the end of its buffer.
    #[error("{tensor}: the view spans {need} bytes from its start, but its buffer has {have} bytes there")]
    OutOfBounds {
        /// The tensor's name.
        tensor: &'static str,
        /// Bytes the view spans from its start.
        need: u128,
        /// Bytes its buffer has from that start.
        have: u64,
    },
    /// Tensors from another device or context than the kernels.
    #[error("{tensor} is on {got}, but these kernels were loaded on {expected}")]
    WrongDevice {
        /// The tensor's name.
        tensor: &'static str,
        /// Where the tensor is (a device, the VM, or "no stream").
        got: String,
        /// Where the kernels are.
        expected: String,
    },
    /// A stream from another context than the kernels.
    #[error(
        "{tensor}: its stream belongs to CUDA context {got:#x}, but these kernels were loaded in context {expected:#x}"
    )]
    StreamContext {
        /// The tensor's name.
        tensor: &'static str,
        /// The stream's CUDA context (its `CUcontext` handle).
        got: usize,
        /// The kernels' CUDA context (its `CUcontext` handle).
        expected: usize,
    },
    /// Views for one launch must be made for the same stream.
    #[error("{tensor} was viewed for stream {got:#x}, but q for stream {expected:#x} (one launch runs on one stream)")]
    StreamMismatch {
        /// The tensor's name.
        tensor: &'static str,
        /// The stream it was viewed for (its `CUstream` handle).
        got: usize,
        /// The stream q was viewed for (its `CUstream` handle).
        expected: usize,
    },
    /// A window side the kernels cannot represent.
    #[error("window {side} side {got} is over the kernels' limit of {} keys (i32::MAX; None is unbounded)", i32::MAX)]
    Window {
        /// Which side: `left` or `right`.
        side: &'static str,
        /// The side's size in keys.
        got: u32,
    },
    /// Per-head sinks that do not fit q.
    #[error("sinks: {why}")]
    Sinks {
        /// The rule the sinks break.
        why: SinksRule,
    },
    /// ALiBi slopes that do not fit q, or a call that has no ALiBi.
    #[error("alibi_slopes: {why}")]
    Alibi {
        /// The rule the slopes break.
        why: AlibiRule,
    },
    /// cu_seqlens (or cache_seqlens) that are not what the tensors need.
    #[error("{tensor}: {why}")]
    SeqLens {
        /// The sequence-length tensor's name.
        tensor: &'static str,
        /// The rule it breaks.
        why: SeqLensRule,
    },
    /// A KV-cache rule (capacity, block table, decode kernel limits), named in the message.
    #[error("KV cache: {why}")]
    KvCache {
        /// The rule the call breaks.
        why: KvCacheRule,
    },
    /// A KV-cache call with device-checked indices broke a rule: found on the device by that
    /// call's `decode_check` kernel and read by [`Kernels::check_kv_status`]. That call and every
    /// later one until the check wrote NaN into O and LSE and did not write the caches.
    #[error(
        "KV cache, checked on the device: {why}; that call and every KV-cache call after it until this check were refused (O and LSE NaN, caches not written)"
    )]
    KvCacheOnDevice {
        /// The rule the device-side check found broken.
        why: KvCacheRule,
    },
    /// An index tensor without host values ([`IndexTensor::device_only`],
    /// [`Kernels::index_tensor_from_cuda`]) given to a call that validates on the host.
    #[error(
        "{tensor} has no host copy of its values, and this call checks them on the host: make it with Kernels::index_tensor (only flash_attn_with_kvcache and plan_kvcache check indices on the device)"
    )]
    NoHostValues {
        /// The index tensor's name.
        tensor: &'static str,
    },
    /// A split count over the plan's limit.
    #[error("num_splits {got} is over the limit of {max} (0 or None lets the library choose)")]
    Splits {
        /// The split count asked for.
        got: u32,
        /// The most splits the plan allows.
        max: u32,
    },
    /// A launch grid over the device's limit.
    #[error("`{entry}` needs grid {grid:?}, over the device's limit {limit:?} in {axis}")]
    Grid {
        /// The kernel entry point.
        entry: &'static str,
        /// The grid it needs, `[x, y, z]` in blocks.
        grid: [u32; 3],
        /// The device's grid limit, `[x, y, z]` in blocks.
        limit: [u32; 3],
        /// The axis over the limit: `x`, `y` or `z`.
        axis: char,
    },
    /// The decode kernels address q, o, the caches and new tokens as contiguous tensors.
    #[error("{tensor} has strides {strides:?}; the decode kernels need it contiguous, strides {want:?}")]
    NotContiguous {
        /// The tensor's name.
        tensor: &'static str,
        /// Its strides in elements.
        strides: [usize; 4],
        /// The contiguous strides of its shape.
        want: [usize; 4],
    },
    /// A tensor the call writes that shares memory with another of its tensors, or whose
    /// strides map two elements to one address (see [`AliasRule`]).
    #[error("aliasing: {why}")]
    Aliasing {
        /// The aliasing found.
        why: AliasRule,
    },
    /// An option the kernels do not implement yet.
    #[error("{feature} is not supported by memattn's kernels yet")]
    NotSupportedYet {
        /// The option, and the call that has it where one does.
        feature: &'static str,
    },
    /// Head dim, dtype, scale or launch limits (see [`ProblemError`]).
    #[error(transparent)]
    Problem(#[from] ProblemError),
    /// The device or the VM failed (allocation, copy, launch, memcheck finding).
    #[error(transparent)]
    Device(#[from] DeviceError),
}

pub use crate::decode::KvCacheRule;
pub use crate::problem::SeqLensRule;

/// Why a tensor's shape was refused ([`AttnError::Shape`]): the rule and the values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShapeRule {
    /// The batch differs from q's.
    #[error("batch {got} != q's batch {q}")]
    Batch {
        /// The tensor's batch.
        got: usize,
        /// q's batch.
        q: usize,
    },
    /// The head dim differs from q's.
    #[error("head_dim {got} != q's head_dim {q}")]
    HeadDim {
        /// The tensor's head dim.
        got: usize,
        /// q's head dim.
        q: usize,
    },
    /// k's heads do not divide q's heads.
    #[error(
        "{got} heads do not divide q's {q} heads (grouped-query attention: query head i reads k/v head i / (q heads / k/v heads))"
    )]
    HeadsDivide {
        /// k's heads.
        got: usize,
        /// q's heads.
        q: usize,
    },
    /// v's heads differ from k's.
    #[error("{got} heads != k's {k} heads (k and v have one head count)")]
    KvHeads {
        /// v's heads.
        got: usize,
        /// k's heads.
        k: usize,
    },
    /// `what` is `seq_kv`, or `total_kv` for packed sequences.
    #[error("{what} {got} != k's {what} {k}")]
    SeqKv {
        /// `seq_kv` or `total_kv`.
        what: &'static str,
        /// v's length.
        got: usize,
        /// k's length.
        k: usize,
    },
    /// `of` is `q's` (attention) or `the partial states'` (merge).
    #[error("o must have {of} shape {want:?}")]
    Output {
        /// Whose shape o must have, as a phrase.
        of: &'static str,
        /// The shape o must have.
        want: [usize; 4],
    },
    /// lse is not a contiguous f32 tensor of the shape the call writes.
    #[error("{}", if *packed {
        format!("lse must be contiguous [heads, total_q] = [{}, {}] f32 (packed sequences)", want[1], want[2])
    } else {
        format!("lse must be contiguous [batch, heads, seq_q] = {want:?} f32")
    })]
    Lse {
        /// The shape lse must have: `[batch, heads, seq_q]`, or `[1, heads, total_q]` when packed.
        want: [usize; 3],
        /// Whether the sequences are packed (varlen).
        packed: bool,
    },
    /// A size over `u32::MAX`.
    #[error("{what} {got} is over the kernels' limit {}", u32::MAX)]
    OverLimit {
        /// The size's name.
        what: &'static str,
        /// Its value.
        got: usize,
    },
    /// Packed sequences given with a batch other than 1.
    #[error("packed sequences are viewed as [1, total, heads, head_dim] (batch 1)")]
    PackedBatch,
    /// The naive kernels' scores buffer is not a contiguous f32 tensor of the right shape.
    #[error("the naive kernels' scores must be contiguous [batch, heads, seq_q, seq_kv] = {want:?} f32")]
    Scores {
        /// The shape it must have, `[batch, heads, seq_q, seq_kv]`.
        want: [usize; 4],
    },
    /// Partial states to merge with a size of 0.
    #[error("{splits} splits of [batch, seq_q, heads, head_dim]: every size must be >= 1")]
    EmptyPartials {
        /// Splits of the partial states.
        splits: usize,
    },
    /// A tensor's shape differs from the one the plan was made for.
    #[error("the plan was made for {planned:?}")]
    NotPlanned {
        /// The shape the plan was made for.
        planned: [usize; 4],
    },
    /// v_cache's shape differs from k_cache's.
    #[error("v_cache must have k_cache's shape {k_cache:?}")]
    VCache {
        /// k_cache's shape.
        k_cache: [usize; 4],
    },
    /// The cache's head dim differs from q's.
    #[error("head_dim {got} != q's {q}")]
    CacheHeadDim {
        /// The cache's head dim.
        got: usize,
        /// q's head dim.
        q: usize,
    },
    /// The cache's KV heads do not divide q's heads.
    #[error("{got} KV heads do not divide q's {q} heads (GQA: query head i reads KV head i / (heads / heads_kv))")]
    CacheHeads {
        /// The cache's KV heads.
        got: usize,
        /// q's heads.
        q: usize,
    },
    /// New keys or values of the wrong shape.
    #[error("new tokens must be [batch, seq_new, heads_kv, head_dim] = {want:?}")]
    NewTokens {
        /// The shape they must have, `[batch, seq_new, heads_kv, head_dim]`.
        want: [usize; 4],
    },
    /// A contiguous cache whose batch differs from q's.
    #[error("a contiguous cache is [batch, seq_cache, heads_kv, head_dim]: batch {got} != q's {q}")]
    CacheBatch {
        /// The cache's batch (its first dimension).
        got: usize,
        /// q's batch.
        q: usize,
    },
}

/// Why per-head sinks were refused ([`AttnError::Sinks`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SinksRule {
    /// Not one sink per query head.
    #[error("{got} sink logits for q's {heads} heads (one per head)")]
    Count {
        /// Sinks given.
        got: usize,
        /// q's heads.
        heads: usize,
    },
    /// The sinks' base pointer is not 4-byte aligned.
    #[error("the base pointer {ptr:#x} is not 4-byte aligned")]
    Misaligned {
        /// The base pointer.
        ptr: u64,
    },
}

/// Why ALiBi slopes were refused ([`AttnError::Alibi`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AlibiRule {
    /// Not one slope per query head.
    #[error("{got} slopes per sequence for q's {heads} heads (one per query head)")]
    Heads {
        /// Slopes per sequence given.
        got: usize,
        /// q's heads.
        heads: usize,
    },
    /// Per-sequence slopes for a number of sequences other than the batch.
    #[error("slopes for {got} sequences where the call has {batch} (give [heads] or [batch, heads])")]
    Batch {
        /// Sequences the slopes are given for.
        got: usize,
        /// Sequences in the call.
        batch: usize,
    },
    /// The slopes' base pointer is not 4-byte aligned.
    #[error("the base pointer {ptr:#x} is not 4-byte aligned")]
    Misaligned {
        /// The base pointer.
        ptr: u64,
    },
    /// ALiBi given to a call that does not take it.
    #[error("{call} has no ALiBi (the forward and decode calls do)")]
    Unsupported {
        /// The call's name.
        call: &'static str,
    },
}

/// Options of an attention call. Built with setters, so options added later are additions:
/// `AttnOpts::new().causal(true).softmax_scale(0.1)`. The lifetime is that of the sinks view
/// ([`AttnOpts::sinks`]); options without sinks are `AttnOpts<'static>`.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct AttnOpts<'s> {
    /// Multiplies `q·k` before the softmax; `None` is `1 / sqrt(head_dim)`.
    pub softmax_scale: Option<f32>,
    /// Bottom-right aligned causal mask (see the module docs). With a window, causal sets the
    /// window's right side to 0.
    pub causal: bool,
    /// Sliding window `(left, right)` in keys around the bottom-right aligned diagonal,
    /// FlashAttention's `window_size`; `None` on a side is unbounded. Query `i` sees key `j` iff
    /// `i + seq_kv - seq_q - left <= j <= i + seq_kv - seq_q + right`. A model config's
    /// `sliding_window = W` is `window(Some(W - 1), Some(0))` with `causal(true)`.
    pub window: (Option<u32>, Option<u32>),
    /// `softcap · tanh(scale · q·k / softcap)` on the scores (Gemma 2); `None` or `0` is off.
    pub softcap: Option<f32>,
    /// Per-head sink logits (`[heads]` f32 on the kernels' device): each joins its head's
    /// softmax denominator only, and LSE includes it (gpt-oss). `None`: no sinks.
    pub sinks: Option<&'s SinksView<'s>>,
    /// ALiBi slopes (FlashAttention-2's `alibi_slopes`, [`AlibiView`]): the score of query `i`
    /// and key `j` gains `-slope · |i + seq_kv - seq_q - j|` after the soft cap, before the mask
    /// (LSE includes it). The forward and decode calls take it; the backward refuses it.
    pub alibi_slopes: Option<&'s AlibiView<'s>>,
    /// KV splits (flash-decoding) of [`Kernels::flash_attn_with_kvcache`]: `None` or `Some(0)`
    /// lets the library choose (FlashAttention-2's heuristic), `Some(n)` is `n` splits
    /// (1..=128). The prefill calls run one split: there, only `None`, 0 and 1 are accepted.
    pub num_splits: Option<u32>,
    /// The decode kernel family of [`Kernels::flash_attn_with_kvcache`]: `Auto` (tensor cores
    /// for bf16/f16, SIMT for f32), `Simt` or `Mma`. The prefill calls refuse anything but `Auto`.
    pub decode_kernel: crate::decode::DecodeKernel,
    /// [`Kernels::flash_attn_with_kvcache`] over a contiguous cache: FlashAttention-2's
    /// `cache_batch_idx`, the cache slot (first dimension index) of each sequence (`[batch]`;
    /// the cache may have more slots than sequences; with new tokens no two sequences may
    /// share one). `None`: sequence `b` is slot `b`. The prefill calls refuse it.
    pub cache_batch_idx: Option<&'s IndexTensor>,
    /// [`Kernels::flash_attn_with_kvcache`] over a contiguous cache: FlashAttention-2's
    /// `cache_leftpad`, the row where each sequence's keys begin (`[batch]`, each at most its
    /// `cache_seqlens`): sequence `b` attends over rows `cache_leftpad[b] .. cache_seqlens[b] +
    /// seq_new` of its slot, bottom-right aligned to those keys. `None`: row 0. The prefill calls
    /// refuse it.
    pub cache_leftpad: Option<&'s IndexTensor>,
    /// [`Kernels::flash_attn_with_kvcache`] with new tokens: FlashAttention-2's rotary
    /// embedding of `q` and the appended keys (`rotary_cos`, `rotary_sin`,
    /// `rotary_interleaved`), see [`RotaryView`]. The prefill calls refuse it.
    pub rotary: Option<&'s RotaryView<'s>>,
}

impl PartialEq for AttnOpts<'_> {
    /// Equal options; sinks are equal when they view the same device address.
    fn eq(&self, other: &Self) -> bool {
        let sinks = |o: &Self| o.sinks.map(|s| (s.0.raw.ptr, s.0.raw.place));
        self.softmax_scale == other.softmax_scale
            && self.causal == other.causal
            && self.window == other.window
            && self.softcap == other.softcap
            && sinks(self) == sinks(other)
            && self.alibi_slopes.map(|a| (a.view.raw.ptr, a.view.raw.place, a.per_batch))
                == other.alibi_slopes.map(|a| (a.view.raw.ptr, a.view.raw.place, a.per_batch))
            && self.num_splits == other.num_splits
            && self.decode_kernel == other.decode_kernel
            && self.cache_batch_idx.map(|t| t.ptr) == other.cache_batch_idx.map(|t| t.ptr)
            && self.cache_leftpad.map(|t| t.ptr) == other.cache_leftpad.map(|t| t.ptr)
            && self.rotary.map(|r| (r.cos.raw.ptr, r.sin.raw.ptr, r.interleaved))
                == other.rotary.map(|r| (r.cos.raw.ptr, r.sin.raw.ptr, r.interleaved))
    }
}

impl<'s> AttnOpts<'s> {
    /// Defaults: scale `1/sqrt(head_dim)`, no mask.
    pub fn new() -> Self {
        Self::default()
    }
    /// See [`AttnOpts::softmax_scale`](struct.AttnOpts.html#structfield.softmax_scale).
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = Some(scale);
        self
    }
    /// See [`AttnOpts::causal`](struct.AttnOpts.html#structfield.causal).
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }
    /// See [`AttnOpts::window`](struct.AttnOpts.html#structfield.window).
    pub fn window(mut self, left: Option<u32>, right: Option<u32>) -> Self {
        self.window = (left, right);
        self
    }
    /// FlashAttention's `window_size=(left, right)`: a negative side (FlashAttention writes `-1`)
    /// is unbounded. `window_size(-1, -1)` is no window.
    pub fn window_size(mut self, left: i32, right: i32) -> Self {
        let side = |w: i32| u32::try_from(w).ok();
        self.window = (side(left), side(right));
        self
    }
    /// See [`AttnOpts::softcap`](struct.AttnOpts.html#structfield.softcap).
    pub fn softcap(mut self, softcap: f32) -> Self {
        self.softcap = Some(softcap);
        self
    }
    /// See [`AttnOpts::sinks`](struct.AttnOpts.html#structfield.sinks).
    pub fn sinks(mut self, sinks: &'s SinksView<'s>) -> Self {
        self.sinks = Some(sinks);
        self
    }
    /// See [`AttnOpts::alibi_slopes`](struct.AttnOpts.html#structfield.alibi_slopes).
    pub fn alibi_slopes(mut self, slopes: &'s AlibiView<'s>) -> Self {
        self.alibi_slopes = Some(slopes);
        self
    }
    /// See [`AttnOpts::num_splits`](struct.AttnOpts.html#structfield.num_splits).
    pub fn num_splits(mut self, n: u32) -> Self {
        self.num_splits = Some(n);
        self
    }
    /// See [`AttnOpts::decode_kernel`](struct.AttnOpts.html#structfield.decode_kernel).
    pub fn decode_kernel(mut self, kernel: crate::decode::DecodeKernel) -> Self {
        self.decode_kernel = kernel;
        self
    }
    /// See [`AttnOpts::cache_batch_idx`](struct.AttnOpts.html#structfield.cache_batch_idx).
    pub fn cache_batch_idx(mut self, slots: &'s IndexTensor) -> Self {
        self.cache_batch_idx = Some(slots);
        self
    }
    /// See [`AttnOpts::cache_leftpad`](struct.AttnOpts.html#structfield.cache_leftpad).
    pub fn cache_leftpad(mut self, leftpad: &'s IndexTensor) -> Self {
        self.cache_leftpad = Some(leftpad);
        self
    }
    /// See [`AttnOpts::rotary`](struct.AttnOpts.html#structfield.rotary).
    pub fn rotary(mut self, rotary: &'s RotaryView<'s>) -> Self {
        self.rotary = Some(rotary);
        self
    }

    /// The window as the kernels take it: `(left, right)`, `-1` unbounded. A side over
    /// `i32::MAX` keys is refused.
    fn window_i32(&self) -> Result<(i32, i32), AttnError> {
        let side = |name: &'static str, w: Option<u32>| match w {
            None => Ok(-1),
            Some(w) => i32::try_from(w).map_err(|_| AttnError::Window { side: name, got: w }),
        };
        Ok((side("left", self.window.0)?, side("right", self.window.1)?))
    }

    /// Refuses split counts and a decode kernel choice on the one-split (prefill) calls.
    fn check_one_split(&self) -> Result<(), AttnError> {
        if self.num_splits.is_some_and(|n| n > 1) {
            return Err(AttnError::NotSupportedYet {
                feature: "split-KV in the prefill calls (AttnOpts::num_splits over 1; \
                          flash_attn_with_kvcache splits)",
            });
        }
        if self.decode_kernel != crate::decode::DecodeKernel::Auto {
            return Err(AttnError::NotSupportedYet {
                feature: "a decode kernel choice in the prefill calls (AttnOpts::decode_kernel is for \
                          flash_attn_with_kvcache)",
            });
        }
        if self.cache_batch_idx.is_some() || self.cache_leftpad.is_some() {
            return Err(AttnError::NotSupportedYet {
                feature: "cache slots or left padding in the prefill calls (AttnOpts::cache_batch_idx and \
                          cache_leftpad are for flash_attn_with_kvcache)",
            });
        }
        if self.rotary.is_some() {
            return Err(AttnError::NotSupportedYet {
                feature: "rotary embedding in the prefill calls (AttnOpts::rotary is for flash_attn_with_kvcache)",
            });
        }
        Ok(())
    }
}

/// Element types a cudarc slice may hold for [`TensorView::cuda`].
pub trait Element: Copy + 'static {
    /// The dtype of the element type.
    const DTYPE: Dtype;
}
impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
}
impl Element for half::bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
}
impl Element for half::f16 {
    const DTYPE: Dtype = Dtype::F16;
}

/// Where a buffer lives: one [`Device`] instance (the VM, or a device given to
/// [`Kernels::on_device`] / [`Kernels::scoped`]), or one CUDA context (and the stream a view is for).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Dev { id: u64, vm: bool },
    Cuda { ctx: usize, stream: usize },
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Place::Dev { id, vm: true } => write!(f, "VM instance #{id}"),
            Place::Dev { id, vm: false } => write!(f, "device instance #{id}"),
            Place::Cuda { ctx, .. } => write!(f, "CUDA context {ctx:#x}"),
        }
    }
}

static NEXT_DEVICE_ID: AtomicU64 = AtomicU64::new(1);

/// The [`Device`] under device-backed kernels: owned ([`Kernels::vm`], [`Kernels::on_device`]) or
/// lent for one scope ([`Kernels::scoped`]).
struct DevShared {
    id: u64,
    vm: bool,
    slot: Mutex<Slot>,
    /// The Hopper forward's tensor-map slot on this device (384 bytes), made at its first launch
    /// and freed with the device's kernels ([`Kernels::launch_sm90`]).
    maps: Mutex<Option<DevPtr>>,
}

enum Slot {
    Owned(Box<dyn Device>),
    /// The device lent to [`Kernels::scoped`]; `None` once the scope returned.
    Lent(Option<NonNull<dyn Device>>),
}

// SAFETY: `Device: Send`, so the device may be used from another thread; the lent pointer is
// dereferenced only under the mutex and only while `Kernels::scoped`, which holds the exclusive
// borrow it was made from, is running (it sets the slot to `Lent(None)` before returning, also
// on unwinding).
unsafe impl Send for Slot {}

impl DevShared {
    fn new(id: u64, vm: bool, slot: Slot) -> DevShared {
        DevShared { id, vm, slot: Mutex::new(slot), maps: Mutex::new(None) }
    }

    fn place(&self) -> Place {
        Place::Dev { id: self.id, vm: self.vm }
    }

    /// Runs `f` on the device. A panic while holding the lock cannot leave the device's memory
    /// inconsistent for later calls (each call checks its own ranges), so a poisoned lock is
    /// taken over.
    fn with<R>(&self, f: impl FnOnce(&mut dyn Device) -> Result<R, DeviceError>) -> Result<R, DeviceError> {
        let mut slot = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *slot {
            Slot::Owned(d) => f(d.as_mut()),
            // SAFETY: see `unsafe impl Send for Slot`: the scope that lent the device is running
            // and the mutex makes this the only reference.
            Slot::Lent(Some(p)) => f(unsafe { p.as_mut() }),
            Slot::Lent(None) => Err(DeviceError::Unavailable(
                "the device lent to Kernels::scoped was given back when the scope returned; a buffer or \
                 handle kept past it cannot use it"
                    .into(),
            )),
        }
    }

    /// Frees the tensor-map slot, if one was made (while the device is still there).
    fn free_maps(&self) {
        if let Some(ptr) = self.maps.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = self.with(|d| d.free(ptr));
        }
    }
}

impl Drop for DevShared {
    fn drop(&mut self) {
        self.free_maps();
    }
}

/// One launch as [`Kernels::take_launches`] reports it: the entry point, its grid, block and
/// dynamic shared memory, and what the device reported.
#[derive(Clone, Debug, PartialEq)]
pub struct Launched {
    /// The kernel entry point launched.
    pub kernel: KernelId,
    /// Its grid, block and dynamic shared memory.
    pub dims: kernels_gpu::tiles::LaunchDims,
    /// What the device reported (VM: thread-instructions, the trace when one was asked for;
    /// nothing on a caller's CUDA context, where the launch is only queued).
    pub info: LaunchInfo,
}

impl fmt::Display for Launched {
    /// `name grid [x, y, z] block [x, y, z] smem N`: a line for an engine's log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} grid {:?} block {:?} smem {}",
            self.kernel.name(),
            self.dims.grid,
            self.dims.block,
            self.dims.dynamic_smem_bytes
        )
    }
}

/// A buffer in the memory of device-backed kernels (the VM's simulated memory, or a device given
/// to [`Kernels::on_device`] / [`Kernels::scoped`]), freed when dropped. Made by
/// [`Kernels::alloc`], [`Kernels::upload_as`] (or their `vm_` names).
pub struct DeviceBuffer {
    ptr: DevPtr,
    bytes: u64,
    dev: Arc<DevShared>,
}

/// The VM's buffers are device buffers.
pub type VmBuffer = DeviceBuffer;

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBuffer({} bytes at {:#x} on {})", self.bytes, self.ptr, self.dev.place())
    }
}

impl DeviceBuffer {
    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Copies `data` (as `dtype`: rounded to nearest even for 16-bit types) to the start.
    pub fn write_f32(&self, dtype: Dtype, data: &[f32]) -> Result<(), AttnError> {
        let bytes = dtype.encode(data);
        if bytes.len() as u64 > self.bytes {
            return Err(AttnError::OutOfBounds { tensor: "write", need: bytes.len() as u128, have: self.bytes });
        }
        Ok(self.dev.with(|d| d.upload_bytes(self.ptr, &bytes))?)
    }
    /// Reads `count` elements of `dtype` from the start, as f32.
    pub fn read_f32(&self, dtype: Dtype, count: usize) -> Result<Vec<f32>, AttnError> {
        let need = count as u64 * dtype.size_bytes();
        if need > self.bytes {
            return Err(AttnError::OutOfBounds { tensor: "read", need: need as u128, have: self.bytes });
        }
        let mut out = vec![0u8; need as usize];
        self.dev.with(|d| d.download_bytes(self.ptr, &mut out))?;
        Ok(dtype.decode(&out))
    }
    /// Sets `count` 32-bit words from the start to `value` (e.g. a NaN poison).
    pub fn fill_u32(&self, count: u64, value: u32) -> Result<(), AttnError> {
        if count.saturating_mul(4) > self.bytes {
            return Err(AttnError::OutOfBounds { tensor: "fill", need: count as u128 * 4, have: self.bytes });
        }
        Ok(self.dev.with(|d| d.fill_u32(self.ptr, count, value))?)
    }
    /// Copies raw bytes to the start.
    pub fn write_bytes(&self, data: &[u8]) -> Result<(), AttnError> {
        if data.len() as u64 > self.bytes {
            return Err(AttnError::OutOfBounds { tensor: "write", need: data.len() as u128, have: self.bytes });
        }
        Ok(self.dev.with(|d| d.upload_bytes(self.ptr, data))?)
    }
    /// Reads `len` raw bytes from the start.
    pub fn read_bytes(&self, len: usize) -> Result<Vec<u8>, AttnError> {
        if len as u64 > self.bytes {
            return Err(AttnError::OutOfBounds { tensor: "read", need: len as u128, have: self.bytes });
        }
        let mut out = vec![0u8; len];
        self.dev.with(|d| d.download_bytes(self.ptr, &mut out))?;
        Ok(out)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // After a lent device's scope this is an error, and the memory is the device's again.
        let _ = self.dev.with(|d| d.free(self.ptr));
    }
}

/// A read-only view of a tensor in memory the caller owns: device address, dtype, logical shape
/// `[batch, seq, heads, head_dim]` and element strides. It borrows the buffer for `'a`.
pub struct TensorView<'a> {
    raw: RawView,
    _guard: Option<SyncOnDrop<'a>>,
    stream: Option<Arc<CudaStream>>,
    _borrow: PhantomData<&'a ()>,
}

/// A writable view (outputs). Like [`TensorView`], it borrows the buffer mutably for `'a`.
pub struct TensorViewMut<'a> {
    raw: RawView,
    _guard: Option<SyncOnDrop<'a>>,
    stream: Option<Arc<CudaStream>>,
    _borrow: PhantomData<&'a mut ()>,
}

#[derive(Clone, Copy, Debug)]
struct RawView {
    ptr: u64,
    /// Bytes of the buffer from `ptr` on.
    avail: u64,
    dtype: Dtype,
    shape: [usize; 4],
    strides: [usize; 4],
    place: Place,
}

fn contiguous(shape: [usize; 4]) -> [usize; 4] {
    [shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1]
}

impl RawView {
    fn new(ptr: u64, avail: u64, dtype: Dtype, shape: [usize; 4], place: Place) -> RawView {
        RawView { ptr, avail, dtype, shape, strides: contiguous(shape), place }
    }

    /// Bytes from the start to one past the last element.
    fn span_bytes(&self) -> u128 {
        if self.shape.contains(&0) {
            return 0;
        }
        let last: u128 = self.shape.iter().zip(&self.strides).map(|(&n, &s)| (n as u128 - 1) * s as u128).sum();
        (last + 1) * self.dtype.size_bytes() as u128
    }

    fn check_bounds(&self, tensor: &'static str) -> Result<(), AttnError> {
        let need = self.span_bytes();
        if need > self.avail as u128 {
            return Err(AttnError::OutOfBounds { tensor, need, have: self.avail });
        }
        Ok(())
    }

    fn kernel_strides(&self) -> Strides {
        Strides { batch: self.strides[0] as u64, seq: self.strides[1] as u64, head: self.strides[2] as u64 }
    }
}

macro_rules! view_common {
    ($t:ident) => {
        impl<'a> $t<'a> {
            /// The same buffer seen with other element strides (`[batch, seq, heads, head_dim]`
            /// order; head_dim's must be 1). `TensorView::vm(&buf, dtype, [b, s, h, d])?
            /// .with_strides([h * s * d, d, s * d, 1])` is a BHSD tensor.
            pub fn with_strides(mut self, strides: [usize; 4]) -> Self {
                self.raw.strides = strides;
                self
            }
            /// The same buffer starting `elements` elements further on.
            pub fn offset(mut self, elements: usize) -> Result<Self, AttnError> {
                let bytes = elements as u64 * self.raw.dtype.size_bytes();
                if bytes > self.raw.avail {
                    return Err(AttnError::OutOfBounds { tensor: "offset", need: bytes as u128, have: self.raw.avail });
                }
                self.raw.ptr += bytes;
                self.raw.avail -= bytes;
                Ok(self)
            }
            /// The element type the view reads its buffer as.
            pub fn dtype(&self) -> Dtype {
                self.raw.dtype
            }
            /// `[batch, seq, heads, head_dim]`.
            pub fn shape(&self) -> [usize; 4] {
                self.raw.shape
            }
            /// Element strides in shape order.
            pub fn strides(&self) -> [usize; 4] {
                self.raw.strides
            }
            /// The device address of element `[0, 0, 0, 0]`.
            pub fn ptr(&self) -> u64 {
                self.raw.ptr
            }
            /// A view of `buf` (a buffer of device-backed kernels), contiguous
            /// `[batch, seq, heads, head_dim]` (BSHD).
            pub fn device(buf: &'a DeviceBuffer, dtype: Dtype, shape: [usize; 4]) -> Result<Self, AttnError> {
                let raw = RawView::new(buf.ptr, buf.bytes, dtype, shape, buf.dev.place());
                Ok($t { raw, _guard: None, stream: None, _borrow: PhantomData })
            }
            /// [`Self::device`] of a VM buffer.
            pub fn vm(buf: &'a VmBuffer, dtype: Dtype, shape: [usize; 4]) -> Result<Self, AttnError> {
                Self::device(buf, dtype, shape)
            }
        }
    };
}
view_common!(TensorView);
view_common!(TensorViewMut);

fn cuda_place(stream: &CudaStream) -> Place {
    Place::Cuda { ctx: stream.context().cu_ctx() as usize, stream: stream.cu_stream() as usize }
}

fn check_slice_context<T>(
    what: &'static str,
    slice: &impl DeviceSlice<T>,
    stream: &CudaStream,
) -> Result<(), AttnError> {
    let (have, want) = (slice.stream().context().cu_ctx() as usize, stream.context().cu_ctx() as usize);
    if have != want {
        return Err(AttnError::WrongDevice {
            tensor: what,
            got: format!("CUDA context {have:#x}"),
            expected: format!("the stream's context {want:#x}"),
        });
    }
    Ok(())
}

impl<'a> TensorView<'a> {
    /// A view of a cudarc slice (`CudaSlice<T>` or `CudaView<T>`), contiguous
    /// `[batch, seq, heads, head_dim]`, for a launch on `stream`. The view waits (on the device)
    /// for the slice's last write and records its read when dropped, as cudarc's launches do.
    pub fn cuda<T: Element, S: DevicePtr<T>>(
        slice: &'a S,
        stream: &'a Arc<CudaStream>,
        shape: [usize; 4],
    ) -> Result<Self, AttnError> {
        check_slice_context("the slice", slice, stream)?;
        let avail = (slice.len() * std::mem::size_of::<T>()) as u64;
        let (ptr, guard) = slice.device_ptr(stream);
        let raw = RawView::new(ptr, avail, T::DTYPE, shape, cuda_place(stream));
        Ok(TensorView { raw, _guard: Some(guard), stream: Some(stream.clone()), _borrow: PhantomData })
    }

    /// A view of raw device memory.
    ///
    /// # Safety
    /// `[ptr, ptr + bytes)` must be memory of `kernels`' device (its VM, or its CUDA context)
    /// that stays valid, and is not written by anything else, until the launches reading it
    /// completed.
    pub unsafe fn from_raw(
        kernels: &Kernels,
        stream: Option<&Arc<CudaStream>>,
        ptr: u64,
        bytes: u64,
        dtype: Dtype,
        shape: [usize; 4],
    ) -> Self {
        let place = match (&kernels.inner, stream) {
            (Inner::Cuda(_), Some(s)) => cuda_place(s),
            (Inner::Cuda(c), None) => Place::Cuda { ctx: c.ctx.cu_ctx() as usize, stream: 0 },
            (Inner::Dev(v), _) => v.place(),
        };
        TensorView {
            raw: RawView::new(ptr, bytes, dtype, shape, place),
            _guard: None,
            stream: stream.cloned(),
            _borrow: PhantomData,
        }
    }
}

impl<'a> TensorViewMut<'a> {
    /// A writable view of a cudarc slice (`CudaSlice<T>` or `CudaViewMut<T>`), contiguous
    /// `[batch, seq, heads, head_dim]`, for a launch on `stream`.
    pub fn cuda<T: Element, S: DevicePtrMut<T>>(
        slice: &'a mut S,
        stream: &'a Arc<CudaStream>,
        shape: [usize; 4],
    ) -> Result<Self, AttnError> {
        check_slice_context("the slice", slice, stream)?;
        let avail = (slice.len() * std::mem::size_of::<T>()) as u64;
        let (ptr, guard) = slice.device_ptr_mut(stream);
        let raw = RawView::new(ptr, avail, T::DTYPE, shape, cuda_place(stream));
        Ok(TensorViewMut { raw, _guard: Some(guard), stream: Some(stream.clone()), _borrow: PhantomData })
    }

    /// A writable view of raw device memory.
    ///
    /// # Safety
    /// As [`TensorView::from_raw`], and nothing else may read or write the memory until the
    /// launch writing it completed.
    pub unsafe fn from_raw(
        kernels: &Kernels,
        stream: Option<&Arc<CudaStream>>,
        ptr: u64,
        bytes: u64,
        dtype: Dtype,
        shape: [usize; 4],
    ) -> Self {
        // SAFETY: the same contract, forwarded.
        let v = unsafe { TensorView::from_raw(kernels, stream, ptr, bytes, dtype, shape) };
        TensorViewMut { raw: v.raw, _guard: None, stream: v.stream, _borrow: PhantomData }
    }
}

/// The LSE output: `[batch, heads, seq_q]` f32, contiguous.
pub struct LseViewMut<'a>(TensorViewMut<'a>);

impl<'a> LseViewMut<'a> {
    /// An LSE view of a device buffer (VM or [`Kernels::on_device`]).
    pub fn vm(buf: &'a VmBuffer, batch: usize, heads: usize, seq_q: usize) -> Result<Self, AttnError> {
        Ok(LseViewMut(TensorViewMut::vm(buf, Dtype::F32, [batch, heads, seq_q, 1])?))
    }
    /// An LSE view of a cudarc f32 slice, for a launch on `stream`.
    pub fn cuda<S: DevicePtrMut<f32>>(
        slice: &'a mut S,
        stream: &'a Arc<CudaStream>,
        batch: usize,
        heads: usize,
        seq_q: usize,
    ) -> Result<Self, AttnError> {
        Ok(LseViewMut(TensorViewMut::cuda(slice, stream, [batch, heads, seq_q, 1])?))
    }
}

/// Per-head sink logits, `[heads]` f32, contiguous, on the kernels' device (see
/// [`AttnOpts::sinks`]). Their values are not read by the host: they must be finite.
pub struct SinksView<'a>(TensorView<'a>);

impl fmt::Debug for SinksView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SinksView({} heads at {:#x} on {})", self.heads(), self.0.raw.ptr, self.0.raw.place)
    }
}

impl<'a> SinksView<'a> {
    /// Sinks in a device buffer (VM or [`Kernels::on_device`]; `heads` f32 from its start).
    pub fn vm(buf: &'a VmBuffer, heads: usize) -> Result<Self, AttnError> {
        Ok(SinksView(TensorView::vm(buf, Dtype::F32, [1, 1, heads, 1])?))
    }
    /// Sinks in a cudarc f32 slice, for a launch on `stream`.
    pub fn cuda<S: DevicePtr<f32>>(slice: &'a S, stream: &'a Arc<CudaStream>, heads: usize) -> Result<Self, AttnError> {
        Ok(SinksView(TensorView::cuda(slice, stream, [1, 1, heads, 1])?))
    }
    /// The number of heads.
    pub fn heads(&self) -> usize {
        self.0.raw.shape[2]
    }
}

/// ALiBi slopes ([`AttnOpts::alibi_slopes`]): f32, contiguous, on the kernels' device, either one
/// slope per query head shared by every sequence (`[heads]`) or one per sequence and head
/// (`[batch, heads]`; varlen: per packed sequence), as FlashAttention-2's `alibi_slopes`
/// `(nheads,)` or `(batch, nheads)`. Their values are not read by the host.
/// [`crate::problem::alibi_slopes`] gives the ALiBi paper's slopes for a head count.
pub struct AlibiView<'a> {
    view: TensorView<'a>,
    per_batch: bool,
}

impl fmt::Debug for AlibiView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [_, b, h, _] = self.view.raw.shape;
        let shape = if self.per_batch { format!("[{b}, {h}]") } else { format!("[{h}]") };
        write!(f, "AlibiView({shape} at {:#x} on {})", self.view.raw.ptr, self.view.raw.place)
    }
}

impl<'a> AlibiView<'a> {
    /// Slopes in a device buffer (VM or [`Kernels::on_device`]): `heads` f32 from its start, or
    /// with `batch = Some(n)`, `n * heads` (sequence-major).
    pub fn vm(buf: &'a VmBuffer, batch: Option<usize>, heads: usize) -> Result<Self, AttnError> {
        Ok(AlibiView {
            view: TensorView::vm(buf, Dtype::F32, [1, batch.unwrap_or(1), heads, 1])?,
            per_batch: batch.is_some(),
        })
    }
    /// Slopes in a cudarc f32 slice, for a launch on `stream` (shapes as [`AlibiView::vm`]).
    pub fn cuda<S: DevicePtr<f32>>(
        slice: &'a S,
        stream: &'a Arc<CudaStream>,
        batch: Option<usize>,
        heads: usize,
    ) -> Result<Self, AttnError> {
        Ok(AlibiView {
            view: TensorView::cuda(slice, stream, [1, batch.unwrap_or(1), heads, 1])?,
            per_batch: batch.is_some(),
        })
    }
    /// Slopes per sequence (the query heads).
    pub fn heads(&self) -> usize {
        self.view.raw.shape[2]
    }
    /// The sequences, for `[batch, heads]` slopes; `None` for `[heads]`.
    pub fn batch(&self) -> Option<usize> {
        self.per_batch.then_some(self.view.raw.shape[1])
    }
    /// Checks the slopes against a call of `heads` query heads and `batch` sequences and gives
    /// their address and batch stride (elements).
    fn check(&self, heads: usize, batch: usize) -> Result<(u64, u32), AttnError> {
        let why = if self.heads() != heads {
            Some(AlibiRule::Heads { got: self.heads(), heads })
        } else if self.batch().is_some_and(|b| b != batch) {
            Some(AlibiRule::Batch { got: self.batch().unwrap_or(0), batch })
        } else if !self.view.raw.ptr.is_multiple_of(4) {
            Some(AlibiRule::Misaligned { ptr: self.view.raw.ptr })
        } else {
            None
        };
        match why {
            Some(why) => Err(AttnError::Alibi { why }),
            None => Ok((self.view.raw.ptr, if self.per_batch { heads as u32 } else { 0 })),
        }
    }
    fn raw(&self) -> &RawView {
        &self.view.raw
    }
    fn stream(&self) -> Option<&CudaStream> {
        self.view.stream.as_deref()
    }
}

/// FlashAttention-2's rotary tables of a KV-cache call ([`AttnOpts::rotary`]): `cos` and `sin`
/// are `[seqlen_ro, rotary_dim / 2]` in q's dtype, contiguous, on the kernels' device, given as
/// [`TensorView`]s of shape `[seqlen_ro, rotary_dim / 2, 1, 1]`; `interleaved` picks the pairs
/// `(2i, 2i + 1)` (GPT-J) over `(i, i + rotary_dim / 2)` (GPT-NeoX). Rows must cover every
/// rotated position (docs/semantics.md, "Rotary embedding").
pub struct RotaryView<'a> {
    pub(crate) cos: TensorView<'a>,
    pub(crate) sin: TensorView<'a>,
    pub(crate) interleaved: bool,
}

impl fmt::Debug for RotaryView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RotaryView([{}, {}] at {:#x}/{:#x}, interleaved {})",
            self.cos.raw.shape[0], self.cos.raw.shape[1], self.cos.raw.ptr, self.sin.raw.ptr, self.interleaved
        )
    }
}

impl<'a> RotaryView<'a> {
    /// The tables; their shapes, dtype and place are checked by the call.
    pub fn new(cos: TensorView<'a>, sin: TensorView<'a>, interleaved: bool) -> Self {
        RotaryView { cos, sin, interleaved }
    }
    /// `rotary_dim`: twice the tables' second dimension.
    pub fn rotary_dim(&self) -> usize {
        2 * self.cos.raw.shape[1]
    }
}

/// An output the allocating calls return: memory owned by memattn on the kernels' device.
pub struct DeviceTensor {
    storage: Storage,
    dtype: Dtype,
    shape: [usize; 4],
}

enum Storage {
    Dev(DeviceBuffer),
    Cuda { slice: CudaSlice<u8>, stream: Arc<CudaStream> },
}

impl fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on = match &self.storage {
            Storage::Dev(b) => b.dev.place().to_string(),
            Storage::Cuda { .. } => "CUDA".to_string(),
        };
        write!(f, "DeviceTensor({} {:?} at {:#x} on {on})", self.dtype, self.shape, self.ptr())
    }
}

impl Storage {
    fn ptr(&self) -> u64 {
        match self {
            Storage::Dev(b) => b.ptr,
            Storage::Cuda { slice, stream } => slice.device_ptr(stream).0,
        }
    }
}

impl DeviceTensor {
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.storage.ptr()
    }
    /// The element type of the tensor.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    /// `[batch, seq_q, heads, head_dim]` for `o`; `[batch, heads, seq_q, 1]` for `lse`.
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }
    /// The device buffer, when on device-backed kernels (the VM).
    pub fn as_vm(&self) -> Option<&VmBuffer> {
        match &self.storage {
            Storage::Dev(b) => Some(b),
            Storage::Cuda { .. } => None,
        }
    }
    /// The bytes as a cudarc slice, when on a GPU (elements of [`DeviceTensor::dtype`]).
    pub fn as_cuda(&self) -> Option<&CudaSlice<u8>> {
        match &self.storage {
            Storage::Cuda { slice, .. } => Some(slice),
            Storage::Dev(_) => None,
        }
    }
    /// Copies the values to the host as f32 (waits for the launch on CUDA: the one place a
    /// result is synchronised, because the caller asks for it here).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>, AttnError> {
        match &self.storage {
            Storage::Dev(b) => b.read_f32(self.dtype, self.shape.iter().product()),
            Storage::Cuda { slice, stream } => {
                let bytes = stream.clone_dtoh(slice).map_err(|e| DeviceError::Cuda {
                    op: "copying a result to the host".into(),
                    message: e.to_string(),
                })?;
                Ok(self.dtype.decode(&bytes))
            }
        }
    }
}

struct CudaKernels {
    ctx: Arc<CudaContext>,
    /// memattn's module in `ctx`, its function cache and the one launch
    /// ([`CudaModule::launch`]); dropped (unloaded) after [`CudaKernels::drop`] made `ctx`
    /// current.
    module: std::mem::ManuallyDrop<CudaModule>,
    /// The `sm_90a` module, loaded at the first launch of one of its kernels (compute
    /// capability 9.0 only); unloaded like `module`.
    module_sm90: Mutex<Option<CudaModule>>,
    caps: DeviceCaps,
    /// Multiprocessors, for the split plan of the KV-cache call.
    sm_count: u32,
    /// The context's device: its generation (compute capability) and `MEMATTN_HOPPER`.
    target: crate::choice::Target,
    /// The Hopper forward's tensor-map slot (384 bytes) of each stream it ran on, by stream
    /// handle: the maps are written on that stream before each forward launch, so launches on
    /// one stream never overwrite a slot a launch still reads. Freed on drop.
    maps: Mutex<std::collections::HashMap<usize, u64>>,
}

impl CudaKernels {
    /// The stream a host-to-device copy of the kernels' own (indices, FP8 scales) goes on: one
    /// must be given, of these kernels' context. `why` says why a stream is needed.
    fn copy_stream<'s>(
        &self,
        tensor: &'static str,
        why: &str,
        stream: Option<&'s Arc<CudaStream>>,
    ) -> Result<&'s Arc<CudaStream>, AttnError> {
        let stream = stream.ok_or_else(|| AttnError::WrongDevice {
            tensor,
            got: "no stream".into(),
            expected: format!("a stream of the kernels' context ({why})"),
        })?;
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(AttnError::StreamContext {
                tensor,
                got: stream.context().cu_ctx() as usize,
                expected: self.ctx.cu_ctx() as usize,
            });
        }
        Ok(stream)
    }
}

impl Drop for CudaKernels {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // The slots may still be read by queued launches: free them after those ran.
            let slots: Vec<u64> =
                self.maps.get_mut().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, p)| p).collect();
            if !slots.is_empty() {
                let _ = self.ctx.synchronize();
                for p in slots {
                    // SAFETY: allocated by `Kernels::tensor_map_slot` in this context, freed once.
                    let _ = unsafe { cudarc::driver::result::free_sync(p) };
                }
            }
            drop(self.module_sm90.get_mut().unwrap_or_else(|e| e.into_inner()).take());
            // SAFETY: dropped once, here; not used after this point.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.module) };
        }
        // Without the context bound the modules and slots are left to the context's own teardown.
    }
}

enum Inner {
    /// A [`Device`]: the VM, or one given to [`Kernels::on_device`] / [`Kernels::scoped`].
    Dev(Arc<DevShared>),
    Cuda(Box<CudaKernels>),
}

/// memattn's kernels loaded once on one device: a PTX VM instance, or one CUDA context. Functions
/// are looked up once and cached. Cheap to share (`Send + Sync`); make one per context.
pub struct Kernels {
    inner: Inner,
    /// The status words of KV-cache calls with device-checked indices, made at the first such
    /// call ([`Kernels::check_kv_status`]).
    kv_status: std::sync::OnceLock<KvStatusWords>,
    /// `Some` while [`Kernels::record_launches`] is on: every launch, in order.
    log: Mutex<Option<Vec<Launched>>>,
}

/// [`kernels_gpu::decode_abi::kv_status::WORDS`] zeroed u32 on the kernels' device.
struct KvStatusWords {
    ptr: u64,
    storage: IndexStorage,
}

fn cuda_err(op: &str, e: cudarc::driver::DriverError) -> DeviceError {
    DeviceError::Cuda { op: op.into(), message: e.to_string() }
}

/// Opens the primary context of CUDA device `ordinal` for [`Kernels::cuda`], without a panic
/// where cudarc's own `CudaContext::new` would have one: the driver library is chosen first
/// (`MEMATTN_CUDA_DRIVER`, or [`crate::device::cuda::use_driver_library`]; else the system's)
/// and checked for every function memattn calls. No driver, no device or a driver too old is an
/// [`AttnError::Device`] naming the cause.
///
/// ```
/// // On a machine without a GPU (and without MEMATTN_CUDA_DRIVER) this is an error, not a panic.
/// match memattn::attn::cuda_context(0) {
///     Ok(ctx) => drop(memattn::attn::Kernels::cuda(&ctx)),
///     Err(e) => eprintln!("no CUDA: {e}"),
/// }
/// ```
pub fn cuda_context(ordinal: usize) -> Result<Arc<CudaContext>, AttnError> {
    crate::device::cuda::probe().map_err(DeviceError::Unavailable)?;
    crate::device::cuda::quietly(|| CudaContext::new(ordinal))
        .map_err(|panic| DeviceError::Unavailable(format!("the CUDA driver could not be used: {panic}")))?
        .map_err(|e| AttnError::Device(cuda_err(&format!("creating the context on device {ordinal}"), e)))
}

impl Kernels {
    #[cfg(feature = "vm")]
    /// A fresh PTX VM with memattn's embedded kernels (memcheck, initcheck and racecheck on).
    pub fn vm() -> Result<Kernels, AttnError> {
        let dev = VmDevice::new(&DeviceOptions::new(BackendChoice::Vm, PtxSource::embedded()))?;
        Ok(Kernels::on_device(Box::new(dev)))
    }

    /// Kernels on any [`Device`]: the library's measurement extension point. Every call
    /// ([`Kernels::flash_attn_into`], the KV-cache calls, [`Kernels::naive_attn_into`]) is
    /// validated and launched exactly as on the VM, through the device's
    /// [`Device::launch`]; buffers are [`DeviceBuffer`]s of [`Kernels::alloc`]. The `memattn`
    /// command runs this way over its NVML-measuring CUDA device and over the VM, and wraps
    /// devices to inject faults in its tests. [`Kernels::with_device`] reaches the device's
    /// timer and memory hooks between calls; [`Kernels::record_launches`] keeps what each
    /// launch reported.
    pub fn on_device(dev: Box<dyn Device>) -> Kernels {
        let id = NEXT_DEVICE_ID.fetch_add(1, Ordering::Relaxed);
        let vm = dev.backend() == Backend::Vm;
        Kernels {
            inner: Inner::Dev(Arc::new(DevShared::new(id, vm, Slot::Owned(dev)))),
            kv_status: Default::default(),
            log: Mutex::new(None),
        }
    }

    /// [`Kernels::on_device`] over a device the caller keeps: `f` runs with kernels on `dev`,
    /// which is the caller's again when `f` returns. Buffers are freed as they are dropped;
    /// one kept past the scope is not (its drop, and every use, is an error once the scope
    /// returned, never an access to the device).
    ///
    /// ```
    /// # #[cfg(feature = "vm")] {
    /// use memattn::attn::{AttnOpts, Kernels, LseViewMut, TensorView, TensorViewMut};
    /// use memattn::device::{vm::VmDevice, BackendChoice, Device, DeviceOptions};
    /// use memattn::{ptx::PtxSource, Dtype};
    ///
    /// let mut dev = VmDevice::new(&DeviceOptions::new(BackendChoice::Vm, PtxSource::embedded()))?;
    /// let o = Kernels::scoped(&mut dev, |k| -> Result<Vec<f32>, memattn::attn::AttnError> {
    ///     let x: Vec<f32> = (0..5 * 64).map(|i| (i % 7) as f32 / 7.0).collect();
    ///     let t = k.upload_as(Dtype::F32, &x)?;
    ///     let (o, lse) = (k.alloc(5 * 64 * 4)?, k.alloc(5 * 4)?);
    ///     let view = TensorView::device(&t, Dtype::F32, [1, 5, 1, 64])?;
    ///     k.flash_attn_into(&view, &view, &view, &mut TensorViewMut::device(&o, Dtype::F32, [1, 5, 1, 64])?,
    ///         &mut LseViewMut::vm(&lse, 1, 1, 5)?, &AttnOpts::new().causal(true))?;
    ///     o.read_f32(Dtype::F32, 5 * 64)
    /// })?;
    /// assert_eq!(o[..64], (0..64).map(|i| (i % 7) as f32 / 7.0).collect::<Vec<_>>()[..]); // row 0 sees key 0
    /// assert_eq!(dev.memory_end()?.after_bytes, 0); // the device is ours again, every buffer freed
    /// # }
    /// # Ok::<(), memattn::attn::AttnError>(())
    /// ```
    pub fn scoped<R>(dev: &mut dyn Device, f: impl FnOnce(&Kernels) -> R) -> R {
        struct GiveBack(Arc<DevShared>);
        impl Drop for GiveBack {
            fn drop(&mut self) {
                self.0.free_maps();
                *self.0.slot.lock().unwrap_or_else(|e| e.into_inner()) = Slot::Lent(None);
            }
        }
        let id = NEXT_DEVICE_ID.fetch_add(1, Ordering::Relaxed);
        let vm = dev.backend() == Backend::Vm;
        let lent: NonNull<dyn Device + '_> = NonNull::from(dev);
        // SAFETY: only the lifetime is erased; `GiveBack` clears the pointer before this
        // function returns (or unwinds), while the exclusive borrow of `dev` is still held.
        let lent: NonNull<dyn Device + 'static> = unsafe { std::mem::transmute(lent) };
        let shared = Arc::new(DevShared::new(id, vm, Slot::Lent(Some(lent))));
        let _give_back = GiveBack(shared.clone());
        let kernels = Kernels { inner: Inner::Dev(shared), kv_status: Default::default(), log: Mutex::new(None) };
        f(&kernels)
    }

    /// Runs `f` on the device of device-backed kernels ([`Kernels::vm`], [`Kernels::on_device`],
    /// [`Kernels::scoped`]) between calls: its timer, memory and fill hooks. An error on CUDA
    /// kernels (cudarc owns that side).
    pub fn with_device<R>(&self, f: impl FnOnce(&mut dyn Device) -> Result<R, DeviceError>) -> Result<R, AttnError> {
        Ok(self.dev_shared()?.with(f)?)
    }

    /// From now on keep a record of every launch (on) or stop (off, dropping the records), on
    /// every kind of kernels (a caller's CUDA context included): which kernels ran, with their
    /// grids and shared memory, for an engine's log or a test. Off by default.
    pub fn record_launches(&self, on: bool) -> Result<(), AttnError> {
        *self.log() = on.then(Vec::new);
        Ok(())
    }

    /// The launches recorded since the last call (see [`Kernels::record_launches`]).
    pub fn take_launches(&self) -> Result<Vec<Launched>, AttnError> {
        Ok(self.log().as_mut().map(std::mem::take).unwrap_or_default())
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Option<Vec<Launched>>> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The launches [`Kernels::flash_attn_into`] would make for these tensors and options, in
    /// order, without launching anything (every check of the call runs): kernel names, grids,
    /// blocks and dynamic shared memory, e.g. for an engine to log which kernel serves a layer.
    /// The Hopper forward comes with the `tensor_maps_store` launch before it.
    pub fn flash_attn_launches(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        opts: &AttnOpts<'_>,
    ) -> Result<Vec<crate::problem::PlannedLaunch>, AttnError> {
        let plan = self.plan(KernelKind::Flash, q, k, v, None, None, opts, None)?;
        Ok(Self::with_map_stores(plan.launches))
    }

    /// `launches` with the `tensor_maps_store` launch before each Hopper forward.
    fn with_map_stores(launches: Vec<crate::problem::PlannedLaunch>) -> Vec<crate::problem::PlannedLaunch> {
        let mut out = Vec::with_capacity(launches.len() + 1);
        for l in launches {
            if matches!(l.kernel.variant().tile, kernels_gpu::variants::Tile::FlashSm90(_)) {
                out.push(crate::problem::PlannedLaunch {
                    kernel: KernelId::TensorMapsStore,
                    dims: kernels_gpu::tiles::tensor_maps_store_launch(),
                });
            }
            out.push(l);
        }
        out
    }

    /// The kernels these kernels run: the device's GPU generation and the Hopper policy
    /// ([`crate::choice`]; on a caller's CUDA context from its compute capability and
    /// `MEMATTN_HOPPER`).
    pub fn target(&self) -> Result<crate::choice::Target, AttnError> {
        match &self.inner {
            Inner::Dev(v) => Ok(v.with(|d| d.target())?),
            Inner::Cuda(c) => Ok(c.target),
        }
    }

    /// Loads memattn's embedded kernels into the caller's CUDA context (the driver JIT-compiles
    /// the PTX for the device once, here). The driver is checked first ([`crate::device::cuda::probe`],
    /// which honours `MEMATTN_CUDA_DRIVER`): a driver that lacks a function memattn calls is an
    /// [`AttnError::Device`] error, never a panic.
    pub fn cuda(ctx: &Arc<CudaContext>) -> Result<Kernels, AttnError> {
        crate::device::cuda::probe().map_err(DeviceError::Unavailable)?;
        crate::device::cuda::quietly(|| Self::cuda_unchecked(ctx))
            .map_err(|panic| DeviceError::Unavailable(format!("the CUDA driver could not be used: {panic}")))?
    }

    fn cuda_unchecked(ctx: &Arc<CudaContext>) -> Result<Kernels, AttnError> {
        use sys::CUdevice_attribute::*;
        let hopper = crate::choice::HopperPolicy::from_env().map_err(DeviceError::Setting)?;
        ctx.bind_to_thread().map_err(|e| cuda_err("binding the context", e))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| cuda_err("cuDeviceGetAttribute", e))?;
        let module = std::mem::ManuallyDrop::new(CudaModule::load(&PtxSource::embedded())?);
        let attr = |a| ctx.attribute(a).map(|x| x as u32).map_err(|e| cuda_err("cuDeviceGetAttribute", e));
        let caps = DeviceCaps {
            max_dynamic_smem_bytes: attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
            max_threads_per_block: attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_grid: [
                attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
                attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?,
                attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?,
            ],
            total_memory_bytes: 0,
            free_memory_bytes: 0,
        };
        Ok(Kernels {
            inner: Inner::Cuda(Box::new(CudaKernels {
                ctx: ctx.clone(),
                module,
                module_sm90: Mutex::new(None),
                caps,
                sm_count: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
                target: crate::choice::Target::new(crate::choice::Arch::of_compute_capability(major, minor), hopper),
                maps: Mutex::new(Default::default()),
            })),
            kv_status: Default::default(),
            log: Mutex::new(None),
        })
    }

    /// Whether these kernels run in the VM.
    pub fn is_vm(&self) -> bool {
        matches!(&self.inner, Inner::Dev(d) if d.vm)
    }

    fn place_name(&self) -> String {
        match &self.inner {
            Inner::Dev(v) => v.place().to_string(),
            Inner::Cuda(c) => format!("CUDA context {:#x}", c.ctx.cu_ctx() as usize),
        }
    }

    fn dev_shared(&self) -> Result<&Arc<DevShared>, AttnError> {
        match &self.inner {
            Inner::Dev(v) => Ok(v),
            Inner::Cuda(_) => Err(AttnError::WrongDevice {
                tensor: "a device buffer",
                got: "a CUDA context".into(),
                expected: "device-backed kernels (these kernels are CUDA's: use cudarc to allocate)".into(),
            }),
        }
    }

    /// Allocates `bytes` on the device of device-backed kernels (the VM, [`Kernels::on_device`]).
    /// The memory is not initialised.
    pub fn alloc(&self, bytes: u64) -> Result<DeviceBuffer, AttnError> {
        let dev = self.dev_shared()?;
        let ptr = dev.with(|d| d.alloc(bytes.max(1)))?;
        Ok(DeviceBuffer { ptr, bytes, dev: dev.clone() })
    }

    /// Allocates a device buffer holding `data` rounded to `dtype` (device-backed kernels).
    pub fn upload_as(&self, dtype: Dtype, data: &[f32]) -> Result<DeviceBuffer, AttnError> {
        let buf = self.alloc(data.len() as u64 * dtype.size_bytes())?;
        buf.write_f32(dtype, data)?;
        Ok(buf)
    }

    /// [`Kernels::alloc`] (VM kernels).
    pub fn vm_alloc(&self, bytes: u64) -> Result<VmBuffer, AttnError> {
        self.alloc(bytes)
    }

    /// Allocates a VM buffer holding `data` as f32 (VM kernels).
    pub fn vm_upload(&self, data: &[f32]) -> Result<VmBuffer, AttnError> {
        self.upload_as(Dtype::F32, data)
    }

    /// [`Kernels::upload_as`] (VM kernels).
    pub fn vm_upload_as(&self, dtype: Dtype, data: &[f32]) -> Result<VmBuffer, AttnError> {
        self.upload_as(dtype, data)
    }

    /// Copies `values` to the kernels' device (on CUDA: on `stream`, without waiting) and keeps a
    /// host copy for validation: the `cu_seqlens` of [`Kernels::flash_attn_varlen`], the
    /// `cache_seqlens` and block table of [`Kernels::flash_attn_with_kvcache`]. On CUDA the
    /// tensor must be used on the same stream.
    pub fn index_tensor(&self, values: &[u32], stream: Option<&Arc<CudaStream>>) -> Result<IndexTensor, AttnError> {
        match &self.inner {
            Inner::Dev(dev) => {
                let buf = self.alloc(values.len() as u64 * 4)?;
                let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                buf.write_bytes(&bytes)?;
                Ok(IndexTensor {
                    values: values.to_vec(),
                    len: values.len(),
                    host: true,
                    ptr: buf.ptr,
                    place: dev.place(),
                    _storage: IndexStorage::Dev(buf),
                })
            }
            Inner::Cuda(c) => {
                let stream = c.copy_stream("an index tensor", "CUDA kernels copy indices on a stream", stream)?;
                let padded: Vec<u32> = if values.is_empty() { vec![0] } else { values.to_vec() };
                let slice = stream.clone_htod(&padded).map_err(|e| cuda_err("copying indices to the device", e))?;
                let ptr = slice.device_ptr(stream).0;
                Ok(IndexTensor {
                    values: values.to_vec(),
                    len: values.len(),
                    host: true,
                    ptr,
                    place: cuda_place(stream),
                    _storage: IndexStorage::Cuda(slice),
                })
            }
        }
    }

    /// Copies `len` u32 from the caller's CUDA buffer `src` into an [`IndexTensor`] without a
    /// host copy, on `stream`, without waiting (a device-to-device copy: nothing is read back).
    /// KV-cache calls given it check its values on the device ([`Kernels::check_kv_status`]).
    /// CUDA kernels only; `src` must hold `len` values and belong to this context.
    pub fn index_tensor_from_cuda<S: DevicePtr<u32>>(
        &self,
        src: &S,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<IndexTensor, AttnError> {
        let Inner::Cuda(c) = &self.inner else {
            return Err(AttnError::WrongDevice {
                tensor: "an index tensor's source",
                got: "a CUDA buffer".into(),
                expected: format!("{} (use Kernels::index_tensor)", self.place_name()),
            });
        };
        if stream.context().cu_ctx() != c.ctx.cu_ctx() {
            return Err(AttnError::StreamContext {
                tensor: "an index tensor",
                got: stream.context().cu_ctx() as usize,
                expected: c.ctx.cu_ctx() as usize,
            });
        }
        // SAFETY: read by the copy below on the same stream before the launches that use it.
        let mut dst = unsafe { stream.alloc::<u32>(len.max(1)) }.map_err(|e| cuda_err("allocating indices", e))?;
        if len > 0 {
            let (from, _guard) = src.device_ptr(stream);
            let (to, _guard2) = dst.device_ptr_mut(stream);
            // SAFETY: both ranges hold `len` u32 (the caller's promise for `src`, ours for
            // `dst`), on this context, ordered on `stream`.
            unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, len * 4, stream.cu_stream()) }
                .result()
                .map_err(|e| cuda_err("copying indices on the device", e))?;
        }
        let ptr = dst.device_ptr(stream).0;
        Ok(IndexTensor {
            values: Vec::new(),
            len,
            host: false,
            ptr,
            place: cuda_place(stream),
            _storage: IndexStorage::Cuda(dst),
        })
    }

    /// The status words of KV-cache calls with device-checked indices, made (zeroed) at the
    /// first such call; their address.
    pub(crate) fn kv_status_ptr(&self) -> Result<u64, AttnError> {
        if let Some(w) = self.kv_status.get() {
            return Ok(w.ptr);
        }
        let zeros = [0u32; kernels_gpu::decode_abi::kv_status::WORDS];
        let words = match &self.inner {
            Inner::Dev(_) => {
                let buf = self.alloc(4 * zeros.len() as u64)?;
                buf.fill_u32(zeros.len() as u64, 0)?;
                KvStatusWords { ptr: buf.ptr, storage: IndexStorage::Dev(buf) }
            }
            Inner::Cuda(c) => {
                c.ctx.bind_to_thread().map_err(|e| cuda_err("binding the context", e))?;
                let stream = c.ctx.default_stream();
                let slice = stream.clone_htod(&zeros).map_err(|e| cuda_err("zeroing the KV status words", e))?;
                // Once per kernels handle: the words are zero before any stream's check reads them.
                stream.synchronize().map_err(|e| cuda_err("zeroing the KV status words", e))?;
                let ptr = slice.device_ptr(&stream).0;
                KvStatusWords { ptr, storage: IndexStorage::Cuda(slice) }
            }
        };
        // Two threads may race to make them; the loser's buffer is dropped unused.
        Ok(self.kv_status.get_or_init(|| words).ptr)
    }

    /// Reads the status of the KV-cache calls with device-checked indices (an
    /// [`IndexTensor`] without host values) made since the last check, after waiting for every
    /// launch of these kernels (on CUDA: the whole context). `Ok` when none broke a rule. Else
    /// the first violation found, as [`AttnError::KvCacheOnDevice`] with the
    /// [`KvCacheRule`] the host would have named; that call and every KV-cache call after it
    /// wrote NaN into O and LSE and left the caches unwritten. The status is cleared, so calls
    /// after this one run again.
    ///
    /// This is the one host read of the device-checked path: call it when a result is about to
    /// be used (e.g. every few decode steps, or before sampling), not per layer. After an error,
    /// treat every KV-cache result since the previous check as refused: a call on another stream
    /// that overlapped the refused one may have had its kernels stopped after its own check
    /// passed, leaving its O unwritten rather than NaN.
    pub fn check_kv_status(&self) -> Result<(), AttnError> {
        let Some(w) = self.kv_status.get() else {
            return Ok(()); // no device-checked call yet
        };
        let n = kernels_gpu::decode_abi::kv_status::WORDS;
        let words: Vec<u32> = match (&self.inner, &w.storage) {
            (Inner::Dev(d), IndexStorage::Dev(buf)) => {
                d.with(|dev| dev.synchronize())?;
                buf.read_bytes(4 * n)?.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            (Inner::Cuda(c), IndexStorage::Cuda(slice)) => {
                c.ctx.bind_to_thread().map_err(|e| cuda_err("binding the context", e))?;
                c.ctx.synchronize().map_err(|e| cuda_err("waiting for the KV-cache calls", e))?;
                c.ctx.default_stream().clone_dtoh(slice).map_err(|e| cuda_err("reading the KV status words", e))?
            }
            _ => unreachable!("the words are made on the kernels' own device"),
        };
        if words[0] == 0 {
            return Ok(());
        }
        match (&self.inner, &w.storage) {
            (Inner::Dev(_), IndexStorage::Dev(buf)) => buf.fill_u32(n as u64, 0)?,
            (Inner::Cuda(_), IndexStorage::Cuda(_)) => {
                // SAFETY: the words are ours (n u32 at w.ptr); the context is current and idle
                // (synchronised above), and the synchronous memset finishes before it returns.
                unsafe { sys::cuMemsetD32_v2(w.ptr, 0, n) }
                    .result()
                    .map_err(|e| cuda_err("clearing the KV status words", e))?;
            }
            _ => unreachable!("the words are made on the kernels' own device"),
        }
        Err(AttnError::KvCacheOnDevice { why: crate::attn::kvcache::status_rule(&words) })
    }

    /// `o = softmax(scale · q kᵀ [masked]) v` and `lse`, into buffers memattn allocates on the
    /// kernels' device (on CUDA: on q's stream). See the module docs for the semantics.
    pub fn flash_attn(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        opts: &AttnOpts<'_>,
    ) -> Result<(DeviceTensor, DeviceTensor), AttnError> {
        self.attn_alloc(q, k, v, opts, None)
    }

    /// [`Kernels::flash_attn`] and [`Kernels::flash_attn_varlen`]: validate, allocate, launch.
    fn attn_alloc(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        opts: &AttnOpts<'_>,
        varlen: Option<&VarlenArgs<'_>>,
    ) -> Result<(DeviceTensor, DeviceTensor), AttnError> {
        let [b, sq, h, d] = q.raw.shape;
        let o_shape = [b, sq, h, d];
        let lse_shape = [b, h, sq, 1];
        // Validate before allocating, so a refused call allocates nothing.
        let plan = self.plan(KernelKind::Flash, q, k, v, None, None, opts, varlen)?;
        let o_bytes = (b * sq * h * d) as u64 * q.raw.dtype.size_bytes();
        let lse_bytes = (b * h * sq) as u64 * 4;
        let (o, lse) = self.alloc_outputs(q, o_bytes, lse_bytes)?;
        let o = DeviceTensor { storage: o, dtype: q.raw.dtype, shape: o_shape };
        let lse = DeviceTensor { storage: lse, dtype: Dtype::F32, shape: lse_shape };
        let mut params = plan.params;
        params.o = o.ptr();
        params.lse = lse.ptr();
        params.o_strides = Strides::bshd(sq as u64, h as u64, d as u64);
        self.launch(&plan, &params, q.stream.as_deref())?;
        Ok((o, lse))
    }

    /// Two output buffers of `o_bytes` and `lse_bytes` on the kernels' device (on CUDA on q's
    /// stream, so they are freed in that stream's order).
    fn alloc_outputs(&self, q: &TensorView<'_>, o_bytes: u64, lse_bytes: u64) -> Result<(Storage, Storage), AttnError> {
        Ok(match &self.inner {
            Inner::Dev(_) => {
                let o = self.alloc(o_bytes)?;
                let lse = self.alloc(lse_bytes)?;
                (Storage::Dev(o), Storage::Dev(lse))
            }
            Inner::Cuda(_) => {
                let stream = q.stream.clone().ok_or_else(|| AttnError::WrongDevice {
                    tensor: "q",
                    got: "a raw view without a stream".into(),
                    expected: "a view made for a stream (the allocating call allocates on q's stream)".into(),
                })?;
                // Not memset: the kernels write every element of o and lse (a row that sees no
                // key gets o = 0 and lse = -inf), so zeroing would be a wasted pass over HBM.
                // SAFETY: the buffers are read only after the launch that fills them, on the
                // same stream.
                let alloc = |n: u64| {
                    unsafe { stream.alloc::<u8>(n.max(1) as usize) }.map_err(|e| cuda_err("allocating an output", e))
                };
                let (o, lse) = (alloc(o_bytes)?, alloc(lse_bytes)?);
                (Storage::Cuda { slice: o, stream: stream.clone() }, Storage::Cuda { slice: lse, stream })
            }
        })
    }

    /// As [`Kernels::flash_attn`], writing `o` and `lse` into the caller's buffers (the kernels
    /// always write LSE, as FlashAttention's forward does). On CUDA the launch is queued on the
    /// views' stream and the call returns without waiting. `o` and `lse` may not share memory
    /// with `q`, `k`, `v`, the sinks or each other, and `o` must map each element to its own
    /// address ([`AttnError::Aliasing`]).
    pub fn flash_attn_into(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        o: &mut TensorViewMut<'_>,
        lse: &mut LseViewMut<'_>,
        opts: &AttnOpts<'_>,
    ) -> Result<(), AttnError> {
        let outs = (&o.raw, o.stream.as_deref(), Some(lse.0.raw), lse.0.stream.as_deref());
        let plan = self.plan(KernelKind::Flash, q, k, v, Some(outs), None, opts, None)?;
        Self::check_forward_aliasing(q, k, v, &o.raw, &lse.0.raw, None, opts, None)?;
        self.launch(&plan, &plan.params, q.stream.as_deref())
    }

    /// Naive attention, for comparison: the three kernels that materialise the score matrix
    /// `S = scale · q kᵀ` (masked) in `scores`, softmax it in place (writing `lse`), then
    /// multiply by `v` into `o`. Same semantics, shapes, dtypes and options as
    /// [`Kernels::flash_attn_into`]; `scores` is a contiguous f32 workspace
    /// `[batch, heads, seq_q, seq_kv]` (varlen: the longest lengths), the `O(N²)` memory
    /// flash attention does without. Head dims 1 to 256; no tensor cores.
    #[allow(clippy::too_many_arguments)] // flash_attn_into's arguments plus the workspace
    pub fn naive_attn_into(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        o: &mut TensorViewMut<'_>,
        lse: &mut LseViewMut<'_>,
        scores: &mut TensorViewMut<'_>,
        opts: &AttnOpts<'_>,
    ) -> Result<(), AttnError> {
        let outs = (&o.raw, o.stream.as_deref(), Some(lse.0.raw), lse.0.stream.as_deref());
        let ws = (&scores.raw, scores.stream.as_deref());
        let plan = self.plan(KernelKind::Naive, q, k, v, Some(outs), Some(ws), opts, None)?;
        Self::check_forward_aliasing(q, k, v, &o.raw, &lse.0.raw, Some(&scores.raw), opts, None)?;
        self.launch(&plan, &plan.params, q.stream.as_deref())
    }

    /// [`Kernels::naive_attn_into`] over packed sequences (the arguments of
    /// [`Kernels::flash_attn_varlen_into`]); `scores` is `[batch, heads, max_seqlen_q,
    /// max_seqlen_k]` f32.
    #[allow(clippy::too_many_arguments)]
    pub fn naive_attn_varlen_into(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        cu_seqlens_q: &IndexTensor,
        cu_seqlens_k: &IndexTensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        o: &mut TensorViewMut<'_>,
        lse: &mut LseViewMut<'_>,
        scores: &mut TensorViewMut<'_>,
        opts: &AttnOpts<'_>,
    ) -> Result<(), AttnError> {
        let va = VarlenArgs { cu_q: cu_seqlens_q, cu_kv: cu_seqlens_k, max_q: max_seqlen_q, max_kv: max_seqlen_k };
        let outs = (&o.raw, o.stream.as_deref(), Some(lse.0.raw), lse.0.stream.as_deref());
        let ws = (&scores.raw, scores.stream.as_deref());
        let plan = self.plan(KernelKind::Naive, q, k, v, Some(outs), Some(ws), opts, Some(&va))?;
        Self::check_forward_aliasing(q, k, v, &o.raw, &lse.0.raw, Some(&scores.raw), opts, Some(&va))?;
        self.launch(&plan, &plan.params, q.stream.as_deref())
    }

    /// Attention over a batch of packed sequences of different lengths, FlashAttention-2's
    /// `flash_attn_varlen_func`: `q` is `[total_q, heads, head_dim]` and `k`, `v`
    /// `[total_kv, heads_kv, head_dim]`, viewed as batch 1 (`[1, total, heads, head_dim]`, any
    /// seq/head strides); sequence `b` is q rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` and k/v
    /// rows `cu_seqlens_k[b]..cu_seqlens_k[b + 1]`. Causal masks and windows apply within each
    /// sequence, bottom-right aligned to its own lengths. `max_seqlen_q` / `max_seqlen_k` bound
    /// the longest sequences (they size the grid, as in FlashAttention). Returns `o`
    /// `[1, total_q, heads, head_dim]` and `lse` `[heads, total_q]` (shape `[1, heads, total_q, 1]`).
    /// The cu_seqlens must start at 0, not decrease and end at the totals: each rule is an
    /// [`AttnError::SeqLens`]. Empty sequences are allowed and produce nothing.
    ///
    /// ```
    /// use memattn::attn::{AttnOpts, Kernels, TensorView};
    /// use memattn::Dtype;
    ///
    /// let kernels = Kernels::vm()?;
    /// let (h, d) = (2, 64);
    /// let lens = [5, 0, 11]; // three sequences, one empty
    /// let total: usize = lens.iter().sum();
    /// let cu = kernels.index_tensor(&[0, 5, 5, 16], None)?;
    /// let x: Vec<f32> = (0..total * h * d).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
    /// let buf = kernels.vm_upload(&x)?;
    /// let t = TensorView::vm(&buf, Dtype::F32, [1, total, h, d])?;
    /// let (o, lse) = kernels.flash_attn_varlen(&t, &t, &t, &cu, &cu, 11, 11, &AttnOpts::new().causal(true))?;
    /// let (o, lse) = (o.to_vec_f32()?, lse.to_vec_f32()?);
    /// // Row 5 starts the third sequence: causal, it sees only its own key, so o = v there.
    /// assert!((o[5 * h * d] - x[5 * h * d]).abs() < 1e-6);
    /// assert_eq!(lse.len(), h * total); // [heads, total_q]
    ///
    /// // A prefix sum that decreases is refused before anything runs.
    /// let bad = kernels.index_tensor(&[0, 5, 4, 16], None)?;
    /// let e = kernels.flash_attn_varlen(&t, &t, &t, &bad, &cu, 11, 11, &AttnOpts::new()).unwrap_err();
    /// assert!(e.to_string().contains("non-decreasing"), "{e}");
    /// # Ok::<(), memattn::attn::AttnError>(())
    /// ```
    #[allow(clippy::too_many_arguments)] // FlashAttention-2's signature
    pub fn flash_attn_varlen(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        cu_seqlens_q: &IndexTensor,
        cu_seqlens_k: &IndexTensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        opts: &AttnOpts<'_>,
    ) -> Result<(DeviceTensor, DeviceTensor), AttnError> {
        let va = VarlenArgs { cu_q: cu_seqlens_q, cu_kv: cu_seqlens_k, max_q: max_seqlen_q, max_kv: max_seqlen_k };
        self.attn_alloc(q, k, v, opts, Some(&va))
    }

    /// As [`Kernels::flash_attn_varlen`], into the caller's `o` (`[1, total_q, heads, head_dim]`)
    /// and `lse` ([`LseViewMut`] of batch 1, heads, total_q).
    #[allow(clippy::too_many_arguments)] // FlashAttention-2's signature plus the outputs
    pub fn flash_attn_varlen_into(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        cu_seqlens_q: &IndexTensor,
        cu_seqlens_k: &IndexTensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        o: &mut TensorViewMut<'_>,
        lse: &mut LseViewMut<'_>,
        opts: &AttnOpts<'_>,
    ) -> Result<(), AttnError> {
        let va = VarlenArgs { cu_q: cu_seqlens_q, cu_kv: cu_seqlens_k, max_q: max_seqlen_q, max_kv: max_seqlen_k };
        let outs = (&o.raw, o.stream.as_deref(), Some(lse.0.raw), lse.0.stream.as_deref());
        let plan = self.plan(KernelKind::Flash, q, k, v, Some(outs), None, opts, Some(&va))?;
        Self::check_forward_aliasing(q, k, v, &o.raw, &lse.0.raw, None, opts, Some(&va))?;
        self.launch(&plan, &plan.params, q.stream.as_deref())
    }

    /// Validates everything and builds the kernel parameters (outputs filled when given):
    /// the one validation of every prefill launch. `varlen`: packed sequences (`q`, `k`, `v` of
    /// batch 1, `[1, total, heads, d]`). `scores`: the naive kernels' S workspace.
    #[allow(clippy::too_many_arguments)]
    fn plan(
        &self,
        kind: KernelKind,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        outs: Option<Outputs<'_>>,
        scores: Option<(&RawView, Option<&CudaStream>)>,
        opts: &AttnOpts<'_>,
        varlen: Option<&VarlenArgs<'_>>,
    ) -> Result<Plan, AttnError> {
        opts.check_one_split()?;
        let window = opts.window_i32()?;
        let mut tensors: Vec<(&'static str, &RawView, Option<&CudaStream>)> = vec![
            ("q", &q.raw, q.stream.as_deref()),
            ("k", &k.raw, k.stream.as_deref()),
            ("v", &v.raw, v.stream.as_deref()),
        ];
        if let Some((o, os, _, _)) = &outs {
            tensors.push(("o", o, *os));
        }
        let lse_raw = outs.as_ref().and_then(|(_, _, l, ls)| l.as_ref().map(|l| (l, *ls)));
        if let Some((l, ls)) = &lse_raw {
            tensors.push(("lse", l, *ls));
        }
        if let Some(s) = opts.sinks {
            tensors.push(("sinks", &s.0.raw, s.0.stream.as_deref()));
        }
        if let Some(a) = opts.alibi_slopes {
            tensors.push(("alibi_slopes", a.raw(), a.stream()));
        }
        if let Some((s, ss)) = scores {
            tensors.push(("scores", s, ss));
        }
        self.check_places(&tensors, &q.raw)?;
        // Dtypes.
        let dtype = q.raw.dtype;
        for (name, t, _) in &tensors {
            let want = if matches!(*name, "lse" | "sinks" | "scores" | "alibi_slopes") { Dtype::F32 } else { dtype };
            if t.dtype != want {
                return Err(AttnError::Dtype { tensor: name, got: t.dtype, expected: want });
            }
        }
        // Shapes.
        let [b, sq, h, d] = q.raw.shape;
        let kh = k.raw.shape[2];
        for (name, t) in [("k", &k.raw), ("v", &v.raw)] {
            let [kb, _, th, kd] = t.shape;
            if kb != b {
                return Err(AttnError::Shape { tensor: name, got: t.shape, why: ShapeRule::Batch { got: kb, q: b } });
            }
            if kd != d {
                return Err(AttnError::Shape { tensor: name, got: t.shape, why: ShapeRule::HeadDim { got: kd, q: d } });
            }
            if th == 0 || !h.is_multiple_of(th) {
                return Err(AttnError::Shape {
                    tensor: name,
                    got: t.shape,
                    why: ShapeRule::HeadsDivide { got: th, q: h },
                });
            }
            if th != kh {
                return Err(AttnError::Shape {
                    tensor: name,
                    got: t.shape,
                    why: ShapeRule::KvHeads { got: th, k: kh },
                });
            }
        }
        if k.raw.shape[1] != v.raw.shape[1] {
            let what = if varlen.is_some() { "total_kv" } else { "seq_kv" };
            return Err(AttnError::Shape {
                tensor: "v",
                got: v.raw.shape,
                why: ShapeRule::SeqKv { what, got: v.raw.shape[1], k: k.raw.shape[1] },
            });
        }
        let skv = k.raw.shape[1];
        if let Some((o, ..)) = &outs
            && o.shape != q.raw.shape
        {
            return Err(AttnError::Shape {
                tensor: "o",
                got: o.shape,
                why: ShapeRule::Output { of: "q's", want: q.raw.shape },
            });
        }
        if let Some((l, _)) = &lse_raw
            && (l.shape != [b, h, sq, 1] || l.strides != contiguous([b, h, sq, 1]))
        {
            let why = ShapeRule::Lse { want: [b, h, sq], packed: varlen.is_some() };
            return Err(AttnError::Shape { tensor: "lse", got: l.shape, why });
        }
        if let Some(s) = opts.sinks
            && s.heads() != h
        {
            return Err(AttnError::Sinks { why: SinksRule::Count { got: s.heads(), heads: h } });
        }
        for (name, t, _) in &tensors {
            if t.strides[3] != 1 {
                return Err(AttnError::InnerStride { tensor: name, stride: t.strides[3] });
            }
        }
        let to_u32 = |tensor: &'static str, n: usize, what: &'static str| {
            u32::try_from(n).map_err(|_| AttnError::Shape {
                tensor,
                got: q.raw.shape,
                why: ShapeRule::OverLimit { what, got: n },
            })
        };
        // Varlen: `batch` sequences of at most max_seqlen rows, packed in one batch-1 tensor.
        let (batch, seq_q, seq_kv) = match varlen {
            None => (b, sq, skv),
            Some(va) => {
                if b != 1 {
                    return Err(AttnError::Shape { tensor: "q", got: q.raw.shape, why: ShapeRule::PackedBatch });
                }
                let nseq = self.check_varlen(va, &q.raw, sq, skv)?;
                (nseq, va.max_q.max(1), va.max_kv.max(1))
            }
        };
        let problem = Problem {
            batch: to_u32("q", batch, "batch")?,
            heads: to_u32("q", h, "heads")?,
            seq_q: to_u32("q", seq_q, "seq_q")?,
            seq_kv: to_u32("k", seq_kv, "seq_kv")?,
            head_dim: to_u32("q", d, "head_dim")?,
            dtype,
            causal: opts.causal,
            scale: opts.softmax_scale,
            layout: Layout::Bshd,
            heads_kv: Some(to_u32("k", kh, "heads")?),
            window,
            softcap: opts.softcap.unwrap_or(0.0),
            sinks: opts.sinks.is_some(),
            alibi: opts.alibi_slopes.is_some(),
            varlen: None,
        };
        let alibi = opts.alibi_slopes.map(|a| a.check(h, batch)).transpose()?;
        problem.validate(kind, &self.caps()?)?;
        let launches = problem.launches_on(kind, self.target()?)?;
        self.check_module(&launches.iter().map(|l| l.kernel).collect::<Vec<_>>())?;
        if let Some((s, _)) = scores {
            let want = [problem.batch as usize, h, problem.seq_q as usize, problem.seq_kv as usize];
            if s.shape != want || s.strides != contiguous(want) {
                return Err(AttnError::Shape { tensor: "scores", got: s.shape, why: ShapeRule::Scores { want } });
            }
        }
        // Bounds, then the tensor-core kernels' alignment.
        for (name, t, _) in &tensors {
            t.check_bounds(name)?;
        }
        if kind == KernelKind::Flash && dtype.is_16bit() {
            let entry = launches[0].kernel.name();
            for (name, t, _) in &tensors {
                let (need_ptr, need_label) = match *name {
                    "q" | "k" | "v" => (16, "16-byte aligned base pointers (cp.async copies 16-byte chunks)"),
                    "o" => (4, "a 4-byte aligned base pointer"),
                    _ => continue,
                };
                if !t.ptr.is_multiple_of(need_ptr) {
                    return Err(AttnError::Misaligned {
                        tensor: name,
                        what: "the base pointer",
                        got: format!("{:#x}", t.ptr),
                        entry,
                        need: need_label,
                    });
                }
                if *name != "o" {
                    for (i, what) in [(0, "the batch stride"), (1, "the seq stride"), (2, "the head stride")] {
                        if i == 0 && varlen.is_some() {
                            continue; // one packed batch: the batch stride is not used
                        }
                        if !t.strides[i].is_multiple_of(8) {
                            return Err(AttnError::Misaligned {
                                tensor: name,
                                what,
                                got: format!("{} elements", t.strides[i]),
                                entry,
                                need: "strides that are multiples of 8 elements (16 bytes)",
                            });
                        }
                    }
                }
            }
        }
        if let Some(s) = opts.sinks
            && !s.0.raw.ptr.is_multiple_of(4)
        {
            return Err(AttnError::Sinks { why: SinksRule::Misaligned { ptr: s.0.raw.ptr } });
        }
        let mut bufs = AttnBuffers {
            q: q.raw.ptr,
            k: k.raw.ptr,
            v: v.raw.ptr,
            q_strides: q.raw.kernel_strides(),
            k_strides: k.raw.kernel_strides(),
            v_strides: v.raw.kernel_strides(),
            sinks: opts.sinks.map_or(0, |s| s.0.raw.ptr),
            alibi_slopes: alibi.map_or(0, |a| a.0),
            alibi_batch_stride: alibi.map_or(0, |a| a.1),
            ..AttnBuffers::default()
        };
        if let Some(va) = varlen {
            bufs.cu_seqlens_q = va.cu_q.ptr;
            bufs.cu_seqlens_kv = va.cu_kv.ptr;
        }
        if let Some((o, _, l, _)) = outs {
            bufs.o = o.ptr;
            bufs.o_strides = o.kernel_strides();
            if let Some(l) = l {
                bufs.lse = l.ptr;
            }
        }
        bufs.scores = scores.map_or(0, |(s, _)| s.ptr);
        let mut params = problem.attn_params(&bufs);
        if varlen.is_some() {
            params.total_q = to_u32("q", sq, "total_q")?;
        }
        Ok(Plan { launches, params, total_kv: skv as u64 })
    }

    /// The aliasing rules of a forward call into caller buffers ([`alias`]): the written `o`,
    /// `lse` and naive `scores` against `q`, `k`, `v`, the sinks, the cu_seqlens and each other,
    /// and `o` one-to-one. Run after [`Self::plan`] checked the same views' bounds; not part of
    /// `plan`, which the backward also uses to validate its `o` and `lse`, there read only.
    #[allow(clippy::too_many_arguments)]
    fn check_forward_aliasing(
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        o: &RawView,
        lse: &RawView,
        scores: Option<&RawView>,
        opts: &AttnOpts<'_>,
        varlen: Option<&VarlenArgs<'_>>,
    ) -> Result<(), AttnError> {
        alias::check_injective("o", o)?;
        let mut extents = vec![
            alias::Extent::of_view("q", &q.raw, false),
            alias::Extent::of_view("k", &k.raw, false),
            alias::Extent::of_view("v", &v.raw, false),
            alias::Extent::of_view("o", o, true),
            alias::Extent::of_view("lse", lse, true),
        ];
        if let Some(s) = scores {
            extents.push(alias::Extent::of_view("scores", s, true));
        }
        if let Some(s) = opts.sinks {
            extents.push(alias::Extent::of_view("sinks", &s.0.raw, false));
        }
        if let Some(a) = opts.alibi_slopes {
            extents.push(alias::Extent::of_view("alibi_slopes", a.raw(), false));
        }
        if let Some(va) = varlen {
            extents.push(alias::Extent::of_index("cu_seqlens_q", va.cu_q));
            extents.push(alias::Extent::of_index("cu_seqlens_k", va.cu_kv));
        }
        alias::check_disjoint(&extents)
    }

    /// The cu_seqlens of a varlen call: on the kernels' device and q's stream, `batch + 1` prefix
    /// sums each (first 0, non-decreasing, ending at the packed tensors' totals), the longest
    /// sequences within `max_seqlen_*`. Returns the number of sequences.
    fn check_varlen(
        &self,
        va: &VarlenArgs<'_>,
        q: &RawView,
        total_q: usize,
        total_kv: usize,
    ) -> Result<usize, AttnError> {
        for (n, (name, cu, total, max)) in
            [("cu_seqlens_q", va.cu_q, total_q, va.max_q), ("cu_seqlens_k", va.cu_kv, total_kv, va.max_kv)]
                .into_iter()
                .enumerate()
        {
            self.check_index(name, cu, q)?;
            let bad = |why: SeqLensRule| AttnError::SeqLens { tensor: name, why };
            let values = cu.host_values(name)?;
            let lens = Varlen::lens_from_cu(values, name).map_err(bad)?;
            let last = *values.last().expect("lens_from_cu checked >= 2 entries") as usize;
            if last != total {
                let packed = if n == 0 { "q has" } else { "k and v have" };
                return Err(bad(SeqLensRule::LastSum { last, packed, total }));
            }
            let long = lens.iter().copied().max().unwrap_or(0) as usize;
            if long > max {
                let what = if n == 0 { "max_seqlen_q" } else { "max_seqlen_k" };
                return Err(bad(SeqLensRule::TooLong { rows: long, max_name: what, max }));
            }
        }
        if va.cu_q.len != va.cu_kv.len {
            return Err(AttnError::SeqLens {
                tensor: "cu_seqlens_k",
                why: SeqLensRule::Entries { got: va.cu_kv.len, q: va.cu_q.len },
            });
        }
        Ok(va.cu_q.len - 1)
    }

    /// An index tensor must live where the kernels run and be made for q's stream (its upload
    /// was queued there, so the launch is ordered after it).
    fn check_index(&self, name: &'static str, t: &IndexTensor, q: &RawView) -> Result<(), AttnError> {
        let ok = match (&self.inner, t.place) {
            (Inner::Dev(dev), Place::Dev { id, .. }) => dev.id == id,
            (Inner::Cuda(c), Place::Cuda { ctx, .. }) => ctx == c.ctx.cu_ctx() as usize,
            _ => false,
        };
        if !ok {
            return Err(AttnError::WrongDevice { tensor: name, got: t.place.to_string(), expected: self.place_name() });
        }
        if let (Place::Cuda { stream: s, .. }, Place::Cuda { stream: qs, .. }) = (t.place, q.place)
            && s != qs
        {
            return Err(AttnError::StreamMismatch { tensor: name, got: s, expected: qs });
        }
        Ok(())
    }

    /// Same device, same context, one stream: every tensor against the kernels and `q`.
    fn check_places(
        &self,
        tensors: &[(&'static str, &RawView, Option<&CudaStream>)],
        q: &RawView,
    ) -> Result<(), AttnError> {
        let expected = self.place_name();
        for (name, t, stream) in tensors {
            let same = match (&self.inner, t.place) {
                (Inner::Dev(dev), Place::Dev { id, .. }) => dev.id == id,
                (Inner::Cuda(c), Place::Cuda { ctx, .. }) => {
                    if let Some(s) = stream {
                        let sctx = s.context().cu_ctx() as usize;
                        if sctx != c.ctx.cu_ctx() as usize {
                            return Err(AttnError::StreamContext {
                                tensor: name,
                                got: sctx,
                                expected: c.ctx.cu_ctx() as usize,
                            });
                        }
                    }
                    ctx == c.ctx.cu_ctx() as usize
                }
                _ => false,
            };
            if !same {
                return Err(AttnError::WrongDevice { tensor: name, got: t.place.to_string(), expected });
            }
            if let (Place::Cuda { stream: s, .. }, Place::Cuda { stream: qs, .. }) = (t.place, q.place)
                && s != qs
            {
                return Err(AttnError::StreamMismatch { tensor: name, got: s, expected: qs });
            }
        }
        Ok(())
    }

    /// Device-backed kernels may have loaded another module than the embedded one (the
    /// command's `--ptx FILE`): its entries must have the tiles these launches were planned for.
    fn check_module(&self, ids: &[KernelId]) -> Result<(), AttnError> {
        if let Inner::Dev(dev) = &self.inner {
            dev.with(|d| d.check_tiles(ids))?;
        }
        Ok(())
    }

    /// The device's launch limits, for validation.
    fn caps(&self) -> Result<DeviceCaps, AttnError> {
        match &self.inner {
            Inner::Dev(v) => Ok(v.with(|d| d.caps())?),
            Inner::Cuda(c) => Ok(c.caps),
        }
    }

    fn launch(&self, plan: &Plan, params: &AttnParams, stream: Option<&CudaStream>) -> Result<(), AttnError> {
        let bytes = params.to_bytes();
        for l in &plan.launches {
            if let kernels_gpu::variants::Tile::FlashSm90(tile) = l.kernel.variant().tile {
                self.launch_sm90(l, tile, params, plan.total_kv, stream)?;
                continue;
            }
            self.launch_bytes(l.kernel, &l.dims, &bytes, stream)?;
        }
        Ok(())
    }

    /// One launch of the Hopper forward, the same on every kind of kernels: its three tensor
    /// maps encoded by the driver (or the VM), stored by a `tensor_maps_store` launch into this
    /// device's (or this stream's) slot, then the forward reading them there. Nothing is
    /// allocated (but the slot, once), freed, copied from the host or waited for: both are
    /// launches on `stream`, which orders them, and a CUDA graph captures the maps by value.
    fn launch_sm90(
        &self,
        l: &crate::problem::PlannedLaunch,
        tile: kernels_gpu::tiles::FlashSm90Tile,
        params: &AttnParams,
        total_kv: u64,
        stream: Option<&CudaStream>,
    ) -> Result<(), AttnError> {
        let maps = crate::tma::forward_maps(params, tile, total_kv);
        for m in &maps {
            m.check().map_err(|e| DeviceError::Unavailable(format!("a tensor map of `{}`: {e}", l.kernel.name())))?;
        }
        // The three maps' 384 bytes, each encoded by the device's own encoder.
        let encode_all = |enc: &mut dyn FnMut(&crate::tma::TensorMapDesc) -> Result<[u8; 128], DeviceError>| {
            let mut bytes = [0u8; 3 * 128];
            for (chunk, m) in bytes.chunks_exact_mut(128).zip(&maps) {
                chunk.copy_from_slice(&enc(m)?);
            }
            Ok::<_, DeviceError>(bytes)
        };
        let (slot, bytes) = match &self.inner {
            Inner::Dev(v) => v.with(|d| {
                let bytes = encode_all(&mut |m| d.encode_tensor_map(m))?;
                let mut slot = v.maps.lock().unwrap_or_else(|e| e.into_inner());
                let p = match *slot {
                    Some(p) => p,
                    None => *slot.insert(d.alloc(bytes.len() as u64)?),
                };
                Ok((p, bytes))
            })?,
            Inner::Cuda(c) => {
                let stream = Self::launch_stream(stream)?;
                c.ctx.bind_to_thread().map_err(|e| cuda_err("binding the context", e))?;
                let bytes = encode_all(&mut |m| crate::device::cuda::encode_tensor_map(m))?;
                let mut slots = c.maps.lock().unwrap_or_else(|e| e.into_inner());
                let p = match slots.entry(stream.cu_stream() as usize) {
                    std::collections::hash_map::Entry::Occupied(e) => *e.get(),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        // SAFETY: an allocation in the bound context, freed when the kernels drop.
                        let p = unsafe { cudarc::driver::result::malloc_sync(bytes.len()) }
                            .map_err(|e| cuda_err("cuMemAlloc (the Hopper forward's tensor-map slot)", e))?;
                        *e.insert(p)
                    }
                };
                (p, bytes)
            }
        };
        let store = kernels_gpu::abi::TensorMapsParams::new(slot, &bytes);
        self.launch_bytes(
            KernelId::TensorMapsStore,
            &kernels_gpu::tiles::tensor_maps_store_launch(),
            &store.to_bytes(),
            stream,
        )?;
        let p = kernels_gpu::abi::Sm90Params { attn: *params, tensor_maps: slot };
        self.launch_bytes(l.kernel, &l.dims, &p.to_bytes(), stream)
    }

    /// The stream of a launch on CUDA kernels (views made for a stream carry it).
    fn launch_stream(stream: Option<&CudaStream>) -> Result<&CudaStream, AttnError> {
        stream.ok_or_else(|| AttnError::WrongDevice {
            tensor: "q",
            got: "a raw view without a stream".into(),
            expected: "a view made for a stream".into(),
        })
    }

    /// Launches `kernel` with its one by-value parameter struct `bytes` (a multiple of 8 bytes),
    /// from the module it is in.
    fn launch_bytes(
        &self,
        kernel: KernelId,
        dims: &kernels_gpu::tiles::LaunchDims,
        bytes: &[u8],
        stream: Option<&CudaStream>,
    ) -> Result<(), AttnError> {
        let info = match &self.inner {
            Inner::Dev(v) => v.with(|d| d.launch(kernel.name(), dims, &[bytes]))?,
            Inner::Cuda(c) => {
                let stream = Self::launch_stream(stream)?;
                c.ctx.bind_to_thread().map_err(|e| cuda_err("binding the context", e))?;
                if kernel.variant().module() == kernels_gpu::variants::PtxModule::Sm90a {
                    let mut m = c.module_sm90.lock().unwrap_or_else(|e| e.into_inner());
                    if m.is_none() {
                        if c.target.arch != crate::choice::Arch::Sm90 {
                            return Err(DeviceError::Unavailable(format!(
                                "`{}` is in the sm_90a module, which only compute capability 9.0 loads (this context: {})",
                                kernel.name(),
                                c.target.arch
                            ))
                            .into());
                        }
                        *m = Some(CudaModule::load(&PtxSource::embedded_sm90())?);
                    }
                    let module = m.as_ref().expect("loaded above");
                    // SAFETY: as below.
                    unsafe { module.launch(kernel.name(), dims, &[bytes], stream.cu_stream()) }?;
                } else {
                    // SAFETY: `bytes` is the one parameter struct the kernel declares; every
                    // pointer in it was validated by the caller (device, bounds, alignment) and
                    // its buffers are borrowed for the call; the stream belongs to `c.ctx`
                    // (checked when the views were made), which is current.
                    unsafe { c.module.launch(kernel.name(), dims, &[bytes], stream.cu_stream()) }?;
                }
                LaunchInfo::default()
            }
        };
        if let Some(log) = self.log().as_mut() {
            log.push(Launched { kernel, dims: *dims, info });
        }
        Ok(())
    }
}

/// The packed-sequence arguments of [`Kernels::flash_attn_varlen`].
struct VarlenArgs<'a> {
    cu_q: &'a IndexTensor,
    cu_kv: &'a IndexTensor,
    max_q: usize,
    max_kv: usize,
}

/// u32 indices on the kernels' device, usually with a host copy of their values: `cu_seqlens`,
/// `cache_seqlens`, block tables. Validation reads the host copy, so a call checks every index
/// before its launch without reading device memory back (no synchronisation); the device copy
/// is what the kernels read. Make one per batch with [`Kernels::index_tensor`] and reuse it for
/// every layer. The values cannot change after it is made.
///
/// Without a host copy ([`IndexTensor::device_only`], [`Kernels::index_tensor_from_cuda`]) the
/// KV-cache calls check the indices on the device instead (docs/semantics.md, "Indices checked
/// on the device"): the values may then be whatever the device holds at the launch, and a
/// violation surfaces at [`Kernels::check_kv_status`].
pub struct IndexTensor {
    /// The host copy; empty when `host` is false.
    values: Vec<u32>,
    len: usize,
    host: bool,
    ptr: u64,
    place: Place,
    _storage: IndexStorage,
}

#[allow(dead_code)] // owns the device memory the pointer refers to
enum IndexStorage {
    Dev(DeviceBuffer),
    Cuda(CudaSlice<u32>),
}

impl fmt::Debug for IndexTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.host {
            true => write!(f, "IndexTensor({:?} at {:#x} on {})", self.values, self.ptr, self.place),
            false => {
                write!(f, "IndexTensor({} values on the device only at {:#x} on {})", self.len, self.ptr, self.place)
            }
        }
    }
}

impl IndexTensor {
    /// The values (the host copy), `None` for a device-only tensor.
    pub fn values(&self) -> Option<&[u32]> {
        self.host.then_some(&self.values[..])
    }
    /// Entries.
    pub fn len(&self) -> usize {
        self.len
    }
    /// No entries.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The same device copy without its host copy: a KV-cache call given it checks the indices
    /// on the device (what a tensor the host never saw gets; useful to test that path).
    pub fn device_only(mut self) -> IndexTensor {
        self.values = Vec::new();
        self.host = false;
        self
    }
    /// Whether the values are known on the host.
    pub fn has_host_values(&self) -> bool {
        self.host
    }
    /// The host copy, or [`AttnError::NoHostValues`] naming `tensor`.
    pub(crate) fn host_values(&self, tensor: &'static str) -> Result<&[u32], AttnError> {
        self.values().ok_or(AttnError::NoHostValues { tensor })
    }
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// `o` and its stream, `lse` and its stream, as [`Kernels::plan`] checks them.
type Outputs<'a> = (&'a RawView, Option<&'a CudaStream>, Option<RawView>, Option<&'a CudaStream>);

struct Plan {
    /// One for the flash kernels, three for the naive ones (same parameters).
    launches: Vec<crate::problem::PlannedLaunch>,
    params: AttnParams,
    /// K's rows (varlen: the packed total), for the Hopper forward's tensor maps.
    total_kv: u64,
}
