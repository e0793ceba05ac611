//! KV-cache decode: split-KV attention (flash-decoding) over a contiguous or paged cache, the
//! cache append, the combine (`merge_states`), the split plan and the f64 reference. The
//! library's [`crate::attn::Kernels::flash_attn_with_kvcache`] launches this plan.
//!
//! Semantics follow FlashAttention-2's `flash_attn_with_kvcache` (see [`kernels_gpu::decode_abi`]
//! for the layouts): `cache_seqlens[b]` keys are in the cache before the call; `k_new`, `v_new`
//! (`seq_new` tokens) are appended at `cache_seqlens[b]` before attention, so sequence `b` attends
//! over `seqlen_k = cache_seqlens[b] + seq_new` keys; GQA query head `h` reads KV head `h /
//! (heads / heads_kv)`; `window_left`/`window_right` limit a query to keys around its diagonal
//! (FlashAttention-2's `window_size`, `-1` unbounded); causal is bottom-right aligned (query `i` sees key `j <= i + seqlen_k -
//! seq_q`); a row that sees nothing gives `O = 0`, `LSE = -inf`; LSE is natural log.
//!
//! A plan, then a run: [`DecodeProblem::plan`] fixes the split count once (printed by the CLI);
//! a run (the library's [`crate::attn::Kernels::flash_attn_with_kvcache`], or the `memattn decode`
//! command) launches `decode_append` (when there are new tokens), `decode_fwd` and, with
//! more than one split, `merge_states`.
//!
//! **Reproducibility.** Runs are bit-reproducible (no atomics; every sum has a fixed order). A
//! sequence's output depends on its own keys and the split count only (split `s` covers whole
//! key tiles `[s * tps, (s + 1) * tps)` of its own length), so with `--splits N` it is
//! batch-invariant: the same sequence gives the same bits in any batch. `--splits auto` picks the
//! count from the batch and head count, so its output can change (within rounding) with the batch.
//!
//! **Block tables.** Entries past a sequence's last used page (`ceil(seqlen_k / page_size)`) are
//! never read and not checked. Duplicate pages across sequences (a shared prefix) are allowed for
//! pages that only hold keys read; a page that receives appended tokens must be referenced by one
//! sequence only (two sequences writing one page would race).

use crate::device::{DevPtr, Device};
use crate::dtype::Dtype;
use crate::dtype::Tolerance;
use crate::error::Error;
use crate::reference::{attention_row, rows_on_cores, KeysByDim, Mask, Reference, RowId, RowOut, RowRules};
use crate::rng::SplitMix64;
use crate::verify::{judge, RefRow, RowPair, WorstRow};
use kernels_gpu::abi::{AttnParams, Strides};
use kernels_gpu::decode_abi::{DecodeParams, MergeParams};
pub use kernels_gpu::fp8::Fp8Format;
use kernels_gpu::tiles::{LaunchDims, APPEND, MERGE};
use kernels_gpu::variants::Elem;
use kernels_gpu::variants::Tile;
use kernels_gpu::Family;
use kernels_gpu::KernelId;
use std::fmt;
use std::str::FromStr;

/// Multiprocessors the split plan assumes where the device reports none (the VM; an H100/H200
/// has 132); `--sms` overrides, and on CUDA the device's own count is the default.
pub const DEFAULT_SM_COUNT: u32 = 132;

/// Where a problem's SM count came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum SmCountSource {
    /// [`DEFAULT_SM_COUNT`] (the VM, or a device that reports none).
    #[default]
    Default,
    /// Given (`--sms`).
    Given,
    /// The device's multiprocessor count ([`Device::multiprocessor_count`]).
    Device,
}

impl SmCountSource {
    /// Where the count came from, in words.
    pub const fn describe(self) -> &'static str {
        match self {
            SmCountSource::Default => "default, an H100/H200 as the VM models",
            SmCountSource::Given => "given",
            SmCountSource::Device => "the device's multiprocessor count",
        }
    }
}
/// Most splits a plan may have (FlashAttention-2's `max_splits`, 128).
pub const MAX_SPLITS: u32 = 128;

/// The `--splits` option.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Splits {
    /// Planned from the device: for the tensor-core decode, enough blocks per multiprocessor to
    /// keep [`IN_FLIGHT_PER_SM`] bytes of the cache in flight ([`splits_for_bytes_in_flight`]);
    /// for the SIMT decode, FlashAttention-2's wave-efficiency heuristic ([`num_splits_heuristic`]).
    #[default]
    Auto,
    /// Exactly this many (1..=128).
    Fixed(u32),
}

impl FromStr for Splits {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(Splits::Auto);
        }
        match s.parse::<u32>() {
            Ok(n) if (1..=MAX_SPLITS).contains(&n) => Ok(Splits::Fixed(n)),
            _ if s.trim().starts_with('-') => {
                Err(format!("a split count must be >= 0: `auto` or a count 1..={MAX_SPLITS}, got `{s}`"))
            }
            _ => Err(format!("a split count is `auto` or a count 1..={MAX_SPLITS}, got `{s}`")),
        }
    }
}

impl fmt::Display for Splits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Splits::Auto => f.write_str("auto"),
            Splits::Fixed(n) => write!(f, "{n}"),
        }
    }
}

pub use crate::error::KvCacheRule;

/// The `--kernel` option of decode: which decode forward family runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum DecodeKernel {
    /// The tensor-core kernel (`decode_mma_*`) for bf16 and f16, the SIMT one for f32.
    #[default]
    Auto,
    /// The SIMT kernel (`decode_fwd_*`, f32 arithmetic) for every dtype.
    Simt,
    /// The tensor-core kernel (`decode_mma_*`, `mma.sync`); bf16 and f16 only.
    Mma,
    /// Chunked prefill: the tensor-core forward (`flash_fwd_*`) reading K and V from the cache
    /// (through the block table when paged), one block per 16·k query rows of a head and no key
    /// splits; bf16 and f16 caches, no ALiBi, `cache_batch_idx` or `cache_leftpad`.
    /// [`DecodeKernel::Auto`] picks it when the query has at least as many tokens as the
    /// forward's block has rows ([`DecodeProblem::uses_prefill`]).
    Prefill,
}

impl FromStr for DecodeKernel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(DecodeKernel::Auto),
            "simt" => Ok(DecodeKernel::Simt),
            "mma" => Ok(DecodeKernel::Mma),
            "prefill" => Ok(DecodeKernel::Prefill),
            _ => Err(format!("a decode kernel is auto, simt, mma or prefill, got `{s}`")),
        }
    }
}

impl fmt::Display for DecodeKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DecodeKernel::Auto => "auto",
            DecodeKernel::Simt => "simt",
            DecodeKernel::Mma => "mma",
            DecodeKernel::Prefill => "prefill",
        })
    }
}

/// FlashAttention-2's split-count heuristic, copied from `csrc/flash_attn/flash_api.cpp`,
/// `num_splits_heuristic` (Dao-AILab/flash-attention, v2.x): if the blocks without splitting
/// already fill 80 % of the SMs, use 1 split; otherwise, among split counts `1..=min(max_splits,
/// num_sms, num_n_blocks)` that change the number of key blocks per split (others are the same
/// split in disguise), compute the wave efficiency `n_waves / ceil(n_waves)` with `n_waves =
/// blocks * splits / num_sms`, and take the smallest count within 85 % of the best efficiency.
pub fn num_splits_heuristic(batch_nheads_mblocks: u32, num_sms: u32, num_n_blocks: u32, max_splits: u32) -> u32 {
    if batch_nheads_mblocks as f32 >= 0.8 * num_sms as f32 {
        return 1;
    }
    let max_splits = max_splits.min(num_sms).min(num_n_blocks);
    let eligible = |n: u32| n == 1 || num_n_blocks.div_ceil(n) != num_n_blocks.div_ceil(n - 1);
    let eff = |n: u32| {
        let waves = (batch_nheads_mblocks as f32 * n as f32) / num_sms as f32;
        waves / waves.ceil()
    };
    let best = (1..=max_splits).filter(|&n| eligible(n)).map(eff).fold(0f32, f32::max);
    (1..=max_splits).find(|&n| eligible(n) && eff(n) >= 0.85 * best).unwrap_or(1)
}

/// Bytes of the KV cache a multiprocessor should have in flight for a decode to read at the
/// memory's bandwidth: Little's law, bandwidth x loaded latency / SMs. On the H200 the calibrated
/// decode model (docs/perf/README.md, "What the decode needs") puts it at 26.5 KB (4.8 TB/s x
/// 0.912 us / 132 SMs, for 3.84 TB/s: 80 % of the bandwidth); rounded up to two of the tensor-core
/// decode's 16 KiB key tiles (bf16, d128, Bc 64).
pub const IN_FLIGHT_PER_SM: u32 = 32 * 1024;

/// Blocks per multiprocessor the split plan may count on for the tensor-core decode: two blocks
/// of 4 warps fit any kernel of up to 255 registers (65,536 / (128 threads x 256)) and the
/// decode's 34-68 KiB of shared memory (two K/V stages) on sm_80 and sm_90 (164 / 228 KiB per
/// SM); the 100 KiB SMs of sm_86/sm_89 hold one d128 block (68 KiB), so there the plan's splits
/// run in two waves. More would depend on the kernel's registers, and past the resident blocks
/// the launch runs a second wave (on the H200 model, 512 blocks over 396 slots read 2.9 TB/s
/// where 256 blocks read 4.1).
pub const DECODE_MMA_BLOCKS_PER_SM: u32 = 2;

/// The split count of the tensor-core decode, planned from the device: each block keeps one key
/// tile of `tile_bytes` in flight, so a multiprocessor needs `ceil(IN_FLIGHT_PER_SM / tile_bytes)`
/// blocks (at most [`DECODE_MMA_BLOCKS_PER_SM`]); the count is the largest that keeps the launch
/// within those resident blocks (`blocks_per_split x splits <= sms x blocks per SM`: one wave),
/// at least 1, at most `key_blocks` (a split gets at least one key block) and [`MAX_SPLITS`].
/// With `blocks_per_split` already filling the multiprocessors it is 1.
///
/// On the calibrated H200 model (heads 32/8, d128, bf16): batch 8 x 32768 cached keys gets 4
/// splits (256 blocks, 4.1 TB/s predicted; FlashAttention-2's heuristic chose 2: 2.2 TB/s
/// measured), batch 1 x 8192 gets 33 (0.96 TB/s predicted; the heuristic's 16: 0.90 measured).
pub fn splits_for_bytes_in_flight(blocks_per_split: u64, sms: u32, tile_bytes: u32, key_blocks: u32) -> u32 {
    let per_sm = IN_FLIGHT_PER_SM.div_ceil(tile_bytes.max(1)).clamp(1, DECODE_MMA_BLOCKS_PER_SM);
    let slots = sms as u64 * per_sm as u64;
    if blocks_per_split == 0 {
        return 1;
    }
    let fit = (slots / blocks_per_split).max(1);
    fit.min(key_blocks.max(1) as u64).min(MAX_SPLITS as u64) as u32
}

/// FlashAttention-2's key block of its split-KV kernel for a head dim (`set_params_splitkv`:
/// 256 for d <= 64, 128 for d <= 128, 64 above): the unit of `num_n_blocks` in the heuristic, so a
/// split gets at least that many keys.
pub const fn fa2_block_n(head_dim: u32) -> u32 {
    if head_dim <= 64 {
        256
    } else if head_dim <= 128 {
        128
    } else {
        64
    }
}

/// One decode problem: shapes, cache, new tokens, dtype, split choice.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeProblem {
    /// Sequences in the batch.
    pub batch: u32,
    /// Query heads.
    pub heads: u32,
    /// Heads of the K and V caches (GQA/MQA); must divide `heads`.
    pub heads_kv: u32,
    /// Elements per head of Q, K, V and O.
    pub head_dim: u32,
    /// Query tokens per sequence (1 for plain decode; more for speculative decoding).
    pub seq_q: u32,
    /// Keys already in the cache per sequence (`batch` entries).
    pub cache_seqlens: Vec<u32>,
    /// New tokens appended per sequence before attention.
    pub seq_new: u32,
    /// `None`: contiguous cache; `Some(P)`: paged with `P` keys per page.
    pub page_size: Option<u32>,
    /// The element type of Q, O and the new tokens, and of the cache unless `kv_fp8` is set.
    pub dtype: Dtype,
    /// Bottom-right aligned causal mask (forces the window's right side to 0).
    pub causal: bool,
    /// Sliding window, bottom-right aligned as in FlashAttention-2: keys left and right of the
    /// diagonal a query sees, `-1` for unbounded (causal forces the right side to 0).
    pub window_left: i32,
    /// Keys right of the diagonal a query sees, `-1` for unbounded (see `window_left`).
    pub window_right: i32,
    /// Score soft-capping: `softcap * tanh(score / softcap)` (0: off).
    pub softcap: f32,
    /// None: `1/sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// The split count: chosen by the plan (`Auto`) or fixed.
    pub splits: Splits,
    /// Multiprocessors the plan fills.
    pub sm_count: u32,
    /// Where `sm_count` came from (see [`DecodeProblem::use_device_sm_count`]).
    pub sm_count_source: SmCountSource,
    /// Which decode forward runs (default: tensor cores for bf16/f16, SIMT for f32).
    pub kernel: DecodeKernel,
    /// Per-head attention sinks (values in [`DecodeInputs::sinks`]): a logit per query head that
    /// joins the softmax denominator only, counted once whatever the split count.
    pub sinks: bool,
    /// An FP8 KV cache in this format (one byte per element, `docs/semantics.md`, "FP8 KV
    /// cache"): `dtype` (Q, O, `k_new`, `v_new`) must be bf16, the scales are in
    /// [`DecodeInputs::k_scale`] and [`DecodeInputs::v_scale`]. `None`: the cache is in `dtype`.
    pub kv_fp8: Option<Fp8Format>,
    /// Contiguous cache only (FlashAttention-2's `cache_batch_idx`): the cache slot (first
    /// dimension index) of each sequence, `batch` entries; the cache may have more slots than
    /// sequences. `None`: sequence `b` is slot `b`.
    pub cache_batch_idx: Option<Vec<u32>>,
    /// Contiguous cache only (FlashAttention-2's `cache_leftpad`): the cache row where each
    /// sequence's keys begin, `batch` entries, at most `cache_seqlens[b]`. The keys of sequence
    /// `b` are rows `cache_leftpad[b] .. cache_seqlens[b] + seq_new` of its slot, so it has
    /// `cache_seqlens[b] - cache_leftpad[b] + seq_new` keys (bottom-right alignment counts
    /// those). `None`: every sequence starts at row 0.
    pub cache_leftpad: Option<Vec<u32>>,
    /// Rotary embedding of `q` and the new keys (FlashAttention-2's `rotary_cos`, `rotary_sin`,
    /// `rotary_interleaved`; the tables are [`DecodeInputs::rotary_cos`] and `rotary_sin`).
    /// Needs new tokens, as FlashAttention-2 does. `None`: no rotation.
    pub rotary: Option<Rotary>,
    /// ALiBi (FlashAttention-2's `alibi_slopes`; the slopes are [`DecodeInputs::alibi_slopes`]):
    /// the score of query token `i` and key `j` gains `-slope · |i + seqlen_k - seq_q - j|`.
    pub alibi: bool,
}

/// The rotary embedding of a decode call: the leading `dim` dims of every head of `q` and
/// `k_new` rotate in pairs ([`kernels_gpu::decode_abi::rotary_pair`]: `(2i, 2i + 1)` when
/// `interleaved`, GPT-J; `(i, i + dim / 2)` otherwise, GPT-NeoX) by the angle of the token's
/// position (docs/semantics.md, "Rotary embedding").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Rotary {
    /// Leading dims of each head that rotate (even, 2..=head_dim).
    pub dim: u32,
    /// Pairs `(2i, 2i + 1)` (GPT-J) when true; `(i, i + dim / 2)` (GPT-NeoX) when false.
    pub interleaved: bool,
}

