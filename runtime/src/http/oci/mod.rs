//! Components in OCI registries: `facegate push` stores a handler as the
//! CNCF wasm artifact, and a deploy may name one (`oci://…`) for the node
//! to pull. `reference` parses where it is, `artifact` is its layout,
//! `auth` finds credentials and answers challenges, `client` speaks the
//! distribution API (under the egress rules on a node) and `allow` is the
//! operator's list of registries a node pulls from; `pull` is a deploy's
//! pull on a node.

pub mod allow;
pub mod artifact;
pub mod auth;
pub mod client;
pub mod pull;
pub mod reference;

pub use allow::AllowedRegistries;
pub use auth::Credentials;
pub use client::{Egress, OciError, Pulled, Registry};
pub use reference::Reference;
