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
use crate::linalg::{gemm, view, view_mut};
use crate::{check_len, EigenError, HostEigensolver, Real, ShapeError};

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

/// Why a KL-Shampoo step failed (nothing of the parameter changed).
#[derive(Debug, thiserror::Error)]
pub enum KlShampooError {
    /// Operand lengths.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// The initial eigendecomposition.
    #[error(transparent)]
    Eigen(#[from] EigenError),
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

/// Eigenvectors of the symmetric `[d, d]` `a`, columns in descending eigenvalue order.
fn eigvecs_desc<T: Real>(
    a: &[T],
    d: usize,
    solver: &dyn HostEigensolver,
) -> Result<Vec<T>, EigenError> {
    let e = T::eigh_with(solver, a, d)?;
    let mut q = vec![T::zero(); d * d];
    for i in 0..d {
        for j in 0..d {
            q[i * d + j] = e.vectors[i * d + (d - 1 - j)];
        }
    }
    Ok(q)
}

/// One `KLOpt.step` for a 2-D parameter at the scheduled learning rate `lr`: the first call
/// initialises the state and returns `false` (the parameter is unchanged); later calls update
/// `param` in place and return `true`.
///
/// # Errors
/// [`KlShampooError::Shape`] for operands that do not match the state's `[m, n]`;
/// [`KlShampooError::Eigen`] when the first call's eigendecomposition fails (the state stays
/// uninitialised).
pub fn kl_shampoo_step<T: Real>(
    st: &mut KlShampooState<T>,
    hp: &KlShampooParams,
    lr: f64,
    param: &mut [T],
    grad: &[T],
    solver: &dyn HostEigensolver,
) -> Result<bool, KlShampooError> {
    let (m, n) = (st.m, st.n);
    check_len("kl_shampoo_step", "param", param.len(), m * n)?;
    check_len("kl_shampoo_step", "grad", grad.len(), m * n)?;
    let b = T::of(hp.shampoo_beta);
    let w = T::of(1.0 - hp.shampoo_beta);
    let (mf, nf) = (T::of(m as f64), T::of(n as f64));
    if !st.initialized {
        let ggt = mm(grad, false, grad, true, m, n, m);
        let gtg = mm(grad, true, grad, false, n, m, n);
        st.factor_left = ggt.iter().map(|&x| w / nf * x).collect();
        st.factor_right = gtg.iter().map(|&x| w / mf * x).collect();
        st.basis_left = eigvecs_desc(&st.factor_left, m, solver)?;
        st.basis_right = eigvecs_desc(&st.factor_right, n, solver)?;
        st.eig_left = vec![T::of(hp.init_factor); m];
        st.eig_right = vec![T::of(hp.init_factor); n];
        st.initialized = true;
        return Ok(false);
    }
    st.step += 1;
    let b1 = T::of(hp.beta1);
    let w1 = T::of(1.0 - hp.beta1);
    for (x, &g) in st.exp_avg.iter_mut().zip(grad) {
        *x = b1 * *x + w1 * g;
    }
    let (ql, qr) = (&st.basis_left, &st.basis_right);
    let (dl, dr) = (st.eig_left.clone(), st.eig_right.clone());
    let inv_sqrt = |d: &[T]| -> Vec<T> { d.iter().map(|&x| T::one() / x.sqrt()).collect() };
    let (sl, sr) = (inv_sqrt(&dl), inv_sqrt(&dr));
    // U = Q_L [(Q_Lᵀ M Q_R) ⊘ (√(D_L D_Rᵀ) + ε)] Q_Rᵀ, with r = s_L s_R: r / (1 + r·ε).
    let eps = T::of(hp.eps);
    let mut mt = mm(
        &mm(ql, true, &st.exp_avg, false, m, m, n),
        false,
        qr,
        false,
        m,
        n,
        n,
    );
    for i in 0..m {
        for j in 0..n {
            let r = sl[i] * sr[j];
            mt[i * n + j] = mt[i * n + j] * (r / (T::one() + r * eps));
        }
    }
    let mut u = mm(
        &mm(ql, false, &mt, false, m, m, n),
        false,
        qr,
        true,
        m,
        n,
        n,
    );
    // Factors, from the old bases and eigenvalues: X_R = G Q_R diag(s_R), S_L += X_R X_Rᵀ.
    let mut xr = mm(grad, false, qr, false, m, n, n);
    for i in 0..m {
        for j in 0..n {
            xr[i * n + j] *= sr[j];
        }
    }
    let mut xl = mm(grad, true, ql, false, n, m, m);
    for i in 0..n {
        for j in 0..m {
            xl[i * m + j] *= sl[j];
        }
    }
    let add_l = mm(&xr, false, &xr, true, m, n, m);
    let add_r = mm(&xl, false, &xl, true, n, m, n);
    for (s, a) in st.factor_left.iter_mut().zip(&add_l) {
        *s = b * *s + w / nf * *a;
    }
    for (s, a) in st.factor_right.iter_mut().zip(&add_r) {
        *s = b * *s + w / mf * *a;
    }
    // Eigenvalue estimates, from the old bases and eigenvalues.
    let gt = mm(
        &mm(ql, true, grad, false, m, m, n),
        false,
        qr,
        false,
        m,
        n,
        n,
    );
    let floor = |d: usize| {
        let c = (d as f64).min(hp.max_clamp_value).max(10.0);
        T::of(1.0 / (c * c))
    };
    let (fl, fr) = (floor(m), floor(n));
    for i in 0..m {
        let mut acc = T::zero();
        for j in 0..n {
            acc += gt[i * n + j] * gt[i * n + j] / dr[j];
        }
        st.eig_left[i] = (b * dl[i] + w * (acc / nf)).max(fl);
    }
    for j in 0..n {
        let mut acc = T::zero();
        for i in 0..m {
            acc += gt[i * n + j] * gt[i * n + j] / dl[i];
        }
        st.eig_right[j] = (b * dr[j] + w * (acc / mf)).max(fr);
    }
    if hp.precondition_frequency > 0 && st.step % hp.precondition_frequency == 0 {
        let zl = mm(&st.factor_left, false, &st.basis_left, false, m, m, m);
        let zr = mm(&st.factor_right, false, &st.basis_right, false, n, n, n);
        st.basis_left = crate::thin_qr_q(&zl, m, m)?;
        st.basis_right = crate::thin_qr_q(&zr, n, n)?;
    }
    if hp.normalize_grads {
        let ms = u.iter().fold(T::zero(), |a, &x| a + x * x) / T::of((m * n) as f64);
        let d = T::of(1e-30) + ms.sqrt();
        u.iter_mut().for_each(|x| *x /= d);
    }
    let (lr_t, decay) = (T::of(lr), T::of(1.0 - lr * hp.weight_decay));
    for (p, &x) in param.iter_mut().zip(&u) {
        *p = (*p - lr_t * x) * decay;
    }
    Ok(true)
}
