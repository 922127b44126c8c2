//! Bounded image decoding, letterboxing to the model's input, JPEG encoding.
//!
//! [`decode`] reads the header first and refuses an image whose dimensions
//! exceed [`ImageLimits`] before any pixel buffer exists; the decoder then
//! runs under `image::Limits` as a second fence. [`letterbox`] scales the
//! image to fit a square (aspect kept, bilinear, PIL-compatible), places it at
//! the top-left and pads with zeros: the `u8` HWC RGB tensor the host's
//! `centerface` model takes.

use std::io::Cursor;

use fast_image_resize as fr;
use image::metadata::Orientation;
use image::{DynamicImage, ImageDecoder, ImageReader};

use crate::face_detect::{ElementType, Tensor};

#[cfg_attr(
    not(all(target_arch = "wasm32", target_feature = "simd128")),
    allow(dead_code, reason = "used in wasm only (natively fast_image_resize's AVX2 path is faster); built natively for its tests")
)]
mod bilinear;
mod f32x4;
mod plain_png;
mod reduced_jpeg;
mod scaled;
#[cfg_attr(not(all(target_arch = "wasm32", target_feature = "simd128")), allow(dead_code, reason = "only bilinear uses it"))]
mod u8x16;
pub use scaled::{ScaledImage, decode_for_letterbox};

/// Decoded RGB image, 8 bits per channel (re-exported from the `image` crate).
pub use image::RgbImage;

/// Default [`ImageLimits::max_side`]: 8192 pixels.
pub const DEFAULT_MAX_SIDE: u32 = 8192;
/// Default [`ImageLimits::max_pixels`]: 24 megapixels. Sized to the host's
/// default 256 MiB instance memory: a 24 MP RGBA decode (96 MB) plus its RGB
/// copy (72 MB), the body and the letterbox still fit, so an oversized image
/// is a 413 rather than a memory-limit trap.
pub const DEFAULT_MAX_PIXELS: u64 = 24_000_000;
/// Default [`ImageLimits::max_alloc`]: 100 MiB (a 24 MP RGBA image is 96 MB).
pub const DEFAULT_MAX_ALLOC: u64 = 100 << 20;
/// Default letterbox side: the 640×640 input the reference detections use.
pub const DEFAULT_LETTERBOX_SIDE: u32 = 640;
/// Letterbox sides must be multiples of this (CenterFace's total stride).
pub const SIDE_MULTIPLE: u32 = 32;

/// The largest image [`decode`] accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// Largest width or height, in pixels.
    pub max_side: u32,
    /// Largest width × height.
    pub max_pixels: u64,
    /// Most bytes the decoder may allocate for the decoded image.
    pub max_alloc: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        Self { max_side: DEFAULT_MAX_SIDE, max_pixels: DEFAULT_MAX_PIXELS, max_alloc: DEFAULT_MAX_ALLOC }
    }
}

/// An image format [`decode`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// JPEG (baseline and progressive).
    Jpeg,
    /// PNG (any bit depth; alpha is dropped).
    Png,
    /// WebP (lossy and lossless; alpha is dropped).
    WebP,
}

impl ImageFormat {
    /// The media type, e.g. `image/jpeg`.
    pub fn mime(self) -> &'static str {
        match self {
            Self::Jpeg => "image/jpeg",
            Self::Png => "image/png",
            Self::WebP => "image/webp",
        }
    }

    fn to_image_crate(self) -> image::ImageFormat {
        match self {
            Self::Jpeg => image::ImageFormat::Jpeg,
            Self::Png => image::ImageFormat::Png,
            Self::WebP => image::ImageFormat::WebP,
        }
    }
}

/// What an image's header says, read without decoding pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    /// The format, from the leading bytes.
    pub format: ImageFormat,
    /// Width in pixels, as stored (before any EXIF orientation).
    pub width: u32,
    /// Height in pixels, as stored (before any EXIF orientation).
    pub height: u32,
}

