//! Staging tiles in shared memory, shared by the tensor-core kernels of every family (the
//! forward and both backward kernels): the unit of dynamic shared memory, the global rows of one
//! head, and the `cp.async` copies of a tile into the swizzled layout (nvptx64 only). No kernel
//! file supplies these to another.

use crate::device::*;
use crate::mma::cp_async_16;
use crate::swizzle::{copy_group_rows, copy_phases, copy_slot, swizzled_offset, CHUNK};

/// Unit of dynamic shared memory: `cp.async` and `ldmatrix` need 16-byte alignment, and the
/// lane addresses ([`TileLane`]) 128-byte aligned tiles.
#[repr(C, align(128))]
pub(crate) struct SmemChunk([u8; CHUNK]);

/// Global addresses of one `[seq, D]` slice (fixed batch and head) of a strided 2-byte tensor.
#[derive(Clone, Copy)]
pub(crate) struct Rows {
    /// `.global` address of row 0.
    pub(crate) base: u64,
    /// Bytes between consecutive rows.
    pub(crate) stride: u64,
    /// Rows that exist; rows at or past it are zero-filled.
    pub(crate) len: usize,
    /// Head columns that exist (the problem's head dim, a multiple of 8, at most `D`); the
    /// chunks of a row at or past it are zero-filled, never read.
    pub(crate) cols: u32,
}

impl Rows {
    /// Whether chunk `c` (columns `8c..8c + 8`) of a row exists: false only when a head dim
    /// below the tile's `D` runs on it (`cols < D`).
    #[inline(always)]
    pub(crate) fn chunk_exists(&self, c: usize) -> bool {
        ((c * (CHUNK / 2)) as u32) < self.cols
    }
}

/// Starts the `cp.async` copies of `ROWS` rows `row0..row0 + ROWS` of `src` into the swizzled
/// tile at shared address `tile`; with one copy phase ([`copy_phases`]) this thread copies chunk
/// `tid % CPR` of every `THREADS / CPR`-th row starting at `tid / CPR`, with several the chunk
/// of [`copy_slot`] in each phase. Used for the Q tile (once per block).
#[inline(always)]
pub(crate) unsafe fn stage_tile<const D: usize, const ROWS: usize, const THREADS: usize>(
    tile: u32,
    src: Rows,
    row0: usize,
    tid: usize,
) {
    let rows_per_pass = const { copy_group_rows(D, THREADS) };
    const { assert!(ROWS % copy_group_rows(D, THREADS) == 0, "whole groups of rows per copy phase") };
    const { assert!(copy_group_rows(D, THREADS) % 4 == 0, "a thread's rows take one or two swizzles") };
    const { assert!(copy_phases(D, THREADS) == 1 || copy_group_rows(D, THREADS) % 8 == 0, "one swizzle per phase") };
    let tile = opaque_u32(tile);
    unroll4!(j in 0..(const { copy_phases(D, THREADS) }) => {
        let (r, c) = copy_slot(D, THREADS, tid, j);
        let dst = tile + swizzled_offset(D, r, c) as u32;
        // Passes of a multiple of 8 rows keep a thread's swizzle; passes of 4 mod 8 rows (d 192 at
        // 3 warps, d 256 at 4) alternate between two destinations.
        let dst_odd = tile + (swizzled_offset(D, r + rows_per_pass, c) - rows_per_pass * D * 2) as u32;
        // 32-bit row bookkeeping: fewer 64-bit registers live across the key loop. A chunk past
        // the head dim counts no rows: it is zero-filled like a row past the end.
        let rows_left = if src.chunk_exists(c) { src.len.saturating_sub(row0 + r) as u32 } else { 0 };
        let first = src.base + (row0 + r) as u64 * src.stride + (c * CHUNK) as u64;
        let mut k = 0;
        while k < ROWS / rows_per_pass {
            let (addr, bytes) = if ((k * rows_per_pass) as u32) < rows_left {
                (first + (k * rows_per_pass) as u64 * src.stride, CHUNK as u32)
            } else {
                (src.base, 0) // zero-fill: nothing is read
            };
            let base = if rows_per_pass % 8 == 0 || k % 2 == 0 { dst } else { dst_odd };
            unsafe { cp_async_16(base + (k * rows_per_pass * D * 2) as u32, addr, bytes) };
            k += 1;
        }
    });
}
