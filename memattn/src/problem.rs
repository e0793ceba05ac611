//! The attention problem and its validation.
//!
//! Validation runs before anything is allocated; every error names the limit it hit.

use crate::caps::DeviceCaps;
use crate::dtype::Dtype;
use kernels_gpu::abi::{AttnParams, Strides};
use kernels_gpu::tiles::{LaunchDims, MAX_GRID_YZ, NAIVE_MAX_HEAD_DIM};
use kernels_gpu::variants::LaunchShape;
use kernels_gpu::KernelId;
use std::fmt;
use std::str::FromStr;

/// Which attention implementation to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum KernelKind {
    /// Three kernels (scores, softmax, P·V) with the `seq_q x seq_kv` score matrix in memory.
    Naive,
    /// One fused kernel (online softmax); extra memory is LSE only.
    Flash,
}

impl KernelKind {
    /// Both kinds, naive first.
    pub const ALL: [KernelKind; 2] = [KernelKind::Naive, KernelKind::Flash];
    /// The lowercase name (`naive`, `flash`), as `Display` writes it and `FromStr` reads it.
    pub const fn name(self) -> &'static str {
        match self {
            KernelKind::Naive => "naive",
            KernelKind::Flash => "flash",
        }
    }
}

impl KernelKind {
    /// The kernels one run of this kind launches for `dtype`, `head_dim` and window
    /// `(left, right)` (`-1` unbounded, causal folded in as `right = 0`), in order, looked up in
    /// the variant table (for flash: [`KernelId::flash_for`], which picks a row made for narrow
    /// windows where the table has one); `None` when the table has no such row.
    pub fn kernels(self, dtype: Dtype, head_dim: u32, window: (i32, i32)) -> Option<Vec<KernelId>> {
        match self {
            KernelKind::Flash => KernelId::flash_for(dtype.elem(), head_dim, window).map(|k| vec![k]),
            KernelKind::Naive => KernelId::naive(dtype.elem()).map(|k| k.to_vec()),
        }
    }

    /// Whether the variant table has kernels of this kind for `dtype` (at some head dim).
    pub fn supports(self, dtype: Dtype) -> bool {
        match self {
            KernelKind::Flash => !KernelId::flash_head_dims(dtype.elem()).is_empty(),
            KernelKind::Naive => KernelId::naive(dtype.elem()).is_some(),
        }
    }

    /// The dtypes the variant table has kernels of this kind for.
    pub fn dtypes(self) -> Vec<Dtype> {
        Dtype::ALL.into_iter().filter(|d| self.supports(*d)).collect()
    }

    fn dtypes_note(self) -> String {
        let names: Vec<&str> = self.dtypes().into_iter().map(|d| d.name()).collect();
        format!("{self} kernels exist for {}", names.join(", "))
    }
}

impl fmt::Display for KernelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KernelKind {
    type Err = ParseEnumError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "naive" => Ok(KernelKind::Naive),
            "flash" => Ok(KernelKind::Flash),
            _ => Err(ParseEnumError { what: "kernel", got: s.into(), expected: "naive, flash" }),
        }
    }
}

pub use crate::choice::{Arch, HopperPolicy, Target};

/// Memory layout of Q, K, V and O on the device. Files and the host always use BSHD.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Layout {
    /// `[batch, seq, heads, head_dim]`
    Bshd,
    /// `[batch, heads, seq, head_dim]`
    Bhsd,
}

impl Layout {
    /// The lowercase name (`bshd`, `bhsd`), as `Display` writes it and `FromStr` reads it.
    pub const fn name(self) -> &'static str {
        match self {
            Layout::Bshd => "bshd",
            Layout::Bhsd => "bhsd",
        }
    }
    /// The element strides (batch, seq, head) of a contiguous tensor of these sizes in this layout.
    pub const fn strides(self, seq: u64, heads: u64, head_dim: u64) -> Strides {
        match self {
            Layout::Bshd => Strides::bshd(seq, heads, head_dim),
            Layout::Bhsd => Strides::bhsd(seq, heads, head_dim),
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Layout {
    type Err = ParseEnumError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "bshd" => Ok(Layout::Bshd),
            "bhsd" => Ok(Layout::Bhsd),
            _ => Err(ParseEnumError { what: "layout", got: s.into(), expected: "bshd, bhsd" }),
        }
    }
}

/// A name that is not one of a [`KernelKind`] or [`Layout`] value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} `{got}` (expected one of: {expected})")]
pub struct ParseEnumError {
    /// What was parsed: `kernel` or `layout`.
    pub what: &'static str,
    /// The string given.
    pub got: String,
    /// The accepted names, comma-separated.
    pub expected: &'static str,
}

/// One attention problem: `O = softmax(scale · Q Kᵀ [+ mask]) V`, plus `LSE` per query row, with
/// the options of `docs/semantics.md` (GQA/MQA, window, soft cap, sinks).
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Problem {
    /// Sequences in the batch.
    pub batch: u32,
    /// Query heads.
    pub heads: u32,
    /// Query rows per sequence (varlen: the longest).
    pub seq_q: u32,
    /// Keys per sequence (varlen: the longest).
    pub seq_kv: u32,
    /// Elements per head of Q, K, V and O.
    pub head_dim: u32,
    /// The element type of Q, K, V and O.
    pub dtype: Dtype,
    /// Bottom-right aligned causal mask (sets the window's right side to 0).
    pub causal: bool,
    /// Softmax scale; `None` means `1 / sqrt(head_dim)`.
    #[cfg_attr(feature = "serde", serde(skip))]
    pub scale: Option<f32>,
    /// The device layout of Q, K, V and O.
    pub layout: Layout,
    /// Heads of K and V (GQA/MQA); `None` means `heads`. Must divide `heads`.
    pub heads_kv: Option<u32>,
    /// Window `(left, right)`, `-1` = unbounded: query `i` sees key `j` iff
    /// `i + seq_kv - seq_q - left <= j <= i + seq_kv - seq_q + right`; `causal` sets `right = 0`.
    pub window: (i32, i32),
    /// Logit soft cap `c` (`0` = off): scores are `c · tanh(scale · q·k / c)`.
    pub softcap: f32,
    /// Per-head sink logits join the softmax denominator (values in [`crate::inputs::Qkv::sinks`]).
    pub sinks: bool,
    /// ALiBi with the paper's slopes for `heads` heads ([`alibi_slopes`]): the score of query
    /// `i`, key `j` gains `-slope_h · |i + seq_kv - seq_q - j|` (after the soft cap, before the
    /// mask; FlashAttention-2's `alibi_slopes`).
    pub alibi: bool,
    /// Varlen batch: `batch` packed sequences of these lengths (then `seq_q` / `seq_kv` are the
    /// longest; built by [`Problem::varlen`]).
    pub varlen: Option<Varlen>,
}

/// The sequence lengths of a varlen batch (`batch` entries each). Leaked once per problem so
/// that [`Problem`] stays `Copy`; a run builds one or a handful.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Varlen {
    /// Query rows of each sequence.
    pub seqlens_q: &'static [u32],
    /// Keys of each sequence.
    pub seqlens_kv: &'static [u32],
}

