//! KL-Shampoo (Lin et al. 2025, "Understanding and Improving Shampoo and SOAP via
//! Kullback-Leibler Minimization", arXiv 2509.03378) for one 2-D parameter `[m, n]`: the
//! reference `KLOpt` of `yorkerlin/KL-Methods` with `using_klsoap = False`, as specified in
//! `docs/kl-shampoo.md` (state, the order of every operation, defaults).
//!
//! Per step, with the bases `Q_L` `[m, m]`, `Q_R` `[n, n]` and the eigenvalue estimates
//! `D_L` `[m]`, `D_R` `[n]` of the previous step:
//!
//! ```text
//! M   ← β₁·M + (1 − β₁)·G                                   (momentum, unrotated)
//! U   = Q_L [ (Q_Lᵀ M Q_R) ⊘ (√(D_L D_Rᵀ) + ε) ] Q_Rᵀ
//! S_L ← β·S_L + (1 − β)/n · G Q_R diag(1/D_R) Q_Rᵀ Gᵀ       (the factors estimated jointly)
//! S_R ← β·S_R + (1 − β)/m · Gᵀ Q_L diag(1/D_L) Q_Lᵀ G
//! D_L ← max(β·D_L + (1 − β)·rowmean((Q_Lᵀ G Q_R)² ⊘ D_Rᵀ), 1/c_L²)   c = max(10, min(dim, 4000))
//! D_R ← max(β·D_R + (1 − β)·colmean((Q_Lᵀ G Q_R)² ⊘ D_L), 1/c_R²)
//! every `precondition_frequency` steps: Q ← qr(S·Q).Q      (warm-started, no sorting)
//! W   ← (W − lr·U)·(1 − lr·wd)
//! ```
//!
//! The first call only initialises: `S_L = (1 − β)/n·GGᵀ`, `S_R = (1 − β)/m·GᵀG`, `Q` = their
//! eigenvectors in descending eigenvalue order, `D = init_factor`; the parameter is unchanged.
//! There is no grafting, no Adam state, no bias correction. The reference computes in bf16 with
//! f32 decompositions; here everything is in `T` (f32 in training, f64 in tests).
//!
//! The engine runs it as the plan runs SOAP: [`kl_shampoo_update`] every step (plan op
//! `KlShampooUpdate`: the first step's initialisation, then the update, the factors and the
//! eigenvalue estimates), and the factors' bases through the refresh runtime (host task
//! `EigenbasisRefresh` with method `qr`: [`crate::refresh_compute_method`] is the first
//! eigendecomposition at the end of step 1, then `qr(S·Q)` without sorting, and
//! [`crate::refresh_apply`] installs the basis and nothing else). A side longer than the
//! plan's `max_precond_dim` has no factor and no basis: its basis is the identity and only its
//! eigenvalue estimate `D` is kept (a diagonal preconditioner on that side).
//! [`kl_shampoo_step`] composes both for one parameter (the reference's `step`).
use crate::linalg::{gemm, view, view_mut};
use crate::{check_len, HostEigensolver, Real, ShapeError};
use schedule::RefreshMethod;

/// KL-Shampoo hyperparameters except the (scheduled) learning rate; defaults are the
/// reference's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KlShampooParams {
    /// β₁ of the momentum (default 0.9).
    pub beta1: f64,
    /// β of the factor and eigenvalue EMAs (default 0.98, the reference's `betas[1]`).
    pub shampoo_beta: f64,
    /// ε of the denominator (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay, applied after the step (default 0.01).
    pub weight_decay: f64,
    /// Steps between basis refreshes (default 10).
    pub precondition_frequency: u64,
    /// Initial eigenvalue estimate (default 0.1).
    pub init_factor: f64,
    /// Clamp bound: `D ≥ 1/c²`, `c = max(10, min(dim, max_clamp_value))` (default 4000).
    pub max_clamp_value: f64,
    /// Divide the update by `1e-30 + RMS(update)` (default false).
    pub normalize_grads: bool,
}

impl Default for KlShampooParams {
    fn default() -> Self {
        KlShampooParams {
            beta1: 0.9,
            shampoo_beta: 0.98,
            eps: 1e-8,
            weight_decay: 0.01,
            precondition_frequency: 10,
            init_factor: 0.1,
            max_clamp_value: 4000.0,
            normalize_grads: false,
        }
    }
}