/// Why an image could not be decoded, letterboxed or encoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ImageError {
    /// The bytes are not a JPEG, PNG or WebP image (415).
    #[error("the body is not a JPEG, PNG or WebP image ({0})")]
    Unsupported(String),
    /// The image is truncated or corrupt (400).
    #[error("the image cannot be decoded: {0}")]
    Invalid(String),
    /// The image is larger than the limits allow (413).
    #[error("the image is {width}×{height} pixels, over the limit of {limit}")]
    TooLarge {
        /// Width from the header.
        width: u32,
        /// Height from the header.
        height: u32,
        /// The limit it breaks, in words.
        limit: String,
    },
    /// The letterbox side is not a positive multiple of 32 (400).
    #[error("letterbox side {0} is not a positive multiple of 32")]
    InvalidSide(u32),
    /// The image could not be encoded (500).
    #[error("the image cannot be encoded: {0}")]
    Encode(String),
}

impl ImageError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> u16 {
        match self {
            Self::Unsupported(_) => 415,
            Self::Invalid(_) | Self::InvalidSide(_) => 400,
            Self::TooLarge { .. } => 413,
            Self::Encode(_) => 500,
        }
    }

    /// The stable `snake_case` code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Unsupported(_) => "unsupported_image",
            Self::Invalid(_) => "invalid_image",
            Self::TooLarge { .. } => "image_too_large",
            Self::InvalidSide(_) => "invalid_parameter",
            Self::Encode(_) => "encode_failed",
        }
    }
}

/// Tells the format from the leading bytes; anything but JPEG, PNG and
/// WebP is [`ImageError::Unsupported`].
pub fn sniff_format(bytes: &[u8]) -> Result<ImageFormat, ImageError> {
    match image::guess_format(bytes) {
        Ok(image::ImageFormat::Jpeg) => Ok(ImageFormat::Jpeg),
        Ok(image::ImageFormat::Png) => Ok(ImageFormat::Png),
        Ok(image::ImageFormat::WebP) => Ok(ImageFormat::WebP),
        Ok(other) => Err(ImageError::Unsupported(format!("{other:?} is not supported"))),
        Err(_) => Err(ImageError::Unsupported("unrecognised leading bytes".into())),
    }
}

/// Reads the format and dimensions from the header, without decoding
/// pixels, and checks them against `limits`.
pub fn probe(bytes: &[u8], limits: &ImageLimits) -> Result<ImageInfo, ImageError> {
    let format = sniff_format(bytes)?;
    check_header(bytes, format, limits)?;
    let decoder = open_decoder(bytes, format, limits)?;
    let (width, height) = decoder.dimensions();
    check_dimensions(width, height, limits)?;
    Ok(ImageInfo { format, width, height })
}

/// Decodes a JPEG, PNG or WebP image into RGB, applying its EXIF
/// orientation.
///
/// The header's dimensions are checked against `limits` before any pixel
/// buffer is allocated: a header claiming 30000×30000 is refused with
/// [`ImageError::TooLarge`] at once.
pub fn decode(bytes: &[u8], limits: &ImageLimits) -> Result<RgbImage, ImageError> {
    let format = sniff_format(bytes)?;
    check_header(bytes, format, limits)?;
    // Baseline JPEGs (what cameras write) by this crate's decoder.
    if format == ImageFormat::Jpeg
        && let Some(image) = scaled::decode_jpeg_whole(bytes, limits)?
    {
        return Ok(image);
    }
    decode_checked(bytes, format, limits)
}