impl Varlen {
    /// `batch + 1` prefix sums (first 0), as `cu_seqlens` are.
    pub fn cu(lens: &[u32]) -> Vec<u32> {
        let mut cu = Vec::with_capacity(lens.len() + 1);
        let mut t = 0u32;
        cu.push(0);
        for &l in lens {
            t += l;
            cu.push(t);
        }
        cu
    }
    /// Lengths from `cu_seqlens` (validated: first 0, non-decreasing).
    pub fn lens_from_cu(cu: &[u32], what: &'static str) -> Result<Vec<u32>, SeqLensRule> {
        if cu.len() < 2 {
            return Err(SeqLensRule::TooFew { what, entries: cu.len() });
        }
        if cu[0] != 0 {
            return Err(SeqLensRule::First { what, got: cu[0] });
        }
        if let Some(b) = (1..cu.len()).find(|&b| cu[b] < cu[b - 1]) {
            return Err(SeqLensRule::Decreasing { what, at: b, value: cu[b], prev: cu[b - 1] });
        }
        Ok(cu.windows(2).map(|w| w[1] - w[0]).collect())
    }
}

/// Why sequence lengths or prefix sums (`cu_seqlens`, `cache_seqlens`) were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SeqLensRule {
    /// Fewer than 2 prefix sums.
    #[error("{what} has {entries} entries; it needs batch + 1 >= 2 prefix sums")]
    TooFew {
        /// The tensor's name.
        what: &'static str,
        /// Its entries.
        entries: usize,
    },
    /// The first prefix sum is not 0.
    #[error("{what}[0] is {got}; the prefix sums must start at 0")]
    First {
        /// The tensor's name.
        what: &'static str,
        /// Its first entry.
        got: u32,
    },
    /// A prefix sum below the one before it.
    #[error("{what} decreases at entry {at} ({value} after {prev}); the prefix sums must be non-decreasing")]
    Decreasing {
        /// The tensor's name.
        what: &'static str,
        /// The entry's index.
        at: usize,
        /// The entry.
        value: u32,
        /// The entry before it.
        prev: u32,
    },
    /// `packed` is `q has` or `k and v have`.
    #[error("the last prefix sum is {last}, but {packed} {total} packed rows")]
    LastSum {
        /// The last prefix sum.
        last: usize,
        /// Which tensors are packed, as a phrase.
        packed: &'static str,
        /// Their packed rows.
        total: usize,
    },
    /// A sequence longer than the maximum length the call was given.
    #[error("a sequence has {rows} rows, over {max_name} = {max}")]
    TooLong {
        /// The sequence's rows.
        rows: usize,
        /// The name of the maximum (`max_seqlen_q`, ...).
        max_name: &'static str,
        /// The maximum.
        max: usize,
    },
    /// `cu_seqlens_kv` has a different number of entries than `cu_seqlens_q`.
    #[error("{got} entries, but cu_seqlens_q has {q} (one prefix sum per sequence, plus the leading 0)")]
    Entries {
        /// Its entries.
        got: usize,
        /// `cu_seqlens_q`'s entries.
        q: usize,
    },
    /// Per-sequence lengths not one per sequence of q.
    #[error("{got} entries for q's batch of {batch} (one length per sequence)")]
    BatchEntries {
        /// Entries given.
        got: usize,
        /// Sequences of q.
        batch: usize,
    },
}

/// The shape part of a problem as it appears in JSON output.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ShapeJson {
    /// [`Problem::batch`].
    pub batch: u32,
    /// [`Problem::heads`].
    pub heads: u32,
    /// [`Problem::seq_q`].
    pub seq_q: u32,
    /// [`Problem::seq_kv`].
    pub seq_kv: u32,
    /// [`Problem::head_dim`].
    pub head_dim: u32,
    /// [`Problem::causal`].
    pub causal: bool,
    /// The scale the kernels get ([`Problem::softmax_scale`]).
    pub softmax_scale: f32,
    /// [`Problem::layout`].
    pub layout: Layout,
    /// Heads of K and V (`heads` when the problem gives none).
    pub heads_kv: u32,
    /// `-1`: unbounded (after `causal`, which sets the right side to 0).
    pub window_left: i32,
    /// The window's right side the kernels apply (0 when causal; `-1`: unbounded).
    pub window_right: i32,
    /// [`Problem::softcap`] (`0`: off).
    pub softcap: f32,
    /// [`Problem::sinks`].
    pub sinks: bool,
    /// Query rows of each sequence of a varlen batch; `None` otherwise.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub seqlens_q: Option<&'static [u32]>,
    /// Keys of each sequence of a varlen batch; `None` otherwise.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub seqlens_kv: Option<&'static [u32]>,
}

impl Default for Problem {
    /// The default shape of `memattn run` / `compare`: small enough to verify in the VM in seconds.
    fn default() -> Self {
        Problem {
            batch: 1,
            heads: 4,
            seq_q: 256,
            seq_kv: 256,
            head_dim: 64,
            dtype: Dtype::F32,
            causal: false,
            scale: None,
            layout: Layout::Bshd,
            heads_kv: None,
            window: (-1, -1),
            softcap: 0.0,
            sinks: false,
            alibi: false,
            varlen: None,
        }
    }
}

/// The ALiBi paper's slopes for `heads` heads (its reference code's `get_slopes`, which
/// FlashAttention-2's tests use): for `n` a power of two, `2^(-8 i / n)` for `i = 1..=n`;
/// otherwise those of the largest power of two `m < n`, then every other slope of `2m`, up to
/// `n` in all.
pub fn alibi_slopes(heads: u32) -> Vec<f32> {
    fn pow2(n: u32) -> impl Iterator<Item = f64> {
        let start = 2f64.powf(-8.0 / n as f64);
        (1..=n as i32).map(move |i| start.powi(i))
    }
    if heads == 0 {
        return Vec::new();
    }
    let m = 1u32 << (31 - heads.leading_zeros());
    let mut s: Vec<f64> = pow2(m).collect();
    s.extend(pow2(2 * m).step_by(2).take((heads - m) as usize));
    s.into_iter().map(|x| x as f32).collect()
}

/// The rule for head dims without a kernel of their own, as the errors and `--help` state it.
pub const PADDED_HEAD_DIMS: &str =
    "any other multiple of 8 up to 256 runs on the next of them, with its head dim padded (nothing copied)";
const _: () = assert!(kernels_gpu::PAD_MULTIPLE == 8 && kernels_gpu::MAX_HEAD_DIM == 256);

/// The most keys a padded head dim takes in the forward: the tensor-core kernel counts a thread's
/// rows left in 32 bits, and for a chunk past the head dim that count runs down from 0 by up to
/// `seq_kv` plus a tile.
pub const PADDED_MAX_KEYS: u32 = (1 << 31) - 1024;

