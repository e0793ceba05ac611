//! Lesson 5, reference solution: flash-attention forward, one thread per query row, blocks of two
//! warps sharing K/V tiles of 64 rows in shared memory, online softmax in base 2.

use crate::gpu::*;

const D: usize = 32;
/// Threads per block = query rows per block = K/V rows per tile: thread `t` loads tile row `t`.
const BC: u32 = 64;

/// # Safety
/// The pointers must be valid for the shapes in `kernel.rs`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn flash_lesson_f32(
    seq_q: u32,
    seq_kv: u32,
    scale: f32,
    causal: u32,
    q: *const f32,
    k: *const f32,
    v: *const f32,
    o: *mut f32,
    lse: *mut f32,
) {
    let t = tid_x();
    let i = ctaid_x() * BC + t;
    let valid = i < seq_q;
    let k_s = dynamic_smem_f32();
    let v_s = unsafe { k_s.add(BC as usize * D) };
    // Step 1.
    let scale2 = scale * LOG2E;
    let mut qr = [0.0f32; D];
    if valid {
        for (c, x) in qr.iter_mut().enumerate() {
            *x = unsafe { *q.add(i as usize * D + c) } * scale2;
        }
    }
    // Keys this row may see: j < key_end.
    let key_end =
        if causal != 0 { (i as i64 + seq_kv as i64 - seq_q as i64 + 1).min(seq_kv as i64) } else { seq_kv as i64 };
    let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0.0f32, [0.0f32; D]);
    let mut kv0 = 0;
    while kv0 < seq_kv {
        // Step 2a.
        sync_threads();
        let j = kv0 + t;
        for c in 0..D {
            let (kx, vx) = if j < seq_kv {
                unsafe { (*k.add(j as usize * D + c), *v.add(j as usize * D + c)) }
            } else {
                (0.0, 0.0)
            };
            unsafe {
                *k_s.add(t as usize * D + c) = kx;
                *v_s.add(t as usize * D + c) = vx;
            }
        }
        sync_threads();
        // Step 2b.
        for r in 0..BC as usize {
            let mut s = 0.0f32;
            for (c, x) in qr.iter().enumerate() {
                s = fma(*x, unsafe { *k_s.add(r * D + c) }, s);
            }
            if ((kv0 as usize + r) as i64) >= key_end {
                s = f32::NEG_INFINITY;
            }
            let m_new = max_f32(m, s);
            let base = if m_new == f32::NEG_INFINITY { 0.0 } else { m_new };
            let alpha = exp2(m - base);
            let p = exp2(s - base);
            l = l * alpha + p;
            for (c, a) in acc.iter_mut().enumerate() {
                *a = fma(p, unsafe { *v_s.add(r * D + c) }, *a * alpha);
            }
            m = m_new;
        }
        kv0 += BC;
    }
    // Step 3.
    if valid {
        let (inv_l, lse_i) = if l > 0.0 { (1.0 / l, LN2 * (m + log2(l))) } else { (0.0, f32::NEG_INFINITY) };
        for (c, a) in acc.iter().enumerate() {
            unsafe { *o.add(i as usize * D + c) = a * inv_l };
        }
        unsafe { *lse.add(i as usize) = lse_i };
    }
}