impl Default for DecodeProblem {
    fn default() -> Self {
        DecodeProblem {
            batch: 1,
            heads: 8,
            heads_kv: 2,
            head_dim: 64,
            seq_q: 1,
            cache_seqlens: vec![100],
            seq_new: 0,
            page_size: None,
            dtype: Dtype::F32,
            causal: true,
            window_left: -1,
            window_right: -1,
            softcap: 0.0,
            scale: None,
            splits: Splits::Auto,
            sm_count: DEFAULT_SM_COUNT,
            sm_count_source: SmCountSource::Default,
            kernel: DecodeKernel::Auto,
            sinks: false,
            kv_fp8: None,
            cache_batch_idx: None,
            cache_leftpad: None,
            rotary: None,
            alibi: false,
        }
    }
}

/// The split plan of a problem.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct SplitPlan {
    /// Key splits per sequence (1..=[`MAX_SPLITS`]; 1 runs no merge).
    pub num_splits: u32,
    /// `"auto"` (the heuristic) or `"fixed"`.
    pub chosen_by: &'static str,
    /// Multiprocessors the plan fills.
    pub sm_count: u32,
    /// Where `sm_count` came from.
    pub sm_count_source: SmCountSource,
    /// Blocks of one split: `ceil(seq_q * group / rows per block) * heads_kv * batch`.
    pub blocks_per_split: u64,
    /// Blocks of the decode launch (`blocks_per_split * num_splits`).
    pub blocks: u64,
    /// `blocks / sm_count`.
    pub blocks_per_sm: f64,
    /// `waves / ceil(waves)` with `waves = blocks / sm_count` (1 = every SM busy in every wave).
    pub wave_efficiency: f64,
    /// The heuristic's `num_n_blocks`: `ceil(max seqlen_k / block_n)`.
    pub heuristic_key_blocks: u32,
}

impl DecodeProblem {
    /// This problem for the worst case its shapes allow, which a call with indices checked on
    /// the device is planned for (the values unknown to the host; FlashAttention-2 plans from the
    /// cache's size too): every sequence at `capacity` keys after the append, no left padding,
    /// and (with `cache_batch_idx`) distinct slots below `slots` where there are enough.
    pub fn at_capacity(&self, capacity: u32, slots: u32) -> DecodeProblem {
        let b = self.batch as usize;
        DecodeProblem {
            cache_seqlens: vec![capacity.saturating_sub(self.seq_new); b],
            cache_batch_idx: self
                .cache_batch_idx
                .as_ref()
                .map(|_| (0..b as u32).map(|i| i.min(slots.saturating_sub(1))).collect()),
            cache_leftpad: self.cache_leftpad.as_ref().map(|_| vec![0; b]),
            ..self.clone()
        }
    }

    /// Query heads per KV head (`heads / heads_kv`).
    pub fn group(&self) -> u32 {
        self.heads / self.heads_kv.max(1)
    }
    /// The softmax scale the kernels get: `scale`, or `1 / sqrt(head_dim)` when `None`.
    pub fn softmax_scale(&self) -> f32 {
        self.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }
    /// Keys sequence `b` attends over: `cache_seqlens[b] - cache_leftpad[b] + seq_new`.
    pub fn seqlen_k(&self, b: usize) -> u32 {
        self.cache_seqlens[b] - self.leftpad(b) + self.seq_new
    }
    /// Sequence `b`'s left padding ([`DecodeProblem::cache_leftpad`], 0 without).
    pub fn leftpad(&self, b: usize) -> u32 {
        self.cache_leftpad.as_ref().map_or(0, |l| l[b])
    }
    /// Sequence `b`'s cache slot ([`DecodeProblem::cache_batch_idx`], `b` without).
    pub fn slot(&self, b: usize) -> usize {
        self.cache_batch_idx.as_ref().map_or(b, |s| s[b] as usize)
    }
    /// Cache rows sequence `b` occupies after the append, padding included:
    /// `cache_seqlens[b] + seq_new` (what a contiguous cache must hold per slot).
    pub fn cache_end(&self, b: usize) -> u32 {
        self.cache_seqlens[b] + self.seq_new
    }
    /// Rotary positions: query token `i` of sequence `b` is at `cache_seqlens[b] + i` in causal
    /// or windowed calls, else at `cache_seqlens[b]` (FlashAttention-2's rule); new key `t` at
    /// `cache_seqlens[b] + t`.
    pub fn rotary_q_per_token(&self) -> bool {
        self.causal || self.window_left >= 0 || self.window_right >= 0
    }
    /// Rows the rotary tables need: one past the largest position of any rotated token.
    pub fn rotary_rows(&self) -> u32 {
        (0..self.batch as usize)
            .map(|b| {
                let q_last = self.cache_seqlens[b] + if self.rotary_q_per_token() { self.seq_q - 1 } else { 0 };
                (q_last + 1).max(self.cache_end(b))
            })
            .max()
            .unwrap_or(0)
    }
    /// Slots a contiguous cache needs: one past the largest [`DecodeProblem::slot`] (a u64: slot
    /// `u32::MAX` needs 2^32 of them, which the size check then refuses).
    pub fn cache_slots(&self) -> u64 {
        (0..self.batch as usize).map(|b| self.slot(b) as u64 + 1).max().unwrap_or(1)
    }
    /// The most keys any sequence attends over ([`DecodeProblem::seqlen_k`]; 0 for an empty batch).
    pub fn max_seqlen_k(&self) -> u32 {
        (0..self.batch as usize).map(|b| self.seqlen_k(b)).max().unwrap_or(0)
    }
    /// Output rows `batch * heads * seq_q`.
    pub fn rows(&self) -> u64 {
        self.batch as u64 * self.heads as u64 * self.seq_q as u64
    }
    /// Elements of Q (and of O): `batch * heads * seq_q * head_dim`.
    pub fn q_elems(&self) -> u64 {
        self.rows() * self.head_dim as u64
    }
    /// Elements of each of `k_new` and `v_new`: `batch * seq_new * heads_kv * head_dim`.
    pub fn new_elems(&self) -> u64 {
        self.batch as u64 * self.seq_new as u64 * self.heads_kv as u64 * self.head_dim as u64
    }
    /// Keys `[start, end)` query token `i` of sequence `b` sees (the kernels' rule,
    /// [`kernels_gpu::decode_abi::key_range`]); empty when `start >= end`.
    pub fn key_range(&self, b: usize, i: u32) -> (u32, u32) {
        let (s, e) = kernels_gpu::mask::key_range(
            self.causal,
            self.window_left,
            self.window_right,
            i,
            self.seq_q,
            self.seqlen_k(b),
        );
        let (s, e) = (s.max(0) as u32, e.max(0) as u32);
        (s.min(e), e)
    }

    /// Keys query token `i` of sequence `b` sees.
    pub fn keys_seen(&self, b: usize, i: u32) -> u32 {
        let (s, e) = self.key_range(b, i);
        e - s
    }

    /// `[decode forward, merge_states, decode_append]` for the dtype, head dim and `kernel`
    /// choice: the forward is `decode_mma_*` (tensor cores) or `decode_fwd_*` (SIMT).
    pub fn kernels(&self) -> Result<[KernelId; 3], KvCacheRule> {
        let elem = match self.kv_fp8 {
            None => self.dtype.elem(),
            Some(f) => {
                if self.dtype != Dtype::Bf16 {
                    return Err(KvCacheRule::Fp8Dtype { dtype: self.dtype });
                }
                fp8_elem(f)
            }
        };
        if let Some(why) = self.prefill_refusal()
            && self.kernel == DecodeKernel::Prefill
        {
            return Err(KvCacheRule::PrefillUnsupported { why });
        }
        if self.uses_prefill() {
            let fwd = KernelId::flash(elem, self.head_dim).ok_or_else(|| KvCacheRule::HeadDim {
                head_dim: self.head_dim,
                dtype: self.dtype,
                compiled: KernelId::flash_head_dims(elem),
            })?;
            // The merge and append of the call's dtype (the merge does not run: one split).
            let [_, merge, append] = self.kernels_of(DecodeKernel::Auto, elem)?;
            return Ok([fwd, merge, append]);
        }
        self.kernels_of(self.kernel, elem)
    }

    /// [`DecodeProblem::kernels`] on a device that runs `target`: on sm_90 the tensor-core decode
    /// of an e4m3 cache is the `sm_90a` module's row where [`crate::choice`] picks it, which
    /// widens the cache with `cvt` (the sm_80 rows use integer operations; both read the same
    /// bytes and give the same values).
    pub fn kernels_on(&self, target: impl Into<crate::problem::Target>) -> Result<[KernelId; 3], KvCacheRule> {
        let [fwd, merge, append] = self.kernels()?;
        Ok([target.into().decode(fwd), merge, append])
    }

    /// Why the prefill kernel cannot run this call (`None`: it can).
    fn prefill_refusal(&self) -> Option<&'static str> {
        if !self.dtype.is_16bit() {
            Some("takes bf16 or f16")
        } else if self.kv_fp8.is_some() {
            Some("does not read FP8 caches")
        } else if self.alibi {
            Some("does not take ALiBi")
        } else if self.cache_batch_idx.is_some() || self.cache_leftpad.is_some() {
            Some("does not take cache_batch_idx or cache_leftpad")
        } else if matches!(self.splits, Splits::Fixed(n) if n > 1) {
            Some("has no key splits (a split count above 1 asks for a decode kernel)")
        } else {
            None
        }
    }

    /// Whether the call runs on the prefill kernel: asked for ([`DecodeKernel::Prefill`]), or
    /// [`DecodeKernel::Auto`] with a query of at least the forward's rows per block (then every
    /// block of the forward is full, and its larger tiles without key splits beat packing the
    /// query into the decode kernel's rows) and nothing the forward refuses (a split count above 1
    /// keeps the decode kernels, which split).
    pub fn uses_prefill(&self) -> bool {
        match self.kernel {
            DecodeKernel::Prefill => true,
            DecodeKernel::Auto => {
                self.prefill_refusal().is_none()
                    && KernelId::flash(self.dtype.elem(), self.head_dim)
                        .is_some_and(|k| self.seq_q >= k.variant().block_rows())
            }
            _ => false,
        }
    }

    /// [`DecodeProblem::kernels`] with the decode forward `kernel`.
    fn kernels_of(&self, kernel: DecodeKernel, elem: Elem) -> Result<[KernelId; 3], KvCacheRule> {
        let found = match kernel {
            DecodeKernel::Auto | DecodeKernel::Prefill => KernelId::decode(elem, self.head_dim),
            DecodeKernel::Simt => KernelId::decode_with(Family::DecodeFwd, elem, self.head_dim),
            DecodeKernel::Mma => {
                if !self.dtype.is_16bit() {
                    return Err(KvCacheRule::MmaDtype { dtype: self.dtype });
                }
                KernelId::decode_with(Family::DecodeMma, elem, self.head_dim)
            }
        };
        found.ok_or_else(|| KvCacheRule::HeadDim {
            head_dim: self.head_dim,
            dtype: self.dtype,
            compiled: match kernel {
                // The tensor-core decode has fewer head dims than the SIMT one.
                DecodeKernel::Mma => {
                    let mut dims: Vec<u32> = kernels_gpu::VARIANTS
                        .iter()
                        .filter(|v| v.family == Family::DecodeMma && v.elem == elem)
                        .filter_map(|v| v.head_dim())
                        .collect();
                    dims.sort_unstable();
                    dims
                }
                _ => KernelId::decode_head_dims(elem).to_vec(),
            },
        })
    }

    /// Bytes of one cache element: 1 for an FP8 cache, the dtype's size otherwise.
    pub fn cache_elem_bytes(&self) -> u64 {
        if self.kv_fp8.is_some() {
            1
        } else {
            self.dtype.size_bytes()
        }
    }

    /// The decode forward's launch for `num_splits` splits (grid `(num_splits, query tiles,
    /// heads_kv * batch)`), for the kernel [`DecodeProblem::kernels`] chooses.
    pub fn forward_launch(&self, num_splits: u32) -> Result<LaunchDims, KvCacheRule> {
        let (sq, g, hk, b) = (self.seq_q, self.group(), self.heads_kv, self.batch);
        match self.kernels()?[0].variant().tile {
            Tile::DecodeFwd(t) => Ok(t.launch(num_splits, sq, g, hk, b)),
            Tile::DecodeMma(t) => Ok(t.launch(num_splits, sq, g, hk, b)),
            Tile::FlashMma(t) => Ok(t.launch(b, self.heads, sq)),
            _ => unreachable!("the decode forward is a DecodeFwd, DecodeMma or FlashMma row"),
        }
    }

    /// Checks the shape rules (nothing allocated). Each error names the rule.
    pub fn validate(&self) -> Result<(), KvCacheRule> {
        if self.batch == 0 || self.heads == 0 || self.heads_kv == 0 || self.seq_q == 0 || self.head_dim == 0 {
            return Err(KvCacheRule::Empty {
                sizes: [self.batch, self.heads, self.heads_kv, self.seq_q, self.head_dim],
            });
        }
        if !self.heads.is_multiple_of(self.heads_kv) {
            return Err(KvCacheRule::Heads { heads: self.heads, heads_kv: self.heads_kv });
        }
        if self.cache_seqlens.len() != self.batch as usize {
            return Err(KvCacheRule::SeqLensEntries { got: self.cache_seqlens.len(), batch: self.batch });
        }
        if self.page_size == Some(0) {
            return Err(KvCacheRule::PageSizeZero);
        }
        if self.cache_seqlens.iter().any(|&l| l as u64 + self.seq_new as u64 > u32::MAX as u64 / 2) {
            return Err(KvCacheRule::TooLong);
        }
        for (tensor, t) in [("cache_batch_idx", &self.cache_batch_idx), ("cache_leftpad", &self.cache_leftpad)] {
            if let Some(t) = t {
                if self.page_size.is_some() {
                    return Err(KvCacheRule::SlotsWithPages { tensor });
                }
                if t.len() != self.batch as usize {
                    return Err(KvCacheRule::SlotEntries { tensor, got: t.len(), batch: self.batch });
                }
            }
        }
        if let Some(r) = self.rotary {
            if r.dim == 0 || !r.dim.is_multiple_of(2) || r.dim > self.head_dim {
                return Err(KvCacheRule::RotaryDim { dim: r.dim, head_dim: self.head_dim });
            }
            if self.seq_new == 0 {
                return Err(KvCacheRule::RotaryWithoutNewTokens);
            }
        }
        if let Some(pad) = &self.cache_leftpad
            && let Some(b) = (0..pad.len()).find(|&b| pad[b] > self.cache_seqlens[b])
        {
            return Err(KvCacheRule::LeftpadPastSeqlen {
                batch: b,
                leftpad: pad[b],
                cache_seqlen: self.cache_seqlens[b],
            });
        }
        if let (Some(slots), true) = (&self.cache_batch_idx, self.seq_new > 0) {
            let mut first = std::collections::HashMap::new();
            for (b, &slot) in slots.iter().enumerate() {
                if let Some(&a) = first.get(&slot) {
                    return Err(KvCacheRule::SharedSlot { slot, first: a, second: b });
                }
                first.insert(slot, b);
            }
        }
        if self.window_left < -1 || self.window_right < -1 {
            return Err(KvCacheRule::Window { left: self.window_left, right: self.window_right });
        }
        if !(self.softcap.is_finite() && self.softcap >= 0.0) {
            return Err(KvCacheRule::Softcap { got: self.softcap });
        }
        if self.sm_count == 0 {
            return Err(KvCacheRule::SmCount);
        }
        if !self.softmax_scale().is_finite() {
            return Err(KvCacheRule::Scale { got: self.softmax_scale() });
        }
        self.kernels()?;
        self.sizes()?;
        Ok(())
    }

    /// The split plan: `--splits N` as given, `auto` from [`num_splits_heuristic`] over this
    /// problem's blocks and the SM count.
    pub fn plan(&self) -> Result<SplitPlan, KvCacheRule> {
        let fwd = self.kernels()?[0].variant();
        let br = fwd.block_rows();
        let prefill = self.uses_prefill();
        let blocks_per_split = if prefill {
            (self.seq_q as u64).div_ceil(br as u64) * self.heads as u64 * self.batch as u64
        } else {
            (self.seq_q as u64 * self.group() as u64).div_ceil(br as u64) * self.heads_kv as u64 * self.batch as u64
        };
        let key_blocks = self.max_seqlen_k().div_ceil(fa2_block_n(self.head_dim));
        let (num_splits, chosen_by) = match (self.splits, fwd.tile) {
            _ if prefill => (1, "prefill kernel (no key splits)"),
            (Splits::Fixed(n), _) => (n, "fixed"),
            (Splits::Auto, Tile::DecodeMma(t)) => {
                // The cache's bytes of one key tile (an FP8 cache's are one byte each).
                let tile_bytes =
                    (t.bc as u64 * self.head_dim as u64 * self.cache_elem_bytes()).min(u32::MAX as u64) as u32;
                (splits_for_bytes_in_flight(blocks_per_split, self.sm_count, tile_bytes, key_blocks), "auto")
            }
            (Splits::Auto, _) => (
                num_splits_heuristic(
                    blocks_per_split.min(u32::MAX as u64) as u32,
                    self.sm_count,
                    key_blocks,
                    MAX_SPLITS,
                ),
                "auto",
            ),
        };
        let blocks = blocks_per_split * num_splits as u64;
        let waves = blocks as f64 / self.sm_count as f64;
        Ok(SplitPlan {
            num_splits,
            chosen_by,
            sm_count: self.sm_count,
            sm_count_source: self.sm_count_source,
            blocks_per_split,
            blocks,
            blocks_per_sm: waves,
            wave_efficiency: if waves > 0.0 { waves / waves.ceil() } else { 0.0 },
            heuristic_key_blocks: key_blocks,
        })
    }

    /// Plans for `dev`'s own multiprocessor count when it reports one (CUDA) and the count was
    /// not given ([`SmCountSource::Given`] is kept); otherwise the problem is unchanged.
    pub fn use_device_sm_count<D: Device + ?Sized>(&mut self, dev: &mut D) -> Result<(), Error> {
        if self.sm_count_source != SmCountSource::Given
            && let Some(n) = dev.multiprocessor_count()?
        {
            self.sm_count = n;
            self.sm_count_source = SmCountSource::Device;
        }
        Ok(())
    }

    /// Pages sequence `b` needs: `ceil(seqlen_k / page_size)` (a paged cache has no padding).
    pub fn pages_needed(&self, b: usize, page_size: u32) -> u32 {
        self.cache_end(b).div_ceil(page_size)
    }

    /// Element counts of the call's tensors in the layout [`DecodeInputs::random`] draws (a
    /// contiguous cache of `max seqlen_k` rows per sequence, or exactly the pages the sequences
    /// need), computed in 128 bits before anything is allocated. Every count, as f64 bytes (the
    /// widest host copy), must fit in 64 bits; page counts and a cache row must fit in 32 (the
    /// layout's and the kernels' index types).
    pub fn sizes(&self) -> Result<DecodeSizes, KvCacheRule> {
        let (b, h, hk, d, sq) =
            (self.batch as u128, self.heads as u128, self.heads_kv as u128, self.head_dim as u128, self.seq_q as u128);
        let fit = |tensor: &'static str, elems: u128, limit: u64| -> Result<u64, KvCacheRule> {
            if elems > limit as u128 {
                return Err(KvCacheRule::TooLarge { tensor, elems, limit });
            }
            Ok(elems as u64)
        };
        // Elements of f64 copies (the reference) must have byte counts within u64.
        let elems_limit = u64::MAX / 8;
        let row = fit("a cache row (heads_kv * head_dim)", hk * d, u32::MAX as u64)? as u128;
        let rows = fit("lse", b * h * sq, elems_limit)?;
        let q = fit("q", rows as u128 * d, elems_limit)?;
        let new = fit("k_new", b * self.seq_new as u128 * row, elems_limit)?;
        let (slots, block_table, num_pages, max_pages) = match self.page_size {
            None => {
                let rows = (0..self.batch as usize).map(|i| self.cache_end(i)).max().unwrap_or(0).max(1);
                (self.cache_slots() as u128 * rows as u128, 0, 0, 0)
            }
            Some(ps) => {
                let ps = ps.max(1);
                let need = |i: usize| self.pages_needed(i, ps) as u128;
                let pages: u128 = (0..self.batch as usize).map(need).sum::<u128>().max(1);
                let max_pages = (0..self.batch as usize).map(need).max().unwrap_or(0).max(1);
                let num_pages = fit("num_pages", pages, u32::MAX as u64)?;
                let table = fit("block_table", b * max_pages, elems_limit)?;
                (pages * ps as u128, table, num_pages as u32, max_pages as u32)
            }
        };
        let cache = fit("k_cache", slots * row, elems_limit)?;
        let splits = self.plan().map(|p| p.num_splits).unwrap_or(1) as u128;
        let workspace =
            if splits > 1 { fit("the split workspace", splits * rows as u128 * (d + 1), elems_limit)? } else { 0 };
        Ok(DecodeSizes { q, rows, cache, new, block_table, num_pages, max_pages, workspace })
    }
}

