//! Bad input gets a clear 4xx with a JSON error naming the problem, and the
//! gateway keeps serving.

use serde_json::Value;

use crate::harness::{MAX_BODY_BYTES, client, image, url};

fn post(path: &str, body: Vec<u8>) -> (u16, Value) {
    let response = client().post(url(path)).body(body).send().unwrap();
    let status = response.status().as_u16();
    let text = response.text().unwrap();
    let json = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON ({status}): {text}"));
    (status, json)
}

fn assert_error(path: &str, body: Vec<u8>, status: u16, code: &str) -> String {
    let (got, json) = post(path, body);
    assert_eq!((got, json["error"]["code"].as_str()), (status, Some(code)), "{json}");
    let message = json["error"]["message"].as_str().unwrap().to_owned();
    assert!(!message.is_empty());
    message
}

/// A standard CRC-32 (for hand-made PNG chunks).
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

fn chunk(kind: &[u8; 4], data: &[u8]) -> Vec<u8> {
    let mut out = (data.len() as u32).to_be_bytes().to_vec();
    let mut body = kind.to_vec();
    body.extend_from_slice(data);
    out.extend_from_slice(&body);
    out.extend_from_slice(&crc32(&body).to_be_bytes());
    out
}

/// A valid PNG header declaring `w`×`h` RGB pixels, with a tiny IDAT.
pub(crate) fn png_claiming(w: u32, h: u32) -> Vec<u8> {
    let mut ihdr = w.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(chunk(b"IHDR", &ihdr));
    png.extend(chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]));
    png.extend(chunk(b"IEND", &[]));
    png
}

/// grace_hopper.jpg with its frame header rewritten to claim `w`×`h`.
pub(crate) fn jpeg_claiming(w: u16, h: u16) -> Vec<u8> {
    let mut jpeg = image("grace_hopper.jpg");
    let sof = jpeg.windows(2).position(|m| m[0] == 0xFF && (0xC0..=0xC2).contains(&m[1])).expect("SOF marker");
    jpeg[sof + 5..sof + 7].copy_from_slice(&h.to_be_bytes());
    jpeg[sof + 7..sof + 9].copy_from_slice(&w.to_be_bytes());
    jpeg
}

#[test]
fn empty_body() {
    assert_error("/v1/demo/detect", Vec::new(), 400, "empty_body");
}

#[test]
fn truncated_jpeg() {
    let mut jpeg = image("grace_hopper.jpg");
    jpeg.truncate(jpeg.len() / 2);
    assert_error("/v1/demo/detect", jpeg, 400, "invalid_image");
}

#[test]
fn not_an_image() {
    assert_error("/v1/demo/detect", b"hello, this is plainly text".to_vec(), 415, "unsupported_image");
}

#[test]
fn huge_dimensions_are_refused_before_decoding() {
    let message = assert_error("/v1/demo/detect", png_claiming(30_000, 30_000), 413, "image_too_large");
    assert!(message.contains("30000"), "{message}");
    let message = assert_error("/v1/demo/detect", jpeg_claiming(30_000, 30_000), 413, "image_too_large");
    assert!(message.contains("30000"), "{message}");
}

/// Sends a raw HTTP/1.1 request (so the client never trips over an early
/// answer while it is still writing) and returns the status and JSON body.
fn raw_post(head: impl AsRef<[u8]>, body: &[u8]) -> (u16, Value) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(crate::harness::gateway().addr).unwrap();
    stream.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    // The key goes right after the request line: auth is checked before the body.
    let head = String::from_utf8_lossy(head.as_ref()).replacen(
        "\r\n",
        &format!("\r\nAuthorization: Bearer {}\r\n", crate::harness::key("demo")),
        1,
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body).unwrap();
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response);
    let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let json = text.split_once("\r\n\r\n").and_then(|(_, b)| serde_json::from_str(b).ok()).unwrap_or(Value::Null);
    (status, json)
}

