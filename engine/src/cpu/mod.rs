//! The CPU backend: kernels (one file per family, generic over [`Float`]) and the plan
//! interpreter [`CpuEngine`].
//!
//! Kernels take row-major slices plus the dimensions they need and return
//! `Result<(), EngineError>`: a wrong slice length or an out-of-range id is an error, never a
//! panic. Row-parallel kernels run on the current rayon pool (the engine installs one sized by
//! the plan's `threads`); reductions over rows use fixed blocks added in order, so results do
//! not depend on the thread count.
pub mod attention;
pub mod clip;
pub mod cross_entropy;
pub mod elementwise;
pub mod embedding;
mod engine;
mod exec;
mod float;
mod host;
pub mod matmul;
pub mod norms;
pub mod positional;
pub mod rope;
mod store;
mod tiers;

pub use engine::{adamw_kernels, CpuEngine, EngineOptions, EngineStats};
pub use float::{fast_exp_f32, Float};

use crate::EngineError;
use rayon::prelude::*;

/// Errors unless `got == expected`.
pub(crate) fn check_len(
    op: &'static str,
    operand: &'static str,
    got: usize,
    expected: usize,
) -> Result<(), EngineError> {
    if got == expected {
        Ok(())
    } else {
        Err(EngineError::Shape {
            op,
            operand,
            expected,
            got,
        })
    }
}

/// Rows per rayon task for a row-parallel kernel over rows of `c` elements (≈ 8k elements a
/// task, so small activations do not pay for thread hand-offs).
pub(crate) fn min_rows(c: usize) -> usize {
    (8192 / c.max(1)).max(1)
}

/// Rows per block of [`block_sums`].
const SUM_BLOCK_ROWS: usize = 64;

/// `Σ_n f(n)` over `n` rows into a `width`-vector: each block of [`SUM_BLOCK_ROWS`] rows is
/// accumulated by `f(row, acc)` in parallel, and the block partials are added in block order
/// (deterministic for any thread count).
pub(crate) fn block_sums<T: Float>(
    rows: usize,
    width: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) -> Vec<T> {
    let blocks = rows.div_ceil(SUM_BLOCK_ROWS);
    let partials: Vec<Vec<T>> = (0..blocks)
        .into_par_iter()
        .map(|blk| {
            let mut acc = vec![T::zero(); width];
            for n in blk * SUM_BLOCK_ROWS..((blk + 1) * SUM_BLOCK_ROWS).min(rows) {
                f(n, &mut acc);
            }
            acc
        })
        .collect();
    let mut out = vec![T::zero(); width];
    for p in &partials {
        for (o, &v) in out.iter_mut().zip(p) {
            *o += v;
        }
    }
    out
}
