//! The kernel ABI: the one parameter struct every attention kernel takes.
//!
//! Compiled for both the GPU and the host, so the two cannot disagree about field order or sizes.
//! Every attention kernel (naive and flash) takes exactly one parameter, `AttnParams` by value; in
//! PTX it appears as `.param .align 8 .b8 <kernel>_param_0[264]`. The smoke kernel `saxpy_f32`
//! is the one exception (four scalar parameters). Kernel names live in [`crate::variants`].

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
/// The semantics (FlashAttention-2's) are tabulated once, in `docs/semantics.md`:
/// - K and V have `heads_kv` heads; query head `h` reads K/V head `h / (heads / heads_kv)`.
/// - Window `(window_left, window_right)`, `-1` = unbounded, bottom-right aligned: query `i`
///   sees key `j` iff `i + seq_kv - seq_q - left <= j <= i + seq_kv - seq_q + right`;
///   `causal != 0` forces `right = 0` ([`AttnParams::key_range`]).
/// - `softcap > 0`: scores are `softcap * tanh(softmax_scale * q·k / softcap)`; 0 = off.
/// - `sinks` (0 = none): `heads` f32 logits; `sink[h]` joins the softmax denominator only.
/// - `alibi_slopes` (0 = none): ALiBi, the score of query `i`, key `j` gains
///   `-slope * |i + seq_kv - seq_q - j|` ([`AttnParams::alibi_slopes`]).
/// - Varlen (`cu_seqlens_q != 0`): `batch` packed sequences. Q/O are `[total_q, heads, d]` and
///   K/V `[total_kv, heads_kv, d]` (the batch strides are unused), `cu_seqlens_q` and
///   `cu_seqlens_kv` are `batch + 1` u32 prefix sums (first 0, non-decreasing), sequence `b` has
///   rows `cu_q[b]..cu_q[b + 1]` and keys `cu_kv[b]..cu_kv[b + 1]`; `seq_q` / `seq_kv` are the
///   longest sequence's lengths (they size the grid and the naive workspace
///   `[batch, heads, seq_q, seq_kv]`); LSE is `[heads, total_q]`. Masks apply per sequence
///   ([`AttnParams::sequence`]); an empty sequence produces nothing.
///
/// A query row that sees no key (and has no sink) produces `O = 0` and `LSE = -inf`; with a
/// sink it produces `O = 0` and `LSE = sink[h]`.
///
/// `AttnParams::default()` is plain attention: null pointers, zero sizes, `heads_kv` 0 (meaning
/// `heads`), window `(-1, -1)`, no soft cap, no sinks.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
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
    /// Heads of K and V (divides `heads`; `heads` for multi-head, 1 for multi-query attention;
    /// 0 also means `heads`).
    pub heads_kv: u32,
    /// Keys before the diagonal a query sees (`-1`: unbounded).
    pub window_left: i32,
    /// Keys after the diagonal a query sees (`-1`: unbounded; `causal` forces 0).
    pub window_right: i32,
    /// Logit soft cap (`0`: off).
    pub softcap: f32,
    /// Added to every `seqused_k` entry (a KV-cache call's appended tokens).
    pub seqused_k_add: u32,
    /// `[heads]` f32 sink logits, or 0 for none.
    pub sinks: u64,
    /// Varlen: `[batch + 1]` u32 prefix sums of the query lengths, or 0 (not varlen).
    pub cu_seqlens_q: u64,
    /// Varlen: `[batch + 1]` u32 prefix sums of the key lengths.
    pub cu_seqlens_kv: u64,
    /// Varlen: total query rows (`cu_seqlens_q[batch]`), the head stride of LSE `[heads, total_q]`.
    pub total_q: u32,
    /// ALiBi: elements between two sequences' slopes (`heads` for `[batch, heads]` slopes, 0 for
    /// one `[heads]` row shared by every sequence).
    pub alibi_batch_stride: u32,
    /// ALiBi (FlashAttention-2's `alibi_slopes`): f32 slopes, slope `m` of sequence `b`, head
    /// `h` at `b * alibi_batch_stride + h`; the score of query `i`, key `j` gains
    /// `-m * |i + seq_kv - seq_q - j|` (after the soft cap, before the mask); 0: none.
    pub alibi_slopes: u64,
    /// A KV cache (chunked prefill; the bf16/f16 tensor-core forward only, whose fourth loop
    /// reads it): `[batch]` u32 key counts (FlashAttention-2's `seqused_k`), or 0 (no cache:
    /// every field below is then ignored). Sequence `b` has `seqused_k[b] + seqused_k_add` keys.
    /// Paged (`block_table` non-zero), K and V are `[num_pages, page_size, heads_kv, D]` with
    /// `k_strides`/`v_strides` giving the page (`batch`), row (`seq`) and head strides; key `j`
    /// of sequence `b` is row `j % page_size` of page `block_table[b * max_pages + j /
    /// page_size]`, any `page_size >= 1`. Contiguous (`block_table` 0), K and V are `[batch,
    /// seq_cache, heads_kv, D]` and `page_size` must be 2^31. Varlen reads `cu_seqlens_kv` as
    /// usual (any `batch + 1` u32 will do: the cache, not the key offset, places the keys).
    pub seqused_k: u64,
    /// `[batch, max_pages]` u32 page indices, or 0 (a contiguous cache).
    pub block_table: u64,
    /// Keys per page (2^31 for a contiguous cache).
    pub page_size: u32,
    /// Entries per row of `block_table`.
    pub max_pages: u32,
    /// A KV-cache call with device-checked indices (`crate::kv_check`): the address of the
    /// call's status words, or 0. When non-zero, the tensor-core forward returns at once if
    /// status word 0 is set, so no index that failed the check is used.
    pub status: u64,
}

