//! What handlers do with faces besides listing them: blur them, crop them.

use std::time::Instant;

use ::image::imageops;

use crate::centerface::Face;
use crate::http::{HttpError, Query, Request, Response};
use crate::image::{RgbImage, encode_jpeg};
use crate::{DetectOptions, Error, detect};

/// Output settings shared by the image-producing handlers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutputOptions {
    /// JPEG quality, 1..=100 (query `quality`, default 85).
    pub quality: u8,
    /// How far to grow each face box, as a fraction of its size (query `margin`, 0..=1).
    pub margin: f32,
}

impl OutputOptions {
    /// Reads `quality` and `margin` from the query; invalid values are a 400 naming the parameter.
    pub fn from_query(query: &Query, default_margin: f32) -> Result<Self, HttpError> {
        let quality = query.parse_or("quality", 85u8, "an integer from 1 to 100", |q| (1..=100).contains(&q))?;
        let margin = query.parse_or("margin", default_margin, "a number from 0 to 1", |m| (0.0..=1.0).contains(&m))?;
        Ok(Self { quality, margin })
    }
}

/// The `blur` answer: detect (query `threshold`, `max_faces`, `size`), blur
/// every face grown by `margin` (default 0.1), encode as JPEG (`quality`);
/// `image/jpeg` with `X-Faces` (the count) and `Server-Timing`. The Rust
/// example `guests/blur` and the pipeline component both answer with it.
pub fn blur_response(request: &Request) -> Result<Response, Error> {
    let query = request.query();
    let options = DetectOptions::from_query(query)?;
    let OutputOptions { quality, margin } = OutputOptions::from_query(query, 0.1)?;
    let mut detection = detect(request.image_bytes()?, &options)?;
    let start = Instant::now();
    blur_faces(&mut detection.image, &detection.faces, margin);
    let jpeg = encode_jpeg(&detection.image, quality)?;
    let timing = format!("{}, blur_encode;dur={:.2}", detection.timings.server_timing(), start.elapsed().as_secs_f64() * 1000.0);
    Ok(Response::bytes(200, "image/jpeg", jpeg)
        .with_header("x-faces", detection.faces.len().to_string())
        .with_header("server-timing", timing))
}

/// A pixel rectangle inside an image: `x, y` top-left, `width × height`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Left edge.
    pub x: u32,
    /// Top edge.
    pub y: u32,
    /// Width, at least 1.
    pub width: u32,
    /// Height, at least 1.
    pub height: u32,
}

/// The face's box grown by `margin` × its size on every side, rounded
/// outwards and clipped to the image; `None` if nothing is left.
pub fn face_region(face: &Face, margin: f32, (image_width, image_height): (u32, u32)) -> Option<Region> {
    let (mx, my) = (face.width() * margin, face.height() * margin);
    let x1 = (face.bbox[0] - mx).floor().max(0.0) as u32;
    let y1 = (face.bbox[1] - my).floor().max(0.0) as u32;
    let x2 = ((face.bbox[2] + mx).ceil().max(0.0) as u32).min(image_width);
    let y2 = ((face.bbox[3] + my).ceil().max(0.0) as u32).min(image_height);
    (x2 > x1 && y2 > y1).then(|| Region { x: x1, y: y1, width: x2 - x1, height: y2 - y1 })
}

/// Blurs each face's region (grown by `margin`) in place, strongly enough
/// that it cannot be recognised: a Gaussian-like blur (three box passes)
/// with sigma a fifth of the region's larger side.
pub fn blur_faces(image: &mut RgbImage, faces: &[Face], margin: f32) {
    for face in faces {
        if let Some(region) = face_region(face, margin, image.dimensions()) {
            blur_region(image, region);
        }
    }
}

/// Blurs one region of the image in place.
pub fn blur_region(image: &mut RgbImage, region: Region) {
    let sigma = (region.width.max(region.height) as f32 / 5.0).max(2.0);
    let patch = crop(image, region);
    let blurred = imageops::fast_blur(&patch, sigma);
    imageops::replace(image, &blurred, i64::from(region.x), i64::from(region.y));
}

/// Copies a region out of the image.
pub fn crop(image: &RgbImage, region: Region) -> RgbImage {
    imageops::crop_imm(image, region.x, region.y, region.width, region.height).to_image()
}

/// Each face cropped (grown by `margin`), in the order given; faces with
/// nothing left after clipping are skipped.
pub fn crop_faces(image: &RgbImage, faces: &[Face], margin: f32) -> Vec<(Region, RgbImage)> {
    faces.iter().filter_map(|face| face_region(face, margin, image.dimensions())).map(|region| (region, crop(image, region))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn face(bbox: [f32; 4]) -> Face {
        Face { bbox, score: 0.9, landmarks: [[0.0; 2]; 5] }
    }

    #[test]
    fn regions_grow_round_outwards_and_clip() {
        let region = face_region(&face([10.2, 20.7, 30.1, 40.0]), 0.0, (100, 100));
        assert_eq!(region, Some(Region { x: 10, y: 20, width: 21, height: 20 }));
        let grown = face_region(&face([10.0, 10.0, 30.0, 30.0]), 0.5, (35, 100));
        assert_eq!(grown, Some(Region { x: 0, y: 0, width: 35, height: 40 }));
        assert_eq!(face_region(&face([50.0, 50.0, 50.0, 60.0]), 0.0, (100, 100)), None);
    }

    #[test]
    fn blur_changes_only_the_face_region() {
        let mut image = RgbImage::from_fn(64, 64, |x, y| {
            let v = if (x + y) % 2 == 0 { 255 } else { 0 };
            ::image::Rgb([v, v, v])
        });
        let original = image.clone();
        blur_faces(&mut image, &[face([16.0, 16.0, 32.0, 32.0])], 0.0);
        assert_eq!(image.get_pixel(0, 0), original.get_pixel(0, 0));
        assert_eq!(image.get_pixel(40, 40), original.get_pixel(40, 40));
        let centre = image.get_pixel(24, 24).0[0];
        assert!((64..=192).contains(&centre), "checkerboard should average out, got {centre}");
    }

    #[test]
    fn crops_have_the_region_size() {
        let image = RgbImage::from_fn(50, 40, |x, y| ::image::Rgb([x as u8, y as u8, 0]));
        let crops = crop_faces(&image, &[face([10.0, 5.0, 20.0, 25.0]), face([60.0, 60.0, 70.0, 70.0])], 0.0);
        assert_eq!(crops.len(), 1);
        let (region, crop) = &crops[0];
        assert_eq!((crop.width(), crop.height()), (region.width, region.height));
        assert_eq!(crop.get_pixel(0, 0).0, [10, 5, 0]);
    }
}
