//! CenterFace: decoding the model's outputs into faces, NMS, and mapping
//! faces back to the original image.
//!
//! The decode follows `deface`'s `CenterFace.decode` exactly: every cell of
//! the heatmap above the threshold becomes a box centred on the cell (plus
//! its offset) with the size `exp(scale) * 4`; the five landmarks are given
//! in units of the box size from its top-left corner. Greedy NMS then keeps
//! the highest-scoring box of each overlapping group (IoU ≥ 0.3, areas
//! computed with deface's `+1` convention, in model-input pixels).

use crate::face_detect::{ElementType, Tensor};

/// The model's name on the host.
pub const MODEL: &str = "centerface";
/// Input pixels per output cell.
pub const STRIDE: u32 = 4;
/// Default heatmap threshold: a cell scoring above it is a face.
pub const DEFAULT_THRESHOLD: f32 = 0.5;
/// Default NMS threshold: a box overlapping a better one by this IoU or
/// more is dropped.
pub const DEFAULT_NMS_IOU: f32 = 0.3;
/// Channels of the four outputs: heatmap, scale, offset, landmarks.
const CHANNELS: [usize; 4] = [1, 2, 2, 10];

/// One detected face.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Face {
    /// `[x1, y1, x2, y2]`, in pixels.
    pub bbox: [f32; 4],
    /// Heatmap score, in `(threshold, 1]`.
    pub score: f32,
    /// Right eye, left eye, nose, right and left mouth corners: `[x, y]`
    /// each, in pixels (as CenterFace orders them).
    pub landmarks: [[f32; 2]; 5],
}

impl Face {
    /// Width of the box.
    pub fn width(&self) -> f32 {
        self.bbox[2] - self.bbox[0]
    }

    /// Height of the box.
    pub fn height(&self) -> f32 {
        self.bbox[3] - self.bbox[1]
    }

    /// Intersection over union with deface's `+1` pixel convention (boxes
    /// that merely touch overlap by one pixel).
    pub fn iou(&self, other: &Face) -> f32 {
        let [ax1, ay1, ax2, ay2] = self.bbox;
        let [bx1, by1, bx2, by2] = other.bbox;
        let w = (ax2.min(bx2) - ax1.max(bx1) + 1.0).max(0.0);
        let h = (ay2.min(by2) - ay1.max(by1) + 1.0).max(0.0);
        let inter = w * h;
        let area = |x1: f32, y1: f32, x2: f32, y2: f32| (x2 - x1 + 1.0) * (y2 - y1 + 1.0);
        inter / (area(ax1, ay1, ax2, ay2) + area(bx1, by1, bx2, by2) - inter)
    }

    /// Every x multiplied by `fx` and every y by `fy` (a reduced decode's
    /// pixels → the original's).
    pub fn scaled(&self, fx: f32, fy: f32) -> Face {
        let [x1, y1, x2, y2] = self.bbox;
        Face { bbox: [x1 * fx, y1 * fy, x2 * fx, y2 * fy], score: self.score, landmarks: self.landmarks.map(|[x, y]| [x * fx, y * fy]) }
    }

    /// Every coordinate divided by `scale` (canvas → original pixels).
    pub fn unscaled(&self, scale: f32) -> Face {
        Face { bbox: self.bbox.map(|v| v / scale), score: self.score, landmarks: self.landmarks.map(|[x, y]| [x / scale, y / scale]) }
    }

    /// Every coordinate clamped to `[0, width] × [0, height]`.
    pub fn clamped(&self, width: f32, height: f32) -> Face {
        let [x1, y1, x2, y2] = self.bbox;
        Face {
            bbox: [x1.clamp(0.0, width), y1.clamp(0.0, height), x2.clamp(0.0, width), y2.clamp(0.0, height)],
            score: self.score,
            landmarks: self.landmarks.map(|[x, y]| [x.clamp(0.0, width), y.clamp(0.0, height)]),
        }
    }
}

/// The model's outputs do not look like CenterFace's.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("the model's outputs are not CenterFace's: {0}")]
pub struct DecodeError(pub String);

impl DecodeError {
    /// The HTTP status this error answers with (500: host or model mismatch).
    pub fn status(&self) -> u16 {
        500
    }

