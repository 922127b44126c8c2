//! The handler's settings and secrets (`wasi:config/store`): values its
//! tenant sets without a redeploy (`facegate config set`, `facegate secret
//! set`), a handler's own over its tenant's, as they were when the request
//! started.
//!
//! ```ignore
//! let min_score: f32 = facegate_guest_sdk::config::parse_or("min_score", 0.5)?;
//! let token = facegate_guest_sdk::config::get("webhook_token")?;
//! ```

use std::str::FromStr;

use crate::Error;

mod bindings {
    #![allow(unsafe_code, reason = "wit-bindgen generates the canonical ABI glue")]
    #![allow(missing_docs, reason = "bindgen-generated code")]
    #![allow(clippy::all, reason = "bindgen-generated code")]

    wit_bindgen::generate!({
        world: "settings",
        path: "../wit",
        // wasi:config is not among the interfaces the `wasi` crate binds.
        generate_all,
    });
}

use bindings::wasi::config::store;

/// A setting that could not be read (a secret the host could not open) or
/// does not parse: a 500 `bad_setting` naming it, never a guess.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the setting {name:?} {why}")]
pub struct SettingError {
    /// The setting's name.
    pub name: String,
    /// What is wrong with it.
    pub why: String,
}

impl From<SettingError> for Error {
    fn from(e: SettingError) -> Self {
        Error::custom(500, "bad_setting", e.to_string())
    }
}

fn host_error(name: &str, e: store::Error) -> SettingError {
    let why = match e {
        store::Error::Upstream(why) | store::Error::Io(why) => why,
    };
    SettingError { name: name.to_owned(), why: format!("cannot be read: {why}") }
}

/// The value of setting `name`, `None` if it is not set.
pub fn get(name: &str) -> Result<Option<String>, SettingError> {
    store::get(name).map_err(|e| host_error(name, e))
}

/// Every setting of this handler, by name.
pub fn get_all() -> Result<Vec<(String, String)>, SettingError> {
    store::get_all().map_err(|e| host_error("*", e))
}

/// Setting `name` parsed as a `T`, or `default` when it is not set.
pub fn parse_or<T: FromStr>(name: &str, default: T) -> Result<T, SettingError> {
    match get(name)? {
        None => Ok(default),
        // Never the value in the error: it may be a secret, and errors reach the client.
        Some(text) => {
            text.trim().parse().map_err(|_| SettingError { name: name.to_owned(), why: "is not a valid value of its type".to_owned() })
        }
    }
}