/// Size in bytes of [`AttnParams`] as the kernels see it (`.b8 ..._param_0[264]`).
pub const ATTN_PARAMS_BYTES: usize = 264;
const _: () = assert!(core::mem::size_of::<AttnParams>() == ATTN_PARAMS_BYTES);
const _: () = assert!(core::mem::align_of::<AttnParams>() == 8);

/// Parameters of the Hopper forward ([`crate::flash_fwd_sm90`]): the attention parameters and
/// the device address of its three 128-byte tensor maps (Q, K, V, in that order, 128-byte
/// aligned, in global memory: a by-value 64-byte-aligned parameter is not something rustc can
/// pass, and TMA reads maps from global, constant or parameter memory alike).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sm90Params {
    pub attn: AttnParams,
    pub tensor_maps: u64,
}

/// Size in bytes of [`Sm90Params`] (`.b8 ..._param_0[272]`).
pub const SM90_PARAMS_BYTES: usize = 272;
const _: () = assert!(core::mem::size_of::<Sm90Params>() == SM90_PARAMS_BYTES);

impl Sm90Params {
    /// The struct's bytes as the kernel reads them.
    pub fn to_bytes(&self) -> [u8; SM90_PARAMS_BYTES] {
        let mut out = [0u8; SM90_PARAMS_BYTES];
        out[..ATTN_PARAMS_BYTES].copy_from_slice(&self.attn.to_bytes());
        out[ATTN_PARAMS_BYTES..].copy_from_slice(&self.tensor_maps.to_le_bytes());
        out
    }
}

/// The three tensor maps of one Hopper-forward launch (Q, K, V; 128 bytes each), as 64-bit words.
pub const TENSOR_MAP_WORDS: usize = 3 * 128 / 8;

/// Parameters of `tensor_maps_store` ([`crate::tensor_maps`]): the Hopper forward's three tensor
/// maps by value and the global address they are stored to. Passing the maps as a kernel
/// parameter makes the store a launch on the caller's stream (captured by value in a CUDA graph):
/// no host copy, allocation or synchronisation per forward call.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorMapsParams {
    /// 128-byte aligned global address of `3 * 128` bytes: [`Sm90Params::tensor_maps`] of the
    /// forward launch that follows on the same stream.
    pub dst: u64,
    pub maps: [u64; TENSOR_MAP_WORDS],
}

