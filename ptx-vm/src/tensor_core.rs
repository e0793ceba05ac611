//! Tensor-core instruction semantics: `mma.sync.aligned.m16n8k{8,16}.row.col.f32.{f16,bf16}.{f16,bf16}.f32`
//! and `ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.b16`, as pure functions over the 32 lanes of a
//! warp. The executor gathers each lane's source registers, calls these, and scatters the results.
//!
//! Lane naming follows the PTX ISA: `group = lane / 4`, `tig = lane % 4` (thread in group).
//!
//! ```text
//! A (m16 x k16, row-major), 4 x .b32 per lane, each .b32 = {lo, hi} halves:
//!   reg0 = A[group    ][2 tig .. 2 tig + 1]     reg2 = A[group    ][2 tig + 8 .. 2 tig + 9]
//!   reg1 = A[group + 8][2 tig .. 2 tig + 1]     reg3 = A[group + 8][2 tig + 8 .. 2 tig + 9]
//! B (k16 x n8, column-major), 2 x .b32 per lane:
//!   reg0 = B[2 tig .. 2 tig + 1][group]         reg1 = B[2 tig + 8 .. 2 tig + 9][group]
//! C, D (m16 x n8, f32), 4 x .f32 per lane:
//!   c0, c1 = C[group][2 tig], C[group][2 tig + 1]     c2, c3 = C[group + 8][2 tig], C[group + 8][2 tig + 1]
//! m16n8k8: A is reg0, reg1 only (k 0..8), B is reg0 only.
//! ```
//!
//! Numerics: every product of two f16/bf16 values is exact in f64, the 8 or 16 products and the
//! f32 accumulator are summed in f64 and rounded once to f32 (round to nearest even). Hardware
//! keeps at least f32 precision with an unspecified order, so results agree to within a few f32
//! ulps of the larger terms.
//!
//! The executor (`exec.rs`) checks that all 32 lanes execute the instruction, gathers each
//! lane's source registers (or, for `ldmatrix`, the 16-byte shared-memory rows the lanes
//! address), calls these functions and scatters the results.

/// Element type of the A and B operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HalfKind {
    F16,
    Bf16,
}

impl HalfKind {
    /// Value of a 16-bit element.
    #[inline]
    pub(crate) fn to_f64(self, bits: u16) -> f64 {
        match self {
            HalfKind::F16 => half::f16::from_bits(bits).to_f64(),
            // bf16 is the upper half of an f32: exact, without a library call.
            HalfKind::Bf16 => f32::from_bits((bits as u32) << 16) as f64,
        }
    }
}

#[inline]
fn lo(x: u32) -> u16 {
    x as u16
}
#[inline]
fn hi(x: u32) -> u16 {
    (x >> 16) as u16
}

/// Row-major A (16 x k) from the per-lane A registers (`k` = 8 or 16).
fn gather_a(kind: HalfKind, k: usize, a: &[[u32; 4]; 32]) -> [[f64; 16]; 16] {
    let mut m = [[0.0; 16]; 16];
    for (lane, regs) in a.iter().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        let nregs = k / 4; // 2 for k8, 4 for k16
        for (r, &reg) in regs.iter().enumerate().take(nregs) {
            let row = g + 8 * (r % 2);
            let col = 2 * t + 8 * (r / 2);
            m[row][col] = kind.to_f64(lo(reg));
            m[row][col + 1] = kind.to_f64(hi(reg));
        }
    }
    m
}

/// B (k x 8) from the per-lane B registers.
fn gather_b(kind: HalfKind, k: usize, b: &[[u32; 2]; 32]) -> [[f64; 8]; 16] {
    let mut m = [[0.0; 8]; 16];
    for (lane, regs) in b.iter().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for (r, &reg) in regs.iter().enumerate().take(k / 8) {
            let row = 2 * t + 8 * r;
            m[row][g] = kind.to_f64(lo(reg));
            m[row + 1][g] = kind.to_f64(hi(reg));
        }
    }
    m
}

