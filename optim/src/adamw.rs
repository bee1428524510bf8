//! AdamW (Loshchilov & Hutter 2019) with PyTorch `torch.optim.AdamW` semantics (single
//! tensor, no amsgrad): decoupled weight decay first, then bias-corrected Adam.
use crate::{check_len, Real, ShapeError};

/// Hyperparameters of one AdamW step. `lr` is the **scheduled** learning rate of this step
/// (plan lr × schedule multiplier).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWParams {
    /// Learning rate of this step.
    pub lr: f64,
    /// β₁ of the first moment.
    pub beta1: f64,
    /// β₂ of the second moment.
    pub beta2: f64,
    /// ε added to the bias-corrected √v.
    pub eps: f64,
    /// Decoupled weight decay coefficient (multiplied by `lr`).
    pub weight_decay: f64,
}

/// One AdamW step at 1-based step `t`, in place on `param`, `exp_avg`, `exp_avg_sq` (all the
/// same length as `grad`, any shape flattened):
///
/// ```text
/// p ← p·(1 − lr·wd)
/// m ← lerp(m, g, 1−β₁);   v ← β₂·v + (1−β₂)·g²
/// p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)
/// ```
/// exactly as `torch.optim.adamw._single_tensor_adamw`.
///
/// # Errors
/// [`ShapeError`] when lengths differ (nothing modified).
pub fn adamw_update<T: Real>(
    t: u64,
    hp: &AdamWParams,
    param: &mut [T],
    grad: &[T],
    exp_avg: &mut [T],
    exp_avg_sq: &mut [T],
) -> Result<(), ShapeError> {
    let n = grad.len();
    check_len("adamw_update", "param", param.len(), n)?;
    check_len("adamw_update", "exp_avg", exp_avg.len(), n)?;
    check_len("adamw_update", "exp_avg_sq", exp_avg_sq.len(), n)?;
    let t = t.max(1) as i32;
    let decay = T::of(1.0 - hp.lr * hp.weight_decay);
    let w1 = T::of(1.0 - hp.beta1);
    let beta2 = T::of(hp.beta2);
    let w2 = T::of(1.0 - hp.beta2);
    let bc1 = 1.0 - hp.beta1.powi(t);
    let bc2_sqrt = T::of((1.0 - hp.beta2.powi(t)).sqrt());
    let step_size = T::of(hp.lr / bc1);
    let eps = T::of(hp.eps);
    let half = T::of(0.5);
    for i in 0..n {
        let g = grad[i];
        let mut p = param[i];
        if hp.weight_decay != 0.0 {
            p *= decay;
        }
        // torch.lerp: weight < 0.5 → start + w·(end − start), else end − (end − start)·(1 − w).
        let m = exp_avg[i];
        let m = if w1 < half {
            m + w1 * (g - m)
        } else {
            g - (g - m) * (T::one() - w1)
        };
        let v = exp_avg_sq[i] * beta2 + w2 * g * g;
        let denom = v.sqrt() / bc2_sqrt + eps;
        p -= step_size * (m / denom);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = p;
    }
    Ok(())
}
