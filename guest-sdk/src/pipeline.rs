//! The detection pipeline the example handlers share:
//! decode → letterbox → `infer` → decode outputs, NMS, map back.

use std::time::Instant;

use serde::Serialize;

use crate::Error;
use crate::centerface::{self, DEFAULT_NMS_IOU, DEFAULT_THRESHOLD, Face, MODEL, Outputs};
use crate::error::InferError;
use crate::face_detect::{self, Tensor};
use crate::http::{HttpError, Query, Response};
use crate::image::{self, DEFAULT_LETTERBOX_SIDE, ImageLimits, RgbImage, SIDE_MULTIPLE};

/// Default [`DetectOptions::max_faces`].
pub const DEFAULT_MAX_FACES: usize = 100;
/// Largest `max_faces` a request may ask for.
pub const MAX_FACES_LIMIT: usize = 1000;
/// Smallest letterbox side a request may ask for.
pub const MIN_SIZE: u32 = 128;
/// Largest letterbox side a request may ask for.
pub const MAX_SIZE: u32 = 1536;

/// Longest model name a request may give.
pub const MAX_MODEL_NAME: usize = 64;

/// The name of a model on the host (`?model=`, the `model` setting): 1 to
/// [`MAX_MODEL_NAME`] bytes of `a-z`, `0-9`, `.`, `_`, `-`, the first a
/// letter or digit (the host's rule). Default
/// [`MODEL`] (CenterFace FP32). Kept inline, so options stay `Copy`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ModelName {
    len: u8,
    bytes: [u8; MAX_MODEL_NAME],
}

impl ModelName {
    /// `name`, if it is a valid model name.
    pub fn new(name: &str) -> Option<Self> {
        let valid = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-');
        if name.is_empty() || name.len() > MAX_MODEL_NAME || !name.bytes().all(valid) || !name.as_bytes()[0].is_ascii_alphanumeric() {
            return None;
        }
        let mut bytes = [0; MAX_MODEL_NAME];
        bytes[..name.len()].copy_from_slice(name.as_bytes());
        Some(Self { len: name.len() as u8, bytes })
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        // Only ASCII is ever stored (see `new`).
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or(MODEL)
    }
}

impl Default for ModelName {
    fn default() -> Self {
        Self::new(MODEL).expect("a valid name")
    }
}

impl std::fmt::Debug for ModelName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

impl std::str::FromStr for ModelName {
    type Err = ();

    fn from_str(name: &str) -> Result<Self, ()> {
        Self::new(name).ok_or(())
    }
}

/// How to detect: the model, thresholds, how many faces, input size, image limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DetectOptions {
    /// The model to run (default [`MODEL`]); the answer's `model` names it.
    pub model: ModelName,
    /// Heatmap threshold, `0 < threshold ≤ 1` (default 0.5).
    pub threshold: f32,
    /// NMS IoU threshold (default 0.3).
    pub nms_iou: f32,
    /// Most faces returned, best first (default 100).
    pub max_faces: usize,
    /// Letterbox side: the model input is `size × size` (default 640).
    pub size: u32,
    /// Limits on the decoded image.
    pub limits: ImageLimits,
}

impl Default for DetectOptions {
    fn default() -> Self {
        Self {
            model: ModelName::default(),
            threshold: DEFAULT_THRESHOLD,
            nms_iou: DEFAULT_NMS_IOU,
            max_faces: DEFAULT_MAX_FACES,
            size: DEFAULT_LETTERBOX_SIDE,
            limits: ImageLimits::default(),
        }
    }
}

impl DetectOptions {
    /// Reads `threshold` (0 < t ≤ 1), `max_faces` (1..=1000) and `size`
    /// (a multiple of 32 in 128..=1536) from the query; absent ones keep
    /// their defaults. An invalid value is a 400 naming the parameter.
    pub fn from_query(query: &Query) -> Result<Self, HttpError> {
        Self::from_query_over(query, Self::default())
    }