    /// The stable `snake_case` code of this error.
    pub fn code(&self) -> &'static str {
        "bad_model_output"
    }
}

/// Borrowed, validated view of CenterFace's four output tensors for one
/// sample: heatmap `[1,h,w]`, scale `[2,h,w]`, offset `[2,h,w]`, landmarks
/// `[10,h,w]`, all `f32` little-endian, `h = H/4`, `w = W/4`.
#[derive(Debug, Clone, Copy)]
pub struct Outputs<'a> {
    planes: [&'a [u8]; 4],
    height: usize,
    width: usize,
    input: (u32, u32),
}

impl<'a> Outputs<'a> {
    /// Checks the tensors `infer` returned for an `input_height ×
    /// input_width` input.
    pub fn new(tensors: &'a [Tensor], input_height: u32, input_width: u32) -> Result<Self, DecodeError> {
        if tensors.len() != 4 {
            return Err(DecodeError(format!("expected 4 tensors, got {}", tensors.len())));
        }
        let (height, width) = ((input_height / STRIDE) as usize, (input_width / STRIDE) as usize);
        let mut planes: [&[u8]; 4] = [&[]; 4];
        for (i, (tensor, channels)) in tensors.iter().zip(CHANNELS).enumerate() {
            check_tensor(i, tensor, [channels, height, width])?;
            planes[i] = &tensor.data;
        }
        Ok(Self { planes, height, width, input: (input_height, input_width) })
    }

    /// Value of output `tensor`, channel `channel`, cell `cell` (`row * w + col`).
    fn at(&self, tensor: usize, channel: usize, cell: usize) -> f32 {
        let i = (channel * self.height * self.width + cell) * 4;
        let bytes = &self.planes[tensor][i..i + 4];
        f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }
}

fn check_tensor(index: usize, tensor: &Tensor, dims: [usize; 3]) -> Result<(), DecodeError> {
    let shape: Vec<usize> = tensor.shape.iter().map(|&d| d as usize).collect();
    if tensor.element != ElementType::F32 || shape != dims {
        return Err(DecodeError(format!("output {index}: expected f32 {dims:?}, got {:?} {shape:?}", tensor.element)));
    }
    if tensor.data.len() != dims.iter().product::<usize>() * 4 {
        return Err(DecodeError(format!("output {index}: {} data bytes for {dims:?}", tensor.data.len())));
    }
    Ok(())
}

/// Every cell whose heatmap score is above `threshold`, decoded into a face
/// in model-input pixels (before NMS; in heatmap order).
pub fn decode(outputs: &Outputs<'_>, threshold: f32) -> Vec<Face> {
    let heatmap = outputs.planes[0];
    heatmap
        .chunks_exact(4)
        .enumerate()
        .filter(|(_, b)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) > threshold)
        .map(|(cell, _)| decode_cell(outputs, cell))
        .collect()
}

/// Decodes the face at one heatmap cell (deface's formulas).
fn decode_cell(outputs: &Outputs<'_>, cell: usize) -> Face {
    const S: f32 = STRIDE as f32;
    let (row, col) = ((cell / outputs.width) as f32, (cell % outputs.width) as f32);
    let (input_h, input_w) = (outputs.input.0 as f32, outputs.input.1 as f32);
    let sh = outputs.at(1, 0, cell).exp() * S;
    let sw = outputs.at(1, 1, cell).exp() * S;
    let (oy, ox) = (outputs.at(2, 0, cell), outputs.at(2, 1, cell));
    let x1 = ((col + ox + 0.5) * S - sw / 2.0).max(0.0).min(input_w);
    let y1 = ((row + oy + 0.5) * S - sh / 2.0).max(0.0).min(input_h);
    let landmarks = std::array::from_fn(|j| {
        let y = outputs.at(3, 2 * j, cell) * sh + y1;
        let x = outputs.at(3, 2 * j + 1, cell) * sw + x1;
        [x, y]
    });
    Face { bbox: [x1, y1, (x1 + sw).min(input_w), (y1 + sh).min(input_h)], score: outputs.at(0, 0, cell), landmarks }
}

