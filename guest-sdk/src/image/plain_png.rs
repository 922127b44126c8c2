//! A decoder for the PNGs most encoders write: 8 bits a sample, grey, grey
//! and alpha, RGB or RGBA, not interlaced. Anything else (palettes, 16 or
//! fewer than 8 bits, Adam7 interlacing, an `eXIf` orientation) is
//! `Ok(None)`, for the `png` crate (through `image`) to take.
//!
//! Why not the `png` crate for these too: photos are mostly Paeth rows,
//! and for every target but x86-64 (so for wasm32, even on an x86 host)
//! `png` unfilters Paeth in its comparison form; this module uses stb_image's
//! branch-free form, which `png` uses on x86-64. It also inflates (with the
//! same `fdeflate`) straight into one buffer sized from the header, so a
//! stream that inflates to more than the image is cut there, and unfilters
//! in place. On the bench's 1080p PNG in wasm, decode went from 28.4 to
//! 26.0 ms with that alone.
//!
//! A Paeth row is a chain, each pixel waiting for the one to its left, and
//! a `simd128` version with one pixel in a vector measured no faster than
//! scalar code. With `simd128`, two consecutive Paeth rows (RGB or RGBA)
//! are unfiltered together instead, the lower one pixel behind, so one
//! vector carries a pixel of each and every step advances both chains
//! (`paeth_pair`). On the same PNG in wasm (the guest bench, alternated
//! with the row-by-row build in one process): decode 22.3 → 14.9 ms.
//!
//! Chunk CRCs are not checked: the image data is checked by zlib's Adler-32,
//! and a damaged ancillary chunk cannot change the pixels.

use image::RgbImage;

use super::{ImageError, ImageLimits, check_alloc, check_dimensions};

const SIGNATURE: [u8; 8] = [0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];

/// What the `IHDR` chunk says, for the images this module takes.
#[derive(Debug, Clone, Copy)]
struct Header {
    width: u32,
    height: u32,
    /// Samples a pixel: 1 (grey), 2 (grey, alpha), 3 (RGB), 4 (RGBA).
    channels: usize,
}

/// Decodes `bytes` as RGB (alpha dropped, grey repeated), or `Ok(None)`
/// when it is not a PNG this module takes. `limits` apply to the header's
/// dimensions and to the bytes decoding needs.
pub(super) fn decode(bytes: &[u8], limits: &ImageLimits) -> Result<Option<RgbImage>, ImageError> {
    let Some(mut rest) = bytes.strip_prefix(&SIGNATURE) else {
        return Ok(None);
    };
    let (mut header, mut compressed) = (None, Vec::new());
    while let Some((kind, data, next)) = next_chunk(rest)? {
        match &kind {
            b"IHDR" => match parse_header(data)? {
                Some(h) => header = Some(h),
                None => return Ok(None),
            },
            // The general decoder applies the orientation.
            b"eXIf" => return Ok(None),
            b"IDAT" => compressed.extend_from_slice(data),
            b"IEND" => break,
            _ => {}
        }
        rest = next;
    }
    let header = header.ok_or_else(|| invalid("the PNG has no header chunk"))?;
    check_dimensions(header.width, header.height, limits)?;
    let row = 1 + u64::from(header.width) * header.channels as u64;
    let (raw_len, out_len) = (row * u64::from(header.height), 3 * u64::from(header.width) * u64::from(header.height));
    check_alloc(raw_len + out_len, header.width, header.height, limits)?;
    let mut raw = inflate(&compressed, usize::try_from(raw_len).map_err(|_| invalid("the PNG is too large"))?)?;
    drop(compressed);
    unfilter_rows(&mut raw, header)?;
    to_rgb(raw, header).map(Some)
}

/// A chunk's type, its data, and what follows the chunk.
type Chunk<'a> = ([u8; 4], &'a [u8], &'a [u8]);

