//! Write facegate handlers: WebAssembly components (`wasm32-wasip2`) that
//! answer HTTP requests with face detections.
//!
//! A handler validates the request, decodes and letterboxes the image, calls
//! the host's `face-detect.infer`, decodes the model's outputs and answers.
//! This crate holds every step so that a handler is a few lines:
//!
//! ```ignore
//! use facegate_guest_sdk::{detect, export_handler, DetectOptions, Error, Handler, Request, Response};
//!
//! struct Detect;
//!
//! impl Handler for Detect {
//!     fn handle(request: Request) -> Result<Response, Error> {
//!         let options = DetectOptions::from_query(request.query())?;
//!         let detection = detect(request.image_bytes()?, &options)?;
//!         Ok(detection.json_response())
//!     }
//! }
//!
//! export_handler!(Detect);
//! ```
//!
//! Modules:
//! - [`face_detect`]: the host's WIT interface (tensors, `infer`, `models`).
//! - [`image`]: bounded decoding (limits checked before any pixel buffer is
//!   allocated), letterboxing to the model's input, JPEG encoding.
//! - [`centerface`]: decoding CenterFace outputs into faces, NMS, mapping
//!   back to image pixels.
//! - [`http`]: requests and responses over `wasi:http`, query parameters,
//!   `multipart/form-data`, JSON errors.
//! - [`effects`]: blurring and cropping faces.
//! - [`pipeline`]: [`detect`], the whole path from bytes to faces, and its
//!   options and JSON answer.
//! - [`config`]: the handler's settings and secrets (`wasi:config/store`).
//! - [`kv`]: the tenant's state, buckets of keys and values (`wasi:keyvalue`).
//!
//! Everything except the calls into the host runs natively too, so handlers'
//! logic can be unit-tested with `cargo test`.

#![deny(missing_docs)]

mod bindings;
pub mod centerface;
pub mod config;
pub mod effects;
mod error;
pub mod http;
pub mod image;
pub mod kv;
pub mod pipeline;

pub use error::{Error, InferError};
pub use http::{Handler, Request, Response};
pub use pipeline::{
    DetectOptions, Detection, FaceReport, ModelName, Timings, detect, detect_faces, detect_image, faces_from_outputs, infer,
    infer_centerface,
};

/// The `wasi` crate this SDK is built on (the `wasi:http` types and the
/// `export!` macros), for handlers that need more than [`http`] offers.
pub use wasi;

/// `serde_json`, for handlers that build their own JSON answers.
pub use serde_json;

/// The host's `face-detect` interface: the models it serves and `infer`.
///
/// `infer` and `models` are host calls: they work only inside a component
/// running on a facegate host (natively they panic).
pub mod face_detect {
    pub use crate::bindings::facegate::face_detect::face_detect::{ElementType, Error, ModelInfo, Tensor, TensorSpec, infer, models};
}

/// Exports a [`Handler`] as the component's `wasi:http/incoming-handler`.
///
/// Invoke it once, in the handler crate (a `cdylib`), with the name of a
/// type that implements [`Handler`].
#[macro_export]
macro_rules! export_handler {
    ($handler:ident) => {
        impl $crate::wasi::exports::http::incoming_handler::Guest for $handler {
            fn handle(request: $crate::wasi::http::types::IncomingRequest, response_out: $crate::wasi::http::types::ResponseOutparam) {
                $crate::http::serve::<$handler>(request, response_out)
            }
        }
        $crate::wasi::http::proxy::export!($handler);
    };
}
