//! facegate's integration tests that measure the gateway under load: each
//! needs the machine to itself. Cargo runs test binaries one after another,
//! so nothing of `tests/all` (compiling handlers, running other gateways)
//! takes the CPU these tests measure the gateway's own behaviour on.

#![allow(clippy::unwrap_used, reason = "test helpers fail loudly: a failed unwrap is a failed test")]

#[allow(dead_code, reason = "the helpers are shared with tests/all; these tests use a few")]
#[path = "../all/harness.rs"]
mod harness;
mod overload;