/// Where the cache's rows live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(tag = "kind", rename_all = "lowercase"))]
pub enum CacheLayout {
    /// `[batch, seq_cache, heads_kv, head_dim]`.
    Contiguous {
        /// Keys each slot holds.
        seq_cache: u32,
    },
    /// `[num_pages, page_size, heads_kv, head_dim]` and a `[batch, max_pages]` block table.
    Paged {
        /// Keys per page.
        page_size: u32,
        /// Pages in the cache.
        num_pages: u32,
        /// Block-table entries per sequence.
        max_pages: u32,
    },
}

impl CacheLayout {
    /// Keys one sequence can hold after an append: `seq_cache`, or `page_size * max_pages` (at
    /// most `u32::MAX / 2`, the longest sequence a call takes).
    pub fn capacity(self) -> u32 {
        let keys = match self {
            CacheLayout::Contiguous { seq_cache } => seq_cache as u64,
            CacheLayout::Paged { page_size, max_pages, .. } => page_size as u64 * max_pages as u64,
        };
        keys.min(u32::MAX as u64 / 2) as u32
    }
}

/// The tensors of one decode call, all f32 on the host (16-bit dtypes hold their exact values).
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeInputs {
    /// `[batch, seq_q, heads, head_dim]`.
    pub q: Vec<f32>,
    /// The K cache, as [`DecodeInputs::layout`] lays it out.
    pub k_cache: Vec<f32>,
    /// The V cache, laid out as `k_cache`.
    pub v_cache: Vec<f32>,
    /// `[batch, max_pages]` (paged only; empty otherwise).
    pub block_table: Vec<u32>,
    /// `[batch, seq_new, heads_kv, head_dim]` (empty when `seq_new == 0`).
    pub k_new: Vec<f32>,
    /// New values, laid out as `k_new`.
    pub v_new: Vec<f32>,
    /// How the caches are laid out: contiguous or paged, and their sizes.
    pub layout: CacheLayout,
    /// `[heads]` f32 sink logits with [`DecodeProblem::sinks`], empty without.
    pub sinks: Vec<f32>,
    /// FP8 cache ([`DecodeProblem::kv_fp8`]): the K cache's scales, one (per tensor) or
    /// `heads_kv` (per KV head), each in [`MIN_FP8_SCALE`, `MAX_FP8_SCALE`]; empty for other caches. `k_cache` and
    /// `k_new` hold the unquantised values; the device cache holds `encode(k / scale)`
    /// ([`fp8_encode_cache`]).
    pub k_scale: Vec<f32>,
    /// FP8 cache: the V cache's scales, as `k_scale`.
    pub v_scale: Vec<f32>,
    /// [`DecodeProblem::rotary`]: `[seqlen_ro, rotary_dim / 2]` cosines and sines of the
    /// position angles, in the dtype (rounded); empty without rotary.
    pub rotary_cos: Vec<f32>,
    /// The sines of the position angles, laid out as `rotary_cos`.
    pub rotary_sin: Vec<f32>,
    /// [`DecodeProblem::alibi`]: the slopes, `[heads]` (every sequence) or `[batch, heads]`;
    /// empty without ALiBi. [`DecodeInputs::random`] gives the ALiBi paper's slopes
    /// ([`crate::problem::alibi_slopes`]).
    pub alibi_slopes: Vec<f32>,
}

