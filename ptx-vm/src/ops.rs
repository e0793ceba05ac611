//! Per-lane scalar functions the decoder selects as function pointers (integer, bit, f32 fast
//! paths). `B` is the operand width in bits; results are zero-extended to 64 bits.

use crate::num::{self, mask, sext, FMode, Ty};

#[inline(always)]
fn m<const B: u32>(x: u64) -> u64 {
    x & mask(B)
}
#[inline(always)]
fn s<const B: u32>(x: u64) -> i64 {
    sext(x, B)
}

pub(crate) fn add<const B: u32>(a: u64, b: u64) -> u64 {
    m::<B>(a.wrapping_add(b))
}
pub(crate) fn sub<const B: u32>(a: u64, b: u64) -> u64 {
    m::<B>(a.wrapping_sub(b))
}
pub(crate) fn mul<const B: u32>(a: u64, b: u64) -> u64 {
    m::<B>(a.wrapping_mul(b))
}
pub(crate) fn mulhi_u<const B: u32>(a: u64, b: u64) -> u64 {
    let p = (m::<B>(a) as u128) * (m::<B>(b) as u128);
    m::<B>((p >> B) as u64)
}
pub(crate) fn mulhi_s<const B: u32>(a: u64, b: u64) -> u64 {
    let p = (s::<B>(a) as i128) * (s::<B>(b) as i128);
    m::<B>((p >> B) as u64)
}
pub(crate) fn mulwide_u<const B: u32>(a: u64, b: u64) -> u64 {
    m::<B>(a).wrapping_mul(m::<B>(b)) & mask(2 * B)
}
pub(crate) fn mulwide_s<const B: u32>(a: u64, b: u64) -> u64 {
    (s::<B>(a).wrapping_mul(s::<B>(b)) as u64) & mask(2 * B)
}
pub(crate) fn mad<const B: u32>(a: u64, b: u64, c: u64) -> u64 {
    m::<B>(a.wrapping_mul(b).wrapping_add(c))
}
pub(crate) fn madhi_u<const B: u32>(a: u64, b: u64, c: u64) -> u64 {
    m::<B>(mulhi_u::<B>(a, b).wrapping_add(c))
}
pub(crate) fn madhi_s<const B: u32>(a: u64, b: u64, c: u64) -> u64 {
    m::<B>(mulhi_s::<B>(a, b).wrapping_add(c))
}
pub(crate) fn madhi_sat_s32(a: u64, b: u64, c: u64) -> u64 {
    let v = s::<32>(mulhi_s::<32>(a, b)) + s::<32>(c);
    m::<32>(v.clamp(i32::MIN as i64, i32::MAX as i64) as u64)
}
pub(crate) fn madwide_u<const B: u32>(a: u64, b: u64, c: u64) -> u64 {
    mulwide_u::<B>(a, b).wrapping_add(c) & mask(2 * B)
}
pub(crate) fn madwide_s<const B: u32>(a: u64, b: u64, c: u64) -> u64 {
    mulwide_s::<B>(a, b).wrapping_add(c) & mask(2 * B)
}
pub(crate) fn sad_u<const B: u32>(a: u64, b: u64, c: u64) -> u64 {
    let (a, b) = (m::<B>(a), m::<B>(b));
    m::<B>(a.abs_diff(b).wrapping_add(c))
}
pub(crate) fn sad_s<const B: u32>(a: u64, b: u64, c: u64) -> u64 {
    m::<B>(s::<B>(a).abs_diff(s::<B>(b)).wrapping_add(c))
}
pub(crate) fn add_sat_s32(a: u64, b: u64) -> u64 {
    m::<32>((a as u32 as i32).saturating_add(b as u32 as i32) as u32 as u64)
}
pub(crate) fn sub_sat_s32(a: u64, b: u64) -> u64 {
    m::<32>((a as u32 as i32).saturating_sub(b as u32 as i32) as u32 as u64)
}
/// Unsigned division; division by zero gives all ones (as the hardware does).
pub(crate) fn div_u<const B: u32>(a: u64, b: u64) -> u64 {
    let (a, b) = (m::<B>(a), m::<B>(b));
    a.checked_div(b).unwrap_or(mask(B))
}
/// Signed division; `MIN / -1` wraps to `MIN`, division by zero gives -1.
pub(crate) fn div_s<const B: u32>(a: u64, b: u64) -> u64 {
    let (a, b) = (s::<B>(a), s::<B>(b));
    if b == 0 {
        mask(B)
    } else {
        m::<B>(a.wrapping_div(b) as u64)
    }
}
/// Unsigned remainder; `x % 0 = x`.
pub(crate) fn rem_u<const B: u32>(a: u64, b: u64) -> u64 {
    let (a, b) = (m::<B>(a), m::<B>(b));
    if b == 0 {
        a
    } else {
        a % b
    }
}
/// Signed remainder (sign of the dividend); `MIN % -1 = 0`, `x % 0 = x`.
pub(crate) fn rem_s<const B: u32>(a: u64, b: u64) -> u64 {
    let (sa, sb) = (s::<B>(a), s::<B>(b));
    if sb == 0 {
        m::<B>(a)
    } else {
        m::<B>(sa.wrapping_rem(sb) as u64)
    }
}
pub(crate) fn min_u<const B: u32>(a: u64, b: u64) -> u64 {
    m::<B>(a).min(m::<B>(b))
}
pub(crate) fn max_u<const B: u32>(a: u64, b: u64) -> u64 {
    m::<B>(a).max(m::<B>(b))
}
pub(crate) fn min_s<const B: u32>(a: u64, b: u64) -> u64 {
    m::<B>(s::<B>(a).min(s::<B>(b)) as u64)
}
pub(crate) fn max_s<const B: u32>(a: u64, b: u64) -> u64 {
    m::<B>(s::<B>(a).max(s::<B>(b)) as u64)
}
pub(crate) fn and(a: u64, b: u64) -> u64 {
    a & b
}
pub(crate) fn or(a: u64, b: u64) -> u64 {
    a | b
}
pub(crate) fn xor(a: u64, b: u64) -> u64 {
    a ^ b
}
pub(crate) fn pnot(a: u64) -> u64 {
    (a & 1) ^ 1
}
/// Shift amounts at or above the width clamp: the result is 0.
pub(crate) fn shl<const B: u32>(a: u64, b: u64) -> u64 {
    let n = b as u32;
    if n >= B {
        0
    } else {
        m::<B>(a << n)
    }
}
pub(crate) fn shr_u<const B: u32>(a: u64, b: u64) -> u64 {
    let n = b as u32;
    if n >= B {
        0
    } else {
        m::<B>(a) >> n
    }
}
/// Arithmetic shift; amounts at or above the width fill with the sign bit.
pub(crate) fn shr_s<const B: u32>(a: u64, b: u64) -> u64 {
    let n = (b as u32).min(B - 1);
    m::<B>((s::<B>(a) >> n) as u64)
}
pub(crate) fn abs<const B: u32>(a: u64) -> u64 {
    m::<B>(s::<B>(a).wrapping_abs() as u64)
}
pub(crate) fn neg<const B: u32>(a: u64) -> u64 {
    m::<B>(a.wrapping_neg())
}
pub(crate) fn not<const B: u32>(a: u64) -> u64 {
    m::<B>(!a)
}
pub(crate) fn cnot(a: u64) -> u64 {
    (a == 0) as u64
}
pub(crate) fn popc<const B: u32>(a: u64) -> u64 {
    m::<B>(a).count_ones() as u64
}
pub(crate) fn clz<const B: u32>(a: u64) -> u64 {
    (m::<B>(a).leading_zeros() - (64 - B)) as u64
}
pub(crate) fn brev<const B: u32>(a: u64) -> u64 {
    a.reverse_bits() >> (64 - B)
}
/// Bit field extract: `len` bits from `pos` (each clamped to 0..=255 as the ISA specifies).
pub(crate) fn bfe_u<const B: u32>(a: u64, pos: u64, len: u64) -> u64 {
    let (pos, len) = ((pos & 0xff) as u32, (len & 0xff) as u32);
    if len == 0 || pos >= B {
        return 0;
    }
    let len = len.min(B - pos);
    (m::<B>(a) >> pos) & mask(len)
}
pub(crate) fn bfe_s<const B: u32>(a: u64, pos: u64, len: u64) -> u64 {
    let (pos, len) = ((pos & 0xff) as u32, (len & 0xff) as u32);
    let sbit = if len == 0 { 0 } else { (pos + len - 1).min(B - 1) };
    let sign = if len == 0 { false } else { (a >> sbit) & 1 == 1 };
    let mut r = 0u64;
    for i in 0..B {
        let bit = if i < len && pos + i < B { (a >> (pos + i)) & 1 == 1 } else { sign };
        if bit {
            r |= 1 << i;
        }
    }
    r
}
/// Bit field insert: `len` low bits of `a` into `b` at `pos`.
pub(crate) fn bfi<const B: u32>(a: u64, b: u64, pos: u64, len: u64) -> u64 {
    let (pos, len) = ((pos & 0xff) as u32, (len & 0xff) as u32);
    if len == 0 || pos >= B {
        return m::<B>(b);
    }
    let len = len.min(B - pos);
    let fm = mask(len) << pos;
    m::<B>((b & !fm) | ((a << pos) & fm))
}
/// `prmt.b32` byte permute; MODE 0 is the generic form, 1..=6 are f4e b4e rc8 ecl ecr rc16.
pub(crate) fn prmt<const MODE: u8>(a: u64, b: u64, c: u64) -> u64 {
    let x = ((b as u32 as u64) << 32) | (a as u32 as u64);
    let byte = |i: u64| ((x >> (8 * (i & 7))) & 0xff) as u32;
    let c = c as u32;
    let mut r = 0u32;
    if MODE == 0 {
        for k in 0..4 {
            let sel = (c >> (4 * k)) & 0xf;
            let mut v = byte(sel as u64 & 7);
            if sel & 8 != 0 {
                v = if v & 0x80 != 0 { 0xff } else { 0 };
            }
            r |= v << (8 * k);
        }
        return r as u64;
    }
    let n = (c & 3) as u64;
    let sel: [u64; 4] = match MODE {
        1 => [n, n + 1, n + 2, n + 3],
        2 => [n, n.wrapping_sub(1) & 7, n.wrapping_sub(2) & 7, n.wrapping_sub(3) & 7],
        3 => [n, n, n, n],
        4 => [0u64, 1, 2, 3].map(|k| k.max(n)),
        5 => [0u64, 1, 2, 3].map(|k| k.min(n)),
        _ => {
            let h = (c & 1) as u64 * 2;
            [h, h + 1, h, h + 1]
        }
    };
    for (k, s) in sel.iter().enumerate() {
        r |= byte(*s) << (8 * k);
    }
    r as u64
}
pub(crate) fn fsub32(a: u64, b: u64) -> u64 {
    (f32::from_bits(a as u32) - f32::from_bits(b as u32)).to_bits() as u64
}
pub(crate) fn copysign32(a: u64, b: u64) -> u64 {
    // copysign.f32 d, a, b: magnitude of b, sign of a.
    f32::from_bits(b as u32).copysign(f32::from_bits(a as u32)).to_bits() as u64
}
pub(crate) fn copysign64(a: u64, b: u64) -> u64 {
    f64::from_bits(b).copysign(f64::from_bits(a)).to_bits()
}

