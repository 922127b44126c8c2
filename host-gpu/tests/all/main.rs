//! host-gpu's integration tests: the batcher with a fake backend, and the
//! ONNX Runtime backend against reference outputs.

#![allow(clippy::unwrap_used, reason = "test helpers fail loudly: a failed unwrap is a failed test")]

mod batching;
mod onnx;