impl DecodeInputs {
    /// Random normal inputs (rounded to the dtype). Contiguous caches hold `max seqlen_k` keys per
    /// sequence; a paged cache holds exactly the pages the sequences need, in a shuffled order.
    /// Cache rows at and past `cache_seqlens[b]` (the append's target and the unused tail) are NaN,
    /// so a kernel that reads a row it must not, or attends before the append, fails verification.
    pub fn random(p: &DecodeProblem, seed: u64) -> DecodeInputs {
        // One stream: q, k_new, v_new, then the cache rows in order, each row's K and V elements
        // interleaved; cut into parts that the cores draw side by side.
        let stream = seed ^ 0xDEC0_DE00;
        let (hk, d) = (p.heads_kv as usize, p.head_dim as usize);
        let (nq, nn) = (p.q_elems(), p.new_elems());
        let q = crate::inputs::normals(p.dtype, stream, 0, nq);
        let k_new = crate::inputs::normals(p.dtype, stream, nq, nn);
        let v_new = crate::inputs::normals(p.dtype, stream, nq + nn, nn);
        let row = (hk * d) as u64;
        let (layout, block_table, slots) = match p.page_size {
            None => {
                let seq_cache = (0..p.batch as usize).map(|b| p.cache_end(b)).max().unwrap_or(0).max(1);
                (CacheLayout::Contiguous { seq_cache }, Vec::new(), p.cache_slots().saturating_mul(seq_cache as u64))
            }
            Some(ps) => {
                let need: Vec<u32> = (0..p.batch as usize).map(|b| p.pages_needed(b, ps)).collect();
                let num_pages: u32 = need.iter().sum::<u32>().max(1);
                let max_pages = need.iter().copied().max().unwrap_or(0).max(1);
                let mut order: Vec<u32> = (0..num_pages).collect();
                let mut r2 = SplitMix64::new(seed ^ 0x9A6E);
                for i in (1..order.len()).rev() {
                    order.swap(i, r2.below(i as u64 + 1) as usize);
                }
                let mut table = vec![u32::MAX; p.batch as usize * max_pages as usize];
                let mut next = 0;
                for (b, &n) in need.iter().enumerate() {
                    for s in 0..n as usize {
                        table[b * max_pages as usize + s] = order[next];
                        next += 1;
                    }
                }
                (CacheLayout::Paged { page_size: ps, num_pages, max_pages }, table, num_pages as u64 * ps as u64)
            }
        };
        let mut x = DecodeInputs {
            q,
            k_cache: vec![f32::NAN; (slots * row) as usize],
            v_cache: vec![f32::NAN; (slots * row) as usize],
            block_table,
            k_new,
            v_new,
            layout,
            sinks: Vec::new(),
            k_scale: Vec::new(),
            v_scale: Vec::new(),
            rotary_cos: Vec::new(),
            rotary_sin: Vec::new(),
            alibi_slopes: if p.alibi { crate::problem::alibi_slopes(p.heads) } else { Vec::new() },
        };
        if let Some(r) = p.rotary {
            (x.rotary_cos, x.rotary_sin) = rope_tables(p.rotary_rows(), r.dim, 10000.0, p.dtype);
        }
        if p.sinks {
            // From their own stream (the other tensors do not change), plus 1 as the forward's
            // random sinks: a sink weighs about as much as a typical key.
            let mut r3 = SplitMix64::new(seed ^ 0x51_4E_C5);
            x.sinks = (0..p.heads).map(|_| r3.normal() as f32 + 1.0).collect();
        }
        // Left padding stays NaN too: a kernel that reads it fails verification.
        let rows: Vec<usize> = (0..p.batch as usize)
            .flat_map(|b| (p.leftpad(b)..p.cache_seqlens[b]).map(move |j| (b, j)))
            .map(|(b, j)| x.row_offset(p, b, j).expect("sized above"))
            .collect();
        let w = hk * d;
        // Parts of 512 rows: the drawn values of one part are at most 2 x 512 x w floats.
        let mut first = nq + 2 * nn;
        for part in rows.chunks(512) {
            let drawn = crate::inputs::normals(p.dtype, stream, first, (2 * part.len() * w) as u64);
            first += drawn.len() as u64;
            for (&at, kv) in part.iter().zip(drawn.chunks_exact(2 * w)) {
                for (e, pair) in kv.chunks_exact(2).enumerate() {
                    x.k_cache[at + e] = pair[0];
                    x.v_cache[at + e] = pair[1];
                }
            }
        }
        if let Some(f) = p.kv_fp8 {
            // Per-tensor scales from the largest magnitude (vLLM's `amax / max_finite`), so the
            // largest value lands on the format's largest code.
            let amax =
                |a: &[f32], b: &[f32]| a.iter().chain(b).filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()));
            let scale = |m: f32| if m > 0.0 { m / f.max_finite() } else { 1.0 };
            x.k_scale = vec![scale(amax(&x.k_cache, &x.k_new))];
            x.v_scale = vec![scale(amax(&x.v_cache, &x.v_new))];
        }
        x
    }

    /// The inputs the attention sees with [`DecodeProblem::rotary`]: `q` and `k_new` rotated
    /// by the kernels' rule ([`kernels_gpu::decode_abi::rotate`] in f32, rounded to the dtype);
    /// unchanged without rotary.
    pub fn rotated(&self, p: &DecodeProblem) -> DecodeInputs {
        let Some(r) = p.rotary else { return self.clone() };
        let mut y = self.clone();
        let (d, half) = (p.head_dim as usize, (r.dim / 2) as usize);
        let rot = |t: &mut [f32], heads: usize, tokens: usize, pos: &dyn Fn(usize, usize) -> usize| {
            for b in 0..p.batch as usize {
                for tok in 0..tokens {
                    let at_pos = pos(b, tok) * half;
                    for h in 0..heads {
                        let row = &mut t[((b * tokens + tok) * heads + h) * d..][..d];
                        for i in 0..half {
                            let (a, c) = kernels_gpu::decode_abi::rotary_pair(i as u32, r.dim, r.interleaved);
                            let (u, v) = kernels_gpu::decode_abi::rotate(
                                row[a as usize],
                                row[c as usize],
                                self.rotary_cos[at_pos + i],
                                self.rotary_sin[at_pos + i],
                            );
                            (row[a as usize], row[c as usize]) = (p.dtype.round(u), p.dtype.round(v));
                        }
                    }
                }
            }
        };
        let per_token = p.rotary_q_per_token();
        let q_pos = |b: usize, i: usize| p.cache_seqlens[b] as usize + if per_token { i } else { 0 };
        rot(&mut y.q, p.heads as usize, p.seq_q as usize, &q_pos);
        let k_pos = |b: usize, t: usize| p.cache_seqlens[b] as usize + t;
        rot(&mut y.k_new, p.heads_kv as usize, p.seq_new as usize, &k_pos);
        y
    }

    /// The FP8 scale of KV head `hk` in `scales` (one per tensor or one per head).
    pub fn fp8_scale(scales: &[f32], hk: usize) -> f32 {
        if scales.len() == 1 {
            scales[0]
        } else {
            scales[hk]
        }
    }

    /// Checks the FP8 scales of a problem with [`DecodeProblem::kv_fp8`]: one or `heads_kv` of
    /// each, in [`MIN_FP8_SCALE`, `MAX_FP8_SCALE`] ([`KvCacheRule::Fp8Scale`], [`KvCacheRule::Fp8ScaleCount`]); none
    /// without it.
    pub fn check_fp8_scales(&self, p: &DecodeProblem) -> Result<(), KvCacheRule> {
        for (tensor, s) in [("k_scale", &self.k_scale), ("v_scale", &self.v_scale)] {
            check_fp8_scales(tensor, s, p.heads_kv as usize, p.kv_fp8.is_some())?;
        }
        Ok(())
    }

    /// Element offset of cache row `j` (head 0) of sequence `b` (row `j` of its slot, padding
    /// included, in a contiguous cache); `None` when the cache or block table has no such row.
    pub fn row_offset(&self, p: &DecodeProblem, b: usize, j: u32) -> Option<usize> {
        let row = (p.heads_kv * p.head_dim) as usize;
        match self.layout {
            CacheLayout::Contiguous { seq_cache } => {
                let slots = self.k_cache.len() / (seq_cache as usize * row).max(1);
                (j < seq_cache && p.slot(b) < slots).then(|| (p.slot(b) * seq_cache as usize + j as usize) * row)
            }
            CacheLayout::Paged { page_size, num_pages, max_pages } => {
                let slot = j / page_size;
                if slot >= max_pages {
                    return None;
                }
                let page = *self.block_table.get(b * max_pages as usize + slot as usize)?;
                (page < num_pages).then(|| (page as usize * page_size as usize + (j % page_size) as usize) * row)
            }
        }
    }

    /// The same keys and values in another layout (`None`: contiguous with `max seqlen_k` rows;
    /// `Some(P)`: pages of `P`, shuffled by `seed`), for comparing layouts. Slots and left
    /// padding are dropped (each sequence's keys start at row 0 of slot `b`).
    pub fn relaid(&self, p: &DecodeProblem, page_size: Option<u32>, seed: u64) -> (DecodeProblem, DecodeInputs) {
        let mut p2 = p.clone();
        p2.page_size = page_size;
        p2.cache_batch_idx = None;
        p2.cache_leftpad = None;
        for b in 0..p.batch as usize {
            p2.cache_seqlens[b] = p.cache_seqlens[b] - p.leftpad(b);
        }
        let mut y = DecodeInputs::random(&p2, seed);
        y.q = self.q.clone();
        y.k_new = self.k_new.clone();
        y.v_new = self.v_new.clone();
        let row = (p.heads_kv * p.head_dim) as usize;
        for b in 0..p.batch as usize {
            for j in 0..p.seqlen_k(b) {
                if let (Some(a), Some(c)) = (self.row_offset(p, b, p.leftpad(b) + j), y.row_offset(&p2, b, j)) {
                    y.k_cache[c..c + row].copy_from_slice(&self.k_cache[a..a + row]);
                    y.v_cache[c..c + row].copy_from_slice(&self.v_cache[a..a + row]);
                }
            }
        }
        (p2, y)
    }

    /// Checks the tensors against the problem: lengths, block-table entries, capacity, the
    /// append's targets and finite values. Each error names the rule; nothing out of bounds can
    /// be launched past it.
    pub fn validate(&self, p: &DecodeProblem) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Usage(m));
        let row = (p.heads_kv as u64) * p.head_dim as u64;
        let want = |name: &str, got: usize, want: u64| -> Result<(), Error> {
            if got as u64 != want {
                return Err(Error::Usage(format!("tensor `{name}` has {got} elements, the problem needs {want}")));
            }
            Ok(())
        };
        want("q", self.q.len(), p.q_elems())?;
        self.check_fp8_scales(p)?;
        want("sinks", self.sinks.len(), if p.sinks { p.heads as u64 } else { 0 })?;
        if let Some(bad_sink) = self.sinks.iter().find(|s| !s.is_finite()) {
            return bad(format!("sink logit {bad_sink} is not finite; sinks must be finite f32 logits"));
        }
        let slopes = self.alibi_slopes.len() as u64;
        if p.alibi != (slopes > 0)
            || (slopes > 0 && slopes != p.heads as u64 && slopes != p.batch as u64 * p.heads as u64)
        {
            return bad(format!(
                "tensor `alibi_slopes` has {slopes} elements, the problem needs {} ([heads] or [batch, heads] with ALiBi, none without)",
                if p.alibi { p.heads as u64 } else { 0 }
            ));
        }
        if let Some(bad_slope) = self.alibi_slopes.iter().find(|s| !s.is_finite()) {
            return bad(format!("ALiBi slope {bad_slope} is not finite"));
        }
        want("k_new", self.k_new.len(), p.new_elems())?;
        want("v_new", self.v_new.len(), p.new_elems())?;
        // As FlashAttention-2: `[seqlen_ro, rotary_dim / 2]` with seqlen_ro at least the rows the
        // call's positions need; longer tables are fine (their extra rows are not read).
        let half = p.rotary.map_or(1, |r| (r.dim / 2).max(1) as u64);
        let table = p.rotary.map_or(0, |_| p.rotary_rows() as u64 * half);
        let (lc, ls) = (self.rotary_cos.len() as u64, self.rotary_sin.len() as u64);
        let fits = match p.rotary {
            None => lc == 0 && ls == 0,
            Some(_) => lc == ls && lc >= table && lc.is_multiple_of(half),
        };
        if !fits {
            return bad(format!(
                "rotary tables have {lc}/{ls} elements, the problem needs at least {table} ([{} or more rows, rotary_dim / 2], both the same)",
                p.rotary_rows()
            ));
        }
        match (self.layout, p.page_size) {
            (CacheLayout::Contiguous { seq_cache }, None) => {
                let slots = p.cache_slots();
                want("k_cache", self.k_cache.len(), slots * seq_cache as u64 * row)?;
                want("v_cache", self.v_cache.len(), slots * seq_cache as u64 * row)?;
                check_cache_layout(p, self.layout, &self.block_table)?;
            }
            (CacheLayout::Paged { page_size, num_pages, max_pages }, Some(ps)) if ps == page_size => {
                if page_size == 0 {
                    return bad("page_size must be >= 1 (0 keys per page)".into());
                }
                want("k_cache", self.k_cache.len(), num_pages as u64 * page_size as u64 * row)?;
                want("v_cache", self.v_cache.len(), num_pages as u64 * page_size as u64 * row)?;
                want("block_table", self.block_table.len(), p.batch as u64 * max_pages as u64)?;
                check_cache_layout(p, self.layout, &self.block_table)?;
            }
            (layout, ps) => return bad(format!("cache layout {layout:?} does not match page size {ps:?}")),
        }
        for (name, t) in [("q", &self.q), ("k_new", &self.k_new), ("v_new", &self.v_new)] {
            if let Some(e) = t.iter().position(|v| !v.is_finite()) {
                return bad(format!(
                    "input tensor `{name}` has a non-finite value at element {e}; NaN and +-inf are refused"
                ));
            }
        }
        for b in 0..p.batch as usize {
            for j in p.leftpad(b)..p.cache_seqlens[b] {
                let at = self.row_offset(p, b, j).expect("checked above");
                let r = row as usize;
                if self.k_cache[at..at + r].iter().chain(&self.v_cache[at..at + r]).any(|v| !v.is_finite()) {
                    return bad(format!(
                        "the cache has a non-finite value in key {j} of sequence {b}; NaN and +-inf are refused"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The inputs an FP8 cache holds, as f32 values: every element of the caches and of
    /// `k_new`, `v_new` replaced by `decode(encode(x / scale)) * scale` (its KV head's scale;
    /// NaN stays NaN). Unchanged without [`DecodeProblem::kv_fp8`].
    pub fn dequantised(&self, p: &DecodeProblem) -> DecodeInputs {
        let Some(f) = p.kv_fp8 else { return self.clone() };
        let (hk, d) = (p.heads_kv as usize, p.head_dim as usize);
        let q = |x: &[f32], scales: &[f32]| -> Vec<f32> {
            x.iter()
                .enumerate()
                .map(|(i, &v)| {
                    let s = Self::fp8_scale(scales, (i / d) % hk);
                    (fp8_value_f64(f, kernels_gpu::fp8::encode(f, v / s)) * s as f64) as f32
                })
                .collect()
        };
        DecodeInputs {
            k_cache: q(&self.k_cache, &self.k_scale),
            v_cache: q(&self.v_cache, &self.v_scale),
            k_new: q(&self.k_new, &self.k_scale),
            v_new: q(&self.v_new, &self.v_scale),
            ..self.clone()
        }
    }

    /// The cache after the append: `k_new` (rotated with [`DecodeProblem::rotary`]), `v_new`
    /// written at `cache_seqlens`.
    pub fn appended(&self, p: &DecodeProblem) -> (Vec<f32>, Vec<f32>) {
        if p.rotary.is_some() {
            return self.rotated(p).appended(&DecodeProblem { rotary: None, ..p.clone() });
        }
        let (mut k, mut v) = (self.k_cache.clone(), self.v_cache.clone());
        let row = (p.heads_kv * p.head_dim) as usize;
        for b in 0..p.batch as usize {
            for t in 0..p.seq_new {
                let at = self.row_offset(p, b, p.cache_seqlens[b] + t).expect("validated");
                let src = (b * p.seq_new as usize + t as usize) * row;
                k[at..at + row].copy_from_slice(&self.k_new[src..src + row]);
                v[at..at + row].copy_from_slice(&self.v_new[src..src + row]);
            }
        }
        (k, v)
    }
}

/// The capacity and block-table rules of a decode call, on the host values: every sequence's
/// `cache_seqlens[b] + seq_new` keys fit (a contiguous cache's rows per sequence, or the block
/// table's pages), every page a sequence uses is `< num_pages`, and a page that receives
/// appended tokens is referenced once. `block_table` is `[batch, max_pages]` (paged only).
pub fn check_cache_layout(p: &DecodeProblem, layout: CacheLayout, block_table: &[u32]) -> Result<(), KvCacheRule> {
    match layout {
        CacheLayout::Contiguous { seq_cache } => {
            for b in 0..p.batch as usize {
                if p.cache_end(b) > seq_cache {
                    return Err(KvCacheRule::Capacity {
                        batch: b,
                        cache_seqlen: p.cache_seqlens[b],
                        new: p.seq_new,
                        seq_cache,
                    });
                }
            }
        }
        CacheLayout::Paged { page_size, num_pages, max_pages } => {
            let need = p.batch as u64 * max_pages as u64;
            if block_table.len() as u64 != need {
                return Err(KvCacheRule::BlockTableSize { got: block_table.len(), batch: p.batch, max_pages, need });
            }
            let mut refs = std::collections::HashMap::<u32, u32>::new();
            let mut written = std::collections::HashSet::<u32>::new();
            for b in 0..p.batch as usize {
                let need = p.pages_needed(b, page_size);
                if need > max_pages {
                    return Err(KvCacheRule::Pages {
                        batch: b,
                        cache_seqlen: p.cache_seqlens[b],
                        new: p.seq_new,
                        need,
                        page_size,
                        max_pages,
                    });
                }
                for s in 0..need as usize {
                    let page = block_table[b * max_pages as usize + s];
                    if page >= num_pages {
                        return Err(KvCacheRule::PagePastEnd { batch: b, slot: s, page, num_pages });
                    }
                    *refs.entry(page).or_default() += 1;
                    let (lo, hi) = (s as u32 * page_size, (s as u32 + 1) * page_size);
                    if p.seq_new > 0 && hi > p.cache_seqlens[b] && lo < p.seqlen_k(b) {
                        written.insert(page);
                    }
                }
            }
            if let Some(&page) = written.iter().find(|pg| refs[pg] > 1) {
                return Err(KvCacheRule::SharedWrittenPage { page });
            }
        }
    }
    Ok(())
}

/// The f64 reference of a decode call: the rows of [`crate::reference::reference`]'s routine
/// (one query row's attention, shared with prefill), laid out as the decode outputs are, and the
/// bounds [`verify_decode`] judges an output by.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeReference {
    /// `[batch, seq_q, heads, head_dim]`.
    pub o: Vec<f64>,
    /// `[batch, heads, seq_q]`, natural log, `-inf` for a row that sees nothing.
    pub lse: Vec<f64>,
    /// Per element like `o`, `Σ_j P_j |v_j|`: the row-local magnitude O's rounding error scales
    /// with ([`crate::reference::Reference::o_abs`]); the bounds of each row are relative to it.
    pub o_abs: Vec<f64>,
    /// Per element like `o`, the part an f32 kernel may lose to underflow (keys whose weight is
    /// below [`crate::reference::UNDERFLOW_WEIGHT`] of the row's largest; see
    /// [`crate::reference::Reference::o_under`]): a sink far above the scores makes O 0.
    pub o_under: Vec<f64>,
    /// The bounds of [`verify_decode`]: the prefill's limit rule for the dtype
    /// ([`crate::verify::tolerance_for`]: f32 bounds grown with the scores; bf16/f16 twice naive
    /// attention in the dtype on the same inputs), each row bound no looser than decode's own
    /// rule before the two were one ([`DECODE_ROW_MAX_ABS_F32`], [`DECODE_LSE_ROW_MAX_ABS`]).
    pub tolerance: Tolerance,
}

/// The largest a decode row's `max |o_r − ref_r| / max a_r` may be in an f32 run, whatever the
/// shared rule allows (the bound decode had before it took the prefill's rule); bf16/f16 runs
/// add `2u` (`u` the dtype's unit roundoff).
pub const DECODE_ROW_MAX_ABS_F32: f64 = 1e-4;

/// The largest a decode row's LSE error `|lse_r − ref_r| / max(1, |ref_r|)` may be, whatever the
/// shared rule allows (the bound decode had before it took the prefill's rule).
pub const DECODE_LSE_ROW_MAX_ABS: f64 = 1e-4;

/// The rows of a decode call in the order of [`crate::reference::RowSelection::All`] for a
/// problem of `batch`, `heads`, `seq_q`: sequence, then head, then query token (the order of
/// the LSE, `[batch, heads, seq_q]`).
fn decode_row_ids(p: &DecodeProblem) -> Vec<RowId> {
    let mut rows = Vec::with_capacity(p.rows() as usize);
    for b in 0..p.batch {
        for h in 0..p.heads {
            rows.extend((0..p.seq_q).map(|i| RowId { b, h, i }));
        }
    }
    rows
}

/// The mask and score rules of head `h` of sequence `b`: bottom-right causal and window as
/// prefill's, the soft cap, the slope of [`DecodeInputs::alibi_slopes`] and the head's sink.
#[inline(always)]
fn decode_rules(p: &DecodeProblem, x: &DecodeInputs, b: usize, h: usize) -> RowRules {
    RowRules {
        mask: Mask { causal: p.causal, window: (p.window_left, p.window_right) },
        scale: p.softmax_scale() as f64,
        softcap: p.softcap as f64,
        slope: crate::reference::alibi_slope(&x.alibi_slopes, p.heads as usize, b, h),
        sink: if p.sinks { x.sinks[h] as f64 } else { f64::NEG_INFINITY },
    }
}

/// Element offsets of key `j` of sequence `b`, KV head `kv`: `(true, at)` in the cache (row
/// `cache_leftpad[b] + j` of its slot or page) for the first `cache_seqlens[b] - leftpad` keys,
/// then `(false, at)` in `k_new`/`v_new`: the concatenation, independent of the append kernel.
#[inline(always)]
fn key_offset(p: &DecodeProblem, x: &DecodeInputs, b: usize, kv: usize, j: usize) -> (bool, usize) {
    let (d, hk) = (p.head_dim as usize, p.heads_kv as usize);
    let (pad, cached) = (p.leftpad(b), p.cache_seqlens[b] - p.leftpad(b));
    if (j as u32) < cached {
        (true, x.row_offset(p, b, pad + j as u32).expect("validated") + kv * d)
    } else {
        (false, ((b * p.seq_new as usize + (j - cached as usize)) * hk + kv) * d)
    }
}

/// The query, K-row and V-row sources of decode row `row`, for [`attention_row`] and
/// [`crate::verify::naive_attention_row`]: `(q, k_row, v_row, of)` with `of` the (sequence, KV
/// head) pair the keys belong to.
#[inline(always)]
#[allow(clippy::type_complexity)]
fn decode_row_inputs<'a>(
    p: &'a DecodeProblem,
    x: &'a DecodeInputs,
    row: &RowId,
) -> (&'a [f32], impl Fn(usize) -> &'a [f32], impl Fn(usize) -> &'a [f32], (u32, u32)) {
    let (b, h, i) = (row.b as usize, row.h as usize, row.i as usize);
    let (hh, d, sq) = (p.heads as usize, p.head_dim as usize, p.seq_q as usize);
    let kv = h / p.group() as usize;
    let q = &x.q[((b * sq + i) * hh + h) * d..][..d];
    let k_row = move |j: usize| match key_offset(p, x, b, kv, j) {
        (true, at) => &x.k_cache[at..at + d],
        (false, at) => &x.k_new[at..at + d],
    };
    let v_row = move |j: usize| match key_offset(p, x, b, kv, j) {
        (true, at) => &x.v_cache[at..at + d],
        (false, at) => &x.v_new[at..at + d],
    };
    (q, k_row, v_row, (row.b, kv as u32))
}

widest_vectors! {
    /// The decode rows `rs` one after the other, by the prefill reference's row routine
    /// ([`attention_row`]): O, its scale and its underflow part into `oc`, `ac`, `uc`
    /// (`head_dim` values per row), the LSE into `lc`.
    fn decode_reference_rows / decode_reference_rows_baseline(
        p: &DecodeProblem,
        x: &DecodeInputs,
        rs: &[RowId],
        oc: &mut [f64],
        ac: &mut [f64],
        uc: &mut [f64],
        lc: &mut [f64],
    ) {
        let d = p.head_dim as usize;
        let mut scores = vec![f64::NEG_INFINITY; p.max_seqlen_k() as usize];
        let mut keys = KeysByDim::default();
        for (k, row) in rs.iter().enumerate() {
            let at = k * d..(k + 1) * d;
            let out = RowOut { o: &mut oc[at.clone()], abs: &mut ac[at.clone()], under: &mut uc[at] };
            let rules = decode_rules(p, x, row.b as usize, row.h as usize);
            let (q, k_row, v_row, of) = decode_row_inputs(p, x, row);
            let lens = (p.seq_q, p.seqlen_k(row.b as usize));
            lc[k] = attention_row(&rules, lens, row.i, q, &mut keys, of, k_row, v_row, &mut scores, out);
        }
    }
}

widest_vectors! {
    /// The decode rows `rs` as naive attention in the dtype computes them
    /// ([`crate::verify::naive_attention_row`], the baseline of the 16-bit bounds): O into `oc`
    /// (`head_dim` values per row, left as they are for a row that sees nothing), LSE into `lc`.
    fn decode_naive_rows / decode_naive_rows_baseline(
        p: &DecodeProblem,
        x: &DecodeInputs,
        rs: &[RowId],
        oc: &mut [f32],
        lc: &mut [f32],
    ) {
        let d = p.head_dim as usize;
        let (mut e, mut acc) = (vec![0f32; p.max_seqlen_k() as usize], vec![0f32; d]);
        let mut keys = KeysByDim::default();
        for (k, row) in rs.iter().enumerate() {
            let rules = decode_rules(p, x, row.b as usize, row.h as usize);
            let (q, k_row, v_row, of) = decode_row_inputs(p, x, row);
            let lens = (p.seq_q, p.seqlen_k(row.b as usize));
            let naive = crate::verify::naive_attention_row(
                p.dtype, &rules, lens, row.i, q, &mut keys, of, k_row, v_row, &mut e, &mut acc,
            );
            if let Some(l) = naive {
                oc[k * d..(k + 1) * d].copy_from_slice(&acc);
                lc[k] = l;
            }
        }
    }
}

/// Attention in f64 over the cache's first `cache_seqlens[b]` keys followed by `k_new` (the
/// concatenation, independent of the append kernel), by the prefill reference's row routine: a
/// decode step is a prefill of `seq_q` queries over the sequence's `seqlen_k` keys with the
/// same bottom-right mask, and gives the same bits.
///
/// An FP8 cache ([`DecodeProblem::kv_fp8`]) is attended over the values its bytes hold
/// ([`DecodeInputs::dequantised`], the f64 decode of [`fp8_value_f64`]).
pub fn reference(p: &DecodeProblem, x: &DecodeInputs) -> DecodeReference {
    if p.rotary.is_some() {
        return reference(&DecodeProblem { rotary: None, ..p.clone() }, &x.rotated(p));
    }
    if p.kv_fp8.is_some() {
        let deq = x.dequantised(p);
        return reference(&DecodeProblem { kv_fp8: None, ..p.clone() }, &deq);
    }
    let r = reference_rows(p, x);
    let tolerance = decode_tolerance(p, x, &r);
    // Rows (b, h, i) to O's `[batch, seq_q, heads, head_dim]`; the LSE is in row order already.
    let (h, d, sq) = (p.heads as usize, p.head_dim as usize, p.seq_q as usize);
    let bshd = |rows: &[f64]| {
        let mut out = vec![0f64; rows.len()];
        for (k, row) in r.rows.iter().enumerate() {
            let at = ((row.b as usize * sq + row.i as usize) * h + row.h as usize) * d;
            out[at..at + d].copy_from_slice(&rows[k * d..(k + 1) * d]);
        }
        out
    };
    let (o, o_abs, o_under) = (bshd(&r.o), bshd(&r.o_abs), bshd(&r.o_under));
    DecodeReference { o, lse: r.lse, o_abs, o_under, tolerance }
}

/// The reference rows of a decode call without rotary or FP8 (those are applied to the inputs
/// first), in the order of [`decode_row_ids`], as [`crate::reference::Reference`] holds them.
fn reference_rows(p: &DecodeProblem, x: &DecodeInputs) -> Reference {
    let rows = decode_row_ids(p);
    let d = p.head_dim as usize;
    let work = p.max_seqlen_k().max(1) as usize * d;
    let ([o, o_abs, o_under], lse) = rows_on_cores(&rows, work, d, (0.0, 0.0), |rs, [oc, ac, uc], lc| {
        decode_reference_rows(p, x, rs, oc, ac, uc, lc)
    });
    Reference { rows, o, lse, o_abs, o_under, total_rows: p.rows() }
}

/// The bounds of a decode call: the shared limit rule of its dtype
/// ([`crate::verify::tolerance_for`]'s, here with the decode rows' naive baseline), each row bound
/// capped at what decode's own rule allowed before ([`DECODE_ROW_MAX_ABS_F32`] plus `2u` for
/// bf16/f16, [`DECODE_LSE_ROW_MAX_ABS`]) so that no decode output it failed passes.
fn decode_tolerance(p: &DecodeProblem, x: &DecodeInputs, r: &Reference) -> Tolerance {
    let d = p.head_dim as usize;
    let mut tol = crate::verify::tolerance_rule(p.dtype, &r.o, &r.lse, p.max_seqlen_k(), || {
        let work = p.max_seqlen_k().max(1) as usize * d;
        let ([o], lse) = rows_on_cores(&r.rows, work, d, (0.0, f32::NEG_INFINITY), |rs, [oc], lc| {
            decode_naive_rows(p, x, rs, oc, lc)
        });
        crate::verify::baseline_errors(&o, &lse, r, d)
    });
    let legacy = if p.dtype.is_16bit() { 2.0 * p.dtype.unit_roundoff() } else { 0.0 } + DECODE_ROW_MAX_ABS_F32;
    tol.row_max_abs = tol.row_max_abs.min(legacy);
    tol.lse_row_max_abs = tol.lse_row_max_abs.min(DECODE_LSE_ROW_MAX_ABS);
    tol
}

/// Errors of a decode run against the reference.
#[derive(Clone, Debug, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct DecodeVerification {
    /// Every bound met and no failure (`failures` empty).
    pub passed: bool,
    /// Largest `max |o_r − ref_r| / max a_r` over the rows (`a_r` the row's `Σ P |v|`;
    /// [`crate::verify::row_errors`]).
    pub o_max_scaled_err: f64,
    /// `sqrt(Σ err² / Σ ref²)` over the elements of O.
    pub o_rel_rms_err: f64,
    /// Largest `|lse - ref| / max(1, |ref|)` over rows with a finite reference LSE.
    pub lse_max_abs_err: f64,
    /// Elements NaN or infinite where the reference is finite (never written, or corrupted).
    pub unwritten: u64,
    /// Rows whose LSE is `-inf` on one side only.
    pub lse_inf_mismatches: u64,
    /// Bound on `o_max_scaled_err` ([`Tolerance::row_max_abs`] of `tolerance`).
    pub o_bound: f64,
    /// Bound on `|lse - ref| / max(1, |ref|)` ([`Tolerance::lse_row_max_abs`] of `tolerance`).
    pub lse_bound: f64,
    /// Every bound the output was judged against ([`DecodeReference::tolerance`]; `None` only in
    /// a default value).
    pub tolerance: Option<Tolerance>,
    /// The checked row closest to (or furthest over) its bounds ([`crate::verify::Verification`]).
    pub worst_row: Option<WorstRow>,
    /// The updated cache equals the expected append (bit for bit), when there were new tokens.
    pub cache_ok: Option<bool>,
    /// FP8 cache: the relative RMS error of O against the reference over the unquantised
    /// cache (what quantisation costs; reported, not bounded). `None` for other caches.
    pub quantisation_rel_rms: Option<f64>,
    /// One sentence per check that failed; empty when `passed`.
    pub failures: Vec<String>,
}

/// Compares O (`[batch, seq_q, heads, head_dim]`) and LSE (`[batch, heads, seq_q]`) with the
/// reference by the acceptance rule every attention output has ([`crate::verify::verify`]'s):
/// every row against its own scale and the whole tensor, within [`DecodeReference::tolerance`].
pub fn verify_decode(p: &DecodeProblem, o: &[f32], lse: &[f32], r: &DecodeReference) -> DecodeVerification {
    let (h, d, sq) = (p.heads as usize, p.head_dim as usize, p.seq_q as usize);
    let rows = decode_row_ids(p);
    let pairs = rows.iter().enumerate().map(|(k, row)| {
        let at = ((row.b as usize * sq + row.i as usize) * h + row.h as usize) * d..;
        let want = RefRow {
            o: &r.o[at.clone()][..d],
            abs: &r.o_abs[at.clone()][..d],
            under: &r.o_under[at.clone()][..d],
            lse: r.lse[k],
        };
        RowPair { row: *row, o: &o[at][..d], lse: lse[k], want }
    });
    let (mut o_max, mut lse_max) = (0f64, 0f64);
    for pair in pairs.clone() {
        let (_, abs, l) = crate::verify::row_errors_of(pair.o, pair.lse, &pair.want);
        (o_max, lse_max) = (o_max.max(abs), lse_max.max(l));
    }
    let v = judge(pairs, &r.tolerance, p.rows());
    DecodeVerification {
        passed: v.passed,
        o_max_scaled_err: o_max,
        o_rel_rms_err: v.o.rel_rms_err,
        lse_max_abs_err: lse_max,
        unwritten: v.unwritten,
        lse_inf_mismatches: v.lse_inf_mismatches,
        o_bound: r.tolerance.row_max_abs,
        lse_bound: r.tolerance.lse_row_max_abs,
        tolerance: Some(r.tolerance),
        worst_row: v.worst_row,
        cache_ok: None,
        quantisation_rel_rms: None,
        failures: v.failures,
    }
}

/// A decode problem whose sequences share their first `prefix` cached keys, split into one
/// prefix cache and per-sequence suffix caches for
/// [`crate::attn::Kernels::flash_attn_with_shared_prefix_into`] (docs/semantics.md, "Shared
/// prefix"). The f64 reference of the split call is the plain [`reference()`] of the whole problem:
/// each sequence attends over `prefix ++ suffix`.
#[derive(Clone, Debug)]
pub struct SharedPrefix {
    /// Keys in the prefix.
    pub prefix: u32,
    /// The prefix's keys, `[1, prefix, heads_kv, head_dim]`.
    pub prefix_k: Vec<f32>,
    /// The prefix's values, laid out as `prefix_k`.
    pub prefix_v: Vec<f32>,
    /// The suffix problem: `cache_seqlens[b] - prefix` cached keys per sequence, the same query,
    /// new tokens and options.
    pub suffix: DecodeProblem,
    /// The suffix inputs: a contiguous cache of the keys after the prefix (`seq_cache` reduced by
    /// `prefix`), the query, new tokens and sinks unchanged.
    pub suffix_inputs: DecodeInputs,
}

impl SharedPrefix {
    /// Makes the first `prefix` cached keys and values of every sequence of `x` those of sequence
    /// 0 (in place: the whole problem is then the reference of the split one), and splits them
    /// off. A contiguous cache without slots, left padding, FP8, rotary, ALiBi or a window
    /// ([`KvCacheRule::SharedPrefixOption`]); `1 <= prefix <= min cache_seqlens`
    /// ([`KvCacheRule::SharedPrefixLength`]).
    pub fn split(p: &DecodeProblem, x: &mut DecodeInputs, prefix: u32) -> Result<SharedPrefix, KvCacheRule> {
        let refuse = |option| Err(KvCacheRule::SharedPrefixOption { option });
        let seq_cache = match x.layout {
            CacheLayout::Contiguous { seq_cache } => seq_cache,
            CacheLayout::Paged { .. } => {
                return refuse("a paged cache here (the library call takes one; this split builds contiguous caches)")
            }
        };
        if p.cache_batch_idx.is_some() {
            return refuse("cache_batch_idx");
        }
        if p.cache_leftpad.is_some() {
            return refuse("cache_leftpad");
        }
        if p.kv_fp8.is_some() {
            return refuse("an FP8 cache");
        }
        if p.rotary.is_some() {
            return refuse("a rotary embedding");
        }
        if p.alibi {
            return refuse("ALiBi slopes");
        }
        if p.window_left >= 0 || (p.window_right >= 0 && !p.causal) {
            return refuse("a window");
        }
        if p.kernel == DecodeKernel::Prefill {
            return refuse("the prefill kernel (it writes no partial states)");
        }
        if let Some((batch, &cache_seqlen)) = p
            .cache_seqlens
            .iter()
            .enumerate()
            .find(|&(_, &l)| l < prefix)
            .or(if prefix == 0 { Some((0, &0)) } else { None })
        {
            return Err(KvCacheRule::SharedPrefixLength { prefix, batch, cache_seqlen });
        }
        let row = (p.heads_kv * p.head_dim) as usize;
        let n = prefix as usize * row;
        let (sc, pc) = (seq_cache as usize * row, n);
        for b in 1..p.batch as usize {
            let (k0, v0) = (x.k_cache[..pc].to_vec(), x.v_cache[..pc].to_vec());
            x.k_cache[b * sc..b * sc + pc].copy_from_slice(&k0);
            x.v_cache[b * sc..b * sc + pc].copy_from_slice(&v0);
        }
        let rest = (seq_cache - prefix) as usize * row;
        let tail =
            |c: &[f32]| (0..p.batch as usize).flat_map(|b| c[b * sc + pc..b * sc + pc + rest].to_vec()).collect();
        let suffix =
            DecodeProblem { cache_seqlens: p.cache_seqlens.iter().map(|&l| l - prefix).collect(), ..p.clone() };
        let suffix_inputs = DecodeInputs {
            k_cache: tail(&x.k_cache),
            v_cache: tail(&x.v_cache),
            layout: CacheLayout::Contiguous { seq_cache: seq_cache - prefix },
            ..x.clone()
        };
        Ok(SharedPrefix {
            prefix,
            prefix_k: x.k_cache[..n].to_vec(),
            prefix_v: x.v_cache[..n].to_vec(),
            suffix,
            suffix_inputs,
        })
    }

    /// Bytes of the prefix's K and V (`2 · prefix · heads_kv · head_dim` elements of `elem_bytes`).
    pub fn prefix_bytes(&self, elem_bytes: u64) -> u64 {
        2 * self.prefix_k.len() as u64 * elem_bytes
    }
}

/// Element counts of a decode call's tensors ([`DecodeProblem::sizes`]), each known to fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeSizes {
    /// Q and O (`batch * seq_q * heads * head_dim`).
    pub q: u64,
    /// Output rows (`batch * heads * seq_q`): LSE.
    pub rows: u64,
    /// Each of K and V cache as [`DecodeInputs::random`] lays it out.
    pub cache: u64,
    /// Each of `k_new` and `v_new`.
    pub new: u64,
    /// Block-table entries (0 for a contiguous cache).
    pub block_table: u64,
    /// Pages of a paged cache (0 for a contiguous one) and the block table's pages per sequence.
    pub num_pages: u32,
    /// Block-table entries per sequence (0 for a contiguous cache).
    pub max_pages: u32,
    /// Split workspace elements (f32 partial O and LSE; 0 with one split).
    pub workspace: u64,
}