/// Size in bytes of [`TensorMapsParams`] (`.b8 tensor_maps_store_param_0[392]`).
pub const TENSOR_MAPS_PARAMS_BYTES: usize = 8 + 3 * 128;
const _: () = assert!(core::mem::size_of::<TensorMapsParams>() == TENSOR_MAPS_PARAMS_BYTES);

impl TensorMapsParams {
    /// `dst` and the maps' 384 bytes (`maps` as the encoder wrote them).
    pub fn new(dst: u64, maps: &[u8; 3 * 128]) -> TensorMapsParams {
        let mut words = [0u64; TENSOR_MAP_WORDS];
        for (w, b) in words.iter_mut().zip(maps.chunks_exact(8)) {
            let mut le = [0u8; 8];
            le.copy_from_slice(b);
            *w = u64::from_le_bytes(le);
        }
        TensorMapsParams { dst, maps: words }
    }
    /// The struct's bytes as the kernel reads them.
    pub fn to_bytes(&self) -> [u8; TENSOR_MAPS_PARAMS_BYTES] {
        let mut out = [0u8; TENSOR_MAPS_PARAMS_BYTES];
        out[..8].copy_from_slice(&self.dst.to_le_bytes());
        for (i, w) in self.maps.iter().enumerate() {
            out[8 + 8 * i..16 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        out
    }
}

impl Default for AttnParams {
    fn default() -> Self {
        let z = Strides { batch: 0, seq: 0, head: 0 };
        AttnParams {
            q: 0,
            k: 0,
            v: 0,
            o: 0,
            lse: 0,
            scores: 0,
            q_strides: z,
            k_strides: z,
            v_strides: z,
            o_strides: z,
            batch: 0,
            heads: 0,
            seq_q: 0,
            seq_kv: 0,
            head_dim: 0,
            causal: 0,
            softmax_scale: 0.0,
            heads_kv: 0,
            window_left: -1,
            window_right: -1,
            softcap: 0.0,
            seqused_k_add: 0,
            sinks: 0,
            cu_seqlens_q: 0,
            cu_seqlens_kv: 0,
            total_q: 0,
            alibi_batch_stride: 0,
            alibi_slopes: 0,
            seqused_k: 0,
            block_table: 0,
            page_size: 0,
            max_pages: 0,
            status: 0,
        }
    }
}

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
        w.u32(self.heads_kv);
        w.u32(self.window_left as u32);
        w.u32(self.window_right as u32);
        w.u32(self.softcap.to_bits());
        w.u32(self.seqused_k_add);
        w.u64(self.sinks);
        w.u64(self.cu_seqlens_q);
        w.u64(self.cu_seqlens_kv);
        w.u32(self.total_q);
        w.u32(self.alibi_batch_stride);
        w.u64(self.alibi_slopes);
        w.u64(self.seqused_k);
        w.u64(self.block_table);
        w.u32(self.page_size);
        w.u32(self.max_pages);
        w.u64(self.status);
        debug_assert_eq!(w.at, ATTN_PARAMS_BYTES);
        out
    }

    /// Keys `[start, end)` query row `i` may see (empty when `start >= end`): the window rule
    /// [`crate::mask::key_range`] with this problem's (or, after [`AttnParams::sequence`], this
    /// sequence's) lengths.
    #[inline(always)]
    pub fn key_range(&self, i: u32) -> (i64, i64) {
        crate::mask::key_range(self.causal != 0, self.window_left, self.window_right, i, self.seq_q, self.seq_kv)
    }

