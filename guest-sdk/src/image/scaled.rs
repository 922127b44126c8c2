//! Decoding only what a letterbox needs: a JPEG larger than the letterbox
//! is decoded at n/8 of its size (n from 1 to 6) straight from its DCT
//! coefficients (as libjpeg's `scale_num`/8 does; Pillow's `draft` takes
//! 1/2, 1/4 and 1/8), at the smallest scale that still covers the
//! letterboxed image, then resized as usual. A 12 MP photo for a 640
//! letterbox decodes at 2/8: the entropy decoding is the same, the inverse
//! DCT, colour conversion and resize handle 1/16 of the pixels; a 1080p
//! frame decodes at 3/8, a 512×600 photo for a 160 letterbox too. Baseline JPEGs (what cameras write) go to
//! this crate's own decoder ([`super::reduced_jpeg`]), which keeps only the
//! coefficients a scale needs, at full size too (in WebAssembly it is about
//! a fifth faster than the `image` crate's decoder); the rest (progressive,
//! say) to jpeg-decoder's scaled decode, or, needed whole, to
//! [`decode`](super::decode).

use image::metadata::Orientation;
use image::{DynamicImage, GrayImage};
use jpeg_decoder::PixelFormat;

use super::reduced_jpeg;
use super::{
    ImageError, ImageFormat, ImageLimits, RgbImage, check_dimensions, check_header, decode_checked, letterbox_geometry, sniff_format,
};

/// An image decoded for a letterbox, perhaps at a reduced scale.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaledImage {
    /// The pixels, EXIF orientation applied; at most the original's size.
    pub image: RgbImage,
    /// The original's width, after EXIF orientation.
    pub width: u32,
    /// The original's height, after EXIF orientation.
    pub height: u32,
}

impl ScaledImage {
    /// Original pixels per decoded pixel, along x and along y (1 when decoded full size).
    pub fn factors(&self) -> (f32, f32) {
        (self.width as f32 / self.image.width() as f32, self.height as f32 / self.image.height() as f32)
    }

    /// Whether the image was decoded below its full size.
    pub fn is_reduced(&self) -> bool {
        self.image.dimensions() != (self.width, self.height)
    }
}

/// Decodes `bytes` for a letterbox of `side`: a JPEG at the smallest DCT
/// scale whose size still covers the letterboxed image, 1/1 included (see
/// the module docs); anything else as [`decode`](super::decode) does. A
/// JPEG's pixels may differ from [`decode`](super::decode)'s by rounding. The same limits and errors as [`decode`](super::decode) apply, to the original's
/// dimensions.
pub fn decode_for_letterbox(bytes: &[u8], limits: &ImageLimits, side: u32) -> Result<ScaledImage, ImageError> {
    let format = sniff_format(bytes)?;
    check_header(bytes, format, limits)?;
    if format == ImageFormat::Jpeg
        && let Some(scaled) = decode_jpeg_reduced(bytes, limits, side)?
    {
        return Ok(scaled);
    }
    let image = decode_checked(bytes, format, limits)?;
    let (width, height) = image.dimensions();
    Ok(ScaledImage { image, width, height })
}

/// The JPEG decoded at the smallest scale that covers the letterbox (full
/// size when 6/8 would not; see [`eighths_for`]), or `None` for
/// [`decode`](super::decode) to take: a JPEG needed whole that the reduced decoder leaves to
/// others, or a pixel format other than grey and RGB.
fn decode_jpeg_reduced(bytes: &[u8], limits: &ImageLimits, side: u32) -> Result<Option<ScaledImage>, ImageError> {
    decode_jpeg_at(bytes, limits, Some(side))
}

/// A baseline JPEG decoded whole by this crate's decoder (EXIF orientation
/// applied), or `None` for [`decode`](super::decode)'s general decoder to take. In
/// WebAssembly it is about a fifth faster than the `image` crate's.
pub(super) fn decode_jpeg_whole(bytes: &[u8], limits: &ImageLimits) -> Result<Option<RgbImage>, ImageError> {
    Ok(decode_jpeg_at(bytes, limits, None)?.map(|scaled| scaled.image))
}

