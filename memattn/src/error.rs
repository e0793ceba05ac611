//! The error of the library's lower layers: the decode plan and the device calls under
//! [`crate::attn`] (whose own calls return [`crate::attn::AttnError`]).

use crate::device::DeviceError;
use crate::dtype::Dtype;
use crate::problem::ProblemError;

/// Why a plan or a device call was refused or failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Shape, dtype, head dim or launch limits of a problem.
    #[error("invalid problem: {0}")]
    Problem(#[from] ProblemError),
    /// A rule of the call (named in the message) that the inputs break.
    #[error("{0}")]
    Usage(String),
    /// The device or the VM failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A rule of a KV-cache call (see [`KvCacheRule`]).
    #[error(transparent)]
    KvCache(#[from] KvCacheRule),
}

/// The smallest FP8 cache scale: f32's smallest normal (below it a scaled code is subnormal, and
/// the kernels flush subnormals to zero: a cache read as zeros).
pub const MIN_FP8_SCALE: f32 = f32::MIN_POSITIVE;
/// The largest FP8 cache scale: the largest code of either format (e5m2's 57344) times the scale
/// times the tensor-core kernels' 2^8 (e4m3 read as f16 is the value times 2^-8) stays below
/// f32's largest, with room (2.3e31 would be the limit).
pub const MAX_FP8_SCALE: f32 = 2.0e31;
const _: () = assert!(MAX_FP8_SCALE * 57344.0 * 256.0 < f32::MAX);

/// A rule of a KV-cache (decode) call that the problem breaks: shape, capacity, block table,
/// kernel choice. `Display` names the rule and the values.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum KvCacheRule {
    #[error(
        "batch, heads, heads_kv, seq_q and head_dim must be >= 1 (got {}, {}, {}, {}, {})",
        sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]
    )]
    Empty { sizes: [u32; 5] },
    #[error(
        "mismatched heads: heads ({heads}) must be a multiple of heads_kv ({heads_kv}) (GQA: query head h reads KV head h / (heads / heads_kv))"
    )]
    Heads { heads: u32, heads_kv: u32 },
    #[error("cache_seqlens has {got} entries, batch is {batch}: one length per sequence")]
    SeqLensEntries { got: usize, batch: u32 },
    #[error("page_size must be >= 1 (0 keys per page)")]
    PageSizeZero,
    #[error("cache_seqlens + new tokens must be below 2^31")]
    TooLong,
    /// A tensor of the call whose size does not fit: its elements (computed in 128 bits) and the
    /// limit it is over.
    #[error("tensor `{tensor}` would have {elems} elements, over the limit of {limit}")]
    TooLarge { tensor: &'static str, elems: u128, limit: u64 },
    #[error("window ({left}, {right}): each side must be >= 0 keys, or -1 for unbounded")]
    Window { left: i32, right: i32 },
    #[error("softcap {got} must be >= 0 (0 turns it off)")]
    Softcap { got: f32 },
    #[error("sm_count (the multiprocessors the split plan assumes) must be >= 1")]
    SmCount,
    #[error("softmax scale {got} must be finite")]
    Scale { got: f32 },
    #[error("the tensor-core decode kernel (DecodeKernel::Mma) takes bf16 or f16, not {dtype} (choose Simt or Auto)")]
    MmaDtype { dtype: Dtype },
    /// The prefill kernel (chunked prefill over the cache) was asked for a call it cannot run.
    #[error(
        "the prefill kernel (DecodeKernel::Prefill: the tensor-core forward reading the cache) {why} (choose Mma, Simt or Auto)"
    )]
    PrefillUnsupported { why: &'static str },
    #[error(
        "head_dim {head_dim}: the {dtype} decode kernels are compiled for head_dim {}; {} (not over an FP8 cache)",
        crate::problem::list_and(compiled),
        crate::problem::PADDED_HEAD_DIMS
    )]
    HeadDim { head_dim: u32, dtype: Dtype, compiled: Vec<u32> },
    #[error(
        "cache_seqlens[{batch}] + new tokens = {cache_seqlen} + {new} exceeds the cache's {seq_cache} keys per sequence"
    )]
    Capacity { batch: usize, cache_seqlen: u32, new: u32, seq_cache: u32 },
    #[error(
        "{tensor} applies to a contiguous cache only (as in FlashAttention-2): with a block table, the table places each sequence's keys"
    )]
    SlotsWithPages { tensor: &'static str },
    #[error("{tensor} has {got} entries, batch is {batch}: one per sequence")]
    SlotEntries { tensor: &'static str, got: usize, batch: u32 },
    #[error(
        "cache_leftpad[{batch}] = {leftpad} is past cache_seqlens[{batch}] = {cache_seqlen}: a sequence's keys are cache rows cache_leftpad .. cache_seqlens + new tokens"
    )]
    LeftpadPastSeqlen { batch: usize, leftpad: u32, cache_seqlen: u32 },
    #[error("cache_batch_idx[{batch}] = {slot} is past the cache's {slots} slots (its first dimension)")]
    SlotPastEnd { batch: usize, slot: u32, slots: u32 },
    #[error(
        "cache_batch_idx names slot {slot} for sequences {first} and {second} while new tokens are appended: both would write its rows"
    )]
    SharedSlot { slot: u32, first: usize, second: usize },
    #[error("rotary_dim {dim}: it must be even, at least 2 and at most head_dim {head_dim}")]
    RotaryDim { dim: u32, head_dim: u32 },
    #[error(
        "rotary embedding needs new tokens to append (k_new, v_new), as in FlashAttention-2: the cached keys are already rotated"
    )]
    RotaryWithoutNewTokens,
    #[error("there is no rotary kernel for {dtype} (f32, bf16 and f16 have one)")]
    RotaryDtype { dtype: Dtype },
    #[error(
        "rotary tables have {rows} rows of {half} (cos {cos_shape:?}, sin {sin_shape:?}); the call needs [{need}, {half}]: one row per position up to the last rotated token"
    )]
    RotaryTables { rows: usize, half: usize, need: u32, cos_shape: [usize; 4], sin_shape: [usize; 4] },
    #[error("block_table has {got} entries, [batch, max_pages] = [{batch}, {max_pages}] needs {need}")]
    BlockTableSize { got: usize, batch: u32, max_pages: u32, need: u64 },
    #[error(
        "cache_seqlens[{batch}] + new tokens = {cache_seqlen} + {new} needs {need} pages of {page_size}, the block table has {max_pages} per sequence"
    )]
    Pages { batch: usize, cache_seqlen: u32, new: u32, need: u32, page_size: u32, max_pages: u32 },
    #[error(
        "block_table[{batch}][{slot}] = {page} is past num_pages ({num_pages}): every page a sequence uses must be < num_pages"
    )]
    PagePastEnd { batch: usize, slot: usize, page: u32, num_pages: u32 },
    #[error(
        "page {page} receives appended tokens and is in more than one block-table entry: duplicate pages are allowed only for pages that are read, not written"
    )]
    SharedWrittenPage { page: u32 },
    #[error("block_table has {entries} entries: it must be [batch, max_pages] = {batch} x max_pages >= 1")]
    BlockTableShape { entries: usize, batch: usize },
    #[error("{missing} is missing while {given} is given (new keys and values come together)")]
    NewTokensPair { missing: &'static str, given: &'static str },
    #[error(
        "the plan was made {} new tokens; this run gives {}",
        if *planned { "with" } else { "without" },
        if *given { "some" } else { "none" }
    )]
    PlanNewTokens { planned: bool, given: bool },
    #[error("an FP8 KV cache takes bf16 q, o, k_new and v_new, not {dtype}")]
    Fp8Dtype { dtype: Dtype },
    #[error(
        "FP8 {tensor}[{index}] = {got:e}: a scale must be finite and between {min:e} (f32's smallest normal) and {max:e} (so that the largest code times the scale, and the kernels' 2^8 factor, stay finite in f32)",
        min = MIN_FP8_SCALE,
        max = MAX_FP8_SCALE
    )]
    Fp8Scale { tensor: &'static str, index: usize, got: f32 },
    #[error(
        "{tensor} has {got} scales: {}",
        if *fp8 { format!("an FP8 cache takes 1 (per tensor) or heads_kv = {heads_kv} (per KV head)") } else { "only an FP8 cache takes scales".to_string() }
    )]
    Fp8ScaleCount { tensor: &'static str, got: usize, heads_kv: usize, fp8: bool },
    #[error("the plan was made for {} cache; this run gives {}", if *planned { "an FP8" } else { "a non-FP8" }, if *planned { "another" } else { "an FP8 one" })]
    Fp8Plan { planned: bool },
    #[error(
        "the device-side index check reported status code {code} (words {words:?}), which this library does not know"
    )]
    StatusCode { code: u32, words: Vec<u32> },
}
