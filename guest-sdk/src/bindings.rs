//! Generated bindings for the host's `face-detect` import (world `host`).
//!
//! Kept private: [`crate::face_detect`] re-exports what handlers use.

#![allow(unsafe_code, reason = "wit-bindgen generates the canonical ABI glue")]
#![allow(missing_docs, reason = "bindgen-generated code")]
#![allow(clippy::all, reason = "bindgen-generated code")]

wit_bindgen::generate!({
    world: "host",
    path: "../wit",
});
