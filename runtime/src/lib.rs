//! # facegate
//!
//! A serverless gateway for face detection. Tenants deploy WebAssembly
//! components (wasi:http handlers); each request runs its handler in a fresh
//! sandbox, and the handler's `face-detect` calls are batched by the host
//! across all handlers of all tenants onto shared inference engines
//! ([`facegate_host_gpu`]).
//!
//! Layout, in rooms by purpose, each using only those listed after it:
//! [`serve`] (`facegate serve`: loading the models, assembling a node,
//! serving until a signal; the cores set apart for inference, the memory
//! budget's default size), [`cli`] (the command tree and the admin client),
//! [`http`] (listeners and connections, routes, a tenant's call, bodies,
//! tokens, the admin API, the console), [`control`] (tenants, keys, handler
//! versions: the store, its live snapshot and the cluster's sync),
//! [`config`] (flags), [`sandbox`] (the wasmtime engine, handlers, one
//! request's store and limits, warm instances, compiling, outgoing HTTP,
//! the `face-detect` host side, `wasi:keyvalue`), [`kv`] (handlers' state in
//! the store's database: its statements and connections), [`telemetry`] (Prometheus metrics, usage records, logs, traces), and
//! [`admission`] (a tenant's limits and gate, instance slots, the node's
//! memory budget). The benchmarks are the `facegate-bench` binary
//! (`runtime/bench/`), which `facegate bench` runs.

pub mod admission;
pub mod cli;
pub mod config;
pub mod control;
pub mod http;
pub mod kv;
pub mod sandbox;
pub mod serve;
pub mod telemetry;

pub use serve::{Gateway, batcher_config, bind, load_models, run};
