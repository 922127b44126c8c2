//! Four `f32` lanes: one `simd128` vector in WebAssembly built with that
//! feature, a plain array elsewhere.
//!
//! LLVM vectorises small array loops natively but, for wasm32, left the
//! JPEG decoder's 4×4 inverse DCT scalar: 96 `mulss` and 80 `addss`/`subss`
//! a block after Cranelift, a fifth of the decode's time at 1/2 scale.
//! Written with this type, the transform is one vector operation per line
//! in wasm, and the same code (as arrays) runs natively.

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
use core::arch::wasm32 as simd;

/// Four `f32`s, operated on lane by lane.
#[derive(Clone, Copy, Debug)]
pub(super) struct F32x4(Repr);

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
type Repr = simd::v128;
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
type Repr = [f32; 4];

/// The magic number [`pixel`] and [`F32x4::pixels`] round with: 1.5·2²³,
/// whose float has the integer part of a sum with it in its low mantissa bits.
const MAGIC: f32 = 12_582_912.0;

/// A sample of the inverse DCT as a pixel: level-shifted by 128, rounded to
/// nearest, clamped to 0..=255. Rounded by adding [`MAGIC`], which leaves
/// the integer in the low bits of the float: a float-to-int conversion is a
/// long instruction sequence in WebAssembly (it must saturate), this an add
/// and integer clamps. Exact for any sample a valid block gives (|value| <
/// 2²²); a corrupt block's larger ones still end up in 0..=255.
#[inline(always)]
pub(super) fn pixel(value: f32) -> u8 {
    let rounded = (value + (128.0 + MAGIC)).to_bits() as i32 - MAGIC.to_bits() as i32;
    rounded.clamp(0, 255) as u8
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
impl F32x4 {
    /// The lanes `[a[0], a[1], a[2], a[3]]`.
    #[inline(always)]
    pub(super) fn new(a: [f32; 4]) -> Self {
        Self(simd::f32x4(a[0], a[1], a[2], a[3]))
    }

    /// `x` in every lane.
    #[inline(always)]
    pub(super) fn splat(x: f32) -> Self {
        Self(simd::f32x4_splat(x))
    }

    /// The lanes as an array.
    #[cfg(test)]
    pub(super) fn to_array(self) -> [f32; 4] {
        let v = self.0;
        [
            simd::f32x4_extract_lane::<0>(v),
            simd::f32x4_extract_lane::<1>(v),
            simd::f32x4_extract_lane::<2>(v),
            simd::f32x4_extract_lane::<3>(v),
        ]
    }

    #[inline(always)]
    fn add(self, other: Self) -> Self {
        Self(simd::f32x4_add(self.0, other.0))
    }

    #[inline(always)]
    fn sub(self, other: Self) -> Self {
        Self(simd::f32x4_sub(self.0, other.0))
    }

    #[inline(always)]
    fn mul(self, other: Self) -> Self {
        Self(simd::f32x4_mul(self.0, other.0))
    }

    /// Rows become columns: lane `j` of row `i` becomes lane `i` of row `j`.
    #[inline(always)]
    pub(super) fn transpose([r0, r1, r2, r3]: [Self; 4]) -> [Self; 4] {
        use simd::i32x4_shuffle as shuffle;
        let (low01, low23) = (shuffle::<0, 4, 1, 5>(r0.0, r1.0), shuffle::<0, 4, 1, 5>(r2.0, r3.0));
        let (high01, high23) = (shuffle::<2, 6, 3, 7>(r0.0, r1.0), shuffle::<2, 6, 3, 7>(r2.0, r3.0));
        [
            Self(shuffle::<0, 1, 4, 5>(low01, low23)),
            Self(shuffle::<2, 3, 6, 7>(low01, low23)),
            Self(shuffle::<0, 1, 4, 5>(high01, high23)),
            Self(shuffle::<2, 3, 6, 7>(high01, high23)),
        ]
    }

    /// Four rows of inverse-DCT samples as pixels, `[row][lane]`:
    /// level-shifted by 128, rounded to nearest, clamped to 0..=255.
    #[inline(always)]
    pub(super) fn pixels(rows: [Self; 4]) -> [[u8; 4]; 4] {
        let offset = simd::f32x4_splat(128.0 + MAGIC);
        let integer = |row: Self| simd::i32x4_sub(simd::f32x4_add(row.0, offset), simd::i32x4_splat(MAGIC.to_bits() as i32));
        // Saturating narrows: i32 → i16 → u8 clamps each lane to 0..=255.
        let low = simd::i16x8_narrow_i32x4(integer(rows[0]), integer(rows[1]));
        let high = simd::i16x8_narrow_i32x4(integer(rows[2]), integer(rows[3]));
        let bytes = simd::u8x16_narrow_i16x8(low, high);
        let word = |i: u32| -> [u8; 4] {
            let lane = match i {
                0 => simd::u32x4_extract_lane::<0>(bytes),
                1 => simd::u32x4_extract_lane::<1>(bytes),
                2 => simd::u32x4_extract_lane::<2>(bytes),
                _ => simd::u32x4_extract_lane::<3>(bytes),
            };
            lane.to_le_bytes()
        };
        [word(0), word(1), word(2), word(3)]
    }
}

#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
impl F32x4 {
    /// The lanes `[a[0], a[1], a[2], a[3]]`.
    #[inline(always)]
    pub(super) fn new(a: [f32; 4]) -> Self {
        Self(a)
    }

    /// `x` in every lane.
    #[inline(always)]
    pub(super) fn splat(x: f32) -> Self {
        Self([x; 4])
    }

    /// The lanes as an array.
    #[cfg(test)]
    pub(super) fn to_array(self) -> [f32; 4] {
        self.0
    }

    #[inline(always)]
    fn add(self, other: Self) -> Self {
        Self(std::array::from_fn(|i| self.0[i] + other.0[i]))
    }

    #[inline(always)]
    fn sub(self, other: Self) -> Self {
        Self(std::array::from_fn(|i| self.0[i] - other.0[i]))
    }

    #[inline(always)]
    fn mul(self, other: Self) -> Self {
        Self(std::array::from_fn(|i| self.0[i] * other.0[i]))
    }

    /// Rows become columns: lane `j` of row `i` becomes lane `i` of row `j`.
    #[inline(always)]
    pub(super) fn transpose(rows: [Self; 4]) -> [Self; 4] {
        std::array::from_fn(|j| Self(std::array::from_fn(|i| rows[i].0[j])))
    }

    /// Four rows of inverse-DCT samples as pixels, `[row][lane]`:
    /// level-shifted by 128, rounded to nearest, clamped to 0..=255.
    #[inline(always)]
    pub(super) fn pixels(rows: [Self; 4]) -> [[u8; 4]; 4] {
        rows.map(|row| row.0.map(pixel))
    }
}

impl std::ops::Add for F32x4 {
    type Output = Self;
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        F32x4::add(self, other)
    }
}

