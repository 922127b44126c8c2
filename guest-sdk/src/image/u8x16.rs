//! Sixteen bytes, read as `u8`, `i16` or `i32` lanes: one `simd128` vector
//! in WebAssembly built with that feature, a plain array elsewhere (where
//! the same code runs, for the tests, and is not on any hot path).
//!
//! Only what [`super::bilinear`] needs: loads, byte gathers, widening,
//! pairwise multiply-adds and saturating narrows.

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
use core::arch::wasm32 as simd;

/// Sixteen bytes, operated on as the lanes each method names.
#[derive(Clone, Copy, Debug)]
pub(super) struct U8x16(Repr);

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
type Repr = simd::v128;
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
type Repr = [u8; 16];

/// Fixed-point weights are in units of `1 / ONE`: 14 bits, so a weight (at
/// most `ONE`) fits an `i16` lane and a pair's sum, at most `255·ONE`, an
/// `i32` one.
pub(super) const SHIFT: u32 = 14;
/// One in fixed point: `1 << SHIFT`.
pub(super) const ONE: i16 = 1 << SHIFT;

impl U8x16 {
    /// The sixteen bytes of `bytes` from `at`. Panics past the slice's end.
    #[inline(always)]
    pub(super) fn load(bytes: &[u8], at: usize) -> Self {
        let chunk: &[u8; 16] = bytes[at..at + 16].try_into().expect("16 bytes");
        Self::from_bytes(*chunk)
    }

    /// Writes the sixteen bytes to `out` from `at`. Panics past the slice's end.
    #[inline(always)]
    pub(super) fn store(self, out: &mut [u8], at: usize) {
        out[at..at + 16].copy_from_slice(&self.to_bytes());
    }

    /// Eight `i16` lanes.
    pub(super) fn from_i16(lanes: [i16; 8]) -> Self {
        let mut bytes = [0; 16];
        for (pair, lane) in bytes.chunks_exact_mut(2).zip(lanes) {
            pair.copy_from_slice(&lane.to_le_bytes());
        }
        Self::from_bytes(bytes)
    }

    /// The weighted sums of `self`'s eight byte pairs, rounded, as two
    /// vectors of four `i32` lanes: sum `i` (lane `i % 4` of vector `i / 4`)
    /// is `(b[2i]·w[2i] + b[2i+1]·w[2i+1] + ONE/2) >> SHIFT`, where `b` are
    /// `self`'s bytes and `w` the `i16` weights, `low`'s for pairs 0–3 and
    /// `high`'s for pairs 4–7. Weights are non-negative and each pair's sum
    /// is at most `ONE`, so every result is a byte's value.
    #[inline(always)]
    pub(super) fn weigh_pairs(self, low: Self, high: Self) -> [Self; 2] {
        [self.widen_low().dot_rounded(low), self.widen_high().dot_rounded(high)]
    }

    /// Sixteen `i32` lanes (four vectors, each a byte's value) as bytes.
    #[inline(always)]
    pub(super) fn narrow([a, b, c, d]: [Self; 4]) -> Self {
        Self::narrow_i16(Self::narrow_i32(a, b), Self::narrow_i32(c, d))
    }
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
impl U8x16 {
    /// The lanes `bytes`. (Two 64-bit halves: safe code, and LLVM makes
    /// one `v128.load` of them.)
    #[inline(always)]
    pub(super) fn from_bytes(bytes: [u8; 16]) -> Self {
        let (low, high) = bytes.split_at(8);
        let half = |h: &[u8]| u64::from_le_bytes(h.try_into().expect("8 bytes"));
        Self(simd::u64x2(half(low), half(high)))
    }

    /// The lanes as bytes.
    #[inline(always)]
    pub(super) fn to_bytes(self) -> [u8; 16] {
        let mut bytes = [0; 16];
        bytes[..8].copy_from_slice(&simd::u64x2_extract_lane::<0>(self.0).to_le_bytes());
        bytes[8..].copy_from_slice(&simd::u64x2_extract_lane::<1>(self.0).to_le_bytes());
        bytes
    }

    /// Byte `i` is `self`'s byte `index[i]`, or 0 where that is 16 or more.
    #[inline(always)]
    pub(super) fn gather(self, index: Self) -> Self {
        Self(simd::i8x16_swizzle(self.0, index.0))
    }

    /// Bytes 0–7 of `self` and `other`, alternating: `a0 b0 a1 b1 …`.
    #[inline(always)]
    pub(super) fn interleave_low(self, other: Self) -> Self {
        Self(simd::i8x16_shuffle::<0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23>(self.0, other.0))
    }

    /// Bytes 8–15 of `self` and `other`, alternating.
    #[inline(always)]
    pub(super) fn interleave_high(self, other: Self) -> Self {
        Self(simd::i8x16_shuffle::<8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31>(self.0, other.0))
    }

    #[inline(always)]
    fn widen_low(self) -> Self {
        Self(simd::u16x8_extend_low_u8x16(self.0))
    }

