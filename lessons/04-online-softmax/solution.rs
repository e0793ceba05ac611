//! Lesson 4, reference solution: one pass, running max, rescaled sum and accumulator.

use crate::gpu::*;

/// # Safety
/// `s` must point to `rows * n`, `v` to `n * 4`, `o` to `rows * 4` and `lse` to `rows` f32s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn online_softmax_pv_f32(
    rows: u32,
    n: u32,
    s: *const f32,
    v: *const f32,
    o: *mut f32,
    lse: *mut f32,
) {
    let r = ctaid_x() * ntid_x() + tid_x();
    if r >= rows {
        return;
    }
    let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0.0f32, [0.0f32; 4]);
    for j in 0..n {
        let s2 = unsafe { *s.add((r * n + j) as usize) } * LOG2E;
        // Step 1.
        let m_new = max_f32(m, s2);
        let base = if m_new == f32::NEG_INFINITY { 0.0 } else { m_new };
        // Step 2.
        let alpha = exp2(m - base);
        l *= alpha;
        for a in acc.iter_mut() {
            *a *= alpha;
        }
        // Step 3.
        let p = exp2(s2 - base);
        l += p;
        for (c, a) in acc.iter_mut().enumerate() {
            *a = fma(p, unsafe { *v.add((j * 4) as usize + c) }, *a);
        }
        m = m_new;
    }
    let (inv_l, lse_r) = if l > 0.0 { (1.0 / l, LN2 * (m + log2(l))) } else { (0.0, f32::NEG_INFINITY) };
    for (c, a) in acc.iter().enumerate() {
        unsafe { *o.add((r * 4) as usize + c) = a * inv_l };
    }
    unsafe { *lse.add(r as usize) = lse_r };
}
