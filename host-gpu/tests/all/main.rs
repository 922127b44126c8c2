//! host-gpu's integration tests: the batcher with a fake backend, and the
//! ONNX Runtime backend against reference outputs.

mod batching;
mod onnx;