/// The state of one parameter `[m, n]`, row-major.
#[derive(Clone, Debug)]
pub struct KlShampooState<T> {
    /// Rows.
    pub m: usize,
    /// Columns.
    pub n: usize,
    /// Steps taken (0 until the first step after initialisation).
    pub step: u64,
    /// Whether the first call (initialisation) happened.
    pub initialized: bool,
    /// Momentum `M` `[m, n]`.
    pub exp_avg: Vec<T>,
    /// `S_L` `[m, m]`.
    pub factor_left: Vec<T>,
    /// `S_R` `[n, n]`.
    pub factor_right: Vec<T>,
    /// `Q_L` `[m, m]` (columns are the basis).
    pub basis_left: Vec<T>,
    /// `Q_R` `[n, n]`.
    pub basis_right: Vec<T>,
    /// `D_L` `[m]`.
    pub eig_left: Vec<T>,
    /// `D_R` `[n]`.
    pub eig_right: Vec<T>,
}

impl<T: Real> KlShampooState<T> {
    /// Zero state of a `[m, n]` parameter (not initialised).
    pub fn new(m: usize, n: usize) -> Self {
        let z = |k: usize| vec![T::zero(); k];
        KlShampooState {
            m,
            n,
            step: 0,
            initialized: false,
            exp_avg: z(m * n),
            factor_left: z(m * m),
            factor_right: z(n * n),
            basis_left: z(m * m),
            basis_right: z(n * n),
            eig_left: z(m),
            eig_right: z(n),
        }
    }
}

fn mm<T: Real>(a: &[T], ta: bool, b: &[T], tb: bool, m: usize, k: usize, n: usize) -> Vec<T> {
    let mut out = vec![T::zero(); m * n];
    let av = if ta {
        view(a, k, m).transpose()
    } else {
        view(a, m, k)
    };
    let bv = if tb {
        view(b, n, k).transpose()
    } else {
        view(b, k, n)
    };
    gemm(view_mut(&mut out, m, n), None, av, bv, T::one());
    out
}

/// One side (rows = left, columns = right) of a KL-Shampoo parameter in the plan: the
/// Kronecker factor `S` and its basis `Q` (`[d, d]`, absent for a side over
/// `max_precond_dim`: identity basis, no factor) and the eigenvalue estimate `D` `[d]`.
#[derive(Debug)]
pub struct KlSide<'a, T> {
    /// `S` `[d, d]`, updated in place; `None` for an unpreconditioned side.
    pub factor: Option<&'a mut [T]>,
    /// `Q` `[d, d]` (columns are the basis), read only; `None` = identity (and then `factor`
    /// must be `None` too).
    pub basis: Option<&'a [T]>,
    /// `D` `[d]`, updated in place.
    pub eig: &'a mut [T],
}

/// `Qᵀ X` for `X` `[d, k]` (identity when `q` is `None`).
fn qt_x<T: Real>(q: Option<&[T]>, x: &[T], d: usize, k: usize) -> Vec<T> {
    match q {
        Some(q) => mm(q, true, x, false, d, d, k),
        None => x.to_vec(),
    }
}

/// `X Q` for `X` `[k, d]` (identity when `q` is `None`).
fn x_q<T: Real>(x: &[T], q: Option<&[T]>, k: usize, d: usize) -> Vec<T> {
    match q {
        Some(q) => mm(x, false, q, false, k, d, d),
        None => x.to_vec(),
    }
}

/// The clamp floor `1/c²` of an eigenvalue estimate of a side of length `d`,
/// `c = max(10, min(d, max_clamp_value))`.
pub fn kl_eig_floor(d: usize, max_clamp_value: f64) -> f64 {
    let c = (d as f64).min(max_clamp_value).max(10.0);
    1.0 / (c * c)
}

