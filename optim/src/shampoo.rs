//! Shampoo as Distributed Shampoo implements it (facebookresearch/optimizers at `f6066066`;
//! Gupta et al. 2018, Shi et al. 2023), for one parameter of one or two dimensions, as
//! specified in `docs/shampoo.md`: the parameter is blocked (`merge_small_dims`, then
//! `multi_dim_split` with `B = max_preconditioner_dim`), and every block keeps its own
//! Kronecker factors, inverse roots, first moment and grafting state.
//!
//! Per block, at step `t` (1-based), with `G` the block's gradient:
//!
//! ```text
//! F_k ← β₂·F_k + (1 − β₂)·C_k   (β₂ < 1)   or   F_k ← F_k + C_k   (β₂ = 1, the default)
//!        C_1 = G Gᵀ, C_2 = Gᵀ G for a 2-D block; C_1 = g gᵀ for a 1-D block
//! V   ← γ₂·V + (1 − γ₂)·G²                                       (Adam grafting only)
//! on a refresh step: Finv_k = Q diag(λ^(−1/r)) Qᵀ of eigh(F_k / bc₂ + ε·I), λ shifted so that
//!        min λ = ε when it is below; r = 2·order (4 for a matrix, 2 for a vector)
//! M   ← β₁·M + (1 − β₁)·G;   Ḡ = M / (1 − β₁ᵗ)
//! P   = Finv_1 Ḡ Finv_2  (Finv_1 ḡ for a vector); with grafting P ← P·‖Pg‖/(‖P‖ + 1e-16),
//!        Pg = Ḡ / (√(V / (1 − γ₂ᵗ)) + γ_ε)  (before the first refresh: P = Pg)
//! W   ← W − lr·(P + wd·W)                                       (decoupled weight decay)
//! ```
//!
//! Refresh steps: `t % frequency == 0 && t > start`, or `t == start` (`start` defaults to the
//! frequency). Before the first refresh the inverse roots are the identity. Everything is in
//! `T` (the reference keeps factors and roots in f32 with f64 retries).
pub use schedule::blocking::{blocks, merge_small_dims, Block};

use crate::linalg::{gemm, view, view_mut};
use crate::{check_len, EigenError, HostEigensolver, Real, ShapeError};

/// Adam grafting (`AdamPreconditionerConfig`): the block's step takes the Frobenius norm of the
/// Adam step `Ḡ / (√(V̂) + ε)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamGrafting {
    /// β₂ of the grafting second moment (reference default 0.999).
    pub beta2: f64,
    /// ε of the grafting denominator (reference default 1e-10).
    pub epsilon: f64,
}

/// Shampoo hyperparameters except the (scheduled) learning rate; defaults are the reference's
/// (`DistributedShampoo.__init__` at HEAD `f6066066`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShampooParams {
    /// β₁ of the first moment (default 0.9; 0 disables it).
    pub beta1: f64,
    /// β₂ of the factors (default 1.0: a running sum, AdaGrad-style).
    pub beta2: f64,
    /// ε added to the factor before its eigendecomposition (default 1e-12).
    pub epsilon: f64,
    /// Decoupled weight decay (default 0).
    pub weight_decay: f64,
    /// Block size `B` of `merge_small_dims` and `multi_dim_split` (default 1024).
    pub max_preconditioner_dim: usize,
    /// Steps between inverse-root refreshes (default 1).
    pub precondition_frequency: u64,
    /// First refresh step (default: `precondition_frequency`); must be at least the frequency.
    pub start_preconditioning_step: Option<u64>,
    /// Bias correction of the first moment and of the factors when β₂ < 1 (default true).
    pub use_bias_correction: bool,
    /// Grafting (default none).
    pub grafting: Option<AdamGrafting>,
}

impl Default for ShampooParams {
    fn default() -> Self {
        ShampooParams {
            beta1: 0.9,
            beta2: 1.0,
            epsilon: 1e-12,
            weight_decay: 0.0,
            max_preconditioner_dim: 1024,
            precondition_frequency: 1,
            start_preconditioning_step: None,
            use_bias_correction: true,
            grafting: None,
        }
    }
}

