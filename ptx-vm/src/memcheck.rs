//! Memcheck state, next to the memory model it checks: the block's shared memory with its
//! initcheck (which bytes were written) and racecheck (which warp touched each word in the current
//! barrier interval) state, and address resolution with every check — alignment, the shared,
//! local and parameter windows, and the allocation lookup of global addresses (out of bounds, use
//! after free). The executor (`exec.rs`) calls [`Mem::locate`] for every access and reports a
//! [`Fault`] as a finding.

use crate::exec::SHARED_POISON;
use crate::ir::Space;
use crate::memory::{self, GlobalView, LOCAL_WINDOW, PARAM_WINDOW, SHARED_WINDOW, WINDOW_SIZE};
use crate::num;

/// A block's shared memory and, for initcheck, which of its bytes have been written.
#[derive(Default)]
pub(crate) struct SharedMem {
    pub(crate) bytes: Vec<u8>,
    written: Vec<bool>,
    /// Bytes not written yet (0 when initcheck is off). Once the whole window has been written,
    /// as the flash kernels do with their first tile, loads skip the check entirely.
    unwritten: usize,
    racecheck: bool,
    pub(crate) race: RaceState,
    /// mbarriers and the async-proxy race state ([`crate::hopper`]).
    pub(crate) hopper: crate::hopper::AsyncState,
    /// The block's named barriers (`bar.sync a, b`, `bar.arrive a, b`).
    pub(crate) named: crate::exec::NamedBars,
}

/// Racecheck: per 4-byte word of the window, the last writing warp and the warps that read it,
/// each stamped with the barrier interval ("epoch") it happened in. Epochs count every block
/// start and barrier release of the worker, so stamps left by an earlier interval or block are
/// stale by construction and nothing is cleared between blocks (only when the epoch counter
/// wraps, every 2^26 intervals). A conflict is an access by one warp to a word another warp
/// wrote (or, for a store, read) in the current interval: on a GPU the warps' order there is
/// undefined. Atomics are exempt; sub-word accesses share their word.
#[derive(Default)]
pub(crate) struct RaceState {
    pub(crate) epoch: u32,
    /// Warp running now (set before each warp runs).
    pub(crate) warp: u32,
    /// Instruction running now (set before each instruction), stamped on the words it touches
    /// so that a race names the other access's line too.
    pub(crate) pc: u32,
    /// Set while an atomic instruction accesses shared memory.
    pub(crate) atomic: bool,
    /// Per word: epoch and warp of the last write (the stamp every check reads; 4 bytes per
    /// word, so that the checks and stamps of a warp's row of stores or reads touch few cache
    /// lines).
    wr: Vec<u32>,
    /// Per word: instruction of the last write (stored, read only for a report).
    wpc: Vec<u32>,
    /// Per word: the read stamps (checked by a store only while another warp has read stamps
    /// in this interval, [`RaceState::read_stamped`]).
    hot: Vec<HotWord>,
    /// Per word: the second reader, updated on a change of reading warp.
    cold: Vec<ColdWord>,
    /// Warps (bit per warp) that stored to shared memory in this interval: a read by a warp
    /// when no other warp has stored cannot be a read-after-write race, and skips the check.
    writers: u32,
    /// Warps (bit per warp) whose read stamps of this interval are applied: a store by a warp
    /// when no other warp has any cannot be a write-after-read race, and skips that check (the
    /// pending reads it could meet are applied first).
    read_stamped: u32,
    /// Word reads of [`RaceState::read_words`] in this interval not stamped yet, in order. Read
    /// stamps only matter to a later store of the same interval (write-after-read) and to the
    /// stamps of later reads, so they are applied, in the same order, just before any other
    /// access ([`RaceState::access`]), and dropped unapplied when the interval ends.
    pending: Vec<PendingRead>,
    /// The words of pending reads that are not evenly spaced, 32 per read.
    scattered: Vec<[u32; 32]>,
    /// The lowest and highest word the first `pending_seen` pending reads touch (`u32::MAX`, 0
    /// for none), brought up to date by the first access that asks. An access outside this range
    /// cannot meet a pending read's word, and the order of stamps on different words does not
    /// matter, so it leaves the queue as it is (the `cp.async` of one buffer while `ldmatrix`
    /// reads another). Reads alone never compute it.
    pending_lo: u32,
    pending_hi: u32,
    pending_seen: usize,
    /// Tests: the portable paths even where the CPU has AVX-512.
    #[cfg(feature = "unit-tests")]
    portable: bool,
}

/// One `ld.shared.b32` of a warp waiting to be stamped: lane `l` of `exec` read word
/// `base + l * stride` (a full warp with evenly spaced words, the common case), or, when
/// `stride` is [`SCATTERED`], the words listed at `base` in [`RaceState::scattered`]; with
/// `span` 4 (`ldmatrix`), the listed word and the three after it.
#[derive(Clone, Copy)]
struct PendingRead {
    span: u32,
    warp: u32,
    pc: u32,
    exec: u32,
    base: u32,
    stride: u32,
    /// Added to every listed word of a [`SCATTERED`] read (the loads of a fused run share one
    /// list: they read the same lanes' words at different offsets).
    shift: u32,
}

/// [`PendingRead::stride`] of a read whose words are listed one per lane.
const SCATTERED: u32 = u32::MAX;

/// Pending reads kept before they are stamped anyway (a long interval without stores).
const PENDING_LIMIT: usize = 16384;

/// Epochs fit in the bits of a stamp above the warp.
const EPOCH_LIMIT: u32 = 1 << 26;

/// An epoch and a warp in one stamp: `epoch << 6 | (warp + 1)` (warps below 32; 0: none).
#[inline(always)]
fn stamp(epoch: u32, warp: u32) -> u32 {
    epoch << 6 | (warp + 1)
}