/// Plan op `KlShampooUpdate` for a 2-D parameter `[m, n]` at 1-based engine step `t` with
/// scheduled learning rate `lr` (`hp.precondition_frequency` is not read: refreshes are host
/// tasks).
///
/// - `t == 1` (the reference's first call): `S_L = (1 − β)/n·GGᵀ`, `S_R = (1 − β)/m·GᵀG` for
///   the sides with a factor, `D = init_factor`; the parameter and the momentum are unchanged.
///   (The first eigendecomposition of the factors runs at the end of the step, as a refresh.)
/// - `t > 1`: momentum, the update `U = Q_L[(Q_Lᵀ M Q_R) ⊘ (√(D_L D_Rᵀ) + ε)]Q_Rᵀ`, the factors
///   `S_L ← β S_L + (1 − β)/n · G Q_R D_R⁻¹ Q_Rᵀ Gᵀ` (and twin), the eigenvalue estimates
///   `D_L ← max(β D_L + (1 − β)·rowmean((Q_Lᵀ G Q_R)² ⊘ D_Rᵀ), 1/c_L²)` (and twin), all from
///   the bases and estimates the step started with; optional RMS normalisation of `U`; then
///   `W ← (W − lr·U)(1 − lr·wd)`.
///
/// Row-major slices of `T`: `param`, `grad`, `exp_avg` `[m, n]`; `left` has `d = m`, `right`
/// `d = n`.
///
/// # Errors
/// [`ShapeError`] when an operand's length does not match `[m, n]` (nothing was modified).
#[allow(clippy::too_many_arguments)]
pub fn kl_shampoo_update<T: Real>(
    t: u64,
    hp: &KlShampooParams,
    lr: f64,
    param: &mut [T],
    grad: &[T],
    exp_avg: &mut [T],
    left: KlSide<'_, T>,
    right: KlSide<'_, T>,
    m: usize,
    n: usize,
) -> Result<(), ShapeError> {
    const OP: &str = "kl_shampoo_update";
    check_len(OP, "param", param.len(), m * n)?;
    check_len(OP, "grad", grad.len(), m * n)?;
    check_len(OP, "exp_avg", exp_avg.len(), m * n)?;
    for (side, d, name_f, name_q, name_d) in [
        (&left, m, "factor_left", "basis_left", "eig_left"),
        (&right, n, "factor_right", "basis_right", "eig_right"),
    ] {
        if let Some(f) = &side.factor {
            check_len(OP, name_f, f.len(), d * d)?;
        }
        if let Some(q) = side.basis {
            check_len(OP, name_q, q.len(), d * d)?;
        }
        check_len(OP, name_d, side.eig.len(), d)?;
    }
    if t <= 1 {
        return kl_factor_update(t, hp, grad, (left, right), m, n);
    }
    let (ql, qr) = (left.basis, right.basis);
    let b1 = T::of(hp.beta1);
    let w1 = T::of(1.0 - hp.beta1);
    for (x, &g) in exp_avg.iter_mut().zip(grad) {
        *x = b1 * *x + w1 * g;
    }
    // U = Q_L [(Q_Lᵀ M Q_R) ⊘ (√(D_L D_Rᵀ) + ε)] Q_Rᵀ.
    let mt = x_q(&qt_x(ql, exp_avg, m, n), qr, m, n);
    let mt = kl_scale(t, hp.eps, &mt, (&*left.eig, &*right.eig), m, n)?;
    // Q_L X Q_Rᵀ = ((X Q_Rᵀ)ᵀ... written as two products with the transposes explicit.
    let mut u = match ql {
        Some(q) => mm(q, false, &mt, false, m, m, n),
        None => mt,
    };
    if let Some(q) = qr {
        u = mm(&u, false, q, true, m, n, n);
    }
    kl_factor_update(t, hp, grad, (left, right), m, n)?;
    if hp.normalize_grads {
        let ms = u.iter().fold(T::zero(), |a, &x| a + x * x) / T::of((m * n) as f64);
        let d = T::of(1e-30) + ms.sqrt();
        u.iter_mut().for_each(|x| *x /= d);
    }
    let (lr_t, decay) = (T::of(lr), T::of(1.0 - lr * hp.weight_decay));
    for (p, &x) in param.iter_mut().zip(&u) {
        *p = (*p - lr_t * x) * decay;
    }
    Ok(())
}

