//! Device memory: the global heap with exact statistics, the address map, and the launch-time view
//! every access is checked against.
//!
//! Generic address space layout (64-bit):
//! - `[MODULE_BASE, HEAP_BASE)`: module `.global`/`.const` variables, one 4 GiB window per module;
//! - `[HEAP_BASE, ..)`: `Vm::alloc` allocations, 256-byte aligned, never reused (so a stale pointer
//!   is recognised as a use after free);
//! - `PARAM_WINDOW`, `LOCAL_WINDOW`, `SHARED_WINDOW`: generic windows onto kernel parameters, the
//!   thread's local memory and the block's shared memory. State-space addresses (`ld.shared`,
//!   `ld.local`) are offsets from 0; `cvta` adds or removes the window base.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};

pub(crate) const MODULE_BASE: u64 = 0x0080_0000_0000;
pub(crate) const HEAP_BASE: u64 = 0x0100_0000_0000;
pub(crate) const PARAM_WINDOW: u64 = 0xFD00_0000_0000;
pub(crate) const LOCAL_WINDOW: u64 = 0xFE00_0000_0000;
pub(crate) const SHARED_WINDOW: u64 = 0xFF00_0000_0000;
pub(crate) const WINDOW_SIZE: u64 = 1 << 32;

pub(crate) struct Alloc {
    pub size: u64,
    pub data: Box<[AtomicU64]>,
    /// Module variables: not counted in `MemStats`, not freeable.
    pub module: Option<u64>,
}

/// Zeroed backing store for `bytes` bytes, or `HostMemory` when the host cannot provide it (a
/// failed allocation is reported, not an abort of the process).
fn zeroed(bytes: u64) -> Result<Box<[AtomicU64]>, crate::VmError> {
    let fail = crate::VmError::HostMemory { requested: bytes };
    let words = usize::try_from(bytes.div_ceil(8)).map_err(|_| fail.clone())?.max(1);
    let layout = std::alloc::Layout::array::<AtomicU64>(words).map_err(|_| fail.clone())?;
    // SAFETY: the layout has a non-zero size (words >= 1).
    let p = unsafe { std::alloc::alloc_zeroed(layout) } as *mut AtomicU64;
    if p.is_null() {
        return Err(fail);
    }
    // SAFETY: `p` is a zeroed allocation of `words` AtomicU64 with the layout `Box<[AtomicU64]>`
    // frees it with (all-zero bits are a valid AtomicU64).
    Ok(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, words)) })
}

pub(crate) fn bytes_ptr(data: &[AtomicU64]) -> *mut u8 {
    data.as_ptr() as *mut u8
}

#[derive(Default)]
pub(crate) struct Heap {
    pub allocs: BTreeMap<u64, Alloc>,
    /// Freed ranges (start, size), in address order.
    pub freed: Vec<(u64, u64)>,
    pub next: u64,
    pub current: u64,
    pub peak: u64,
    pub live: u64,
    pub total: u64,
    /// Names given to allocations (`Vm::set_label`), by start address; kept after a free.
    pub labels: HashMap<u64, String>,
}