/// The JPEG at the smallest scale that covers a letterbox of `side`, or
/// whole without one.
fn decode_jpeg_at(bytes: &[u8], limits: &ImageLimits, side: Option<u32>) -> Result<Option<ScaledImage>, ImageError> {
    let mut decoder = jpeg_decoder::Decoder::new(bytes);
    decoder.set_max_decoding_buffer_size(usize::try_from(limits.max_alloc).unwrap_or(usize::MAX));
    decoder.read_info().map_err(jpeg_error)?;
    let Some(info) = decoder.info() else {
        return Ok(None);
    };
    let (width, height) = (u32::from(info.width), u32::from(info.height));
    check_dimensions(width, height, limits)?;
    // The letterbox's scale does not depend on the orientation: the stored
    // image needs (want_w, want_h), rotated or not.
    let (_, want_w, want_h) = side.map_or((1.0, width, height), |side| letterbox_geometry(width, height, side.max(1)));
    if !matches!(info.pixel_format, PixelFormat::RGB24 | PixelFormat::L8) {
        return Ok(None);
    }
    let eighths = eighths_for(width, height, want_w, want_h);
    let (image, exif) = match reduced_jpeg::decode(bytes, eighths, limits.max_alloc).map_err(ImageError::Invalid)? {
        Some(reduced) => {
            let (w, h, exif) = (reduced.width, reduced.height, reduced.exif);
            (rgb_from(w, h, reduced.grey, reduced.pixels)?, exif)
        }
        None if eighths == 8 => return Ok(None),
        // A feature the reduced decoder leaves to jpeg-decoder (progressive, say).
        None => {
            let to_u16 = |v: u32| u16::try_from(v).unwrap_or(u16::MAX);
            let (w, h) = decoder.scale(to_u16(want_w), to_u16(want_h)).map_err(jpeg_error)?;
            let pixels = decoder.decode().map_err(jpeg_error)?;
            (rgb_from(u32::from(w), u32::from(h), info.pixel_format == PixelFormat::L8, pixels)?, decoder.exif_data().map(<[u8]>::to_vec))
        }
    };
    let orientation = exif.as_deref().and_then(Orientation::from_exif_chunk).unwrap_or(Orientation::NoTransforms);
    let mut image = DynamicImage::ImageRgb8(image);
    image.apply_orientation(orientation);
    let turned =
        matches!(orientation, Orientation::Rotate90 | Orientation::Rotate270 | Orientation::Rotate90FlipH | Orientation::Rotate270FlipH);
    let (width, height) = if turned { (height, width) } else { (width, height) };
    Ok(Some(ScaledImage { image: image.into_rgb8(), width, height }))
}

/// Reduced scales the decoder is asked for, in eighths: 7/8 is left out,
/// its inverse DCT (7×7 from 49 coefficients) costing more than the full
/// size's with the resize saved (measured natively on a 512×600 photo:
/// 2.4 ms at 7/8 against 1.8 whole; 3/8 0.70 against 0.93 at 4/8).
const REDUCED_EIGHTHS: [usize; 6] = [1, 2, 3, 4, 5, 6];

/// The smallest scale, in eighths, whose size (each side rounded up, as
/// the decoder does) still covers `want_w`×`want_h` of a `width`×`height`
/// image; 8 (full size) when no reduced scale does.
fn eighths_for(width: u32, height: u32, want_w: u32, want_h: u32) -> usize {
    let covers = |n: usize| {
        let side = |full: u32| (u64::from(full) * n as u64).div_ceil(8);
        side(width) >= u64::from(want_w) && side(height) >= u64::from(want_h)
    };
    REDUCED_EIGHTHS.into_iter().find(|&n| covers(n)).unwrap_or(8)
}

/// Decoded pixels, grey or RGB, as an RGB image.
fn rgb_from(width: u32, height: u32, grey: bool, pixels: Vec<u8>) -> Result<RgbImage, ImageError> {
    let image = if grey {
        GrayImage::from_raw(width, height, pixels).map(|g| DynamicImage::ImageLuma8(g).into_rgb8())
    } else {
        RgbImage::from_raw(width, height, pixels)
    };
    image.ok_or_else(|| ImageError::Invalid("the JPEG decoder returned too few pixels".into()))
}