/// [`decode`] once the format is known and the raw header passed [`check_header`].
fn decode_checked(bytes: &[u8], format: ImageFormat, limits: &ImageLimits) -> Result<RgbImage, ImageError> {
    // 8-bit, non-interlaced PNGs (most of them) by this crate's decoder.
    if format == ImageFormat::Png
        && let Some(image) = plain_png::decode(bytes, limits)?
    {
        return Ok(image);
    }
    let mut decoder = open_decoder(bytes, format, limits)?;
    let (width, height) = decoder.dimensions();
    check_dimensions(width, height, limits)?;
    check_alloc(decoder.total_bytes(), width, height, limits)?;
    decoder.set_limits(decoder_limits(limits)).map_err(|e| map_image_error(e, Some((width, height))))?;
    let orientation = decoder.orientation().unwrap_or(Orientation::NoTransforms);
    let mut image = DynamicImage::from_decoder(decoder).map_err(|e| map_image_error(e, Some((width, height))))?;
    image.apply_orientation(orientation);
    Ok(image.into_rgb8())
}

/// Opens a decoder and reads the header only. No dimension limit yet (so
/// that ours, with its typed error, applies), but an allocation limit for
/// whatever the header parsing itself reserves.
fn open_decoder<'a>(bytes: &'a [u8], format: ImageFormat, limits: &ImageLimits) -> Result<impl ImageDecoder + 'a, ImageError> {
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format.to_image_crate());
    let mut header_limits = image::Limits::no_limits();
    header_limits.max_alloc = Some(limits.max_alloc);
    reader.limits(header_limits);
    reader.into_decoder().map_err(|e| map_image_error(e, None))
}