    #[inline(always)]
    fn widen_high(self) -> Self {
        Self(simd::u16x8_extend_high_u8x16(self.0))
    }

    #[inline(always)]
    fn dot_rounded(self, weights: Self) -> Self {
        let sum = simd::i32x4_dot_i16x8(self.0, weights.0);
        Self(simd::i32x4_shr(simd::i32x4_add(sum, simd::i32x4_splat(i32::from(ONE) / 2)), SHIFT))
    }

    #[inline(always)]
    fn narrow_i32(a: Self, b: Self) -> Self {
        Self(simd::i16x8_narrow_i32x4(a.0, b.0))
    }

    #[inline(always)]
    fn narrow_i16(a: Self, b: Self) -> Self {
        Self(simd::u8x16_narrow_i16x8(a.0, b.0))
    }
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
impl U8x16 {
    /// The lanes `bytes`.
    #[inline(always)]
    pub(super) fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The lanes as bytes.
    #[inline(always)]
    pub(super) fn to_bytes(self) -> [u8; 16] {
        self.0
    }

    /// Byte `i` is `self`'s byte `index[i]`, or 0 where that is 16 or more.
    pub(super) fn gather(self, index: Self) -> Self {
        Self(index.0.map(|i| self.0.get(usize::from(i)).copied().unwrap_or(0)))
    }

    /// Bytes 0–7 of `self` and `other`, alternating: `a0 b0 a1 b1 …`.
    pub(super) fn interleave_low(self, other: Self) -> Self {
        Self(std::array::from_fn(|i| if i % 2 == 0 { self.0[i / 2] } else { other.0[i / 2] }))
    }

    /// Bytes 8–15 of `self` and `other`, alternating.
    pub(super) fn interleave_high(self, other: Self) -> Self {
        Self(std::array::from_fn(|i| if i % 2 == 0 { self.0[8 + i / 2] } else { other.0[8 + i / 2] }))
    }

    fn i16_lanes(self) -> [i16; 8] {
        std::array::from_fn(|i| i16::from_le_bytes([self.0[2 * i], self.0[2 * i + 1]]))
    }

    fn i32_lanes(self) -> [i32; 4] {
        std::array::from_fn(|i| i32::from_le_bytes([self.0[4 * i], self.0[4 * i + 1], self.0[4 * i + 2], self.0[4 * i + 3]]))
    }

    fn from_i32(lanes: [i32; 4]) -> Self {
        let mut bytes = [0; 16];
        for (quad, lane) in bytes.chunks_exact_mut(4).zip(lanes) {
            quad.copy_from_slice(&lane.to_le_bytes());
        }
        Self(bytes)
    }

    fn widen_low(self) -> Self {
        Self::from_i16(std::array::from_fn(|i| i16::from(self.0[i])))
    }

    fn widen_high(self) -> Self {
        Self::from_i16(std::array::from_fn(|i| i16::from(self.0[8 + i])))
    }

    fn dot_rounded(self, weights: Self) -> Self {
        let (v, w) = (self.i16_lanes(), weights.i16_lanes());
        let sum = |i: usize| i32::from(v[2 * i]) * i32::from(w[2 * i]) + i32::from(v[2 * i + 1]) * i32::from(w[2 * i + 1]);
        Self::from_i32(std::array::from_fn(|i| (sum(i) + i32::from(ONE) / 2) >> SHIFT))
    }

    fn narrow_i32(a: Self, b: Self) -> Self {
        let lanes = [a.i32_lanes(), b.i32_lanes()].concat();
        Self::from_i16(std::array::from_fn(|i| lanes[i].clamp(i32::from(i16::MIN), i32::from(i16::MAX)) as i16))
    }

    fn narrow_i16(a: Self, b: Self) -> Self {
        let lanes = [a.i16_lanes(), b.i16_lanes()].concat();
        Self(std::array::from_fn(|i| lanes[i].clamp(0, 255) as u8))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_picks_bytes_and_zeroes_indexes_past_the_end() {
        let v = U8x16::from_bytes(std::array::from_fn(|i| 100 + i as u8));
        let mut index = [0u8; 16];
        index[..4].copy_from_slice(&[15, 0, 16, 3]);
        let got = v.gather(U8x16::from_bytes(index)).to_bytes();
        assert_eq!(&got[..4], &[115, 100, 0, 103]);
    }

    #[test]
    fn weighed_pairs_round_to_nearest() {
        // Pairs (200, 100) at weights (¼, ¾) → 125; (255, 255) at (½, ½) → 255.
        let mut bytes = [0u8; 16];
        bytes[..4].copy_from_slice(&[200, 100, 255, 255]);
        let q = ONE / 4;
        let low = U8x16::from_i16([q, 3 * q, 2 * q, 2 * q, 0, 0, 0, 0]);
        let [a, b] = U8x16::from_bytes(bytes).weigh_pairs(low, low);
        let zero = U8x16::from_bytes([0; 16]);
        let out = U8x16::narrow([a, b, zero, zero]).to_bytes();
        assert_eq!(&out[..2], &[125, 255]);
    }
}
