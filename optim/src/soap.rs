//! SOAP parameter update and Kronecker-factor accumulation (Vyas et al. 2024, "SOAP:
//! Improving and Stabilizing Shampoo using Adam"; reference `nikhilvyas/SOAP` `soap.py`,
//! `SOAP.step` and `update_preconditioner`).
use crate::linalg::{gemm, view, view_mut};
use crate::{check_len, Real, ShapeError};

/// SOAP hyperparameters of one parameter update, except the learning rate (passed per step,
/// already scheduled). Defaults are `soap.py`'s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoapParams {
    /// β₁ of the first moment (default 0.95).
    pub beta1: f64,
    /// β₂ of the second moment (default 0.95).
    pub beta2: f64,
    /// ε added to √v (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay, multiplied by the scheduled lr (default 0.01).
    pub weight_decay: f64,
    /// Adam bias correction `√(1−β₂ᵏ)/(1−β₁ᵏ)` with k = t − 1 (default true).
    pub correct_bias: bool,
    /// Divide the update by `1e-30 + RMS(update)` (default false).
    pub normalize_grads: bool,
}

impl Default for SoapParams {
    fn default() -> Self {
        Self {
            beta1: 0.95,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            correct_bias: true,
            normalize_grads: false,
        }
    }
}

/// Which sides of a 2-D parameter `[m, n]` get a Kronecker factor and eigenbasis:
/// `[Some(m), Some(n)]` with a side set to `None` when it exceeds `max_precond_dim`
/// (`soap.py` `init_preconditioner`: `if sh > max_precond_dim: GG.append([])`). A `None`
/// side is never rotated. 1-D parameters have no factors at all (`precondition_1d = False`).
pub fn precond_dims(m: usize, n: usize, max_precond_dim: usize) -> [Option<usize>; 2] {
    [
        (m <= max_precond_dim).then_some(m),
        (n <= max_precond_dim).then_some(n),
    ]
}

/// `Q_Lᵀ x Q_R` (`soap.py` `project`), a missing basis being the identity. `x` `[m, n]`,
/// `ql` `[m, m]`, `qr` `[n, n]` row-major (basis vectors as columns); the left side first, as
/// [`soap_update`] does (plan op `Project`). Panics on slices shorter than their shapes: the
/// callers check lengths ([`soap_update`], the engines' plan verifier).
pub fn project<T: Real>(x: &[T], ql: Option<&[T]>, qr: Option<&[T]>, m: usize, n: usize) -> Vec<T> {
    let mut cur = x.to_vec();
    if let Some(ql) = ql {
        let mut out = vec![T::zero(); m * n];
        gemm(
            view_mut(&mut out, m, n),
            None,
            view(ql, m, m).transpose(),
            view(&cur, m, n),
            T::one(),
        );
        cur = out;
    }
    if let Some(qr) = qr {
        let mut out = vec![T::zero(); m * n];
        gemm(
            view_mut(&mut out, m, n),
            None,
            view(&cur, m, n),
            view(qr, n, n),
            T::one(),
        );
        cur = out;
    }
    cur
}

/// `Q_L x Q_Rᵀ` (`soap.py` `project_back`), a missing basis being the identity; shapes and
/// order as [`project`].
pub fn project_back<T: Real>(
    x: &[T],
    ql: Option<&[T]>,
    qr: Option<&[T]>,
    m: usize,
    n: usize,
) -> Vec<T> {
    let mut cur = x.to_vec();
    if let Some(ql) = ql {
        let mut out = vec![T::zero(); m * n];
        gemm(
            view_mut(&mut out, m, n),
            None,
            view(ql, m, m),
            view(&cur, m, n),
            T::one(),
        );
        cur = out;
    }
    if let Some(qr) = qr {
        let mut out = vec![T::zero(); m * n];
        gemm(
            view_mut(&mut out, m, n),
            None,
            view(&cur, m, n),
            view(qr, n, n).transpose(),
            T::one(),
        );
        cur = out;
    }
    cur
}