/// Why a problem cannot run. Each message names the limit.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProblemError {
    /// A size of the problem is 0.
    #[error("{name} must be at least 1 (got 0)")]
    ZeroSize {
        /// The size's name.
        name: &'static str,
    },
    /// No kernel of the kind for the head dim.
    #[error("head_dim {got} is not supported by the {kernel} kernel: {supported}")]
    UnsupportedHeadDim {
        /// The kernel kind.
        kernel: KernelKind,
        /// The head dim.
        got: u32,
        /// The head dims that are supported, as a phrase.
        supported: String,
    },
    /// No kernel of the kind for the dtype.
    #[error("dtype {dtype} has no {kernel} kernel ({})", kernel.dtypes_note())]
    UnsupportedDtype {
        /// The kernel kind.
        kernel: KernelKind,
        /// The dtype.
        dtype: Dtype,
    },
    /// A stride the tensor-core kernels cannot load (not a multiple of 16 bytes).
    #[error(
        "`{entry}` needs {what} aligned to {need} (got {got}); the tensor-core kernels load 16-byte \
         chunks with cp.async, so Q, K and V rows must start on 16-byte boundaries"
    )]
    Alignment {
        /// The kernel entry point.
        entry: &'static str,
        /// Which stride, as a phrase.
        what: String,
        /// Its value in elements and bytes, formatted.
        got: String,
        /// The alignment needed, as a phrase.
        need: &'static str,
    },
    /// A softmax scale that is not finite (the value given).
    #[error("softmax scale must be finite (got {0})")]
    BadScale(f32),
    /// The KV heads do not divide the query heads.
    #[error("heads_kv {heads_kv} must divide heads {heads} (query head h reads K/V head h / (heads / heads_kv))")]
    HeadsKv {
        /// Query heads.
        heads: u32,
        /// KV heads.
        heads_kv: u32,
    },
    /// A window side below -1.
    #[error("window {side} {got} is invalid: each side is -1 (unbounded) or a number of keys >= 0")]
    BadWindow {
        /// Which side: `left` or `right`.
        side: &'static str,
        /// The side given.
        got: i32,
    },
    /// A soft cap that is negative or not finite (the value given).
    #[error("softcap {0} is invalid: it must be 0 (off) or a finite number > 0")]
    BadSoftcap(f32),
    /// Varlen sequence lengths that do not fit (the rule broken, as a sentence).
    #[error("varlen: {0}")]
    Varlen(String),
    /// Packed sequences with a layout other than BSHD.
    #[error("varlen: packed sequences are [total, heads, head_dim], which needs the BSHD layout (the default)")]
    VarlenLayout,
    /// A launch grid over the device's limit on an axis.
    #[error("{kernel} launch of `{entry}` needs grid {axis} = {got}, over the device limit {limit} ({why})")]
    GridLimit {
        /// The kernel kind.
        kernel: KernelKind,
        /// The kernel entry point.
        entry: &'static str,
        /// The axis: `x`, `y` or `z`.
        axis: char,
        /// Blocks the launch needs on that axis.
        got: u64,
        /// The device's limit on that axis.
        limit: u64,
        /// What the axis walks, as a phrase.
        why: &'static str,
    },
    /// A kernel needs more dynamic shared memory per block than the device allows.
    #[error(
        "`{entry}` needs {needed} bytes of dynamic shared memory per block, over the device limit of {limit} bytes"
    )]
    SharedMemory {
        /// The kernel entry point.
        entry: &'static str,
        /// Bytes it needs per block.
        needed: u32,
        /// The device's limit in bytes per block.
        limit: u32,
    },
    /// A run needs more device memory than is free (the analytic estimate).
    #[error(
        "{kernel} needs an estimated {needed} bytes ({needed_h}) of device memory, more than the {free} bytes ({free_h}) free \
         [{breakdown}]"
    )]
    OutOfDeviceMemory {
        /// The kernel kind.
        kernel: KernelKind,
        /// Bytes needed.
        needed: u64,
        /// `needed`, human-readable.
        needed_h: String,
        /// Bytes free on the device.
        free: u64,
        /// `free`, human-readable.
        free_h: String,
        /// The bytes of each buffer, formatted.
        breakdown: String,
    },
    /// A buffer whose size in bytes does not fit in 64 bits.
    #[error("{what} needs {got} bytes, beyond what a 64-bit byte count can address")]
    TooLarge {
        /// The buffer's name.
        what: &'static str,
        /// Its size in bytes, in decimal.
        got: String,
    },
}

/// One kernel launch of a run: the PTX entry and its geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedLaunch {
    /// The kernel entry point.
    pub kernel: KernelId,
    /// Its grid, block and dynamic shared memory.
    pub dims: LaunchDims,
}

