//! Value types of the IR: dense tensors with a static shape and an element type.
use schedule::DType;
use std::fmt;

/// The type of an IR value: a dense row-major tensor. Prints as `f32[1024, 64]` (element
/// types `f32`, `i32`, `bf16`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Static shape; scalars are `[1]`.
    pub shape: Vec<usize>,
}

impl TensorType {
    /// An f32 tensor of `shape`.
    pub fn f32(shape: impl Into<Vec<usize>>) -> Self {
        TensorType {
            dtype: DType::F32,
            shape: shape.into(),
        }
    }
    /// An i32 tensor of `shape`.
    pub fn i32(shape: impl Into<Vec<usize>>) -> Self {
        TensorType {
            dtype: DType::I32,
            shape: shape.into(),
        }
    }
    /// Element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Size in bytes.
    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype.name())?;
        for (i, s) in self.shape.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{s}")?;
        }
        write!(f, "]")
    }
}