/// The next chunk of `rest`; `None` at the end of the data.
fn next_chunk(rest: &[u8]) -> Result<Option<Chunk<'_>>, ImageError> {
    if rest.is_empty() {
        return Ok(None);
    }
    let truncated = || invalid("the PNG is truncated");
    let (length, rest) = rest.split_first_chunk::<4>().ok_or_else(truncated)?;
    let (kind, rest) = rest.split_first_chunk::<4>().ok_or_else(truncated)?;
    let length = u32::from_be_bytes(*length) as usize;
    // The data, then its 4-byte CRC.
    let data = rest.get(..length).ok_or_else(truncated)?;
    let next = rest.get(length..).and_then(|r| r.get(4..)).ok_or_else(truncated)?;
    Ok(Some((*kind, data, next)))
}

/// The header, or `None` for a kind of PNG this module leaves to `png`.
fn parse_header(data: &[u8]) -> Result<Option<Header>, ImageError> {
    let &[w0, w1, w2, w3, h0, h1, h2, h3, depth, colour, compression, filter, interlace] = data else {
        return Err(invalid("the PNG's header chunk has the wrong length"));
    };
    let (width, height) = (u32::from_be_bytes([w0, w1, w2, w3]), u32::from_be_bytes([h0, h1, h2, h3]));
    if compression != 0 || filter != 0 || interlace > 1 {
        return Err(invalid("the PNG's header names an unknown compression, filter or interlace method"));
    }
    let channels = match colour {
        0 => 1,
        2 => 3,
        4 => 2,
        6 => 4,
        _ => return Ok(None),
    };
    Ok((depth == 8 && interlace == 0).then_some(Header { width, height, channels }))
}

/// Inflates the zlib stream `compressed` into exactly `len` bytes.
fn inflate(compressed: &[u8], len: usize) -> Result<Vec<u8>, ImageError> {
    let mut out = vec![0u8; len];
    let mut inflater = fdeflate::Decompressor::new();
    let (mut read, mut written) = (0, 0);
    // On to the end of the stream, where its Adler-32 is checked, even once
    // the image is full.
    while !inflater.is_done() {
        let (consumed, produced) = inflater
            .read(compressed.get(read..).unwrap_or_default(), &mut out, written, true)
            .map_err(|e| invalid(&format!("corrupt PNG image data ({e:?})")))?;
        if consumed == 0 && produced == 0 {
            break;
        }
        read += consumed;
        written += produced;
    }
    if written < len {
        return Err(invalid("the PNG's image data ends before the image does"));
    }
    Ok(out)
}

/// Reverses the filter of every row of `raw` (each a filter byte, then
/// the row), in place.
fn unfilter_rows(raw: &mut [u8], header: Header) -> Result<(), ImageError> {
    let stride = header.width as usize * header.channels;
    // The row above the first.
    let zeros = vec![0u8; stride];
    let rows = raw.len() / (stride + 1);
    let filter = |raw: &[u8], r: usize| raw.get(r * (stride + 1)).copied();
    let mut r = 0;
    while r < rows {
        let start = r * (stride + 1);
        let (before, rest) = raw.split_at_mut(start);
        let previous = if r == 0 { &zeros[..] } else { &before[start - stride..] };
        let (&mut kind, rest) = rest.split_first_mut().ok_or_else(|| invalid("the PNG is truncated"))?;
        let (current, rest) = rest.split_at_mut(stride);
        // Two Paeth rows in a row: unfiltered together where that is faster.
        if kind == 4
            && filter(rest, 0) == Some(4)
            && r + 1 < rows
            && unfilter_paeth_pair(previous, current, &mut rest[1..=stride], header.channels)
        {
            r += 2;
            continue;
        }
        match header.channels {
            1 => unfilter::<1>(kind, previous, current)?,
            2 => unfilter::<2>(kind, previous, current)?,
            3 => unfilter::<3>(kind, previous, current)?,
            _ => unfilter::<4>(kind, previous, current)?,
        }
        r += 1;
    }
    Ok(())
}