/// One SOAP parameter update at 1-based engine step `t` with the scheduled learning rate
/// `lr`, in place (plan op `SoapUpdate`; `soap.py` `SOAP.step` body).
///
/// Shapes (row-major, all `T`): `param`, `grad`, `exp_avg`, `exp_avg_sq` `[m, n]`;
/// `basis_left` `[m, m]`, `basis_right` `[n, n]` (columns = basis vectors, `None` = identity).
/// A 1-D parameter is `m = 1` with both bases `None` (`soap.py` with `precondition_1d = False`).
/// `exp_avg`/`exp_avg_sq` live in the eigenbasis.
///
/// At `t ≤ 1` nothing happens (`soap.py` skips the update on the first step so the current
/// gradient never enters the projection). Otherwise, with k = t − 1:
/// ```text
/// G' = Q_Lᵀ G Q_R
/// exp_avg ← β₁·exp_avg + (1−β₁)·G';   exp_avg_sq ← β₂·exp_avg_sq + (1−β₂)·G'²
/// N = Q_L (exp_avg / (√exp_avg_sq + ε)) Q_Rᵀ;   if normalize_grads: N ← N / (1e-30 + RMS(N))
/// W ← W − lr·√(1−β₂ᵏ)/(1−β₁ᵏ)·N          (plain lr when !correct_bias)
/// W ← W − lr·wd·W                         (if wd > 0)
/// ```
///
/// # Errors
/// [`ShapeError`] when a slice length does not match `m`, `n` (nothing modified).
#[allow(clippy::too_many_arguments)]
pub fn soap_update<T: Real>(
    t: u64,
    lr: f64,
    hp: &SoapParams,
    param: &mut [T],
    grad: &[T],
    exp_avg: &mut [T],
    exp_avg_sq: &mut [T],
    basis_left: Option<&[T]>,
    basis_right: Option<&[T]>,
    m: usize,
    n: usize,
) -> Result<(), ShapeError> {
    const OP: &str = "soap_update";
    let mn = m * n;
    check_len(OP, "param", param.len(), mn)?;
    check_len(OP, "grad", grad.len(), mn)?;
    check_len(OP, "exp_avg", exp_avg.len(), mn)?;
    check_len(OP, "exp_avg_sq", exp_avg_sq.len(), mn)?;
    if let Some(q) = basis_left {
        check_len(OP, "basis_left", q.len(), m * m)?;
    }
    if let Some(q) = basis_right {
        check_len(OP, "basis_right", q.len(), n * n)?;
    }
    if t <= 1 {
        return Ok(());
    }
    let k = i32::try_from(t - 1).unwrap_or(i32::MAX);

    let g_proj = project(grad, basis_left, basis_right, m, n);
    let (b1, w1) = (T::of(hp.beta1), T::of(1.0 - hp.beta1));
    let (b2, w2) = (T::of(hp.beta2), T::of(1.0 - hp.beta2));
    let eps = T::of(hp.eps);
    let mut pre = vec![T::zero(); mn];
    for i in 0..mn {
        let g = g_proj[i];
        let ea = exp_avg[i] * b1 + g * w1;
        let eas = exp_avg_sq[i] * b2 + g * g * w2;
        exp_avg[i] = ea;
        exp_avg_sq[i] = eas;
        pre[i] = ea / (eas.sqrt() + eps);
    }
    let mut update = project_back(&pre, basis_left, basis_right, m, n);

    let mut step_size = lr;
    if hp.correct_bias {
        let bc1 = 1.0 - hp.beta1.powi(k);
        let bc2 = 1.0 - hp.beta2.powi(k);
        step_size = step_size * bc2.sqrt() / bc1;
    }
    if hp.normalize_grads && mn > 0 {
        let mean_sq = update.iter().map(|x| x.f64() * x.f64()).sum::<f64>() / mn as f64;
        let scale = T::of(1e-30) + T::of(mean_sq.sqrt());
        for x in &mut update {
            *x /= scale;
        }
    }
    let neg_step = T::of(-step_size);
    for (p, u) in param.iter_mut().zip(&update) {
        *p += neg_step * *u;
    }
    if hp.weight_decay > 0.0 {
        let neg_decay = T::of(-lr * hp.weight_decay);
        for p in param.iter_mut() {
            *p = *p + neg_decay * *p;
        }
    }
    Ok(())
}

/// Kronecker-factor accumulation after the parameter update, every step including t = 1
/// (plan op `SoapFactorUpdate`; `soap.py` `update_preconditioner`):
/// `L ← β_s·L + (1−β_s)·G Gᵀ` (`[m, m]`), `R ← β_s·R + (1−β_s)·Gᵀ G` (`[n, n]`), i.e.
/// `lerp(·, ·, 1−β_s)`. A `None` factor (dimension over `max_precond_dim`) is skipped.
/// `grad` is row-major `[m, n]`; factors are symmetric row-major.
///
/// # Errors
/// [`ShapeError`] when a slice length does not match `m`, `n` (nothing modified).
pub fn soap_factor_update<T: Real>(
    grad: &[T],
    factor_left: Option<&mut [T]>,
    factor_right: Option<&mut [T]>,
    m: usize,
    n: usize,
    shampoo_beta: f64,
) -> Result<(), ShapeError> {
    const OP: &str = "soap_factor_update";
    check_len(OP, "grad", grad.len(), m * n)?;
    if let Some(f) = &factor_left {
        check_len(OP, "factor_left", f.len(), m * m)?;
    }
    if let Some(f) = &factor_right {
        check_len(OP, "factor_right", f.len(), n * n)?;
    }
    let beta = T::of(shampoo_beta);
    let w = T::of(1.0 - shampoo_beta);
    let g = view(grad, m, n);
    if let Some(l) = factor_left {
        gemm(view_mut(l, m, m), Some(beta), g, g.transpose(), w);
    }
    if let Some(r) = factor_right {
        gemm(view_mut(r, n, n), Some(beta), g.transpose(), g, w);
    }
    Ok(())
}