impl Heap {
    pub fn new() -> Heap {
        Heap { next: HEAP_BASE, ..Default::default() }
    }
    pub fn alloc(&mut self, bytes: u64, limit: u64) -> Result<u64, crate::VmError> {
        let free = limit.saturating_sub(self.current);
        if bytes > free || bytes > (1 << 46) {
            return Err(crate::VmError::OutOfMemory { requested: bytes, free });
        }
        let data = zeroed(bytes)?;
        let addr = self.next;
        self.next += bytes.div_ceil(256).max(1) * 256 + 256;
        self.allocs.insert(addr, Alloc { size: bytes, data, module: None });
        self.current += bytes;
        self.peak = self.peak.max(self.current);
        self.live += 1;
        self.total += 1;
        Ok(addr)
    }
    pub fn free(&mut self, ptr: u64) -> Result<(), crate::VmError> {
        match self.allocs.get(&ptr) {
            Some(a) if a.module.is_none() => {
                let size = a.size;
                self.allocs.remove(&ptr);
                let at = self.freed.partition_point(|&(s, _)| s < ptr);
                self.freed.insert(at, (ptr, size));
                self.current -= size;
                self.live -= 1;
                Ok(())
            }
            Some(_) => {
                Err(crate::VmError::InvalidPointer(format!("{ptr:#x} is a module variable and cannot be freed")))
            }
            None => Err(crate::VmError::InvalidPointer(format!(
                "{ptr:#x} is not the start of a live allocation ({})",
                self.describe(ptr, 1)
            ))),
        }
    }
    /// The allocation containing `[ptr, ptr+len)`, as (start, alloc).
    pub fn find(&self, ptr: u64, len: u64) -> Option<(u64, &Alloc)> {
        let (&s, a) = self.allocs.range(..=ptr).next_back()?;
        if ptr.checked_add(len)? <= s + a.size {
            Some((s, a))
        } else {
            None
        }
    }
    /// Describes where `addr` lies relative to the allocations (for error messages).
    pub fn describe(&self, addr: u64, len: u64) -> String {
        let regions: Vec<(u64, u64)> = self.allocs.iter().map(|(&s, a)| (s, a.size)).collect();
        describe(&regions, &self.freed, &self.labels, addr, len).0
    }
    /// The label of the allocation an access at `addr` belongs to (containing it, or the nearest
    /// one, as in the finding's description).
    pub fn label_near(&self, addr: u64, len: u64) -> Option<String> {
        let regions: Vec<(u64, u64)> = self.allocs.iter().map(|(&s, a)| (s, a.size)).collect();
        let start = describe(&regions, &self.freed, &self.labels, addr, len).1?;
        self.labels.get(&start).cloned()
    }
    pub fn host_access(&self, ptr: u64, len: u64) -> Result<*mut u8, crate::VmError> {
        match self.find(ptr, len) {
            Some((s, a)) => Ok(unsafe { bytes_ptr(&a.data).add((ptr - s) as usize) }),
            None => Err(crate::VmError::InvalidPointer(format!(
                "the {len}-byte range at {ptr:#x} is not inside a live allocation ({})",
                self.describe(ptr, len)
            ))),
        }
    }
}

/// Whether `addr` hits a freed range.
fn in_freed(freed: &[(u64, u64)], addr: u64) -> Option<(u64, u64)> {
    let i = freed.partition_point(|&(s, _)| s <= addr);
    if i == 0 {
        return None;
    }
    let (s, n) = freed[i - 1];
    if addr < s + n.max(1) {
        Some((s, n))
    } else {
        None
    }
}

/// Where `addr` lies relative to the allocations (text for findings) and the start of the
/// allocation the text names.
pub(crate) fn describe(
    regions: &[(u64, u64)],
    freed: &[(u64, u64)],
    labels: &HashMap<u64, String>,
    addr: u64,
    len: u64,
) -> (String, Option<u64>) {
    let name = |s: u64| labels.get(&s).map(|l| format!(" `{l}`")).unwrap_or_default();
    if let Some((s, n)) = in_freed(freed, addr) {
        return (format!("{} bytes into the freed {n}-byte allocation{} at {s:#x}", addr - s, name(s)), Some(s));
    }
    let mut best: Option<(u64, String, u64)> = None;
    for &(s, n) in regions {
        let e = s + n;
        let l = name(s);
        let (dist, text) = if addr < s {
            (s - addr, format!("{} bytes before the {n}-byte allocation{l} at {s:#x}", s - addr))
        } else if addr + len > e {
            let past = (addr + len).saturating_sub(e).min(addr.saturating_sub(e).max(addr + len - e));
            let off = addr - s;
            if addr >= e {
                (addr - e, format!("{} bytes past the end of the {n}-byte allocation{l} at {s:#x}", addr - e))
            } else {
                (
                    0,
                    format!(
                        "at offset {off} of the {n}-byte allocation{l} at {s:#x}, {past} bytes overrunning its end"
                    ),
                )
            }
        } else {
            (0, format!("at offset {} of the {n}-byte allocation{l} at {s:#x}", addr - s))
        };
        if best.as_ref().is_none_or(|(d, _, _)| dist < *d) {
            best = Some((dist, text, s));
        }
    }
    match best {
        Some((_, text, s)) => (text, Some(s)),
        None => ("no allocation is live".to_string(), None),
    }
}

