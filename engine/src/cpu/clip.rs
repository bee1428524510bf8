//! Global gradient-norm clipping (PyTorch `torch.nn.utils.clip_grad_norm_`).
use super::Float;
use rayon::prelude::*;

/// Sum of squares of one slice, accumulated in f64 over fixed chunks (deterministic).
pub fn sum_sq<T: Float>(g: &[T]) -> f64 {
    let parts: Vec<f64> = g
        .par_chunks(1 << 15)
        .map(|c| c.iter().fold(0.0f64, |a, &v| a + v.to_f64() * v.to_f64()))
        .collect();
    parts.iter().sum()
}

/// Global L2 norm `√(Σ_g Σ_i g_i²)` over all gradients, accumulated in f64. NaN or ∞ in any
/// gradient gives a non-finite norm.
pub fn global_norm<T: Float>(grads: &[&[T]]) -> f64 {
    grads.iter().map(|g| sum_sq(g)).sum::<f64>().sqrt()
}

/// The factor [`clip_to`] scales by: `max_norm / norm` when `norm > max_norm` and `norm` is
/// finite, else 1.
pub fn clip_factor(norm: f64, max_norm: f64) -> f64 {
    if norm.is_finite() && norm > max_norm {
        max_norm / norm
    } else {
        1.0
    }
}

/// `g · f` elementwise, the values [`clip_to`] stores in place for the factor `f` (as `T`).
pub fn scaled<T: Float>(g: &[T], f: T) -> Vec<T> {
    if f == T::one() {
        return g.to_vec();
    }
    g.par_iter().with_min_len(1 << 14).map(|&v| v * f).collect()
}

/// Scales every gradient by `max_norm / norm` when `norm > max_norm` (and `norm` is finite);
/// returns the factor applied (1 when nothing was scaled).
pub fn clip_to<T: Float>(grads: &mut [&mut [T]], norm: f64, max_norm: f64) -> f64 {
    if !(norm.is_finite() && norm > max_norm) {
        return 1.0;
    }
    let factor = max_norm / norm;
    let f = T::from_f64(factor);
    for g in grads.iter_mut() {
        g.par_iter_mut().with_min_len(1 << 14).for_each(|v| *v *= f);
    }
    factor
}
