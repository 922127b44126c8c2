//! facegate handler `blur`: `POST` an image (raw body or the form field
//! `image`), get it back as a JPEG with every face blurred.
//!
//! Query parameters: those of `detect` (`threshold`, `max_faces`, `size`),
//! plus `quality` (JPEG quality 1..=100, default 85) and `margin` (how much
//! to grow each box before blurring, as a fraction of its size, 0..=1,
//! default 0.1). The answer is `image/jpeg` with `X-Faces` (the count) and
//! `Server-Timing`.

use facegate_guest_sdk::effects::blur_response;
use facegate_guest_sdk::{Error, Handler, Request, Response, export_handler};

/// The handler (POST only, bodies up to 16 MiB).
struct Blur;

impl Handler for Blur {
    fn handle(request: Request) -> Result<Response, Error> {
        // Detect at full size (the pixels are needed), blur, encode: the SDK's `blur` answer.
        blur_response(&request)
    }
}

export_handler!(Blur);