impl Problem {
    /// The softmax scale the kernels get.
    pub fn softmax_scale(&self) -> f32 {
        self.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// The shape and options as the JSON output writes them (scale, KV heads and window resolved).
    pub fn shape_json(&self) -> ShapeJson {
        ShapeJson {
            batch: self.batch,
            heads: self.heads,
            seq_q: self.seq_q,
            seq_kv: self.seq_kv,
            head_dim: self.head_dim,
            causal: self.causal,
            softmax_scale: self.softmax_scale(),
            layout: self.layout,
            heads_kv: self.kv_heads(),
            window_left: self.window.0,
            window_right: self.window_right(),
            softcap: self.softcap,
            sinks: self.sinks,
            seqlens_q: self.varlen.map(|v| v.seqlens_q),
            seqlens_kv: self.varlen.map(|v| v.seqlens_kv),
        }
    }

    /// A varlen batch of `base`'s other options: `seqlens_q.len()` sequences (the batch),
    /// `seq_q` / `seq_kv` the longest lengths. `seqlens_kv` must have as many entries.
    pub fn varlen(base: Problem, seqlens_q: &[u32], seqlens_kv: &[u32]) -> Result<Problem, ProblemError> {
        if seqlens_q.is_empty() || seqlens_q.len() != seqlens_kv.len() {
            return Err(ProblemError::Varlen(format!(
                "{} query lengths and {} key lengths; both lists need one length per sequence (at least one)",
                seqlens_q.len(),
                seqlens_kv.len()
            )));
        }
        for (what, l) in [("query", seqlens_q), ("key", seqlens_kv)] {
            let total: u64 = l.iter().map(|&x| x as u64).sum();
            if total > u32::MAX as u64 / 2 {
                return Err(ProblemError::Varlen(format!("the {what} lengths add up to {total}, over 2^31 - 1")));
            }
        }
        let leak = |v: &[u32]| -> &'static [u32] { Box::leak(v.to_vec().into_boxed_slice()) };
        Ok(Problem {
            batch: seqlens_q.len() as u32,
            seq_q: seqlens_q.iter().copied().max().unwrap_or(0),
            seq_kv: seqlens_kv.iter().copied().max().unwrap_or(0),
            varlen: Some(Varlen { seqlens_q: leak(seqlens_q), seqlens_kv: leak(seqlens_kv) }),
            ..base
        })
    }

    /// Total query rows (`batch * seq_q`, or the sum of the varlen lengths).
    pub fn total_q(&self) -> u64 {
        match self.varlen {
            Some(v) => v.seqlens_q.iter().map(|&x| x as u64).sum(),
            None => self.batch as u64 * self.seq_q as u64,
        }
    }
    /// Total key rows.
    pub fn total_kv(&self) -> u64 {
        match self.varlen {
            Some(v) => v.seqlens_kv.iter().map(|&x| x as u64).sum(),
            None => self.batch as u64 * self.seq_kv as u64,
        }
    }
    /// `(seq_q, seq_kv)` of sequence `b`.
    pub fn seq_lens(&self, b: u32) -> (u32, u32) {
        match self.varlen {
            Some(v) => (v.seqlens_q[b as usize], v.seqlens_kv[b as usize]),
            None => (self.seq_q, self.seq_kv),
        }
    }
    /// Packed row (in `[total, heads, d]` / BSHD order) of query `i` of sequence `b`.
    pub fn q_row(&self, b: u32, i: u32) -> u64 {
        match self.varlen {
            Some(v) => v.seqlens_q[..b as usize].iter().map(|&x| x as u64).sum::<u64>() + i as u64,
            None => b as u64 * self.seq_q as u64 + i as u64,
        }
    }
    /// Packed row of key `j` of sequence `b`.
    pub fn kv_row(&self, b: u32, j: u32) -> u64 {
        match self.varlen {
            Some(v) => v.seqlens_kv[..b as usize].iter().map(|&x| x as u64).sum::<u64>() + j as u64,
            None => b as u64 * self.seq_kv as u64 + j as u64,
        }
    }
    /// Index of LSE `(b, h, i)`: `[batch, heads, seq_q]`, varlen `[heads, total_q]`.
    pub fn lse_index(&self, b: u32, h: u32, i: u32) -> u64 {
        match self.varlen {
            Some(_) => h as u64 * self.total_q() + self.q_row(b, i),
            None => (b as u64 * self.heads as u64 + h as u64) * self.seq_q as u64 + i as u64,
        }
    }

    /// Heads of K and V.
    pub fn kv_heads(&self) -> u32 {
        self.heads_kv.unwrap_or(self.heads)
    }

    /// The right side of the window the kernels apply: 0 when causal, else `window.1`.
    pub fn window_right(&self) -> i32 {
        if self.causal {
            0
        } else {
            self.window.1
        }
    }

    /// Whether any key is masked by the window (causal included).
    pub fn windowed(&self) -> bool {
        self.window.0 >= 0 || self.window_right() >= 0
    }

    /// Keys `[start, end)` query row `i` sees (empty when `start >= end`), from the window rule
    /// (for varlen: in a sequence of the longest lengths; see [`Problem::key_range_in`]).
    pub fn key_range(&self, i: u32) -> (u64, u64) {
        self.key_range_in(self.seq_q, self.seq_kv, i)
    }

    /// [`Problem::key_range`] in a sequence of `seq_q` queries and `seq_kv` keys.
    /// The kernels' own rule, [`kernels_gpu::mask::key_range`] (the f64 reference keeps an
    /// independent per-key rule, [`crate::reference`]).
    pub fn key_range_in(&self, seq_q: u32, seq_kv: u32, i: u32) -> (u64, u64) {
        let (start, end) =
            kernels_gpu::mask::key_range(self.causal, self.window.0, self.window_right(), i, seq_q, seq_kv);
        (start as u64, end.max(start) as u64)
    }

    /// Elements of Q and O (`batch * seq_q * heads * head_dim`; varlen: `total_q * heads * d`).
    pub fn q_elems(&self) -> u64 {
        self.total_q() * self.heads as u64 * self.head_dim as u64
    }
    /// Elements of K and of V (`batch * seq_kv * heads_kv * head_dim`; varlen: `total_kv * ...`).
    pub fn kv_elems(&self) -> u64 {
        self.total_kv() * self.kv_heads() as u64 * self.head_dim as u64
    }
    /// Query rows (`batch * heads * seq_q`, varlen `heads * total_q`), also the number of LSE values.
    pub fn rows(&self) -> u64 {
        self.heads as u64 * self.total_q()
    }
    /// Elements of the naive score matrix S.
    /// (Varlen: `[batch, heads, longest seq_q, longest seq_kv]`, padded.)
    pub fn score_elems(&self) -> u64 {
        self.batch as u64 * self.heads as u64 * self.seq_q as u64 * self.seq_kv as u64
    }

    /// Keys query row `i` attends to (bottom-right aligned window, causal = right 0).
    pub fn keys_seen(&self, i: u32) -> u64 {
        let (s, e) = self.key_range(i);
        e - s
    }

    /// Exact number of unmasked (query, key) pairs of one head.
    pub fn unmasked_pairs_per_head(&self) -> u64 {
        if self.window.0 >= 0 || (!self.causal && self.window.1 >= 0) {
            return (0..self.seq_q).map(|i| self.keys_seen(i)).sum();
        }
        if !self.causal {
            return self.seq_q as u64 * self.seq_kv as u64;
        }
        // Row i sees min(seq_kv, max(0, i + 1 + seq_kv - seq_q)) keys: closed form over the rows
        // that see a partial prefix, all keys never exceeded since i < seq_q.
        let (nq, nk) = (self.seq_q as i64, self.seq_kv as i64);
        let offset = nk - nq; // row i sees i + 1 + offset keys, clamped to [0, nk]
                              // First row that sees at least one key: i + 1 + offset >= 1  =>  i >= -offset.
        let first = (-offset).max(0);
        if first >= nq {
            return 0;
        }
        let (a, b) = (first + 1 + offset, nq + offset); // counts at rows first and nq-1
        ((a + b) * (nq - first) / 2) as u64
    }

    /// Useful floating-point operations: `4 · batch · heads · head_dim · unmasked pairs` (2 for
    /// QKᵀ and 2 for PV per pair and dim).
    pub fn flops(&self) -> f64 {
        let pairs = match self.varlen {
            // Varlen: the pairs of every sequence (per head), not batch x one sequence's.
            Some(_) => (0..self.batch)
                .map(|b| {
                    let (sq, sk) = self.seq_lens(b);
                    (0..sq)
                        .map(|i| {
                            let (s, e) = self.key_range_in(sq, sk, i);
                            e - s
                        })
                        .sum::<u64>()
                })
                .sum::<u64>() as f64,
            None => self.batch as f64 * self.unmasked_pairs_per_head() as f64,
        };
        4.0 * self.heads as f64 * self.head_dim as f64 * pairs
    }

    /// The [`AttnParams`] of one launch of this problem's prefill kernels: the one place they
    /// are built (the library's [`crate::attn::Kernels`] and the `memattn` command's runner both
    /// call it). Addresses in `b` that a launch does not use are 0; varlen problems take
    /// `total_q` from their sequence lengths.
    pub fn attn_params(&self, b: &AttnBuffers) -> AttnParams {
        AttnParams {
            q: b.q,
            k: b.k,
            v: b.v,
            o: b.o,
            lse: b.lse,
            scores: b.scores,
            q_strides: b.q_strides,
            k_strides: b.k_strides,
            v_strides: b.v_strides,
            o_strides: b.o_strides,
            batch: self.batch,
            heads: self.heads,
            seq_q: self.seq_q,
            seq_kv: self.seq_kv,
            head_dim: self.head_dim,
            causal: self.causal as u32,
            softmax_scale: self.softmax_scale(),
            heads_kv: self.kv_heads(),
            window_left: self.window.0,
            window_right: self.window_right(),
            softcap: self.softcap,
            seqused_k_add: b.seqused_k_add,
            sinks: b.sinks,
            cu_seqlens_q: b.cu_seqlens_q,
            cu_seqlens_kv: b.cu_seqlens_kv,
            total_q: if self.varlen.is_some() {
                u32::try_from(self.total_q()).unwrap_or(u32::MAX)
            } else {
                b.packed_total_q
            },
            alibi_batch_stride: b.alibi_batch_stride,
            alibi_slopes: b.alibi_slopes,
            seqused_k: b.seqused_k,
            block_table: b.block_table,
            page_size: b.page_size,
            max_pages: b.max_pages,
            status: b.status,
        }
    }

    /// Strides of Q/O and K/V in the device layout.
    /// (Varlen: packed `[total, heads, d]`, addressed as batch 0.)
    pub fn q_strides(&self) -> Strides {
        match self.varlen {
            Some(_) => Strides::bshd(self.total_q(), self.heads as u64, self.head_dim as u64),
            None => self.layout.strides(self.seq_q as u64, self.heads as u64, self.head_dim as u64),
        }
    }
    /// Strides of K and V in the device layout (varlen: packed `[total_kv, heads_kv, d]`).
    pub fn kv_strides(&self) -> Strides {
        match self.varlen {
            Some(_) => Strides::bshd(self.total_kv(), self.kv_heads() as u64, self.head_dim as u64),
            None => self.layout.strides(self.seq_kv as u64, self.kv_heads() as u64, self.head_dim as u64),
        }
    }

    /// The launch shape of the kernels (`batch`, `heads`, `seq_q`, `seq_kv`).
    pub fn launch_shape(&self) -> LaunchShape {
        LaunchShape { batch: self.batch, heads: self.heads, seq_q: self.seq_q, seq_kv: self.seq_kv }
    }

    /// The launches one run of `kernel` makes, in order: the variant table's rows for this dtype
    /// and head dim, with the geometry their tiles give.
    pub fn launches(&self, kernel: KernelKind) -> Result<Vec<PlannedLaunch>, ProblemError> {
        self.launches_on(kernel, Arch::Sm80)
    }

    /// The Hopper forward this problem could run on an sm_90 device: bf16/f16 at head dims 64,
    /// 128 and 256 without ALiBi (every window, GQA, soft cap, sinks and varlen). Whether it
    /// runs is the [`Target`]'s choice ([`crate::choice`]).
    pub fn sm90_kernel(&self) -> Option<KernelId> {
        if self.alibi {
            return None;
        }
        KernelId::flash_sm90(self.dtype.elem(), self.head_dim)
    }

    /// [`Problem::launches`] on a device that runs `target`: a flash run takes the Hopper
    /// forward where [`Target::forward`] picks it ([`crate::choice`]: the measured table, or
    /// `MEMATTN_HOPPER`).
    pub fn launches_on(
        &self,
        kernel: KernelKind,
        target: impl Into<Target>,
    ) -> Result<Vec<PlannedLaunch>, ProblemError> {
        let target = target.into();
        if !kernel.supports(self.dtype) {
            return Err(ProblemError::UnsupportedDtype { kernel, dtype: self.dtype });
        }
        let window = (self.window.0, self.window_right());
        let sm90 = match kernel {
            KernelKind::Flash => target.forward(self.sm90_kernel(), self.dtype.elem(), self.head_dim),
            KernelKind::Naive => None,
        };
        let ids = match sm90 {
            Some(k) => vec![k],
            None => kernel.kernels(self.dtype, self.head_dim, window).ok_or_else(|| self.head_dim_error(kernel))?,
        };
        ids.into_iter()
            .map(|id| match id.variant().launch(self.launch_shape()) {
                Some(dims) => Ok(PlannedLaunch { kernel: id, dims }),
                None => Err(self.head_dim_error(kernel)),
            })
            .collect()
    }

    fn head_dim_error(&self, kernel: KernelKind) -> ProblemError {
        let supported = match kernel {
            KernelKind::Flash => format!(
                "{} flash kernels are compiled for head_dim {}; {}",
                self.dtype,
                crate::problem::list_and(&KernelId::flash_head_dims(self.dtype.elem())),
                PADDED_HEAD_DIMS
            ),
            KernelKind::Naive => format!("naive kernels accept 1..={NAIVE_MAX_HEAD_DIM}"),
        };
        ProblemError::UnsupportedHeadDim { kernel, got: self.head_dim, supported }
    }

    /// Whether the flash kernel of this problem is compiled for a larger head dim than its own
    /// (the kernel reads and writes only the problem's columns: [`KernelId::padded_head_dim`]).
    pub fn padded(&self) -> bool {
        KernelId::flash(self.dtype.elem(), self.head_dim)
            .and_then(|k| k.variant().head_dim())
            .is_some_and(|d| d != self.head_dim)
    }

    /// Checks that need no device: sizes, head dim, dtype, scale, overflow.
    pub fn validate_shape(&self, kernel: KernelKind) -> Result<(), ProblemError> {
        for (name, v) in [
            ("batch", self.batch),
            ("heads", self.heads),
            ("seq_q", self.seq_q),
            ("seq_kv", self.seq_kv),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return Err(ProblemError::ZeroSize { name });
            }
        }
        if !kernel.supports(self.dtype) {
            return Err(ProblemError::UnsupportedDtype { kernel, dtype: self.dtype });
        }
        let ok_dim = match kernel {
            KernelKind::Flash => KernelId::flash(self.dtype.elem(), self.head_dim).is_some(),
            KernelKind::Naive => self.head_dim <= NAIVE_MAX_HEAD_DIM,
        };
        if !ok_dim {
            return Err(self.head_dim_error(kernel));
        }
        if kernel == KernelKind::Flash && self.padded() && self.seq_kv > PADDED_MAX_KEYS {
            return Err(ProblemError::UnsupportedHeadDim {
                kernel,
                got: self.head_dim,
                supported: format!(
                    "a head dim padded to the next kernel's takes seq_kv up to {PADDED_MAX_KEYS} (got {})",
                    self.seq_kv
                ),
            });
        }
        let hk = self.kv_heads();
        if hk == 0 {
            return Err(ProblemError::ZeroSize { name: "heads_kv" });
        }
        if !self.heads.is_multiple_of(hk) {
            return Err(ProblemError::HeadsKv { heads: self.heads, heads_kv: hk });
        }
        for (side, w) in [("left", self.window.0), ("right", self.window.1)] {
            if w < -1 {
                return Err(ProblemError::BadWindow { side, got: w });
            }
        }
        if !(self.softcap.is_finite() && self.softcap >= 0.0) {
            return Err(ProblemError::BadSoftcap(self.softcap));
        }
        if self.varlen.is_some() && self.layout != Layout::Bshd {
            return Err(ProblemError::VarlenLayout);
        }
        self.check_alignment(kernel)?;
        let scale = self.softmax_scale();
        if !scale.is_finite() {
            return Err(ProblemError::BadScale(scale));
        }
        self.check_byte_counts(kernel)
    }