impl DecodeSizes {
    /// Device bytes of the call: cache, Q, O, LSE, new tokens, block table, cache lengths, the
    /// split workspace (saturating: a sum past 2^64 is no fit anyway).
    pub fn device_bytes(&self, p: &DecodeProblem) -> u64 {
        let es = p.dtype.size_bytes();
        [
            self.cache.saturating_mul(2 * p.cache_elem_bytes()),
            self.q.saturating_mul(2 * es),
            self.rows.saturating_mul(4),
            self.new.saturating_mul(2 * es),
            self.block_table.saturating_mul(4),
            p.batch as u64 * 4,
            if p.sinks { p.heads as u64 * 4 } else { 0 },
            if p.alibi { p.heads as u64 * 4 } else { 0 },
            self.workspace.saturating_mul(4),
        ]
        .iter()
        .fold(0u64, |a, &x| a.saturating_add(x))
    }

    /// Host bytes a measured run holds at its peak: the f32 inputs, the cache expected after the
    /// append and the one downloaded (f32 each) plus its encoded copy, Q encoded, O downloaded
    /// (encoded and f32) and the f64 reference as [`reference()`] builds it (O, its scale and its
    /// underflow part in row order and laid out as O, the LSE, and naive attention's O and LSE
    /// for the bounds).
    pub fn host_bytes(&self, p: &DecodeProblem) -> u64 {
        let es = p.dtype.size_bytes();
        [
            self.cache.saturating_mul(2 * (4 + 4 + 4 + es)),
            self.q.saturating_mul(4 + es + es + 4 + 6 * 8 + 4),
            self.rows.saturating_mul(4 + 8 + 4),
            self.new.saturating_mul(2 * (4 + es)),
            self.block_table.saturating_mul(4),
        ]
        .iter()
        .fold(0u64, |a, &x| a.saturating_add(x))
    }
}

