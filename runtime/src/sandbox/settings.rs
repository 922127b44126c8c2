//! `wasi:config/store` for handlers: the settings and secrets their tenant
//! set ([`HandlerSettings`]: the handler's own over its tenant's), as the
//! snapshot held them when the request started. A secret this node could
//! not open answers its name with an error, never with other bytes.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

use wasmtime::component::{HasData, Linker};

mod wit {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "facegate:face-detect/settings",
        imports: { default: trappable },
    });
}

use self::wit::wasi::config::store::{self as generated, Error};

/// Settings by name: a value, or why a secret did not open. Its `Debug`
/// shows the names only: values may be secrets.
#[derive(Default, Clone, PartialEq, Eq)]
pub struct Vars(HashMap<String, Result<String, String>>);

impl std::fmt::Debug for Vars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

/// No settings, shared: what a tenant without any reads (no allocation per request).
static NO_VARS: LazyLock<Arc<Vars>> = LazyLock::new(Arc::default);

impl Vars {
    /// Sets `name` (a later value of the same name replaces an earlier one).
    pub fn insert(&mut self, name: String, value: Result<String, String>) {
        self.0.insert(name, value);
    }
}

/// What one handler reads: its own settings over its tenant's, each kept
/// once in the snapshot (never a merged copy per handler).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerSettings {
    /// Set for this handler.
    pub own: Arc<Vars>,
    /// Set for all the tenant's handlers.
    pub every: Arc<Vars>,
}

impl Default for HandlerSettings {
    /// None at all.
    fn default() -> Self {
        Self { own: Arc::clone(&NO_VARS), every: Arc::clone(&NO_VARS) }
    }
}

impl HandlerSettings {
    fn get(&self, name: &str) -> Result<Option<String>, Error> {
        match self.own.0.get(name).or_else(|| self.every.0.get(name)) {
            Some(Ok(value)) => Ok(Some(value.clone())),
            Some(Err(why)) => Err(Error::Upstream(why.clone())),
            None => Ok(None),
        }
    }

    fn get_all(&self) -> Result<Vec<(String, String)>, Error> {
        let inherited = self.every.0.iter().filter(|(name, _)| !self.own.0.contains_key(*name));
        self.own.0.iter().chain(inherited).map(|(name, value)| value.clone().map(|v| (name.clone(), v)).map_err(Error::Upstream)).collect()
    }
}

/// A request's view of its settings (see [`add_to_linker`]).
pub struct SettingsView<'a>(pub &'a HandlerSettings);

impl generated::Host for SettingsView<'_> {
    fn get(&mut self, key: String) -> wasmtime::Result<Result<Option<String>, Error>> {
        Ok(self.0.get(&key))
    }

    fn get_all(&mut self) -> wasmtime::Result<Result<Vec<(String, String)>, Error>> {
        Ok(self.0.get_all())
    }
}

struct HasSettings;

impl HasData for HasSettings {
    type Data<'a> = SettingsView<'a>;
}

/// Adds `wasi:config/store` to `linker`, reading what `get` projects.
pub fn add_to_linker<T: 'static>(linker: &mut Linker<T>, get: fn(&mut T) -> SettingsView<'_>) -> wasmtime::Result<()> {
    generated::add_to_linker::<T, HasSettings>(linker, get)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(entries: &[(&str, Result<&str, &str>)]) -> Arc<Vars> {
        let mut vars = Vars::default();
        for (name, value) in entries {
            vars.insert((*name).to_owned(), value.map(str::to_owned).map_err(str::to_owned));
        }
        Arc::new(vars)
    }

    #[test]
    fn a_handlers_own_value_wins_and_a_secret_that_did_not_open_is_an_error() {
        let settings = HandlerSettings {
            own: vars(&[("min_score", Ok("0.8"))]),
            every: vars(&[("min_score", Ok("0.5")), ("url", Ok("https://hooks.example"))]),
        };
        assert_eq!(settings.get("min_score").unwrap(), Some("0.8".into()), "the handler's own");
        assert_eq!(settings.get("url").unwrap(), Some("https://hooks.example".into()), "the tenant's");
        assert_eq!(settings.get("missing").unwrap(), None);
        let mut all = settings.get_all().unwrap();
        all.sort();
        assert_eq!(all, [("min_score".to_owned(), "0.8".to_owned()), ("url".to_owned(), "https://hooks.example".to_owned())]);
        let broken = HandlerSettings { own: vars(&[("token", Err("the secret \"token\" cannot be opened"))]), ..settings };
        assert!(matches!(broken.get("token"), Err(Error::Upstream(why)) if why.contains("cannot be opened")));
        assert!(broken.get_all().is_err(), "never a partial answer that looks whole");
        assert_eq!(broken.get("url").unwrap(), Some("https://hooks.example".into()), "the others still read");
        assert!(!format!("{:?}", broken.every).contains("hooks.example"), "Debug shows names, never values");
        assert_eq!(HandlerSettings::default().get_all().unwrap(), []);
    }
}