    /// Every byte count of a run (and their sum, the analytic total) must fit in a u64, so that
    /// [`crate::memory::AnalyticBytes`] and the allocations never wrap. Computed in u128; the error names the
    /// tensor that is too large (the score matrix only for naive: flash has none).
    pub fn check_byte_counts(&self, kernel: KernelKind) -> Result<(), ProblemError> {
        let (b, h, nq, nk, d) =
            (self.batch as u128, self.heads as u128, self.seq_q as u128, self.seq_kv as u128, self.head_dim as u128);
        let es = self.dtype.size_bytes() as u128;
        let q = b * nq * h * d * es;
        let kv = b * nk * h * d * es;
        let lse = b * h * nq * 4;
        let scores = if kernel == KernelKind::Naive { b * h * nq * nk * 4 } else { 0 };
        let limit = u64::MAX as u128;
        for (what, bytes) in [("Q (and O)", q), ("K (and V)", kv), ("the score matrix", scores)] {
            if bytes > limit {
                return Err(ProblemError::TooLarge { what, got: bytes.to_string() });
            }
        }
        let total = 2 * q + 2 * kv + lse + scores;
        if total > limit {
            return Err(ProblemError::TooLarge {
                what: "the run (Q, K, V, O, LSE and workspace)",
                got: total.to_string(),
            });
        }
        Ok(())
    }