/// Device bytes of a decode call, stated before it runs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct DecodeBytes {
    /// K and V cache as allocated (both tensors).
    pub kv_cache: u64,
    /// K and V bytes of the keys the sequences hold (`Σ seqlen_k` rows): what attention reads.
    pub kv_used: u64,
    /// `kv_cache - kv_used`: padding of a contiguous cache to the longest sequence, or the
    /// unused rows of the sequences' last pages (internal fragmentation) of a paged cache.
    pub kv_unused: u64,
    /// The same cache, contiguous (`batch * max seqlen_k` rows) and paged with the problem's page
    /// size (or 16 for a contiguous problem): the comparison the CLI prints.
    pub kv_contiguous: u64,
    /// The same cache paged with `kv_paged_page_size` keys per page.
    pub kv_paged: u64,
    /// The page size `kv_paged` is computed with.
    pub kv_paged_page_size: u32,
    /// Q.
    pub q: u64,
    /// O.
    pub o: u64,
    /// LSE (f32 per output row).
    pub lse: u64,
    /// `k_new` and `v_new` together.
    pub new_kv: u64,
    /// The block table (u32 entries; 0 for a contiguous cache).
    pub block_table: u64,
    /// `cache_seqlens` (u32 per sequence).
    pub cache_seqlens: u64,
    /// Sink logits: `4 * heads` with sinks, 0 without.
    pub sinks: u64,
    /// ALiBi slopes as the host gives them (`4` per slope), 0 without.
    pub alibi_slopes: u64,
    /// FP8 cache scales as the host gives them (`4` per scale).
    pub kv_scales: u64,
    /// Split workspace: f32 partial O and LSE, `num_splits * rows * (head_dim + 1) * 4` (0 with
    /// one split).
    pub workspace: u64,
    /// Bytes one call reads and writes at least: K/V of the keys seen, Q, O, LSE, new tokens
    /// (read and written to the cache), block table, workspace (written and read back).
    pub moved: u64,
    /// `moved / (batch * seq_q)`: per query token.
    pub moved_per_token: u64,
    /// Device bytes in all: `kv_cache + q + o + lse + new_kv + block_table + cache_seqlens + sinks +
    /// alibi_slopes + kv_scales + workspace`.
    pub total: u64,
}

impl DecodeBytes {
    /// The bytes of a call of `p` with the inputs `x` under `plan`.
    pub fn new(p: &DecodeProblem, x: &DecodeInputs, plan: &SplitPlan) -> DecodeBytes {
        let es = p.dtype.size_bytes();
        let ces = p.cache_elem_bytes();
        let row = p.heads_kv as u64 * p.head_dim as u64 * ces * 2;
        let used: u64 = (0..p.batch as usize).map(|b| p.seqlen_k(b) as u64).sum::<u64>() * row;
        let kv_cache = x.k_cache.len() as u64 * ces * 2;
        let ps_cmp = p.page_size.unwrap_or(16);
        let paged_rows: u64 = (0..p.batch as usize).map(|b| p.pages_needed(b, ps_cmp) as u64 * ps_cmp as u64).sum();
        let workspace =
            if plan.num_splits > 1 { plan.num_splits as u64 * p.rows() * (p.head_dim as u64 + 1) * 4 } else { 0 };
        // Keys read per sequence: from the first row's window start to the last row's end.
        let seen: u64 = (0..p.batch as usize)
            .map(|b| {
                let (s, _) = p.key_range(b, 0);
                let (_, e) = p.key_range(b, p.seq_q - 1);
                e.saturating_sub(s) as u64
            })
            .sum::<u64>()
            * row;
        let mut bytes = DecodeBytes {
            kv_cache,
            kv_used: used,
            kv_unused: kv_cache.saturating_sub(used),
            kv_contiguous: p.batch as u64 * p.max_seqlen_k() as u64 * row,
            kv_paged: paged_rows * row,
            kv_paged_page_size: ps_cmp,
            q: p.q_elems() * es,
            o: p.q_elems() * es,
            lse: p.rows() * 4,
            new_kv: p.new_elems() * es * 2,
            block_table: x.block_table.len() as u64 * 4,
            cache_seqlens: p.batch as u64 * 4,
            sinks: if p.sinks { 4 * p.heads as u64 } else { 0 },
            kv_scales: 4 * (x.k_scale.len() + x.v_scale.len()) as u64,
            alibi_slopes: 4 * x.alibi_slopes.len() as u64,
            workspace,
            ..Default::default()
        };
        bytes.moved = seen + bytes.q + bytes.o + bytes.lse + 2 * bytes.new_kv + bytes.block_table + 2 * workspace;
        bytes.moved_per_token = bytes.moved / (p.batch as u64 * p.seq_q as u64);
        bytes.total = bytes.kv_cache
            + bytes.q
            + bytes.o
            + bytes.lse
            + bytes.new_kv
            + bytes.block_table
            + bytes.cache_seqlens
            + bytes.sinks
            + bytes.alibi_slopes
            + bytes.kv_scales
            + bytes.workspace;
        bytes
    }
}

/// The variant table's element type of an FP8 cache (bf16 Q and O).
pub const fn fp8_elem(f: Fp8Format) -> kernels_gpu::Elem {
    match f {
        Fp8Format::E4m3 => kernels_gpu::Elem::Fp8E4m3,
        Fp8Format::E5m2 => kernels_gpu::Elem::Fp8E5m2,
    }
}

/// The value of an FP8 code in f64, from the format's fields (written apart from the kernels'
/// bit-level decode, so the two can disagree): `(-1)^s 2^(e - bias) (1 + m / 2^M)`, subnormals
/// `(-1)^s 2^(1 - bias) m / 2^M`; e4m3's `0x7f`/`0xff` and e5m2's all-ones exponent are NaN or
/// infinity.
pub fn fp8_value_f64(f: Fp8Format, byte: u8) -> f64 {
    let (ebits, mbits, bias) = match f {
        Fp8Format::E4m3 => (4u32, 3u32, 7i32),
        Fp8Format::E5m2 => (5, 2, 15),
    };
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((byte as u32 >> mbits) & ((1 << ebits) - 1)) as i32;
    let m = (byte as u32 & ((1 << mbits) - 1)) as f64;
    let top = (1 << ebits) - 1;
    match f {
        Fp8Format::E4m3 if e == top && m == 7.0 => return f64::NAN,
        Fp8Format::E5m2 if e == top => return if m == 0.0 { sign * f64::INFINITY } else { f64::NAN },
        _ => {}
    }
    let frac = m / (1u32 << mbits) as f64;
    if e == 0 {
        sign * frac * 2f64.powi(1 - bias)
    } else {
        sign * (1.0 + frac) * 2f64.powi(e - bias)
    }
}

/// The bytes an FP8 cache holds for `values` (`[.., heads_kv, head_dim]`, any leading shape):
/// `encode(x / scale)` with its KV head's scale (one scale per tensor or `heads_kv`).
pub fn fp8_encode_cache(f: Fp8Format, values: &[f32], scales: &[f32], heads_kv: usize, head_dim: usize) -> Vec<u8> {
    values
        .iter()
        .enumerate()
        .map(|(i, &v)| kernels_gpu::fp8::encode(f, v / DecodeInputs::fp8_scale(scales, (i / head_dim) % heads_kv)))
        .collect()
}

pub use crate::error::{MAX_FP8_SCALE, MIN_FP8_SCALE};

/// The scale rule of one FP8 tensor: one or `heads_kv` scales (none when `fp8` is false), each
/// in [`MIN_FP8_SCALE`, `MAX_FP8_SCALE`].
pub fn check_fp8_scales(tensor: &'static str, s: &[f32], heads_kv: usize, fp8: bool) -> Result<(), KvCacheRule> {
    if !fp8 {
        if !s.is_empty() {
            return Err(KvCacheRule::Fp8ScaleCount { tensor, got: s.len(), heads_kv, fp8 });
        }
        return Ok(());
    }
    if s.len() != 1 && s.len() != heads_kv {
        return Err(KvCacheRule::Fp8ScaleCount { tensor, got: s.len(), heads_kv, fp8 });
    }
    if let Some((index, &got)) = s.iter().enumerate().find(|(_, v)| !(MIN_FP8_SCALE..=MAX_FP8_SCALE).contains(*v)) {
        return Err(KvCacheRule::Fp8Scale { tensor, index, got });
    }
    Ok(())
}

/// Relative RMS difference `sqrt(Σ (o - r)^2 / Σ r^2)` of an output against a reference O (the
/// quantisation error of an FP8 cache: the kernel's O against the unquantised reference).
pub fn rel_rms(o: &[f32], r: &[f64]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in o.iter().zip(r) {
        num += (g as f64 - w) * (g as f64 - w);
        den += w * w;
    }
    if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    }
}

/// The launches of one decode call on a device that runs `target`, in order.
pub fn planned_launches(
    p: &DecodeProblem,
    plan: &SplitPlan,
    target: impl Into<crate::problem::Target>,
) -> Result<Vec<(KernelId, LaunchDims)>, KvCacheRule> {
    let [fwd, merge, append] = p.kernels_on(target)?;
    let mut out = Vec::new();
    if p.rotary.is_some() {
        let rotary = KernelId::find(Family::DecodeRotary, p.dtype.elem(), None)
            .ok_or(KvCacheRule::RotaryDtype { dtype: p.dtype })?;
        out.push((rotary, APPEND.launch(p.seq_q + p.seq_new, p.batch)));
    }
    if p.seq_new > 0 {
        out.push((append, APPEND.launch(p.seq_new, p.batch)));
    }
    out.push((fwd, p.forward_launch(plan.num_splits)?));
    if plan.num_splits > 1 {
        out.push((merge, MERGE.launch(p.rows())));
    }
    Ok(out)
}

/// Device addresses of one decode call (0 where unused: no new tokens, a contiguous cache, one
/// split).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeBuffers {
    /// Q, `[batch, seq_q, heads, head_dim]`.
    pub q: DevPtr,
    /// The K cache.
    pub k_cache: DevPtr,
    /// The V cache.
    pub v_cache: DevPtr,
    /// New keys, `[batch, seq_new, heads_kv, head_dim]` (`0` = none).
    pub k_new: DevPtr,
    /// New values, as `k_new`.
    pub v_new: DevPtr,
    /// The block table, `[batch, max_pages]` (`0` = contiguous cache).
    pub block_table: DevPtr,
    /// Keys already cached per sequence, `batch` u32.
    pub cache_seqlens: DevPtr,
    /// O, `[batch, seq_q, heads, head_dim]`.
    pub o: DevPtr,
    /// LSE, `[batch, heads, seq_q]` f32.
    pub lse: DevPtr,
    /// Split workspace: partial O, `[num_splits, batch, heads, seq_q, head_dim]` f32 (`0` with one split).
    pub o_part: DevPtr,
    /// Split workspace: partial LSE, `[num_splits, batch, heads, seq_q]` f32 (`0` with one split).
    pub lse_part: DevPtr,
    /// Per-head f32 sink logits (`0` = none).
    pub sinks: DevPtr,
    /// FP8 cache: `heads_kv` f32 scales of K and of V (`0` for other caches).
    pub k_scale: DevPtr,
    /// FP8 cache: the scales of V (`0` for other caches).
    pub v_scale: DevPtr,
    /// `batch` u32 cache slots (`0` = none; contiguous caches only).
    pub cache_batch_idx: DevPtr,
    /// `batch` u32 rows of left padding (`0` = none; contiguous caches only).
    pub cache_leftpad: DevPtr,
    /// Rotary tables `[seqlen_ro, rotary_dim / 2]` and the rotated copies of `q` and `k_new`
    /// (`0` = no rotary).
    pub rotary_cos: DevPtr,
    /// The rotary sine table (`0` = no rotary).
    pub rotary_sin: DevPtr,
    /// Where the rotated `q` goes, shaped as `q` (`0` = no rotary).
    pub q_rot: DevPtr,
    /// Where the rotated `k_new` goes, shaped as `k_new` (`0` = no rotary).
    pub k_rot: DevPtr,
    /// ALiBi slopes (f32, `[heads]` or `[batch, heads]`; `0` = none) and the elements between two
    /// sequences' slopes (0 or `heads`).
    pub alibi_slopes: DevPtr,
    /// Elements between two sequences' ALiBi slopes (0 or `heads`).
    pub alibi_batch_stride: u32,
    /// Device-checked indices: the call's status words (`0`: indices checked on the host) and
    /// the cache's first dimension (pages of a paged cache, slots of a contiguous one), the bound
    /// `decode_check_*` holds block-table and `cache_batch_idx` entries to.
    pub status: DevPtr,
    /// The cache's first dimension (pages, or slots) the device check bounds indices by.
    pub cache_slots: u32,
}

