//! facegate handler `crop`: `POST` an image (raw body or the form field
//! `image`), get each face as a JPEG crop, base64-encoded, in JSON.
//!
//! Query parameters: those of `detect` (`threshold`, `max_faces`, `size`),
//! plus `quality` (JPEG quality 1..=100, default 85) and `margin` (how much
//! to grow each box, as a fraction of its size, 0..=1, default 0.2). The
//! answer is the `detect` JSON where each face also has `"crop":{"x","y",
//! "width","height","jpeg_base64"}`.

use std::time::Instant;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use facegate_guest_sdk::effects::{OutputOptions, crop, face_region};
use facegate_guest_sdk::image::encode_jpeg;
use facegate_guest_sdk::serde_json::json;
use facegate_guest_sdk::{DetectOptions, Error, Handler, Request, Response, detect, export_handler};

/// The handler (POST only, bodies up to 16 MiB).
struct Crop;

impl Handler for Crop {
    fn handle(request: Request) -> Result<Response, Error> {
        let query = request.query();
        let options = DetectOptions::from_query(query)?;
        let OutputOptions { quality, margin } = OutputOptions::from_query(query, 0.2)?;
        let detection = detect(request.image_bytes()?, &options)?;

        let start = Instant::now();
        let mut body = detection.to_json();
        let size = detection.image.dimensions();
        if let Some(faces) = body["faces"].as_array_mut() {
            for (json, face) in faces.iter_mut().zip(&detection.faces) {
                let Some(region) = face_region(face, margin, size) else {
                    continue;
                };
                let jpeg = encode_jpeg(&crop(&detection.image, region), quality)?;
                json["crop"] = json!({
                    "x": region.x, "y": region.y, "width": region.width, "height": region.height,
                    "jpeg_base64": STANDARD.encode(jpeg),
                });
            }
        }
        let timing = format!("{}, crop_encode;dur={:.2}", detection.timings.server_timing(), start.elapsed().as_secs_f64() * 1000.0);
        Ok(Response::json(200, &body).with_header("server-timing", timing))
    }
}

export_handler!(Crop);