/// Sorts faces by score, highest first (stable for ties).
pub fn sort_by_score(faces: &mut [Face]) {
    faces.sort_by(|a, b| b.score.total_cmp(&a.score));
}

/// Greedy non-maximum suppression: walking from the highest score down, a
/// face is kept unless a kept face overlaps it with IoU ≥ `iou_threshold`.
/// The result is sorted by score, highest first.
pub fn nms(mut faces: Vec<Face>, iou_threshold: f32) -> Vec<Face> {
    sort_by_score(&mut faces);
    let mut kept: Vec<Face> = Vec::with_capacity(faces.len().min(64));
    for face in faces {
        if kept.iter().all(|k| k.iou(&face) < iou_threshold) {
            kept.push(face);
        }
    }
    kept
}

/// Decode, NMS, then map to an original image of `width × height` that was
/// letterboxed with `scale` (faces divided by it and clamped to the image).
/// Sorted by score, highest first.
pub fn postprocess(outputs: &Outputs<'_>, threshold: f32, iou_threshold: f32, scale: f32, (width, height): (u32, u32)) -> Vec<Face> {
    nms(decode(outputs, threshold), iou_threshold)
        .into_iter()
        .map(|face| face.unscaled(scale).clamped(width as f32, height as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Synthetic outputs for an `h × w` grid (input `4h × 4w`).
    struct Synthetic {
        h: usize,
        w: usize,
        planes: Vec<Vec<f32>>,
    }

    impl Synthetic {
        fn new(h: usize, w: usize) -> Self {
            let planes = CHANNELS.iter().map(|c| vec![0.0; c * h * w]).collect();
            Self { h, w, planes }
        }

        fn set(&mut self, tensor: usize, channel: usize, row: usize, col: usize, v: f32) {
            let (h, w) = (self.h, self.w);
            self.planes[tensor][channel * h * w + row * w + col] = v;
        }

        /// A face at cell (row, col): score, log-size (h, w) in cells, offset.
        fn face(&mut self, row: usize, col: usize, score: f32, size: (f32, f32), off: (f32, f32)) {
            self.set(0, 0, row, col, score);
            self.set(1, 0, row, col, size.0.ln());
            self.set(1, 1, row, col, size.1.ln());
            self.set(2, 0, row, col, off.0);
            self.set(2, 1, row, col, off.1);
            for j in 0..5 {
                self.set(3, 2 * j, row, col, 0.1 * j as f32); // y fraction
                self.set(3, 2 * j + 1, row, col, 0.2 * j as f32); // x fraction
            }
        }

        fn tensors(&self) -> Vec<Tensor> {
            self.planes
                .iter()
                .zip(CHANNELS)
                .map(|(plane, c)| Tensor {
                    shape: vec![c as u32, self.h as u32, self.w as u32],
                    element: ElementType::F32,
                    data: plane.iter().flat_map(|v| v.to_le_bytes()).collect(),
                })
                .collect()
        }
    }

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() < 1e-3
    }

    fn face(bbox: [f32; 4], score: f32) -> Face {
        Face { bbox, score, landmarks: [[0.0; 2]; 5] }
    }

    #[test]
    fn decodes_one_face_with_deface_formulas() {
        let mut s = Synthetic::new(8, 10);
        s.face(3, 5, 0.9, (2.0, 1.0), (0.25, -0.5));
        let tensors = s.tensors();
        let outputs = Outputs::new(&tensors, 32, 40).expect("valid");
        let faces = decode(&outputs, 0.5);
        assert_eq!(faces.len(), 1);
        let f = faces[0];
        // sh = 2*4 = 8, sw = 1*4 = 4; x1 = (5 - 0.5 + 0.5)*4 - 2 = 18; y1 = (3 + 0.25 + 0.5)*4 - 4 = 11
        assert!(close(f.bbox[0], 18.0) && close(f.bbox[1], 11.0), "{f:?}");
        assert!(close(f.bbox[2], 22.0) && close(f.bbox[3], 19.0), "{f:?}");
        assert!(close(f.score, 0.9));
        // landmark j: x = 0.2j * 4 + 18, y = 0.1j * 8 + 11
        assert!(close(f.landmarks[4][0], 18.0 + 3.2) && close(f.landmarks[4][1], 11.0 + 3.2));
    }

    #[test]
    fn threshold_is_strict_and_boxes_clamp_to_the_input() {
        let mut s = Synthetic::new(8, 8);
        s.face(0, 0, 0.5, (4.0, 4.0), (0.0, 0.0)); // exactly at threshold: dropped
        s.face(7, 7, 0.8, (4.0, 4.0), (0.0, 0.0)); // centre (30, 30), size 16
        let tensors = s.tensors();
        let faces = decode(&Outputs::new(&tensors, 32, 32).expect("valid"), 0.5);
        assert_eq!(faces.len(), 1);
        assert_eq!(faces[0].bbox, [22.0, 22.0, 32.0, 32.0]);
    }

    #[test]
    fn rejects_outputs_of_the_wrong_shape() {
        let s = Synthetic::new(8, 8);
        let mut tensors = s.tensors();
        assert!(Outputs::new(&tensors, 32, 36).is_err());
        assert!(Outputs::new(&tensors[..3], 32, 32).is_err());
        tensors[3].data.pop();
        let error = Outputs::new(&tensors, 32, 32).expect_err("must fail");
        assert_eq!((DecodeError::status(&error), error.code()), (500, "bad_model_output"));
    }

    #[test]
    fn iou_uses_the_plus_one_convention() {
        let a = face([0.0, 0.0, 9.0, 9.0], 0.9); // 10×10 with +1
        assert!(close(a.iou(&a), 1.0));
        let b = face([5.0, 0.0, 14.0, 9.0], 0.8); // overlap 5×10 = 50; union 150
        assert!(close(a.iou(&b), 1.0 / 3.0));
        let far = face([20.0, 20.0, 30.0, 30.0], 0.8);
        assert_eq!(a.iou(&far), 0.0);
    }

    #[test]
    fn nms_keeps_the_best_of_each_overlapping_group() {
        let faces = vec![
            face([0.0, 0.0, 9.0, 9.0], 0.7),
            face([1.0, 1.0, 10.0, 10.0], 0.9), // overlaps the first heavily
            face([6.0, 0.0, 15.0, 9.0], 0.6),  // IoU 0.29 with the best; the first is gone
            face([50.0, 50.0, 60.0, 60.0], 0.8),
        ];
        let kept = nms(faces, 0.3);
        let scores: Vec<f32> = kept.iter().map(|f| f.score).collect();
        assert_eq!(scores, vec![0.9, 0.8, 0.6]);
    }

    #[test]
    fn nms_suppresses_at_exactly_the_threshold() {
        let a = face([0.0, 0.0, 9.0, 9.0], 0.9);
        let b = face([5.0, 0.0, 14.0, 9.0], 0.8); // IoU exactly 1/3
        assert_eq!(nms(vec![a, b], 1.0 / 3.0).len(), 1);
        assert_eq!(nms(vec![a, b], 0.34).len(), 2);
    }

    #[test]
    fn postprocess_maps_back_to_the_original_image() {
        let mut s = Synthetic::new(8, 8);
        s.face(2, 2, 0.9, (2.0, 2.0), (0.0, 0.0)); // box [6, 6, 14, 14] on a 32×32 canvas
        s.face(2, 3, 0.6, (2.0, 2.0), (0.0, 0.0)); // [10, 6, 18, 14]: IoU 0.38 → suppressed
        s.face(7, 0, 0.7, (2.0, 2.0), (0.0, 0.0)); // [0, 26, 8, 32]
        let tensors = s.tensors();
        let outputs = Outputs::new(&tensors, 32, 32).expect("valid");
        // The original was 64×50, letterboxed with scale 0.5 (canvas content 32×25).
        let faces = postprocess(&outputs, 0.5, 0.3, 0.5, (64, 50));
        assert_eq!(faces.len(), 2);
        assert_eq!(faces[0].bbox, [12.0, 12.0, 28.0, 28.0]);
        assert_eq!(faces[1].bbox, [0.0, 50.0, 16.0, 50.0]); // clamped to the image
        assert!(faces[1].landmarks.iter().all(|&[x, y]| x <= 64.0 && y <= 50.0));
    }
}
