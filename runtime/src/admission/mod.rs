//! What decides whether work may start on this node.
//!
//! - [`limits`]: a tenant's limits (the server's defaults and ceilings,
//!   what a tenant overrides).
//! - [`gate`]: a tenant's token bucket and concurrency slots, this node's
//!   share of its cluster-wide limits.
//! - [`slots`]: the node's handler-instance slots, fairly shared.
//! - [`models`]: which models a tenant may call (its limit `models`).
//! - [`memory`]: the node's memory budget, charged by every request and
//!   every kept instance (sized at start by `serve::sizing`).

pub mod gate;
pub mod limits;
pub mod memory;
pub mod models;
pub mod slots;
