//! facegate handler `faces`: one component, several routes. Mounted at
//! `/v1/<tenant>/<handler>`, it sees the path relative to its mount (the
//! whole path under a tenant's own hostname) and routes on it exactly:
//!
//! - `GET /health`: `200 {"status":"ok"}`.
//! - `POST /detect`: what the `detect` example answers (faces as JSON).
//! - `POST /blur`: what the `blur` example answers (the image as JPEG with
//!   every face blurred).
//!
//! Any other path is a 404 `not_found` JSON error; another method on one of
//! these paths a 405 `method_not_allowed` with `Allow`.

use facegate_guest_sdk::effects::blur_response;
use facegate_guest_sdk::http::{ANY_METHOD, check_method};
use facegate_guest_sdk::serde_json::json;
use facegate_guest_sdk::{DetectOptions, Error, Handler, Request, Response, detect_faces, export_handler};

/// The handler: every method reaches `handle`, which checks each route's own.
struct Faces;

impl Handler for Faces {
    const METHODS: &'static [&'static str] = ANY_METHOD;

    fn handle(request: Request) -> Result<Response, Error> {
        match request.path() {
            "/health" => {
                check_method(request.method(), &["GET"])?;
                Ok(Response::json(200, &json!({ "status": "ok" })))
            }
            "/detect" => {
                check_method(request.method(), &["POST"])?;
                let options = DetectOptions::from_query(request.query())?;
                Ok(detect_faces(request.image_bytes()?, &options)?.json_response())
            }
            "/blur" => {
                check_method(request.method(), &["POST"])?;
                blur_response(&request)
            }
            path => Err(Error::custom(404, "not_found", not_found_message(path))),
        }
    }
}

/// The 404's message (the same in the JavaScript and Python examples).
fn not_found_message(path: &str) -> String {
    format!("no route for {path}; the routes are GET /health, POST /detect and POST /blur")
}

export_handler!(Faces);
