//! The kernel ABI: the one parameter struct every attention kernel takes, and the kernel names.
//!
//! Compiled for both the GPU and the host, so the two cannot disagree about field order, sizes or
//! names. Every kernel takes exactly one parameter, `AttnParams` by value; in PTX it appears as
//! `.param .align 8 .b8 <kernel>_param_0[176]`.

/// Element strides (in elements, not bytes) of a `[batch, seq, heads, head_dim]` tensor whose last
/// dimension is contiguous. BSHD layout: `{ batch: seq*heads*d, seq: heads*d, head: d }`;
/// BHSD layout: `{ batch: heads*seq*d, seq: d, head: seq*d }`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Strides {
    pub batch: u64,
    pub seq: u64,
    pub head: u64,
}

impl Strides {
    /// Strides of a contiguous `[batch, seq, heads, head_dim]` (BSHD) tensor.
    pub const fn bshd(seq: u64, heads: u64, head_dim: u64) -> Self {
        Strides { batch: seq * heads * head_dim, seq: heads * head_dim, head: head_dim }
    }

    /// Strides of a contiguous `[batch, heads, seq, head_dim]` (BHSD) tensor.
    pub const fn bhsd(seq: u64, heads: u64, head_dim: u64) -> Self {
        Strides { batch: heads * seq * head_dim, seq: head_dim, head: seq * head_dim }
    }

    /// Element offset of `(b, s, h, 0)`.
    #[inline(always)]
    pub const fn offset(&self, b: u64, s: u64, h: u64) -> u64 {
        b * self.batch + s * self.seq + h * self.head
    }
}

/// Parameters of every attention kernel (naive and flash), passed by value.
///
/// Pointers are device addresses (0 where a kernel does not use the buffer). `lse` is
/// `[batch, heads, seq_q]` f32, contiguous; `scores` is the naive workspace
/// `[batch, heads, seq_q, seq_kv]` f32, contiguous. Masked scores are `-inf`.
///
/// Causal masking is bottom-right aligned: query `i` sees key `j` iff `j <= i + seq_kv - seq_q`.
/// A query row that sees no key produces `O = 0` and `LSE = -inf`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub scores: u64,
    pub q_strides: Strides,
    pub k_strides: Strides,
    pub v_strides: Strides,
    pub o_strides: Strides,
    pub batch: u32,
    pub heads: u32,
    pub seq_q: u32,
    pub seq_kv: u32,
    pub head_dim: u32,
    /// 0 or 1.
    pub causal: u32,
    /// Multiplies QKᵀ before the softmax (usually 1/sqrt(head_dim)).
    pub softmax_scale: f32,
    pub _pad: u32,
}

/// Size in bytes of [`AttnParams`] as the kernels see it (`.b8 ..._param_0[176]`).
pub const ATTN_PARAMS_BYTES: usize = 176;
const _: () = assert!(core::mem::size_of::<AttnParams>() == ATTN_PARAMS_BYTES);
const _: () = assert!(core::mem::align_of::<AttnParams>() == 8);

impl AttnParams {
    /// The struct as the bytes a launch passes for parameter 0 (little-endian, as on the GPU).
    pub fn to_bytes(&self) -> [u8; ATTN_PARAMS_BYTES] {
        let mut out = [0u8; ATTN_PARAMS_BYTES];
        let mut w = ByteWriter { buf: &mut out, at: 0 };
        for p in [self.q, self.k, self.v, self.o, self.lse, self.scores] {
            w.u64(p);
        }
        for s in [self.q_strides, self.k_strides, self.v_strides, self.o_strides] {
            w.u64(s.batch);
            w.u64(s.seq);
            w.u64(s.head);
        }
        for x in [self.batch, self.heads, self.seq_q, self.seq_kv, self.head_dim, self.causal] {
            w.u32(x);
        }
        w.u32(self.softmax_scale.to_bits());
        w.u32(self._pad);
        debug_assert_eq!(w.at, ATTN_PARAMS_BYTES);
        out
    }

    /// Last key index (exclusive) that query row `i` may attend to: `min(seq_kv, i + 1 + seq_kv -
    /// seq_q)` when causal (may be `<= 0`: the row sees nothing), `seq_kv` otherwise.
    #[inline(always)]
    pub fn key_end(&self, i: u32) -> i64 {
        causal_key_end(self.causal != 0, i, self.seq_q, self.seq_kv)
    }
}

