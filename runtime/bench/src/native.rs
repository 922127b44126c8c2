//! The `issue2` suite's third row: the same detection pipeline compiled
//! natively, behind a bare hyper server on the same engine. It is the
//! ceiling for any server that decodes and letterboxes images on the CPU it
//! shares with inference. native/engine is what the image work and HTTP
//! cost at the least (natively compiled, no sandbox); gateway/native is what
//! the sandbox, the same code compiled to wasm and the gateway's own
//! request handling add.
//!
//! The handler does what `demo/detect` does for a raw image body with the
//! default options, with the SDK's own functions: `decode_for_letterbox`,
//! `letterbox`, `infer` on the host's batcher, CenterFace post-processing,
//! at most the default number of faces, and the same JSON body. It is not
//! part of the gateway and skips what the gateway and the handler do
//! besides (routing, API keys, limits, a sandbox, query and multipart
//! parsing, the `Server-Timing` header).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use facegate::serve::gate::to_sdk_tensor;
use facegate_guest_sdk::face_detect as sdk;
use facegate_guest_sdk::image::{ImageLimits, decode_for_letterbox, letterbox};
use facegate_guest_sdk::{DetectOptions, FaceReport, Timings, faces_from_outputs};
use facegate_host_gpu::{ElementType, InferRequest, Models, Tensor};
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Largest body the native handler reads (the gateway's default).
const MAX_BODY: usize = 16 << 20;

/// Starts the native detect server on a loopback port; posts to any path,
/// with `?size=` ignored: every request is letterboxed to `side`.
pub(crate) async fn start(models: Models, side: u32) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            let models = models.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request| answer(models.clone(), side, request));
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    Ok((addr, task))
}

async fn answer(models: Models, side: u32, request: Request<hyper::body::Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let reply = match http_body_util::Limited::new(request.into_body(), MAX_BODY).collect().await {
        Ok(body) => detect(&models, &body.to_bytes(), side).await,
        Err(e) => Err((StatusCode::BAD_REQUEST, format!("reading the body: {e}"))),
    };
    let (status, body) = match reply {
        Ok(json) => (StatusCode::OK, json),
        Err((status, message)) => (status, serde_json::json!({ "error": message }).to_string()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    Ok(response)
}

/// `demo/detect`'s work, natively: faces as the same JSON.
async fn detect(models: &Models, bytes: &[u8], side: u32) -> Result<String, (StatusCode, String)> {
    let bad = |e: &dyn std::fmt::Display| (StatusCode::BAD_REQUEST, e.to_string());
    let start = Instant::now();
    let scaled = decode_for_letterbox(bytes, &ImageLimits::default(), side).map_err(|e| bad(&e))?;
    let decode_ms = ms_since(start);
    let start = Instant::now();
    let boxed = letterbox(&scaled.image, side).map_err(|e| bad(&e))?;
    let (scale, side_px) = (boxed.scale, side as usize);
    let input = Tensor::new(vec![side_px, side_px, 3], ElementType::U8, boxed.pixels).map_err(|e| bad(&e))?;
    let preprocess_ms = ms_since(start);
    let start = Instant::now();
    // The bench's gateway allows requests 60 s too (bench::start_seeded).
    let request = InferRequest { tenant: Arc::from("native"), input, deadline: Instant::now() + Duration::from_secs(60) };
    let outputs = models.infer("centerface", request).await.map_err(|e| (StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    let infer_ms = ms_since(start);
    let start = Instant::now();
    let outputs: Vec<sdk::Tensor> = outputs.into_iter().map(to_sdk_tensor).collect();
    let options = DetectOptions { size: side, ..DetectOptions::default() };
    let mut faces = faces_from_outputs(&outputs, side, scale, scaled.image.dimensions(), &options)
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    if scaled.is_reduced() {
        let (fx, fy) = scaled.factors();
        faces = faces.iter().map(|face| face.scaled(fx, fy)).collect();
    }
    let timings = Timings { decode_ms, preprocess_ms, infer_ms, postprocess_ms: ms_since(start) };
    Ok(FaceReport { model: options.model, width: scaled.width, height: scaled.height, faces, timings }.to_json().to_string())
}

fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use facegate::config::EngineConfig;

    /// The real model, as deploy/setup.sh installs it.
    fn models() -> Models {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let home = std::env::var_os("FACEGATE_HOME").map(PathBuf::from).unwrap_or_else(|| root.join(".facegate"));
        let onnxruntime = std::env::var_os("ORT_DYLIB_PATH").map(PathBuf::from).unwrap_or_else(|| home.join("lib/libonnxruntime.so"));
        let config = EngineConfig {
            queue_capacity: 64,
            tenant_queue_capacity: 64,
            ..EngineConfig::single_cpu(home.join("models/centerface.onnx"), onnxruntime)
        };
        facegate::load_models(&config).expect("load the model (run deploy/setup.sh)")
    }

    async fn post(addr: SocketAddr, body: Vec<u8>) -> (StatusCode, serde_json::Value) {
        let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
        let request = Request::post(format!("http://{addr}/v1/demo/detect")).body(Full::new(Bytes::from(body))).unwrap();
        let response = client.request(request).await.expect("answers");
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).expect("JSON"))
    }

    /// The native server finds grace_hopper.jpg's face as `demo/detect`
    /// does (the accuracy tests check where), and refuses a non-image.
    #[tokio::test]
    async fn the_native_pipeline_answers_like_demo_detect() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let (addr, server) = start(models(), 160).await.expect("starts");
        let image = std::fs::read(root.join("runtime/tests/fixtures/images/grace_hopper.jpg")).unwrap();
        let (status, json) = post(addr, image).await;
        assert_eq!(status, StatusCode::OK, "{json}");
        assert_eq!((json["image"]["width"].as_u64(), json["image"]["height"].as_u64()), (Some(512), Some(600)));
        assert_eq!(json["faces"].as_array().map(Vec::len), Some(1), "{json}");
        let (status, json) = post(addr, b"not an image".to_vec()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{json}");
        server.abort();
    }

    #[test]
    fn host_tensors_become_sdk_tensors_unchanged() {
        let host = Tensor::from_f32(vec![1, 2], &[0.5, -1.0]).unwrap();
        let data = host.data().to_vec();
        let sdk = to_sdk_tensor(host);
        assert_eq!((sdk.shape, sdk.element, sdk.data), (vec![1, 2], sdk::ElementType::F32, data));
    }
}