/// `mma.sync.aligned.m16n8k{k}.row.col.f32.T.T.f32`: D = A B + C for all 32 lanes.
/// `a[lane]` uses regs `0..k/4`, `b[lane]` regs `0..k/8`; unused registers are ignored.
pub(crate) fn mma_f32_acc(
    kind: HalfKind,
    k: usize,
    a: &[[u32; 4]; 32],
    b: &[[u32; 2]; 32],
    c: &[[f32; 4]; 32],
) -> [[f32; 4]; 32] {
    assert!(k == 8 || k == 16);
    let am = gather_a(kind, k, a);
    let bm = gather_b(kind, k, b);
    // Each output is c + a0 b0 + a1 b1 + ... in this order (one rounding to f32 at the end);
    // running the k loop outside lets the compiler vectorise over the 8 columns without
    // changing any output's sequence of operations.
    let mut acc = [[0.0f64; 8]; 16];
    for (lane, cl) in c.iter().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for (i, &ci) in cl.iter().enumerate() {
            acc[g + 8 * (i / 2)][2 * t + (i % 2)] = ci as f64;
        }
    }
    for kk in 0..k {
        let bk = &bm[kk];
        for (row, accr) in acc.iter_mut().enumerate() {
            let x = am[row][kk];
            for col in 0..8 {
                accr[col] += x * bk[col];
            }
        }
    }
    let mut d = [[0.0f32; 4]; 32];
    for (lane, dl) in d.iter_mut().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for (i, di) in dl.iter_mut().enumerate() {
            *di = acc[g + 8 * (i / 2)][2 * t + (i % 2)] as f32;
        }
    }
    d
}

/// [`mma_f32_acc`] on the warp's register rows, as the executor holds them: `a[r][lane]`,
/// `b[r][lane]` and `c[r][lane]` (low 32 bits) are register `r` of each lane; returns the four
/// destination rows (`d[i][lane]` = the f32 bits of element `i` of `lane`).
///
/// The same bits as [`mma_f32_acc`]: when every A, B and C element is finite, each product of
/// two 16-bit floats is exact in f64 and no partial sum can overflow, so a fused multiply-add
/// gives exactly what the multiply then add gives, and the sum keeps its k order per output. The
/// fragments are converted straight from the rows (bf16 by a shift) into the layout the
/// multiply-add loop reads, and that loop runs in a copy compiled for AVX-512 or AVX2 with FMA
/// when the CPU has them. An infinite or NaN element (whose NaN bits could depend on the order
/// of operands) sends the warp through [`mma_f32_acc`] itself.
pub(crate) fn mma_rows(
    kind: HalfKind,
    k16: bool,
    a: [&[u64; 32]; 4],
    b: [&[u64; 32]; 2],
    c: [&[u64; 32]; 4],
) -> [[u64; 32]; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX-512F/VL, F16C and FMA (checked just above).
            return unsafe {
                if k16 {
                    mma_rows_avx512::<16>(kind, a, b, c)
                } else {
                    mma_rows_avx512::<8>(kind, a, b, c)
                }
            };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { mma_rows_avx2(kind, k16, a, b, c) };
        }
    }
    mma_rows_body::<false>(kind, k16, a, b, c)
}

