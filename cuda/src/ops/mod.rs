//! Host launchers, one per plan op (and the helper steps of the composite ones), on the
//! device's compute stream. Each checks element types, lengths and `int` ranges against the
//! dimensions it is given, then launches; semantics are exactly the plan ops' docstrings in
//! `schedule/src/op.rs` and the CPU kernels of `engine::cpu`.
//!
//! Launchers that need temporary memory take a `scratch` buffer whose minimum length is given
//! by a matching `*_scratch_len` function; the caller carves it from an arena.
pub mod attention;
pub mod kl_shampoo;
pub mod loss;
pub mod nn;
pub mod norm;
pub mod optim;
pub mod shampoo;

use crate::device::INT_MAX;
use crate::error::{CudaError, Result};

/// `v` as a kernel `int`, or [`CudaError::Invalid`].
pub(crate) fn int(op: &'static str, what: &'static str, v: usize) -> Result<i32> {
    if v > INT_MAX {
        return Err(CudaError::Invalid {
            op,
            what: format!("{what} = {v} exceeds the kernels' int range"),
        });
    }
    Ok(v as i32)
}

/// Errors ([`CudaError::Shape`]) unless `scratch` is f32 with at least `need` elements.
pub(crate) fn check_scratch(op: &'static str, scratch: &crate::Buf, need: usize) -> Result<()> {
    if scratch.len() < need || scratch.elem() != crate::Elem::F32 {
        return Err(CudaError::Shape {
            op,
            operand: "scratch",
            expected: need,
            got: scratch.len(),
        });
    }
    Ok(())
}

/// Threads for a one-block-per-row kernel over rows of `c` elements: `c` rounded up to a warp,
/// between 32 and 1024.
pub(crate) fn row_threads(c: usize) -> u32 {
    c.next_multiple_of(32).clamp(32, 1024) as u32
}

/// Errors unless `n` splits into whole rows of `c`; returns the row count.
pub(crate) fn rows_of(
    op: &'static str,
    operand: &'static str,
    n: usize,
    c: usize,
) -> Result<usize> {
    if c == 0 || n % c != 0 {
        return Err(CudaError::Shape {
            op,
            operand,
            expected: c,
            got: n,
        });
    }
    Ok(n / c)
}

/// Errors when two buffers overlap (kernels that read one while writing the other).
pub(crate) fn no_alias(op: &'static str, a: &crate::Buf, b: &crate::Buf) -> Result<()> {
    if a.overlaps(b) {
        return Err(CudaError::Invalid {
            op,
            what: "input and output overlap; this kernel needs separate buffers".into(),
        });
    }
    Ok(())
}