    /// [`Self::from_query`] over the handler's settings: the setting
    /// `min_score` (0 < s ≤ 1, see [`crate::config`]) is the default
    /// `threshold`, and the setting `model` the default model, which the
    /// query's still override. A setting that is not such a value is a 500
    /// `bad_setting` naming it.
    pub fn configured(query: &Query) -> Result<Self, crate::Error> {
        let threshold = crate::config::parse_or("min_score", DEFAULT_THRESHOLD)?;
        if !(threshold > 0.0 && threshold <= 1.0) {
            let message = "the setting \"min_score\" is not a number with 0 < min_score ≤ 1";
            return Err(crate::Error::custom(500, "bad_setting", message));
        }
        let model = crate::config::parse_or("model", ModelName::default())?;
        Ok(Self::from_query_over(query, Self { model, threshold, ..Self::default() })?)
    }

    /// [`Self::from_query`] over `defaults` (a handler's own, from its
    /// settings, say): the query's values win.
    pub fn from_query_over(query: &Query, defaults: Self) -> Result<Self, HttpError> {
        Ok(Self {
            model: query.parse_or("model", defaults.model, "a model name (a-z, 0-9, '.', '_', '-'; at most 64 bytes)", |_| true)?,
            threshold: query
                .parse_or("threshold", defaults.threshold, "a number with 0 < threshold ≤ 1", |t: f32| t > 0.0 && t <= 1.0)?,
            max_faces: query
                .parse_or("max_faces", defaults.max_faces, "an integer from 1 to 1000", |n: usize| (1..=MAX_FACES_LIMIT).contains(&n))?,
            size: query.parse_or("size", defaults.size, "a multiple of 32 from 128 to 1536", |s: u32| {
                (MIN_SIZE..=MAX_SIZE).contains(&s) && s.is_multiple_of(SIDE_MULTIPLE)
            })?,
            ..defaults
        })
    }
}

/// Milliseconds spent in each step of [`detect`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Timings {
    /// Decoding the image.
    #[serde(rename = "decode")]
    pub decode_ms: f64,
    /// Letterboxing it into the model input.
    #[serde(rename = "preprocess")]
    pub preprocess_ms: f64,
    /// The host's `infer` call (queueing and batching included).
    #[serde(rename = "infer")]
    pub infer_ms: f64,
    /// Decoding outputs, NMS, mapping back.
    #[serde(rename = "postprocess")]
    pub postprocess_ms: f64,
}

impl Timings {
    /// The steps as a `Server-Timing` header value.
    pub fn server_timing(&self) -> String {
        format!(
            "decode;dur={:.2}, preprocess;dur={:.2}, infer;dur={:.2}, postprocess;dur={:.2}",
            self.decode_ms, self.preprocess_ms, self.infer_ms, self.postprocess_ms
        )
    }

    fn rounded(&self) -> Self {
        Self {
            decode_ms: round(self.decode_ms, 2),
            preprocess_ms: round(self.preprocess_ms, 2),
            infer_ms: round(self.infer_ms, 2),
            postprocess_ms: round(self.postprocess_ms, 2),
        }
    }
}

/// What [`detect`] found, with the decoded image for handlers that draw,
/// blur or crop.
#[derive(Debug, Clone)]
pub struct Detection {
    /// The model that ran.
    pub model: ModelName,
    /// The decoded image (EXIF orientation applied).
    pub image: RgbImage,
    /// Faces in image pixels, best first, at most `max_faces`.
    pub faces: Vec<Face>,
    /// Time spent per step.
    pub timings: Timings,
}

impl Detection {
    /// The JSON answer: `{"model","image":{"width","height"},"faces":[{"box",
    /// "score","landmarks"}],"timings_ms"}`; pixels rounded to 0.1, scores
    /// to 1e-4, milliseconds to 0.01.
    pub fn to_json(&self) -> serde_json::Value {
        faces_json(self.model, self.image.dimensions(), &self.faces, &self.timings)
    }

    /// 200 with [`to_json`](Self::to_json) and a `Server-Timing` header.
    pub fn json_response(&self) -> Response {
        json_response(self.to_json(), &self.timings)
    }
}

/// What [`detect_faces`] found: the faces and the image's size, without
/// the pixels (which it may have decoded at a reduced scale).
#[derive(Debug, Clone, PartialEq)]
pub struct FaceReport {
    /// The model that ran.
    pub model: ModelName,
    /// The image's width (EXIF orientation applied).
    pub width: u32,
    /// The image's height (EXIF orientation applied).
    pub height: u32,
    /// Faces in image pixels, best first, at most `max_faces`.
    pub faces: Vec<Face>,
    /// Time spent per step.
    pub timings: Timings,
}