impl std::ops::Sub for F32x4 {
    type Output = Self;
    #[inline(always)]
    fn sub(self, other: Self) -> Self {
        F32x4::sub(self, other)
    }
}

impl std::ops::Mul for F32x4 {
    type Output = Self;
    #[inline(always)]
    fn mul(self, other: Self) -> Self {
        F32x4::mul(self, other)
    }
}

impl std::ops::Mul<f32> for F32x4 {
    type Output = Self;
    #[inline(always)]
    fn mul(self, factor: f32) -> Self {
        F32x4::mul(self, F32x4::splat(factor))
    }
}

#[cfg(test)]
mod tests {
    use super::F32x4;

    #[test]
    fn lanes_add_subtract_multiply_and_transpose() {
        let (a, b) = (F32x4::new([1.0, 2.0, 3.0, 4.0]), F32x4::new([0.5, -1.0, 2.0, 8.0]));
        assert_eq!((a + b).to_array(), [1.5, 1.0, 5.0, 12.0]);
        assert_eq!((a - b).to_array(), [0.5, 3.0, 1.0, -4.0]);
        assert_eq!((a * b * 2.0).to_array(), [1.0, -4.0, 12.0, 64.0]);
        let rows: [F32x4; 4] = std::array::from_fn(|i| F32x4::new(std::array::from_fn(|j| (i * 4 + j) as f32)));
        let columns = F32x4::transpose(rows).map(F32x4::to_array);
        assert_eq!(columns[1], [1.0, 5.0, 9.0, 13.0]);
        assert_eq!(columns[3], [3.0, 7.0, 11.0, 15.0]);
    }

    #[test]
    fn pixels_are_level_shifted_rounded_and_clamped() {
        let rows = [
            F32x4::new([-128.0, -127.6, 0.0, 0.49]),
            F32x4::new([126.6, 127.0, 200.0, -300.0]),
            F32x4::new([1e9, -1e9, f32::MAX, 0.51]),
            F32x4::splat(-0.4),
        ];
        assert_eq!(F32x4::pixels(rows), [[0, 0, 128, 128], [255, 255, 255, 0], [255, 0, 255, 129], [128; 4]]);
    }
}
