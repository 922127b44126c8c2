//! Linking the standard pipeline into a handler at deploy time.
//!
//! A handler written in Python or JavaScript imports
//! `facegate:face-detect/pipeline` (world `script-handler`); the gateway
//! plugs the pipeline component (`guests/pipeline`, `--pipeline-component`)
//! into it with `wac-graph`, as `wac plug` does, and what is validated,
//! compiled and stored is the composed component: the pipeline runs inside
//! the handler's sandbox, under its tenant's limits, and a version keeps the
//! pipeline it was deployed with.

use wac_graph::types::Package;
use wac_graph::{CompositionGraph, EncodeOptions};

/// The interface the pipeline component exports (any 0.1.x version).
pub const PIPELINE_INTERFACE: &str = "facegate:face-detect/pipeline@";

/// Whether `component` imports the pipeline interface. Bytes that do not
/// parse import nothing here; validation refuses them later with its own words.
pub fn imports_pipeline(component: &[u8]) -> bool {
    let mut graph = CompositionGraph::new();
    let Ok(package) = Package::from_bytes("facegate:handler", None, component, graph.types_mut()) else { return false };
    graph.types()[package.ty()].imports.keys().any(|name| name.starts_with(PIPELINE_INTERFACE))
}

/// `handler` with `pipeline`'s exports plugged into its imports; the
/// imports left (WASI, `face-detect`) are those of both.
pub fn plug_pipeline(handler: &[u8], pipeline: &[u8]) -> Result<Vec<u8>, String> {
    let mut graph = CompositionGraph::new();
    let socket = Package::from_bytes("facegate:handler", None, handler, graph.types_mut()).map_err(|e| format!("{e:#}"))?;
    let socket = graph.register_package(socket).map_err(|e| format!("{e:#}"))?;
    let plug = Package::from_bytes("facegate:pipeline", None, pipeline, graph.types_mut())
        .map_err(|e| format!("the pipeline component: {e:#}"))?;
    let plug = graph.register_package(plug).map_err(|e| format!("{e:#}"))?;
    wac_graph::plug(&mut graph, vec![plug], socket)
        .map_err(|e| format!("cannot link the pipeline into the handler (does it import a pipeline version this gateway has?): {e:#}"))?;
    graph.encode(EncodeOptions::default()).map_err(|e| format!("cannot encode the linked handler: {e:#}"))
}