/// The unfiltered rows of `raw` as RGB: alpha dropped, grey repeated.
fn to_rgb(mut raw: Vec<u8>, header: Header) -> Result<RgbImage, ImageError> {
    let stride = header.width as usize * header.channels;
    let pixels = if header.channels == 3 {
        // RGB already: close up the filter bytes in place.
        let rows = raw.len() / (stride + 1);
        for r in 0..rows {
            raw.copy_within(r * (stride + 1) + 1..(r + 1) * (stride + 1), r * stride);
        }
        raw.truncate(rows * stride);
        raw
    } else {
        let mut out = Vec::with_capacity(3 * header.width as usize * header.height as usize);
        for row in raw.chunks_exact(stride + 1) {
            let pixels = &row[1..];
            match header.channels {
                1 => pixels.iter().for_each(|&v| out.extend_from_slice(&[v, v, v])),
                2 => pixels.chunks_exact(2).for_each(|p| out.extend_from_slice(&[p[0], p[0], p[0]])),
                _ => pixels.chunks_exact(4).for_each(|p| out.extend_from_slice(&p[..3])),
            }
        }
        out
    };
    RgbImage::from_raw(header.width, header.height, pixels).ok_or_else(|| invalid("the PNG's pixels do not fill it"))
}

/// Reverses one row's filter (PNG 1.2, section 6) for `BPP` bytes a pixel;
/// the row above is `previous` (zeros for the first row).
fn unfilter<const BPP: usize>(filter: u8, previous: &[u8], current: &mut [u8]) -> Result<(), ImageError> {
    match filter {
        0 => {}
        1 => {
            for i in BPP..current.len() {
                current[i] = current[i].wrapping_add(current[i - BPP]);
            }
        }
        2 => current.iter_mut().zip(previous).for_each(|(x, &b)| *x = x.wrapping_add(b)),
        3 => {
            let mut left = [0u8; BPP];
            for (pixel, above) in current.chunks_exact_mut(BPP).zip(previous.chunks_exact(BPP)) {
                for i in 0..BPP {
                    let mean = ((u16::from(left[i]) + u16::from(above[i])) / 2) as u8;
                    pixel[i] = pixel[i].wrapping_add(mean);
                    left[i] = pixel[i];
                }
            }
        }
        4 => {
            let (mut left, mut above_left) = ([0i32; BPP], [0i32; BPP]);
            for (pixel, above) in current.chunks_exact_mut(BPP).zip(previous.chunks_exact(BPP)) {
                for i in 0..BPP {
                    let above = i32::from(above[i]);
                    pixel[i] = pixel[i].wrapping_add(paeth(left[i], above, above_left[i]));
                    left[i] = i32::from(pixel[i]);
                    above_left[i] = above;
                }
            }
        }
        _ => return Err(invalid("corrupt PNG data: an unknown row filter")),
    }
    Ok(())
}

/// The Paeth predictor of `a` (left), `b` (above) and `c` (above left), in
/// stb_image's branch-free form: the same choice as the specification's,
/// ties included, by comparisons with one threshold.
#[inline(always)]
fn paeth(a: i32, b: i32, c: i32) -> u8 {
    let threshold = c * 3 - (a + b);
    let (low, high) = (a.min(b), a.max(b));
    let t0 = if high <= threshold { low } else { c };
    let t1 = if threshold <= low { high } else { t0 };
    t1 as u8
}