/// The state of one block.
#[derive(Clone, Debug)]
pub struct BlockState<T> {
    /// Where the block is.
    pub block: Block,
    /// Factors `F_k` `[d_k, d_k]`, one per side.
    pub factors: Vec<Vec<T>>,
    /// Inverse roots `Finv_k` `[d_k, d_k]` (identity until the first refresh).
    pub roots: Vec<Vec<T>>,
    /// First moment `M` `[rows, cols]` (unused when β₁ = 0).
    pub exp_avg: Vec<T>,
    /// Grafting second moment `V` `[rows, cols]` (unused without grafting).
    pub graft_sq: Vec<T>,
}

/// The Shampoo state of one parameter.
#[derive(Clone, Debug)]
pub struct ShampooState<T> {
    /// The merged shape's matrix view `[rows, cols]`.
    pub view: (usize, usize),
    /// Steps taken.
    pub step: u64,
    /// One entry per block.
    pub blocks: Vec<BlockState<T>>,
}

fn identity<T: Real>(d: usize) -> Vec<T> {
    let mut q = vec![T::zero(); d * d];
    for i in 0..d {
        q[i * d + i] = T::one();
    }
    q
}

impl<T: Real> ShampooState<T> {
    /// Zero state of a parameter of `shape` (one or two dimensions) under block size `b`.
    pub fn new(shape: &[usize], b: usize) -> Self {
        let (view, blocks) = blocks(shape, b);
        let blocks = blocks
            .into_iter()
            .map(|block| {
                let sides = block.sides();
                let n = block.rows * block.cols;
                BlockState {
                    block,
                    factors: sides.iter().map(|&d| vec![T::zero(); d * d]).collect(),
                    roots: sides.iter().map(|&d| identity(d)).collect(),
                    exp_avg: vec![T::zero(); n],
                    graft_sq: vec![T::zero(); n],
                }
            })
            .collect();
        ShampooState {
            view,
            step: 0,
            blocks,
        }
    }
}

