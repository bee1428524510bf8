//! Elementwise and broadcast kernels: add, bias add, column sums (bias gradient), GELU
//! (tanh approximation) and SwiGLU, forward and backward.
use super::{block_sums, check_len, Float};
use crate::EngineError;
use rayon::prelude::*;

/// Elements per rayon task for elementwise loops.
const GRAIN: usize = 1 << 14;

/// Elementwise `out = a + b`; all three have the same length.
pub fn add<T: Float>(a: &[T], b: &[T], out: &mut [T]) -> Result<(), EngineError> {
    check_len("add", "b", b.len(), a.len())?;
    check_len("add", "out", out.len(), a.len())?;
    out.par_chunks_mut(GRAIN)
        .zip(a.par_chunks(GRAIN).zip(b.par_chunks(GRAIN)))
        .for_each(|(o, (a, b))| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
    Ok(())
}

/// `out[n, :] = x[n, :] + bias`. x/out `[N, c]`, bias `[c]`.
pub fn bias_add<T: Float>(x: &[T], bias: &[T], out: &mut [T], c: usize) -> Result<(), EngineError> {
    check_len("bias_add", "bias", bias.len(), c)?;
    check_len("bias_add", "out", out.len(), x.len())?;
    out.par_chunks_mut(c)
        .with_min_len(super::min_rows(c))
        .zip(x.par_chunks(c))
        .for_each(|(o, xr)| {
            for ((o, &a), &b) in o.iter_mut().zip(xr).zip(bias) {
                *o = a + b;
            }
        });
    Ok(())
}

/// `x[n, :] += bias` in place (the epilogue of a `MatMulBias`): the same additions as
/// [`bias_add`]. x `[N, c]`, bias `[c]`.
pub fn bias_add_in_place<T: Float>(x: &mut [T], bias: &[T], c: usize) -> Result<(), EngineError> {
    check_len("mat_mul_bias", "bias", bias.len(), c)?;
    if c == 0 || x.len() % c != 0 {
        return Err(EngineError::Shape {
            op: "mat_mul_bias",
            operand: "out",
            expected: c,
            got: x.len(),
        });
    }
    x.par_chunks_mut(c)
        .with_min_len(super::min_rows(c))
        .for_each(|row| {
            for (o, &b) in row.iter_mut().zip(bias) {
                *o = *o + b;
            }
        });
    Ok(())
}

/// `out[j] = Σ_n x[n, j]` (the gradient of a bias). x `[N, c]`, out `[c]` (overwritten).
/// Partial sums are taken over fixed row blocks and added in order, so the result does not
/// depend on the thread count.
pub fn sum_rows<T: Float>(x: &[T], out: &mut [T], c: usize) -> Result<(), EngineError> {
    check_len("sum_rows", "out", out.len(), c)?;
    if c == 0 || x.len() % c != 0 {
        return Err(EngineError::Shape {
            op: "sum_rows",
            operand: "x",
            expected: c,
            got: x.len(),
        });
    }
    let sums = block_sums(x.len() / c, c, |n, acc: &mut [T]| {
        for (a, &v) in acc.iter_mut().zip(&x[n * c..(n + 1) * c]) {
            *a += v;
        }
    });
    out.copy_from_slice(&sums);
    Ok(())
}

/// √(2/π), the GPT-2 GELU constant.
const GELU_S: f64 = 0.797_884_560_802_865_4;
/// Cubic coefficient of the GPT-2 GELU approximation.
const GELU_C: f64 = 0.044_715;

/// `sigmoid(2u) = ½(1 + tanh u)` with `u = √(2/π)(x + 0.044715 x³)`: the GELU's gate without
/// `1 + tanh u`, which cancels catastrophically in f32 for x below about −3.
fn gelu_gate<T: Float>(v: T) -> T {
    let (s, k, two) = (T::from_f64(GELU_S), T::from_f64(GELU_C), T::from_f64(2.0));
    sigmoid(two * s * (v + k * v * v * v))
}

/// GELU, tanh approximation (Hendrycks & Gimpel 2016, as in GPT-2):
/// `out = ½ x (1 + tanh(√(2/π) (x + 0.044715 x³)))`, computed as `x · sigmoid(2u)` (the same
/// function, accurate to rounding for negative x). Same shapes.
pub fn gelu<T: Float>(x: &[T], out: &mut [T]) -> Result<(), EngineError> {
    check_len("gelu", "out", out.len(), x.len())?;
    out.par_chunks_mut(GRAIN)
        .zip(x.par_chunks(GRAIN))
        .for_each(|(o, xs)| {
            for (o, &v) in o.iter_mut().zip(xs) {
                *o = v * gelu_gate(v);
            }
        });
    Ok(())
}

/// `dx = dout · gelu′(x)` for [`gelu`], with `u = √(2/π)(x + 0.044715x³)`, `t = tanh u`:
/// `gelu′(x) = ½(1 + t) + ½ x (1 − t²) √(2/π) (1 + 3·0.044715 x²)`, computed with
/// `g = sigmoid(2u)`: `½(1 + t) = g`, `1 − t² = 4 g (1 − g)`.
pub fn gelu_backward<T: Float>(dout: &[T], x: &[T], dx: &mut [T]) -> Result<(), EngineError> {
    check_len("gelu_backward", "dout", dout.len(), x.len())?;
    check_len("gelu_backward", "dx", dx.len(), x.len())?;
    let (s, k, two, three) = (
        T::from_f64(GELU_S),
        T::from_f64(GELU_C),
        T::from_f64(2.0),
        T::from_f64(3.0),
    );
    dx.par_chunks_mut(GRAIN)
        .zip(x.par_chunks(GRAIN).zip(dout.par_chunks(GRAIN)))
        .for_each(|(d, (xs, g))| {
            for ((d, &v), &g) in d.iter_mut().zip(xs).zip(g) {
                let q = gelu_gate(v);
                let grad = q + two * v * q * (T::one() - q) * s * (T::one() + three * k * v * v);
                *d = g * grad;
            }
        });
    Ok(())
}

/// Logistic sigmoid `1 / (1 + e^{−x})`.
fn sigmoid<T: Float>(v: T) -> T {
    T::one() / (T::one() + (-v).exp())
}

/// SwiGLU (Shazeer 2020): x `[N, 2F]` holds `[gate | up]` per row;
/// `out[n, f] = silu(gate[n, f]) · up[n, f]` with `silu(g) = g·σ(g)`; out `[N, F]`.
pub fn swiglu<T: Float>(x: &[T], out: &mut [T], f: usize) -> Result<(), EngineError> {
    check_len("swi_glu", "x", x.len(), 2 * out.len())?;
    if f == 0 || out.len() % f != 0 {
        return Err(EngineError::Shape {
            op: "swi_glu",
            operand: "out",
            expected: f,
            got: out.len(),
        });
    }
    out.par_chunks_mut(f)
        .with_min_len(super::min_rows(f))
        .zip(x.par_chunks(2 * f))
        .for_each(|(o, xr)| {
            let (gate, up) = xr.split_at(f);
            for j in 0..f {
                o[j] = gate[j] * sigmoid(gate[j]) * up[j];
            }
        });
    Ok(())
}

/// Gradient of [`swiglu`]: `dgate = dout · up · σ(g)(1 + g(1 − σ(g)))`, `dup = dout · silu(g)`.
/// dout `[N, F]`, x/dx `[N, 2F]`.
pub fn swiglu_backward<T: Float>(
    dout: &[T],
    x: &[T],
    dx: &mut [T],
    f: usize,
) -> Result<(), EngineError> {
    check_len("swi_glu_backward", "x", x.len(), 2 * dout.len())?;
    check_len("swi_glu_backward", "dx", dx.len(), x.len())?;
    if f == 0 || dout.len() % f != 0 {
        return Err(EngineError::Shape {
            op: "swi_glu_backward",
            operand: "dout",
            expected: f,
            got: dout.len(),
        });
    }
    dx.par_chunks_mut(2 * f)
        .with_min_len(super::min_rows(f))
        .zip(x.par_chunks(2 * f).zip(dout.par_chunks(f)))
        .for_each(|(d, (xr, g))| {
            let (gate, up) = xr.split_at(f);
            let (dgate, dup) = d.split_at_mut(f);
            for j in 0..f {
                let sg = sigmoid(gate[j]);
                dgate[j] = g[j] * up[j] * sg * (T::one() + gate[j] * (T::one() - sg));
                dup[j] = g[j] * gate[j] * sg;
            }
        });
    Ok(())
}