/// Launch-time, read-only view of global memory shared by all workers.
pub(crate) struct GlobalView {
    /// (start, end, base pointer), sorted by start.
    regions: Vec<(u64, u64, *mut u8)>,
    pub sizes: Vec<(u64, u64)>,
    pub freed: Vec<(u64, u64)>,
    pub labels: HashMap<u64, String>,
}

// SAFETY: the pointers refer to `AtomicU64` buffers owned by the heap, which outlives the view
// (the `Vm` is mutably borrowed for the whole launch); all accesses are atomic.
unsafe impl Sync for GlobalView {}
unsafe impl Send for GlobalView {}

impl GlobalView {
    pub fn new(heap: &Heap) -> GlobalView {
        let regions = heap.allocs.iter().map(|(&s, a)| (s, s + a.size, bytes_ptr(&a.data))).collect();
        let sizes = heap.allocs.iter().map(|(&s, a)| (s, a.size)).collect();
        GlobalView { regions, sizes, freed: heap.freed.clone(), labels: heap.labels.clone() }
    }
    /// Pointer to `size` bytes at `addr` if they lie inside one allocation.
    #[inline(always)]
    pub fn resolve(&self, addr: u64, size: u64, hint: &mut usize) -> Option<*mut u8> {
        if let Some(&(s, e, p)) = self.regions.get(*hint) {
            if addr >= s && addr + size <= e {
                return Some(unsafe { p.add((addr - s) as usize) });
            }
        }
        let i = self.regions.partition_point(|r| r.0 <= addr);
        if i == 0 {
            return None;
        }
        let (s, e, p) = self.regions[i - 1];
        if addr.checked_add(size)? <= e {
            *hint = i - 1;
            Some(unsafe { p.add((addr - s) as usize) })
        } else {
            None
        }
    }
    pub fn describe(&self, addr: u64, len: u64) -> String {
        describe(&self.sizes, &self.freed, &self.labels, addr, len).0
    }
    pub fn is_freed(&self, addr: u64) -> bool {
        in_freed(&self.freed, addr).is_some()
    }
}

/// Loads `size` bytes (naturally aligned) through an atomic of that size.
///
/// # Safety
/// `p` must point to `size` valid, `size`-aligned bytes of a heap buffer.
#[inline(always)]
pub(crate) unsafe fn atomic_load(p: *mut u8, size: u8) -> u64 {
    match size {
        1 => (*(p as *const AtomicU8)).load(Relaxed) as u64,
        2 => (*(p as *const AtomicU16)).load(Relaxed) as u64,
        4 => (*(p as *const AtomicU32)).load(Relaxed) as u64,
        _ => (*(p as *const AtomicU64)).load(Relaxed),
    }
}

/// # Safety
/// As for [`atomic_load`].
#[inline(always)]
pub(crate) unsafe fn atomic_store(p: *mut u8, size: u8, v: u64) {
    match size {
        1 => (*(p as *const AtomicU8)).store(v as u8, Relaxed),
        2 => (*(p as *const AtomicU16)).store(v as u16, Relaxed),
        4 => (*(p as *const AtomicU32)).store(v as u32, Relaxed),
        _ => (*(p as *const AtomicU64)).store(v, Relaxed),
    }
}

/// Atomic read-modify-write: returns the old value.
///
/// # Safety
/// As for [`atomic_load`], with `size` 4 or 8.
pub(crate) unsafe fn atomic_rmw(p: *mut u8, size: u8, f: impl Fn(u64) -> u64) -> u64 {
    if size == 4 {
        let a = &*(p as *const AtomicU32);
        a.fetch_update(Relaxed, Relaxed, |o| Some(f(o as u64) as u32)).unwrap_or(0) as u64
    } else {
        let a = &*(p as *const AtomicU64);
        a.fetch_update(Relaxed, Relaxed, |o| Some(f(o))).unwrap_or(0)
    }
}