/// The lowest and highest word that lanes `exec` touch, each `span` words from `first[l]`
/// (`(u32::MAX, 0)` for no lane).
#[inline(always)]
fn word_bounds(exec: u32, first: &[u32; 32], span: u32) -> (u32, u32) {
    let (mut lo, mut hi) = (u32::MAX, 0u32);
    for (l, &i) in first.iter().enumerate() {
        let on = exec >> l & 1 == 1;
        lo = lo.min(if on { i } else { u32::MAX });
        hi = hi.max(if on { i + span - 1 } else { 0 });
    }
    (lo, hi)
}

/// Read stamps of one shared word.
#[derive(Clone, Copy, Default, Debug)]
#[repr(C)]
struct HotWord {
    /// Epoch of the reads in `readers` and the warp of the last of them (slot 0).
    read: u32,
    /// Warps (bit per warp) that read the word in `read`'s epoch.
    readers: u32,
    /// Instruction of the last read (slot 0).
    read_pc: u32,
}

/// Read stamps of one shared word that a change of reading warp updates.
#[derive(Clone, Copy, Default, Debug)]
#[repr(C)]
struct ColdWord {
    /// Instruction and warp of the last read by a warp other than slot 0's (slot 1): whichever
    /// warp writes next, one of the two slots is another warp's read when `readers` says there
    /// is one.
    read_pc: u32,
    read_warp: u32,
}

/// The earlier access of a race, by another warp in the same barrier interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RaceOther {
    pub(crate) warp: u32,
    /// Instruction index in the kernel.
    pub(crate) pc: u32,
    pub(crate) write: bool,
}

