//! The two OCP 8-bit floating-point formats of an FP8 KV cache, one byte per element: decode to
//! f32 (exact) and encode from f32 (round to nearest, ties to even, saturating), pure integer and
//! f32 arithmetic shared by the kernels and the host.
//!
//! | format | exponent bits, bias | mantissa bits | max finite | infinities | NaN codes |
//! |---|---|---|---|---|---|
//! | [`Fp8Format::E4m3`] (`float8_e4m3fn`) | 4, 7 | 3 | 448 | none | `0x7f`, `0xff` |
//! | [`Fp8Format::E5m2`] (`float8_e5m2`) | 5, 15 | 2 | 57344 | `0x7c`, `0xfc` | `0x7d..=0x7f`, `0xfd..=0xff` |
//!
//! Decode: the 7 magnitude bits are moved to the top of an f32's exponent and mantissa fields
//! (`(byte & 0x7f) << (23 - M)`), which reads as the same value times `2^(B - 127)`, subnormals
//! included (an fp8 subnormal lands on an f32 subnormal); one multiply by `2^(127 - B)`, exact as
//! a power of two, restores it. The sign bit moves to bit 31. NaN and infinity codes are checked
//! separately ([`decode`]).
//!
//! Encode (a cache append, `stored = encode(value / scale)`, vLLM's semantics): NaN gives the
//! positive NaN code with the sign of the input; a magnitude at or above the largest finite value
//! (infinity included) saturates to it with its sign; anything else is rounded to the nearest
//! representable value, ties to even. Normal results round the f32 bit pattern (the carry out of
//! the mantissa raises the exponent, as it must), subnormal ones round `|x| / 2^(1 - B - M)` to
//! an integer with the `2^23` trick (f32 addition rounds to nearest even).

/// One of the two FP8 formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// `float8_e4m3fn`: bias 7, 3 mantissa bits, no infinities, max 448.
    E4m3,
    /// `float8_e5m2`: bias 15, 2 mantissa bits, IEEE-like (infinities, NaNs), max 57344.
    E5m2,
}

impl Fp8Format {
    /// Mantissa bits.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4m3 => 3,
            Fp8Format::E5m2 => 2,
        }
    }
    /// Exponent bias.
    pub const fn bias(self) -> i32 {
        match self {
            Fp8Format::E4m3 => 7,
            Fp8Format::E5m2 => 15,
        }
    }
    /// Code of the largest finite value (positive).
    pub const fn max_code(self) -> u8 {
        match self {
            Fp8Format::E4m3 => 0x7e,
            Fp8Format::E5m2 => 0x7b,
        }
    }
    /// The largest finite value: 448 or 57344.
    pub const fn max_finite(self) -> f32 {
        match self {
            Fp8Format::E4m3 => 448.0,
            Fp8Format::E5m2 => 57344.0,
        }
    }
    /// The positive NaN code encode writes (`0x7f` for both).
    pub const fn nan_code(self) -> u8 {
        0x7f
    }
    /// `2^(127 - bias)`: the factor that turns the shifted magnitude bits into the value.
    pub const fn rebias(self) -> f32 {
        f32::from_bits(((254 - self.bias()) as u32) << 23)
    }
    /// Unit roundoff of round-to-nearest, `2^-(M + 1)`: `2^-4` for e4m3, `2^-3` for e5m2.
    pub const fn unit_roundoff(self) -> f32 {
        f32::from_bits(((127 - self.mantissa_bits() as i32 - 1) as u32) << 23)
    }
    /// The format's name on the command line and in reports: `fp8` (e4m3) or `fp8_e5m2`.
    pub const fn name(self) -> &'static str {
        match self {
            Fp8Format::E4m3 => "fp8",
            Fp8Format::E5m2 => "fp8_e5m2",
        }
    }
}

/// The byte's value without its NaN/infinity check: `sign * magnitude`, exact for every finite
/// code (subnormals included). The kernels dequantise with this after they load a byte.
#[inline(always)]
pub fn decode_finite(f: Fp8Format, byte: u32) -> f32 {
    let bits = ((byte & 0x7f) << (23 - f.mantissa_bits())) | ((byte & 0x80) << 24);
    f32::from_bits(bits) * f.rebias()
}

/// The value of a code: exact, with e4m3's `0x7f`/`0xff` NaN and e5m2's infinities and NaNs.
#[inline(always)]
pub fn decode(f: Fp8Format, byte: u8) -> f32 {
    let mag = byte & 0x7f;
    match f {
        Fp8Format::E4m3 if mag == 0x7f => f32::NAN,
        Fp8Format::E5m2 if mag == 0x7c => {
            if byte & 0x80 != 0 {
                f32::NEG_INFINITY
            } else {
                f32::INFINITY
            }
        }
        Fp8Format::E5m2 if mag > 0x7c => f32::NAN,
        _ => decode_finite(f, byte as u32),
    }
}