#[test]
fn declared_body_over_the_limit_is_refused_before_reading_it() {
    let head = format!("POST /v1/demo/detect HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {}\r\n\r\n", MAX_BODY_BYTES + 1);
    let (status, json) = raw_post(&head, &[]);
    assert_eq!((status, json["error"]["code"].as_str()), (413, Some("body_too_large")), "{json}");
}

/// Refused before its body is read, a keep-alive request is told the
/// connection closes, so the client does not send its next request on it.
#[test]
fn early_refusals_close_the_connection_they_leave_unread() {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(crate::harness::gateway().addr).unwrap();
    stream.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let head = format!(
        "POST /v1/demo/detect HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\n\r\n",
        crate::harness::key("demo"),
        MAX_BODY_BYTES + 1
    );
    stream.write_all(head.as_bytes()).unwrap();
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response).to_ascii_lowercase();
    let (head, _) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("http/1.1 413"), "{head}");
    assert!(head.contains("\r\nconnection: close"), "{head}");
    // Answers after the body was read keep the connection, errors included.
    let response = client().post(url("/v1/demo/detect")).body(image("grace_hopper.jpg")).send().unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("connection").is_none());
    let response = client().post(url("/v1/demo/detect")).body(b"not an image".to_vec()).send().unwrap();
    assert_eq!(response.status(), 415, "the handler refuses it");
    assert!(response.headers().get("connection").is_none());
}

#[test]
fn streamed_body_over_the_limit() {
    let chunk = vec![0xFFu8; MAX_BODY_BYTES + 1];
    let mut body = format!("{:x}\r\n", chunk.len()).into_bytes();
    body.extend_from_slice(&chunk);
    body.extend_from_slice(b"\r\n0\r\n\r\n");
    let head = "POST /v1/demo/detect HTTP/1.1\r\nHost: t\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n";
    let (status, json) = raw_post(head, &body);
    assert_eq!((status, json["error"]["code"].as_str()), (413, Some("body_too_large")), "{json}");
}

#[test]
fn unknown_tenant_or_handler() {
    assert_error("/v1/nobody/detect", image("grace_hopper.jpg"), 404, "unknown_handler");
    assert_error("/v1/demo/nothing", image("grace_hopper.jpg"), 404, "unknown_handler");
    assert_error("/nowhere", Vec::new(), 404, "not_found");
}

#[test]
fn wrong_method() {
    let response = client().get(url("/v1/demo/detect")).send().unwrap();
    assert_eq!(response.status(), 405);
    assert_eq!(response.headers().get("allow").map(|v| v.to_str().unwrap()), Some("POST"));
    let json: Value = response.json().unwrap();
    assert_eq!(json["error"]["code"], "method_not_allowed");
}

#[test]
fn invalid_query_parameters_are_named() {
    for (query, name) in [("threshold=2", "threshold"), ("threshold=abc", "threshold"), ("max_faces=0", "max_faces"), ("size=100", "size")]
    {
        let message = assert_error(&format!("/v1/demo/detect?{query}"), image("grace_hopper.jpg"), 400, "invalid_parameter");
        assert!(message.contains(name), "{query}: {message}");
    }
}

#[test]
fn gateway_keeps_serving_after_bad_input() {
    for body in [Vec::new(), b"junk".to_vec(), png_claiming(30_000, 30_000)] {
        let _ = post("/v1/demo/detect", body);
    }
    let (status, json) = post("/v1/demo/detect", image("grace_hopper.jpg"));
    assert_eq!(status, 200);
    assert_eq!(json["faces"].as_array().unwrap().len(), 1);
}

#[test]
fn host_header_that_is_not_text_is_a_400() {
    let head = b"POST /v1/demo/detect HTTP/1.1\r\nHost: caf\xe9\r\nConnection: close\r\nContent-Length: 4\r\n\r\n";
    let (status, json) = raw_post(head, b"junk");
    assert_eq!((status, json["error"]["code"].as_str()), (400, Some("bad_host")), "{json}");
}