impl FaceReport {
    /// The same JSON as [`Detection::to_json`].
    pub fn to_json(&self) -> serde_json::Value {
        faces_json(self.model, (self.width, self.height), &self.faces, &self.timings)
    }

    /// 200 with [`to_json`](Self::to_json) and a `Server-Timing` header.
    pub fn json_response(&self) -> Response {
        json_response(self.to_json(), &self.timings)
    }
}

fn faces_json(model: ModelName, (width, height): (u32, u32), faces: &[Face], timings: &Timings) -> serde_json::Value {
    let faces: Vec<FaceJson> = faces.iter().map(FaceJson::from).collect();
    serde_json::json!({
        "model": model.as_str(),
        "image": { "width": width, "height": height },
        "faces": faces,
        "timings_ms": timings.rounded(),
    })
}

fn json_response(json: serde_json::Value, timings: &Timings) -> Response {
    Response::json(200, &json).with_header("server-timing", timings.server_timing())
}

/// One face as JSON.
#[derive(Serialize)]
struct FaceJson {
    #[serde(rename = "box")]
    bbox: [f64; 4],
    score: f64,
    landmarks: [[f64; 2]; 5],
}

impl From<&Face> for FaceJson {
    fn from(face: &Face) -> Self {
        Self {
            bbox: face.bbox.map(|v| round(f64::from(v), 1)),
            score: round(f64::from(face.score), 4),
            landmarks: face.landmarks.map(|p| p.map(|v| round(f64::from(v), 1))),
        }
    }
}

fn round(value: f64, decimals: i32) -> f64 {
    let factor = 10f64.powi(decimals);
    (value * factor).round() / factor
}

fn elapsed_ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

/// Decodes the image in `bytes` and finds its faces (see [`detect_image`]).
pub fn detect(bytes: &[u8], options: &DetectOptions) -> Result<Detection, Error> {
    let start = Instant::now();
    let image = image::decode(bytes, &options.limits)?;
    let decode_ms = elapsed_ms(start);
    let (faces, timings) = detect_image(&image, options)?;
    Ok(Detection { model: options.model, image, faces, timings: Timings { decode_ms, ..timings } })
}

/// Finds the faces in the image in `bytes`, decoding only what the
/// letterbox needs ([`image::decode_for_letterbox`]: a large JPEG at a
/// scale of n/8). Faces are in the original image's pixels. For
/// handlers that need the pixels at full size (blur, crop), use [`detect`].
pub fn detect_faces(bytes: &[u8], options: &DetectOptions) -> Result<FaceReport, Error> {
    let start = Instant::now();
    let scaled = image::decode_for_letterbox(bytes, &options.limits, options.size)?;
    let decode_ms = elapsed_ms(start);
    let (mut faces, timings) = detect_image(&scaled.image, options)?;
    if scaled.is_reduced() {
        let (fx, fy) = scaled.factors();
        faces = faces.iter().map(|face| face.scaled(fx, fy)).collect();
    }
    Ok(FaceReport { model: options.model, width: scaled.width, height: scaled.height, faces, timings: Timings { decode_ms, ..timings } })
}

/// Letterboxes `image`, runs the options' model (a CenterFace: its
/// outputs are decoded as CenterFace's) on the host and decodes its
/// outputs: faces in image pixels, best first, at most `max_faces`.
/// `decode_ms` of the timings is left at 0.
pub fn detect_image(image: &RgbImage, options: &DetectOptions) -> Result<(Vec<Face>, Timings), Error> {
    let mut timings = Timings::default();
    let start = Instant::now();
    let letterbox = image::letterbox(image, options.size)?;
    let (side, scale) = (letterbox.side, letterbox.scale);
    timings.preprocess_ms = elapsed_ms(start);

    let start = Instant::now();
    let outputs = infer(options.model.as_str(), &letterbox.into_tensor())?;
    timings.infer_ms = elapsed_ms(start);

    let start = Instant::now();
    let faces = faces_from_outputs(&outputs, side, scale, image.dimensions(), options)?;
    timings.postprocess_ms = elapsed_ms(start);
    Ok((faces, timings))
}