    /// Varlen: the lengths of sequence `b` (rows `q0..q1`, keys `k0..k1`, read from the
    /// cu_seqlens by the kernel): the same parameters with `seq_q = q1 - q0`, `seq_kv = k1 - k0`,
    /// so windows and causal apply within the sequence, bottom-right aligned. The kernel adds the
    /// sequence's first row (`q0`, `k0`) to its row indices and uses batch index 0
    /// ([`Sequence`]).
    #[inline(always)]
    pub fn sequence(&self, q0: u32, q1: u32, k0: u32, k1: u32) -> Sequence {
        let mut p = *self;
        p.seq_q = q1 - q0;
        p.seq_kv = k1 - k0;
        Sequence { p, b: 0, q0: q0 as u64, k0: k0 as u64 }
    }

    /// Element offset of LSE `(b, h, i)`: `[batch, heads, seq_q]`, or (varlen, `b` = 0, `i` the
    /// packed row `q0 + i`) `[heads, total_q]`.
    #[inline(always)]
    pub fn lse_offset(&self, b: u64, h: u64, i: u64) -> u64 {
        if self.cu_seqlens_q != 0 {
            h * self.total_q as u64 + i
        } else {
            (b * self.heads as u64 + h) * self.seq_q as u64 + i
        }
    }

    /// The K/V head query head `h` reads: `h / (heads / heads_kv)` (`h` when `heads_kv` is 0 or
    /// exceeds `heads`, so no division by zero).
    #[inline(always)]
    pub fn kv_head(&self, h: u32) -> u32 {
        let group = if self.heads_kv != 0 && self.heads_kv <= self.heads { self.heads / self.heads_kv } else { 1 };
        h / group
    }
}

/// One block's sequence: parameters with its lengths, the batch index to address Q/K/V/O with,
/// and the packed row of its first query (`q0`) and key (`k0`); `q0 = k0 = 0` without varlen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sequence {
    pub p: AttnParams,
    pub b: u64,
    pub q0: u64,
    pub k0: u64,
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

/// Parameters of the backward kernels (`flash_bwd_*`), passed by value: the forward's
/// parameters (q, k, v, o, lse, their strides, sizes and options; `scores` unused) and the
/// gradients' buffers.
///
/// - `d_o`: the upstream gradient, shaped and strided like O (`d_o_strides`);
/// - `delta`: `D = rowsum(dO ∘ O)` f32, laid out like LSE ([`AttnParams::lse_offset`]);
/// - `dq_accum`: the f32 dQ workspace, slices `[batch, seq_q, heads, d]` (`dq_accum_strides`)
///   `dq_split_stride` elements apart. Atomic mode (`dq_split_stride == 0`): one slice, zeroed
///   by the preprocess kernel, added to with `red.global.add.f32` by every main block.
///   Deterministic mode: `dq_splits` slices, one per key block of `key_block` keys (main block
///   `x` stores into slice `x`); the convert kernel sums the slices of the key blocks a row sees,
///   in key order;
/// - `dq` (like q, `dq_strides`), `dk`, `dv` (like k and v, `heads_kv` heads): the outputs;
/// - `dsinks`: `[heads]` f32 sink gradients, or 0 (not wanted);
/// - `key_block`: the main kernel's keys per block (its tile's `bc`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BwdParams {
    pub attn: AttnParams,
    pub d_o: u64,
    pub delta: u64,
    pub dq_accum: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub dsinks: u64,
    pub d_o_strides: Strides,
    pub dq_accum_strides: Strides,
    pub dq_strides: Strides,
    pub dk_strides: Strides,
    pub dv_strides: Strides,
    pub dq_split_stride: u64,
    pub dq_splits: u32,
    pub key_block: u32,
}

/// Size in bytes of [`BwdParams`] (`.b8 ..._param_0[456]`).
pub const BWD_PARAMS_BYTES: usize = 456;
const _: () = assert!(core::mem::size_of::<BwdParams>() == BWD_PARAMS_BYTES);
const _: () = assert!(core::mem::align_of::<BwdParams>() == 8);