/// Why a Shampoo step failed.
#[derive(Debug, thiserror::Error)]
pub enum ShampooError {
    /// Operand lengths.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// A factor is not finite at a refresh (the reference raises).
    #[error("shampoo: block {block} factor {side} is not finite at step {step}")]
    NonFiniteFactor {
        /// Block index.
        block: usize,
        /// Factor index.
        side: usize,
        /// Step.
        step: u64,
    },
    /// The eigendecomposition of a factor failed.
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

/// `Q diag((λ')^(−1/r)) Qᵀ` of `eigh(a/bc + ε·I)`, `λ' = λ − min λ + ε` when `min λ < ε`.
fn inverse_root<T: Real>(
    a: &[T],
    d: usize,
    bc: f64,
    eps: f64,
    root: f64,
    solver: &dyn HostEigensolver,
) -> Result<Vec<T>, EigenError> {
    let mut x: Vec<T> = a.iter().map(|&v| T::of(v.f64() / bc)).collect();
    for i in 0..d {
        x[i * d + i] += T::of(eps);
    }
    let e = T::eigh_with(solver, &x, d)?;
    let min = e.values.iter().fold(f64::INFINITY, |m, v| m.min(v.f64()));
    let shift = if min < eps { eps - min } else { 0.0 };
    let w: Vec<f64> = e
        .values
        .iter()
        .map(|v| (v.f64() + shift).powf(-1.0 / root))
        .collect();
    // Q diag(w) Qᵀ.
    let mut qw = e.vectors.clone();
    for row in qw.chunks_exact_mut(d) {
        for (x, wj) in row.iter_mut().zip(&w) {
            *x = T::of(x.f64() * wj);
        }
    }
    Ok(mm(&qw, false, &e.vectors, true, d, d, d))
}

/// One `DistributedShampoo.step` for one parameter (`param`, `grad` row-major in the merged
/// view `st.view`) at the scheduled learning rate `lr` (the reference's peak lr for decoupled
/// weight decay is the same `lr`).
///
/// # Errors
/// [`ShampooError::Shape`] for operands that do not match the state; a non-finite factor or
/// a failed eigendecomposition at a refresh (the parameter is then unchanged).
pub fn shampoo_step<T: Real>(
    st: &mut ShampooState<T>,
    hp: &ShampooParams,
    lr: f64,
    param: &mut [T],
    grad: &[T],
    solver: &dyn HostEigensolver,
) -> Result<(), ShampooError> {
    let (vm, vn) = st.view;
    check_len("shampoo_step", "param", param.len(), vm * vn)?;
    check_len("shampoo_step", "grad", grad.len(), vm * vn)?;
    let t = st.step + 1;
    let f = hp.precondition_frequency.max(1);
    let start = hp.start_preconditioning_step.unwrap_or(f);
    let refresh = (t % f == 0 && t > start) || t == start;
    let graft_only = t < start && hp.grafting.is_some();
    let ti = t.min(i32::MAX as u64) as i32;
    let bc2 = if hp.use_bias_correction && hp.beta2 < 1.0 {
        1.0 - hp.beta2.powi(ti)
    } else {
        1.0
    };
    let bc1 = if hp.use_bias_correction && hp.beta1 != 0.0 {
        1.0 - hp.beta1.powi(ti)
    } else {
        1.0
    };
    // Every block's new parameter values, written only when all blocks succeeded.
    let mut updates: Vec<Vec<T>> = Vec::with_capacity(st.blocks.len());
    let mut next = st.blocks.clone();
    for (bi, bs) in next.iter_mut().enumerate() {
        let b = bs.block;
        let (rows, cols) = (b.rows, b.cols);
        let mut g = vec![T::zero(); rows * cols];
        let mut w = vec![T::zero(); rows * cols];
        for i in 0..rows {
            let src = (b.r0 + i) * vn + b.c0;
            g[i * cols..(i + 1) * cols].copy_from_slice(&grad[src..src + cols]);
            w[i * cols..(i + 1) * cols].copy_from_slice(&param[src..src + cols]);
        }
        // Factors from the raw gradient.
        let contractions: Vec<Vec<T>> = if b.vector {
            vec![mm(&g, true, &g, false, cols, 1, cols)]
        } else {
            vec![
                mm(&g, false, &g, true, rows, cols, rows),
                mm(&g, true, &g, false, cols, rows, cols),
            ]
        };
        for (fk, ck) in bs.factors.iter_mut().zip(&contractions) {
            for (x, &c) in fk.iter_mut().zip(ck) {
                *x = if hp.beta2 != 1.0 {
                    T::of(hp.beta2) * *x + T::of(1.0 - hp.beta2) * c
                } else {
                    *x + c
                };
            }
        }
        let graft_bc2 = hp.grafting.map(|gr| {
            for (v, &x) in bs.graft_sq.iter_mut().zip(&g) {
                *v = T::of(gr.beta2) * *v + T::of(1.0 - gr.beta2) * x * x;
            }
            1.0 - gr.beta2.powi(ti)
        });
        if refresh {
            let sides = b.sides();
            let root = 2.0 * sides.len() as f64;
            for (k, (fk, d)) in bs.factors.iter().zip(&sides).enumerate() {
                if fk.iter().any(|x| !x.is_finite()) {
                    return Err(ShampooError::NonFiniteFactor {
                        block: bi,
                        side: k,
                        step: t,
                    });
                }
                bs.roots[k] = inverse_root(fk, *d, bc2, hp.epsilon, root, solver)?;
            }
        }
        // First moment and its bias correction.
        let gbar: Vec<T> = if hp.beta1 != 0.0 {
            for (m, &x) in bs.exp_avg.iter_mut().zip(&g) {
                *m = T::of(hp.beta1) * *m + T::of(1.0 - hp.beta1) * x;
            }
            bs.exp_avg.iter().map(|&m| T::of(m.f64() / bc1)).collect()
        } else {
            g.clone()
        };
        let pg: Option<Vec<T>> = hp.grafting.zip(graft_bc2).map(|(gr, gbc)| {
            gbar.iter()
                .zip(&bs.graft_sq)
                .map(|(&x, &v)| T::of(x.f64() / ((v.f64() / gbc).sqrt() + gr.epsilon)))
                .collect()
        });
        let mut p = if graft_only {
            pg.clone().expect("grafting")
        } else if b.vector {
            mm(&bs.roots[0], false, &gbar, false, cols, cols, 1)
        } else {
            let left = mm(&bs.roots[0], false, &gbar, false, rows, rows, cols);
            mm(&left, false, &bs.roots[1], false, rows, cols, cols)
        };
        if let (Some(pg), false) = (&pg, graft_only) {
            let norm = |v: &[T]| v.iter().map(|x| x.f64() * x.f64()).sum::<f64>().sqrt();
            let scale = norm(pg) / (norm(&p) + 1e-16);
            p.iter_mut().for_each(|x| *x = T::of(x.f64() * scale));
        }
        let (lr_t, wd) = (T::of(lr), T::of(hp.weight_decay));
        let new_w: Vec<T> = w
            .iter()
            .zip(&p)
            .map(|(&wv, &pv)| wv - lr_t * (pv + wd * wv))
            .collect();
        updates.push(new_w);
    }
    for (bs, new_w) in next.iter().zip(&updates) {
        let b = bs.block;
        for i in 0..b.rows {
            let dst = (b.r0 + i) * vn + b.c0;
            param[dst..dst + b.cols].copy_from_slice(&new_w[i * b.cols..(i + 1) * b.cols]);
        }
    }
    st.blocks = next;
    st.step = t;
    Ok(())
}

/// The rows `block` covers of a row-major `[.., vn]` matrix, copied out as `[rows, cols]`.
fn cut<T: Copy>(src: &[T], vn: usize, b: &Block) -> Vec<T> {
    let mut out = Vec::with_capacity(b.rows * b.cols);
    for i in 0..b.rows {
        let at = (b.r0 + i) * vn + b.c0;
        out.extend_from_slice(&src[at..at + b.cols]);
    }
    out
}

/// Writes `[rows, cols]` `vals` back into `block` of a row-major `[.., vn]` matrix.
fn paste<T: Copy>(dst: &mut [T], vn: usize, b: &Block, vals: &[T]) {
    for i in 0..b.rows {
        let at = (b.r0 + i) * vn + b.c0;
        dst[at..at + b.cols].copy_from_slice(&vals[i * b.cols..(i + 1) * b.cols]);
    }
}

/// The coefficients `(a, c)` of a factor's accumulation `F ← a·F + c·C` at 1-based step `t`:
/// `(1, 1)` when β₂ ≥ 1 (a running sum); with bias correction the factor is **stored
/// bias-corrected**, `a = β₂·(1 − β₂ᵗ⁻¹)/(1 − β₂ᵗ)`, `c = (1 − β₂)/(1 − β₂ᵗ)`; else `(β₂, 1 − β₂)`.
pub fn factor_coefficients(beta2: f64, use_bias_correction: bool, t: u64) -> (f64, f64) {
    let ti = t.max(1).min(i32::MAX as u64) as i32;
    if beta2 >= 1.0 {
        (1.0, 1.0)
    } else if use_bias_correction {
        let bc = |k: i32| 1.0 - beta2.powi(k);
        (beta2 * bc(ti - 1) / bc(ti), (1.0 - beta2) / bc(ti))
    } else {
        (beta2, 1.0 - beta2)
    }
}

/// Checks `mats` against the sides of `blocks` (`[d, d]` each, in block order).
fn check_sides<T>(
    op: &'static str,
    what: &'static str,
    mats: &[impl AsRef<[T]>],
    blocks: &[Block],
) -> Result<(), ShapeError> {
    let sides: Vec<usize> = blocks.iter().flat_map(|b| b.sides()).collect();
    check_len(op, what, mats.len(), sides.len())?;
    for (f, d) in mats.iter().zip(&sides) {
        check_len(op, what, f.as_ref().len(), d * d)?;
    }
    Ok(())
}

/// Plan op `ShampooFactorUpdate` (the first op of Shampoo's composed step,
/// `crate::optimizers::shampoo`): per block of [`blocks`]`(shape, b)` with `G` the block of
/// `grad` (row-major in the merged view), each side's factor `F ← a·F + c·C` with
/// `(a, c)` = [`factor_coefficients`]`(beta2, use_bias_correction, t)` and `C = G Gᵀ`,
/// `Gᵀ G` (`g gᵀ` for a vector block); `factors` `[d, d]` in block order.
///
/// # Errors
/// [`ShapeError`] when an operand's length does not match (nothing is written then).
pub fn shampoo_factor_update<T: Real>(
    t: u64,
    (beta2, use_bias_correction): (f64, bool),
    (shape, b): (&[usize], usize),
    grad: &[T],
    factors: &mut [&mut [T]],
) -> Result<(), ShapeError> {
    const OP: &str = "shampoo_factor_update";
    let ((vm, vn), blocks) = blocks(shape, b);
    check_len(OP, "grad", grad.len(), vm * vn)?;
    check_sides::<T>(OP, "factor", factors, &blocks)?;
    let (fa, fc) = factor_coefficients(beta2, use_bias_correction, t);
    let (a, c) = (T::of(fa), T::of(fc));
    let mut k = 0;
    for bl in &blocks {
        let (rows, cols) = (bl.rows, bl.cols);
        let g = cut(grad, vn, bl);
        let contractions: Vec<Vec<T>> = if bl.vector {
            vec![mm(&g, true, &g, false, cols, 1, cols)]
        } else {
            vec![
                mm(&g, false, &g, true, rows, cols, rows),
                mm(&g, true, &g, false, cols, rows, cols),
            ]
        };
        for (f, cm) in factors[k..k + contractions.len()]
            .iter_mut()
            .zip(&contractions)
        {
            for (x, &y) in f.iter_mut().zip(cm) {
                *x = a * *x + c * y;
            }
        }
        k += contractions.len();
    }
    Ok(())
}

/// Plan op `ShampooPrecondition`: per block of [`blocks`]`(shape, b)` of `x` (row-major in the
/// merged view), `R_1ᵀ x_b R_2` for a matrix block and `x_b R_1` for a vector block (a row),
/// with `roots` `[d, d]` in block order ([`crate::project`], the left side first). The roots
/// are symmetric, so this is Distributed Shampoo's `R_1 x_b R_2` up to rounding.
///
/// # Errors
/// [`ShapeError`] when an operand's length does not match.
pub fn shampoo_precondition<T: Real>(
    (shape, b): (&[usize], usize),
    x: &[T],
    roots: &[&[T]],
) -> Result<Vec<T>, ShapeError> {
    const OP: &str = "shampoo_precondition";
    let ((vm, vn), blocks) = blocks(shape, b);
    check_len(OP, "x", x.len(), vm * vn)?;
    check_sides::<T>(OP, "root", roots, &blocks)?;
    let mut out = vec![T::zero(); x.len()];
    let mut k = 0;
    for bl in &blocks {
        let xb = cut(x, vn, bl);
        let pb = if bl.vector {
            crate::project(&xb, None, Some(roots[k]), 1, bl.cols)
        } else {
            crate::project(&xb, Some(roots[k]), Some(roots[k + 1]), bl.rows, bl.cols)
        };
        paste(&mut out, vn, bl, &pb);
        k += bl.sides().len();
    }
    Ok(out)
}

/// Plan op `Graft` (Adam grafting, Distributed Shampoo's semantics): per block of
/// [`blocks`]`(shape, b)`, `x_b · ‖graft_b‖ / (‖x_b‖ + 1e-16)` (Frobenius norms and the scale
/// in f64, each element rounded once), and `graft` itself at 1-based step `t = 1` (before any
/// inverse root exists).
///
/// # Errors
/// [`ShapeError`] when an operand's length does not match.
pub fn graft<T: Real>(
    t: u64,
    (shape, b): (&[usize], usize),
    x: &[T],
    graft: &[T],
) -> Result<Vec<T>, ShapeError> {
    const OP: &str = "graft";
    let ((vm, vn), blocks) = blocks(shape, b);
    check_len(OP, "x", x.len(), vm * vn)?;
    check_len(OP, "graft", graft.len(), vm * vn)?;
    if t <= 1 {
        return Ok(graft.to_vec());
    }
    let norm = |v: &[T]| v.iter().map(|x| x.f64() * x.f64()).sum::<f64>().sqrt();
    let mut out = vec![T::zero(); x.len()];
    for bl in &blocks {
        let (xb, gb) = (cut(x, vn, bl), cut(graft, vn, bl));
        let scale = norm(&gb) / (norm(&xb) + 1e-16);
        let ob: Vec<T> = xb.iter().map(|v| T::of(v.f64() * scale)).collect();
        paste(&mut out, vn, bl, &ob);
    }
    Ok(out)
}

/// Plan op `ShampooUpdate` (`schedule::Op::ShampooUpdate`) for one parameter at 1-based engine
/// step `t` with the scheduled learning rate `lr`: `param`, `grad`, `exp_avg` and `graft_sq`
/// (present iff `hp.grafting`) hold the parameter's elements row-major (the merged view's
/// order); `factors` and `roots` are the `[d, d]` Kronecker factors and inverse roots of every
/// side of every block of [`blocks`]`(shape, hp.max_preconditioner_dim)`, in block order.
///
/// It is the composition `crate::optimizers::shampoo` writes, run in one op, with the same
/// operations in the same order (the CPU engine's results are bit-identical either way):
/// - [`shampoo_factor_update`]: the factors accumulate `C_k` (see the module docs), **stored
///   bias-corrected** when β₂ < 1 with bias correction (see [`factor_coefficients`]), so a
///   refresh computes its root from the factor alone ([`shampoo_inverse_root`]);
/// - element-wise (each operation in `T`): `M ← β₁·M + (1 − β₁)·G`, `Ḡ = M / (1 − β₁ᵗ)`
///   (`M` without bias correction, `G` when β₁ = 0); with grafting `V ← γ₂·V + ((1 − γ₂)·G)·G`
///   and `Pg = Ḡ / (√(V / (1 − γ₂ᵗ)) + γ_ε)`;
/// - [`shampoo_precondition`]: `P = root_1ᵀ Ḡ root_2` per block with the roots as they are
///   (identity before the first refresh);
/// - with grafting [`graft`]: `P ← P·‖Pg‖/(‖P‖ + 1e-16)` per block, and `P = Pg` at `t = 1`;
/// - `W ← W − lr·(P + wd·W)`.
///
/// The differences to [`shampoo_step`]: the schedule of the roots — a plan's refresh runs at
/// the step boundary (`schedule::refresh_due`: after step 1, then every `frequency` steps), so
/// the roots a step uses come from the factors up to the step before it (at S = 0), where
/// the reference refreshes between the factor update and the step — and rounding (`Ḡ` and the
/// grafting step computed in `T` rather than in f64, `root_1ᵀ` for `root_1`).
///
/// # Errors
/// [`ShapeError`] when an operand's length does not match (nothing is written then).
#[allow(clippy::too_many_arguments)]
pub fn shampoo_update<T: Real>(
    t: u64,
    hp: &ShampooParams,
    lr: f64,
    param: &mut [T],
    grad: &[T],
    exp_avg: &mut [T],
    mut graft_sq: Option<&mut [T]>,
    shape: &[usize],
    factors: &mut [&mut [T]],
    roots: &[&[T]],
) -> Result<(), ShapeError> {
    const OP: &str = "shampoo_update";
    let b = hp.max_preconditioner_dim;
    let ((vm, vn), blocks) = blocks(shape, b);
    let numel = vm * vn;
    check_len(OP, "param", param.len(), numel)?;
    check_len(OP, "grad", grad.len(), numel)?;
    check_len(OP, "exp_avg", exp_avg.len(), numel)?;
    match (&graft_sq, hp.grafting) {
        (Some(v), Some(_)) => check_len(OP, "graft_sq", v.len(), numel)?,
        (None, None) => {}
        (v, _) => check_len(OP, "graft_sq", v.as_ref().map_or(0, |v| v.len()), numel)?,
    }
    check_sides::<T>(OP, "factor", factors, &blocks)?;
    check_sides::<T>(OP, "root", roots, &blocks)?;
    let bits = (hp.beta2, hp.use_bias_correction);
    shampoo_factor_update(t, bits, (shape, b), grad, factors)?;
    let ti = t.min(i32::MAX as u64) as i32;
    let gbar: Vec<T> = if hp.beta1 != 0.0 {
        let (b1, w1) = (T::of(hp.beta1), T::of(1.0 - hp.beta1));
        let bc1 = T::of(1.0 - hp.beta1.powi(ti));
        exp_avg
            .iter_mut()
            .zip(grad)
            .map(|(m, &x)| {
                *m = b1 * *m + w1 * x;
                match hp.use_bias_correction {
                    true => *m / bc1,
                    false => *m,
                }
            })
            .collect()
    } else {
        grad.to_vec()
    };
    let pg: Option<Vec<T>> = match (hp.grafting, graft_sq.as_deref_mut()) {
        (Some(gr), Some(v)) => {
            let (b2, w2) = (T::of(gr.beta2), T::of(1.0 - gr.beta2));
            let (gbc, geps) = (T::of(1.0 - gr.beta2.powi(ti)), T::of(gr.epsilon));
            Some(
                v.iter_mut()
                    .zip(grad)
                    .zip(&gbar)
                    .map(|((v, &x), &gb)| {
                        *v = b2 * *v + w2 * x * x;
                        gb / ((*v / gbc).sqrt() + geps)
                    })
                    .collect(),
            )
        }
        _ => None,
    };
    let mut p = shampoo_precondition((shape, b), &gbar, roots)?;
    if let Some(pg) = &pg {
        p = graft(t, (shape, b), &p, pg)?;
    }
    let (lr_t, wd) = (T::of(lr), T::of(hp.weight_decay));
    for (wv, &pv) in param.iter_mut().zip(&p) {
        *wv = *wv - lr_t * (pv + wd * *wv);
    }
    Ok(())
}

/// The inverse root `(F + ε·I)^(−1/exponent)` of a `[d, d]` factor as a refresh computes it
/// for [`shampoo_update`] (whose factors are stored bias-corrected): the eigendecomposition of
/// `F + ε·I`, its spectrum shifted up so that its smallest eigenvalue is ε where it falls
/// below, then `Q diag(λ^(−1/exponent)) Qᵀ` (Distributed Shampoo's `matrix_inverse_root`).
///
/// # Errors
/// [`RefreshError::NonFiniteFactor`] (the previous root stays), a failed eigensolve, or a
/// length mismatch.
pub fn shampoo_inverse_root<T: Real>(
    solver: &dyn HostEigensolver,
    side: u8,
    factor: &[T],
    d: usize,
    root: schedule::InverseRoot,
) -> Result<Vec<T>, crate::RefreshError> {
    check_len("shampoo_inverse_root", "factor", factor.len(), d * d)?;
    let count = factor.iter().filter(|x| !x.is_finite()).count();
    if count > 0 {
        return Err(crate::RefreshError::NonFiniteFactor {
            side,
            dim: d,
            count,
        });
    }
    inverse_root(
        factor,
        d,
        1.0,
        root.epsilon,
        f64::from(root.exponent),
        solver,
    )
    .map_err(|source| crate::RefreshError::Eigensolver {
        side,
        solver: solver.name(),
        source,
    })
}

/// A refresh task of method `inverse_root` at the end of 1-based step `t` (the engines'
/// entry point, beside [`crate::refresh_compute_method`]): `None` when the step is not due
/// (`t == 1` or `(t − 1) mod frequency == 0`), else the root of [`shampoo_inverse_root`] as a
/// basis-only [`RefreshResult`] ([`crate::refresh_apply`] installs it into the `basis`
/// operand, the root buffer).
///
/// # Errors
/// As [`shampoo_inverse_root`].
pub fn refresh_compute_inverse_root<T: Real>(
    solver: &dyn HostEigensolver,
    t: u64,
    frequency: u64,
    side: u8,
    factor: &[T],
    d: usize,
    root: schedule::InverseRoot,
) -> Result<Option<crate::RefreshResult<T>>, crate::RefreshError> {
    let init = t == 1;
    #[allow(clippy::manual_is_multiple_of)]
    let due = init || (t > 1 && frequency > 0 && (t - 1) % frequency == 0);
    if !due {
        return Ok(None);
    }
    let kind = if init {
        crate::RefreshOutcome::Initialized
    } else {
        crate::RefreshOutcome::Refreshed
    };
    let q = shampoo_inverse_root(solver, side, factor, d, root)?;
    Ok(Some(crate::RefreshResult::basis_only(kind, side, d, q)))
}