/// Plan op `KlFactorUpdate` (KL-Shampoo's matrix work, after the step of
/// `crate::optimizers::kl_shampoo`): for a 2-D gradient `grad` `[m, n]` and the two sides'
/// factors, bases and eigenvalue estimates ([`KlSide`]),
///
/// - `t ≤ 1` (the reference's first call): `S_L = (1 − β)/n·GGᵀ`, `S_R = (1 − β)/m·GᵀG` for
///   the sides with a factor, `D = init_factor`;
/// - `t > 1`: `S_L ← β S_L + (1 − β)/n · G Q_R D_R⁻¹ Q_Rᵀ Gᵀ` (and twin) and
///   `D_L ← max(β D_L + (1 − β)·rowmean((Q_Lᵀ G Q_R)² ⊘ D_Rᵀ), 1/c_L²)` (and twin), all from
///   the bases and estimates the call started with;
///
/// exactly as [`kl_shampoo_update`] computes them (which calls this).
///
/// # Errors
/// [`ShapeError`] when an operand's length does not match (nothing was modified).
pub fn kl_factor_update<T: Real>(
    t: u64,
    hp: &KlShampooParams,
    grad: &[T],
    (left, right): (KlSide<'_, T>, KlSide<'_, T>),
    m: usize,
    n: usize,
) -> Result<(), ShapeError> {
    const OP: &str = "kl_factor_update";
    check_len(OP, "grad", grad.len(), m * n)?;
    for (side, d, name_f, name_q, name_d) in [
        (&left, m, "factor_left", "basis_left", "eig_left"),
        (&right, n, "factor_right", "basis_right", "eig_right"),
    ] {
        if let Some(f) = &side.factor {
            check_len(OP, name_f, f.len(), d * d)?;
        }
        if let Some(q) = side.basis {
            check_len(OP, name_q, q.len(), d * d)?;
        }
        check_len(OP, name_d, side.eig.len(), d)?;
    }
    let KlSide {
        factor: fl,
        basis: ql,
        eig: el,
    } = left;
    let KlSide {
        factor: fr,
        basis: qr,
        eig: er,
    } = right;
    let b = T::of(hp.shampoo_beta);
    let w = T::of(1.0 - hp.shampoo_beta);
    let (mf, nf) = (T::of(m as f64), T::of(n as f64));
    if t <= 1 {
        if let Some(fl) = fl {
            let ggt = mm(grad, false, grad, true, m, n, m);
            for (s, x) in fl.iter_mut().zip(ggt) {
                *s = w / nf * x;
            }
        }
        if let Some(fr) = fr {
            let gtg = mm(grad, true, grad, false, n, m, n);
            for (s, x) in fr.iter_mut().zip(gtg) {
                *s = w / mf * x;
            }
        }
        el.fill(T::of(hp.init_factor));
        er.fill(T::of(hp.init_factor));
        return Ok(());
    }
    let inv_sqrt = |d: &[T]| -> Vec<T> { d.iter().map(|&x| T::one() / x.sqrt()).collect() };
    let (dl, dr) = (el.to_vec(), er.to_vec());
    let (sl, sr) = (inv_sqrt(&dl), inv_sqrt(&dr));
    // Factors, from the old bases and estimates: X_R = G Q_R diag(s_R), S_L += X_R X_Rᵀ.
    if let Some(fl) = fl {
        let mut xr = x_q(grad, qr, m, n);
        for row in xr.chunks_exact_mut(n.max(1)) {
            for (x, s) in row.iter_mut().zip(&sr) {
                *x *= *s;
            }
        }
        let add = mm(&xr, false, &xr, true, m, n, m);
        for (s, a) in fl.iter_mut().zip(&add) {
            *s = b * *s + w / nf * *a;
        }
    }
    if let Some(fr) = fr {
        // X_L = Gᵀ Q_L diag(s_L) [n, m], S_R += X_L X_Lᵀ.
        let mut xl = match ql {
            Some(q) => mm(grad, true, q, false, n, m, m),
            None => mm_transpose(grad, m, n),
        };
        for row in xl.chunks_exact_mut(m.max(1)) {
            for (x, s) in row.iter_mut().zip(&sl) {
                *x *= *s;
            }
        }
        let add = mm(&xl, false, &xl, true, n, m, n);
        for (s, a) in fr.iter_mut().zip(&add) {
            *s = b * *s + w / mf * *a;
        }
    }
    // Eigenvalue estimates, from the old bases and estimates.
    let gt = x_q(&qt_x(ql, grad, m, n), qr, m, n);
    let (fl_, fr_) = (
        T::of(kl_eig_floor(m, hp.max_clamp_value)),
        T::of(kl_eig_floor(n, hp.max_clamp_value)),
    );
    for i in 0..m {
        let mut acc = T::zero();
        for j in 0..n {
            acc += gt[i * n + j] * gt[i * n + j] / dr[j];
        }
        el[i] = (b * dl[i] + w * (acc / nf)).max(fl_);
    }
    for j in 0..n {
        let mut acc = T::zero();
        for i in 0..m {
            acc += gt[i * n + j] * gt[i * n + j] / dl[i];
        }
        er[j] = (b * dr[j] + w * (acc / mf)).max(fr_);
    }
    Ok(())
}