/// `x` as the nearest code, ties to even, saturating to the largest finite magnitude (infinity
/// included); NaN gives the NaN code.
#[inline(always)]
pub fn encode(f: Fp8Format, x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = f32::from_bits(bits & 0x7fff_ffff);
    if abs.is_nan() {
        return sign | f.nan_code();
    }
    if abs >= f.max_finite() {
        return sign | f.max_code();
    }
    let m = f.mantissa_bits();
    let bias = f.bias();
    // The smallest normal fp8 value, 2^(1 - B).
    let min_normal = f32::from_bits(((128 - bias) as u32) << 23);
    let code = if abs < min_normal {
        // A multiple of the subnormal step 2^(1 - B - M): scale (exact) and round to an integer
        // below 2^(M + 1) (nearest even, by f32 addition of 2^23). `2^M` is the smallest normal.
        let steps = abs * f32::from_bits(((127 + bias - 1 + m as i32) as u32) << 23);
        let r = (steps + 8_388_608.0) - 8_388_608.0;
        r as u32
    } else {
        let shift = 23 - m;
        let a = abs.to_bits();
        let rounded = a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1);
        let c = (rounded >> shift) - (((127 - bias) as u32) << m);
        if c > f.max_code() as u32 {
            f.max_code() as u32
        } else {
            c
        }
    };
    sign | code as u8
}

/// Marker type of an e4m3 cache in the variant table's decode rows (device code).
#[cfg(target_arch = "nvptx64")]
pub struct Fp8E4m3;
/// Marker type of an e5m2 cache in the variant table's decode rows (device code).
#[cfg(target_arch = "nvptx64")]
pub struct Fp8E5m2;

/// The format a marker type stands for.
#[cfg(target_arch = "nvptx64")]
pub(crate) trait Fp8Kind {
    const FORMAT: Fp8Format;
}
#[cfg(target_arch = "nvptx64")]
impl Fp8Kind for Fp8E4m3 {
    const FORMAT: Fp8Format = Fp8Format::E4m3;
}
#[cfg(target_arch = "nvptx64")]
impl Fp8Kind for Fp8E5m2 {
    const FORMAT: Fp8Format = Fp8Format::E5m2;
}

