//! Dense GEMM on row-major slices through faer 0.24 (`faer::linalg::matmul::matmul`), with
//! optional transposes of either operand and optional accumulation into the output.
use super::{check_len, Float};
use crate::EngineError;
use faer::linalg::matmul::matmul as faer_matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

/// Shape of a stored row-major matrix operand, `[rows, cols]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Number of rows as stored.
    pub rows: usize,
    /// Number of columns as stored.
    pub cols: usize,
}

/// The faer parallelism to use for a GEMM of `m·k·p` multiply-adds on the current rayon pool:
/// sequential for small products (thread wake-up costs more than it saves).
pub fn gemm_par(m: usize, k: usize, p: usize) -> Par {
    let threads = rayon::current_num_threads();
    if threads <= 1 || m.saturating_mul(k).saturating_mul(p) < 1 << 18 {
        Par::Seq
    } else {
        Par::rayon(threads)
    }
}

/// `out = op(a) · op(b)` (or `out += …` when `accumulate`), where `op` transposes when the
/// corresponding flag is set.
///
/// a is stored `[a.rows, a.cols]` (logical `[M, K]`, or `[K, M]` stored when `trans_a`); b is
/// stored `[b.rows, b.cols]` (logical `[K, P]`, or `[P, K]` stored when `trans_b`); out is
/// `[M, P]`. A linear layer `y = x Wᵀ` with W `[out, in]` is `trans_b = true`; its weight
/// gradient `dW = dyᵀ x` is `trans_a = true`; its input gradient `dx = dy W` has no transposes.
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Float>(
    a: &[T],
    a_dims: Dims,
    b: &[T],
    b_dims: Dims,
    out: &mut [T],
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<(), EngineError> {
    check_len("mat_mul", "a", a.len(), a_dims.rows * a_dims.cols)?;
    check_len("mat_mul", "b", b.len(), b_dims.rows * b_dims.cols)?;
    let (m, k) = if trans_a {
        (a_dims.cols, a_dims.rows)
    } else {
        (a_dims.rows, a_dims.cols)
    };
    let (k2, p) = if trans_b {
        (b_dims.cols, b_dims.rows)
    } else {
        (b_dims.rows, b_dims.cols)
    };
    check_len("mat_mul", "b (inner dimension)", k2, k)?;
    check_len("mat_mul", "out", out.len(), m * p)?;
    let beta = if accumulate {
        Accum::Add
    } else {
        Accum::Replace
    };
    let threads = rayon::current_num_threads();
    if threads > 1 && m >= 256 && m.saturating_mul(k).saturating_mul(p) >= 1 << 22 {
        // Split the output rows into blocks, one sequential GEMM per block on the rayon pool:
        // on the wide-and-short products of a language-model head (e.g. dW [50257, 64] =
        // dlogitsᵀ x) this is ~1.4× faster than faer's own parallel split on 2 threads.
        let rows = (m / (4 * threads)).max(64);
        out.par_chunks_mut(rows * p).enumerate().for_each(|(i, o)| {
            let (r0, mb) = (i * rows, o.len() / p);
            let ablk = if trans_a {
                MatRef::from_row_major_slice_with_stride(&a[r0..], k, mb, m).transpose()
            } else {
                MatRef::from_row_major_slice(&a[r0 * k..(r0 + mb) * k], mb, k)
            };
            let bv = MatRef::from_row_major_slice(b, b_dims.rows, b_dims.cols);
            let bv = if trans_b { bv.transpose() } else { bv };
            faer_matmul(
                MatMut::from_row_major_slice_mut(o, mb, p),
                beta,
                ablk,
                bv,
                T::one(),
                Par::Seq,
            );
        });
        return Ok(());
    }
    let av = MatRef::from_row_major_slice(a, a_dims.rows, a_dims.cols);
    let bv = MatRef::from_row_major_slice(b, b_dims.rows, b_dims.cols);
    let av = if trans_a { av.transpose() } else { av };
    let bv = if trans_b { bv.transpose() } else { bv };
    let dst = MatMut::from_row_major_slice_mut(out, m, p);
    faer_matmul(dst, beta, av, bv, T::one(), gemm_par(m, k, p));
    Ok(())
}