/// Plan op `KlScale` (KL-Shampoo's preconditioner in the eigenbasis): `x ⊘ (√(D_L D_Rᵀ) + ε)`
/// for `x` `[m, n]` (the momentum rotated into the bases), computed as `x·(r / (1 + r·ε))`
/// with `r = (1/√D_L[i])·(1/√D_R[j])` in `T`, as [`kl_shampoo_update`] does. At `t ≤ 1` (the
/// initialising step, whose update is skipped and whose estimates are not set yet) the result
/// is zero.
///
/// # Errors
/// [`ShapeError`] when an operand's length does not match.
pub fn kl_scale<T: Real>(
    t: u64,
    eps: f64,
    x: &[T],
    (eig_left, eig_right): (&[T], &[T]),
    m: usize,
    n: usize,
) -> Result<Vec<T>, ShapeError> {
    const OP: &str = "kl_scale";
    check_len(OP, "x", x.len(), m * n)?;
    check_len(OP, "eig_left", eig_left.len(), m)?;
    check_len(OP, "eig_right", eig_right.len(), n)?;
    if t <= 1 {
        return Ok(vec![T::zero(); m * n]);
    }
    let inv_sqrt = |d: &[T]| -> Vec<T> { d.iter().map(|&x| T::one() / x.sqrt()).collect() };
    let (sl, sr) = (inv_sqrt(eig_left), inv_sqrt(eig_right));
    let eps = T::of(eps);
    let mut out = x.to_vec();
    for i in 0..m {
        for j in 0..n {
            let r = sl[i] * sr[j];
            out[i * n + j] *= r / (T::one() + r * eps);
        }
    }
    Ok(out)
}

/// `Xᵀ` of a row-major `[r, c]` matrix, as `[c, r]`.
fn mm_transpose<T: Real>(x: &[T], r: usize, c: usize) -> Vec<T> {
    let mut o = vec![T::zero(); r * c];
    for i in 0..r {
        for j in 0..c {
            o[j * r + i] = x[i * c + j];
        }
    }
    o
}

/// Why a KL-Shampoo step failed (the parameter did not change).
#[derive(Debug, thiserror::Error)]
pub enum KlShampooError {
    /// Operand lengths.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// A basis refresh (the first eigendecomposition or a QR).
    #[error(transparent)]
    Refresh(#[from] crate::RefreshError),
}

/// One `KLOpt.step` for a 2-D parameter at the scheduled learning rate `lr`, composed from what
/// the engine runs: [`kl_shampoo_update`] at engine step `st.step + 1`, then each side's basis
/// refresh ([`crate::refresh_compute_method`] with [`RefreshMethod::Qr`] and
/// `hp.precondition_frequency`, installed by [`crate::refresh_apply`]), synchronously. The
/// first call initialises the state and returns `false` (the parameter is unchanged); later
/// calls update `param` in place and return `true`.
///
/// # Errors
/// [`KlShampooError::Shape`] for operands that do not match the state's `[m, n]`;
/// [`KlShampooError::Refresh`] when a refresh fails (the update of that call has happened; the
/// basis of that side is unchanged).
pub fn kl_shampoo_step<T: Real>(
    st: &mut KlShampooState<T>,
    hp: &KlShampooParams,
    lr: f64,
    param: &mut [T],
    grad: &[T],
    solver: &dyn HostEigensolver,
) -> Result<bool, KlShampooError> {
    let (m, n) = (st.m, st.n);
    let t = if st.initialized { st.step + 2 } else { 1 };
    kl_shampoo_update(
        t,
        hp,
        lr,
        param,
        grad,
        &mut st.exp_avg,
        KlSide {
            factor: Some(&mut st.factor_left),
            basis: Some(&st.basis_left),
            eig: &mut st.eig_left,
        },
        KlSide {
            factor: Some(&mut st.factor_right),
            basis: Some(&st.basis_right),
            eig: &mut st.eig_right,
        },
        m,
        n,
    )?;
    for side in 0..2u8 {
        let (f, q) = if side == 0 {
            (&st.factor_left, &mut st.basis_left)
        } else {
            (&st.factor_right, &mut st.basis_right)
        };
        let method = RefreshMethod::Qr;
        let freq = hp.precondition_frequency;
        if let Some(r) = crate::refresh_compute_method(solver, t, freq, method, side, f, q, m, n)? {
            crate::refresh_apply(&r, q, &mut [], &mut [], m, n)?;
        }
    }
    if t == 1 {
        st.initialized = true;
        Ok(false)
    } else {
        st.step += 1;
        Ok(true)
    }
}
