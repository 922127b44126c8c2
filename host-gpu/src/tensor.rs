//! Dense tensors as they cross the host/guest boundary: a shape, an element
//! type and raw little-endian bytes.

use serde::Serialize;

/// How a tensor's bytes are to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ElementType {
    /// One byte per element.
    U8,
    /// Four little-endian bytes per element.
    F32,
}

impl ElementType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::F32 => 4,
        }
    }
}

/// A dense, row-major tensor whose `data` holds exactly
/// `product(shape) * element.size()` bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    element: ElementType,
    data: Vec<u8>,
}

/// A tensor whose byte length does not match its shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tensor of shape {} ({element:?}) needs {expected} bytes, got {actual}", brief_shape(shape))]
pub struct ShapeMismatch {
    /// The declared shape.
    pub shape: Vec<usize>,
    /// The declared element type.
    pub element: ElementType,
    /// Bytes the shape implies (saturating).
    pub expected: usize,
    /// Bytes supplied.
    pub actual: usize,
}

/// Dimensions shown by [`brief_shape`] before it only counts them.
const SHAPE_SHOWN: usize = 8;

/// `shape` for a message: in full up to [`SHAPE_SHOWN`] dimensions, else
/// the first few and the count. A caller's shape can be millions long; its
/// message must not be.
pub fn brief_shape(shape: &[usize]) -> String {
    if shape.len() <= SHAPE_SHOWN {
        return format!("{shape:?}");
    }
    format!("{:?} … ({} dimensions)", &shape[..SHAPE_SHOWN], shape.len())
}

impl Tensor {
    /// Builds a tensor, checking that `data` has exactly the bytes `shape` implies.
    pub fn new(shape: Vec<usize>, element: ElementType, data: Vec<u8>) -> Result<Self, ShapeMismatch> {
        let expected = byte_len(&shape, element);
        if expected != Some(data.len()) {
            return Err(ShapeMismatch { expected: expected.unwrap_or(usize::MAX), actual: data.len(), shape, element });
        }
        Ok(Self { shape, element, data })
    }

    /// Builds an f32 tensor from values (stored little-endian).
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<Self, ShapeMismatch> {
        let mut data = Vec::with_capacity(values.len() * 4);
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        Self::new(shape, ElementType::F32, data)
    }

    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element type.
    pub fn element(&self) -> ElementType {
        self.element
    }

    /// Raw bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len() / self.element.size()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Decodes the elements of an f32 tensor (`None` for other element types).
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        (self.element == ElementType::F32)
            .then(|| self.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    /// Takes the tensor apart into shape, element type and bytes.
    pub fn into_parts(self) -> (Vec<usize>, ElementType, Vec<u8>) {
        (self.shape, self.element, self.data)
    }
}

/// Bytes a tensor of `shape` needs, or `None` on overflow.
pub fn byte_len(shape: &[usize], element: ElementType) -> Option<usize> {
    shape.iter().try_fold(element.size(), |acc, &d| acc.checked_mul(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_rejects_wrong_length() {
        let err = Tensor::new(vec![2, 3], ElementType::F32, vec![0; 23]).unwrap_err();
        assert_eq!((err.expected, err.actual), (24, 23));
        assert!(Tensor::new(vec![2, 3], ElementType::F32, vec![0; 24]).is_ok());
    }

    #[test]
    fn overflowing_shape_is_rejected_not_panicking() {
        let err = Tensor::new(vec![usize::MAX, 2], ElementType::U8, vec![]).unwrap_err();
        assert_eq!(err.expected, usize::MAX);
    }

    #[test]
    fn a_mismatch_names_a_long_shape_briefly() {
        let err = Tensor::new(vec![u32::MAX as usize; 1 << 20], ElementType::U8, vec![]).unwrap_err();
        let message = err.to_string();
        assert!(message.len() < 200 && message.contains("(1048576 dimensions)"), "{message}");
        let short = Tensor::new(vec![2, 3], ElementType::U8, vec![]).unwrap_err().to_string();
        assert!(short.starts_with("tensor of shape [2, 3] (U8) needs 6 bytes"), "{short}");
    }

    #[test]
    fn f32_round_trips_little_endian() {
        let t = Tensor::from_f32(vec![3], &[1.5, -2.0, 0.25]).unwrap();
        assert_eq!(&t.data()[..4], &1.5f32.to_le_bytes());
        assert_eq!(t.to_f32_vec().unwrap(), vec![1.5, -2.0, 0.25]);
        assert_eq!(t.len(), 3);
    }
}
