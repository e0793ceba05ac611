//! The window rule: which keys a query row sees. One function, [`key_range`], used by every
//! kernel (naive scores, both flash forwards, both decode forwards, through
//! [`crate::abi::AttnParams::key_range`] for the prefill ones) and by the host's launch planning,
//! so the kernels and the plan cannot disagree about a window's bounds.
//!
//! The rule (FlashAttention-2's, tabulated in `docs/semantics.md`): a query row `i` of `seq_q`
//! sees, among `seq_kv` keys, key `j` iff
//! `diag - left <= j <= diag + right` with `diag = i + seq_kv - seq_q` (bottom-right aligned:
//! the last query row's diagonal is the last key); a negative `left` or `right` (`-1`) is
//! unbounded on that side and `causal` forces `right = 0`. Varlen applies it per sequence, with
//! that sequence's lengths ([`crate::abi::AttnParams::sequence`]); decode with `seq_kv` the
//! sequence's keys after the append (`cache_seqlens[b] + seq_new`).
//!
//! Pure code: it compiles for the host too (stable, as part of the rlib), where its tests run.

/// Keys `[start, end)` query row `i` of `seq_q` sees among `seq_kv` keys: the window
/// `diag - left <= j <= diag + right` (`diag = i + seq_kv - seq_q`; `right = 0` when `causal`;
/// a negative bound is unbounded) clipped to `[0, seq_kv)`.
///
/// `start` is in `0..`, `end` at most `seq_kv`; the range is empty when `start >= end`, and
/// then `end` may be negative (a row above the diagonal of a causal problem with more queries
/// than keys); callers that need a count take `max(end - start, 0)`.
#[inline(always)]
pub const fn key_range(causal: bool, left: i32, right: i32, i: u32, seq_q: u32, seq_kv: u32) -> (i64, i64) {
    let diag = i as i64 + seq_kv as i64 - seq_q as i64;
    let right = if causal { 0 } else { right };
    let start = if left >= 0 { diag - left as i64 } else { 0 };
    let end = if right >= 0 { diag + right as i64 + 1 } else { seq_kv as i64 };
    let start = if start > 0 { start } else { 0 };
    let end = if end < seq_kv as i64 { end } else { seq_kv as i64 };
    (start, end)
}

#[cfg(all(feature = "unit-tests", not(target_arch = "nvptx64")))]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn bottom_right_aligned_windows() {
        // 3 queries, 10 keys: diagonals 7, 8, 9.
        assert_eq!(key_range(true, -1, -1, 0, 3, 10), (0, 8));
        assert_eq!(key_range(false, -1, -1, 0, 3, 10), (0, 10));
        assert_eq!(key_range(true, 2, -1, 1, 3, 10), (6, 9));
        assert_eq!(key_range(false, 0, 0, 2, 3, 10), (9, 10));
        assert_eq!(key_range(false, -1, 1, 0, 3, 10), (0, 9));
        // Causal wins over a right bound.
        assert_eq!(key_range(true, -1, 5, 0, 3, 10), (0, 8));
        // More queries than keys: the first rows see nothing.
        let (s, e) = key_range(true, -1, -1, 0, 5, 2);
        assert!(s >= e);
        assert_eq!(key_range(false, 1, 0, 0, 1, 0), (0, 0));
        // A window wholly left of the keys.
        let (s, e) = key_range(false, 0, 0, 0, 10, 3);
        assert!(s >= e && e <= 0);
    }

    /// Against a key-by-key restatement of the rule, over small shapes and every window.
    pub fn matches_the_rule_key_by_key() {
        for seq_q in 0..6u32 {
            for seq_kv in 0..7u32 {
                for causal in [false, true] {
                    for left in -1..4i32 {
                        for right in -1..4i32 {
                            for i in 0..seq_q {
                                let (s, e) = key_range(causal, left, right, i, seq_q, seq_kv);
                                let diag = i as i64 + seq_kv as i64 - seq_q as i64;
                                let r = if causal { 0 } else { right };
                                for j in 0..seq_kv as i64 {
                                    let seen = (left < 0 || j >= diag - left as i64) && (r < 0 || j <= diag + r as i64);
                                    assert_eq!(
                                        seen,
                                        j >= s && j < e,
                                        "q {seq_q} kv {seq_kv} c {causal} w ({left}, {right}) i {i} j {j}"
                                    );
                                }
                                assert!(s >= 0 && e <= seq_kv as i64);
                            }
                        }
                    }
                }
            }
        }
    }
}
