//! The shared-memory swizzle modes of Hopper's tensor copies (`cp.async.bulk.tensor`, a tensor
//! map's `CU_TENSOR_MAP_SWIZZLE_*`) and of `wgmma`'s matrix descriptors (the layout type in bits
//! 62–63), one definition for both.
//!
//! A swizzle permutes the 16-byte chunks inside each row of a repeating pattern of 8 rows: the
//! chunk index (address bits 4 and up) is XORed with the row index (address bits 7 and up), so
//! that 8 threads reading the same column of 8 consecutive rows hit 8 different bank groups. The
//! pattern is a function of the shared-memory byte address itself, which is why such buffers must
//! be aligned to the pattern's size (`8 × span` bytes: 1024 for 128-byte swizzle).
//!
//! | mode | span (bytes of a row) | chunk bits XORed | with address bits | pattern repeats every |
//! |---|---|---|---|---|
//! | none | — | — | — | — |
//! | 32B | 32 | 4 | 7 | 256 B |
//! | 64B | 64 | 4–5 | 7–8 | 512 B |
//! | 128B | 128 | 4–6 | 7–9 | 1024 B |

/// One of the four swizzle modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Swizzle {
    None,
    B32,
    B64,
    B128,
}

impl Swizzle {
    /// Bytes of one swizzled row (the inner box dimension in bytes must not exceed it); 0 for
    /// [`Swizzle::None`].
    pub fn span(self) -> u32 {
        match self {
            Swizzle::None => 0,
            Swizzle::B32 => 32,
            Swizzle::B64 => 64,
            Swizzle::B128 => 128,
        }
    }

    /// Bytes after which the pattern repeats (`8 × span`), the alignment a swizzled buffer needs;
    /// 16 for [`Swizzle::None`].
    pub fn repeat(self) -> u32 {
        match self {
            Swizzle::None => 16,
            s => 8 * s.span(),
        }
    }

    /// The address a logical shared-memory byte address `addr` is stored at. An involution:
    /// `apply(apply(a)) == a`.
    #[inline]
    pub fn apply(self, addr: u32) -> u32 {
        let mask = match self {
            Swizzle::None => return addr,
            Swizzle::B32 => 0x10,
            Swizzle::B64 => 0x30,
            Swizzle::B128 => 0x70,
        };
        addr ^ ((addr >> 3) & mask)
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn chunks_of_row_r_move_by_r_modulo_the_pattern() {
        // 128B: row r (128 bytes each) of an aligned 1024-byte block has its chunk c at c ^ (r % 8).
        for r in 0..16u32 {
            for c in 0..8u32 {
                for b in [0u32, 5, 15] {
                    let logical = 2048 + r * 128 + c * 16 + b;
                    assert_eq!(Swizzle::B128.apply(logical), 2048 + r * 128 + ((c ^ (r % 8)) * 16) + b);
                }
            }
        }
        // 64B: rows of 64 bytes; chunk c (0..4) of row r moves to c ^ ((r / 2) % 4).
        for r in 0..8u32 {
            for c in 0..4u32 {
                let logical = r * 64 + c * 16;
                assert_eq!(Swizzle::B64.apply(logical), r * 64 + ((c ^ ((r / 2) % 4)) * 16));
            }
        }
        // 32B: rows of 32 bytes; chunk c (0..2) of row r moves to c ^ ((r / 4) % 2).
        for r in 0..8u32 {
            for c in 0..2u32 {
                let logical = r * 32 + c * 16;
                assert_eq!(Swizzle::B32.apply(logical), r * 32 + ((c ^ ((r / 4) % 2)) * 16));
            }
        }
        for s in [Swizzle::None, Swizzle::B32, Swizzle::B64, Swizzle::B128] {
            for a in (0..4096u32).step_by(3) {
                assert_eq!(s.apply(s.apply(a)), a);
            }
        }
    }
}