/// CenterFace's outputs for a `side`×`side` letterbox of `scale` (see
/// [`image::Letterbox`]) as faces in the pixels of the `width × height`
/// image letterboxed: decoded, NMS, best first, at most `max_faces`.
pub fn faces_from_outputs(
    outputs: &[Tensor],
    side: u32,
    scale: f32,
    (width, height): (u32, u32),
    options: &DetectOptions,
) -> Result<Vec<Face>, Error> {
    let outputs = Outputs::new(outputs, side, side)?;
    let mut faces = centerface::postprocess(&outputs, options.threshold, options.nms_iou, scale, (width, height));
    faces.truncate(options.max_faces);
    Ok(faces)
}

/// Calls the host's `infer` for [`MODEL`] with one `[H, W, 3]` `u8` tensor.
pub fn infer_centerface(input: &Tensor) -> Result<Vec<Tensor>, InferError> {
    infer(MODEL, input)
}

/// Calls the host's `infer` for `model` with one `[H, W, 3]` `u8` tensor.
pub fn infer(model: &str, input: &Tensor) -> Result<Vec<Tensor>, InferError> {
    face_detect::infer(model, input).map_err(InferError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_default_and_parse() {
        let options = DetectOptions::from_query(&Query::parse("")).expect("defaults");
        assert_eq!(options, DetectOptions::default());
        assert_eq!((options.threshold, options.max_faces, options.size), (0.5, 100, 640));
        let options = DetectOptions::from_query(&Query::parse("threshold=1&max_faces=1000&size=128")).expect("ok");
        assert_eq!((options.threshold, options.max_faces, options.size), (1.0, 1000, 128));
        assert_eq!(options.model.as_str(), "centerface");
        let options = DetectOptions::from_query(&Query::parse("model=centerface-int8")).expect("ok");
        assert_eq!(options.model.as_str(), "centerface-int8");
        let longest = "m".repeat(MAX_MODEL_NAME);
        assert_eq!(ModelName::new(&longest).map(|m| m.as_str().len()), Some(MAX_MODEL_NAME));
        assert!(ModelName::new(&format!("{longest}m")).is_none());
    }

    #[test]
    fn invalid_options_name_the_parameter() {
        for (query, name) in [
            ("threshold=0", "threshold"),
            ("threshold=1.01", "threshold"),
            ("threshold=abc", "threshold"),
            ("threshold=NaN", "threshold"),
            ("max_faces=0", "max_faces"),
            ("max_faces=1001", "max_faces"),
            ("max_faces=-1", "max_faces"),
            ("size=100", "size"),
            ("size=1568", "size"),
            ("size=96", "size"),
            ("model=", "model"),
            ("model=CenterFace", "model"),
            ("model=../x", "model"),
            ("model=-x", "model"),
            ("model=centerface%00", "model"),
        ] {
            let error = DetectOptions::from_query(&Query::parse(query)).expect_err("must fail");
            assert_eq!(error.code(), "invalid_parameter", "{query}");
            assert!(matches!(&error, HttpError::InvalidParameter { name: n, .. } if n == name), "{query}: {error}");
        }
    }

    #[test]
    fn detection_json_has_the_contracted_shape() {
        let detection = Detection {
            model: ModelName::new("centerface-int8").expect("valid"),
            image: RgbImage::new(512, 600),
            faces: vec![Face { bbox: [173.34, 122.81, 355.56, 338.44], score: 0.869_74, landmarks: [[200.04, 201.96]; 5] }],
            timings: Timings { decode_ms: 1.234, preprocess_ms: 2.0, infer_ms: 80.5, postprocess_ms: 0.011 },
        };
        let response = detection.json_response();
        assert_eq!(response.status, 200);
        assert_eq!(response.header("server-timing"), Some("decode;dur=1.23, preprocess;dur=2.00, infer;dur=80.50, postprocess;dur=0.01"));
        let json: serde_json::Value = serde_json::from_slice(&response.body).expect("json");
        let expected = serde_json::json!({
            "model": "centerface-int8",
            "image": {"width": 512, "height": 600},
            "faces": [{"box": [173.3, 122.8, 355.6, 338.4], "score": 0.8697, "landmarks": [[200.0, 202.0], [200.0, 202.0], [200.0, 202.0], [200.0, 202.0], [200.0, 202.0]]}],
            "timings_ms": {"decode": 1.23, "preprocess": 2.0, "infer": 80.5, "postprocess": 0.01},
        });
        assert_eq!(json, expected);
    }
}