    /// The tensor-core kernels copy Q, K and V in 16-byte chunks (`cp.async`): every row must start
    /// on a 16-byte boundary, so the batch, seq and head strides must be multiples of 8 elements
    /// (and O rows 4-byte aligned, implied). The base pointers are checked with the views, at the
    /// launch ([`crate::attn::Kernels`]).
    pub fn check_alignment(&self, kernel: KernelKind) -> Result<(), ProblemError> {
        if !(kernel == KernelKind::Flash && self.dtype.is_16bit()) {
            return Ok(());
        }
        let entry = match self.launches(kernel) {
            Ok(l) => l[0].kernel.name(),
            Err(_) => return Ok(()), // the head-dim error is reported instead
        };
        for (tensor, st) in [("Q/O", self.q_strides()), ("K/V", self.kv_strides())] {
            for (name, v) in [("batch", st.batch), ("seq", st.seq), ("head", st.head)] {
                if !v.is_multiple_of(8) {
                    return Err(ProblemError::Alignment {
                        entry,
                        what: format!("the {tensor} {name} stride"),
                        got: format!("{v} elements = {} bytes", v * self.dtype.size_bytes()),
                        need: "a multiple of 8 elements (16 bytes)",
                    });
                }
            }
        }
        Ok(())
    }

    /// Validation against a device's launch limits: shape, grid and shared memory. Whether the
    /// buffers fit in the device's free memory is the memory plan's check,
    /// [`crate::memory::AnalyticBytes::check_fits`].
    pub fn validate(&self, kernel: KernelKind, caps: &DeviceCaps) -> Result<(), ProblemError> {
        self.validate_shape(kernel)?;
        let bh = self.batch as u64 * self.heads as u64;
        match kernel {
            KernelKind::Naive => {
                if bh > MAX_GRID_YZ as u64 || bh > caps.max_grid[2] as u64 {
                    return Err(ProblemError::GridLimit {
                        kernel,
                        entry: self.launches(kernel)?[0].kernel.name(),
                        axis: 'z',
                        got: bh,
                        limit: (MAX_GRID_YZ as u64).min(caps.max_grid[2] as u64),
                        why: "grid z walks batch * heads",
                    });
                }
            }
            KernelKind::Flash => {
                if self.heads as u64 > caps.max_grid[1] as u64 {
                    return Err(ProblemError::GridLimit {
                        kernel,
                        entry: self.launches(kernel)?[0].kernel.name(),
                        axis: 'y',
                        got: self.heads as u64,
                        limit: caps.max_grid[1] as u64,
                        why: "grid y walks heads",
                    });
                }
                if self.batch as u64 > caps.max_grid[2] as u64 {
                    return Err(ProblemError::GridLimit {
                        kernel,
                        entry: self.launches(kernel)?[0].kernel.name(),
                        axis: 'z',
                        got: self.batch as u64,
                        limit: caps.max_grid[2] as u64,
                        why: "grid z walks batch",
                    });
                }
            }
        }
        for l in self.launches(kernel)? {
            for (axis, (&g, &lim)) in ['x', 'y', 'z'].iter().zip(l.dims.grid.iter().zip(caps.max_grid.iter())) {
                if g > lim {
                    return Err(ProblemError::GridLimit {
                        kernel,
                        entry: l.kernel.name(),
                        axis: *axis,
                        got: g as u64,
                        limit: lim as u64,
                        why: "from the tile configuration",
                    });
                }
            }
            if l.dims.dynamic_smem_bytes > caps.max_dynamic_smem_bytes {
                return Err(ProblemError::SharedMemory {
                    entry: l.kernel.name(),
                    needed: l.dims.dynamic_smem_bytes,
                    limit: caps.max_dynamic_smem_bytes,
                });
            }
        }
        Ok(())
    }
}