/// Unfilters two consecutive Paeth rows, `upper` then `lower`, below the
/// finished row `above`, when the target has a fast way to (`simd128`,
/// RGB or RGBA); `false`, touching nothing, otherwise.
///
/// A Paeth row is a chain: each pixel needs the one to its left. Two rows
/// make two chains that can run side by side if the lower row trails by
/// one pixel (its pixel x − 1 needs the upper row's x − 2 and x − 1, just
/// done): one vector holds the upper row's pixel x and the lower row's
/// pixel x − 1, and each step of the chain does both.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn unfilter_paeth_pair(above: &[u8], upper: &mut [u8], lower: &mut [u8], channels: usize) -> bool {
    match channels {
        3 => paeth_pair::<3>(above, upper, lower),
        4 => paeth_pair::<4>(above, upper, lower),
        _ => return false,
    }
    true
}

/// Without `simd128`, rows are unfiltered one by one.
#[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
fn unfilter_paeth_pair(_: &[u8], _: &mut [u8], _: &mut [u8], _: usize) -> bool {
    false
}

/// [`unfilter_paeth_pair`] for `BPP` (3 or 4) bytes a pixel. Lanes 0–3 of
/// each 16-bit vector are the upper row's pixel, lanes 4–7 the lower's; at
/// 3 bytes a pixel, lanes 3 and 7 carry the next pixel's first byte, which
/// [`paeth_step`] leaves as it is, so a pixel is read and written as four
/// bytes at once.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn paeth_pair<const BPP: usize>(above: &[u8], upper: &mut [u8], lower: &mut [u8]) {
    use core::arch::wasm32::{u8x16_narrow_i16x8, u16x8, u16x8_extend_low_u8x16, u32x4, u32x4_extract_lane, v128};
    // A pixel's four bytes, zero-extended to 16-bit lanes 0–3 (and 4–7 for `second`).
    let widen = |first: u32, second: u32| -> v128 { u16x8_extend_low_u8x16(u32x4(first, second, 0, 0)) };
    let keep =
        if BPP == 4 { u16x8(0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF) } else { u16x8(0xFF, 0xFF, 0xFF, 0, 0xFF, 0xFF, 0xFF, 0) };
    let width = upper.len() / BPP;
    // Step x: the upper row's pixel x and the lower row's x − 1. Where all
    // four-byte reads and writes stay inside the rows: no checks but the slices'.
    let inner = 1..width.saturating_sub(if BPP == 3 { 1 } else { 0 }).max(1);
    let mut state = PaethPair::default();
    let edge = |state: &mut PaethPair, x: usize, upper: &mut [u8], lower: &mut [u8]| {
        let at = |row: &[u8], x: Option<usize>| x.filter(|&x| x < width).map_or(0, |x| four_bytes(row, x * BPP));
        let (here, left) = (Some(x), x.checked_sub(1));
        let out = state.step(widen(at(upper, here), at(lower, left)), widen(at(above, here), 0), keep);
        let bytes = u64_bytes(u8x16_narrow_i16x8(out, out));
        if x < width {
            upper[x * BPP..(x + 1) * BPP].copy_from_slice(&bytes[..BPP]);
        }
        if let Some(left) = left {
            lower[left * BPP..x * BPP].copy_from_slice(&bytes[4..4 + BPP]);
        }
    };
    edge(&mut state, 0, upper, lower);
    // Before the lower row's first pixel, its left neighbour is zero.
    state.clear_lower();
    // Each step's filtered bytes are read before the step before writes
    // over the first of them: a read that overlaps a write just made cannot
    // be forwarded from it and waits for the write to reach the cache.
    let read = |upper: &[u8], lower: &[u8], x: usize| {
        let (u, l) = (x * BPP, (x - 1) * BPP);
        (upper.get(u..u + 4).map_or(0, word), lower.get(l..l + 4).map_or(0, word))
    };
    let mut next = read(upper, lower, inner.start);
    for x in inner.clone() {
        let (u, l) = (x * BPP, (x - 1) * BPP);
        let raw = widen(next.0, next.1);
        next = read(upper, lower, x + 1);
        let out = state.step(raw, widen(word(&above[u..u + 4]), 0), keep);
        let words = u8x16_narrow_i16x8(out, out);
        upper[u..u + 4].copy_from_slice(&u32x4_extract_lane::<0>(words).to_le_bytes());
        lower[l..l + 4].copy_from_slice(&u32x4_extract_lane::<1>(words).to_le_bytes());
    }
    for x in inner.end..=width {
        edge(&mut state, x, upper, lower);
    }
}