/// The [`DecodeParams`] of a call: the one place they are built (the `memattn decode` command's run and
/// the library's [`crate::attn::Kernels::flash_attn_with_kvcache`] both use it).
pub fn decode_params(p: &DecodeProblem, layout: CacheLayout, num_splits: u32, bufs: &DecodeBuffers) -> DecodeParams {
    let (seq_cache, page_size, max_pages) = match layout {
        CacheLayout::Contiguous { seq_cache } => (seq_cache, 0, 0),
        CacheLayout::Paged { page_size, max_pages, .. } => (0, page_size, max_pages),
    };
    DecodeParams {
        q: bufs.q,
        k_cache: bufs.k_cache,
        v_cache: bufs.v_cache,
        k_new: bufs.k_new,
        v_new: bufs.v_new,
        block_table: bufs.block_table,
        cache_seqlens: bufs.cache_seqlens,
        o: bufs.o,
        lse: bufs.lse,
        o_part: bufs.o_part,
        lse_part: bufs.lse_part,
        batch: p.batch,
        heads: p.heads,
        heads_kv: p.heads_kv,
        seq_q: p.seq_q,
        head_dim: p.head_dim,
        seq_cache,
        page_size,
        max_pages,
        seq_new: p.seq_new,
        num_splits,
        causal: p.causal as u32,
        softmax_scale: p.softmax_scale(),
        window_left: p.window_left,
        window_right: p.window_right,
        softcap: p.softcap,
        cache_slots: bufs.cache_slots,
        sinks: bufs.sinks,
        k_scale: bufs.k_scale,
        v_scale: bufs.v_scale,
        cache_batch_idx: bufs.cache_batch_idx,
        cache_leftpad: bufs.cache_leftpad,
        rotary_cos: bufs.rotary_cos,
        rotary_sin: bufs.rotary_sin,
        q_rot: bufs.q_rot,
        k_rot: bufs.k_rot,
        rotary_dim: p.rotary.map_or(0, |r| r.dim),
        rotary_interleaved: p.rotary.is_some_and(|r| r.interleaved) as u32,
        seqlen_ro: if p.rotary.is_some() { p.rotary_rows() } else { 0 },
        rotary_q_per_token: p.rotary_q_per_token() as u32,
        alibi_slopes: bufs.alibi_slopes,
        alibi_batch_stride: bufs.alibi_batch_stride,
        _pad2: 0,
        status: bufs.status,
    }
}

/// The [`kernels_gpu::abi::AttnParams`] of a call on the prefill kernel
/// ([`DecodeKernel::Prefill`]): Q, O `[batch, seq_q, heads, d]`, LSE `[batch, heads, seq_q]`,
/// the cache read in place (contiguous: `[batch, seq_cache, heads_kv, d]`; paged: pages through
/// the block table), sequence `b` seeing `cache_seqlens[b] + seq_new` keys (the append ran
/// first). The one place they are built, as [`decode_params`] is for the decode kernels.
pub fn prefill_params(p: &DecodeProblem, layout: CacheLayout, bufs: &DecodeBuffers) -> AttnParams {
    let (h, hk, d) = (p.heads as u64, p.heads_kv as u64, p.head_dim as u64);
    let (kv_strides, page_size, max_pages) = match layout {
        // A contiguous cache is one page per sequence, every key in it (`page_size` 2^31).
        CacheLayout::Contiguous { seq_cache } => (Strides::bshd(seq_cache as u64, hk, d), 1 << 31, 0),
        CacheLayout::Paged { page_size, max_pages, .. } => {
            (Strides::bshd(page_size as u64, hk, d), page_size, max_pages)
        }
    };
    let qo = Strides::bshd(p.seq_q as u64, h, d);
    let problem = crate::problem::Problem {
        batch: p.batch,
        heads: p.heads,
        seq_q: p.seq_q,
        // Each sequence's own count comes from `seqused_k`; this bounds them.
        seq_kv: p.max_seqlen_k(),
        head_dim: p.head_dim,
        dtype: p.dtype,
        causal: p.causal,
        scale: Some(p.softmax_scale()),
        layout: crate::problem::Layout::Bshd,
        heads_kv: Some(p.heads_kv),
        window: (p.window_left, p.window_right),
        softcap: p.softcap,
        sinks: p.sinks,
        alibi: false,
        varlen: None,
    };
    problem.attn_params(&crate::problem::AttnBuffers {
        q: bufs.q,
        k: bufs.k_cache,
        v: bufs.v_cache,
        o: bufs.o,
        lse: bufs.lse,
        sinks: bufs.sinks,
        q_strides: qo,
        k_strides: kv_strides,
        v_strides: kv_strides,
        o_strides: qo,
        seqused_k: bufs.cache_seqlens,
        block_table: if matches!(layout, CacheLayout::Paged { .. }) { bufs.block_table } else { 0 },
        page_size,
        max_pages,
        seqused_k_add: p.seq_new,
        status: bufs.status,
        ..Default::default()
    })
}

/// The usual rotary tables (RoFormer): `cos[pos, i] = cos(pos · base^(-2i / dim))` and the
/// sine, `rows` positions by `dim / 2`, rounded to `dtype`.
pub fn rope_tables(rows: u32, dim: u32, base: f64, dtype: Dtype) -> (Vec<f32>, Vec<f32>) {
    let half = (dim / 2) as usize;
    let mut cos = Vec::with_capacity(rows as usize * half);
    let mut sin = Vec::with_capacity(rows as usize * half);
    for pos in 0..rows as usize {
        for i in 0..half {
            let angle = pos as f64 * base.powf(-2.0 * i as f64 / dim as f64);
            cos.push(dtype.round(angle.cos() as f32));
            sin.push(dtype.round(angle.sin() as f32));
        }
    }
    (cos, sin)
}

/// The [`MergeParams`] combining `splits` partial states of `rows` `[batch, heads, seq_q]` into
/// `o` (BSHD, `o_strides`) and `lse`.
pub fn merge_params(p: &DecodeProblem, splits: u32, bufs: &DecodeBuffers, o_strides: Strides) -> MergeParams {
    MergeParams {
        o_part: bufs.o_part,
        lse_part: bufs.lse_part,
        o: bufs.o,
        lse: bufs.lse,
        o_strides,
        splits,
        batch: p.batch,
        heads: p.heads,
        seq_q: p.seq_q,
        head_dim: p.head_dim,
        _pad: 0,
        status: bufs.status,
    }
}

/// Partial attention states to combine: `splits` states per row of `[batch, heads, seq_q]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Partials {
    /// States per row.
    pub splits: u32,
    /// Sequences in the batch.
    pub batch: u32,
    /// Heads.
    pub heads: u32,
    /// Query rows per sequence.
    pub seq_q: u32,
    /// Elements per head of O.
    pub head_dim: u32,
    /// `[splits, batch, heads, seq_q, head_dim]` f32.
    pub o: Vec<f32>,
    /// `[splits, batch, heads, seq_q]` f32, natural log (`-inf`: the state saw no key).
    pub lse: Vec<f32>,
}

impl Partials {
    /// Output rows, `batch * heads * seq_q`.
    pub fn rows(&self) -> u64 {
        self.batch as u64 * self.heads as u64 * self.seq_q as u64
    }
    /// Checks the shape and values (finite O, LSE finite or `-inf`).
    pub fn check(&self) -> Result<(), Error> {
        let rows = self.rows();
        if self.splits == 0 || rows == 0 || self.head_dim == 0 {
            return Err(Error::Usage("merge_states: splits, batch, heads, seq_q and head_dim must be >= 1".into()));
        }
        if self.o.len() as u64 != self.splits as u64 * rows * self.head_dim as u64
            || self.lse.len() as u64 != self.splits as u64 * rows
        {
            return Err(Error::Usage(format!(
                "merge_states: partial O has {} and LSE {} elements, the shape needs {} and {}",
                self.o.len(),
                self.lse.len(),
                self.splits as u64 * rows * self.head_dim as u64,
                self.splits as u64 * rows
            )));
        }
        if self.lse.iter().any(|v| v.is_nan() || *v == f32::INFINITY) || self.o.iter().any(|v| !v.is_finite()) {
            return Err(Error::Usage("merge_states: partial LSE must be finite or -inf and partial O finite".into()));
        }
        Ok(())
    }
}

