//! `decode_check_{f32,bf16,f16}`: the device-side index check of a KV-cache call whose index
//! tensors (`cache_seqlens`, `block_table`, `cache_batch_idx`, `cache_leftpad`) the host did not
//! read. It runs first in the call's stream; the call's other kernels (rotary, append, decode,
//! merge, prefill) follow and return at once when it found a violation, so an index that failed
//! the check is never used to address memory and the caches are not written.
//!
//! The host planned the call for the worst case its shapes allow (every sequence at the
//! cache's capacity, as FlashAttention-2 plans `flash_attn_with_kvcache` from the cache's
//! size), so these rules are all that the indices' values must satisfy:
//! - each sequence fits: `cache_seqlens[b] + seq_new <= seq_cache` (contiguous), or its
//!   `ceil((cache_seqlens[b] + seq_new) / page_size)` pages fit a block-table row (paged);
//! - each used block-table entry is below `num_pages` ([`crate::decode_abi::DecodeParams::cache_slots`]), each
//!   `cache_batch_idx` entry below the cache's slots, each `cache_leftpad[b] <= cache_seqlens[b]`;
//! - with new tokens: no two sequences share a slot, and no page that receives new tokens is
//!   used by any other block-table entry (the host path's rules, so both paths accept the same
//!   calls).
//!
//! A violation is claimed in the status words ([`crate::decode_abi::kv_status`]) by a
//! compare-and-swap; when word 0 is set (by this call or an earlier one: the words are sticky
//! until the host reads and clears them), the kernel fills the call's O (`batch * seq_q * heads
//! * head_dim` elements) and LSE (`batch * heads * seq_q` f32) with NaN, so a result of a
//! refused call cannot pass for a real one.
//!
//! Tile: one block of [`crate::tiles::APPEND`]'s 128 threads, grid `(1, 1, 1)`; threads stride
//! over the sequences, then over the outputs. Two barriers order the phases (bounds, sharing,
//! NaN fill): the sharing rules read block-table rows only after the bounds of every row held.
//!
//! # Safety
//! `cache_seqlens` must hold `batch` u32 and each non-zero index pointer its tensor's entries
//! (`block_table` `batch * max_pages`), `status` [`crate::decode_abi::kv_status::WORDS`] u32,
//! `o` and `lse` the call's outputs.

#[cfg(target_arch = "nvptx64")]
use crate::decode_abi::{kv_status, DecodeParams};
#[cfg(target_arch = "nvptx64")]
use crate::device::*;
#[cfg(target_arch = "nvptx64")]
use core::arch::asm;

/// `atom.global.cas.b32`: writes `new` at `addr` if it holds 0; returns the old value.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn cas_from_zero(addr: u64, new: u32) -> u32 {
    let old: u32;
    unsafe {
        asm!("{{ .reg .b64 %ga;", "cvta.to.global.u64 %ga, {a};", "atom.global.cas.b32 {o}, [%ga], 0, {n}; }}",
             a = in(reg64) addr, n = in(reg32) new, o = out(reg32) old, options(nostack));
    }
    old
}

/// Claims the status words for `code` (when no violation was claimed yet) and records
/// sequence `b` and `values`.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn report(status: u64, code: u32, b: u32, values: [u32; 5]) {
    unsafe {
        if cas_from_zero(status, code) == 0 {
            *((status + 4) as *mut u32) = b;
            let mut i = 0;
            while i < values.len() {
                *((status + 8 + 4 * i as u64) as *mut u32) = values[i];
                i += 1;
            }
        }
    }
}

/// Status word 0, read past the L1 (other threads of the block set it by atomics).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn claimed(status: u64) -> bool {
    unsafe { core::ptr::read_volatile(status as *const u32) != 0 }
}

/// Pages sequence `b` uses (paged cache): `ceil(end / page_size)`, in u64 so a huge count
/// cannot wrap.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn pages_for(end: u64, page_size: u32) -> u64 {
    end.div_ceil(page_size as u64)
}