impl RaceState {
    /// Starts a new barrier interval (or block): every earlier stamp becomes stale.
    pub(crate) fn next_epoch(&mut self) {
        self.pending.clear();
        self.scattered.clear();
        (self.pending_lo, self.pending_hi, self.pending_seen) = (u32::MAX, 0, 0);
        (self.writers, self.read_stamped) = (0, 0);
        self.epoch += 1;
        if self.epoch >= EPOCH_LIMIT {
            self.wr.fill(0);
            self.wpc.fill(0);
            self.hot.fill(HotWord::default());
            self.cold.fill(ColdWord::default());
            self.epoch = 1;
        }
    }
    /// Whether a read of `[at, at + len)` by the running warp would meet another warp's write of
    /// this barrier interval (the read-after-write check of [`RaceState::access`], without stamping).
    pub(crate) fn conflicts(&self, at: usize, len: usize) -> bool {
        let (w, e) = (self.warp, self.epoch);
        (at / 4..(at + len).div_ceil(4)).any(|i| self.wr[i] >> 6 == e && self.wr[i] != stamp(e, w))
    }
    /// Plain reads of one word per lane of `exec` (`words[l]`) by the running warp:
    /// [`RaceState::access`] with `store == false` and a 4-byte aligned access, without the word
    /// loop (the `ld.shared.b32` of the f32 kernels). Returns false when a read meets another
    /// warp's write of this interval; the caller then calls `access` for the message. The read
    /// stamps are queued ([`RaceState::pending`]); the read-after-write check runs only when
    /// another warp has stored in this interval.
    #[inline(always)]
    pub(crate) fn read_words(&mut self, exec: u32, words: &[u32; 32]) -> bool {
        if self.atomic || self.warp >= 32 {
            return true;
        }
        let (w, e) = (self.warp, self.epoch);
        if self.writers & !(1 << w) != 0 {
            let me = stamp(e, w);
            let mut m = exec;
            while m != 0 {
                let l = m.trailing_zeros() as usize;
                m &= m - 1;
                let x = self.wr[words[l] as usize];
                if x >> 6 == e && x != me {
                    return false;
                }
            }
        }
        self.queue_read(exec, words);
        true
    }
    /// The reads of a fused run of full-warp `ld.shared.b32` ([`crate::fuse`]): the load at
    /// instruction `pc` reads, in lane `l`, word `words0[l] + shift`, for each `(pc, shift)` in
    /// order. Queues exactly what [`RaceState::read_words`] would queue for the loads one after
    /// the other and returns true; or returns false, having queued nothing, where `read_words`
    /// would do more than queue (another warp stored in this interval).
    pub(crate) fn queue_read_run(&mut self, words0: &[u32; 32], loads: impl Iterator<Item = (u32, u32)>) -> bool {
        if self.atomic || self.warp >= 32 {
            return true;
        }
        if self.writers & !(1 << self.warp) != 0 {
            return false;
        }
        let stride = words0[1].wrapping_sub(words0[0]);
        let even =
            stride != SCATTERED && (0..32).all(|l| words0[l] == words0[0].wrapping_add(stride.wrapping_mul(l as u32)));
        let mut listed: Option<u32> = None;
        for (pc, shift) in loads {
            if self.pending.len() >= PENDING_LIMIT {
                self.stamp_pending();
            }
            let (base, stride, shift) = if even {
                (words0[0].wrapping_add(shift), stride, 0)
            } else {
                // One list for the run's loads (pushed again only after a stamping emptied it).
                if listed.is_none_or(|i| i as usize >= self.scattered.len()) {
                    self.scattered.push(*words0);
                    listed = Some(self.scattered.len() as u32 - 1);
                }
                (listed.expect("listed just above"), SCATTERED, shift)
            };
            self.pending.push(PendingRead { span: 1, warp: self.warp, pc, exec: u32::MAX, base, stride, shift });
        }
        true
    }
    #[inline(always)]
    fn queue_read(&mut self, exec: u32, words: &[u32; 32]) {
        let w = self.warp;
        if self.pending.len() >= PENDING_LIMIT {
            self.stamp_pending();
        }
        let stride = words[1].wrapping_sub(words[0]);
        let mut even = exec == u32::MAX && stride != SCATTERED;
        for (l, &x) in words.iter().enumerate() {
            even &= x == words[0].wrapping_add(stride.wrapping_mul(l as u32));
        }
        let (base, stride) = if even {
            (words[0], stride)
        } else {
            self.scattered.push(*words);
            (self.scattered.len() as u32 - 1, SCATTERED)
        };
        self.pending.push(PendingRead { span: 1, warp: w, pc: self.pc, exec, base, stride, shift: 0 });
    }
    /// Whether the pending reads may touch a word in `lo..=hi`; if so they are applied now, as
    /// an access of those words must see them.
    #[inline(always)]
    fn settle_pending(&mut self, lo: u32, hi: u32) {
        if !self.pending.is_empty() {
            self.settle_pending_cold(lo, hi);
        }
    }
    #[inline(never)]
    fn settle_pending_cold(&mut self, lo: u32, hi: u32) {
        for p in &self.pending[self.pending_seen..] {
            let (plo, phi) = if p.stride == SCATTERED {
                let (a, b) = word_bounds(p.exec, &self.scattered[p.base as usize], p.span);
                (a.wrapping_add(p.shift), b.wrapping_add(p.shift))
            } else {
                // Evenly spaced words of a full warp: the ends of the progression.
                let last = p.base.wrapping_add(p.stride.wrapping_mul(31));
                (p.base.min(last), p.base.max(last))
            };
            self.pending_lo = self.pending_lo.min(plo);
            self.pending_hi = self.pending_hi.max(phi);
        }
        self.pending_seen = self.pending.len();
        if lo <= self.pending_hi && hi >= self.pending_lo {
            self.stamp_pending();
        }
    }
    /// Applies the queued read stamps, in order.
    #[cold]
    fn stamp_pending(&mut self) {
        let e = self.epoch;
        let (hot, cold) = (&mut self.hot[..], &mut self.cold[..]);
        for p in self.pending.drain(..) {
            let (w, pc) = (p.warp, p.pc);
            let me = stamp(e, w);
            self.read_stamped |= 1 << w;
            let words: [u32; 32] = if p.stride == SCATTERED {
                self.scattered[p.base as usize].map(|x| x.wrapping_add(p.shift))
            } else {
                std::array::from_fn(|l| p.base.wrapping_add(p.stride.wrapping_mul(l as u32)))
            };
            // A lane reading the word the lane before it read is the same access again.
            let mut prev = u32::MAX;
            let mut m = p.exec;
            while m != 0 {
                let l = m.trailing_zeros() as usize;
                m &= m - 1;
                let i = words[l];
                if i == prev {
                    continue;
                }
                prev = i;
                for i in i as usize..(i + p.span) as usize {
                    let h = &mut hot[i];
                    if h.read != me {
                        if h.read >> 6 != e {
                            h.readers = 1 << w;
                        } else {
                            h.readers |= 1 << w;
                            let c = &mut cold[i];
                            c.read_pc = h.read_pc;
                            c.read_warp = (h.read & 63) - 1;
                        }
                        h.read = me;
                    }
                    h.read_pc = pc;
                }
            }
        }
        self.scattered.clear();
        (self.pending_lo, self.pending_hi, self.pending_seen) = (u32::MAX, 0, 0);
    }
    /// `ldmatrix`'s reads: lane `l` of `exec` reads the 4 words from `rows[l]` (a 16-byte row).
    /// As [`RaceState::read_words`] of the four words of every row (all read-after-write checks
    /// first), with the rows queued as one read.
    #[inline(always)]
    pub(crate) fn read_rows(&mut self, exec: u32, rows: &[u32; 32]) -> bool {
        if self.atomic || self.warp >= 32 || exec == 0 {
            return true;
        }
        let (_, hi) = word_bounds(exec, rows, 4);
        assert!(hi < self.hot.len() as u32, "racecheck shadow covers the window");
        if self.writers & !(1 << self.warp) != 0 && self.rows_conflict(exec, rows, 4, false) {
            return false;
        }
        if self.pending.len() >= PENDING_LIMIT {
            self.stamp_pending();
        }
        self.scattered.push(*rows);
        let base = self.scattered.len() as u32 - 1;
        self.pending.push(PendingRead {
            span: 4,
            warp: self.warp,
            pc: self.pc,
            exec,
            base,
            stride: SCATTERED,
            shift: 0,
        });
        true
    }
    /// Whether the vector (SSE2) paths run.
    #[inline(always)]
    fn simd(&self) -> bool {
        #[cfg(feature = "unit-tests")]
        if self.portable {
            return false;
        }
        cfg!(target_arch = "x86_64")
    }
    /// Whether a word of `first[l]..first[l] + span` for a lane `l` of `exec` was written by
    /// another warp in this interval (the read-after-write check), or, for `store`, also read by
    /// another warp (write-after-read; `span` 1, 2 or 4 words inside one 16-byte row). Each
    /// check runs only while another warp has such stamps in this interval.
    #[inline(always)]
    fn rows_conflict(&self, exec: u32, first: &[u32; 32], span: u32, store: bool) -> bool {
        let bit = 1u32 << self.warp;
        (self.writers & !bit != 0 && self.rows_written(exec, first, span))
            || (store && self.read_stamped & !bit != 0 && self.rows_read(exec, first, span))
    }
    /// Whether a word of the rows (as [`RaceState::rows_conflict`]) was written by another warp
    /// in this interval.
    #[inline(always)]
    fn rows_written(&self, exec: u32, first: &[u32; 32], span: u32) -> bool {
        let (e, me) = (self.epoch, stamp(self.epoch, self.warp));
        #[cfg(target_arch = "x86_64")]
        if self.simd() {
            use core::arch::x86_64::*;
            let wr = self.wr.as_ptr();
            let mut any = 0i32;
            // SAFETY: SSE2 is part of x86_64; words `first[l]..first[l] + span` exist (the
            // callers checked the highest), and a row of `span` words is loaded whole.
            unsafe {
                let (ve, vme) = (_mm_set1_epi32(e as i32), _mm_set1_epi32(me as i32));
                let mut acc = _mm_setzero_si128();
                let mut m = exec;
                while m != 0 {
                    let l = m.trailing_zeros() as usize;
                    m &= m - 1;
                    let p = wr.add(first[l] as usize);
                    let v = match span {
                        4 => _mm_loadu_si128(p.cast()),
                        2 => _mm_loadl_epi64(p.cast()),
                        _ => _mm_cvtsi32_si128(p.read() as i32),
                    };
                    // (Absent elements are 0: epoch 0 is never the current one.)
                    let now = _mm_cmpeq_epi32(_mm_srli_epi32::<6>(v), ve);
                    acc = _mm_or_si128(acc, _mm_andnot_si128(_mm_cmpeq_epi32(v, vme), now));
                }
                any |= _mm_movemask_epi8(acc);
            }
            return any != 0;
        }
        let mut conflict = false;
        let mut m = exec;
        while m != 0 {
            let l = m.trailing_zeros() as usize;
            m &= m - 1;
            for &x in &self.wr[first[l] as usize..(first[l] + span) as usize] {
                conflict |= (x >> 6 == e) & (x != me);
            }
        }
        conflict
    }
    /// Whether a word of the rows (as [`RaceState::rows_conflict`]) was read by another warp in
    /// this interval (applied read stamps).
    fn rows_read(&self, exec: u32, first: &[u32; 32], span: u32) -> bool {
        let (e, bit) = (self.epoch, 1u32 << self.warp);
        let mut conflict = false;
        let mut m = exec;
        while m != 0 {
            let l = m.trailing_zeros() as usize;
            m &= m - 1;
            for h in &self.hot[first[l] as usize..(first[l] + span) as usize] {
                conflict |= (h.read >> 6 == e) & (h.readers & !bit != 0);
            }
        }
        conflict
    }
    /// Stores by every lane `l` of `exec` of the `span` words (1, 2 or 4, inside one 16-byte
    /// row) from `first[l]`, in lane order (`cp.async`): as [`RaceState::store_words`], true
    /// with the stamps [`RaceState::access`] leaves for those stores one after the other when
    /// none conflicts, false otherwise having stamped nothing, for the caller to run `access`
    /// lane by lane and report the conflict.
    pub(crate) fn store_spans(&mut self, exec: u32, first: &[u32; 32], span: u32) -> bool {
        if self.atomic || self.warp >= 32 || exec == 0 {
            return true;
        }
        assert!(
            matches!(span, 1 | 2 | 4) && (0..32).all(|l| exec >> l & 1 == 0 || first[l] & (span - 1) == 0),
            "rows of whole aligned spans"
        );
        let (lo, hi) = word_bounds(exec, first, span);
        self.settle_pending(lo, hi);
        assert!(hi < self.wr.len() as u32, "racecheck shadow covers the window");
        if self.rows_conflict(exec, first, span, true) {
            return false;
        }
        self.stamp_rows(exec, first, span);
        self.writers |= 1 << self.warp;
        true
    }
    /// The write stamps of `span` words from `first[l]` for every lane `l` of `exec` (every word
    /// inside the shadow: the caller checked the highest).
    #[inline(always)]
    fn stamp_rows(&mut self, exec: u32, first: &[u32; 32], span: u32) {
        let (me, pc) = (stamp(self.epoch, self.warp), self.pc);
        #[cfg(target_arch = "x86_64")]
        if span == 4 && self.simd() {
            use core::arch::x86_64::*;
            let (wr, wpc) = (self.wr.as_mut_ptr(), self.wpc.as_mut_ptr());
            // SAFETY: SSE2 is part of x86_64; the four words from `first[l]` exist (the caller).
            unsafe {
                let (vme, vpc) = (_mm_set1_epi32(me as i32), _mm_set1_epi32(pc as i32));
                let mut m = exec;
                while m != 0 {
                    let l = m.trailing_zeros() as usize;
                    m &= m - 1;
                    _mm_storeu_si128(wr.add(first[l] as usize).cast(), vme);
                    _mm_storeu_si128(wpc.add(first[l] as usize).cast(), vpc);
                }
            }
            return;
        }
        let mut m = exec;
        while m != 0 {
            let l = m.trailing_zeros() as usize;
            m &= m - 1;
            let words = first[l] as usize..(first[l] + span) as usize;
            self.wr[words.clone()].fill(me);
            self.wpc[words].fill(pc);
        }
    }
    /// A store of word `words[l]` by every lane `l` of the running warp, in lane order: returns
    /// true, with the stamps [`RaceState::access`] leaves for those stores one after the other,
    /// when none of them conflicts; false otherwise, having stamped nothing (the pending reads
    /// are applied either way, as the first `access` would), for the caller to run `access`
    /// lane by lane and report the conflict. (A lane's store cannot make a later lane's store of
    /// the same warp conflict, so checking every word against the stamps before any store is the
    /// same as checking each after the stores before it.)
    pub(crate) fn store_words(&mut self, words: &[u32; 32]) -> bool {
        if self.atomic || self.warp >= 32 {
            return true;
        }
        // 32 consecutive words from a 16-byte boundary (a warp storing one row): eight rows of
        // four words, checked and stamped as `cp.async` rows are.
        let w0 = words[0];
        if w0.is_multiple_of(4) && (0..32).all(|l| words[l] == w0.wrapping_add(l as u32)) {
            return self.store_spans(0xFF, &std::array::from_fn(|r| w0 + 4 * (r as u32 % 8)), 4);
        }
        if !self.pending.is_empty() {
            let (lo, hi) = word_bounds(u32::MAX, words, 1);
            self.settle_pending_cold(lo, hi);
        }
        let (w, e, pc) = (self.warp, self.epoch, self.pc);
        let me = stamp(e, w);
        let bit = 1u32 << w;
        // (One pass without branches: a conflict anywhere is rare, and the caller then redoes
        // the stores word by word.)
        let mut conflict = false;
        if self.writers & !bit != 0 {
            for &i in words {
                let x = self.wr[i as usize];
                conflict |= (x >> 6 == e) & (x != me);
            }
        }
        if self.read_stamped & !bit != 0 {
            for &i in words {
                let h = &self.hot[i as usize];
                conflict |= (h.read >> 6 == e) & (h.readers & !bit != 0);
            }
        }
        if conflict {
            return false;
        }
        for &i in words {
            self.wr[i as usize] = me;
            self.wpc[i as usize] = pc;
        }
        self.writers |= bit;
        true
    }
    #[inline(always)]
    pub(crate) fn access(&mut self, at: usize, len: usize, store: bool) -> Result<(), (String, RaceOther)> {
        // Reader sets are 32-bit masks: blocks of more than 1024 threads (only with raised
        // limits) go unchecked beyond warp 31.
        if self.atomic || self.warp >= 32 {
            return Ok(());
        }
        if len == 0 {
            return Ok(());
        }
        self.settle_pending((at / 4) as u32, ((at + len - 1) / 4) as u32);
        let (w, e, pc) = (self.warp, self.epoch, self.pc);
        let me = stamp(e, w);
        let bit = 1u32 << w;
        for i in at / 4..(at + len).div_ceil(4) {
            let x = self.wr[i];
            let h = &mut self.hot[i];
            if x >> 6 == e && x != me {
                let writer = (x & 63) - 1;
                return Err((
                    format!(
                        "warp {w} {} shared word {} that warp {} wrote since the last barrier ({} race)",
                        if store { "writes" } else { "reads" },
                        4 * i,
                        writer,
                        if store { "write-write" } else { "read-after-write" }
                    ),
                    RaceOther { warp: writer, pc: self.wpc[i], write: true },
                ));
            }
            if store {
                if h.read >> 6 == e && h.readers & !bit != 0 {
                    // Slot 0 is the last reader; when that is the writing warp, slot 1 is
                    // another warp's read.
                    let (reader, rpc) = if (h.read & 63) - 1 == w {
                        (self.cold[i].read_warp, self.cold[i].read_pc)
                    } else {
                        ((h.read & 63) - 1, h.read_pc)
                    };
                    return Err((
                        format!(
                            "warp {w} writes shared word {} that warp {reader} read since the last barrier (write-after-read race)",
                            4 * i,
                        ),
                        RaceOther { warp: reader, pc: rpc, write: false },
                    ));
                }
                self.wr[i] = me;
                self.wpc[i] = pc;
                self.writers |= bit;
            } else {
                self.read_stamped |= bit;
                if h.read != me {
                    if h.read >> 6 != e {
                        h.readers = bit;
                    } else {
                        h.readers |= bit;
                        let c = &mut self.cold[i];
                        c.read_pc = h.read_pc;
                        c.read_warp = (h.read & 63) - 1;
                    }
                    h.read = me;
                }
                h.read_pc = pc;
            }
        }
        Ok(())
    }
}

