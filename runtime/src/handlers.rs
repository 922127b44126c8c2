//! Tenants' handler components: loaded from `<dir>/<tenant>/<handler>.wasm`,
//! compiled once and pre-instantiated once; each request instantiates from
//! the pre-instance in its own store.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use wasmtime::Engine;
use wasmtime::component::{Component, Linker};
use wasmtime_wasi_http::p2::bindings::ProxyPre;

use crate::state::RequestState;

/// One deployed handler, ready to instantiate.
pub struct Handler {
    /// Owning tenant.
    pub tenant: Arc<str>,
    /// Handler name (the last path segment of its route).
    pub name: String,
    /// The pre-instantiated component.
    pub pre: ProxyPre<RequestState>,
}

/// Every handler served, by `(tenant, handler)`.
#[derive(Default)]
pub struct Registry {
    handlers: HashMap<(String, String), Arc<Handler>>,
}

impl Registry {
    /// Looks up a tenant's handler.
    pub fn get(&self, tenant: &str, handler: &str) -> Option<Arc<Handler>> {
        self.handlers.get(&(tenant.to_owned(), handler.to_owned())).cloned()
    }

    /// Number of handlers.
    pub fn len(&self) -> usize {
        self.handlers.len()
    }

    /// Whether no handler is loaded.
    pub fn is_empty(&self) -> bool {
        self.handlers.is_empty()
    }

    /// Loads every `<tenant>/<handler>.wasm` under `dir`. A component that
    /// fails to compile or link is an error naming the file.
    pub fn load_dir(engine: &Engine, linker: &Linker<RequestState>, dir: &Path) -> anyhow::Result<Self> {
        let mut registry = Self::default();
        let tenants = std::fs::read_dir(dir).with_context(|| format!("cannot read handlers directory {}", dir.display()))?;
        for tenant in tenants {
            let tenant = tenant?;
            if tenant.file_type()?.is_dir() {
                registry.load_tenant(engine, linker, &tenant.path())?;
            }
        }
        Ok(registry)
    }

    fn load_tenant(&mut self, engine: &Engine, linker: &Linker<RequestState>, dir: &Path) -> anyhow::Result<()> {
        let tenant = valid_name(dir.file_name().and_then(|n| n.to_str()).unwrap_or_default())?;
        for file in std::fs::read_dir(dir)? {
            let path = file?.path();
            if path.extension().is_some_and(|e| e == "wasm") {
                let name = valid_name(path.file_stem().and_then(|n| n.to_str()).unwrap_or_default())?;
                let handler = compile(engine, linker, &tenant, &name, &path)?;
                tracing::info!(tenant = %tenant, handler = %name, path = %path.display(), "handler loaded");
                self.handlers.insert((tenant.clone(), name), Arc::new(handler));
            }
        }
        Ok(())
    }
}

/// Compiles and pre-instantiates one component file.
pub fn compile(
    engine: &Engine,
    linker: &Linker<RequestState>,
    tenant: &str,
    name: &str,
    path: &Path,
) -> anyhow::Result<Handler> {
    let component = Component::from_file(engine, path)
        .map_err(anyhow::Error::from)
        .with_context(|| format!("{} is not a valid component", path.display()))?;
    let pre = linker
        .instantiate_pre(&component)
        .map_err(anyhow::Error::from)
        .with_context(|| format!("{} imports something facegate does not provide", path.display()))?;
    let pre = ProxyPre::new(pre)
        .map_err(anyhow::Error::from)
        .with_context(|| format!("{} does not export wasi:http/incoming-handler", path.display()))?;
    Ok(Handler { tenant: tenant.into(), name: name.to_owned(), pre })
}

/// Tenant and handler names: 1-63 chars of `[a-z0-9-]`, not starting with `-`.
pub fn valid_name(name: &str) -> anyhow::Result<String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with('-')
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !ok {
        bail!("invalid name {name:?}: use 1-63 characters of a-z, 0-9 and '-'");
    }
    Ok(name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_restricted() {
        assert!(valid_name("demo").is_ok());
        assert!(valid_name("team-7").is_ok());
        for bad in ["", "-x", "Demo", "a/b", "a.b", &"x".repeat(64)] {
            assert!(valid_name(bad).is_err(), "{bad:?} accepted");
        }
    }
}