/// `cvt.rn.f16x2.{e4m3x2,e5m2x2} d, a` (sm_89+): the two FP8 values of `a`'s 16 bits, byte 0 to
/// bits 0..16 and byte 1 to bits 16..32, each exactly (every finite e4m3 and e5m2 value is an
/// f16). A NaN code gives the canonical NaN `0x7fff`; e5m2's infinities stay infinities.
pub(crate) fn cvt_f16x2_fp8x2<const E4M3: bool>(a: u64) -> u64 {
    let one = |b: u64| -> u64 {
        let b = b & 0xff;
        if !E4M3 {
            // e5m2 is an f16's top byte (same exponent bias, 15).
            return if b & 0x7f > 0x7c { 0x7fff } else { b << 8 };
        }
        let sign = (b & 0x80) << 8;
        let (e, m) = ((b >> 3) & 0xf, b & 7);
        if e == 0xf && m == 7 {
            return 0x7fff;
        }
        if e == 0 {
            if m == 0 {
                return sign;
            }
            // m · 2^-9: normalise into an f16 (exponent -7 - k for the k leading zeros of m's 3 bits).
            let k = m.leading_zeros() as u64 - 61; // m in 1..=7: 2, 1 or 0
            let (e16, m16) = (15 - 7 - k, ((m << (k + 1)) & 7) << 7);
            return sign | e16 << 10 | m16;
        }
        sign | (e + 8) << 10 | m << 7
    };
    one(a) | one(a >> 8) << 16
}

/// `cvt.{rn,rz}.{bf16x2,f16x2}.f32 d, a, b`: `a` rounded to bits 16..32, `b` to bits 0..16.
pub(crate) fn cvt_x2<const BF: bool, const RZ: bool>(a: u64, b: u64) -> u64 {
    if BF && !RZ {
        return (num::cvt_rn_bf16_f32(a) & 0xffff) << 16 | (num::cvt_rn_bf16_f32(b) & 0xffff);
    }
    let to = if BF { Ty::BF16 } else { Ty::F16 };
    let m = FMode { rnd: if RZ { num::RZ } else { num::RN }, ftz: false, sat: false, int_round: false };
    let hi = num::cvt(to, Ty::F32, m, a & 0xffff_ffff);
    let lo = num::cvt(to, Ty::F32, m, b & 0xffff_ffff);
    (hi & 0xffff) << 16 | (lo & 0xffff)
}