impl RaceState {
    /// Shadow for `words` words (the stamps of words already covered are kept).
    fn resize(&mut self, words: usize) {
        self.wr.resize(words, 0);
        self.wpc.resize(words, 0);
        self.hot.resize(words, HotWord::default());
        self.cold.resize(words, ColdWord::default());
    }
    /// The warp and instruction of the last store racecheck stamped on shared word `i`, in any
    /// barrier interval of the block (`None`: none seen).
    pub(crate) fn last_writer(&self, i: usize) -> Option<(u32, u32)> {
        let x = *self.wr.get(i)?;
        (x & 63 != 0).then(|| ((x & 63) - 1, self.wpc[i]))
    }
}

impl SharedMem {
    /// Fresh shared memory: `len` poisoned bytes, none written, a new race epoch.
    pub(crate) fn reset(&mut self, len: usize, initcheck: bool, racecheck: bool) {
        self.racecheck = racecheck;
        self.named.reset();
        if racecheck {
            let words = len.div_ceil(4);
            let r = &mut self.race;
            if r.wr.len() < words {
                r.resize(words);
            }
            r.next_epoch();
        }
        self.bytes.clear();
        self.bytes.resize(len, 0);
        let pb = SHARED_POISON.to_le_bytes();
        for (i, b) in self.bytes.iter_mut().enumerate() {
            *b = pb[i & 3];
        }
        self.written.clear();
        self.unwritten = 0;
        if initcheck {
            self.written.resize(len, false);
            self.unwritten = len;
        }
    }
    #[inline(always)]
    pub(crate) fn mark_written(&mut self, at: usize, len: usize) {
        if self.unwritten > 0 {
            let w = &mut self.written[at..at + len];
            let fresh = w.iter().filter(|&&x| !x).count();
            w.fill(true);
            self.unwritten -= fresh;
        }
    }
    /// Whether every byte of the window has been written (or initcheck is off).
    #[inline(always)]
    pub(crate) fn all_written(&self) -> bool {
        // (Kernels with bulk copies take the checked path, which runs the async-proxy check.)
        self.unwritten == 0 && !self.hopper.on
    }
    #[inline(always)]
    pub(crate) fn racecheck_on(&self) -> bool {
        self.racecheck
    }
    #[inline(always)]
    pub(crate) fn is_written(&self, at: usize, len: usize) -> bool {
        self.unwritten == 0 || self.written[at..at + len].iter().all(|&w| w)
    }
}