/// Checks what the raw header says before any decoder runs: the declared
/// dimensions (PNG, JPEG) against `limits`, and that a JPEG is complete
/// (its decoder would otherwise fill a truncated scan with grey).
fn check_header(bytes: &[u8], format: ImageFormat, limits: &ImageLimits) -> Result<(), ImageError> {
    match format {
        ImageFormat::Png => match png_dimensions(bytes) {
            Some((width, height)) => check_dimensions(width, height, limits),
            None => Err(ImageError::Invalid("PNG header is truncated".into())),
        },
        ImageFormat::Jpeg => {
            let frame = jpeg_frame(bytes).ok_or_else(|| ImageError::Invalid("JPEG has no frame and scan headers".into()))?;
            check_dimensions(frame.width, frame.height, limits)?;
            // From the end, where a complete file has it: found at once.
            if memchr::memmem::rfind(bytes.get(frame.scan_start..).unwrap_or_default(), &[0xFF, 0xD9]).is_none() {
                return Err(ImageError::Invalid("JPEG is truncated (no end-of-image marker after the scan)".into()));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Width and height from a PNG's IHDR chunk (bytes 16..24).
fn png_dimensions(bytes: &[u8]) -> Option<(u32, u32)> {
    let ihdr = bytes.get(12..24).filter(|h| &h[..4] == b"IHDR")?;
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    Some((be(&ihdr[4..8]), be(&ihdr[8..12])))
}

/// A JPEG's frame size and where its first scan's entropy-coded data starts.
struct JpegFrame {
    width: u32,
    height: u32,
    scan_start: usize,
}

/// Walks a JPEG's marker segments up to the first start-of-scan.
fn jpeg_frame(bytes: &[u8]) -> Option<JpegFrame> {
    let be16 = |at: usize| Some(u32::from(u16::from_be_bytes([*bytes.get(at)?, *bytes.get(at + 1)?])));
    let (mut at, mut size) = (2, None);
    loop {
        if *bytes.get(at)? != 0xFF {
            return None;
        }
        let marker = *bytes.get(at + 1)?;
        at += 2;
        if marker == 0xFF || (0xD0..=0xD8).contains(&marker) || marker == 0x01 {
            // Fill byte or a marker without a length.
            at -= usize::from(marker == 0xFF);
            continue;
        }
        let len = usize::try_from(be16(at)?).ok()?;
        if is_start_of_frame(marker) {
            size = Some((be16(at + 5)?, be16(at + 3)?));
        }
        if marker == 0xDA {
            let (width, height) = size?;
            return Some(JpegFrame { width, height, scan_start: at + len });
        }
        at += len;
    }
}

/// SOF0..SOF15, except DHT (C4), JPG (C8) and DAC (CC).
fn is_start_of_frame(marker: u8) -> bool {
    (0xC0..=0xCF).contains(&marker) && !matches!(marker, 0xC4 | 0xC8 | 0xCC)
}

/// The `image::Limits` the decoder runs under once the header passed.
fn decoder_limits(limits: &ImageLimits) -> image::Limits {
    let mut decoder_limits = image::Limits::default();
    decoder_limits.max_image_width = Some(limits.max_side);
    decoder_limits.max_image_height = Some(limits.max_side);
    decoder_limits.max_alloc = Some(limits.max_alloc);
    decoder_limits
}

fn check_dimensions(width: u32, height: u32, limits: &ImageLimits) -> Result<(), ImageError> {
    let too_large = |limit: String| ImageError::TooLarge { width, height, limit };
    if width == 0 || height == 0 {
        return Err(ImageError::Invalid(format!("the header says {width}×{height} pixels")));
    }
    if width > limits.max_side || height > limits.max_side {
        return Err(too_large(format!("{} pixels per side", limits.max_side)));
    }
    if u64::from(width) * u64::from(height) > limits.max_pixels {
        return Err(too_large(format!("{} pixels in all", limits.max_pixels)));
    }
    Ok(())
}

fn check_alloc(bytes: u64, width: u32, height: u32, limits: &ImageLimits) -> Result<(), ImageError> {
    if bytes > limits.max_alloc {
        return Err(ImageError::TooLarge { width, height, limit: format!("{} bytes decoded ({bytes} needed)", limits.max_alloc) });
    }
    Ok(())
}

fn map_image_error(error: image::ImageError, dims: Option<(u32, u32)>) -> ImageError {
    use image::ImageError as E;
    match error {
        E::Unsupported(e) => ImageError::Unsupported(e.to_string()),
        E::Limits(e) => {
            let (width, height) = dims.unwrap_or((0, 0));
            ImageError::TooLarge { width, height, limit: e.to_string() }
        }
        E::Decoding(e) => ImageError::Invalid(e.to_string()),
        E::IoError(e) => ImageError::Invalid(e.to_string()),
        E::Parameter(e) => ImageError::Invalid(e.to_string()),
        E::Encoding(e) => ImageError::Encode(e.to_string()),
    }
}

/// An image scaled into a square, zero-padded model input.
///
/// The image (aspect kept) occupies the top-left `width × height` pixels of
/// the `side × side` canvas; a point `(x, y)` on the canvas is
/// `(x / scale, y / scale)` in the original image.
#[derive(Debug, Clone, PartialEq)]
pub struct Letterbox {
    /// `side × side × 3` bytes, RGB, row-major (HWC).
    pub pixels: Vec<u8>,
    /// Side of the square canvas, a multiple of 32.
    pub side: u32,
    /// Original pixels → canvas pixels: `min(side / width, side / height)`.
    pub scale: f32,
    /// Width of the scaled image on the canvas.
    pub width: u32,
    /// Height of the scaled image on the canvas.
    pub height: u32,
}

impl Letterbox {
    /// The canvas as the `[side, side, 3]` `u8` tensor `infer` takes.
    pub fn into_tensor(self) -> Tensor {
        Tensor { shape: vec![self.side, self.side, 3], element: ElementType::U8, data: self.pixels }
    }

    /// Maps a canvas point back to original-image pixels.
    pub fn to_source(&self, x: f32, y: f32) -> (f32, f32) {
        (x / self.scale, y / self.scale)
    }
}

/// The scale and scaled size of a `width × height` image letterboxed into
/// `side × side`: `scale = min(side / width, side / height)`, sizes rounded
/// and kept within `1..=side`.
pub fn letterbox_geometry(width: u32, height: u32, side: u32) -> (f32, u32, u32) {
    let scale = (f64::from(side) / f64::from(width)).min(f64::from(side) / f64::from(height));
    let scaled = |v: u32| ((f64::from(v) * scale).round() as u32).clamp(1, side);
    (scale as f32, scaled(width), scaled(height))
}

/// Scales `image` to fit `side × side` (bilinear, aspect kept), places it at
/// the top-left of a zero canvas, and returns the canvas with its scale.
pub fn letterbox(image: &RgbImage, side: u32) -> Result<Letterbox, ImageError> {
    if side == 0 || !side.is_multiple_of(SIDE_MULTIPLE) {
        return Err(ImageError::InvalidSide(side));
    }
    let (scale, width, height) = letterbox_geometry(image.width(), image.height(), side);
    let mut pixels = vec![0u8; side as usize * side as usize * 3];
    if (width, height) == image.dimensions() {
        copy_rows(image, &mut pixels, side);
    } else {
        resize_into(image, &mut pixels, side, width, height)?;
    }
    Ok(Letterbox { pixels, side, scale, width, height })
}

/// Copies an image that needs no scaling to the canvas's top-left.
fn copy_rows(image: &RgbImage, canvas: &mut [u8], side: u32) {
    let row = image.width() as usize * 3;
    let stride = side as usize * 3;
    for (src, dst) in image.as_raw().chunks_exact(row).zip(canvas.chunks_exact_mut(stride)) {
        dst[..row].copy_from_slice(src);
    }
}

/// Resizes `image` into the top-left `width × height` of the canvas.
/// In wasm with `simd128`, enlargements go to [`bilinear`].
fn resize_into(image: &RgbImage, canvas: &mut [u8], side: u32, width: u32, height: u32) -> Result<(), ImageError> {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    if bilinear::can_enlarge(image.dimensions(), (width, height)) {
        bilinear::enlarge(image.as_raw(), image.dimensions(), canvas, side as usize * 3, (width, height));
        return Ok(());
    }
    let internal = |e: &dyn std::fmt::Display| ImageError::Invalid(format!("resize: {e}"));
    let src = fr::images::ImageRef::new(image.width(), image.height(), image.as_raw(), fr::PixelType::U8x3).map_err(|e| internal(&e))?;
    let mut dst = fr::images::Image::from_slice_u8(side, side, canvas, fr::PixelType::U8x3).map_err(|e| internal(&e))?;
    let mut view = fr::images::CroppedImageMut::new(&mut dst, 0, 0, width, height).map_err(|e| internal(&e))?;
    let options = fr::ResizeOptions::new().resize_alg(fr::ResizeAlg::Convolution(fr::FilterType::Bilinear));
    fr::Resizer::new().resize(&src, &mut view, &options).map_err(|e| internal(&e))
}

/// Encodes `image` as a baseline JPEG of the given quality (1–100).
pub fn encode_jpeg(image: &RgbImage, quality: u8) -> Result<Vec<u8>, ImageError> {
    let mut out = Vec::with_capacity(image.as_raw().len() / 8);
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality.clamp(1, 100))
        .encode_image(image)
        .map_err(|e| ImageError::Encode(e.to_string()))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient(width: u32, height: u32) -> RgbImage {
        RgbImage::from_fn(width, height, |x, y| image::Rgb([(x % 256) as u8, (y % 256) as u8, 128]))
    }

    fn encode_png(image: &RgbImage) -> Vec<u8> {
        let mut out = Vec::new();
        image.write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png).expect("encode png");
        out
    }

    /// CRC-32 (IEEE), enough to forge a PNG chunk in tests.
    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = 0xffff_ffffu32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
            }
        }
        !crc
    }

    /// A PNG whose IHDR claims `width × height`, with a tiny (bogus) IDAT.
    fn png_claiming(width: u32, height: u32) -> Vec<u8> {
        let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
        let mut chunk = |kind: &[u8], data: &[u8]| {
            png.extend_from_slice(&(data.len() as u32).to_be_bytes());
            let mut body = kind.to_vec();
            body.extend_from_slice(data);
            png.extend_from_slice(&body);
            png.extend_from_slice(&crc32(&body).to_be_bytes());
        };
        let mut ihdr = width.to_be_bytes().to_vec();
        ihdr.extend_from_slice(&height.to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB
        chunk(b"IHDR", &ihdr);
        chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]);
        chunk(b"IEND", &[]);
        png
    }

    /// A real JPEG whose SOF0 header is patched to claim `width × height`.
    fn jpeg_claiming(width: u16, height: u16) -> Vec<u8> {
        let mut jpeg = encode_jpeg(&gradient(16, 16), 90).expect("encode");
        let sof = jpeg.windows(2).position(|w| w == [0xff, 0xc0]).expect("SOF0");
        jpeg[sof + 5..sof + 7].copy_from_slice(&height.to_be_bytes());
        jpeg[sof + 7..sof + 9].copy_from_slice(&width.to_be_bytes());
        jpeg
    }

    #[test]
    fn decodes_png_and_jpeg() {
        let image = gradient(40, 30);
        let png = decode(&encode_png(&image), &ImageLimits::default()).expect("png");
        assert_eq!(png, image);
        let jpeg = decode(&encode_jpeg(&image, 90).expect("jpeg"), &ImageLimits::default());
        assert_eq!(jpeg.expect("decode jpeg").dimensions(), (40, 30));
    }

    #[test]
    fn huge_png_header_is_refused_before_decoding() {
        let error = decode(&png_claiming(30000, 30000), &ImageLimits::default()).expect_err("must fail");
        assert_eq!(error.status(), 413);
        assert_eq!(error.code(), "image_too_large");
        assert!(error.to_string().contains("30000×30000"), "{error}");
    }

    #[test]
    fn huge_jpeg_header_is_refused_before_decoding() {
        let error = decode(&jpeg_claiming(30000, 30000), &ImageLimits::default()).expect_err("must fail");
        assert!(matches!(error, ImageError::TooLarge { width: 30000, height: 30000, .. }), "{error}");
    }

    #[test]
    fn pixel_count_limit_applies_below_the_side_limit() {
        let limits = ImageLimits { max_pixels: 1000, ..ImageLimits::default() };
        let error = probe(&encode_png(&gradient(40, 30)), &limits).expect_err("must fail");
        assert!(matches!(error, ImageError::TooLarge { width: 40, height: 30, .. }));
        let info = probe(&encode_png(&gradient(20, 30)), &limits).expect("fits");
        assert_eq!((info.format, info.width, info.height), (ImageFormat::Png, 20, 30));
    }

    #[test]
    fn alloc_limit_is_checked_from_the_header() {
        let limits = ImageLimits { max_alloc: 100, ..ImageLimits::default() };
        let error = decode(&encode_png(&gradient(40, 30)), &limits).expect_err("must fail");
        assert_eq!(error.code(), "image_too_large");
    }

    #[test]
    fn non_images_are_unsupported_and_truncated_images_invalid() {
        let error = decode(b"hello, world", &ImageLimits::default()).expect_err("must fail");
        assert_eq!((error.status(), error.code()), (415, "unsupported_image"));
        let gif = decode(b"GIF89a\x01\x00\x01\x00", &ImageLimits::default()).expect_err("must fail");
        assert_eq!(gif.code(), "unsupported_image");
        let png = encode_png(&gradient(64, 64));
        let error = decode(&png[..png.len() / 2], &ImageLimits::default()).expect_err("must fail");
        assert_eq!((error.status(), error.code()), (400, "invalid_image"));
        let error = decode(&png[..20], &ImageLimits::default()).expect_err("must fail");
        assert_eq!(error.code(), "invalid_image");
    }

    #[test]
    fn letterbox_geometry_fits_the_longer_side() {
        assert_eq!(letterbox_geometry(512, 600, 640), (640.0 / 600.0, 546, 640));
        assert_eq!(letterbox_geometry(800, 564, 640), (0.8, 640, 451));
        assert_eq!(letterbox_geometry(512, 512, 640), (1.25, 640, 640));
        assert_eq!(letterbox_geometry(10_000, 1, 640).2, 1);
    }

    #[test]
    fn letterbox_places_the_image_top_left_and_pads_with_zeros() {
        let image = RgbImage::from_pixel(100, 50, image::Rgb([200, 100, 50]));
        let boxed = letterbox(&image, 64).expect("letterbox");
        assert_eq!((boxed.side, boxed.width, boxed.height), (64, 64, 32));
        assert!((boxed.scale - 0.64).abs() < 1e-6);
        let px = |x: usize, y: usize| &boxed.pixels[(y * 64 + x) * 3..(y * 64 + x) * 3 + 3];
        assert_eq!(px(0, 0), [200, 100, 50]);
        assert_eq!(px(63, 31), [200, 100, 50]);
        assert_eq!(px(0, 32), [0, 0, 0]);
        assert_eq!(px(63, 63), [0, 0, 0]);
        assert_eq!(boxed.to_source(64.0, 32.0), (100.0, 50.0));
        let tensor = boxed.into_tensor();
        assert_eq!((tensor.shape, tensor.data.len()), (vec![64, 64, 3], 64 * 64 * 3));
    }

    #[test]
    fn letterbox_without_scaling_copies_rows() {
        let image = gradient(32, 20);
        let boxed = letterbox(&image, 32).expect("letterbox");
        assert_eq!((boxed.width, boxed.height, boxed.scale), (32, 20, 1.0));
        assert_eq!(&boxed.pixels[..32 * 20 * 3], image.as_raw().as_slice());
        assert!(boxed.pixels[32 * 20 * 3..].iter().all(|&v| v == 0));
    }

    #[test]
    fn letterbox_rejects_sides_that_are_not_multiples_of_32() {
        let image = gradient(8, 8);
        assert_eq!(letterbox(&image, 100).expect_err("must fail"), ImageError::InvalidSide(100));
        assert_eq!(letterbox(&image, 0).expect_err("must fail"), ImageError::InvalidSide(0));
    }

    #[test]
    fn truncated_jpeg_is_invalid_and_complete_one_passes() {
        let mut jpeg = vec![
            0xFF, 0xD8, // SOI
            0xFF, 0xC0, 0x00, 0x11, 8, 0x00, 0x10, 0x00, 0x20, 3, 1, 0x11, 0, 2, 0x11, 0, 3, 0x11, 0, // SOF0 32x16
            0xFF, 0xDA, 0x00, 0x0C, 3, 1, 0, 2, 0x11, 3, 0x11, 0, 63, 0, // SOS
            0x12, 0x34, 0x56, // scan data, cut short
        ];
        let limits = ImageLimits::default();
        let frame = jpeg_frame(&jpeg).unwrap();
        assert_eq!((frame.width, frame.height), (32, 16));
        let err = check_header(&jpeg, ImageFormat::Jpeg, &limits).unwrap_err();
        assert!(matches!(&err, ImageError::Invalid(m) if m.contains("truncated")), "{err}");
        jpeg.extend([0xFF, 0xD9]);
        assert!(check_header(&jpeg, ImageFormat::Jpeg, &limits).is_ok());
    }

    #[test]
    fn png_header_dimensions_are_checked_before_decoding() {
        let mut png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR".to_vec();
        png.extend(30_000u32.to_be_bytes());
        png.extend(20_000u32.to_be_bytes());
        let err = check_header(&png, ImageFormat::Png, &ImageLimits::default()).unwrap_err();
        assert!(matches!(err, ImageError::TooLarge { width: 30_000, height: 20_000, .. }));
    }
}
