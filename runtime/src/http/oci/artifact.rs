//! The CNCF wasm OCI artifact (tag-team's `wasm-oci` layout, which `wkg`,
//! `wash` and `spin registry` write): an image manifest whose config is
//! `application/vnd.wasm.config.v0+json` and whose one layer is the
//! component, `application/wasm`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The OCI image manifest's media type.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// Docker's image manifest (v2, schema 2), which some registries still answer with.
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// The wasm artifact's config.
pub const WASM_CONFIG: &str = "application/vnd.wasm.config.v0+json";
/// The wasm artifact's layer: the component's bytes.
pub const WASM_LAYER: &str = "application/wasm";
/// The annotation `oras pull` names a layer's file by.
pub const TITLE: &str = "org.opencontainers.image.title";
/// The most a manifest may take (the distribution spec's own bound for what
/// a registry must accept); a wasm artifact's is under a kilobyte.
pub const MAX_MANIFEST_BYTES: usize = 4 << 20;

/// A content descriptor: what a manifest says of a blob.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// The blob's media type.
    pub media_type: String,
    /// `sha256:…` of its bytes.
    pub digest: String,
    /// Its length, bytes.
    pub size: u64,
    /// Its annotations, if any.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// An image manifest (the fields a wasm artifact uses).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// Always 2.
    pub schema_version: u32,
    /// [`OCI_MANIFEST`] (optional in the spec; written by us).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// The config blob.
    pub config: Descriptor,
    /// The layers; a wasm artifact has one.
    pub layers: Vec<Descriptor>,
}

/// The wasm config (`application/vnd.wasm.config.v0+json`), the fields
/// written here.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct WasmConfig<'a> {
    created: String,
    architecture: &'a str,
    os: &'a str,
    layer_digests: Vec<String>,
}

/// `sha256:` and the hex SHA-256 of `bytes`: a blob's (or manifest's) digest.
pub fn digest_of(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    let mut text = String::with_capacity(7 + 64);
    text.push_str("sha256:");
    for b in hash {
        text.push_str(&format!("{b:02x}"));
    }
    text
}

/// A component packed as the wasm artifact, ready to push: its config and
/// manifest, serialised (what is pushed is exactly these bytes).
pub struct Packed {
    /// The config blob.
    pub config: Vec<u8>,
    /// The manifest; its digest is the artifact's.
    pub manifest: Vec<u8>,
    /// The layer's descriptor.
    pub layer: Descriptor,
}

/// Packs `component` (its file name `title`), created at `created` (RFC 3339).
pub fn pack(component: &[u8], title: &str, created: String) -> Packed {
    let layer_digest = digest_of(component);
    let config = WasmConfig { created, architecture: "wasm", os: "wasip2", layer_digests: vec![layer_digest.clone()] };
    // Serialising a struct of strings cannot fail.
    let config = serde_json::to_vec(&config).unwrap_or_default();
    let mut annotations = BTreeMap::new();
    annotations.insert(TITLE.to_owned(), title.to_owned());
    let layer = Descriptor { media_type: WASM_LAYER.to_owned(), digest: layer_digest, size: component.len() as u64, annotations };
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(OCI_MANIFEST.to_owned()),
        config: Descriptor {
            media_type: WASM_CONFIG.to_owned(),
            digest: digest_of(&config),
            size: config.len() as u64,
            annotations: BTreeMap::new(),
        },
        layers: vec![layer.clone()],
    };
    let manifest = serde_json::to_vec(&manifest).unwrap_or_default();
    Packed { config, manifest, layer }
}

/// The component's layer in a pulled manifest: the one `application/wasm`
/// layer, its digest well-formed. An index (several platforms), an image
/// of another kind, or an artifact with several components is refused.
pub fn component_layer(manifest: &[u8]) -> Result<Descriptor, String> {
    let value: serde_json::Value = serde_json::from_slice(manifest).map_err(|e| format!("the manifest is not JSON: {e}"))?;
    let media_type = value.get("mediaType").and_then(serde_json::Value::as_str).unwrap_or(OCI_MANIFEST);
    if media_type != OCI_MANIFEST && media_type != DOCKER_MANIFEST {
        return Err(format!("the reference names a {media_type}, not an image manifest with a wasm component"));
    }
    let manifest: Manifest = serde_json::from_value(value).map_err(|e| format!("the manifest is malformed: {e}"))?;
    let mut wasm = manifest.layers.into_iter().filter(|l| l.media_type == WASM_LAYER);
    let layer = wasm.next().ok_or_else(|| format!("the artifact has no {WASM_LAYER} layer: it is not a wasm component"))?;
    if wasm.next().is_some() {
        return Err(format!("the artifact has several {WASM_LAYER} layers; one component per artifact"));
    }
    if !super::reference::valid_digest(&layer.digest) {
        return Err(format!("the layer's digest {:?} is not sha256:HEX", layer.digest));
    }
    Ok(layer)
}

/// The artifact's `created`, RFC 3339 in UTC: `SOURCE_DATE_EPOCH` (Unix
/// seconds) when set, as reproducible builds set it, so the same
/// component pushes to the same digest; else now.
pub fn created_rfc3339() -> String {
    let pinned = std::env::var("SOURCE_DATE_EPOCH").ok().and_then(|s| s.trim().parse::<i64>().ok());
    let secs =
        pinned.unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64));
    crate::telemetry::dates::rfc3339(secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_component_is_the_wasm_artifact_and_its_layer_is_found_again() {
        let packed = pack(b"\0asm\x0d\0\x01\0", "hello.wasm", "2026-12-05T00:00:00Z".to_owned());
        let manifest: serde_json::Value = serde_json::from_slice(&packed.manifest).unwrap();
        assert_eq!(manifest["mediaType"], OCI_MANIFEST);
        assert_eq!(manifest["config"]["mediaType"], WASM_CONFIG);
        assert_eq!(manifest["config"]["digest"], digest_of(&packed.config).as_str());
        assert_eq!(manifest["layers"][0]["annotations"][TITLE], "hello.wasm");
        let config: serde_json::Value = serde_json::from_slice(&packed.config).unwrap();
        assert_eq!((config["architecture"].as_str(), config["os"].as_str()), (Some("wasm"), Some("wasip2")));
        assert_eq!(config["layerDigests"][0], packed.layer.digest.as_str());
        assert_eq!(component_layer(&packed.manifest).unwrap(), packed.layer);
    }

    #[test]
    fn manifests_without_exactly_one_component_are_refused() {
        let layer = |t: &str| serde_json::json!({"mediaType": t, "digest": digest_of(b"x"), "size": 1});
        let manifest = |layers: Vec<serde_json::Value>| {
            serde_json::to_vec(&serde_json::json!({"schemaVersion": 2, "config": layer(WASM_CONFIG), "layers": layers})).unwrap()
        };
        assert!(
            component_layer(&manifest(vec![layer("application/vnd.oci.image.layer.v1.tar+gzip")]))
                .unwrap_err()
                .contains("no application/wasm")
        );
        assert!(component_layer(&manifest(vec![layer(WASM_LAYER), layer(WASM_LAYER)])).unwrap_err().contains("several"));
        let index = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}"#;
        assert!(component_layer(index).unwrap_err().contains("image.index"));
        assert!(component_layer(b"not json").unwrap_err().contains("not JSON"));
    }
}
