//! `wasi:config/store` for handlers: the settings and secrets their tenant
//! set ([`Vars`]), as the snapshot held them when the request started. A
//! secret this node could not open answers its name with an error, never
//! with other bytes.

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

/// One handler's settings by name: a value, or why a secret did not open.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Vars(HashMap<String, Result<String, String>>);

/// No settings: what a handler of a tenant without any reads.
pub static NO_VARS: LazyLock<Arc<Vars>> = LazyLock::new(Arc::default);

impl Vars {
    /// Sets `name` (a later value of the same name replaces an earlier one).
    pub fn insert(&mut self, name: String, value: Result<String, String>) {
        self.0.insert(name, value);
    }

    /// These, each of `own`'s names set to its value there (a handler's
    /// own settings over its tenant's).
    pub fn overridden_by(&self, own: Vars) -> Vars {
        let mut merged = self.clone();
        merged.0.extend(own.0);
        merged
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn get(&self, name: &str) -> Result<Option<String>, Error> {
        match self.0.get(name) {
            Some(Ok(value)) => Ok(Some(value.clone())),
            Some(Err(why)) => Err(Error::Upstream(why.clone())),
            None => Ok(None),
        }
    }

    fn get_all(&self) -> Result<Vec<(String, String)>, Error> {
        self.0.iter().map(|(name, value)| value.clone().map(|v| (name.clone(), v)).map_err(Error::Upstream)).collect()
    }
}

/// A request's view of its settings (see [`add_to_linker`]).
pub struct SettingsView<'a>(pub &'a Vars);

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

    #[test]
    fn a_secret_that_did_not_open_is_an_error_for_its_name_and_for_all() {
        let mut vars = Vars::default();
        vars.insert("min_score".into(), Ok("0.8".into()));
        assert_eq!(vars.get("min_score").unwrap(), Some("0.8".into()));
        assert_eq!(vars.get("missing").unwrap(), None);
        assert_eq!(vars.get_all().unwrap(), vec![("min_score".to_owned(), "0.8".to_owned())]);
        vars.insert("token".into(), Err("the secret token cannot be opened".into()));
        assert!(matches!(vars.get("token"), Err(Error::Upstream(why)) if why.contains("cannot be opened")));
        assert!(vars.get_all().is_err(), "never a partial answer that looks whole");
        assert_eq!(vars.get("min_score").unwrap(), Some("0.8".into()), "the others still read");
    }
}
