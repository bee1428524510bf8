//! Rotary position embedding (Su et al. 2021, "RoFormer") in LLaMA's rotate-half layout.
//!
//! For a head chunk `[x₁ | x₂]` of width `head_dim = 2h` at position `p` and `i < h`, with
//! `θᵢ = theta^(−2i/head_dim)`: `out₁ᵢ = x₁ᵢ cos(pθᵢ) − x₂ᵢ sin(pθᵢ)` and
//! `out₂ᵢ = x₂ᵢ cos(pθᵢ) + x₁ᵢ sin(pθᵢ)`. The backward is the inverse rotation (angle −pθᵢ).
use super::{check_len, Float};
use crate::EngineError;
use rayon::prelude::*;

/// Geometry of a rope call: x is `[N, width]`, the first `rotated_cols` columns are rotated in
/// chunks of `head_dim`, row n has position `n mod seq_len`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeDims {
    /// Columns of x.
    pub width: usize,
    /// Tokens per sequence (position period).
    pub seq_len: usize,
    /// Width of one head chunk (even).
    pub head_dim: usize,
    /// Leading columns that are rotated (a multiple of `head_dim`, ≤ `width`).
    pub rotated_cols: usize,
    /// Base of the frequencies (10000 in RoFormer / LLaMA).
    pub theta: f64,
}

/// `(cos, sin)` tables `[seq_len, head_dim/2]`, computed in f64.
fn tables<T: Float>(d: &RopeDims) -> (Vec<T>, Vec<T>) {
    let h = d.head_dim / 2;
    let mut cos = Vec::with_capacity(d.seq_len * h);
    let mut sin = Vec::with_capacity(d.seq_len * h);
    for p in 0..d.seq_len {
        for i in 0..h {
            let freq = d.theta.powf(-2.0 * i as f64 / d.head_dim as f64);
            let a = p as f64 * freq;
            cos.push(T::from_f64(a.cos()));
            sin.push(T::from_f64(a.sin()));
        }
    }
    (cos, sin)
}

fn check<T0>(op: &'static str, x: &[T0], out_len: usize, d: &RopeDims) -> Result<(), EngineError>
where
    T0: Sized,
{
    check_len(op, "out", out_len, x.len())?;
    let bad = d.width == 0
        || x.len() % d.width != 0
        || d.seq_len == 0
        || d.head_dim == 0
        || d.head_dim % 2 != 0
        || d.rotated_cols % d.head_dim != 0
        || d.rotated_cols > d.width;
    if bad {
        return Err(EngineError::Shape {
            op,
            operand: "x",
            expected: d.width,
            got: x.len(),
        });
    }
    Ok(())
}

/// Shared body: rotate by `+pθ` (`sign = 1`) or `−pθ` (`sign = −1`).
fn rotate<T: Float>(
    op: &'static str,
    x: &[T],
    out: &mut [T],
    d: &RopeDims,
    sign: T,
) -> Result<(), EngineError> {
    check::<T>(op, x, out.len(), d)?;
    let (cos, sin) = tables::<T>(d);
    let h = d.head_dim / 2;
    out.par_chunks_mut(d.width)
        .with_min_len(super::min_rows(d.width))
        .zip(x.par_chunks(d.width))
        .enumerate()
        .for_each(|(n, (o, xr))| {
            let p = n % d.seq_len;
            let (c, s) = (&cos[p * h..(p + 1) * h], &sin[p * h..(p + 1) * h]);
            for base in (0..d.rotated_cols).step_by(d.head_dim) {
                for i in 0..h {
                    let (x1, x2) = (xr[base + i], xr[base + h + i]);
                    let si = sign * s[i];
                    o[base + i] = x1 * c[i] - x2 * si;
                    o[base + h + i] = x2 * c[i] + x1 * si;
                }
            }
            o[d.rotated_cols..].copy_from_slice(&xr[d.rotated_cols..]);
        });
    Ok(())
}

/// Applies RoPE to `x` `[N, width]` into `out` (same shape); see the module docs.
pub fn rope_forward<T: Float>(x: &[T], out: &mut [T], d: &RopeDims) -> Result<(), EngineError> {
    rotate("rope", x, out, d, T::one())
}

/// Gradient of [`rope_forward`]: `dx = Rᵀ dout`, the rotation by `−pθᵢ`.
pub fn rope_backward<T: Float>(dout: &[T], dx: &mut [T], d: &RopeDims) -> Result<(), EngineError> {
    rotate("rope_backward", dout, dx, d, -T::one())
}
