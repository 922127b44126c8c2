//! Running tenants' code: the one wasmtime engine ([`engine`]), a deployed
//! handler version ([`handler`]), one request (`run`: [`Sandbox`]), whose
//! answer ends with its guest ([`answer_end`]), what its store holds
//! ([`state`], [`stdio`], [`instance_memory`], [`outgoing`],
//! [`face_detect`], [`settings`], [`keyvalue`]), instances kept warm between requests ([`warm`]), and
//! compiling uploads off the request path ([`compile`]).

pub mod answer_end;
pub mod compile;
pub mod engine;
pub mod face_detect;
pub mod handler;
pub mod instance_memory;
pub mod keyvalue;
pub mod outgoing;
mod run;
pub mod settings;
pub mod state;
pub mod stdio;
pub mod warm;

pub use run::{Answer, RequestTag, Sandbox, SandboxError, SandboxLimits};