impl BwdParams {
    /// The struct as the bytes a launch passes (little-endian, `repr(C)` order).
    pub fn to_bytes(&self) -> [u8; BWD_PARAMS_BYTES] {
        let mut out = [0u8; BWD_PARAMS_BYTES];
        out[..ATTN_PARAMS_BYTES].copy_from_slice(&self.attn.to_bytes());
        let mut at = ATTN_PARAMS_BYTES;
        let mut put = |x: u64| {
            out[at..at + 8].copy_from_slice(&x.to_le_bytes());
            at += 8;
        };
        for p in [self.d_o, self.delta, self.dq_accum, self.dq, self.dk, self.dv, self.dsinks] {
            put(p);
        }
        for s in [self.d_o_strides, self.dq_accum_strides, self.dq_strides, self.dk_strides, self.dv_strides] {
            put(s.batch);
            put(s.seq);
            put(s.head);
        }
        put(self.dq_split_stride);
        put(self.dq_splits as u64 | (self.key_block as u64) << 32);
        debug_assert_eq!(at, BWD_PARAMS_BYTES);
        out
    }
}

/// Parameters of the naive backward kernels (`naive_bwd_*`, [`crate::tiles::NAIVE_BWD_P`] ...),
/// passed by value: the backward's [`BwdParams`] (q, k, v, o, lse, d_o, dq, dk, dv and their
/// strides; `delta`, `dq_accum` and `dsinks` unused) with the two materialised matrices, both
/// `[batch, heads, seq_q, seq_kv]` f32, contiguous (varlen: the longest lengths, as the naive
/// forward's scores):
///
/// - `bwd.attn.scores`: P, `P_ij = exp(s_ij - LSE_i)` (0 where row `i` does not see key `j`);
/// - `ds`: the gradient of the raw dot product `x_ij = q_i · k_j`, `dS_ij · ds/dx`
///   (`dS_ij = P_ij (dO_i · v_j - D_i)`, `ds/dx` the scale, with a soft cap
///   `scale · (1 - tanh²)`), so `dQ = ds K` and `dK = dsᵀ Q` need no further factor.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NaiveBwdParams {
    pub bwd: BwdParams,
    pub ds: u64,
}

/// Size in bytes of [`NaiveBwdParams`] (`.b8 ..._param_0[464]`).
pub const NAIVE_BWD_PARAMS_BYTES: usize = 464;
const _: () = assert!(core::mem::size_of::<NaiveBwdParams>() == NAIVE_BWD_PARAMS_BYTES);
const _: () = assert!(core::mem::align_of::<NaiveBwdParams>() == 8);

impl NaiveBwdParams {
    /// The struct as the bytes a launch passes (little-endian, `repr(C)` order).
    pub fn to_bytes(&self) -> [u8; NAIVE_BWD_PARAMS_BYTES] {
        let mut out = [0u8; NAIVE_BWD_PARAMS_BYTES];
        out[..BWD_PARAMS_BYTES].copy_from_slice(&self.bwd.to_bytes());
        out[BWD_PARAMS_BYTES..].copy_from_slice(&self.ds.to_le_bytes());
        out
    }
}

pub use crate::variants::KernelId;

