//! LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019) over the last dimension,
//! forward and backward; the backward recomputes the row statistics from `x`.
use super::{block_sums, check_len, Float};
use crate::EngineError;
use rayon::prelude::*;

/// Row statistics of LayerNorm: `(μ, 1/√(σ² + eps))` with the biased variance.
fn ln_stats<T: Float>(x: &[T], eps: T) -> (T, T) {
    let c = T::from_f64(x.len() as f64);
    let mean = x.iter().fold(T::zero(), |a, &v| a + v) / c;
    let var = x
        .iter()
        .fold(T::zero(), |a, &v| a + (v - mean) * (v - mean))
        / c;
    (mean, T::one() / (var + eps).sqrt())
}

/// LayerNorm: `out = (x − μ) / √(σ² + eps) · weight + bias`, μ and σ² (biased) per row.
///
/// x/out `[N, c]`, weight/bias `[c]` (`bias = None` means no bias).
pub fn layernorm_forward<T: Float>(
    x: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    out: &mut [T],
    c: usize,
    eps: f64,
) -> Result<(), EngineError> {
    check_len("layer_norm", "weight", weight.len(), c)?;
    check_len("layer_norm", "out", out.len(), x.len())?;
    if let Some(b) = bias {
        check_len("layer_norm", "bias", b.len(), c)?;
    }
    let eps = T::from_f64(eps);
    out.par_chunks_mut(c)
        .with_min_len(super::min_rows(c))
        .zip(x.par_chunks(c))
        .for_each(|(o, xr)| {
            let (mean, rstd) = ln_stats(xr, eps);
            for j in 0..c {
                let b = bias.map_or(T::zero(), |b| b[j]);
                o[j] = (xr[j] - mean) * rstd * weight[j] + b;
            }
        });
    Ok(())
}

/// Gradients of [`layernorm_forward`]. With `x̂ = (x − μ)·rstd` and `g = dout ⊙ weight`:
/// `dx = rstd · (g − mean(g) − x̂ · mean(g ⊙ x̂))`, `dweight = Σ_n dout ⊙ x̂`,
/// `dbias = Σ_n dout` (all overwritten).
///
/// dout/x/dx `[N, c]`, weight/dweight/dbias `[c]`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: Float>(
    dout: &[T],
    x: &[T],
    weight: &[T],
    dx: &mut [T],
    dweight: &mut [T],
    dbias: Option<&mut [T]>,
    c: usize,
    eps: f64,
) -> Result<(), EngineError> {
    check_len("layer_norm_backward", "weight", weight.len(), c)?;
    check_len("layer_norm_backward", "dweight", dweight.len(), c)?;
    check_len("layer_norm_backward", "dout", dout.len(), x.len())?;
    check_len("layer_norm_backward", "dx", dx.len(), x.len())?;
    let eps = T::from_f64(eps);
    let cf = T::from_f64(c as f64);
    dx.par_chunks_mut(c)
        .with_min_len(super::min_rows(c))
        .zip(x.par_chunks(c).zip(dout.par_chunks(c)))
        .for_each(|(dxr, (xr, dr))| {
            let (mean, rstd) = ln_stats(xr, eps);
            let (mut sg, mut sgx) = (T::zero(), T::zero());
            for j in 0..c {
                let g = dr[j] * weight[j];
                sg += g;
                sgx += g * (xr[j] - mean) * rstd;
            }
            let (mg, mgx) = (sg / cf, sgx / cf);
            for j in 0..c {
                let xh = (xr[j] - mean) * rstd;
                dxr[j] = rstd * (dr[j] * weight[j] - mg - xh * mgx);
            }
        });
    let has_bias = dbias.is_some();
    let width = if has_bias { 2 * c } else { c };
    let sums = block_sums(x.len() / c.max(1), width, |n, acc: &mut [T]| {
        let xr = &x[n * c..(n + 1) * c];
        let dr = &dout[n * c..(n + 1) * c];
        let (mean, rstd) = ln_stats(xr, eps);
        for j in 0..c {
            acc[j] += dr[j] * (xr[j] - mean) * rstd;
        }
        if has_bias {
            for j in 0..c {
                acc[c + j] += dr[j];
            }
        }
    });
    dweight.copy_from_slice(&sums[..c]);
    if let Some(db) = dbias {
        check_len("layer_norm_backward", "dbias", db.len(), c)?;
        db.copy_from_slice(&sums[c..]);
    }
    Ok(())
}

/// RMSNorm: `out = x / √(mean(x²) + eps) · weight`. x/out `[N, c]`, weight `[c]`.
pub fn rmsnorm_forward<T: Float>(
    x: &[T],
    weight: &[T],
    out: &mut [T],
    c: usize,
    eps: f64,
) -> Result<(), EngineError> {
    check_len("rms_norm", "weight", weight.len(), c)?;
    check_len("rms_norm", "out", out.len(), x.len())?;
    let eps = T::from_f64(eps);
    let cf = T::from_f64(c as f64);
    out.par_chunks_mut(c)
        .with_min_len(super::min_rows(c))
        .zip(x.par_chunks(c))
        .for_each(|(o, xr)| {
            let ms = xr.iter().fold(T::zero(), |a, &v| a + v * v) / cf;
            let r = T::one() / (ms + eps).sqrt();
            for j in 0..c {
                o[j] = xr[j] * r * weight[j];
            }
        });
    Ok(())
}

/// Gradients of [`rmsnorm_forward`]. With `r = 1/√(mean(x²) + eps)` and `g = dout ⊙ weight`:
/// `dx = r·g − r³ · x · mean(g ⊙ x)`, `dweight = Σ_n dout ⊙ x · r` (overwritten).
///
/// dout/x/dx `[N, c]`, weight/dweight `[c]`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward<T: Float>(
    dout: &[T],
    x: &[T],
    weight: &[T],
    dx: &mut [T],
    dweight: &mut [T],
    c: usize,
    eps: f64,
) -> Result<(), EngineError> {
    check_len("rms_norm_backward", "weight", weight.len(), c)?;
    check_len("rms_norm_backward", "dweight", dweight.len(), c)?;
    check_len("rms_norm_backward", "dout", dout.len(), x.len())?;
    check_len("rms_norm_backward", "dx", dx.len(), x.len())?;
    let eps = T::from_f64(eps);
    let cf = T::from_f64(c as f64);
    let rinv =
        |xr: &[T]| T::one() / (xr.iter().fold(T::zero(), |a, &v| a + v * v) / cf + eps).sqrt();
    dx.par_chunks_mut(c)
        .with_min_len(super::min_rows(c))
        .zip(x.par_chunks(c).zip(dout.par_chunks(c)))
        .for_each(|(dxr, (xr, dr))| {
            let r = rinv(xr);
            let sgx = (0..c).fold(T::zero(), |a, j| a + dr[j] * weight[j] * xr[j]) / cf;
            for j in 0..c {
                dxr[j] = r * dr[j] * weight[j] - r * r * r * xr[j] * sgx;
            }
        });
    let sums = block_sums(x.len() / c.max(1), c, |n, acc: &mut [T]| {
        let xr = &x[n * c..(n + 1) * c];
        let dr = &dout[n * c..(n + 1) * c];
        let r = rinv(xr);
        for j in 0..c {
            acc[j] += dr[j] * xr[j] * r;
        }
    });
    dweight.copy_from_slice(&sums);
    Ok(())
}
