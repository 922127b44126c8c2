//! facegate handler `blur`: `POST` an image (raw body or the form field
//! `image`), get it back as a JPEG with every face blurred.
//!
//! Query parameters: those of `detect` (`threshold`, `max_faces`, `size`),
//! plus `quality` (JPEG quality 1..=100, default 85) and `margin` (how much
//! to grow each box before blurring, as a fraction of its size, 0..=1,
//! default 0.1). The answer is `image/jpeg` with `X-Faces` (the count) and
//! `Server-Timing`.

use std::time::Instant;

use facegate_guest_sdk::effects::{OutputOptions, blur_faces};
use facegate_guest_sdk::image::encode_jpeg;
use facegate_guest_sdk::{DetectOptions, Error, Handler, Request, Response, detect, export_handler};

/// The handler (POST only, bodies up to 16 MiB).
struct Blur;

impl Handler for Blur {
    fn handle(request: Request) -> Result<Response, Error> {
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
}

export_handler!(Blur);
