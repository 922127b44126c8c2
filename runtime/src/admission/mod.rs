//! What decides whether work may start on this node, beside each tenant's
//! own limits: the node's budgets, shared by all tenants and fairly.
//!
//! - [`memory`]: the node's memory budget, charged by every request and
//!   every kept instance; [`sizing`]: how large it is by default, and what
//!   it leaves aside for the pool's resident pages.

pub mod memory;
pub mod sizing;