/// The bounds rules of sequence `b`.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn check_bounds(p: &DecodeParams, b: u32) {
    let st = p.status;
    let seqlen = unsafe { ld_u32(p.cache_seqlens + 4 * b as u64) };
    let (slot, pad) = unsafe { p.slot_of(b) };
    if pad > seqlen {
        unsafe { report(st, kv_status::LEFTPAD, b, [pad, seqlen, 0, 0, 0]) };
        return;
    }
    let end = seqlen as u64 + p.seq_new as u64;
    if p.block_table == 0 {
        if p.cache_batch_idx != 0 && slot >= p.cache_slots {
            unsafe { report(st, kv_status::SLOT_PAST_END, b, [slot, p.cache_slots, 0, 0, 0]) };
        } else if end > p.seq_cache as u64 {
            unsafe { report(st, kv_status::CAPACITY, b, [seqlen, p.seq_new, p.seq_cache, 0, 0]) };
        }
        return;
    }
    let need = pages_for(end, p.page_size);
    if need > p.max_pages as u64 {
        let need = if need > u32::MAX as u64 { u32::MAX } else { need as u32 };
        unsafe { report(st, kv_status::PAGES, b, [seqlen, p.seq_new, need, p.page_size, p.max_pages]) };
        return;
    }
    let row = p.block_table + 4 * b as u64 * p.max_pages as u64;
    let mut s = 0;
    while s < need as u32 {
        let page = unsafe { ld_u32(row + 4 * s as u64) };
        if page >= p.cache_slots {
            unsafe { report(st, kv_status::PAGE_PAST_END, b, [s, page, p.cache_slots, 0, 0]) };
            return;
        }
        s += 1;
    }
}

/// The sharing rules of sequence `b` (with new tokens; every row's bounds held).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn check_sharing(p: &DecodeParams, b: u32) {
    let st = p.status;
    if p.block_table == 0 {
        if p.cache_batch_idx == 0 {
            return;
        }
        let slot = unsafe { ld_u32(p.cache_batch_idx + 4 * b as u64) };
        let mut a = 0;
        while a < b {
            if unsafe { ld_u32(p.cache_batch_idx + 4 * a as u64) } == slot {
                unsafe { report(st, kv_status::SHARED_SLOT, b, [slot, a, 0, 0, 0]) };
                return;
            }
            a += 1;
        }
        return;
    }
    let seqlen = unsafe { ld_u32(p.cache_seqlens + 4 * b as u64) };
    let end = seqlen + p.seq_new;
    let mp = p.max_pages as u64;
    // Slots whose page receives new tokens: rows seqlen .. end.
    let mut s = seqlen / p.page_size;
    while s < end.div_ceil(p.page_size) {
        let page = unsafe { ld_u32(p.block_table + 4 * (b as u64 * mp + s as u64)) };
        let mut b2 = 0;
        while b2 < p.batch {
            let used = pages_for(unsafe { ld_u32(p.cache_seqlens + 4 * b2 as u64) } as u64 + p.seq_new as u64, p.page_size)
                as u32;
            let mut s2 = 0;
            while s2 < used {
                if (b2 != b || s2 != s) && unsafe { ld_u32(p.block_table + 4 * (b2 as u64 * mp + s2 as u64)) } == page {
                    unsafe { report(st, kv_status::SHARED_WRITTEN_PAGE, b, [page, 0, 0, 0, 0]) };
                    return;
                }
                s2 += 1;
            }
            b2 += 1;
        }
        s += 1;
    }
}

/// The generic body; `THREADS` threads in the one block.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn check<E: Elem, const THREADS: u32>(p: &DecodeParams) {
    let st = p.status;
    // A violation of an earlier call stands: its words are kept for the host to read.
    if !unsafe { claimed(st) } {
        let mut b = tid_x();
        while b < p.batch {
            unsafe { check_bounds(p, b) };
            b += THREADS;
        }
    }
    sync_threads();
    if p.seq_new > 0 && !unsafe { claimed(st) } {
        let mut b = tid_x();
        while b < p.batch {
            unsafe { check_sharing(p, b) };
            b += THREADS;
        }
    }
    sync_threads();
    if unsafe { claimed(st) } {
        let rows = p.batch as u64 * p.heads as u64 * p.seq_q as u64;
        let mut i = tid_x() as u64;
        while i < rows * p.head_dim as u64 {
            unsafe { E::store(p.o + E::BYTES * i, f32::NAN) };
            i += THREADS as u64;
        }
        let mut i = tid_x() as u64;
        while i < rows {
            unsafe { st_f32(p.lse + 4 * i, f32::NAN) };
            i += THREADS as u64;
        }
    }
}