#[cfg(all(feature = "unit-tests", not(target_arch = "nvptx64")))]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    /// `to_bytes` writes exactly the `repr(C)` layout the kernels read (every field distinct, so
    /// a swapped or missing field shows).
    pub fn to_bytes_is_the_repr_c_layout() {
        let s = |x: u64| Strides { batch: x, seq: x + 1, head: x + 2 };
        let p = AttnParams {
            q: 1,
            k: 2,
            v: 3,
            o: 4,
            lse: 5,
            scores: 6,
            q_strides: s(10),
            k_strides: s(20),
            v_strides: s(30),
            o_strides: s(40),
            batch: 50,
            heads: 51,
            seq_q: 52,
            seq_kv: 53,
            head_dim: 54,
            causal: 1,
            softmax_scale: 0.5,
            heads_kv: 55,
            window_left: -1,
            window_right: 7,
            softcap: 2.5,
            seqused_k_add: 70,
            sinks: 60,
            cu_seqlens_q: 61,
            cu_seqlens_kv: 62,
            total_q: 63,
            alibi_batch_stride: 64,
            alibi_slopes: 65,
            seqused_k: 66,
            block_table: 67,
            page_size: 68,
            max_pages: 69,
            status: 71,
        };
        // SAFETY: AttnParams is repr(C), Copy, and has no padding bytes (size asserted above).
        let raw: [u8; ATTN_PARAMS_BYTES] = unsafe { core::mem::transmute(p) };
        assert_eq!(p.to_bytes(), raw);
        assert_eq!(AttnParams::default().window_left, -1);
        assert_eq!(AttnParams::default().kv_head(3), 3);
    }

    pub fn bwd_to_bytes_is_the_repr_c_layout() {
        let s = |x: u64| Strides { batch: x, seq: x + 1, head: x + 2 };
        let attn = AttnParams { q: 1, k: 2, lse: 5, seq_q: 7, softcap: 1.5, window_left: 3, ..Default::default() };
        let p = BwdParams {
            attn,
            d_o: 70,
            delta: 71,
            dq_accum: 72,
            dq: 73,
            dk: 74,
            dv: 75,
            dsinks: 76,
            d_o_strides: s(80),
            dq_accum_strides: s(90),
            dq_strides: s(100),
            dk_strides: s(110),
            dv_strides: s(120),
            dq_split_stride: 130,
            dq_splits: 131,
            key_block: 132,
        };
        // SAFETY: BwdParams is repr(C), Copy, and has no padding bytes (size asserted above).
        let raw: [u8; BWD_PARAMS_BYTES] = unsafe { core::mem::transmute(p) };
        assert_eq!(p.to_bytes(), raw);
    }

    pub fn naive_bwd_to_bytes_is_the_repr_c_layout() {
        let attn = AttnParams { q: 1, scores: 6, seq_kv: 9, softcap: 0.5, ..Default::default() };
        let z = Strides::default();
        let bwd = BwdParams {
            attn,
            d_o: 70,
            delta: 0,
            dq_accum: 0,
            dq: 73,
            dk: 74,
            dv: 75,
            dsinks: 0,
            d_o_strides: Strides { batch: 1, seq: 2, head: 3 },
            dq_accum_strides: z,
            dq_strides: Strides { batch: 4, seq: 5, head: 6 },
            dk_strides: z,
            dv_strides: z,
            dq_split_stride: 0,
            dq_splits: 1,
            key_block: 0,
        };
        let p = NaiveBwdParams { bwd, ds: 77 };
        // SAFETY: NaiveBwdParams is repr(C), Copy, and has no padding bytes (size asserted above).
        let raw: [u8; NAIVE_BWD_PARAMS_BYTES] = unsafe { core::mem::transmute(p) };
        assert_eq!(p.to_bytes(), raw);
    }

    pub fn key_range_and_kv_head() {
        let p = AttnParams {
            seq_q: 5,
            seq_kv: 8,
            window_left: 2,
            window_right: 1,
            heads: 8,
            heads_kv: 2,
            ..Default::default()
        };
        // Row 0: diagonal at key 3, sees 1..=4.
        assert_eq!(p.key_range(0), (1, 5));
        assert_eq!(p.key_range(4), (5, 8));
        assert_eq!(AttnParams { causal: 1, ..p }.key_range(0), (1, 4));
        assert_eq!((p.kv_head(0), p.kv_head(3), p.kv_head(4), p.kv_head(7)), (0, 0, 1, 1));
        let s = p.sequence(10, 13, 20, 20);
        assert_eq!((s.p.seq_q, s.p.seq_kv, s.q0, s.k0, s.b), (3, 0, 10, 20, 0));
        assert_eq!(AttnParams { cu_seqlens_q: 8, total_q: 40, ..p }.lse_offset(0, 2, 11), 91);
        assert_eq!(p.lse_offset(1, 2, 3), (8 + 2) * 5 + 3);
    }
}