/// `[32, 64, 96]` as "32, 64 and 96" (one item as itself, none as "none").
pub fn list_and(items: &[u32]) -> String {
    match items {
        [] => "none".into(),
        [one] => one.to_string(),
        [init @ .., last] => {
            format!("{} and {last}", init.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
        }
    }
}

/// Device addresses and element strides of one prefill launch's tensors, for
/// [`Problem::attn_params`]; 0 where a launch does not use the buffer (no `lse` for the naive
/// kernels, no `scores` for the fused ones, no sinks, no varlen).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttnBuffers {
    /// Q's device address.
    pub q: u64,
    /// K's device address.
    pub k: u64,
    /// V's device address.
    pub v: u64,
    /// O's device address.
    pub o: u64,
    /// LSE's device address (f32).
    pub lse: u64,
    /// The naive kernels' score matrix.
    pub scores: u64,
    /// Per-head f32 sink logits.
    pub sinks: u64,
    /// ALiBi slopes (f32, `[heads]` or `[batch, heads]`) and the elements between two
    /// sequences' slopes (0 or `heads`).
    pub alibi_slopes: u64,
    /// Elements between two sequences' ALiBi slopes (0: one set for all, or `heads`).
    pub alibi_batch_stride: u32,
    /// Varlen: the device address of the `batch + 1` u32 query prefix sums.
    pub cu_seqlens_q: u64,
    /// Varlen: the device address of the `batch + 1` u32 key prefix sums.
    pub cu_seqlens_kv: u64,
    /// Q's element strides.
    pub q_strides: Strides,
    /// K's element strides.
    pub k_strides: Strides,
    /// V's element strides.
    pub v_strides: Strides,
    /// O's element strides.
    pub o_strides: Strides,
    /// A KV cache (chunked prefill, [`kernels_gpu::abi::AttnParams::seqused_k`]): `[batch]` u32
    /// key counts (0: no cache), the block table (0: contiguous), keys per page (`2^31` for a
    /// contiguous cache), block-table entries per sequence, and the count added to each key
    /// count (appended tokens).
    pub seqused_k: u64,
    /// The block table's device address (0: contiguous cache).
    pub block_table: u64,
    /// Keys per page (`2^31` for a contiguous cache).
    pub page_size: u32,
    /// Block-table entries per sequence.
    pub max_pages: u32,
    /// Keys appended to each sequence's key count (the new tokens).
    pub seqused_k_add: u32,
    /// A KV-cache call with device-checked indices: its status words
    /// ([`kernels_gpu::abi::AttnParams::status`]); 0 otherwise.
    pub status: u64,
    /// Packed rows of a varlen call whose lengths the problem does not carry (its `varlen` is
    /// `None`; the kernels read `cu_seqlens_q`): LSE's head stride. 0 otherwise.
    pub packed_total_q: u32,
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    fn brute_pairs(p: &Problem) -> u64 {
        (0..p.seq_q).map(|i| p.keys_seen(i)).sum()
    }

    pub fn unmasked_pairs_match_brute_force() {
        for causal in [false, true] {
            for nq in [1u32, 2, 5, 17, 64, 100] {
                for nk in [1u32, 3, 5, 17, 64, 99, 130] {
                    let p = Problem { seq_q: nq, seq_kv: nk, causal, ..Problem::default() };
                    assert_eq!(p.unmasked_pairs_per_head(), brute_pairs(&p), "nq={nq} nk={nk} causal={causal}");
                }
            }
        }
        let p = Problem { seq_q: 4, seq_kv: 4, causal: true, ..Problem::default() };
        assert_eq!(p.unmasked_pairs_per_head(), 10); // 1 + 2 + 3 + 4
                                                     // seq_q > seq_kv: the first seq_q - seq_kv rows see nothing.
        let p = Problem { seq_q: 6, seq_kv: 3, causal: true, ..Problem::default() };
        assert_eq!(p.unmasked_pairs_per_head(), 6); // rows 3,4,5 see 1,2,3
    }

    pub fn gqa_window_and_softcap_are_validated() {
        let p = Problem { heads: 8, heads_kv: Some(3), ..Problem::default() };
        let e = p.validate_shape(KernelKind::Flash).unwrap_err().to_string();
        assert!(e.contains("heads_kv 3 must divide heads 8"), "{e}");
        for hk in [1, 2, 4, 8] {
            let p = Problem { heads: 8, heads_kv: Some(hk), ..Problem::default() };
            assert!(p.validate_shape(KernelKind::Flash).is_ok());
            assert_eq!(p.kv_elems(), 256 * hk as u64 * 64);
        }
        let e = Problem { window: (-2, 0), ..Problem::default() }.validate_shape(KernelKind::Naive).unwrap_err();
        assert!(e.to_string().contains("window left -2"), "{e}");
        for c in [-1.0, f32::NAN, f32::INFINITY] {
            let e = Problem { softcap: c, ..Problem::default() }.validate_shape(KernelKind::Flash).unwrap_err();
            assert!(e.to_string().contains("softcap"), "{e}");
        }
    }

    pub fn lists_read_as_prose() {
        assert_eq!(list_and(&[]), "none");
        assert_eq!(list_and(&[64]), "64");
        assert_eq!(list_and(&[64, 128]), "64 and 128");
        assert_eq!(list_and(&[32, 64, 96]), "32, 64 and 96");
    }

    pub fn zero_sizes_and_head_dims_are_named() {
        let p = Problem { heads: 0, ..Problem::default() };
        assert_eq!(p.validate_shape(KernelKind::Flash), Err(ProblemError::ZeroSize { name: "heads" }));
        let p = Problem { head_dim: 84, ..Problem::default() };
        let e = p.validate_shape(KernelKind::Flash).unwrap_err().to_string();
        assert!(e.contains("84") && e.contains("32, 64, 96, 128, 192 and 256"), "{e}");
        assert!(e.contains("any other multiple of 8 up to 256 runs on the next"), "{e}");
        assert!(p.validate_shape(KernelKind::Naive).is_ok());
        let e = Problem { head_dim: 264, ..p }.validate_shape(KernelKind::Flash).unwrap_err().to_string();
        assert!(e.contains("264") && e.contains("up to 256"), "{e}");
        // A multiple of 8 runs on the next compiled head dim, its own head dim kept.
        let p = Problem { head_dim: 80, ..Problem::default() };
        assert!(p.validate_shape(KernelKind::Flash).is_ok() && p.padded());
        assert!(!Problem::default().padded());
        let e = Problem { seq_kv: PADDED_MAX_KEYS + 1, ..p }.validate_shape(KernelKind::Flash).unwrap_err();
        assert!(e.to_string().contains("seq_kv up to 2147482624"), "{e}");
        let p = Problem { head_dim: 300, ..Problem::default() };
        assert!(p.validate_shape(KernelKind::Naive).unwrap_err().to_string().contains("1..=256"));
    }

    pub fn dtype_picks_the_kernel_from_the_variant_table() {
        let names = |p: &Problem| p.launches(KernelKind::Flash).unwrap().iter().map(|l| l.kernel).collect::<Vec<_>>();
        let p = Problem { dtype: Dtype::Bf16, seq_q: 130, ..Problem::default() };
        assert_eq!(names(&p), [KernelId::FlashFwdBf16D64]);
        let l = p.launches(KernelKind::Flash).unwrap()[0].dims;
        assert_eq!((l.grid, l.block, l.dynamic_smem_bytes), ([2, 4, 1], [128, 1, 1], 32 * 1024));
        assert_eq!(names(&Problem { head_dim: 128, ..p }), [KernelId::FlashFwdBf16D128]);
        assert_eq!(names(&Problem { dtype: Dtype::F16, ..p }), [KernelId::FlashFwdF16D64]);
        assert_eq!(names(&Problem { dtype: Dtype::F16, head_dim: 128, ..p }), [KernelId::FlashFwdF16D128]);
        assert_eq!(names(&Problem { dtype: Dtype::F32, ..p }), [KernelId::FlashFwdF32D64]);
        assert!(p.validate_shape(KernelKind::Flash).is_ok());
        // Naive in 16 bits: 16-bit scores and P·V around the shared f32 softmax.
        assert!(p.validate_shape(KernelKind::Naive).is_ok());
        let naive: Vec<KernelId> = p.launches(KernelKind::Naive).unwrap().into_iter().map(|l| l.kernel).collect();
        assert_eq!(naive, [KernelId::NaiveScoresBf16, KernelId::NaiveSoftmaxF32, KernelId::NaivePvBf16]);
        let f16 = Problem { dtype: Dtype::F16, ..p };
        let naive: Vec<KernelId> = f16.launches(KernelKind::Naive).unwrap().into_iter().map(|l| l.kernel).collect();
        assert_eq!(naive, [KernelId::NaiveScoresF16, KernelId::NaiveSoftmaxF32, KernelId::NaivePvF16]);
        let e = Problem { head_dim: 81, ..p }.validate_shape(KernelKind::Flash).unwrap_err().to_string();
        assert!(e.contains("32, 64, 96, 128, 192 and 256"), "{e}");
        // Padded head dims: the next compiled head dim, the window rows' rules kept.
        assert_eq!(names(&Problem { head_dim: 40, ..p }), [KernelId::FlashFwdBf16D64]);
        assert_eq!(names(&Problem { head_dim: 8, ..p }), [KernelId::FlashFwdBf16D32]);
        assert_eq!(names(&Problem { head_dim: 200, ..p }), [KernelId::FlashFwdBf16D256]);
        assert_eq!(names(&Problem { dtype: Dtype::F32, head_dim: 160, ..p }), [KernelId::FlashFwdF32D192]);
        let p200 = Problem { head_dim: 200, window: (127, 0), ..p };
        assert_eq!(names(&p200), [KernelId::FlashFwdBf16D256Window]);
        assert_eq!(Problem { head_dim: 200, ..p }.attn_params(&AttnBuffers::default()).head_dim, 200);
        // Every other head dim of the table, by (dtype, head dim).
        assert_eq!(names(&Problem { head_dim: 32, ..p }), [KernelId::FlashFwdBf16D32]);
        assert_eq!(names(&Problem { head_dim: 96, ..p }), [KernelId::FlashFwdBf16D96]);
        assert_eq!(names(&Problem { dtype: Dtype::F16, head_dim: 192, ..p }), [KernelId::FlashFwdF16D192]);
        assert_eq!(names(&Problem { dtype: Dtype::F32, head_dim: 256, ..p }), [KernelId::FlashFwdF32D256]);
        let l = Problem { head_dim: 96, ..p }.launches(KernelKind::Flash).unwrap()[0].dims;
        assert_eq!((l.grid, l.block, l.dynamic_smem_bytes), ([3, 4, 1], [128, 1, 1], 36 * 1024));
    }

    pub fn narrow_windows_pick_the_narrow_tiles() {
        let names = |p: &Problem| p.launches(KernelKind::Flash).unwrap().iter().map(|l| l.kernel).collect::<Vec<_>>();
        let p = Problem { dtype: Dtype::Bf16, seq_q: 4096, seq_kv: 4096, head_dim: 128, ..Problem::default() };
        let narrow = [KernelId::FlashFwdBf16D128Window];
        // d128: both sides bounded, left + right + 1 <= 96 keys (causal is right = 0).
        assert_eq!(names(&Problem { window: (63, 0), ..p }), narrow);
        assert_eq!(names(&Problem { window: (95, -1), causal: true, ..p }), narrow);
        assert_eq!(names(&Problem { window: (40, 55), ..p }), narrow);
        assert_eq!(names(&Problem { window: (0, 0), ..p }), narrow);
        assert_eq!(names(&Problem { window: (63, 0), dtype: Dtype::F16, ..p }), [KernelId::FlashFwdF16D128Window]);
        let l = Problem { window: (63, 0), ..p }.launches(KernelKind::Flash).unwrap()[0].dims;
        assert_eq!((l.grid, l.block, l.dynamic_smem_bytes), ([64, 4, 1], [64, 1, 1], 32 * 1024));
        // Everything else runs the default row: wider windows, a side unbounded, full and causal
        // attention, f32.
        let default = [KernelId::FlashFwdBf16D128];
        for (window, causal) in [
            ((96, 0), false),
            ((255, 0), false),
            ((40, 56), false),
            ((63, -1), false),
            ((-1, 0), false),
            ((-1, -1), true),
            ((-1, -1), false),
        ] {
            assert_eq!(names(&Problem { window, causal, ..p }), default, "{window:?} causal {causal}");
        }
        // The other head dims by their own bounds; d64 has no narrow row.
        assert_eq!(names(&Problem { window: (255, 0), head_dim: 64, ..p }), [KernelId::FlashFwdBf16D64]);
        assert_eq!(names(&Problem { window: (0, 0), head_dim: 64, ..p }), [KernelId::FlashFwdBf16D64]);
        assert_eq!(names(&Problem { window: (255, 0), head_dim: 192, ..p }), [KernelId::FlashFwdBf16D192Window]);
        let l = Problem { window: (255, 0), head_dim: 192, ..p }.launches(KernelKind::Flash).unwrap()[0].dims;
        assert_eq!((l.grid, l.block, l.dynamic_smem_bytes), ([43, 4, 1], [192, 1, 1], 60 * 1024));
        assert_eq!(names(&Problem { window: (255, 0), head_dim: 256, ..p }), [KernelId::FlashFwdBf16D256]);
        assert_eq!(names(&Problem { window: (127, 0), head_dim: 256, ..p }), [KernelId::FlashFwdBf16D256Window]);
        assert_eq!(names(&Problem { window: (127, 0), head_dim: 96, ..p }), [KernelId::FlashFwdBf16D96Window]);
        assert_eq!(names(&Problem { window: (63, 0), head_dim: 32, ..p }), [KernelId::FlashFwdBf16D32Window]);
        assert_eq!(names(&Problem { window: (63, 0), dtype: Dtype::F32, ..p }), [KernelId::FlashFwdF32D128]);
        // Naive is one set of kernels whatever the window.
        let naive: Vec<KernelId> = Problem { window: (255, 0), ..p }
            .launches(KernelKind::Naive)
            .unwrap()
            .into_iter()
            .map(|l| l.kernel)
            .collect();
        assert_eq!(naive, [KernelId::NaiveScoresBf16, KernelId::NaiveSoftmaxF32, KernelId::NaivePvBf16]);
    }

    pub fn alignment_is_checked_for_the_tensor_core_kernels() {
        let p = Problem { dtype: Dtype::Bf16, ..Problem::default() };
        assert!(p.check_alignment(KernelKind::Flash).is_ok());
        let odd = Problem { head_dim: 96, seq_q: 3, ..p };
        assert!(odd.check_alignment(KernelKind::Flash).is_ok(), "96 elements per row: 16-byte rows");
    }

    pub fn flops_halve_for_square_causal() {
        let p = Problem { seq_q: 1024, seq_kv: 1024, ..Problem::default() };
        let c = Problem { causal: true, ..p };
        let ratio = c.flops() / p.flops();
        assert!((ratio - 0.5).abs() < 1e-3, "{ratio}");
    }
}
