//! The standard detection pipeline as a component: world
//! `pipeline-provider` in `wit/face-detect.wit`. The gateway links it into
//! every handler that imports `facegate:face-detect/pipeline` (handlers in
//! Python or JavaScript, which have no SDK of their own for images), at
//! deploy time; it runs in the handler's sandbox.
//!
//! Its answers are the Rust examples': `detect` is `guests/detect` (its
//! default threshold the handler's setting `min_score`), `blur`
//! is the SDK's `blur_response` (as `guests/blur`), errors are
//! `Response::error` of the SDK — the same statuses, codes, messages and headers.

#![allow(unsafe_code, reason = "wit-bindgen generates the canonical ABI glue")]

use facegate_guest_sdk::effects::blur_response;
use facegate_guest_sdk::http::{DEFAULT_MAX_BODY_BYTES, HttpError, check_method};
use facegate_guest_sdk::{DetectOptions, Error, Request, Response, detect_faces};

mod bindings {
    #![allow(missing_docs, reason = "bindgen-generated code")]
    #![allow(clippy::all, reason = "bindgen-generated code")]
    wit_bindgen::generate!({
        world: "pipeline-provider",
        path: "../../wit",
        with: { "facegate:face-detect/face-detect@0.1.0": facegate_guest_sdk::face_detect },
    });
}

use bindings::exports::facegate::face_detect::pipeline::{Detections, Face, Failure, Guest, ImageRequest, Options, Reply};

/// The methods the Rust examples accept.
const METHODS: &[&str] = &["POST"];

/// The component's export.
struct Provider;

impl Guest for Provider {
    fn max_body_bytes() -> u64 {
        DEFAULT_MAX_BODY_BYTES as u64
    }

    fn detect(request: ImageRequest) -> Reply {
        answer(request, |request| {
            let options = DetectOptions::configured(request.query())?;
            Ok(detect_faces(request.image_bytes()?, &options)?.json_response())
        })
    }

    fn blur(request: ImageRequest) -> Reply {
        answer(request, |request| blur_response(&request))
    }

    fn parse_options(query: String) -> Result<Options, Failure> {
        let options = options_from_query(&query).map_err(|e| failure(&e))?;
        Ok(Options { threshold: options.threshold, max_faces: options.max_faces as u32, size: options.size })
    }

    fn detect_faces(image: Vec<u8>, options: Options) -> Result<Detections, Failure> {
        // Through the query parser: the same bounds, the same refusal.
        let query = format!("threshold={}&max_faces={}&size={}", options.threshold, options.max_faces, options.size);
        let options = options_from_query(&query).map_err(|e| failure(&e))?;
        let report = detect_faces(&image, &options).map_err(|e| failure(&e))?;
        let faces = report
            .faces
            .iter()
            .map(|f| Face {
                box_: (f.bbox[0], f.bbox[1], f.bbox[2], f.bbox[3]),
                score: f.score,
                landmarks: f.landmarks.iter().map(|p| (p[0], p[1])).collect(),
            })
            .collect();
        Ok(Detections { width: report.width, height: report.height, faces })
    }

    fn error_reply(failure: Failure) -> Reply {
        let body = facegate_guest_sdk::serde_json::json!({ "error": { "code": failure.code, "message": failure.message } });
        reply(Response::bytes(failure.status, "application/json", body.to_string().into_bytes()))
    }
}

bindings::export!(Provider with_types_in bindings);

/// Checks the request as the SDK's `serve` does (method, then size), runs
/// `handle`, and turns an error into the SDK's JSON error.
fn answer(request: ImageRequest, handle: impl FnOnce(Request) -> Result<Response, Error>) -> Reply {
    reply(receive(request).and_then(handle).unwrap_or_else(|e| Response::error(&e)))
}

fn receive(request: ImageRequest) -> Result<Request, Error> {
    check_method(&request.method, METHODS)?;
    let announced = request
        .headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, value)| std::str::from_utf8(value).ok()?.trim().parse::<usize>().ok());
    if announced.unwrap_or(0) > DEFAULT_MAX_BODY_BYTES || request.body.len() > DEFAULT_MAX_BODY_BYTES {
        return Err(HttpError::BodyTooLarge { limit: DEFAULT_MAX_BODY_BYTES }.into());
    }
    Ok(Request::new(&request.method, &request.path_with_query, request.headers, request.body))
}

/// The options `query` asks for, over the handler's settings (`min_score`).
fn options_from_query(query: &str) -> Result<DetectOptions, Error> {
    let request = Request::new("GET", &format!("/?{query}"), Vec::new(), Vec::new());
    DetectOptions::configured(request.query())
}

fn failure(error: &Error) -> Failure {
    Failure { status: error.status(), code: error.code().to_owned(), message: error.to_string() }
}

fn reply(response: Response) -> Reply {
    Reply { status: response.status, headers: response.headers, body: response.body }
}
