//! Numerics: IEEE float operations with PTX rounding modes, `.ftz`, `.sat`, and `cvt`.
//!
//! Directed rounding (`.rz`, `.rm`, `.rp`) is exact: the round-to-nearest result is computed
//! natively, the sign of the exact error is found with an error-free transformation, and the result
//! is stepped to its neighbour when the mode demands (`fma.f64` uses an exact expansion of
//! `a·b + c − r`; only an underflowing product `a·b` can make it inexact). `.approx` functions (`ex2`, `lg2`, `sin`, `cos`, `rcp.approx`, `rsqrt`,
//! `sqrt.approx`, `tanh`) are computed with the host's correctly rounded or near-correct libm
//! functions, i.e. at least as accurate as the hardware.

use std::cmp::Ordering;

/// Rounding mode: 0 = rn, 1 = rz, 2 = rm, 3 = rp.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub(crate) struct FMode {
    pub rnd: u8,
    pub ftz: bool,
    pub sat: bool,
    /// Integer rounding for float-to-float `cvt` (`.rni` etc.).
    pub int_round: bool,
}

pub(crate) const RN: u8 = 0;
pub(crate) const RZ: u8 = 1;
pub(crate) const RM: u8 = 2;
pub(crate) const RP: u8 = 3;

#[inline]
pub(crate) fn ftz32(x: f32) -> f32 {
    if x.is_subnormal() {
        0.0f32.copysign(x)
    } else {
        x
    }
}
#[inline]
pub(crate) fn ftz64(x: f64) -> f64 {
    if x.is_subnormal() {
        0.0f64.copysign(x)
    } else {
        x
    }
}
#[inline]
fn sat32(x: f32) -> f32 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(0.0, 1.0)
    }
}
#[inline]
fn sat64(x: f64) -> f64 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(0.0, 1.0)
    }
}

/// Steps a round-to-nearest result `r` to the directed result, given how the exact value compares.
fn direct32(r: f32, exact_vs_r: Ordering, rnd: u8) -> f32 {
    if r.is_nan() {
        return r;
    }
    match (exact_vs_r, rnd) {
        (Ordering::Equal, _) | (_, RN) => r,
        (Ordering::Greater, RP) => r.next_up(),
        (Ordering::Greater, RZ) if r < 0.0 || (r == 0.0 && r.is_sign_negative()) => r.next_up(),
        (Ordering::Less, RM) => r.next_down(),
        (Ordering::Less, RZ) if r > 0.0 || (r == 0.0 && r.is_sign_positive()) => r.next_down(),
        _ => r,
    }
}
fn direct64(r: f64, exact_vs_r: Ordering, rnd: u8) -> f64 {
    if r.is_nan() {
        return r;
    }
    match (exact_vs_r, rnd) {
        (Ordering::Equal, _) | (_, RN) => r,
        (Ordering::Greater, RP) => r.next_up(),
        (Ordering::Greater, RZ) if r < 0.0 => r.next_up(),
        (Ordering::Less, RM) => r.next_down(),
        (Ordering::Less, RZ) if r > 0.0 => r.next_down(),
        _ => r,
    }
}

/// `s + e == a + b` exactly (Knuth's TwoSum).
fn two_sum(a: f64, b: f64) -> (f64, f64) {
    let s = a + b;
    let bb = s - a;
    (s, (a - (s - bb)) + (b - bb))
}

/// Sign of the exact sum of `terms` (finite, no overflow): Shewchuk's grow-expansion turns them
/// into non-overlapping components of increasing magnitude that sum exactly to the total, whose
/// sign is the sign of the largest non-zero component.
fn expansion_sign(terms: &[f64; 4]) -> Ordering {
    let mut e = [0f64; 4];
    for (n, &t) in terms.iter().enumerate() {
        let mut q = t;
        for x in e.iter_mut().take(n) {
            let (s, err) = two_sum(q, *x);
            *x = err;
            q = s;
        }
        e[n] = q;
    }
    e.iter().rev().map(|&x| sign_ord(x)).find(|o| *o != Ordering::Equal).unwrap_or(Ordering::Equal)
}

fn sign_ord(x: f64) -> Ordering {
    if x > 0.0 {
        Ordering::Greater
    } else if x < 0.0 {
        Ordering::Less
    } else {
        Ordering::Equal
    }
}

