//! The aliasing rules of every call that writes memory the caller owns: nothing a launch writes
//! may share a byte with anything it reads or with another tensor it writes, and a written view
//! may not map two of its elements to one address. The kernels read inputs while other blocks
//! write outputs, so any overlap gives an order-dependent answer with no error from the device.
//!
//! The checks are conservative and O(1) per pair of tensors: each tensor is the byte range
//! `[ptr, ptr + span)` of its view (from element `[0, 0, 0, 0]` to one past its last element), and
//! two ranges of one address space (one VM or device instance, one CUDA context) that intersect
//! are refused even when the strides would interleave without touching. A written view is
//! one-to-one when its dimensions, sorted by stride, each step over the whole span of the
//! dimensions inside it ([`injective`]); layouts that interleave without that nesting are refused.

use super::{AttnError, IndexTensor, Place, RawView};

/// Why a call's tensors were refused as sharing memory ([`AttnError::Aliasing`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AliasRule {
    /// A tensor the call writes shares bytes with another tensor of the call. The message names
    /// the shared bytes (the intersection of the two ranges). Views into one allocation are
    /// accepted when their ranges are disjoint (vLLM's joint KV cache: k_cache and v_cache the
    /// two halves of one `[2, num_pages, page_size, heads_kv, head_dim]` buffer).
    #[error(
        "{written} (written, bytes {:#x}..{:#x}) overlaps {other} (bytes {:#x}..{:#x}): they share bytes {:#x}..{:#x} ({} bytes), and a tensor the call writes must not share memory with any tensor it reads or writes (views into one allocation are fine when their bytes are disjoint)",
        written_bytes[0], written_bytes[1], other_bytes[0], other_bytes[1],
        written_bytes[0].max(other_bytes[0]), written_bytes[1].min(other_bytes[1]),
        written_bytes[1].min(other_bytes[1]).saturating_sub(written_bytes[0].max(other_bytes[0]))
    )]
    Overlap {
        /// The written tensor's name.
        written: &'static str,
        /// The other tensor's name.
        other: &'static str,
        /// The written tensor's bytes, `[start, end)` addresses.
        written_bytes: [u64; 2],
        /// The other tensor's bytes, `[start, end)` addresses.
        other_bytes: [u64; 2],
    },
    /// A written view whose strides send two elements to one address.
    #[error(
        "{tensor} has shape {shape:?} and strides {strides:?}: distinct elements would share memory (each stride, in increasing order, must exceed the span of the dimensions inside it)"
    )]
    SelfOverlap {
        /// The tensor's name.
        tensor: &'static str,
        /// Its shape.
        shape: [usize; 4],
        /// Its strides in elements.
        strides: [usize; 4],
    },
}

/// One tensor's bytes: its name, address space, `[start, end)` and whether the call writes it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Extent {
    name: &'static str,
    space: (bool, u64),
    start: u64,
    end: u64,
    written: bool,
}

/// The address space of a place: CUDA views for different streams of one context share it.
fn space(place: Place) -> (bool, u64) {
    match place {
        Place::Dev { id, .. } => (false, id),
        Place::Cuda { ctx, .. } => (true, ctx as u64),
    }
}

impl Extent {
    /// A view's bytes (empty for a shape with a zero dimension). Call after its bounds check,
    /// so the span fits in its buffer and so in `u64`.
    pub(super) fn of_view(name: &'static str, raw: &RawView, written: bool) -> Extent {
        let span = u64::try_from(raw.span_bytes()).unwrap_or(u64::MAX);
        Extent { name, space: space(raw.place), start: raw.ptr, end: raw.ptr.saturating_add(span), written }
    }

    /// `bytes` read at `ptr` in `place` (a tensor known only by its address).
    pub(super) fn of_ptr(name: &'static str, place: Place, ptr: u64, bytes: u64) -> Extent {
        Extent { name, space: space(place), start: ptr, end: ptr.saturating_add(bytes), written: false }
    }

    /// An index tensor's bytes (read only: `u32` each).
    pub(super) fn of_index(name: &'static str, t: &IndexTensor) -> Extent {
        let span = t.len() as u64 * 4;
        Extent { name, space: space(t.place), start: t.ptr, end: t.ptr.saturating_add(span), written: false }
    }

    fn meets(&self, other: &Extent) -> bool {
        self.space == other.space
            && self.start < self.end
            && other.start < other.end
            && self.start < other.end
            && other.start < self.end
    }
}

/// Refuses any written extent that meets another extent (read or written).
pub(super) fn check_disjoint(extents: &[Extent]) -> Result<(), AttnError> {
    for (i, w) in extents.iter().enumerate() {
        if !w.written {
            continue;
        }
        for (j, other) in extents.iter().enumerate() {
            // A pair of written tensors is reported once, in the caller's order.
            if i == j || (other.written && j < i) {
                continue;
            }
            if w.meets(other) {
                return Err(AttnError::Aliasing {
                    why: AliasRule::Overlap {
                        written: w.name,
                        other: other.name,
                        written_bytes: [w.start, w.end],
                        other_bytes: [other.start, other.end],
                    },
                });
            }
        }
    }
    Ok(())
}

/// Whether every element of `shape` under `strides` has its own offset (sufficient condition:
/// the dimensions of size > 1, sorted by stride, each have a stride above the largest offset
/// the smaller ones reach). An empty shape is one-to-one.
pub(super) fn injective(shape: [usize; 4], strides: [usize; 4]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut dims: Vec<(u128, u128)> =
        shape.iter().zip(&strides).filter(|&(&n, _)| n > 1).map(|(&n, &s)| (s as u128, n as u128)).collect();
    dims.sort_unstable();
    let mut reach: u128 = 0; // largest offset the dimensions so far reach
    for (s, n) in dims {
        if s <= reach || s == 0 {
            return false;
        }
        reach += (n - 1) * s;
    }
    true
}

/// [`injective`] for a written view, as an error naming it.
pub(super) fn check_injective(name: &'static str, raw: &RawView) -> Result<(), AttnError> {
    if injective(raw.shape, raw.strides) {
        return Ok(());
    }
    Err(AttnError::Aliasing { why: AliasRule::SelfOverlap { tensor: name, shape: raw.shape, strides: raw.strides } })
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn nested_strides_are_one_to_one_and_shared_ones_are_not() {
        // BSHD and BHSD layouts, with padding between rows, are one-to-one.
        assert!(injective([2, 5, 3, 4], [60, 12, 4, 1]));
        assert!(injective([2, 5, 3, 4], [60, 4, 20, 1]));
        assert!(injective([2, 5, 3, 4], [100, 16, 5, 1]));
        // Size-1 dimensions may have any stride, 0 included.
        assert!(injective([1, 5, 1, 4], [0, 4, 0, 1]));
        // Broadcast (stride 0), rows that step less than a row, heads that land on rows.
        assert!(!injective([1, 1, 2, 4], [0, 0, 0, 1]));
        assert!(!injective([1, 3, 1, 4], [12, 1, 4, 1]));
        assert!(!injective([1, 3, 2, 4], [24, 4, 4, 1]));
        // Exactly touching is fine, one element short is not.
        assert!(injective([1, 3, 1, 4], [12, 4, 4, 1]));
        assert!(!injective([1, 3, 1, 4], [12, 3, 4, 1]));
    }
}
