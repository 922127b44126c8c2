//! What a model accepts and returns, per sample (no batch dimension).

use crate::error::InferError;
use crate::tensor::{ElementType, Tensor};

/// Shape and type of one input or output of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    /// Name in the model graph.
    pub name: String,
    /// Dimensions; 0 means "any size" (see [`ModelSpec::dim_multiple`]).
    pub shape: Vec<usize>,
    /// Element type.
    pub element: ElementType,
}

/// Everything a caller needs to build valid inputs for a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// The name callers pass to `infer`.
    pub name: String,
    /// Input of one sample, e.g. `[0, 0, 3]` u8: any H×W RGB image.
    pub input: TensorSpec,
    /// Outputs of one sample, in the order `infer` returns them.
    pub outputs: Vec<TensorSpec>,
    /// Free ("0") input dimensions must be multiples of this.
    pub dim_multiple: usize,
    /// Largest size accepted for a free dimension.
    pub max_side: usize,
    /// Most samples in one device batch.
    pub max_batch: usize,
}

impl ModelSpec {
    /// Bytes of the largest valid input sample: free dimensions at
    /// [`ModelSpec::max_side`]. What a caller may need to hand over at once.
    pub fn max_input_bytes(&self) -> usize {
        let elements = self.input.shape.iter().map(|&d| if d == 0 { self.max_side } else { d }).try_fold(1usize, usize::checked_mul);
        elements.and_then(|n| n.checked_mul(self.input.element.size())).unwrap_or(usize::MAX)
    }

    /// Checks a sample against the input spec; the error names what is wrong.
    pub fn validate_input(&self, tensor: &Tensor) -> Result<(), InferError> {
        let invalid = |msg: String| Err(InferError::InvalidInput(msg));
        if tensor.element() != self.input.element {
            return invalid(format!("expected {:?} elements, got {:?}", self.input.element, tensor.element()));
        }
        let shape = tensor.shape();
        if shape.len() != self.input.shape.len() {
            return invalid(format!("expected shape like {:?} (0 = any), got {}", self.input.shape, crate::tensor::brief_shape(shape)));
        }
        for (axis, (&want, &got)) in self.input.shape.iter().zip(shape).enumerate() {
            self.validate_dim(axis, want, got)?;
        }
        Ok(())
    }

    fn validate_dim(&self, axis: usize, want: usize, got: usize) -> Result<(), InferError> {
        let ok = if want == 0 { got > 0 && got <= self.max_side && got.is_multiple_of(self.dim_multiple.max(1)) } else { got == want };
        if ok {
            return Ok(());
        }
        let rule = if want == 0 { format!("a multiple of {} in 1..={}", self.dim_multiple, self.max_side) } else { format!("{want}") };
        Err(InferError::InvalidInput(format!("dimension {axis} is {got}, must be {rule}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ModelSpec {
        ModelSpec {
            name: "m".into(),
            input: TensorSpec { name: "x".into(), shape: vec![0, 0, 3], element: ElementType::U8 },
            outputs: vec![],
            dim_multiple: 32,
            max_side: 128,
            max_batch: 4,
        }
    }

    #[test]
    fn the_largest_input_has_free_dimensions_at_the_max_side() {
        assert_eq!(spec().max_input_bytes(), 128 * 128 * 3);
        let f32_fixed = ModelSpec { input: TensorSpec { shape: vec![2, 0], element: ElementType::F32, ..spec().input }, ..spec() };
        assert_eq!(f32_fixed.max_input_bytes(), 2 * 128 * 4);
        let huge = ModelSpec { max_side: usize::MAX, ..spec() };
        assert_eq!(huge.max_input_bytes(), usize::MAX, "saturates");
    }

    #[test]
    fn a_shape_of_a_million_dimensions_is_named_briefly() {
        let t = Tensor::new(vec![1; 1 << 20], ElementType::U8, vec![0]).unwrap();
        let Err(InferError::InvalidInput(message)) = spec().validate_input(&t) else { panic!("accepted") };
        assert!(message.len() < 200 && message.contains("1048576 dimensions"), "{message}");
    }

    fn image(h: usize, w: usize, c: usize) -> Tensor {
        Tensor::new(vec![h, w, c], ElementType::U8, vec![0; h * w * c]).unwrap()
    }

    #[test]
    fn accepts_multiples_within_bounds() {
        assert!(spec().validate_input(&image(64, 128, 3)).is_ok());
    }

    #[test]
    fn names_the_bad_dimension() {
        let err = spec().validate_input(&image(64, 100, 3)).unwrap_err();
        assert!(matches!(&err, InferError::InvalidInput(m) if m.contains("dimension 1 is 100")), "{err}");
        let err = spec().validate_input(&image(160, 32, 3)).unwrap_err();
        assert!(matches!(&err, InferError::InvalidInput(m) if m.contains("dimension 0 is 160")), "{err}");
        let err = spec().validate_input(&image(32, 32, 4)).unwrap_err();
        assert!(matches!(&err, InferError::InvalidInput(m) if m.contains("must be 3")), "{err}");
    }

    #[test]
    fn rejects_wrong_rank_and_type() {
        let flat = Tensor::new(vec![96], ElementType::U8, vec![0; 96]).unwrap();
        assert!(spec().validate_input(&flat).is_err());
        let f = Tensor::new(vec![32, 32, 3], ElementType::F32, vec![0; 32 * 32 * 3 * 4]).unwrap();
        assert!(spec().validate_input(&f).is_err());
    }
}