/// Ordering of the exact result vs. the rounded `r` when `r` overflowed from finite inputs.
fn overflow_ord(r: f64) -> Ordering {
    if r > 0.0 {
        Ordering::Less
    } else {
        Ordering::Greater
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FBin {
    Add,
    Sub,
    Mul,
    Div,
    Min,
    Max,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FUn {
    Neg,
    Abs,
    Rcp,
    Sqrt,
    Rsqrt,
    Ex2,
    Lg2,
    Sin,
    Cos,
    Tanh,
}

#[inline(always)]
pub(crate) fn minmax32(a: f32, b: f32, max: bool) -> f32 {
    if a.is_nan() {
        return if b.is_nan() { f32::from_bits(0x7fff_ffff) } else { b };
    }
    if b.is_nan() {
        return a;
    }
    if a == b {
        // -0 < +0
        return if max == a.is_sign_negative() { b } else { a };
    }
    if (a > b) == max {
        a
    } else {
        b
    }
}
fn minmax64(a: f64, b: f64, max: bool) -> f64 {
    if a.is_nan() {
        return if b.is_nan() { f64::from_bits(0x7fff_ffff_ffff_ffff) } else { b };
    }
    if b.is_nan() {
        return a;
    }
    if a == b {
        return if max == a.is_sign_negative() { b } else { a };
    }
    if (a > b) == max {
        a
    } else {
        b
    }
}

#[inline(always)]
pub(crate) fn fbin32(k: FBin, m: FMode, a: u64, b: u64) -> u64 {
    let (mut a, mut b) = (f32::from_bits(a as u32), f32::from_bits(b as u32));
    if m.ftz {
        a = ftz32(a);
        b = ftz32(b);
    }
    let mut r = match k {
        FBin::Min => minmax32(a, b, false),
        FBin::Max => minmax32(a, b, true),
        FBin::Add | FBin::Sub => {
            let b = if k == FBin::Sub { -b } else { b };
            let r = a + b;
            if m.rnd == RN {
                r
            } else if r.is_infinite() && a.is_finite() && b.is_finite() {
                direct32(r, overflow_ord(r as f64), m.rnd)
            } else {
                // TwoSum: exact error of the rounded sum.
                let bb = r - a;
                let e = (a - (r - bb)) + (b - bb);
                let o = sign_ord(e as f64);
                // A zero sum of opposite operands is -0 in round-down mode.
                if r == 0.0
                    && e == 0.0
                    && m.rnd == RM
                    && (a != 0.0 || b != 0.0 || a.is_sign_negative() != b.is_sign_negative())
                {
                    -0.0
                } else {
                    direct32(r, o, m.rnd)
                }
            }
        }
        FBin::Mul => {
            let r = a * b;
            if m.rnd == RN || !(r.is_finite() || a.is_finite() && b.is_finite()) {
                r
            } else if r.is_infinite() {
                direct32(r, overflow_ord(r as f64), m.rnd)
            } else {
                direct32(r, sign_ord(a as f64 * b as f64 - r as f64), m.rnd)
            }
        }
        FBin::Div => {
            let r = a / b;
            if m.rnd == RN || !a.is_finite() || !b.is_finite() || b == 0.0 {
                r
            } else if r.is_infinite() {
                direct32(r, overflow_ord(r as f64), m.rnd)
            } else {
                let rem = a as f64 - r as f64 * b as f64;
                let o = if b > 0.0 { sign_ord(rem) } else { sign_ord(rem).reverse() };
                direct32(r, o, m.rnd)
            }
        }
    };
    if m.ftz {
        r = ftz32(r);
    }
    if m.sat {
        r = sat32(r);
    }
    r.to_bits() as u64
}

pub(crate) fn fbin64(k: FBin, m: FMode, a: u64, b: u64) -> u64 {
    let (mut a, mut b) = (f64::from_bits(a), f64::from_bits(b));
    if m.ftz {
        a = ftz64(a);
        b = ftz64(b);
    }
    let mut r = match k {
        FBin::Min => minmax64(a, b, false),
        FBin::Max => minmax64(a, b, true),
        FBin::Add | FBin::Sub => {
            let b = if k == FBin::Sub { -b } else { b };
            let r = a + b;
            if m.rnd == RN {
                r
            } else if r.is_infinite() && a.is_finite() && b.is_finite() {
                direct64(r, overflow_ord(r), m.rnd)
            } else {
                let bb = r - a;
                let e = (a - (r - bb)) + (b - bb);
                direct64(r, sign_ord(e), m.rnd)
            }
        }
        FBin::Mul => {
            let r = a * b;
            if m.rnd == RN || !(a.is_finite() && b.is_finite()) {
                r
            } else if r.is_infinite() {
                direct64(r, overflow_ord(r), m.rnd)
            } else {
                direct64(r, sign_ord(a.mul_add(b, -r)), m.rnd)
            }
        }
        FBin::Div => {
            let r = a / b;
            if m.rnd == RN || !a.is_finite() || !b.is_finite() || b == 0.0 {
                r
            } else if r.is_infinite() {
                direct64(r, overflow_ord(r), m.rnd)
            } else {
                let rem = (-r).mul_add(b, a);
                let o = if b > 0.0 { sign_ord(rem) } else { sign_ord(rem).reverse() };
                direct64(r, o, m.rnd)
            }
        }
    };
    if m.ftz {
        r = ftz64(r);
    }
    if m.sat {
        r = sat64(r);
    }
    r.to_bits()
}

pub(crate) fn fma32(m: FMode, a: u64, b: u64, c: u64) -> u64 {
    let (mut a, mut b, mut c) = (f32::from_bits(a as u32), f32::from_bits(b as u32), f32::from_bits(c as u32));
    if m.ftz {
        a = ftz32(a);
        b = ftz32(b);
        c = ftz32(c);
    }
    let mut r = a.mul_add(b, c);
    if m.rnd != RN && r.is_finite() && a.is_finite() && b.is_finite() && c.is_finite() {
        // p is exact; s + e is the exact sum.
        let p = a as f64 * b as f64;
        let s = p + c as f64;
        let bb = s - p;
        let e = (p - (s - bb)) + (c as f64 - bb);
        let d = s - r as f64;
        let o = if d != 0.0 { sign_ord(d) } else { sign_ord(e) };
        r = direct32(r, o, m.rnd);
    } else if m.rnd != RN && r.is_infinite() && a.is_finite() && b.is_finite() && c.is_finite() {
        r = direct32(r, overflow_ord(r as f64), m.rnd);
    }
    if m.ftz {
        r = ftz32(r);
    }
    if m.sat {
        r = sat32(r);
    }
    r.to_bits() as u64
}

pub(crate) fn fma64(m: FMode, a: u64, b: u64, c: u64) -> u64 {
    let (a, b, c) = (f64::from_bits(a), f64::from_bits(b), f64::from_bits(c));
    let mut r = a.mul_add(b, c);
    if m.rnd != RN && a.is_finite() && b.is_finite() && c.is_finite() {
        if r.is_infinite() {
            r = direct64(r, overflow_ord(r), m.rnd);
        } else {
            // a·b = p + ep exactly (unless a·b underflows); the sign of p + ep + c − r is the
            // sign of the largest component of their exact expansion.
            let p = a * b;
            let ep = a.mul_add(b, -p);
            r = direct64(r, expansion_sign(&[p, ep, c, -r]), m.rnd);
        }
    }
    if m.sat {
        r = sat64(r);
    }
    r.to_bits()
}

pub(crate) fn fun32(k: FUn, m: FMode, approx: bool, a: u64) -> u64 {
    let mut a = f32::from_bits(a as u32);
    if m.ftz {
        a = ftz32(a);
    }
    let mut r = match k {
        FUn::Neg => -a,
        FUn::Abs => a.abs(),
        FUn::Rcp => {
            if approx {
                1.0 / a
            } else {
                f32::from_bits(fbin32(
                    FBin::Div,
                    FMode { ftz: false, sat: false, ..m },
                    1.0f32.to_bits() as u64,
                    a.to_bits() as u64,
                ) as u32)
            }
        }
        FUn::Sqrt => {
            let r = a.sqrt();
            if approx || m.rnd == RN || !r.is_finite() || r == 0.0 {
                r
            } else {
                let rem = a as f64 - r as f64 * r as f64;
                direct32(r, sign_ord(rem), m.rnd)
            }
        }
        FUn::Rsqrt => (1.0 / (a as f64).sqrt()) as f32,
        FUn::Ex2 => a.exp2(),
        FUn::Lg2 => a.log2(),
        FUn::Sin => a.sin(),
        FUn::Cos => a.cos(),
        FUn::Tanh => a.tanh(),
    };
    if m.ftz {
        r = ftz32(r);
    }
    if m.sat {
        r = sat32(r);
    }
    r.to_bits() as u64
}

pub(crate) fn fun64(k: FUn, m: FMode, approx: bool, a: u64) -> u64 {
    let mut a = f64::from_bits(a);
    if m.ftz {
        a = ftz64(a);
    }
    let mut r = match k {
        FUn::Neg => -a,
        FUn::Abs => a.abs(),
        FUn::Rcp => {
            if approx {
                1.0 / a
            } else {
                f64::from_bits(fbin64(FBin::Div, FMode { ftz: false, sat: false, ..m }, 1.0f64.to_bits(), a.to_bits()))
            }
        }
        FUn::Sqrt => {
            let r = a.sqrt();
            if approx || m.rnd == RN || !r.is_finite() || r == 0.0 {
                r
            } else {
                direct64(r, sign_ord((-r).mul_add(r, a)), m.rnd)
            }
        }
        FUn::Rsqrt => 1.0 / a.sqrt(),
        FUn::Ex2 => a.exp2(),
        FUn::Lg2 => a.log2(),
        FUn::Sin => a.sin(),
        FUn::Cos => a.cos(),
        FUn::Tanh => a.tanh(),
    };
    if m.ftz {
        r = ftz64(r);
    }
    if m.sat {
        r = sat64(r);
    }
    r.to_bits()
}

/// Scalar types as `cvt` and friends see them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ty {
    U(u8),
    S(u8),
    B(u8),
    F16,
    BF16,
    F32,
    F64,
    Pred,
}

impl Ty {
    pub fn parse(s: &str) -> Option<Ty> {
        Some(match s {
            "u8" => Ty::U(8),
            "u16" => Ty::U(16),
            "u32" => Ty::U(32),
            "u64" => Ty::U(64),
            "s8" => Ty::S(8),
            "s16" => Ty::S(16),
            "s32" => Ty::S(32),
            "s64" => Ty::S(64),
            "b8" => Ty::B(8),
            "b16" => Ty::B(16),
            "b32" => Ty::B(32),
            "b64" => Ty::B(64),
            "f16" => Ty::F16,
            "bf16" => Ty::BF16,
            "f32" => Ty::F32,
            "f64" => Ty::F64,
            "pred" => Ty::Pred,
            _ => return None,
        })
    }
    pub fn bits(self) -> u32 {
        match self {
            Ty::U(b) | Ty::S(b) | Ty::B(b) => b as u32,
            Ty::F16 | Ty::BF16 => 16,
            Ty::F32 => 32,
            Ty::F64 => 64,
            Ty::Pred => 1,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, Ty::F16 | Ty::BF16 | Ty::F32 | Ty::F64)
    }
    pub fn is_signed(self) -> bool {
        matches!(self, Ty::S(_))
    }
}

#[inline]
pub(crate) fn mask(bits: u32) -> u64 {
    if bits >= 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    }
}

#[inline]
pub(crate) fn sext(x: u64, bits: u32) -> i64 {
    if bits >= 64 {
        x as i64
    } else {
        let s = 64 - bits;
        ((x << s) as i64) >> s
    }
}

fn int_value(t: Ty, x: u64) -> i128 {
    let b = t.bits();
    if t.is_signed() {
        sext(x, b) as i128
    } else {
        (x & mask(b)) as i128
    }
}

fn int_range(t: Ty) -> (i128, i128) {
    let b = t.bits();
    if t.is_signed() {
        (-(1i128 << (b - 1)), (1i128 << (b - 1)) - 1)
    } else {
        (0, (1i128 << b) - 1)
    }
}

/// Float value of a float-typed register, widened to f64 (exact).
fn float_value(t: Ty, x: u64, ftz: bool) -> f64 {
    match t {
        Ty::F16 => half::f16::from_bits(x as u16).to_f64(),
        Ty::BF16 => half::bf16::from_bits(x as u16).to_f64(),
        Ty::F32 => {
            let f = f32::from_bits(x as u32);
            (if ftz { ftz32(f) } else { f }) as f64
        }
        _ => {
            let f = f64::from_bits(x);
            if ftz {
                ftz64(f)
            } else {
                f
            }
        }
    }
}

fn round_int(v: f64, rnd: u8) -> f64 {
    match rnd {
        RZ => v.trunc(),
        RM => v.floor(),
        RP => v.ceil(),
        _ => v.round_ties_even(),
    }
}

fn next16(bits: u16, up: bool, bf: bool) -> u16 {
    let (exp_mask, _) = if bf { (0x7f80u16, 0) } else { (0x7c00u16, 0) };
    let _ = exp_mask;
    let neg = bits & 0x8000 != 0;
    let mag = bits & 0x7fff;
    if mag == 0 {
        return if up { 0x0001 } else { 0x8001 };
    }
    if up != neg {
        bits + 1
    } else {
        bits - 1
    }
}

/// `v` rounded to f32 with round-to-odd: `v` itself when representable, else its truncation toward
/// zero with the last bit set. Rounding that to nearest in a format with at most 22 significant
/// bits (f16, bf16) gives the same result as rounding `v` directly.
fn f32_round_to_odd(v: f64) -> f32 {
    let r = v as f32;
    if v.is_nan() || r as f64 == v {
        return r;
    }
    let mut b = r.to_bits();
    if (r as f64).abs() > v.abs() {
        b -= 1; // one step toward zero (from infinity: to the largest finite f32)
    }
    f32::from_bits(b | 1)
}

/// Rounds exact `v` (an f64) to f16/bf16/f32 with mode `rnd`.
fn narrow(v: f64, to: Ty, rnd: u8) -> u64 {
    match to {
        Ty::F32 => {
            let r = v as f32;
            if rnd == RN || v.is_nan() || v.is_infinite() {
                return r.to_bits() as u64;
            }
            direct32(r, v.partial_cmp(&(r as f64)).unwrap_or(Ordering::Equal), rnd).to_bits() as u64
        }
        Ty::F16 | Ty::BF16 => {
            let bf = to == Ty::BF16;
            // Through f32 with round-to-odd: `half`'s direct f64 conversions drop the low 32 bits
            // of the f64 when rounding (1 + 2^-8 + 2^-23 would round to bf16 1.0, not 1 + 2^-7).
            let v32 = f32_round_to_odd(v);
            let (bits, back) = if bf {
                let h = half::bf16::from_f32(v32);
                (h.to_bits(), h.to_f64())
            } else {
                let h = half::f16::from_f32(v32);
                (h.to_bits(), h.to_f64())
            };
            if rnd == RN || v.is_nan() || v.is_infinite() {
                return bits as u64;
            }
            let o = v.partial_cmp(&back).unwrap_or(Ordering::Equal);
            let step_up = match (o, rnd) {
                (Ordering::Greater, RP) => Some(true),
                (Ordering::Greater, RZ) if back < 0.0 => Some(true),
                (Ordering::Less, RM) => Some(false),
                (Ordering::Less, RZ) if back > 0.0 => Some(false),
                _ => None,
            };
            match step_up {
                Some(up) => next16(bits, up, bf) as u64,
                None => bits as u64,
            }
        }
        _ => v.to_bits(),
    }
}

/// `cvt.rn.bf16.f32` (no `.ftz`, `.sat`): the bits [`cvt`] gives, without its dispatch. `cvt`
/// rounds the f32 through f64 and f32 round-to-odd, which is the f32 itself (a NaN can only
/// be quieted, and `bf16::from_f32` sets the quiet bit of a NaN anyway).
#[inline(always)]
pub(crate) fn cvt_rn_bf16_f32(x: u64) -> u64 {
    half::bf16::from_f32(f32::from_bits(x as u32)).to_bits() as u64
}

/// [`cvt_rn_bf16_f32`] without branches, so that a loop over lanes vectorises: a NaN keeps its
/// sign and top mantissa bits and becomes quiet; any other value rounds to nearest, ties to
/// even, by adding `0x7fff` plus the kept part's lowest bit below the cut (a carry rounds up,
/// into the exponent too, up to infinity).
#[inline(always)]
pub(crate) fn bf16_rn_bits(x: u32) -> u32 {
    let rounded = x.wrapping_add(0x7fff + (x >> 16 & 1)) >> 16;
    if x & 0x7fff_ffff > 0x7f80_0000 {
        x >> 16 | 0x40
    } else {
        rounded
    }
}

/// `cvt.<rnd>.<sat>.<ftz>.to.from d, a`.
pub(crate) fn cvt(to: Ty, from: Ty, m: FMode, x: u64) -> u64 {
    let tb = to.bits();
    if !from.is_float() && !to.is_float() {
        let v = int_value(from, x);
        let v = if m.sat {
            let (lo, hi) = int_range(to);
            v.clamp(lo, hi)
        } else {
            v
        };
        return (v as u64) & mask(tb);
    }
    if from.is_float() && !to.is_float() {
        let v = float_value(from, x, m.ftz);
        if v.is_nan() {
            return 0;
        }
        let r = round_int(v, m.rnd);
        let (lo, hi) = int_range(to);
        let i = if r <= lo as f64 {
            lo
        } else if r >= hi as f64 {
            hi
        } else {
            r as i128
        };
        return (i as u64) & mask(tb);
    }
    if !from.is_float() {
        // int -> float
        let v = int_value(from, x);
        let r = match to {
            Ty::F64 => {
                let r = v as f64;
                let o = v.cmp(&(r as i128));
                direct64(r, o, m.rnd).to_bits()
            }
            Ty::F32 => {
                let r = v as f32;
                let o = if r.is_finite() { v.cmp(&(r as i128)) } else { Ordering::Less };
                direct32(r, o, m.rnd).to_bits() as u64
            }
            _ => narrow(v as f64, to, m.rnd),
        };
        return finish_float(to, r, m);
    }
    // float -> float
    let v = float_value(from, x, m.ftz);
    let r = if m.int_round {
        let r = if v.is_finite() { round_int(v, m.rnd) } else { v };
        match to {
            Ty::F64 => r.to_bits(),
            _ => narrow(r, to, RN),
        }
    } else if to == Ty::F64 {
        v.to_bits()
    } else if from == Ty::F64 || from == Ty::F32 && to != Ty::F32 {
        narrow(v, to, m.rnd)
    } else {
        // widening (exact) or same type
        match to {
            Ty::F32 => (v as f32).to_bits() as u64,
            _ => narrow(v, to, RN),
        }
    };
    finish_float(to, r, m)
}

fn finish_float(to: Ty, r: u64, m: FMode) -> u64 {
    match to {
        Ty::F32 => {
            let mut f = f32::from_bits(r as u32);
            if m.ftz {
                f = ftz32(f);
            }
            if m.sat {
                f = sat32(f);
            }
            f.to_bits() as u64
        }
        Ty::F64 => {
            let mut f = f64::from_bits(r);
            if m.sat {
                f = sat64(f);
            }
            f.to_bits()
        }
        Ty::F16 if m.sat => half::f16::from_f64(sat64(half::f16::from_bits(r as u16).to_f64())).to_bits() as u64,
        Ty::BF16 if m.sat => half::bf16::from_f64(sat64(half::bf16::from_bits(r as u16).to_f64())).to_bits() as u64,
        _ => r,
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    /// The `cvt.rn.bf16.f32` fast path gives [`cvt`]'s bits on random f32s, halfway cases,
    /// subnormals, infinities, and signalling and quiet NaNs.
    pub fn cvt_rn_bf16_f32_matches_cvt() {
        let m = FMode { rnd: RN, ftz: false, sat: false, int_round: false };
        let special = [
            0u32,
            0x8000_0000,
            1,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0x7FC0_0001,
            0xFFBF_FFFF,
            0x3F80_8000,
            0x3F81_8000,
            0x7F7F_FFFF,
            0x0000_8000,
            0x0001_8000,
        ];
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for i in 0..200_000usize {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = match special.get(i) {
                Some(&s) => s,
                // Every fourth value halfway between two bf16s.
                None if i % 4 == 0 => (x as u32) & 0xFFFF_0000 | 0x8000,
                None => x as u32,
            };
            assert_eq!(cvt_rn_bf16_f32(v as u64), cvt(Ty::BF16, Ty::F32, m, v as u64), "{v:#x}");
            assert_eq!(
                crate::ops::cvt_x2::<true, false>(v as u64, x >> 32),
                cvt(Ty::BF16, Ty::F32, m, v as u64) << 16 | cvt(Ty::BF16, Ty::F32, m, x >> 32),
                "{v:#x} {:#x}",
                x >> 32
            );
        }
    }
}
