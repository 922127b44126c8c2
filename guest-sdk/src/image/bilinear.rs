//! Bilinear enlargement of RGB images with `simd128`, for WebAssembly.
//!
//! With `fast_image_resize`'s `simd128` path for three-byte pixels,
//! enlarging grace_hopper.jpg (512×600) to a 640 letterbox took 1.3–3 ms
//! in wasm, against about 0.5 natively with its AVX2 path; this code takes
//! about 0.65 ms in wasm. Enlarging, bilinear weighs at most two source pixels per
//! output pixel, which fits byte gathers: four output pixels (12 bytes)
//! come from one 16-byte load, two `swizzle`s that pair each output byte's
//! two source bytes, and pairwise multiply-adds (`i32x4.dot_i16x8_s`).
//! Like `fast_image_resize` for bytes, each output row is first blended
//! from the two source rows it lies between, then enlarged along the row.
//!
//! Weights are PIL's (the same `fast_image_resize` and Pillow use: a
//! triangle of support 1 centred on each output pixel's centre), in 14-bit
//! fixed point, the blended rows rounded to bytes: on the images of the
//! tests, the same pixels as `fast_image_resize`'s.

use super::u8x16::{ONE, U8x16};

/// An output pixel's two source pixels along one axis and their weights,
/// in units of `1 / ONE` (the second is `ONE - near`).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Tap {
    first: usize,
    second: usize,
    near: i16,
}

impl Tap {
    fn far(self) -> i16 {
        ONE - self.near
    }
}

/// Whether [`enlarge`] handles `from → to` (pixels, width then height): no
/// axis shrinks and the rows, in and out, are at least one vector wide.
pub(super) fn can_enlarge(from: (u32, u32), to: (u32, u32)) -> bool {
    to.0 >= from.0 && to.1 >= from.1 && from.0 >= 6 && from.1 >= 1
}

/// Enlarges `pixels` (`from` pixels, RGB rows) to `to` pixels, written to
/// `canvas`'s top-left, whose rows are `stride` bytes; the rest of the
/// canvas is left as it is. The caller checked [`can_enlarge`].
pub(super) fn enlarge(pixels: &[u8], from: (u32, u32), canvas: &mut [u8], stride: usize, to: (u32, u32)) {
    debug_assert!(can_enlarge(from, to) && to.0 as usize * 3 <= stride, "{from:?} → {to:?}, stride {stride}");
    debug_assert!(pixels.len() >= from.0 as usize * from.1 as usize * 3);
    let row_len = from.0 as usize * 3;
    let groups = groups(&taps(from.0 as usize, to.0 as usize), row_len);
    let source = |y: usize| &pixels[y * row_len..(y + 1) * row_len];
    let mut blended = vec![0u8; row_len];
    for (y, tap) in taps(from.1 as usize, to.1 as usize).into_iter().enumerate() {
        let row = if tap.near == ONE {
            source(tap.first)
        } else {
            blend_rows(source(tap.first), source(tap.second), tap, &mut blended);
            &blended
        };
        enlarge_row(row, &groups, &mut canvas[y * stride..y * stride + to.0 as usize * 3]);
    }
}

/// Each output index's taps: PIL's bilinear coefficients when enlarging.
/// Output pixel `o`'s centre lies at `t = (o + ½)·n_in/n_out − ½` in
/// source pixels; it takes `1 − frac(t)` of pixel `⌊t⌋` and `frac(t)` of the
/// next, one pixel alone at the edges.
fn taps(n_in: usize, n_out: usize) -> Vec<Tap> {
    let scale = n_in as f64 / n_out as f64;
    let last = n_in - 1;
    (0..n_out)
        .map(|o| {
            let t = (o as f64 + 0.5) * scale - 0.5;
            if t <= 0.0 {
                return Tap { first: 0, second: 0, near: ONE };
            }
            let first = t.floor() as usize;
            if first >= last {
                return Tap { first: last, second: last, near: ONE };
            }
            let far = ((t - first as f64) * f64::from(ONE)).round() as i16;
            Tap { first, second: first + 1, near: ONE - far }
        })
        .collect()
}