/// The chain state of [`paeth_pair`]: its last two outputs and the row
/// above's last pixel, as 16-bit lanes.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
struct PaethPair {
    /// [upper x − 1, lower x − 2]: `a` of both, and `b` of the lower.
    last: core::arch::wasm32::v128,
    /// [upper x − 2, lower x − 3]: the lower's `c` in lanes 0–3.
    before_last: core::arch::wasm32::v128,
    /// The row above's pixel x − 1: the upper's `c`.
    above_left: core::arch::wasm32::v128,
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
impl Default for PaethPair {
    fn default() -> Self {
        let zero = core::arch::wasm32::u64x2(0, 0);
        Self { last: zero, before_last: zero, above_left: zero }
    }
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
impl PaethPair {
    /// One step: `raw` the two filtered pixels, `above` the row above's
    /// pixel x (lanes 0–3); [`paeth`]'s comparisons in every lane. Lanes
    /// where `keep` is 0 come out as `raw` has them.
    #[inline(always)]
    fn step(
        &mut self,
        raw: core::arch::wasm32::v128,
        above: core::arch::wasm32::v128,
        keep: core::arch::wasm32::v128,
    ) -> core::arch::wasm32::v128 {
        use core::arch::wasm32::{i16x8_add, i16x8_gt, i16x8_max, i16x8_min, i16x8_sub, u64x2_shuffle, v128_and, v128_bitselect};
        let a = self.last;
        // Lanes 0–3 of the first, then lanes 0–3 of the second.
        let b = u64x2_shuffle::<0, 2>(above, self.last);
        let c = u64x2_shuffle::<0, 2>(self.above_left, self.before_last);
        let threshold = i16x8_sub(i16x8_sub(i16x8_add(c, i16x8_add(c, c)), b), a);
        let (low, high) = (i16x8_min(a, b), i16x8_max(a, b));
        let t0 = v128_bitselect(c, low, i16x8_gt(high, threshold));
        let t1 = v128_and(v128_bitselect(t0, high, i16x8_gt(threshold, low)), keep);
        let out = v128_and(i16x8_add(raw, t1), core::arch::wasm32::i16x8_splat(0xFF));
        (self.before_last, self.last, self.above_left) = (self.last, out, above);
        out
    }

    /// Zeroes the lower row's lanes of `last`.
    fn clear_lower(&mut self) {
        use core::arch::wasm32::{u32x4, v128_and};
        self.last = v128_and(self.last, u32x4(u32::MAX, u32::MAX, 0, 0));
    }
}

/// A four-byte slice as a little-endian word.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn word(bytes: &[u8]) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(bytes);
    u32::from_le_bytes(word)
}

/// The low eight bytes of a vector.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn u64_bytes(v: core::arch::wasm32::v128) -> [u8; 8] {
    core::arch::wasm32::u64x2_extract_lane::<0>(v).to_le_bytes()
}

/// The four bytes of `row` from `at`, zeros past its end; little-endian.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn four_bytes(row: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(std::array::from_fn(|i| row.get(at + i).copied().unwrap_or(0)))
}

