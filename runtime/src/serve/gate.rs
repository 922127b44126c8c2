//! The accuracy gate a model passes before the repository takes it: on the
//! project's three test photos (built into the binary), its faces against
//! the reference model's (`centerface`, FP32) through the same pipeline as
//! the `detect` example (decode, 640² letterbox, CenterFace decode, NMS). A
//! reference face counts as found when one of the model's overlaps it at
//! IoU ≥ [`GATE_IOU`] with a score within [`GATE_SCORE`] of its own; at
//! least [`GATE_RECALL`] of the reference faces must be found. The same
//! rule as `runtime/tests/all/models.rs`, where INT8 CenterFace finds 11 of 16.

pub use crate::control::models::{Accuracy, GATE_IOU, GATE_RECALL, GATE_SCORE};
use anyhow::Context;
use facegate_guest_sdk::face_detect as sdk;
use facegate_guest_sdk::image::{ImageLimits, decode_for_letterbox, letterbox};
use facegate_guest_sdk::{DetectOptions, faces_from_outputs};
use facegate_host_gpu::backend::Backend;
use facegate_host_gpu::{ElementType, Tensor};

/// The letterbox side the photos are run at (the `detect` example's default).
const SIDE: u32 = 640;

/// The test photos, as `runtime/tests/fixtures/images` has them.
const PHOTOS: [(&str, &[u8]); 3] = [
    ("grace_hopper.jpg", include_bytes!("../../tests/fixtures/images/grace_hopper.jpg")),
    ("astronaut.png", include_bytes!("../../tests/fixtures/images/astronaut.png")),
    ("city.jpg", include_bytes!("../../tests/fixtures/images/city.jpg")),
];

/// Runs the photos through `reference` and `candidate` and counts the
/// reference faces the candidate found.
pub fn measure(reference: &mut dyn Backend, candidate: &mut dyn Backend) -> anyhow::Result<Accuracy> {
    let (mut matched, mut total) = (0, 0);
    for (name, photo) in PHOTOS {
        let want = faces(reference, photo).with_context(|| format!("the reference model on {name}"))?;
        let got = faces(candidate, photo).with_context(|| format!("the model on {name}"))?;
        matched += want.iter().filter(|w| got.iter().any(|g| iou(&w.bbox, &g.bbox) >= GATE_IOU && score_gap(w, g) <= GATE_SCORE)).count();
        total += want.len();
    }
    let recall = if total == 0 { 0.0 } else { matched as f64 / total as f64 };
    Ok(Accuracy { matched, reference: total, recall, passes: recall >= GATE_RECALL })
}

/// The faces `backend` finds in `photo`, in the photo's pixels.
fn faces(backend: &mut dyn Backend, photo: &[u8]) -> anyhow::Result<Vec<facegate_guest_sdk::centerface::Face>> {
    let scaled = decode_for_letterbox(photo, &ImageLimits::default(), SIDE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let boxed = letterbox(&scaled.image, SIDE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let side = SIDE as usize;
    let input = Tensor::new(vec![side, side, 3], ElementType::U8, boxed.pixels)?;
    let outputs = backend.run(&[&input]).map_err(|e| anyhow::anyhow!("{e}"))?.pop().context("no outputs")?;
    let outputs: Vec<sdk::Tensor> = outputs.into_iter().map(to_sdk_tensor).collect();
    let options = DetectOptions { size: SIDE, ..DetectOptions::default() };
    let mut faces = faces_from_outputs(&outputs, SIDE, boxed.scale, scaled.image.dimensions(), &options)
        .map_err(|e| anyhow::anyhow!("its outputs are not CenterFace's: {e}"))?;
    if scaled.is_reduced() {
        let (fx, fy) = scaled.factors();
        faces = faces.iter().map(|face| face.scaled(fx, fy)).collect();
    }
    Ok(faces)
}

fn score_gap(a: &facegate_guest_sdk::centerface::Face, b: &facegate_guest_sdk::centerface::Face) -> f64 {
    f64::from((a.score - b.score).abs())
}

/// Intersection over union of two `[x1, y1, x2, y2]` boxes.
fn iou(a: &[f32; 4], b: &[f32; 4]) -> f64 {
    let [a, b] = [a, b].map(|r| r.map(f64::from));
    let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let area = |r: &[f64; 4]| (r[2] - r[0]) * (r[3] - r[1]);
    let union = area(&a) + area(&b) - w * h;
    if union <= 0.0 { 0.0 } else { w * h / union }
}

/// A host tensor as the SDK's `face-detect` types hold it (the pipeline's
/// input when it runs natively).
pub fn to_sdk_tensor(tensor: Tensor) -> sdk::Tensor {
    let (shape, element, data) = tensor.into_parts();
    let element = match element {
        ElementType::U8 => sdk::ElementType::U8,
        ElementType::F32 => sdk::ElementType::F32,
    };
    sdk::Tensor { shape: shape.into_iter().map(|d| u32::try_from(d).unwrap_or(u32::MAX)).collect(), element, data }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iou_of_boxes() {
        assert!((iou(&[0.0, 0.0, 10.0, 10.0], &[0.0, 0.0, 10.0, 10.0]) - 1.0).abs() < 1e-9);
        assert!((iou(&[0.0, 0.0, 10.0, 10.0], &[5.0, 0.0, 15.0, 10.0]) - 50.0 / 150.0).abs() < 1e-9);
        assert_eq!(iou(&[0.0, 0.0, 1.0, 1.0], &[2.0, 2.0, 3.0, 3.0]), 0.0);
        assert_eq!(iou(&[0.0, 0.0, 0.0, 0.0], &[0.0, 0.0, 0.0, 0.0]), 0.0, "empty boxes overlap nothing");
    }
}