/// Four output pixels of a row: where their source bytes start, which of
/// the 16 loaded bytes pair up for each output byte, and the pairs' weights.
#[derive(Clone, Copy, Debug)]
struct Group {
    at: usize,
    /// Output bytes 0–7, then 8–11: each a (first, second) byte index pair.
    pairs: [U8x16; 2],
    /// The weight pairs for output bytes 0–3, 4–7 and 8–11.
    weights: [U8x16; 3],
}

/// The row taps in groups of four output pixels (the last repeating its
/// last pixel), for source rows of `row_len` bytes (at least 16).
fn groups(taps: &[Tap], row_len: usize) -> Vec<Group> {
    taps.chunks(4)
        .map(|chunk| {
            let pixel = |p: usize| chunk[p.min(chunk.len() - 1)];
            // Enlarging, four outputs span at most five source pixels (15
            // bytes), so one load holds them, moved back at the row's end.
            let at = (3 * chunk[0].first).min(row_len - 16);
            let (mut pairs, mut weights) = ([[0u8; 16]; 2], [[0i16; 8]; 3]);
            for byte in 0..12 {
                let (tap, channel) = (pixel(byte / 3), byte % 3);
                let index = |source: usize| (3 * source + channel - at) as u8;
                pairs[byte / 8][2 * (byte % 8)] = index(tap.first);
                pairs[byte / 8][2 * (byte % 8) + 1] = index(tap.second);
                weights[byte / 4][2 * (byte % 4)] = tap.near;
                weights[byte / 4][2 * (byte % 4) + 1] = tap.far();
            }
            Group { at, pairs: pairs.map(U8x16::from_bytes), weights: weights.map(U8x16::from_i16) }
        })
        .collect()
}

/// One row enlarged into `out`, 12 bytes a group.
fn enlarge_row(row: &[u8], groups: &[Group], out: &mut [u8]) {
    for (g, group) in groups.iter().enumerate() {
        let source = U8x16::load(row, group.at);
        let [w0, w1, w2] = group.weights;
        let [a, b] = source.gather(group.pairs[0]).weigh_pairs(w0, w1);
        let [c, d] = source.gather(group.pairs[1]).weigh_pairs(w2, w2);
        let pixels = U8x16::narrow([a, b, c, d]);
        if 12 * g + 16 <= out.len() {
            pixels.store(out, 12 * g);
        } else {
            // Near the row's end: only the row's bytes, not the canvas's
            // next ones (a spill into the next group's is overwritten).
            let rest = out.len() - 12 * g;
            out[12 * g..].copy_from_slice(&pixels.to_bytes()[..rest]);
        }
    }
}

