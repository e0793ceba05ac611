//! The tensor maps of the Hopper forward (`flash_fwd_*_sm90_*`): what each of Q, K and V is to
//! the TMA unit, described once here and encoded by the device (CUDA's `cuTensorMapEncodeTiled`,
//! or the VM's own encoding), then placed in global memory where the kernel reads them.

use kernels_gpu::abi::{AttnParams, Strides};
use kernels_gpu::tiles::FlashSm90Tile;

/// A 4-d tiled tensor map of 2-byte elements, 128-byte swizzle, out-of-bounds elements zero:
/// `cuTensorMapEncodeTiled`'s arguments (dims and strides innermost first; `strides[i]` is the
/// byte stride of dim `i + 1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorMapDesc {
    /// The tensor's device address (16-byte aligned).
    pub address: u64,
    /// Elements of each dim, innermost first.
    pub dims: [u64; 4],
    /// Byte strides of dims 1, 2 and 3 (dim 0 is contiguous).
    pub strides: [u64; 3],
    /// Elements of each dim one load (a box) copies, innermost first.
    pub box_dims: [u32; 4],
}

impl TensorMapDesc {
    /// Bytes of one element.
    pub const ELEM_BYTES: u64 = 2;

    /// Why `cuTensorMapEncodeTiled` would refuse this map, checked before any device call (the
    /// same rules on every backend): a 16-byte aligned address, strides multiples of 16 below
    /// 2^40, dims in 1..=2^32, box dims in 1..=256 with an inner box of 16..=128 bytes (the
    /// 128-byte swizzle's span).
    pub fn check(&self) -> Result<(), String> {
        if !self.address.is_multiple_of(16) {
            return Err(format!("address {:#x} is not 16-byte aligned", self.address));
        }
        for (i, s) in self.strides.iter().enumerate() {
            if !s.is_multiple_of(16) || *s >= 1 << 40 {
                return Err(format!("stride of dim {} is {s} bytes (must be a multiple of 16 below 2^40)", i + 1));
            }
        }
        for (i, d) in self.dims.iter().enumerate() {
            if *d == 0 || *d > 1 << 32 {
                return Err(format!("dim {i} is {d} (must be 1..=2^32)"));
            }
        }
        for (i, b) in self.box_dims.iter().enumerate() {
            if *b == 0 || *b > 256 {
                return Err(format!("box dim {i} is {b} (must be 1..=256)"));
            }
        }
        let inner = self.box_dims[0] as u64 * Self::ELEM_BYTES;
        if !inner.is_multiple_of(16) || inner > 128 {
            return Err(format!("the inner box is {inner} bytes (must be a multiple of 16, at most 128)"));
        }
        Ok(())
    }
}

/// The Q, K and V maps of one forward launch of `tile`: each tensor as `(D, heads, seq, batch)`
/// with its strides, box `(64, 1, rows, 1)` (`rows` 128 for Q, the key tile for K and V) — or
/// `(D, seq, heads, batch)`, box `(64, rows, 1, 1)`, when its head stride is larger than its seq
/// stride (`[batch, heads, seq, d]`): TMA wants each dimension's stride to cover the ones below
/// it, and the kernel orders its coordinates by the same rule ([`kernels_gpu::abi::Strides`]).
/// A varlen launch (`cu_seqlens_q != 0`) maps the packed tensors as one sequence of all rows
/// (batch 1), as the kernel addresses them.
pub fn forward_maps(p: &AttnParams, tile: FlashSm90Tile, total_kv: u64) -> [TensorMapDesc; 3] {
    let d = p.head_dim as u64;
    let varlen = p.cu_seqlens_q != 0;
    let e = TensorMapDesc::ELEM_BYTES;
    let map = |address: u64, s: &Strides, heads: u32, seq: u64, rows: u32| {
        let batch = if varlen { 1 } else { p.batch as u64 };
        let (dims, mut strides, box_dims) = if s.head > s.seq {
            ([d, seq, heads as u64, batch], [e * s.seq, e * s.head, 0], [64, rows, 1, 1])
        } else {
            ([d, heads as u64, seq, batch], [e * s.head, e * s.seq, 0], [64, 1, rows, 1])
        };
        // One packed sequence: no batch dimension to speak of; any stride covering the rest.
        strides[2] = if varlen { (strides[0] * dims[1]).max(strides[1] * dims[2]) } else { e * s.batch };
        // A dimension of extent 1 is never stepped along, so its stride only has to cover the
        // dimensions below it, which TMA requires: a `[batch, heads, 1, d]` tensor has a seq
        // stride of `d`, below the `heads * d` its head dimension spans.
        let mut span = e * dims[0];
        for i in 0..3 {
            if dims[i + 1] == 1 {
                strides[i] = strides[i].max(span);
            }
            span = strides[i] * dims[i + 1];
        }
        TensorMapDesc { address, dims, strides, box_dims }
    };
    let heads_kv = if p.heads_kv == 0 { p.heads } else { p.heads_kv };
    let (seq_q, seq_kv) = if varlen { (p.total_q as u64, total_kv) } else { (p.seq_q as u64, p.seq_kv as u64) };
    [
        map(p.q, &p.q_strides, p.heads, seq_q, FlashSm90Tile::BR),
        map(p.k, &p.k_strides, heads_kv, seq_kv, tile.bc),
        map(p.v, &p.v_strides, heads_kv, seq_kv, tile.bc),
    ]
}
