//! facegate handler `detect`: `POST` an image (raw body or the form field
//! `image`), get its faces as JSON.
//!
//! Query parameters: `threshold` (0 < t ≤ 1, default the setting
//! `min_score`, else 0.5: `facegate config set --tenant T --handler detect
//! min_score 0.8` changes it without a redeploy), `max_faces`
//! (1..=1000, default 100), `size` (letterbox side, a multiple of 32 in
//! 128..=1536, default 640). The answer is
//! `{"model","image":{"width","height"},"faces":[{"box","score","landmarks"}],"timings_ms"}`
//! with a `Server-Timing` header.

use facegate_guest_sdk::{DetectOptions, Error, Handler, Request, Response, detect_faces, export_handler};

/// The handler (POST only, bodies up to 16 MiB).
struct Detect;

impl Handler for Detect {
    fn handle(request: Request) -> Result<Response, Error> {
        // The default threshold is the handler's setting `min_score`, if set.
        let options = DetectOptions::configured(request.query())?;
        // Faces only: a large JPEG is decoded at the scale the letterbox needs.
        let report = detect_faces(request.image_bytes()?, &options)?;
        Ok(report.json_response())
    }
}

export_handler!(Detect);