/// See [`AttnParams::key_end`].
#[inline(always)]
pub fn causal_key_end(causal: bool, i: u32, seq_q: u32, seq_kv: u32) -> i64 {
    if causal {
        let e = i as i64 + 1 + seq_kv as i64 - seq_q as i64;
        if e < seq_kv as i64 {
            e
        } else {
            seq_kv as i64
        }
    } else {
        seq_kv as i64
    }
}

struct ByteWriter<'a> {
    buf: &'a mut [u8; ATTN_PARAMS_BYTES],
    at: usize,
}

impl ByteWriter<'_> {
    fn u64(&mut self, x: u64) {
        self.buf[self.at..self.at + 8].copy_from_slice(&x.to_le_bytes());
        self.at += 8;
    }
    fn u32(&mut self, x: u32) {
        self.buf[self.at..self.at + 4].copy_from_slice(&x.to_le_bytes());
        self.at += 4;
    }
}

/// Every kernel entry point in the PTX module. Names say family, dtype and head dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// Smoke test kernel: `y[i] = a * x[i] + y[i]` (see `smoke.rs`).
    Saxpy,
    /// Naive step 1: `S = scale * Q Kᵀ` with the causal mask as `-inf`.
    NaiveScoresF32,
    /// Naive step 2: row softmax of S in place, writing LSE.
    NaiveSoftmaxF32,
    /// Naive step 3: `O = P V`.
    NaivePvF32,
    /// Fused memory-efficient forward, f32 SIMT, head_dim 64.
    FlashFwdF32D64,
    /// Fused memory-efficient forward, f32 SIMT, head_dim 128.
    FlashFwdF32D128,
    /// Fused forward on tensor cores (`mma.sync`), bf16 in/out, f32 accumulation, head_dim 64.
    FlashFwdBf16D64,
    /// Tensor-core forward, bf16, head_dim 128.
    FlashFwdBf16D128,
    /// Tensor-core forward, f16 in/out, f32 accumulation, head_dim 64.
    FlashFwdF16D64,
    /// Tensor-core forward, f16, head_dim 128.
    FlashFwdF16D128,
    /// Naive step 1 with bf16 Q, K (S stays f32).
    NaiveScoresBf16,
    /// Naive step 1 with f16 Q, K.
    NaiveScoresF16,
    /// Naive step 3 with bf16 V, O (P stays f32).
    NaivePvBf16,
    /// Naive step 3 with f16 V, O.
    NaivePvF16,
}

impl KernelId {
    pub const ALL: [KernelId; 14] = [
        KernelId::Saxpy,
        KernelId::NaiveScoresF32,
        KernelId::NaiveSoftmaxF32,
        KernelId::NaivePvF32,
        KernelId::FlashFwdF32D64,
        KernelId::FlashFwdF32D128,
        KernelId::FlashFwdBf16D64,
        KernelId::FlashFwdBf16D128,
        KernelId::FlashFwdF16D64,
        KernelId::FlashFwdF16D128,
        KernelId::NaiveScoresBf16,
        KernelId::NaiveScoresF16,
        KernelId::NaivePvBf16,
        KernelId::NaivePvF16,
    ];

    /// The PTX entry-point name.
    pub const fn name(self) -> &'static str {
        match self {
            KernelId::Saxpy => "saxpy_f32",
            KernelId::NaiveScoresF32 => "naive_scores_f32",
            KernelId::NaiveSoftmaxF32 => "naive_softmax_f32",
            KernelId::NaivePvF32 => "naive_pv_f32",
            KernelId::FlashFwdF32D64 => "flash_fwd_f32_d64",
            KernelId::FlashFwdF32D128 => "flash_fwd_f32_d128",
            KernelId::FlashFwdBf16D64 => "flash_fwd_bf16_d64",
            KernelId::FlashFwdBf16D128 => "flash_fwd_bf16_d128",
            KernelId::FlashFwdF16D64 => "flash_fwd_f16_d64",
            KernelId::FlashFwdF16D128 => "flash_fwd_f16_d128",
            KernelId::NaiveScoresBf16 => "naive_scores_bf16",
            KernelId::NaiveScoresF16 => "naive_scores_f16",
            KernelId::NaivePvBf16 => "naive_pv_bf16",
            KernelId::NaivePvF16 => "naive_pv_f16",
        }
    }

    pub fn from_name(name: &str) -> Option<KernelId> {
        KernelId::ALL.into_iter().find(|k| k.name() == name)
    }
}