/// [`mma_rows_body`] with AVX-512: four lanes' register `r` hold eight consecutive elements of
/// one A row, converted as one vector; every fourth lane's B register holds one row pair of B,
/// permuted into one vector; each output row is one vector of 8 f64 accumulated with one fused
/// multiply-add per k. Where an output is infinite or NaN the fallback computes all of them:
/// an infinite or NaN operand always makes one (it is multiplied into a whole output row or
/// column), so the operands need no check of their own, and a sum past the f32 range takes the
/// fallback too (the same bits: the fallback also sums in f64 and rounds once).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,f16c,fma")]
fn mma_rows_avx512<const K: usize>(
    kind: HalfKind,
    a: [&[u64; 32]; 4],
    b: [&[u64; 32]; 2],
    c: [&[u64; 32]; 4],
) -> [[u64; 32]; 4] {
    use std::arch::x86_64::*;
    // The low 32 bits of 4 lanes (8 halves, lane order, low half first) as 8 f64.
    let conv8 = |p: &[u64]| -> __m512d {
        assert!(p.len() >= 4);
        // SAFETY: `p` has at least 4 elements (32 bytes); unaligned loads are allowed.
        let v = unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) };
        let h = _mm256_cvtepi64_epi32(v);
        let f = match kind {
            HalfKind::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h))),
            HalfKind::F16 => _mm256_cvtph_ps(h),
        };
        _mm512_cvtps_pd(f)
    };
    let (na, nb) = (K / 4, K / 8);
    let mut am = [[0f64; 16]; 16];
    for (r, ar) in a.iter().enumerate().take(na) {
        for g in 0..8 {
            let row = &mut am[g + 8 * (r % 2)][8 * (r / 2)..8 * (r / 2) + 8];
            // SAFETY: `row` is 8 f64.
            unsafe { _mm512_storeu_pd(row.as_mut_ptr(), conv8(&ar[4 * g..])) };
        }
    }
    // bm[k] = B[k][0..8]: register r of lane 4g + t holds B[2t + 8r][g] (low half) and
    // B[2t + 8r + 1][g] (high half), so the lanes t, t + 4, ..., t + 28 (one per column) give
    // rows 2t + 8r and 2t + 8r + 1.
    let half8 = |v: __m512i, high: bool| -> __m512d {
        let h = _mm512_cvtepi64_epi32(if high { _mm512_srli_epi64::<16>(v) } else { v });
        let f = match kind {
            // The shift drops the other half.
            HalfKind::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h)),
            HalfKind::F16 => _mm256_cvtph_ps(_mm256_cvtepi32_epi16(h)),
        };
        _mm512_cvtps_pd(f)
    };
    let mut bm = [_mm512_setzero_pd(); K];
    for (r, br) in b.iter().enumerate().take(nb) {
        // SAFETY: 8 u64 at `8 q` of a 32-lane row.
        let z: [__m512i; 4] = std::array::from_fn(|q| unsafe { _mm512_loadu_si512(br[8 * q..].as_ptr().cast()) });
        for t in 0..4i64 {
            let lo = _mm512_permutex2var_epi64(z[0], _mm512_set_epi64(0, 0, 0, 0, 12 + t, 8 + t, 4 + t, t), z[1]);
            let hi = _mm512_permutex2var_epi64(z[2], _mm512_set_epi64(12 + t, 8 + t, 4 + t, t, 0, 0, 0, 0), z[3]);
            let v = _mm512_mask_blend_epi64(0xF0, lo, hi);
            let k = 2 * t as usize + 8 * r;
            bm[k] = half8(v, false);
            bm[k + 1] = half8(v, true);
        }
    }
    // C: lanes 4g..4g+3 of c0/c1 interleaved are row g (c2/c3: row g + 8).
    let lanes4 = |p: &[u64]| -> __m128 {
        // SAFETY: as in `conv8`.
        _mm_castsi128_ps(_mm256_cvtepi64_epi32(unsafe { _mm256_loadu_si256(p.as_ptr() as *const __m256i) }))
    };
    let mut acc = [_mm512_setzero_pd(); 16];
    for g in 0..8 {
        for half in 0..2 {
            let (e, o) = (lanes4(&c[2 * half][4 * g..]), lanes4(&c[2 * half + 1][4 * g..]));
            let row = _mm256_set_m128(_mm_unpackhi_ps(e, o), _mm_unpacklo_ps(e, o));
            acc[g + 8 * half] = _mm512_cvtps_pd(row);
        }
    }
    // k outermost: 16 independent accumulator chains in flight (each still in k order).
    for (kk, bk) in bm.iter().enumerate() {
        for (row, accr) in acc.iter_mut().enumerate() {
            *accr = _mm512_fmadd_pd(_mm512_set1_pd(am[row][kk]), *bk, *accr);
        }
    }
    let mut out = [[0u64; 32]; 4];
    let deint = _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0);
    // Outputs whose exponent is all ones (infinite or NaN).
    let (exp, mut special) = (_mm256_set1_epi32(0x7F80_0000), 0u8);
    for g in 0..8 {
        for half in 0..2 {
            let f = _mm512_cvtpd_ps(acc[g + 8 * half]);
            special |= _mm256_cmpeq_epi32_mask(_mm256_and_si256(_mm256_castps_si256(f), exp), exp);
            let p = _mm256_castps_si256(_mm256_permutevar8x32_ps(f, deint));
            let (e, o) = (
                _mm256_cvtepu32_epi64(_mm256_castsi256_si128(p)),
                _mm256_cvtepu32_epi64(_mm256_extracti128_si256::<1>(p)),
            );
            // SAFETY: each destination is 4 u64 inside a 32-lane row.
            unsafe {
                _mm256_storeu_si256(out[2 * half][4 * g..].as_mut_ptr() as *mut __m256i, e);
                _mm256_storeu_si256(out[2 * half + 1][4 * g..].as_mut_ptr() as *mut __m256i, o);
            }
        }
    }
    if special != 0 {
        return mma_rows_fallback(kind, K == 16, a, b, c);
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn mma_rows_avx2(
    kind: HalfKind,
    k16: bool,
    a: [&[u64; 32]; 4],
    b: [&[u64; 32]; 2],
    c: [&[u64; 32]; 4],
) -> [[u64; 32]; 4] {
    mma_rows_body::<true>(kind, k16, a, b, c)
}

/// The body of [`mma_rows`], inlined into each target-feature copy; `FUSED` says whether the
/// copy has a hardware fused multiply-add.
#[inline(always)]
fn mma_rows_body<const FUSED: bool>(
    kind: HalfKind,
    k16: bool,
    a: [&[u64; 32]; 4],
    b: [&[u64; 32]; 2],
    c: [&[u64; 32]; 4],
) -> [[u64; 32]; 4] {
    let (na, nb) = if k16 { (4, 2) } else { (2, 1) };
    // The elements as f32 (exact for both kinds): am[row][k] (row-major A), bt[col][k] (B
    // transposed: lanes 4g..4g+3 hold column g), in the order the lanes' registers list them.
    let mut am = [[0f32; 16]; 16];
    let mut bt = [[0f32; 16]; 8];
    let to_f32 = |h: u32| -> f32 {
        match kind {
            HalfKind::Bf16 => f32::from_bits(h << 16),
            HalfKind::F16 => half::f16::from_bits(h as u16).to_f32(),
        }
    };
    for (r, ar) in a.iter().enumerate().take(na) {
        // Register r of lanes 4g..4g+3: A[g + 8 (r % 2)][8 (r / 2) .. 8 (r / 2) + 8].
        for g in 0..8 {
            let dst = &mut am[g + 8 * (r % 2)][8 * (r / 2)..8 * (r / 2) + 8];
            for t in 0..4 {
                let v = ar[4 * g + t] as u32;
                dst[2 * t] = to_f32(v & 0xffff);
                dst[2 * t + 1] = to_f32(v >> 16);
            }
        }
    }
    for (r, br) in b.iter().enumerate().take(nb) {
        // Register r of lanes 4g..4g+3: B[8 r .. 8 r + 8][g].
        for g in 0..8 {
            let dst = &mut bt[g][8 * r..8 * r + 8];
            for t in 0..4 {
                let v = br[4 * g + t] as u32;
                dst[2 * t] = to_f32(v & 0xffff);
                dst[2 * t + 1] = to_f32(v >> 16);
            }
        }
    }
    // B by k, in f64: bm[k][col].
    let mut bm = [[0f64; 8]; 16];
    for (kk, bk) in bm.iter_mut().enumerate() {
        for (col, x) in bk.iter_mut().enumerate() {
            *x = bt[col][kk] as f64;
        }
    }
    // Output rows: acc[row][col]; lane 4g+t holds (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
    let mut acc = [[0f64; 8]; 16];
    for (i, cr) in c.iter().enumerate() {
        for (l, &v) in cr.iter().enumerate() {
            acc[l / 4 + 8 * (i / 2)][2 * (l % 4) + (i % 2)] = f32::from_bits(v as u32) as f64;
        }
    }
    let kn = if k16 { 16 } else { 8 };
    for (ar, accr) in am.iter().zip(acc.iter_mut()) {
        let mut v = *accr;
        for (kk, bk) in bm.iter().enumerate().take(kn) {
            let x = ar[kk] as f64;
            for col in 0..8 {
                v[col] = if FUSED { x.mul_add(bk[col], v[col]) } else { v[col] + x * bk[col] };
            }
        }
        *accr = v;
    }
    let mut out = [[0u64; 32]; 4];
    for (i, or) in out.iter_mut().enumerate() {
        for (l, o) in or.iter_mut().enumerate() {
            *o = (acc[l / 4 + 8 * (i / 2)][2 * (l % 4) + (i % 2)] as f32).to_bits() as u64;
        }
    }
    // An infinite or NaN output (from such an operand, or a sum past the f32 range): the
    // fallback, as in `mma_rows_avx512`.
    if out.iter().flatten().any(|&o| o as u32 & 0x7F80_0000 == 0x7F80_0000) {
        return mma_rows_fallback(kind, k16, a, b, c);
    }
    out
}

/// [`mma_rows`] through [`mma_f32_acc`] itself (operands with an infinity or NaN).
#[cold]
#[inline(never)]
fn mma_rows_fallback(
    kind: HalfKind,
    k16: bool,
    a: [&[u64; 32]; 4],
    b: [&[u64; 32]; 2],
    c: [&[u64; 32]; 4],
) -> [[u64; 32]; 4] {
    let (na, nb) = if k16 { (4, 2) } else { (2, 1) };
    let mut aa = [[0u32; 4]; 32];
    let mut bb = [[0u32; 2]; 32];
    let mut cc = [[0f32; 4]; 32];
    for l in 0..32 {
        for r in 0..na {
            aa[l][r] = a[r][l] as u32;
        }
        for r in 0..nb {
            bb[l][r] = b[r][l] as u32;
        }
        for r in 0..4 {
            cc[l][r] = f32::from_bits(c[r][l] as u32);
        }
    }
    let d = mma_f32_acc(kind, if k16 { 16 } else { 8 }, &aa, &bb, &cc);
    let mut out = [[0u64; 32]; 4];
    for l in 0..32 {
        for i in 0..4 {
            out[i][l] = d[l][i].to_bits() as u64;
        }
    }
    out
}

/// `ldmatrix.sync.aligned.m8n8.x{num}{.trans}.b16`. `rows[m][r]` is row `r` of matrix `m` (8
/// 16-bit elements, read from the address lane `8 m + r` supplied). Returns each lane's `num`
/// destination registers: without `.trans`, reg `m` of lane `l` holds `M_m[l / 4][2 (l % 4) ..+2]`;
/// with `.trans`, it holds `M_m[2 (l % 4)][l / 4]` (lo) and `M_m[2 (l % 4) + 1][l / 4]` (hi).
pub(crate) fn ldmatrix(num: usize, trans: bool, rows: &[[[u16; 8]; 8]]) -> [[u32; 4]; 32] {
    assert!(matches!(num, 1 | 2 | 4) && rows.len() >= num);
    let mut out = [[0u32; 4]; 32];
    for (lane, regs) in out.iter_mut().enumerate() {
        let (r, c) = (lane / 4, 2 * (lane % 4));
        for (m, reg) in regs.iter_mut().enumerate().take(num) {
            let (e0, e1) = if trans { (rows[m][c][r], rows[m][c + 1][r]) } else { (rows[m][r][c], rows[m][r][c + 1]) };
            *reg = e0 as u32 | (e1 as u32) << 16;
        }
    }
    out
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use half::{bf16, f16};

    fn pack(lo: u16, hi: u16) -> u32 {
        lo as u32 | (hi as u32) << 16
    }

    /// Distributes a row-major A and column-major B per the PTX fragment layout, independently of
    /// the gather code (written from the ISA tables), and checks D against an f64 matmul.
    fn check(kind: HalfKind, k: usize) {
        let enc = |x: f32| match kind {
            HalfKind::F16 => f16::from_f32(x).to_bits(),
            HalfKind::Bf16 => bf16::from_f32(x).to_bits(),
        };
        // Small integers and halves: exact in both formats, so the expected D is exact.
        let av = |i: usize, j: usize| ((i * 7 + j * 3) % 11) as f32 * 0.5 - 2.0;
        let bv = |i: usize, j: usize| ((i * 5 + j * 13) % 9) as f32 - 4.0;
        let cv = |i: usize, j: usize| (i * 8 + j) as f32 * 0.25;
        let mut a = [[0u32; 4]; 32];
        let mut b = [[0u32; 2]; 32];
        let mut c = [[0f32; 4]; 32];
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            // A: a0,a1 (row g, cols 2t,2t+1), a2,a3 (row g+8), a4,a5 (row g, cols +8), a6,a7 (row g+8, +8)
            a[lane][0] = pack(enc(av(g, 2 * t)), enc(av(g, 2 * t + 1)));
            a[lane][1] = pack(enc(av(g + 8, 2 * t)), enc(av(g + 8, 2 * t + 1)));
            if k == 16 {
                a[lane][2] = pack(enc(av(g, 2 * t + 8)), enc(av(g, 2 * t + 9)));
                a[lane][3] = pack(enc(av(g + 8, 2 * t + 8)), enc(av(g + 8, 2 * t + 9)));
            }
            b[lane][0] = pack(enc(bv(2 * t, g)), enc(bv(2 * t + 1, g)));
            if k == 16 {
                b[lane][1] = pack(enc(bv(2 * t + 8, g)), enc(bv(2 * t + 9, g)));
            }
            c[lane] = [cv(g, 2 * t), cv(g, 2 * t + 1), cv(g + 8, 2 * t), cv(g + 8, 2 * t + 1)];
        }
        let d = mma_f32_acc(kind, k, &a, &b, &c);
        for (lane, dl) in d.iter().enumerate() {
            let (g, t) = (lane / 4, lane % 4);
            for (i, (row, col)) in
                [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)].into_iter().enumerate()
            {
                let mut want = cv(row, col) as f64;
                for kk in 0..k {
                    want += av(row, kk) as f64 * bv(kk, col) as f64;
                }
                assert_eq!(dl[i] as f64, want, "{kind:?} k{k} lane {lane} elem {i}");
            }
        }
    }

    pub fn mma_m16n8k16_f16_and_bf16() {
        check(HalfKind::F16, 16);
        check(HalfKind::Bf16, 16);
    }

    pub fn mma_m16n8k8_f16_and_bf16() {
        check(HalfKind::F16, 8);
        check(HalfKind::Bf16, 8);
    }

    pub fn mma_rounds_once_to_f32() {
        // 1 + 2^-24 + 2^-24 : summed exactly then rounded -> 1 + 2^-23 (two separate f32 adds give 1).
        let one = f16::from_f32(1.0).to_bits();
        let tiny = f16::from_f32(2f32.powi(-12)).to_bits();
        let mut a = [[0u32; 4]; 32];
        let mut b = [[0u32; 2]; 32];
        let c = [[1.0f32; 4]; 32];
        // Row 0 of A = [2^-12, 2^-12, 0...], column 0 of B = [2^-12, 2^-12, 0...] -> D[0][0] = 1 + 2^-23.
        a[0][0] = pack(tiny, tiny);
        b[0][0] = pack(tiny, tiny);
        let _ = one;
        let d = mma_f32_acc(HalfKind::F16, 16, &a, &b, &c);
        assert_eq!(d[0][0], 1.0 + 2f32.powi(-23));
        assert_eq!(d[0][1], 1.0);
    }

    pub fn mma_sums_every_output_in_k_order_bit_for_bit() {
        // Random finite operands: each output must be exactly `c + a0 b0 + a1 b1 + ...` summed
        // in f64 in k order and rounded once (the order the VM has always used, so kernels' VM
        // results stay bit-identical), for both element kinds and both k.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for kind in [HalfKind::F16, HalfKind::Bf16] {
            for k in [8, 16] {
                let mut half_bits = || loop {
                    let h = next() as u16;
                    if kind.to_f64(h).is_finite() {
                        return h;
                    }
                };
                let mut a = [[0u32; 4]; 32];
                let mut b = [[0u32; 2]; 32];
                let mut c = [[0f32; 4]; 32];
                for lane in 0..32 {
                    for r in &mut a[lane] {
                        *r = pack(half_bits(), half_bits());
                    }
                    for r in &mut b[lane] {
                        *r = pack(half_bits(), half_bits());
                    }
                    for v in &mut c[lane] {
                        *v = kind.to_f64(half_bits()) as f32;
                    }
                }
                let (am, bm) = (gather_a(kind, k, &a), gather_b(kind, k, &b));
                let d = mma_f32_acc(kind, k, &a, &b, &c);
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    for i in 0..4 {
                        let (row, col) = (g + 8 * (i / 2), 2 * t + (i % 2));
                        let mut s = c[lane][i] as f64;
                        for kk in 0..k {
                            s += am[row][kk] * bm[kk][col];
                        }
                        assert_eq!(d[lane][i].to_bits(), (s as f32).to_bits(), "{kind:?} k{k} lane {lane} elem {i}");
                    }
                }
            }
        }
    }

    /// [`mma_rows`] (fragments straight from the register rows, the fused multiply-add loop)
    /// gives the bits of [`mma_f32_acc`] on random operands of every exponent, for both element
    /// kinds and both k, and also when some element is infinite or NaN (the fallback).
    pub fn mma_rows_matches_mma_f32_acc_bit_for_bit() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..400 {
            for kind in [HalfKind::F16, HalfKind::Bf16] {
                for k16 in [false, true] {
                    let mut a = [[0u64; 32]; 4];
                    let mut b = [[0u64; 32]; 2];
                    let mut c = [[0u64; 32]; 4];
                    // Some rounds: narrow exponents (sums that cancel, subnormal and zero
                    // products); others: any bits, with NaN and infinity every few rounds.
                    let narrow = round % 2 == 0;
                    let special = round % 5 == 4;
                    let mut half_bits = || -> u64 {
                        let h = next() as u16;
                        let h = if narrow { h & 0x83ff | 0x3800 } else { h };
                        let h = if !special && kind.to_f64(h).is_nan() | kind.to_f64(h).is_infinite() {
                            h & 0x3fff
                        } else {
                            h
                        };
                        h as u64
                    };
                    for row in a.iter_mut().chain(b.iter_mut()) {
                        for v in row.iter_mut() {
                            *v = half_bits() | half_bits() << 16 | half_bits() << 40;
                        }
                    }
                    for row in c.iter_mut() {
                        for v in row.iter_mut() {
                            let f = kind.to_f64(half_bits() as u16) as f32;
                            let f = if round % 7 == 3 { -0.0 } else { f };
                            *v = f.to_bits() as u64;
                        }
                    }
                    let (na, nb) = if k16 { (4, 2) } else { (2, 1) };
                    let mut aa = [[0u32; 4]; 32];
                    let mut bb = [[0u32; 2]; 32];
                    let mut cc = [[0f32; 4]; 32];
                    for l in 0..32 {
                        for r in 0..na {
                            aa[l][r] = a[r][l] as u32;
                        }
                        for r in 0..nb {
                            bb[l][r] = b[r][l] as u32;
                        }
                        for r in 0..4 {
                            cc[l][r] = f32::from_bits(c[r][l] as u32);
                        }
                    }
                    let want = mma_f32_acc(kind, if k16 { 16 } else { 8 }, &aa, &bb, &cc);
                    let (ar, br, cr) = ([&a[0], &a[1], &a[2], &a[3]], [&b[0], &b[1]], [&c[0], &c[1], &c[2], &c[3]]);
                    // The widest copy this CPU runs, and the portable body with and without a
                    // fused multiply-add (what CPUs without AVX-512 run).
                    let paths = [
                        ("mma_rows", mma_rows(kind, k16, ar, br, cr)),
                        ("body", mma_rows_body::<false>(kind, k16, ar, br, cr)),
                        ("body fused", mma_rows_body::<true>(kind, k16, ar, br, cr)),
                    ];
                    for (path, got) in paths {
                        for l in 0..32 {
                            for i in 0..4 {
                                assert_eq!(
                                    got[i][l],
                                    want[l][i].to_bits() as u64,
                                    "{path}: round {round} {kind:?} k16 {k16} lane {l} elem {i}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    pub fn ldmatrix_plain_and_trans() {
        let mut rows = [[[0u16; 8]; 8]; 4];
        for (m, mat) in rows.iter_mut().enumerate() {
            for (r, row) in mat.iter_mut().enumerate() {
                for (c, e) in row.iter_mut().enumerate() {
                    *e = (m * 100 + r * 10 + c) as u16;
                }
            }
        }
        let plain = ldmatrix(4, false, &rows);
        // lane 6: row 1, cols 4,5
        assert_eq!(plain[6][0], 14 | 15 << 16);
        assert_eq!(plain[6][3], 314 | 315 << 16);
        let t = ldmatrix(2, true, &rows);
        // lane 6 with .trans: (row 4, col 1) lo and (row 5, col 1) hi
        assert_eq!(t[6][0], 41 | 51 << 16);
        assert_eq!(t[6][1], 141 | 151 << 16);
        assert_eq!(t[6][2], 0, "x2 leaves the third register alone");
        let one = ldmatrix(1, false, &rows);
        assert_eq!(one[31][0], 76 | 77 << 16);
    }
}