fn invalid(reason: &str) -> ImageError {
    ImageError::Invalid(reason.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::codecs::png::{CompressionType, FilterType, PngEncoder};
    use image::{ExtendedColorType, ImageEncoder};

    /// A `width × height` picture with `channels` samples a pixel: smooth
    /// gradients and a little noise, so every filter has something to do.
    fn picture(width: u32, height: u32, channels: usize) -> Vec<u8> {
        let mut seed = 7u32;
        let mut out = Vec::new();
        for y in 0..height {
            for x in 0..width {
                for c in 0..channels {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    let noise = seed >> 28;
                    out.push(((x * 3 + y * 5 + c as u32 * 40 + noise) % 256) as u8);
                }
            }
        }
        out
    }

    fn encode(pixels: &[u8], width: u32, height: u32, colour: ExtendedColorType, filter: FilterType) -> Vec<u8> {
        let mut out = Vec::new();
        PngEncoder::new_with_quality(&mut out, CompressionType::Fast, filter).write_image(pixels, width, height, colour).expect("encode");
        out
    }

    fn reference(bytes: &[u8]) -> RgbImage {
        image::load_from_memory(bytes).expect("png decodes").into_rgb8()
    }

    const FILTERS: [FilterType; 6] =
        [FilterType::NoFilter, FilterType::Sub, FilterType::Up, FilterType::Avg, FilterType::Paeth, FilterType::Adaptive];

    #[test]
    fn matches_the_png_crate_for_every_colour_type_and_filter() {
        let kinds = [(ExtendedColorType::L8, 1), (ExtendedColorType::La8, 2), (ExtendedColorType::Rgb8, 3), (ExtendedColorType::Rgba8, 4)];
        for (colour, channels) in kinds {
            for filter in FILTERS {
                for (width, height) in [(37, 23), (1, 5), (64, 1)] {
                    let bytes = encode(&picture(width, height, channels), width, height, colour, filter);
                    let ours = decode(&bytes, &ImageLimits::default()).expect("decodes").expect("taken");
                    assert!(ours == reference(&bytes), "{colour:?} {filter:?} {width}×{height}");
                }
            }
        }
    }

    #[test]
    fn other_kinds_of_png_are_left_to_the_png_crate() {
        let wide: Vec<u8> = picture(9, 7, 3).iter().flat_map(|&v| [v, v]).collect();
        let sixteen_bits = encode(&wide, 9, 7, ExtendedColorType::Rgb16, FilterType::Paeth);
        assert!(decode(&sixteen_bits, &ImageLimits::default()).expect("no error").is_none());
        assert!(decode(b"\xFF\xD8\xFF\xE0 a jpeg", &ImageLimits::default()).expect("no error").is_none());
    }

    #[test]
    fn the_paeth_predictor_is_the_specifications() {
        for a in (0..256i32).step_by(5) {
            for b in (0..256).step_by(7) {
                for c in (0..256).step_by(3) {
                    // PNG 1.2, 6.6: the nearest of a, b, c to a + b − c, ties in that order.
                    let p = a + b - c;
                    let (pa, pb, pc) = ((p - a).abs(), (p - b).abs(), (p - c).abs());
                    let expected = if pa <= pb && pa <= pc {
                        a
                    } else if pb <= pc {
                        b
                    } else {
                        c
                    };
                    assert_eq!(i32::from(paeth(a, b, c)), expected, "a {a} b {b} c {c}");
                }
            }
        }
    }

    #[test]
    fn damaged_and_oversized_pngs_are_errors_not_panics() {
        let bytes = encode(&picture(40, 30, 3), 40, 30, ExtendedColorType::Rgb8, FilterType::Adaptive);
        for cut in (9..bytes.len() - 12).step_by(7) {
            assert!(decode(&bytes[..cut], &ImageLimits::default()).is_err(), "cut at {cut}");
        }
        let mut seed = 1u32;
        for _ in 0..300 {
            let mut damaged = bytes.clone();
            for _ in 0..4 {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let at = 8 + (seed as usize >> 8) % (damaged.len() - 8);
                damaged[at] ^= (seed >> 24) as u8 | 1;
            }
            let _ = decode(&damaged, &ImageLimits::default());
        }
        let tight = ImageLimits { max_alloc: 1000, ..ImageLimits::default() };
        assert!(matches!(decode(&bytes, &tight), Err(ImageError::TooLarge { .. })));
    }
}