#[cfg(all(feature = "unit-tests", not(target_arch = "nvptx64")))]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    /// The value of a code from the format's definition, in f64, written without bit tricks.
    fn value_f64(f: Fp8Format, byte: u8) -> f64 {
        let (ebits, m) = match f {
            Fp8Format::E4m3 => (4u32, 3u32),
            Fp8Format::E5m2 => (5, 2),
        };
        let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((byte >> m) & ((1 << ebits) - 1) as u8) as i32;
        let mant = (byte & ((1 << m) - 1) as u8) as f64;
        let bias = (1 << (ebits - 1)) - 1;
        let all_ones = (1 << ebits) - 1;
        match f {
            Fp8Format::E4m3 if e == all_ones && mant == 7.0 => return f64::NAN,
            Fp8Format::E5m2 if e == all_ones => return if mant == 0.0 { sign * f64::INFINITY } else { f64::NAN },
            _ => {}
        }
        let frac = mant / (1 << m) as f64;
        if e == 0 {
            sign * frac * 2f64.powi(1 - bias)
        } else {
            sign * (1.0 + frac) * 2f64.powi(e - bias)
        }
    }

    /// Nearest finite code to `x` by search over every code (ties: the even code), saturating.
    fn encode_f64(f: Fp8Format, x: f64) -> u8 {
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        if x.is_nan() {
            return sign | 0x7f;
        }
        let a = x.abs();
        let mut best = 0u8;
        let mut best_d = f64::INFINITY;
        for c in 0..=f.max_code() {
            let d = (value_f64(f, c) - a).abs();
            if d < best_d || (d == best_d && c % 2 == 0) {
                best = c;
                best_d = d;
            }
        }
        sign | best
    }

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4m3, Fp8Format::E5m2];

    pub fn decode_matches_the_definition_for_all_256_codes() {
        for f in FORMATS {
            let mut finite = 0;
            for b in 0..=255u8 {
                let want = value_f64(f, b);
                let got = decode(f, b) as f64;
                if want.is_nan() {
                    assert!(got.is_nan(), "{f:?} {b:#04x}: {got}");
                } else {
                    assert_eq!(got.to_bits(), want.to_bits(), "{f:?} {b:#04x}: {got} vs {want}");
                    if want.is_finite() {
                        assert_eq!(decode_finite(f, b as u32) as f64, want, "{f:?} {b:#04x}");
                        finite += 1;
                    }
                }
                // Every finite code survives encode(decode(c)) (-0 included).
                if want.is_finite() {
                    assert_eq!(encode(f, want as f32), b, "{f:?} {b:#04x}");
                }
            }
            assert_eq!(finite, if f == Fp8Format::E4m3 { 254 } else { 248 }, "{f:?}");
        }
        // Known answers: max, min normal, smallest subnormal.
        assert_eq!(decode(Fp8Format::E4m3, 0x7e), 448.0);
        assert_eq!(decode(Fp8Format::E4m3, 0x08), 2f32.powi(-6));
        assert_eq!(decode(Fp8Format::E4m3, 0x01), 2f32.powi(-9));
        assert_eq!(decode(Fp8Format::E4m3, 0xfe), -448.0);
        assert_eq!(decode(Fp8Format::E5m2, 0x7b), 57344.0);
        assert_eq!(decode(Fp8Format::E5m2, 0x01), 2f32.powi(-16));
        assert_eq!(decode(Fp8Format::E5m2, 0x7c), f32::INFINITY);
        assert_eq!(Fp8Format::E4m3.unit_roundoff(), 0.0625);
        assert_eq!(Fp8Format::E5m2.unit_roundoff(), 0.125);
    }

    pub fn encode_rounds_to_nearest_even_and_saturates() {
        for f in FORMATS {
            // Every midpoint between neighbouring finite codes (a tie), the points just beside
            // it, and values inside each interval, against the search-based rounding.
            for c in 0..f.max_code() {
                let (lo, hi) = (value_f64(f, c), value_f64(f, c + 1));
                let mid = (lo + hi) / 2.0;
                let want_tie = if c % 2 == 0 { c } else { c + 1 };
                assert_eq!(encode(f, mid as f32), want_tie, "{f:?} tie between {c:#04x} and {:#04x}", c + 1);
                assert_eq!(encode(f, -mid as f32), 0x80 | want_tie, "{f:?} -tie {c:#04x}");
                let below = f32::from_bits((mid as f32).to_bits() - 1);
                let above = f32::from_bits((mid as f32).to_bits() + 1);
                assert_eq!(encode(f, below), c, "{f:?} below tie {c:#04x}");
                assert_eq!(encode(f, above), c + 1, "{f:?} above tie {c:#04x}");
                for k in 1..8 {
                    let x = lo + (hi - lo) * k as f64 / 8.0;
                    assert_eq!(encode(f, x as f32), encode_f64(f, x as f32 as f64), "{f:?} {x}");
                }
            }
            // Saturation: beyond the largest finite value, halfway to the next power, infinity.
            let max = f.max_finite();
            for x in [max, max * 1.03, max * 1.0625, max * 1.2, 1e30, f32::MAX, f32::INFINITY] {
                assert_eq!(encode(f, x), f.max_code(), "{f:?} {x}");
                assert_eq!(encode(f, -x), 0x80 | f.max_code(), "{f:?} -{x}");
            }
            // Underflow: half the smallest subnormal is a tie to 0, just above it rounds up.
            let tiny = value_f64(f, 1);
            assert_eq!(encode(f, (tiny / 2.0) as f32), 0, "{f:?}");
            assert_eq!(encode(f, (tiny * 0.5000001) as f32), 1, "{f:?}");
            assert_eq!(encode(f, (tiny * 1.5) as f32), 2, "{f:?} 1.5 steps is a tie to even 2");
            assert_eq!(encode(f, 1e-30), 0, "{f:?}");
            assert_eq!(encode(f, -0.0), 0x80, "{f:?}");
            assert_eq!(encode(f, f32::NAN), 0x7f, "{f:?}");
            assert!(decode(f, encode(f, f32::NAN)).is_nan(), "{f:?}");
        }
        // Known answers: 464 is the e4m3 midpoint of 448 and 480 (480 is no value): saturates.
        assert_eq!(encode(Fp8Format::E4m3, 464.0), 0x7e);
        assert_eq!(encode(Fp8Format::E4m3, 1.0), 0x38);
        assert_eq!(encode(Fp8Format::E4m3, 1.0625), 0x38, "tie between 1 and 1.125 to even");
        assert_eq!(encode(Fp8Format::E4m3, 1.1875), 0x3a, "tie between 1.125 and 1.25 to even");
        assert_eq!(encode(Fp8Format::E5m2, 1.125), 0x3c, "tie between 1 and 1.25 to even");
        assert_eq!(encode(Fp8Format::E5m2, 61440.0), 0x7b, "midpoint past max saturates, never inf");
    }
}