/// `out = near·a + far·b`, byte by byte, rounded; rows of at least 16
/// bytes (the last vector overlaps the one before).
fn blend_rows(a: &[u8], b: &[u8], tap: Tap, out: &mut [u8]) {
    let weights = U8x16::from_i16([tap.near, tap.far(), tap.near, tap.far(), tap.near, tap.far(), tap.near, tap.far()]);
    let last = out.len() - 16;
    for at in (0..out.len()).step_by(16).map(|at| at.min(last)) {
        let (x, y) = (U8x16::load(a, at), U8x16::load(b, at));
        let [p, q] = x.interleave_low(y).weigh_pairs(weights, weights);
        let [r, s] = x.interleave_high(y).weigh_pairs(weights, weights);
        U8x16::narrow([p, q, r, s]).store(out, at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fast_image_resize as fr;

    /// A deterministic image with edges, gradients and noise.
    fn image(width: u32, height: u32) -> Vec<u8> {
        let mut state = 0x2545_f491_u32;
        (0..width * height * 3)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let (x, y) = ((i / 3) % width, (i / 3) / width);
                if (x / 7 + y / 5) % 3 == 0 { (state >> 24) as u8 } else { ((x * 255) / width.max(1)) as u8 ^ ((i % 3) as u8 * 40) }
            })
            .collect()
    }

    fn with_fir(pixels: &[u8], from: (u32, u32), side: u32, to: (u32, u32)) -> Vec<u8> {
        let src = fr::images::ImageRef::new(from.0, from.1, pixels, fr::PixelType::U8x3).unwrap();
        let mut canvas = vec![0u8; (side * side * 3) as usize];
        let mut dst = fr::images::Image::from_slice_u8(side, side, &mut canvas, fr::PixelType::U8x3).unwrap();
        let mut view = fr::images::CroppedImageMut::new(&mut dst, 0, 0, to.0, to.1).unwrap();
        let options = fr::ResizeOptions::new().resize_alg(fr::ResizeAlg::Convolution(fr::FilterType::Bilinear));
        fr::Resizer::new().resize(&src, &mut view, &options).unwrap();
        canvas
    }

    fn with_simd(pixels: &[u8], from: (u32, u32), side: u32, to: (u32, u32)) -> Vec<u8> {
        let mut canvas = vec![0u8; (side * side * 3) as usize];
        assert!(can_enlarge(from, to));
        enlarge(pixels, from, &mut canvas, side as usize * 3, to);
        canvas
    }

    #[test]
    fn enlarging_gives_fast_image_resize_s_pixels() {
        for (from, side, to) in [
            ((512, 600), 640, (546, 640)),
            ((7, 9), 64, (50, 64)),
            ((100, 100), 160, (100, 160)),
            ((100, 100), 160, (160, 100)),
            ((160, 90), 320, (320, 180)),
            ((6, 1), 32, (32, 5)),
            ((33, 17), 96, (96, 49)),
        ] {
            let pixels = image(from.0, from.1);
            let (ours, theirs) = (with_simd(&pixels, from, side, to), with_fir(&pixels, from, side, to));
            let differ = ours.iter().zip(&theirs).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{from:?} → {to:?}: {differ} of {} bytes differ", ours.len());
        }
    }

    #[test]
    fn every_small_enlargement_gives_fast_image_resize_s_pixels() {
        // Widths 6..=20 (the narrowest a vector handles, and the last group
        // both full and partial), heights 1..=5, enlarged by 1 to 4.5×.
        for width in 6..=20u32 {
            for height in 1..=5u32 {
                let pixels = image(width, height);
                for factor in [1.0, 1.1, 1.5, 2.0, 3.3, 4.5] {
                    let to = ((width as f32 * factor).round() as u32, (height as f32 * factor).round() as u32);
                    let side = to.0.max(to.1).next_multiple_of(32);
                    let (from, ours) = ((width, height), with_simd(&pixels, (width, height), side, to));
                    assert!(ours == with_fir(&pixels, from, side, to), "{from:?} → {to:?}");
                }
            }
        }
    }

    #[test]
    fn the_canvas_outside_the_image_stays_untouched() {
        let (from, side, to) = ((40, 30), 64, (64, 48));
        let mut canvas = vec![7u8; (side * side * 3) as usize];
        enlarge(&image(from.0, from.1), from, &mut canvas, side as usize * 3, to);
        let stride = side as usize * 3;
        assert!(canvas[to.1 as usize * stride..].iter().all(|&b| b == 7), "rows below the image");
        assert!(canvas[..to.1 as usize * stride].chunks(stride).all(|row| row[to.0 as usize * 3..].iter().all(|&b| b == 7)));
    }

    #[test]
    fn edge_pixels_are_copied_and_midpoints_averaged() {
        // 6×1 → 12×1: output 0 is source 0 alone; output 1 lies ¼ of the
        // way from source 0 to 1.
        let pixels: Vec<u8> = (0..6).flat_map(|x| [x * 40, 255 - x * 40, 100]).collect();
        let out = with_simd(&pixels, (6, 1), 32, (12, 1));
        assert_eq!(&out[..3], &[0, 255, 100]);
        assert_eq!(&out[3..6], &[10, 245, 100]);
    }

    #[test]
    fn shrinking_and_narrow_sources_are_left_to_the_general_path() {
        assert!(!can_enlarge((100, 100), (90, 120)));
        assert!(!can_enlarge((100, 100), (120, 90)));
        assert!(!can_enlarge((5, 100), (32, 640)));
        assert!(can_enlarge((6, 1), (6, 1)));
    }
}