pub(crate) struct Fault {
    pub(crate) lane: u32,
    pub(crate) kind: &'static str,
    pub(crate) addr: u64,
    pub(crate) size: u32,
    pub(crate) detail: Option<String>,
    /// A race's other access.
    pub(crate) other: Option<RaceOther>,
}

impl Fault {
    pub(crate) fn new(lane: u32, kind: &'static str, addr: u64, size: u32, detail: Option<String>) -> Fault {
        Fault { lane, kind, addr, size, detail, other: None }
    }
}

pub(crate) struct Mem<'a> {
    pub(crate) global: &'a GlobalView,
    pub(crate) shared: &'a mut SharedMem,
    pub(crate) local: &'a mut [u8],
    pub(crate) local_bytes: usize,
    pub(crate) params: &'a [u8],
    pub(crate) hint: &'a mut crate::exec::Hints,
    /// Global bytes read (`[0]`) and written (`[1]`) by the accesses `locate` and
    /// `check_global` allowed: what the threads asked of global memory, with no cache model.
    pub(crate) traffic: &'a mut [u64; 2],
}

#[derive(Clone, Copy)]
pub(crate) enum Loc {
    Ptr(*mut u8),
    Shared(usize),
    Local(usize),
    Param(usize),
}

impl Mem<'_> {
    #[inline(always)]
    pub(crate) fn locate(&mut self, sp: Space, addr: u64, size: u64, lane: u32, store: bool) -> Result<Loc, Fault> {
        let fault = |kind: &'static str| Fault::new(lane, kind, addr, size as u32, None);
        if addr & (size - 1) != 0 {
            return Err(fault("misaligned access"));
        }
        let (sp, a) = match sp {
            Space::Generic => {
                if (SHARED_WINDOW..SHARED_WINDOW + WINDOW_SIZE).contains(&addr) {
                    (Space::Shared, addr - SHARED_WINDOW)
                } else if (LOCAL_WINDOW..LOCAL_WINDOW + WINDOW_SIZE).contains(&addr) {
                    (Space::Local, addr - LOCAL_WINDOW)
                } else if (PARAM_WINDOW..PARAM_WINDOW + WINDOW_SIZE).contains(&addr) {
                    (Space::Param, addr - PARAM_WINDOW)
                } else {
                    (Space::Global, addr)
                }
            }
            s => (s, addr),
        };
        match sp {
            Space::Shared => {
                if a.checked_add(size).is_none_or(|e| e > self.shared.bytes.len() as u64) {
                    Err(fault("shared memory out of window"))
                } else if !store && !self.shared.is_written(a as usize, size as usize) {
                    Err(fault("uninitialized shared memory read"))
                } else if let Err((d, other)) = self.async_check(a as usize, size as usize, store) {
                    Err(Fault {
                        other: Some(other),
                        ..Fault::new(lane, "async-proxy race", addr, size as u32, Some(d))
                    })
                } else if self.shared.racecheck {
                    match self.shared.race.access(a as usize, size as usize, store) {
                        Ok(()) => Ok(Loc::Shared(a as usize)),
                        Err((d, other)) => Err(Fault {
                            other: Some(other),
                            ..Fault::new(lane, "shared memory race", addr, size as u32, Some(d))
                        }),
                    }
                } else {
                    Ok(Loc::Shared(a as usize))
                }
            }
            Space::Local => {
                if a.checked_add(size).is_some_and(|e| e <= self.local_bytes as u64) {
                    Ok(Loc::Local(lane as usize * self.local_bytes + a as usize))
                } else {
                    Err(fault("local memory overflow"))
                }
            }
            Space::Param => {
                if store {
                    Err(fault("store to kernel parameter space"))
                } else if a.checked_add(size).is_some_and(|e| e <= self.params.len() as u64) {
                    Ok(Loc::Param(a as usize))
                } else {
                    Err(fault("out-of-bounds parameter load"))
                }
            }
            _ => match self.global.resolve(a, size, &mut self.hint.alloc) {
                Some(p) => {
                    self.traffic[store as usize] += size;
                    Ok(Loc::Ptr(p))
                }
                None => {
                    let kind = if self.global.is_freed(a) {
                        "use after free"
                    } else if store {
                        "out-of-bounds global store"
                    } else {
                        "out-of-bounds global load"
                    };
                    Err(Fault::new(lane, kind, addr, size as u32, Some(self.global.describe(a, size))))
                }
            },
        }
    }
    /// [`crate::hopper::AsyncState::generic`] for a generic access of shared bytes by the running
    /// warp (nothing when the program has no Hopper instructions).
    #[inline(always)]
    fn async_check(&mut self, at: usize, len: usize, store: bool) -> Result<(), (String, RaceOther)> {
        if !self.shared.hopper.on {
            return Ok(());
        }
        let (w, pc) = (self.shared.race.warp, self.shared.race.pc);
        self.shared.hopper.generic(w, pc, at, len, store)
    }
    /// Checks that `len` global bytes at `addr` lie inside one live allocation.
    pub(crate) fn check_global(&mut self, addr: u64, len: u64, lane: u32, store: bool) -> Result<*mut u8, Fault> {
        match self.global.resolve(addr, len, &mut self.hint.alloc) {
            Some(p) => {
                self.traffic[store as usize] += len;
                Ok(p)
            }
            None => {
                let kind = if self.global.is_freed(addr) {
                    "use after free"
                } else if store {
                    "out-of-bounds global store"
                } else {
                    "out-of-bounds global load"
                };
                Err(Fault::new(lane, kind, addr, len as u32, Some(self.global.describe(addr, len))))
            }
        }
    }
    #[inline(always)]
    pub(crate) fn read(&self, loc: Loc, size: u8) -> u64 {
        // Fixed-size copies per access size (a variable-length copy per lane was a call to
        // memmove and the VM's largest single cost on shared-memory loads).
        let rd = |s: &[u8], at: usize| -> u64 {
            match size {
                1 => s[at] as u64,
                2 => u16::from_le_bytes([s[at], s[at + 1]]) as u64,
                4 => u32::from_le_bytes(s[at..at + 4].try_into().unwrap()) as u64,
                _ => u64::from_le_bytes(s[at..at + 8].try_into().unwrap()),
            }
        };
        match loc {
            // SAFETY: `resolve` checked bounds; `locate` checked natural alignment.
            Loc::Ptr(p) => unsafe { memory::atomic_load(p, size) },
            Loc::Shared(a) => rd(&self.shared.bytes, a),
            Loc::Local(a) => rd(self.local, a),
            Loc::Param(a) => rd(self.params, a),
        }
    }
    #[inline(always)]
    pub(crate) fn write(&mut self, loc: Loc, size: u8, v: u64) {
        #[inline(always)]
        fn wr(s: &mut [u8], at: usize, size: u8, v: u64) {
            match size {
                1 => s[at] = v as u8,
                2 => s[at..at + 2].copy_from_slice(&(v as u16).to_le_bytes()),
                4 => s[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes()),
                _ => s[at..at + 8].copy_from_slice(&v.to_le_bytes()),
            }
        }
        match loc {
            // SAFETY: as in `read`.
            Loc::Ptr(p) => unsafe { memory::atomic_store(p, size, v) },
            Loc::Shared(a) => {
                wr(&mut self.shared.bytes, a, size, v);
                self.shared.mark_written(a, size as usize);
            }
            Loc::Local(a) => wr(self.local, a, size, v),
            Loc::Param(_) => {}
        }
    }
    pub(crate) fn rmw(&mut self, loc: Loc, size: u8, f: impl Fn(u64) -> u64) -> u64 {
        match loc {
            // SAFETY: as in `read`; atomics are 4 or 8 bytes.
            Loc::Ptr(p) => unsafe { memory::atomic_rmw(p, size, f) },
            _ => {
                let old = self.read(loc, size);
                self.write(loc, size, f(old) & num::mask(size as u32 * 8));
                old
            }
        }
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    /// When the epoch counter wraps, the stamps of the intervals before are cleared, so an
    /// interval numbered like an old one sees none of its accesses.
    pub fn epoch_wrap_clears_old_stamps() {
        let mut r = RaceState::default();
        r.resize(4);
        r.next_epoch();
        assert_eq!(r.epoch, 1);
        r.warp = 0;
        r.access(0, 4, true).unwrap();
        r.warp = 1;
        assert!(r.access(0, 4, false).is_err(), "read-after-write in one interval");
        r.epoch = EPOCH_LIMIT - 1;
        r.warp = 0;
        r.access(4, 4, false).unwrap();
        r.next_epoch();
        assert_eq!(r.epoch, 1, "wrapped");
        r.warp = 1;
        r.access(0, 4, false).unwrap();
        r.access(4, 4, true).unwrap();
        assert!(r.read_words(1, &[0; 32]));
        r.warp = 2;
        assert!(!r.read_words(1, &[1; 32]), "warp 1 wrote word 1 in this interval");
        // Warp 2's queued read of word 0 is stamped before warp 1's store there.
        assert!(r.read_words(1, &[0; 32]));
        r.warp = 1;
        let (msg, other) = r.access(0, 4, true).unwrap_err();
        assert!(msg.contains("warp 2 read"), "{msg}");
        assert_eq!(other.warp, 2);
        // A full warp reading evenly spaced words (queued as base and stride), then a store by
        // another warp to the last of them: the read is stamped first, with its instruction.
        r.next_epoch();
        r.resize(64);
        r.warp = 3;
        r.pc = 77;
        assert!(r.read_words(u32::MAX, &std::array::from_fn(|l| 2 * l as u32)));
        r.warp = 0;
        r.pc = 78;
        let (msg, other) = r.access(4 * 62, 4, true).unwrap_err();
        assert!(msg.contains("warp 3 read"), "{msg}");
        assert_eq!(other, RaceOther { warp: 3, pc: 77, write: false });
        // Queued reads of an interval that ended are dropped: no race with the next one.
        r.warp = 3;
        assert!(r.read_words(u32::MAX, &std::array::from_fn(|l| l as u32)));
        r.next_epoch();
        r.warp = 0;
        r.access(0, 128, true).unwrap();
    }

    /// Every write stamp, and the read stamps of the current interval (those of an interval that
    /// ended are stale, and the queue drops its reads unstamped then), agree.
    fn same_live_stamps(a: &RaceState, b: &RaceState, op: usize) {
        assert_eq!(a.epoch, b.epoch);
        assert_eq!(a.writers, b.writers, "after operation {op}");
        for i in 0..a.hot.len() {
            let (ha, hb, ca, cb) = (a.hot[i], b.hot[i], a.cold[i], b.cold[i]);
            assert_eq!((a.wr[i], a.wpc[i]), (b.wr[i], b.wpc[i]), "word {i} after operation {op}");
            let live = |h: HotWord| h.read >> 6 == a.epoch;
            assert_eq!(live(ha), live(hb), "word {i} after operation {op}");
            if live(ha) {
                assert_eq!((ha.read, ha.readers, ha.read_pc), (hb.read, hb.readers, hb.read_pc), "word {i} after {op}");
                if ha.readers.count_ones() > 1 {
                    assert_eq!((ca.read_pc, ca.read_warp), (cb.read_pc, cb.read_warp), "word {i} after {op}");
                }
            }
        }
    }

    /// The queued, filtered and whole-warp paths against plain [`RaceState::access`] lane by
    /// lane, on random interleavings of reads and stores of four warps in a 64-word window: the
    /// same result for every operation (with the executor's fallback: a fast path that says
    /// false is followed by `access` lane by lane), and the same stamps on every word after every
    /// operation once the queued reads are applied.
    pub fn fast_paths_match_access_lane_by_lane() {
        fast_paths_match(false);
        fast_paths_match(true);
    }

    fn fast_paths_match(portable: bool) {
        const WORDS: u32 = 64;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |n: u32| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 33) as u32 % n
        };
        let fresh = || {
            let mut r = RaceState::default();
            r.resize(WORDS as usize);
            r
        };
        let (mut fast, mut plain) = (RaceState { portable, ..fresh() }, fresh());
        fast.next_epoch();
        plain.next_epoch();
        type R = Result<(), (String, RaceOther)>;
        // `access` for each (lane, byte offset, length) in order: the first error.
        let lane_by_lane = |r: &mut RaceState, spans: &[(usize, usize)], store: bool| -> R {
            spans.iter().try_for_each(|&(at, len)| r.access(at, len, store))
        };
        let (mut races, mut ops) = (0, 0);
        for _ in 0..20_000 {
            let (w, pc) = (rnd(4), rnd(1000));
            for r in [&mut fast, &mut plain] {
                (r.warp, r.pc) = (w, pc);
            }
            let exec = match rnd(3) {
                0 => u32::MAX,
                1 => rnd(u32::MAX),
                _ => 1 << rnd(32),
            };
            let lanes = |f: &dyn Fn(usize) -> (usize, usize)| -> Vec<(usize, usize)> {
                (0..32).filter(|l| exec >> l & 1 == 1).map(f).collect()
            };
            let (a, b): (R, R) = match rnd(7) {
                0 => {
                    // Evenly spaced words (queued as base and stride) or scattered ones.
                    let words: [u32; 32] = if rnd(2) == 0 {
                        let (base, stride) = (rnd(WORDS - 31), rnd(2));
                        std::array::from_fn(|l| base + stride * l as u32)
                    } else {
                        std::array::from_fn(|_| rnd(WORDS))
                    };
                    let spans = lanes(&|l| (4 * words[l] as usize, 4));
                    let a = if fast.read_words(exec, &words) { Ok(()) } else { lane_by_lane(&mut fast, &spans, false) };
                    (a, lane_by_lane(&mut plain, &spans, false))
                }
                1 => {
                    let rows: [u32; 32] = std::array::from_fn(|_| 4 * rnd(WORDS / 4));
                    let spans = lanes(&|l| (16 * (rows[l] / 4) as usize, 16));
                    let a = if fast.read_rows(exec, &rows) { Ok(()) } else { lane_by_lane(&mut fast, &spans, false) };
                    (a, lane_by_lane(&mut plain, &spans, false))
                }
                2 => {
                    let span = [1, 2, 4][rnd(3) as usize];
                    let first: [u32; 32] = std::array::from_fn(|_| span * rnd(WORDS / span));
                    let spans = lanes(&|l| (4 * first[l] as usize, 4 * span as usize));
                    let a = if fast.store_spans(exec, &first, span) {
                        Ok(())
                    } else {
                        lane_by_lane(&mut fast, &spans, true)
                    };
                    (a, lane_by_lane(&mut plain, &spans, true))
                }
                3 => {
                    // Scattered words, or one row of 32 consecutive words (from a 16-byte
                    // boundary: checked as eight rows of four; from another word: one by one).
                    let words: [u32; 32] = match rnd(3) {
                        0 => std::array::from_fn(|_| rnd(WORDS)),
                        1 => {
                            let base = 4 * rnd((WORDS - 31) / 4);
                            std::array::from_fn(|l| base + l as u32)
                        }
                        _ => {
                            let base = rnd(WORDS - 31);
                            std::array::from_fn(|l| base + l as u32)
                        }
                    };
                    let spans: Vec<_> = (0..32).map(|l| (4 * words[l] as usize, 4)).collect();
                    let a = if fast.store_words(&words) { Ok(()) } else { lane_by_lane(&mut fast, &spans, true) };
                    (a, lane_by_lane(&mut plain, &spans, true))
                }
                4 => {
                    // A fused run: loads at `words0 + shift`, each with its own instruction.
                    let words0: [u32; 32] =
                        if rnd(2) == 0 { std::array::from_fn(|l| l as u32) } else { std::array::from_fn(|_| rnd(32)) };
                    let loads: Vec<(u32, u32)> = (0..1 + rnd(4)).map(|k| (pc + k, rnd(WORDS - 31))).collect();
                    let one_by_one = |r: &mut RaceState| -> R {
                        for &(lpc, shift) in &loads {
                            r.pc = lpc;
                            let spans: Vec<_> = (0..32).map(|l| (4 * (words0[l] + shift) as usize, 4)).collect();
                            lane_by_lane(r, &spans, false)?;
                        }
                        Ok(())
                    };
                    let a = if fast.queue_read_run(&words0, loads.iter().copied()) {
                        Ok(())
                    } else {
                        one_by_one(&mut fast)
                    };
                    (a, one_by_one(&mut plain))
                }
                5 => {
                    let (at, len, store) = (rnd(4 * WORDS - 16) as usize, 1 + rnd(16) as usize, rnd(2) == 0);
                    (fast.access(at, len, store), plain.access(at, len, store))
                }
                _ => {
                    fast.next_epoch();
                    plain.next_epoch();
                    continue;
                }
            };
            ops += 1;
            assert_eq!(a, b, "operation {ops}");
            let mut settled = RaceState {
                wr: fast.wr.clone(),
                wpc: fast.wpc.clone(),
                writers: fast.writers,
                hot: fast.hot.clone(),
                cold: fast.cold.clone(),
                pending: fast.pending.clone(),
                scattered: fast.scattered.clone(),
                epoch: fast.epoch,
                ..Default::default()
            };
            settled.stamp_pending();
            same_live_stamps(&settled, &plain, ops);
            if a.is_err() {
                races += 1;
                fast.next_epoch();
                plain.next_epoch();
            }
        }
        assert!(races > 100 && ops - races > 5000, "{races} races of {ops} operations");
    }
}
