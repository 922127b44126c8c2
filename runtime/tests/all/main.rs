//! facegate's integration tests: the real gateway (HTTP, wasmtime, the
//! example handlers, the CenterFace model on ONNX Runtime) on an ephemeral port.

#![allow(clippy::unwrap_used, reason = "test helpers fail loudly: a failed unwrap is a failed test")]

mod bad_input;
mod budget;
mod canary;
mod cluster;
mod connections;
mod console;
mod control;
mod cores;
mod detect;
mod egress;
mod harness;
mod hostile;
mod isolation;
mod keys;
mod logs;
mod models;
mod process;
mod queue;
mod registry;
mod restart;
mod routes;
mod scripts;
mod secrets;
mod settings;
mod state;
mod stores;
mod tenants;
mod tls;
mod traces;
mod uploads;
mod usage;
mod warm;