fn jpeg_error(error: jpeg_decoder::Error) -> ImageError {
    match error {
        jpeg_decoder::Error::Unsupported(feature) => ImageError::Unsupported(format!("JPEG feature {feature:?}")),
        other => ImageError::Invalid(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::{decode, encode_jpeg, letterbox};

    /// Smooth content (as photos mostly are), so a reduced decode and a full
    /// one resized should agree closely.
    fn photo_like(width: u32, height: u32) -> RgbImage {
        RgbImage::from_fn(width, height, |x, y| {
            let (fx, fy) = (x as f32 / width as f32, y as f32 / height as f32);
            let wave = ((fx * 9.0).sin() * (fy * 7.0).cos() * 100.0 + 128.0) as u8;
            image::Rgb([wave, (fx * 255.0) as u8, (fy * 255.0) as u8])
        })
    }

    /// Mean absolute difference of two equally sized letterboxes, per byte.
    fn mean_difference(a: &RgbImage, b: &RgbImage, side: u32) -> f64 {
        let (a, b) = (letterbox(a, side).expect("letterbox"), letterbox(b, side).expect("letterbox"));
        let total: u64 = a.pixels.iter().zip(&b.pixels).map(|(x, y)| u64::from(x.abs_diff(*y))).sum();
        total as f64 / a.pixels.len() as f64
    }

    /// An EXIF APP1 segment (big-endian TIFF) holding only an orientation tag.
    fn exif_orientation(value: u16) -> Vec<u8> {
        let mut tiff = b"MM\0\x2a\0\0\0\x08".to_vec();
        tiff.extend_from_slice(&1u16.to_be_bytes()); // one entry
        tiff.extend_from_slice(&0x0112u16.to_be_bytes()); // Orientation
        tiff.extend_from_slice(&3u16.to_be_bytes()); // SHORT
        tiff.extend_from_slice(&1u32.to_be_bytes());
        tiff.extend_from_slice(&value.to_be_bytes());
        tiff.extend_from_slice(&[0, 0, 0, 0, 0, 0]); // padding, next IFD 0
        let mut payload = b"Exif\0\0".to_vec();
        payload.extend_from_slice(&tiff);
        let mut segment = vec![0xFF, 0xE1];
        segment.extend_from_slice(&u16::try_from(payload.len() + 2).expect("short").to_be_bytes());
        segment.extend_from_slice(&payload);
        segment
    }

    #[test]
    fn a_large_jpeg_is_decoded_reduced_and_matches_the_full_decode() {
        let jpeg = encode_jpeg(&photo_like(2560, 1920), 92).expect("encode");
        let scaled = decode_for_letterbox(&jpeg, &ImageLimits::default(), 640).expect("scaled");
        assert_eq!((scaled.width, scaled.height), (2560, 1920));
        assert_eq!(scaled.image.dimensions(), (640, 480), "1/4 covers 640×480 exactly");
        assert_eq!(scaled.factors(), (4.0, 4.0));
        let full = decode(&jpeg, &ImageLimits::default()).expect("full");
        let difference = mean_difference(&scaled.image, &full, 640);
        assert!(difference < 2.0, "mean difference {difference:.2} per byte");
        // A larger letterbox needs more: 1/2.
        let scaled = decode_for_letterbox(&jpeg, &ImageLimits::default(), 1024).expect("scaled");
        assert_eq!(scaled.image.dimensions(), (1280, 960));
    }

    /// Scales between the powers of two: the smallest eighth that covers
    /// the letterbox, each side rounded up, and the letterbox close to the
    /// full decode's.
    #[test]
    fn the_smallest_eighth_that_covers_the_letterbox_is_taken() {
        for ((width, height), side, reduced) in
            [((1920, 1080), 640, (720, 405)), ((1000, 750), 640, (750, 563)), ((512, 600), 160, (192, 225)), ((1001, 751), 320, (376, 282))]
        {
            let jpeg = encode_jpeg(&photo_like(width, height), 92).expect("encode");
            let scaled = decode_for_letterbox(&jpeg, &ImageLimits::default(), side).expect("scaled");
            assert_eq!((scaled.width, scaled.height), (width, height));
            assert_eq!(scaled.image.dimensions(), reduced, "{width}×{height} for {side}");
            let full = decode(&jpeg, &ImageLimits::default()).expect("full");
            let difference = mean_difference(&scaled.image, &full, side);
            assert!(difference < 2.0, "{width}×{height} for {side}: mean difference {difference:.2} per byte");
        }
    }

    #[test]
    fn images_the_letterbox_needs_whole_are_decoded_whole() {
        let small = encode_jpeg(&photo_like(800, 600), 90).expect("encode");
        let scaled = decode_for_letterbox(&small, &ImageLimits::default(), 640).expect("decoded");
        assert!(!scaled.is_reduced(), "800 px for a 640 letterbox: 6/8 would not cover it, 7/8 is not used");
        assert_eq!(scaled.image, decode(&small, &ImageLimits::default()).expect("full"));
        // The SDK's own decoder at full size against the image crate's: rounding apart, the same pixels.
        let theirs = image::load_from_memory(&small).expect("image crate").into_rgb8();
        assert_eq!(scaled.image.dimensions(), theirs.dimensions());
        let total: u64 = scaled.image.as_raw().iter().zip(theirs.as_raw()).map(|(a, b)| u64::from(a.abs_diff(*b))).sum();
        let mean = total as f64 / theirs.as_raw().len() as f64;
        assert!(mean < 0.5, "mean difference {mean:.3} levels");
        let mut png = Vec::new();
        photo_like(2000, 1500).write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).expect("png");
        let scaled = decode_for_letterbox(&png, &ImageLimits::default(), 640).expect("png");
        assert_eq!((scaled.image.dimensions(), scaled.width), ((2000, 1500), 2000));
    }

    #[test]
    fn exif_orientation_is_applied_to_the_reduced_image_and_the_size() {
        let plain = encode_jpeg(&photo_like(2560, 1920), 92).expect("encode");
        let mut rotated = plain[..2].to_vec(); // SOI
        rotated.extend_from_slice(&exif_orientation(6)); // rotate 90° clockwise
        rotated.extend_from_slice(&plain[2..]);
        let scaled = decode_for_letterbox(&rotated, &ImageLimits::default(), 640).expect("scaled");
        assert_eq!((scaled.width, scaled.height), (1920, 2560));
        assert_eq!(scaled.image.dimensions(), (480, 640));
        let full = decode(&rotated, &ImageLimits::default()).expect("full");
        assert_eq!(full.dimensions(), (1920, 2560));
        // Turned as the image crate turns it.
        let mut theirs =
            image::ImageReader::new(std::io::Cursor::new(&rotated)).with_guessed_format().expect("format").into_decoder().expect("decoder");
        let orientation = image::ImageDecoder::orientation(&mut theirs).expect("orientation");
        let mut theirs = DynamicImage::from_decoder(theirs).expect("image crate");
        theirs.apply_orientation(orientation);
        let total: u64 = full.as_raw().iter().zip(theirs.into_rgb8().as_raw()).map(|(a, b)| u64::from(a.abs_diff(*b))).sum();
        assert!(total as f64 / (full.as_raw().len() as f64) < 0.5, "the same pixels, the same way up");
        let difference = mean_difference(&scaled.image, &full, 640);
        assert!(difference < 2.0, "mean difference {difference:.2} per byte");
    }

    #[test]
    fn limits_and_errors_are_those_of_decode() {
        let jpeg = encode_jpeg(&photo_like(2560, 1920), 80).expect("encode");
        let limits = ImageLimits { max_pixels: 1_000_000, ..ImageLimits::default() };
        let error = decode_for_letterbox(&jpeg, &limits, 640).expect_err("too large");
        assert_eq!((error.status(), error.code()), (413, "image_too_large"));
        let error = decode_for_letterbox(&jpeg[..jpeg.len() / 2], &ImageLimits::default(), 640).expect_err("truncated");
        assert_eq!((error.status(), error.code()), (400, "invalid_image"));
        let error = decode_for_letterbox(b"GIF89a....", &ImageLimits::default(), 640).expect_err("gif");
        assert_eq!(error.status(), 415);
    }
}
