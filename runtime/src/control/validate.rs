//! Upload validation: a component (not a core module) whose imports stay
//! within the `handler` world (plus the interfaces linked with every use
//! denied) and which exports `wasi:http/incoming-handler`.
//! Each refusal names what is wrong.

use wasmtime::Engine;
use wasmtime::component::Component;

/// Interfaces a handler may import (package/interface prefixes).
pub const ALLOWED_IMPORTS: &[&str] = &[
    "facegate:face-detect/",
    "wasi:http/types@",
    "wasi:io/",
    "wasi:clocks/",
    "wasi:random/",
    "wasi:cli/",
    // Rust's std imports these; the sandbox grants no preopened directory.
    "wasi:filesystem/",
    // Linked with every use denied (state.rs: no TCP, no UDP, no name
    // lookup, no address allowed): componentize-py's runtime imports them,
    // and a handler gets `access-denied`, never a socket.
    "wasi:sockets/",
    // Every request fails with `HTTP-request-denied` unless the tenant is
    // granted outgoing HTTP (state.rs): JavaScript components import it
    // whether or not they use it.
    "wasi:http/outgoing-handler@",
    // The handler's settings and secrets (sandbox/settings.rs).
    "wasi:config/store@0.2.0-rc.1",
    // The tenant's state (sandbox/keyvalue.rs).
    "wasi:keyvalue/store@0.2.0-draft2",
    "wasi:keyvalue/atomics@0.2.0-draft2",
    "wasi:keyvalue/batch@0.2.0-draft2",
];

/// The export every handler must have.
pub const INCOMING_HANDLER: &str = "wasi:http/incoming-handler@0.2";

/// Checks the binary's header before anything parses it.
pub fn check_header(bytes: &[u8]) -> Result<(), String> {
    match bytes {
        [] => Err("the upload is empty".to_owned()),
        [0, b'a', b's', b'm', 1, 0, 0, 0, ..] => {
            Err("this is a core WebAssembly module, not a component: build the handler for wasm32-wasip2 \
             (or wrap the module with `wasm-tools component new`)"
                .to_owned())
        }
        [0, b'a', b's', b'm', 0x0d, 0, 1, 0, ..] => Ok(()),
        [0, b'a', b's', b'm', ..] => Err("unsupported WebAssembly binary version (expected a component, layer 1)".to_owned()),
        _ => Err("not a WebAssembly binary (no \\0asm header)".to_owned()),
    }
}

/// The cheap checks of an upload, before anything compiles: its imports
/// stay within [`ALLOWED_IMPORTS`] (and the pipeline interface, which the
/// gateway links in) and it exports the incoming handler, read from the
/// component's type information (parsed, not compiled). A refusal here
/// costs the node a parse, not a compile; the compiled component is checked
/// again after the compile ([`check_imports`], [`check_exports`]).
/// Says whether the component imports the pipeline.
pub fn check_interface(bytes: &[u8]) -> Result<bool, String> {
    let mut graph = wac_graph::CompositionGraph::new();
    let package = wac_graph::types::Package::from_bytes("facegate:upload", None, bytes, graph.types_mut())
        .map_err(|e| format!("the component does not parse: {e:#}"))?;
    let world = &graph.types()[package.ty()];
    let pipeline = super::compose::PIPELINE_INTERFACE;
    if let Some(name) =
        world.imports.keys().find(|name| !name.starts_with(pipeline) && !ALLOWED_IMPORTS.iter().any(|p| name.starts_with(p)))
    {
        return Err(format!("the component imports `{name}`, which handlers may not use (allowed: {})", ALLOWED_IMPORTS.join(", ")));
    }
    if world.exports.keys().any(|name| name.starts_with(INCOMING_HANDLER)) {
        return Ok(world.imports.keys().any(|name| name.starts_with(pipeline)));
    }
    let exports: Vec<&str> = world.exports.keys().map(String::as_str).collect();
    let found = if exports.is_empty() { "nothing".to_owned() } else { exports.join(", ") };
    Err(format!("the component does not export wasi:http/incoming-handler@0.2.x (it exports {found})"))
}

/// Checks every import name against the allowed interfaces.
pub fn check_imports(engine: &Engine, component: &Component) -> Result<(), String> {
    let ty = component.component_type();
    for (name, _) in ty.imports(engine) {
        if !ALLOWED_IMPORTS.iter().any(|p| name.starts_with(p)) {
            return Err(format!("the component imports `{name}`, which handlers may not use (allowed: {})", ALLOWED_IMPORTS.join(", ")));
        }
    }
    Ok(())
}

/// Checks that the component exports the incoming handler.
pub fn check_exports(engine: &Engine, component: &Component) -> Result<(), String> {
    let ty = component.component_type();
    let exports: Vec<&str> = ty.exports(engine).map(|(name, _)| name).collect();
    if exports.iter().any(|name| name.starts_with(INCOMING_HANDLER)) {
        return Ok(());
    }
    let found = if exports.is_empty() { "nothing".to_owned() } else { exports.join(", ") };
    Err(format!("the component does not export wasi:http/incoming-handler@0.2.x (it exports {found})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_told_apart() {
        assert!(check_header(b"").unwrap_err().contains("empty"));
        assert!(check_header(b"\x89PNG\r\n\x1a\n").unwrap_err().contains("not a WebAssembly binary"));
        assert!(check_header(b"\0asm\x01\0\0\0").unwrap_err().contains("core WebAssembly module"));
        assert!(check_header(b"\0asm\x0d\0\x01\0").is_ok());
        assert!(check_header(b"\0asm\x0e\0\x01\0").unwrap_err().contains("version"));
    }

    #[test]
    fn imports_and_exports_are_checked_without_compiling() {
        let component = |wat: &str| wat::parse_str(wat).unwrap();
        let exports_nothing = component("(component)");
        assert!(check_interface(&exports_nothing).unwrap_err().contains("does not export wasi:http/incoming-handler"));
        let imports_fs = component(r#"(component (import "acme:secret/vault" (instance)))"#);
        assert!(check_interface(&imports_fs).unwrap_err().contains("`acme:secret/vault`"));
        let handler = component(
            r#"(component
                 (import "wasi:clocks/monotonic-clock@0.2.0" (instance))
                 (instance $h)
                 (export "wasi:http/incoming-handler@0.2.0" (instance $h)))"#,
        );
        assert_eq!(check_interface(&handler), Ok(false), "a handler that does not import the pipeline");
        assert!(check_interface(b"\0asm\x0d\0\x01\0garbage").unwrap_err().contains("does not parse"));
    }
}