/// The combine in f64: `m = max_s lse_s` (0 if all are `-inf`), `lse = m + ln Σ e^(lse_s - m)`,
/// `O = Σ e^(lse_s - lse) O_s`; a row whose states are all `-inf` gives `O = 0`, `LSE = -inf`.
/// Returns O `[batch, seq_q, heads, head_dim]` and LSE `[batch, heads, seq_q]`.
pub fn merge_states_reference(x: &Partials) -> (Vec<f64>, Vec<f64>) {
    let (rows, d) = (x.rows() as usize, x.head_dim as usize);
    let (h, sq) = (x.heads as usize, x.seq_q as usize);
    let mut o = vec![0f64; rows * d];
    let mut lse = vec![f64::NEG_INFINITY; rows];
    for (r, lse_r) in lse.iter_mut().enumerate() {
        let l = |s: usize| x.lse[s * rows + r] as f64;
        let m = (0..x.splits as usize).map(l).fold(f64::NEG_INFINITY, f64::max);
        let m = if m == f64::NEG_INFINITY { 0.0 } else { m };
        let sum: f64 = (0..x.splits as usize).map(|s| (l(s) - m).exp()).sum();
        if sum == 0.0 {
            continue;
        }
        *lse_r = m + sum.ln();
        let (i, bh) = (r % sq, r / sq);
        let (hh, b) = (bh % h, bh / h);
        let out = &mut o[((b * sq + i) * h + hh) * d..][..d];
        for s in 0..x.splits as usize {
            let w = (l(s) - *lse_r).exp();
            for (c, oc) in out.iter_mut().enumerate() {
                *oc += w * x.o[(s * rows + r) * d + c] as f64;
            }
        }
    }
    (o, lse)
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use crate::inputs::Qkv;
    use crate::reference::RowSelection;

    pub fn heuristic_matches_flash_attention_2_on_known_cases() {
        // batch 1, 8 KV heads (32 query heads packed), d 128, 8192 keys: 8 blocks on 132 SMs,
        // 64 key blocks of 128. 15 splits is not eligible (ceil(64/15) = ceil(64/14) = 5); 16
        // gives 128 blocks, 97 % of a wave.
        assert_eq!(num_splits_heuristic(8, 132, 64, 128), 16);
        // Already >= 80 % of the SMs: one split.
        assert_eq!(num_splits_heuristic(106, 132, 64, 128), 1);
        // 105 blocks: 1-4 splits all give 0.795 of a wave; 5 gives 525 / 528 = 0.994.
        assert_eq!(num_splits_heuristic(105, 132, 64, 128), 5);
        // Few key blocks cap the count.
        assert_eq!(num_splits_heuristic(1, 132, 3, 128), 3);
        assert_eq!(num_splits_heuristic(1, 132, 0, 128), 1);
    }

    pub fn the_benchmark_plan_fills_the_modelled_gpu() {
        let p = DecodeProblem {
            batch: 1,
            heads: 32,
            heads_kv: 8,
            head_dim: 128,
            cache_seqlens: vec![8192],
            dtype: Dtype::Bf16,
            ..DecodeProblem::default()
        };
        // The tensor-core decode: 2 blocks per SM of 16 KiB key tiles, 264 / 8 = 33 splits.
        let auto = p.plan().unwrap();
        assert_eq!((auto.num_splits, auto.blocks_per_split, auto.blocks), (33, 8, 264));
        // Batch 8 x 32768: 64 blocks a split, 264 / 64 = 4 splits (FlashAttention-2's heuristic: 2).
        let long = DecodeProblem { batch: 8, cache_seqlens: vec![32768; 8], ..p.clone() }.plan().unwrap();
        assert_eq!((long.num_splits, long.blocks), (4, 256));
        assert_eq!(num_splits_heuristic(64, 132, 256, MAX_SPLITS), 2);
        // The SIMT decode keeps FlashAttention-2's heuristic.
        let simt = DecodeProblem { kernel: DecodeKernel::Simt, ..p.clone() }.plan().unwrap();
        assert_eq!(simt.num_splits, num_splits_heuristic(8, 132, 64, MAX_SPLITS));
        assert_eq!(simt.num_splits, 16);
        let one = DecodeProblem { splits: Splits::Fixed(1), ..p }.plan().unwrap();
        assert_eq!(one.blocks, 8);
        assert!((one.blocks_per_sm - 8.0 / 132.0).abs() < 1e-12);
    }

    /// The split count for bytes in flight, against the arithmetic of its rule.
    pub fn splits_keep_the_bytes_in_flight_within_one_wave() {
        // 16 KiB tiles: 2 blocks per SM; 132 SMs -> 264 slots.
        assert_eq!(splits_for_bytes_in_flight(8, 132, 16384, 64), 33);
        assert_eq!(splits_for_bytes_in_flight(64, 132, 16384, 256), 4);
        // Capped by the key blocks (a split gets at least one) and by MAX_SPLITS.
        assert_eq!(splits_for_bytes_in_flight(8, 132, 16384, 5), 5);
        assert_eq!(splits_for_bytes_in_flight(1, 132, 16384, 1000), MAX_SPLITS);
        // Blocks that already fill the slots, or more: one split.
        assert_eq!(splits_for_bytes_in_flight(264, 132, 16384, 64), 1);
        assert_eq!(splits_for_bytes_in_flight(1000, 132, 16384, 64), 1);
        // A 32 KiB tile is the whole target: one block per SM; an 8 KiB one would want 4, capped at 2.
        assert_eq!(splits_for_bytes_in_flight(8, 132, 32768, 64), 16);
        assert_eq!(splits_for_bytes_in_flight(8, 132, 8192, 64), 33);
        // Never more blocks than the resident slots.
        for (blocks, key_blocks) in [(1u64, 300u32), (7, 300), (100, 300), (131, 300), (133, 300)] {
            let s = splits_for_bytes_in_flight(blocks, 132, 16384, key_blocks) as u64;
            assert!(s == 1 || blocks * s <= 264, "{blocks} blocks x {s} splits");
        }
    }

    pub fn sizes_are_exact_and_refuse_what_does_not_fit() {
        // Paged: pages ceil(100/16) + ceil(37/16) = 7 + 3 = 10 of 16 rows; rows of 2 x 64.
        let p = DecodeProblem {
            batch: 2,
            cache_seqlens: vec![100, 37],
            page_size: Some(16),
            splits: Splits::Fixed(1),
            ..DecodeProblem::default()
        };
        let s = p.sizes().unwrap();
        assert_eq!((s.cache, s.num_pages, s.max_pages, s.block_table), (10 * 16 * 128, 10, 7, 14));
        assert_eq!((s.q, s.rows, s.new, s.workspace), (2 * 8 * 64, 16, 0, 0));
        // A page of 2^32 - 1 keys: the cache's bytes fit in 64 bits, so the count is exact (the
        // device and host checks refuse it); a cache row over 32 bits is refused here.
        let huge = DecodeProblem { page_size: Some(u32::MAX), cache_seqlens: vec![1], ..DecodeProblem::default() };
        assert_eq!(huge.sizes().unwrap().cache, u32::MAX as u64 * 128);
        let wide = DecodeProblem { heads: u32::MAX, heads_kv: u32::MAX, ..DecodeProblem::default() };
        assert!(matches!(wide.validate(), Err(KvCacheRule::TooLarge { .. })), "{:?}", wide.validate());
    }

    pub fn shape_rules_are_named() {
        let e = DecodeProblem { heads: 6, heads_kv: 4, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("mismatched heads"), "{e}");
        let e = DecodeProblem { page_size: Some(0), ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("page_size must be >= 1"), "{e}");
        let e = DecodeProblem { head_dim: 84, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("head_dim 84"), "{e}");
        assert!(e.to_string().contains("any other multiple of 8 up to 256"), "{e}");
        assert!(DecodeProblem { head_dim: 80, ..Default::default() }.validate().is_ok());
        assert!("0".parse::<Splits>().is_err() && "129".parse::<Splits>().is_err());
        assert_eq!("auto".parse::<Splits>(), Ok(Splits::Auto));
    }

    /// The kernels cannot see a sink's value before they run, so the command's inputs are
    /// checked here: a NaN or infinite sink is refused by name; finite ones pass. A sink far above
    /// the scores makes O underflow in f32, which the verification accepts (`o_under`).
    pub fn non_finite_sinks_are_refused_and_underflow_is_not_an_error() {
        let p =
            DecodeProblem { heads: 2, heads_kv: 1, cache_seqlens: vec![5], sinks: true, ..DecodeProblem::default() };
        let mut x = DecodeInputs::random(&p, 3);
        assert!(x.validate(&p).is_ok());
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            x.sinks[1] = bad;
            let e = x.validate(&p).unwrap_err();
            assert!(e.to_string().contains("is not finite"), "{bad}: {e}");
        }
        x.sinks = vec![100.0, 0.5];
        let r = reference(&p, &x);
        let d = p.head_dim as usize;
        assert!(r.o[..d].iter().all(|&o| o != 0.0 && o.abs() < 1e-40), "head 0 underflows in f32");
        assert!(r.o_under[..d].iter().zip(&r.o[..d]).all(|(&u, &o)| u >= o.abs()));
        assert!(r.o_under[d..2 * d].iter().all(|&u| u == 0.0));
        // O = 0 on head 0 (what f32 gives) passes; the same error on head 1 does not.
        let mut o: Vec<f32> = r.o.iter().map(|&v| v as f32).collect();
        let lse: Vec<f32> = r.lse.iter().map(|&v| v as f32).collect();
        o[..d].fill(0.0);
        assert!(verify_decode(&p, &o, &lse, &r).passed);
        o[d..2 * d].fill(0.0);
        assert!(!verify_decode(&p, &o, &lse, &r).passed);
    }

    pub fn reference_with_a_sink_known_answer() {
        // One query, keys with scores 0 and ln 3 (q = 1, scale 1, d = 1), values 4 and 8, sink
        // ln 4: weights 1, 3 and the sink's 4 -> O = (4 + 24) / 8 = 3.5, LSE = ln 8. Without keys:
        // O = 0, LSE = ln 4.
        let p = DecodeProblem {
            heads: 1,
            heads_kv: 1,
            head_dim: 1,
            cache_seqlens: vec![2],
            scale: Some(1.0),
            sinks: true,
            ..DecodeProblem::default()
        };
        let x = DecodeInputs {
            q: vec![1.0],
            k_cache: vec![0.0, 3f32.ln()],
            v_cache: vec![4.0, 8.0],
            block_table: vec![],
            k_new: vec![],
            v_new: vec![],
            layout: CacheLayout::Contiguous { seq_cache: 2 },
            sinks: vec![4f32.ln()],
            k_scale: vec![],
            v_scale: vec![],
            rotary_cos: vec![],
            rotary_sin: vec![],
            alibi_slopes: Vec::new(),
        };
        let r = reference(&p, &x);
        assert!((r.o[0] - 3.5).abs() < 1e-6 && (r.lse[0] - 8f64.ln()).abs() < 1e-6, "{r:?}");
        let empty = reference(&DecodeProblem { cache_seqlens: vec![0], ..p.clone() }, &x);
        assert_eq!(empty.o[0], 0.0);
        assert!((empty.lse[0] - 4f64.ln()).abs() < 1e-6);
        let none = reference(&DecodeProblem { sinks: false, ..p }, &DecodeInputs { sinks: vec![], ..x });
        assert!((none.o[0] - 7.0).abs() < 1e-6 && (none.lse[0] - 4f64.ln()).abs() < 1e-6);
    }

    pub fn fp8_reference_reads_the_bytes_and_scale_rules_are_named() {
        // The reference's f64 decode agrees with the kernels' bit-level decode on every code.
        for f in [Fp8Format::E4m3, Fp8Format::E5m2] {
            for c in 0..=255u8 {
                let (a, b) = (fp8_value_f64(f, c), kernels_gpu::fp8::decode(f, c) as f64);
                assert!(a == b || (a.is_nan() && b.is_nan()), "{f:?} {c:#04x}: {a} vs {b}");
            }
        }
        // Known answer: one key, V of head 0 is 1000 with scale 2 in e4m3: 1000 / 2 = 500 saturates
        // to 448, so the FP8 cache holds 896 and O is 896; head 1 (scale 0.5) holds 0.3 / 0.5 =
        // 0.6, nearest e4m3 0.625, so O is 0.3125.
        let p = DecodeProblem {
            heads: 2,
            heads_kv: 2,
            head_dim: 1,
            cache_seqlens: vec![1],
            dtype: Dtype::Bf16,
            kv_fp8: Some(Fp8Format::E4m3),
            ..DecodeProblem::default()
        };
        let x = DecodeInputs {
            q: vec![1.0, 1.0],
            k_cache: vec![1.0, 1.0],
            v_cache: vec![1000.0, 0.3],
            block_table: vec![],
            k_new: vec![],
            v_new: vec![],
            layout: CacheLayout::Contiguous { seq_cache: 1 },
            sinks: vec![],
            k_scale: vec![1.0],
            v_scale: vec![2.0, 0.5],
            rotary_cos: vec![],
            rotary_sin: vec![],
            alibi_slopes: Vec::new(),
        };
        let r = reference(&p, &x);
        assert_eq!((r.o[0], r.o[1]), (896.0, 0.3125));
        let unq = reference(&DecodeProblem { kv_fp8: None, ..p.clone() }, &x);
        assert_eq!(unq.o[0], 1000.0);
        assert!(matches!(x.check_fp8_scales(&p), Ok(())));
        let bad = |k: Vec<f32>| DecodeInputs { k_scale: k, ..x.clone() }.check_fp8_scales(&p).unwrap_err();
        assert_eq!(bad(vec![-1.0]), KvCacheRule::Fp8Scale { tensor: "k_scale", index: 0, got: -1.0 });
        assert!(matches!(bad(vec![1.0, f32::INFINITY]), KvCacheRule::Fp8Scale { index: 1, .. }));
        // Scales whose products leave f32's normal range: a NaN or zero cache before this rule.
        assert!(matches!(bad(vec![3e38]), KvCacheRule::Fp8Scale { index: 0, .. }));
        assert!(matches!(bad(vec![1.0, 1e-45]), KvCacheRule::Fp8Scale { index: 1, .. }));
        assert!(bad(vec![3e31]).to_string().contains("2e31"), "{}", bad(vec![3e31]));
        assert!(matches!(x.check_fp8_scales(&p), Ok(())));
        for ok in [MIN_FP8_SCALE, MAX_FP8_SCALE] {
            DecodeInputs { k_scale: vec![ok], ..x.clone() }.check_fp8_scales(&p).unwrap();
        }
        assert!(matches!(bad(vec![1.0; 3]), KvCacheRule::Fp8ScaleCount { got: 3, heads_kv: 2, .. }));
        assert!(bad(vec![]).to_string().contains("1 (per tensor) or heads_kv = 2"));
        let plain = DecodeProblem { kv_fp8: None, ..p.clone() };
        assert!(matches!(x.check_fp8_scales(&plain), Err(KvCacheRule::Fp8ScaleCount { fp8: false, .. })));
        let f32_q = DecodeProblem { dtype: Dtype::F32, ..p };
        assert_eq!(f32_q.kernels().unwrap_err(), KvCacheRule::Fp8Dtype { dtype: Dtype::F32 });
    }

    /// The prefill problem and inputs of a decode call (rotary and FP8 applied to its inputs, as
    /// the decode reference applies them): a varlen batch of `seq_q` queries per sequence over its
    /// `seqlen_k` keys (cache then new tokens, gathered from the slots or pages), bottom-right
    /// causal and windowed as decode is.
    fn as_prefill(p: &DecodeProblem, x: &DecodeInputs) -> (crate::problem::Problem, Qkv) {
        let plain = DecodeProblem { rotary: None, kv_fp8: None, ..p.clone() };
        let x = x.rotated(p).dequantised(&DecodeProblem { rotary: None, ..p.clone() });
        let (hk, d) = (p.heads_kv as usize, p.head_dim as usize);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for b in 0..p.batch as usize {
            for j in 0..plain.seqlen_k(b) as usize {
                for kv in 0..hk {
                    let (in_cache, at) = key_offset(&plain, &x, b, kv, j);
                    let (kt, vt) = if in_cache { (&x.k_cache, &x.v_cache) } else { (&x.k_new, &x.v_new) };
                    k.extend_from_slice(&kt[at..at + d]);
                    v.extend_from_slice(&vt[at..at + d]);
                }
            }
        }
        let seqlens_kv: Vec<u32> = (0..p.batch as usize).map(|b| plain.seqlen_k(b)).collect();
        let pp = crate::problem::Problem {
            batch: p.batch,
            heads: p.heads,
            heads_kv: Some(p.heads_kv),
            seq_q: p.seq_q,
            seq_kv: p.max_seqlen_k(),
            head_dim: p.head_dim,
            causal: p.causal,
            window: (p.window_left, p.window_right),
            softcap: p.softcap,
            scale: p.scale,
            sinks: p.sinks,
            dtype: p.dtype,
            varlen: Some(crate::problem::Varlen {
                seqlens_q: vec![p.seq_q; p.batch as usize].leak(),
                seqlens_kv: seqlens_kv.leak(),
            }),
            ..crate::problem::Problem::default()
        };
        (pp, Qkv { q: x.q.clone(), k, v, sinks: x.sinks.clone() })
    }

    /// A decode step is a prefill of `seq_q` queries with the same bottom-right mask: the decode
    /// reference and the prefill reference give the same bits on every row (O, its scale, its
    /// underflow part, LSE), over contiguous and paged caches, left padding and slots, new tokens,
    /// GQA, window, soft cap, ALiBi, sinks, rotary and an FP8 cache.
    pub fn decode_and_prefill_reference_rows_are_bit_identical() {
        let base = DecodeProblem {
            batch: 3,
            heads: 4,
            heads_kv: 2,
            head_dim: 24,
            cache_seqlens: vec![37, 5, 70],
            ..DecodeProblem::default()
        };
        let cases = [
            base.clone(),
            DecodeProblem { sinks: true, seq_new: 2, page_size: Some(16), softcap: 5.0, ..base.clone() },
            DecodeProblem {
                seq_q: 3,
                seq_new: 3,
                window_left: 9,
                alibi: true,
                cache_leftpad: Some(vec![4, 0, 11]),
                cache_batch_idx: Some(vec![2, 0, 1]),
                ..base.clone()
            },
            DecodeProblem { seq_q: 2, causal: false, window_left: 20, window_right: 1, sinks: true, ..base.clone() },
            DecodeProblem { seq_new: 2, rotary: Some(Rotary { dim: 8, interleaved: false }), ..base.clone() },
            DecodeProblem { head_dim: 64, dtype: Dtype::Bf16, kv_fp8: Some(Fp8Format::E4m3), seq_new: 1, ..base },
        ];
        for p in cases {
            let x = DecodeInputs::random(&p, 21);
            x.validate(&p).unwrap();
            let dr = reference(&p, &x);
            let (pp, px) = as_prefill(&p, &x);
            let pr = crate::reference::reference_with_slopes(&pp, &px, &RowSelection::All, &x.alibi_slopes);
            let (h, d, sq) = (p.heads as usize, p.head_dim as usize, p.seq_q as usize);
            assert_eq!(pr.rows.len() as u64, p.rows());
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<u64>>();
            for (k, row) in pr.rows.iter().enumerate() {
                let at = ((row.b as usize * sq + row.i as usize) * h + row.h as usize) * d;
                let lse_at = (row.b as usize * h + row.h as usize) * sq + row.i as usize;
                let what = format!("{p:?} row {row:?}");
                assert_eq!(bits(&dr.o[at..at + d]), bits(&pr.o[k * d..(k + 1) * d]), "O of {what}");
                assert_eq!(bits(&dr.o_abs[at..at + d]), bits(&pr.o_abs[k * d..(k + 1) * d]), "scale of {what}");
                assert_eq!(bits(&dr.o_under[at..at + d]), bits(&pr.o_under[k * d..(k + 1) * d]), "{what}");
                assert_eq!(dr.lse[lse_at].to_bits(), pr.lse[k].to_bits(), "LSE of {what}");
            }
            // The same limit rule too: f32 bounds from the same reference values, bf16 ones from
            // naive attention in bf16 on the same rows (decode's own caps aside). The row bounds
            // are maxima, the same bits; the whole-tensor ones sum the rows in another order.
            let tol = crate::verify::tolerance_for(&pp, &px, &pr);
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(b.abs());
            assert!(close(dr.tolerance.rel_rms, tol.rel_rms) && close(dr.tolerance.max_abs, tol.max_abs), "{p:?}");
            assert_eq!(dr.tolerance.row_rel_rms, tol.row_rel_rms, "{p:?}");
            assert!(dr.tolerance.row_max_abs <= tol.row_max_abs, "{p:?}");
        }
    }

    /// The acceptance rule can fail a decode output: the reference itself (rounded to f32)
    /// passes; one element of one row moved by 3x its row bound, an unwritten (NaN) element, a
    /// masked row's LSE that is not `-inf`, or a whole row 1 % off (each alone) fails, in f32 and
    /// bf16, and the failure names the row.
    pub fn the_acceptance_rule_rejects_a_perturbed_decode_output() {
        for dtype in [Dtype::F32, Dtype::Bf16] {
            let p = DecodeProblem {
                batch: 2,
                heads: 4,
                heads_kv: 2,
                head_dim: 64,
                seq_q: 3,
                cache_seqlens: vec![1, 40],
                window_left: 0,
                dtype,
                ..DecodeProblem::default()
            };
            let x = DecodeInputs::random(&p, 9);
            let r = reference(&p, &x);
            let o: Vec<f32> = r.o.iter().map(|&v| v as f32).collect();
            let lse: Vec<f32> = r.lse.iter().map(|&v| v as f32).collect();
            let v = verify_decode(&p, &o, &lse, &r);
            assert!(v.passed, "{dtype}: {:?}", v.failures);
            assert!(v.o_max_scaled_err < v.o_bound && v.o_bound == r.tolerance.row_max_abs);
            // Sequence 1, head 3, query 2 (row (1, 3, 2)): element 5 moved by 3x the row bound.
            let (h, d, sq) = (4usize, 64usize, 3usize);
            let at = ((sq + 2) * h + 3) * d;
            let scale = r.o_abs[at..at + d].iter().fold(0f64, |a, &v| a.max(v));
            let mut bad = o.clone();
            bad[at + 5] += (3.0 * r.tolerance.row_max_abs * scale) as f32;
            let v = verify_decode(&p, &bad, &lse, &r);
            assert!(!v.passed && v.o_max_scaled_err > v.o_bound, "{dtype}: {v:?}");
            assert!(v.failures.iter().any(|f| f.contains("row (batch 1, head 3, query 2)")), "{:?}", v.failures);
            let mut bad = o.clone();
            bad[at] = f32::NAN;
            let v = verify_decode(&p, &bad, &lse, &r);
            assert!(!v.passed && v.unwritten == 1, "{dtype}: {v:?}");
            // Sequence 0 has one key and window 0: queries 0 and 1 see nothing.
            assert_eq!(r.lse[0], f64::NEG_INFINITY);
            let mut bad = lse.clone();
            bad[0] = 0.0;
            let v = verify_decode(&p, &o, &bad, &r);
            assert!(!v.passed && v.lse_inf_mismatches == 1, "{dtype}: {v:?}");
            let mut bad = o.clone();
            for e in &mut bad[at..at + d] {
                *e *= 1.01;
            }
            assert!(!verify_decode(&p, &bad, &lse, &r).passed, "{dtype}: a row 1 % off passed");
        }
    }

    pub fn merge_reference_known_answers() {
        // Two states of one row: lse ln 1 and ln 3 -> weights 1/4, 3/4, lse ln 4.
        let x = Partials {
            splits: 3,
            batch: 1,
            heads: 1,
            seq_q: 1,
            head_dim: 2,
            o: vec![1.0, 2.0, 5.0, 6.0, 9.0, 9.0],
            lse: vec![0.0, 3f32.ln(), f32::NEG_INFINITY],
        };
        let (o, lse) = merge_states_reference(&x);
        assert!((lse[0] - 4f64.ln()).abs() < 1e-7);
        assert!((o[0] - 4.0).abs() < 1e-6 && (o[1] - 5.0).abs() < 1e-6);
        let all_inf = Partials { lse: vec![f32::NEG_INFINITY; 3], ..x };
        let (o, lse) = merge_states_reference(&all_inf);
        assert_eq!((o[0], o[1], lse[0]), (0.0, 0.0, f64::NEG_INFINITY));
    }
}
