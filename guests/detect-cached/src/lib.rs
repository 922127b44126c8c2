//! facegate handler `detect-cached`: `detect`, with its answers kept in the
//! tenant's state (`wasi:keyvalue`, bucket `detect-cache`) by the image's
//! SHA-256 and the options, so a repeated image is answered without
//! calling `infer` (no device time, none billed).
//!
//! Takes what `detect` takes (`threshold`, `max_faces`, `size`, the setting
//! `min_score`) and answers what it answers, byte for byte the first time,
//! with the header `x-facegate-cache: hit` or `miss` (a hit's `timings_ms`
//! are the first answer's). Entries stay until deleted and count against
//! the tenant's `kv_keys` and `kv_bytes`. The cache never
//! fails a request: an answer that could not be kept (a limit of the
//! tenant's state, say) still goes out, with `x-facegate-cache-error`
//! saying why.

use facegate_guest_sdk::kv::{Bucket, KvError};
use facegate_guest_sdk::{DetectOptions, Error, Handler, Request, Response, detect_faces, export_handler};
use sha2::{Digest, Sha256};

/// The bucket answers are kept in.
const BUCKET: &str = "detect-cache";
/// Names the answer's shape: bumped when this code answers differently
/// (old entries are then never read; `facegate kv delete … --all` clears them).
const VERSION: &str = "detect-v2";

/// The handler (POST only, bodies up to 16 MiB).
struct DetectCached;

impl Handler for DetectCached {
    fn handle(request: Request) -> Result<Response, Error> {
        let options = DetectOptions::configured(request.query())?;
        let image = request.image_bytes()?;
        let key = cache_key(image, &options);
        let cache = Bucket::open(BUCKET);
        if let Some(body) = cache.as_ref().ok().and_then(|bucket| bucket.get(&key).ok().flatten()) {
            return Ok(Response::bytes(200, "application/json", body).with_header("x-facegate-cache", "hit"));
        }
        let answer = detect_faces(image, &options)?.json_response().with_header("x-facegate-cache", "miss");
        let kept = cache.and_then(|bucket| bucket.set(&key, &answer.body));
        Ok(match kept {
            Ok(()) => answer,
            Err(e) => answer.with_header("x-facegate-cache-error", one_line(&e)),
        })
    }
}

/// The image's SHA-256 and the options that shape the answer (the model too).
fn cache_key(image: &[u8], options: &DetectOptions) -> String {
    let digest = Sha256::digest(image);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{VERSION}/{hex}/{}/t{}/n{}/s{}", options.model.as_str(), options.threshold, options.max_faces, options.size)
}

/// Why an answer was not kept, as a header value.
fn one_line(e: &KvError) -> String {
    e.to_string().chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect()
}

export_handler!(DetectCached);
