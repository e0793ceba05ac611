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
    /// A size of the call is 0.
    #[error(
        "batch, heads, heads_kv, seq_q and head_dim must be >= 1 (got {}, {}, {}, {}, {})",
        sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]
    )]
    Empty {
        /// The sizes `[batch, heads, heads_kv, seq_q, head_dim]` as given.
        sizes: [u32; 5],
    },
    /// The query heads are not a multiple of the KV heads.
    #[error(
        "mismatched heads: heads ({heads}) must be a multiple of heads_kv ({heads_kv}) (GQA: query head h reads KV head h / (heads / heads_kv))"
    )]
    Heads {
        /// Query heads.
        heads: u32,
        /// KV heads of the cache.
        heads_kv: u32,
    },
    /// `cache_seqlens` does not have one entry per sequence.
    #[error("cache_seqlens has {got} entries, batch is {batch}: one length per sequence")]
    SeqLensEntries {
        /// Entries of `cache_seqlens`.
        got: usize,
        /// Sequences in the batch.
        batch: u32,
    },
    /// The page size of a paged cache is 0.
    #[error("page_size must be >= 1 (0 keys per page)")]
    PageSizeZero,
    /// A sequence's cached plus new tokens reach 2^31.
    #[error("cache_seqlens + new tokens must be below 2^31")]
    TooLong,
    /// A tensor of the call whose size does not fit: its elements (computed in 128 bits) and the
    /// limit it is over.
    #[error("tensor `{tensor}` would have {elems} elements, over the limit of {limit}")]
    TooLarge {
        /// The tensor's name.
        tensor: &'static str,
        /// Its elements.
        elems: u128,
        /// The most elements allowed.
        limit: u64,
    },
    /// A sliding-window side below -1.
    #[error("window ({left}, {right}): each side must be >= 0 keys, or -1 for unbounded")]
    Window {
        /// Keys to the left of the query (-1: unbounded).
        left: i32,
        /// Keys to the right of the query (-1: unbounded).
        right: i32,
    },
    /// A soft cap that is negative or not finite.
    #[error("softcap {got} must be >= 0 (0 turns it off)")]
    Softcap {
        /// The soft cap given.
        got: f32,
    },
    /// The multiprocessor count the split plan assumes is 0.
    #[error("sm_count (the multiprocessors the split plan assumes) must be >= 1")]
    SmCount,
    /// A softmax scale that is not finite.
    #[error("softmax scale {got} must be finite")]
    Scale {
        /// The scale given.
        got: f32,
    },
    /// The tensor-core decode kernel was asked for a dtype other than bf16 or f16.
    #[error("the tensor-core decode kernel (DecodeKernel::Mma) takes bf16 or f16, not {dtype} (choose Simt or Auto)")]
    MmaDtype {
        /// The dtype of the call.
        dtype: Dtype,
    },
    /// The prefill kernel (chunked prefill over the cache) was asked for a call it cannot run.
    #[error(
        "the prefill kernel (DecodeKernel::Prefill: the tensor-core forward reading the cache) {why} (choose Mma, Simt or Auto)"
    )]
    PrefillUnsupported {
        /// What the prefill kernel cannot do, as a phrase for the message.
        why: &'static str,
    },
    /// No decode kernel is compiled for the head dim.
    #[error(
        "head_dim {head_dim}: the {dtype} decode kernels are compiled for head_dim {}; {} (not over an FP8 cache)",
        crate::problem::list_and(compiled),
        crate::problem::PADDED_HEAD_DIMS
    )]
    HeadDim {
        /// The head dim of the call.
        head_dim: u32,
        /// The dtype of the call.
        dtype: Dtype,
        /// The head dims the decode kernels of that dtype are compiled for.
        compiled: Vec<u32>,
    },
    /// A sequence's cached plus new tokens do not fit in a contiguous cache.
    #[error(
        "cache_seqlens[{batch}] + new tokens = {cache_seqlen} + {new} exceeds the cache's {seq_cache} keys per sequence"
    )]
    Capacity {
        /// The sequence's index in the batch.
        batch: usize,
        /// Its `cache_seqlens` entry (keys already cached).
        cache_seqlen: u32,
        /// New tokens appended to it.
        new: u32,
        /// Keys per sequence the cache holds.
        seq_cache: u32,
    },
    /// A slot tensor (`cache_batch_idx` or `cache_leftpad`) given with a block table.
    #[error(
        "{tensor} applies to a contiguous cache only (as in FlashAttention-2): with a block table, the table places each sequence's keys"
    )]
    SlotsWithPages {
        /// The slot tensor's name.
        tensor: &'static str,
    },
    /// A per-sequence tensor does not have one entry per sequence.
    #[error("{tensor} has {got} entries, batch is {batch}: one per sequence")]
    SlotEntries {
        /// The tensor's name.
        tensor: &'static str,
        /// Its entries.
        got: usize,
        /// Sequences in the batch.
        batch: u32,
    },
    /// A sequence's `cache_leftpad` is past its `cache_seqlens`.
    #[error(
        "cache_leftpad[{batch}] = {leftpad} is past cache_seqlens[{batch}] = {cache_seqlen}: a sequence's keys are cache rows cache_leftpad .. cache_seqlens + new tokens"
    )]
    LeftpadPastSeqlen {
        /// The sequence's index in the batch.
        batch: usize,
        /// Its `cache_leftpad` entry (first cache row of the sequence).
        leftpad: u32,
        /// Its `cache_seqlens` entry.
        cache_seqlen: u32,
    },
    /// A `cache_batch_idx` entry past the cache's slots.
    #[error("cache_batch_idx[{batch}] = {slot} is past the cache's {slots} slots (its first dimension)")]
    SlotPastEnd {
        /// The sequence's index in the batch.
        batch: usize,
        /// The slot it names.
        slot: u32,
        /// Slots in the cache (its first dimension).
        slots: u32,
    },
    /// Two sequences name the same cache slot while new tokens are written into it.
    #[error(
        "cache_batch_idx names slot {slot} for sequences {first} and {second} while new tokens are appended: both would write its rows"
    )]
    SharedSlot {
        /// The shared slot.
        slot: u32,
        /// The first sequence (batch index) that names it.
        first: usize,
        /// The second sequence (batch index) that names it.
        second: usize,
    },
    /// A rotary dim that is odd, below 2 or over the head dim.
    #[error("rotary_dim {dim}: it must be even, at least 2 and at most head_dim {head_dim}")]
    RotaryDim {
        /// The rotary dim given.
        dim: u32,
        /// The head dim of the call.
        head_dim: u32,
    },
    /// Rotary tables given without new keys and values to rotate.
    #[error(
        "rotary embedding needs new tokens to append (k_new, v_new), as in FlashAttention-2: the cached keys are already rotated"
    )]
    RotaryWithoutNewTokens,
    /// No rotary kernel for the dtype (FP8).
    #[error("there is no rotary kernel for {dtype} (f32, bf16 and f16 have one)")]
    RotaryDtype {
        /// The dtype of the call.
        dtype: Dtype,
    },
    /// The rotary cos/sin tables are too short or of mismatched shapes.
    #[error(
        "rotary tables have {rows} rows of {half} (cos {cos_shape:?}, sin {sin_shape:?}); the call needs [{need}, {half}]: one row per position up to the last rotated token"
    )]
    RotaryTables {
        /// Rows (positions) of the tables.
        rows: usize,
        /// Columns of a row (half the rotary dim).
        half: usize,
        /// Rows the call needs (one past the last rotated position).
        need: u32,
        /// The shape of the cos table.
        cos_shape: [usize; 4],
        /// The shape of the sin table.
        sin_shape: [usize; 4],
    },
    /// The block table does not have `batch * max_pages` entries.
    #[error("block_table has {got} entries, [batch, max_pages] = [{batch}, {max_pages}] needs {need}")]
    BlockTableSize {
        /// Entries of the block table.
        got: usize,
        /// Sequences in the batch.
        batch: u32,
        /// Pages per sequence of the table.
        max_pages: u32,
        /// Entries needed (`batch * max_pages`).
        need: u64,
    },
    /// A sequence's cached plus new tokens need more pages than the block table has per sequence.
    #[error(
        "cache_seqlens[{batch}] + new tokens = {cache_seqlen} + {new} needs {need} pages of {page_size}, the block table has {max_pages} per sequence"
    )]
    Pages {
        /// The sequence's index in the batch.
        batch: usize,
        /// Its `cache_seqlens` entry (keys already cached).
        cache_seqlen: u32,
        /// New tokens appended to it.
        new: u32,
        /// Pages it needs.
        need: u32,
        /// Keys per page.
        page_size: u32,
        /// Pages per sequence of the block table.
        max_pages: u32,
    },
    /// A block-table entry names a page past the cache's pages.
    #[error(
        "block_table[{batch}][{slot}] = {page} is past num_pages ({num_pages}): every page a sequence uses must be < num_pages"
    )]
    PagePastEnd {
        /// The sequence's index in the batch.
        batch: usize,
        /// The entry's index in the sequence's row of the table.
        slot: usize,
        /// The page it names.
        page: u32,
        /// Pages in the cache.
        num_pages: u32,
    },
    /// A page that receives new tokens appears more than once in the block table.
    #[error(
        "page {page} receives appended tokens and is in more than one block-table entry: duplicate pages are allowed only for pages that are read, not written"
    )]
    SharedWrittenPage {
        /// The page.
        page: u32,
    },
    /// The block table's entries are not a positive multiple of the batch.
    #[error("block_table has {entries} entries: it must be [batch, max_pages] = {batch} x max_pages >= 1")]
    BlockTableShape {
        /// Entries of the block table.
        entries: usize,
        /// Sequences in the batch.
        batch: usize,
    },
    /// Only one of the new keys and new values is given.
    #[error("{missing} is missing while {given} is given (new keys and values come together)")]
    NewTokensPair {
        /// The name of the tensor missing.
        missing: &'static str,
        /// The name of the tensor given.
        given: &'static str,
    },
    /// A run gives new tokens when its plan was made without them, or the other way round.
    #[error(
        "the plan was made {} new tokens; this run gives {}",
        if *planned { "with" } else { "without" },
        if *given { "some" } else { "none" }
    )]
    PlanNewTokens {
        /// Whether the plan was made with new tokens.
        planned: bool,
        /// Whether the run gives new tokens.
        given: bool,
    },
    /// An FP8 cache with q, o, k_new or v_new not in bf16.
    #[error("an FP8 KV cache takes bf16 q, o, k_new and v_new, not {dtype}")]
    Fp8Dtype {
        /// The dtype given.
        dtype: Dtype,
    },
    /// An FP8 scale that is not finite or lies outside [`MIN_FP8_SCALE`] ..= [`MAX_FP8_SCALE`].
    #[error(
        "FP8 {tensor}[{index}] = {got:e}: a scale must be finite and between {min:e} (f32's smallest normal) and {max:e} (so that the largest code times the scale, and the kernels' 2^8 factor, stay finite in f32)",
        min = MIN_FP8_SCALE,
        max = MAX_FP8_SCALE
    )]
    Fp8Scale {
        /// The scale tensor's name.
        tensor: &'static str,
        /// The scale's index in it.
        index: usize,
        /// The scale.
        got: f32,
    },
    /// A scale tensor of the wrong length, or scales for a cache that is not FP8.
    #[error(
        "{tensor} has {got} scales: {}",
        if *fp8 { format!("an FP8 cache takes 1 (per tensor) or heads_kv = {heads_kv} (per KV head)") } else { "only an FP8 cache takes scales".to_string() }
    )]
    Fp8ScaleCount {
        /// The scale tensor's name.
        tensor: &'static str,
        /// Its scales.
        got: usize,
        /// KV heads of the cache (the per-head length).
        heads_kv: usize,
        /// Whether the cache is FP8.
        fp8: bool,
    },
    /// A run's cache is FP8 when its plan's was not, or the other way round.
    #[error("the plan was made for {} cache; this run gives {}", if *planned { "an FP8" } else { "a non-FP8" }, if *planned { "another" } else { "an FP8 one" })]
    Fp8Plan {
        /// Whether the plan was made for an FP8 cache.
        planned: bool,
    },
    /// A shared-prefix call ([`crate::attn::Kernels::flash_attn_with_shared_prefix_into`]):
    /// the prefix K or V is not `[1, prefix_len >= 1, heads_kv, head_dim]` of the suffix cache.
    #[error(
        "{tensor} must be [1, prefix_len >= 1, heads_kv, head_dim] = [1, _, {heads_kv}, {head_dim}] with heads_kv and head_dim those of the suffix cache (got {got:?})"
    )]
    SharedPrefixShape {
        /// `prefix_k` or `prefix_v`.
        tensor: &'static str,
        /// Its shape.
        got: [usize; 4],
        /// KV heads of the suffix cache.
        heads_kv: usize,
        /// The head dim of q.
        head_dim: usize,
    },
    /// A shared-prefix call was given an option it does not take (the prefix is attended in
    /// one launch for every request, so per-request positions do not reach it).
    #[error("a shared-prefix call does not take {option} (docs/semantics.md, \"Shared prefix\")")]
    SharedPrefixOption {
        /// The option.
        option: &'static str,
    },
    /// A shared prefix of a decode problem ([`crate::decode::SharedPrefix::split`]) that is 0 or
    /// longer than a sequence's cached keys, or a problem it cannot be split from.
    #[error(
        "shared prefix of {prefix} keys: {}",
        if *prefix == 0 { "it must be at least 1".to_string() } else { format!("sequence {batch} caches only {cache_seqlen} keys (the prefix is the first keys of every sequence's cache, so it is at most the shortest cache length)") }
    )]
    SharedPrefixLength {
        /// The prefix's keys.
        prefix: u32,
        /// The first sequence that caches fewer keys.
        batch: usize,
        /// Its cached keys.
        cache_seqlen: u32,
    },
    /// A causal shared-prefix call where a query row would not see the whole prefix: every
    /// sequence needs at least `seq_q - 1` suffix keys (cached plus new).
    #[error(
        "sequence {batch} has {suffix_keys} suffix keys (cached + new) for {seq_q} query tokens: causal shared-prefix attention needs at least seq_q - 1 = {} so that every query row sees the whole prefix",
        seq_q - 1
    )]
    SharedPrefixCausal {
        /// The sequence.
        batch: usize,
        /// Its suffix keys.
        suffix_keys: u32,
        /// Query tokens per sequence.
        seq_q: u32,
    },
    /// The device-side check reported a status code this library does not know.
    #[error(
        "the device-side index check reported status code {code} (words {words:?}), which this library does not know"
    )]
    StatusCode {
        /// The status code (the first word).
        code: u32,
        /// All the status words.
        words: Vec<u32>,
    },
}
