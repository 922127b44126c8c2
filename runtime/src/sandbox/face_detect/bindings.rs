//! Generated host bindings for `facegate:face-detect` (private; see `mod.rs`).

wasmtime::component::bindgen!({
    path: "../wit",
    world: "facegate:face-detect/host",
    imports: { default: async | trappable },
});
