//! The KL-Shampoo parameter update (plan op `KlShampooUpdate`; Lin et al. 2025, "Understanding
//! and Improving Shampoo and SOAP via Kullback-Leibler Minimization", arXiv 2509.03378,
//! reference `KLOpt` of `yorkerlin/KL-Methods`, specified in `docs/kl-shampoo.md`): cuBLAS fp32
//! GEMMs for the basis projections and the factor EMAs around the kernels of family
//! `kl_shampoo` (`cuda/kernels/kl_shampoo.cu`). Semantics: `optim::kl_shampoo_update`.
//!
//! One step `t > 1` on a parameter `[m, n]`, in stream order (`s = 1/√D` of the estimates the
//! step starts with; a missing basis is the identity and its GEMMs are skipped):
//!
//! ```text
//! M    ← β₁·M + (1 − β₁)·G                                  kl_momentum
//! s_L, s_R = 1/√D_L, 1/√D_R                                 kl_inv_sqrt
//! Gt   = Q_Lᵀ G Q_R                                         GEMMs (A = Q_Lᵀ G kept)
//! D_L', D_R' from Gt, D_L, D_R (clamped), then installed    kl_eig_rows / kl_eig_cols, copies
//! S_R  ← β·S_R + (1 − β)/m · (diag(s_L) A)ᵀ (diag(s_L) A)    kl_scale, one GEMM (α, β)
//! S_L  ← β·S_L + (1 − β)/n · X Xᵀ,  X = G Q_R diag(s_R)      GEMM, kl_scale, one GEMM (α, β)
//! P    = (Q_Lᵀ M Q_R) · r/(1 + r·ε), r_ij = s_L_i s_R_j      GEMMs, kl_precondition
//! U    = Q_L P Q_Rᵀ;  W ← (W − lr·U/div)·(1 − lr·wd)         GEMMs, kl_apply
//! ```
//!
//! `(diag(s_L) A)ᵀ (diag(s_L) A) = Gᵀ Q_L diag(1/D_L) Q_Lᵀ G` is the reference's `X_L X_Lᵀ`
//! formed from the `[m, n]` side, so both factors' operands share one layout. Without
//! `normalize_grads` the last projection GEMM applies the step itself (`α = −lr·(1 − lr·wd)`,
//! `β = 1 − lr·wd` on `W`), as `soap_update` does; with it, `div = 1e-30 + RMS(U)` comes from
//! the sum-of-squares partials of family `reduce`.
use super::int;
use super::loss::{sumsq_partials, SUMSQ_BLOCKS};
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::gemm::{gemm_f32, Dims};
use crate::kernels::Args;
use crate::memory::{Buf, Elem};
use crate::StreamKind;
use schedule::KlShampooHyper;

/// One side of a KL-Shampoo parameter (rows = left with `d = m`, columns = right with
/// `d = n`), the GPU twin of `optim::KlSide`: all f32, updated in place where written.
#[derive(Clone, Copy, Debug)]
pub struct KlSide<'a> {
    /// The Kronecker factor `S` `[d, d]` (read and written); `None` for a side without one.
    pub factor: Option<&'a Buf>,
    /// The basis `Q` `[d, d]` (columns are the basis vectors; read only); `None` = identity.
    pub basis: Option<&'a Buf>,
    /// The eigenvalue estimates `D` `[d]` (read and written).
    pub eig: &'a Buf,
}

/// Scratch elements (f32) of [`kl_shampoo_update`] for an `[m, n]` parameter with a left
/// (`left`) and / or right (`right`) basis: regions of 64-element multiples (256 bytes) for the
/// f64 partials and the RMS divisor (`2·256 + 2`), `1/√D` and the new `D` of each side (`m`,
/// `n`, `m`, `n`), and `1 + (left ∨ right) + (left ∧ right)` `[m, n]` work matrices
/// (`schedule::reserve::kl_shampoo_update_scratch_len`, which the compiler's memory estimate
/// uses).
pub fn kl_shampoo_update_scratch_len(m: usize, n: usize, left: bool, right: bool) -> usize {
    schedule::reserve::kl_shampoo_update_scratch_len(m, n, left, right)
}

/// Errors unless each side's factor and basis (when present) are `[d, d]` f32 and its
/// estimates `[d]` f32 (`d = m` on the left, `n` on the right).
fn check_sides(
    op: &'static str,
    left: &KlSide<'_>,
    right: &KlSide<'_>,
    m: usize,
    n: usize,
) -> Result<()> {
    for (side, d, [fname, qname, ename]) in [
        (left, m, ["factor_left", "basis_left", "eig_left"]),
        (right, n, ["factor_right", "basis_right", "eig_right"]),
    ] {
        if let Some(f) = side.factor {
            f.expect(op, fname, Elem::F32, d * d)?;
        }
        if let Some(q) = side.basis {
            q.expect(op, qname, Elem::F32, d * d)?;
        }
        side.eig.expect(op, ename, Elem::F32, d)?;
    }
    Ok(())
}

/// Carves 64-element-aligned regions off the front of a scratch buffer.
struct Carve<'a> {
    scratch: &'a Buf,
    off: usize,
}

impl Carve<'_> {
    fn take(&mut self, len: usize) -> Result<Buf> {
        let b = self.scratch.slice(self.off, len)?;
        self.off += len.next_multiple_of(64);
        Ok(b)
    }
}

/// `Q_Lᵀ X Q_R` (`back` false) or `Q_L X Q_Rᵀ` (`back` true) of an `[m, n]` matrix `x`, by up to
/// two fp32 GEMMs: returns the buffer that holds it — `x` itself without bases, `work[0]` with
/// one basis, `work[1]` (through `work[0]`) with both. `work` must hold one matrix per basis.
#[allow(clippy::too_many_arguments)]
fn project(
    dev: &Device,
    ql: Option<&Buf>,
    qr: Option<&Buf>,
    x: &Buf,
    work: &[Buf],
    back: bool,
    m: usize,
    n: usize,
) -> Result<Buf> {
    let (dm, dmm, dnn) = (Dims::new(m, n), Dims::new(m, m), Dims::new(n, n));
    let mut cur = x.clone();
    let mut slots = work.iter();
    let mut next = || {
        slots.next().cloned().ok_or(CudaError::Invalid {
            op: "kl_shampoo_update",
            what: "internal: a projection without a work matrix".into(),
        })
    };
    if let Some(q) = ql {
        let out = next()?;
        gemm_f32(dev, q, dmm, &cur, dm, &out, !back, false, 1.0, 0.0)?;
        cur = out;
    }
    if let Some(q) = qr {
        let out = next()?;
        gemm_f32(dev, &cur, dm, q, dnn, &out, false, back, 1.0, 0.0)?;
        cur = out;
    }
    Ok(cur)
}

/// Plan op `KlShampooUpdate` on a parameter `[m, n]` at 1-based engine step `t` with the
/// scheduled learning rate `lr` (`hp.lr` is not read), on the compute stream:
///
/// - `t ≤ 1`: the factors `S_L = (1 − β)/n·G Gᵀ`, `S_R = (1 − β)/m·Gᵀ G` (of the sides that
///   have one) and `D_L = D_R = init_factor`; `param` and `exp_avg` are not touched.
/// - `t > 1`: the momentum, the update `U = Q_L[(Q_Lᵀ M Q_R) ⊘ (√(D_L D_Rᵀ) + ε)]Q_Rᵀ`, the
///   factor EMAs `S_L ← β S_L + (1 − β)/n·G Q_R D_R⁻¹ Q_Rᵀ Gᵀ` (and twin) and the clamped
///   estimate EMAs `D_L ← max(β D_L + (1 − β)·rowmean((Q_Lᵀ G Q_R)² ⊘ D_Rᵀ), 1/c_L²)` (and
///   twin; `c = max(10, min(d, max_clamp_value))`, `optim::kl_eig_floor`), all from the bases
///   and estimates the step started with; `U` divided by `1e-30 + RMS(U)` with
///   `normalize_grads`; then `W ← (W − lr·U)(1 − lr·wd)` (see the module docs for the order).
///
/// Operands, all f32 row-major: `param`, `grad`, `exp_avg` `[m, n]`; each side's factor and
/// basis `[d, d]` (either may be absent: a missing basis is the identity, a missing factor is
/// not updated), its estimates `[d]`; `scratch` of at least
/// [`kl_shampoo_update_scratch_len`] f32 elements, overlapping no operand. The GEMMs run with
/// the device's [`crate::GemmMath`] (the engine's optimizer program: fp32, or TF32 under
/// `precision = bf16`). An empty parameter (`m·n = 0`) is left as it is.
///
/// # Errors
/// Operands of the wrong length or dtype and a short scratch ([`CudaError::Shape`],
/// [`CudaError::Operand`]), sides beyond the kernels' `int` range ([`CudaError::Invalid`]),
/// cuBLAS and launch failures. Shapes are checked before anything is enqueued.
#[allow(clippy::too_many_arguments)]
pub fn kl_shampoo_update(
    dev: &Device,
    t: u64,
    lr: f64,
    hp: &KlShampooHyper,
    param: &Buf,
    grad: &Buf,
    exp_avg: &Buf,
    left: KlSide<'_>,
    right: KlSide<'_>,
    m: usize,
    n: usize,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "kl_shampoo_update";
    let mn = m * n;
    for (name, b) in [("param", param), ("grad", grad), ("exp_avg", exp_avg)] {
        b.expect(OP, name, Elem::F32, mn)?;
    }
    check_sides(OP, &left, &right, m, n)?;
    let (ql, qr) = (left.basis, right.basis);
    let need = kl_shampoo_update_scratch_len(m, n, ql.is_some(), qr.is_some());
    super::check_scratch(OP, scratch, need)?;
    // The kernels' `int` range, checked before anything is enqueued.
    let _ = (int(OP, "m", m)?, int(OP, "n", n)?);
    if mn == 0 {
        return Ok(());
    }
    let dm = Dims::new(m, n);
    let factors = FactorHyper {
        shampoo_beta: hp.shampoo_beta,
        init_factor: hp.init_factor,
        max_clamp_value: hp.max_clamp_value,
    };
    if t <= 1 {
        return init_factors(dev, &factors, grad, left, right, m, n);
    }

    let mut carve = Carve { scratch, off: 0 };
    let head = carve.take(2 * SUMSQ_BLOCKS + 2)?;
    let partials = head
        .slice(0, 2 * SUMSQ_BLOCKS)?
        .reinterpret(Elem::F64, SUMSQ_BLOCKS)?;
    let divisor = head.slice(2 * SUMSQ_BLOCKS, 1)?;
    let fw = FactorWork::carve(&mut carve, ql.is_some(), qr.is_some(), m, n)?;
    let elementwise = (dev.grid_for(mn), 1, 1);

    // Momentum, then the estimates and factors (which leave 1/√D of the estimates the step
    // started with in s_L, s_R).
    let args = Args::new()
        .buf(exp_avg)
        .buf(grad)
        .i64(mn as i64)
        .f32(hp.beta1 as f32)
        .f32((1.0 - hp.beta1) as f32);
    dev.launch("kl_momentum", elementwise, (256, 1, 1), args)?;
    update_factors(dev, &factors, grad, left, right, m, n, &fw)?;
    let (x, work) = (&fw.x, &fw.work);

    // P = (Q_Lᵀ M Q_R) · r/(1 + r·ε) into x (never in place: without bases the input is M).
    let mt = project(dev, ql, qr, exp_avg, work, false, m, n)?;
    precondition(dev, &mt, x, (&fw.s_l, &fw.s_r), hp.eps, m, n)?;

    // U = Q_L P Q_Rᵀ and the step. Without the RMS normalisation the last GEMM applies it:
    // W ← α·(…) + β·W with α = −lr·(1 − lr·wd), β = 1 − lr·wd.
    let decay = 1.0 - lr * hp.weight_decay;
    if !hp.normalize_grads {
        let (alpha, beta) = ((-lr * decay) as f32, decay as f32);
        let (dmm, dnn) = (Dims::new(m, m), Dims::new(n, n));
        match (ql, qr) {
            (Some(l), Some(r)) => {
                let y = project(dev, Some(l), None, x, work, true, m, n)?;
                return gemm_f32(dev, &y, dm, r, dnn, param, false, true, alpha, beta);
            }
            (Some(l), None) => {
                return gemm_f32(dev, l, dmm, x, dm, param, false, false, alpha, beta)
            }
            (None, Some(r)) => {
                return gemm_f32(dev, x, dm, r, dnn, param, false, true, alpha, beta)
            }
            // No GEMM to fuse into: the update kernel below.
            (None, None) => {}
        }
    }
    let u = project(dev, ql, qr, x, work, true, m, n)?;
    if hp.normalize_grads {
        sumsq_partials(dev, &u, &partials, 0)?;
        let args = Args::new()
            .buf(&partials)
            .i32(SUMSQ_BLOCKS as i32)
            .i64(mn as i64)
            .buf(&divisor);
        dev.launch("rms_finalize", (1, 1, 1), (256, 1, 1), args)?;
    }
    let args = Args::new()
        .buf(param)
        .buf(&u)
        .i64(mn as i64)
        .f32(lr as f32)
        .opt(hp.normalize_grads.then_some(&divisor))
        .f32(decay as f32);
    dev.launch("kl_apply", elementwise, (256, 1, 1), args)
}

/// The hyperparameters of the factor and estimate updates.
#[derive(Clone, Copy, Debug)]
pub struct FactorHyper {
    /// β of the factor and estimate EMAs.
    pub shampoo_beta: f64,
    /// The estimates' value at `t = 1`.
    pub init_factor: f64,
    /// The clamp's `max_clamp_value` (`optim::kl_eig_floor`).
    pub max_clamp_value: f64,
}

/// The scratch of the estimate and factor updates: `1/√D` of each side's old estimates, the new
/// estimates, the `[m, n]` work matrix `x` and one `[m, n]` matrix per basis.
struct FactorWork {
    s_l: Buf,
    s_r: Buf,
    d_l: Buf,
    d_r: Buf,
    x: Buf,
    work: Vec<Buf>,
}

impl FactorWork {
    /// Carved from `carve` in this order.
    fn carve(carve: &mut Carve<'_>, left: bool, right: bool, m: usize, n: usize) -> Result<Self> {
        let (s_l, s_r) = (carve.take(m)?, carve.take(n)?);
        let (d_l, d_r) = (carve.take(m)?, carve.take(n)?);
        let x = carve.take(m * n)?;
        let bases = usize::from(left) + usize::from(right);
        let work = (0..bases)
            .map(|_| carve.take(m * n))
            .collect::<Result<Vec<Buf>>>()?;
        Ok(FactorWork {
            s_l,
            s_r,
            d_l,
            d_r,
            x,
            work,
        })
    }
}

/// The first step's factors `S_L = (1 − β)/n·G Gᵀ`, `S_R = (1 − β)/m·Gᵀ G` (the sides that
/// have one) and estimates `D = init_factor`.
fn init_factors(
    dev: &Device,
    hp: &FactorHyper,
    grad: &Buf,
    left: KlSide<'_>,
    right: KlSide<'_>,
    m: usize,
    n: usize,
) -> Result<()> {
    let dm = Dims::new(m, n);
    let b = hp.shampoo_beta;
    let (wl, wr) = ((1.0 - b) / n as f64, (1.0 - b) / m as f64);
    // β = 0: cuBLAS does not read the factors' previous contents.
    if let Some(f) = left.factor {
        gemm_f32(dev, grad, dm, grad, dm, f, false, true, wl as f32, 0.0)?;
    }
    if let Some(f) = right.factor {
        gemm_f32(dev, grad, dm, grad, dm, f, true, false, wr as f32, 0.0)?;
    }
    let init = (hp.init_factor as f32).to_bits();
    dev.fill_bits32(left.eig, init)?;
    dev.fill_bits32(right.eig, init)
}

/// `out = x · r/(1 + r·ε)`, `r_ij = s_L_i s_R_j` (`kl_precondition`; `x` and `out` distinct).
fn precondition(
    dev: &Device,
    x: &Buf,
    out: &Buf,
    (s_l, s_r): (&Buf, &Buf),
    eps: f64,
    m: usize,
    n: usize,
) -> Result<()> {
    const OP: &str = "kl_precondition";
    let args = Args::new()
        .buf(x)
        .buf(out)
        .buf(s_l)
        .buf(s_r)
        .i32(int(OP, "m", m)?)
        .i32(int(OP, "n", n)?)
        .f32(eps as f32);
    dev.launch(
        "kl_precondition",
        (dev.grid_for(m * n), 1, 1),
        (256, 1, 1),
        args,
    )
}

/// One step's (`t > 1`) estimate and factor updates from the bases and estimates as they are
/// (module docs): `1/√D` of the old estimates into `fw.s_l`, `fw.s_r` (left there for the
/// caller), the new clamped estimates (staged in `fw.d_l`, `fw.d_r`) installed, then the
/// factor EMAs through `fw.x` and `fw.work`.
#[allow(clippy::too_many_arguments)]
fn update_factors(
    dev: &Device,
    hp: &FactorHyper,
    grad: &Buf,
    left: KlSide<'_>,
    right: KlSide<'_>,
    m: usize,
    n: usize,
    fw: &FactorWork,
) -> Result<()> {
    let (s_l, s_r, x, work) = (&fw.s_l, &fw.s_r, &fw.x, fw.work.as_slice());
    let (d_l, d_r) = (&fw.d_l, &fw.d_r);
    const OP: &str = "kl_factor_update";
    let (mi, ni) = (int(OP, "m", m)?, int(OP, "n", n)?);
    let (ql, qr) = (left.basis, right.basis);
    let dm = Dims::new(m, n);
    let b = hp.shampoo_beta;
    // The factor EMAs' weights (1 − β)/n and (1 − β)/m, rounded once.
    let (wl, wr) = ((1.0 - b) / n as f64, (1.0 - b) / m as f64);
    let elementwise = (dev.grid_for(m * n), 1, 1);
    for (d, s, len) in [(left.eig, s_l, mi), (right.eig, s_r, ni)] {
        let args = Args::new().buf(d).buf(s).i32(len);
        dev.launch(
            "kl_inv_sqrt",
            (dev.grid_for(len as usize), 1, 1),
            (256, 1, 1),
            args,
        )?;
    }

    // Eigenvalue estimates from Gt = Q_Lᵀ G Q_R and the old D (both computed before either is
    // installed). With a left basis, A = Q_Lᵀ G stays in work[0] for S_R below.
    let gt = project(dev, ql, qr, grad, work, false, m, n)?;
    let (beta, w) = (b as f32, (1.0 - b) as f32);
    let floor = |d: usize| optim::kl_eig_floor(d, hp.max_clamp_value) as f32;
    let args = Args::new()
        .buf(&gt)
        .buf(left.eig)
        .buf(right.eig)
        .buf(&d_l)
        .i32(mi)
        .i32(ni)
        .f32(beta)
        .f32(w)
        .f32(floor(m));
    dev.launch(
        "kl_eig_rows",
        (mi as u32, 1, 1),
        (super::row_threads(n), 1, 1),
        args,
    )?;
    let args = Args::new()
        .buf(&gt)
        .buf(left.eig)
        .buf(right.eig)
        .buf(&d_r)
        .i32(mi)
        .i32(ni)
        .f32(beta)
        .f32(w)
        .f32(floor(n));
    dev.launch(
        "kl_eig_cols",
        (n.div_ceil(32) as u32, 1, 1),
        (32, 32, 1),
        args,
    )?;
    dev.copy(left.eig, &d_l, StreamKind::Compute)?;
    dev.copy(right.eig, &d_r, StreamKind::Compute)?;

    // Factors, from the old bases and estimates: x = diag(s_L)·A, S_R ← β S_R + (1 − β)/m·xᵀx;
    // x = (G Q_R)·diag(s_R), S_L ← β S_L + (1 − β)/n·x xᵀ.
    let scale = |src: &Buf, row: Option<&Buf>, col: Option<&Buf>| {
        let args = Args::new()
            .buf(src)
            .buf(x)
            .opt(row)
            .opt(col)
            .i32(mi)
            .i32(ni);
        dev.launch("kl_scale", elementwise, (256, 1, 1), args)
    };
    if let Some(f) = right.factor {
        // A = Q_Lᵀ G (work[0], from the Gt projection) or G itself.
        let a = match (ql, work.first()) {
            (Some(_), Some(a)) => a,
            _ => grad,
        };
        scale(a, Some(s_l), None)?;
        gemm_f32(dev, x, dm, x, dm, f, true, false, wr as f32, beta)?;
    }
    if let Some(f) = left.factor {
        let g_qr = project(dev, None, qr, grad, work, false, m, n)?;
        scale(&g_qr, None, Some(s_r))?;
        gemm_f32(dev, x, dm, x, dm, f, false, true, wl as f32, beta)?;
    }
    Ok(())
}

/// Scratch elements (f32) of [`kl_scale`]: `1/√D` of each side.
pub fn kl_scale_scratch_len(m: usize, n: usize) -> usize {
    schedule::reserve::kl_scale_scratch_len(m, n)
}

/// Plan op `KlScale` (KL-Shampoo's composed step): `out = x ⊘ (√(D_L D_Rᵀ) + ε)` for `x`
/// `[m, n]` f32 with the estimates `eig_left` `[m]`, `eig_right` `[n]`, computed as
/// `x·(r/(1 + r·ε))`, `r = (1/√D_L[i])(1/√D_R[j])` (`kl_inv_sqrt`, `kl_precondition`); zero
/// at `t ≤ 1`. `x` and `out` distinct; `scratch` at least [`kl_scale_scratch_len`] f32
/// elements. Semantics: `optim::kl_scale`.
///
/// # Errors
/// Operands of the wrong length or dtype, a short scratch ([`CudaError::Shape`],
/// [`CudaError::Operand`]); sizes beyond `int`; launch failures.
#[allow(clippy::too_many_arguments)]
pub fn kl_scale(
    dev: &Device,
    t: u64,
    eps: f64,
    x: &Buf,
    out: &Buf,
    (eig_left, eig_right): (&Buf, &Buf),
    m: usize,
    n: usize,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "kl_scale";
    x.expect(OP, "x", Elem::F32, m * n)?;
    out.expect(OP, "out", Elem::F32, m * n)?;
    eig_left.expect(OP, "eig_left", Elem::F32, m)?;
    eig_right.expect(OP, "eig_right", Elem::F32, n)?;
    let need = kl_scale_scratch_len(m, n);
    super::check_scratch(OP, scratch, need)?;
    let (mi, ni) = (int(OP, "m", m)?, int(OP, "n", n)?);
    if m * n == 0 {
        return Ok(());
    }
    if t <= 1 {
        return dev.zero(out);
    }
    let mut carve = Carve { scratch, off: 0 };
    let (s_l, s_r) = (carve.take(m)?, carve.take(n)?);
    for (d, s, len) in [(eig_left, &s_l, mi), (eig_right, &s_r, ni)] {
        let args = Args::new().buf(d).buf(s).i32(len);
        dev.launch(
            "kl_inv_sqrt",
            (dev.grid_for(len as usize), 1, 1),
            (256, 1, 1),
            args,
        )?;
    }
    precondition(dev, x, out, (&s_l, &s_r), eps, m, n)
}

/// Scratch elements (f32) of [`kl_factor_update`]: `1/√D` and the new estimates of each side,
/// a work matrix and one more per basis (`schedule::reserve::kl_factor_update_scratch_len`).
pub fn kl_factor_update_scratch_len(m: usize, n: usize, left: bool, right: bool) -> usize {
    schedule::reserve::kl_factor_update_scratch_len(m, n, left, right)
}

/// Plan op `KlFactorUpdate` (after KL-Shampoo's composed step): at `t ≤ 1` the factors from
/// `grad` `[m, n]` and the estimates `init_factor`; later the clamped estimate EMAs and the
/// factor EMAs from the bases and estimates as they are (the step of this `t` read them
/// before), exactly as [`kl_shampoo_update`] computes them. Operands as there; `scratch` at
/// least [`kl_factor_update_scratch_len`] f32 elements. Semantics: `optim::kl_factor_update`.
///
/// # Errors
/// As [`kl_shampoo_update`].
#[allow(clippy::too_many_arguments)]
pub fn kl_factor_update(
    dev: &Device,
    t: u64,
    hp: &FactorHyper,
    grad: &Buf,
    left: KlSide<'_>,
    right: KlSide<'_>,
    m: usize,
    n: usize,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "kl_factor_update";
    grad.expect(OP, "grad", Elem::F32, m * n)?;
    check_sides(OP, &left, &right, m, n)?;
    let (l, r) = (left.basis.is_some(), right.basis.is_some());
    let need = kl_factor_update_scratch_len(m, n, l, r);
    super::check_scratch(OP, scratch, need)?;
    let _ = (int(OP, "m", m)?, int(OP, "n", n)?);
    if m * n == 0 {
        return Ok(());
    }
    if t <= 1 {
        return init_factors(dev, hp, grad, left, right, m, n);
    }
    let fw = FactorWork::carve(&mut Carve { scratch, off: 0 }, l, r, m, n)?;
    update_factors(dev, hp, grad, left, right, m, n, &fw)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The regions [`kl_shampoo_update`] carves, in its order (each start rounded up to 64
    /// elements), fit the scratch length the compiler plans with.
    #[test]
    fn scratch_len_covers_the_carved_regions() {
        for (m, n) in [(1usize, 1usize), (7, 13), (33, 5), (64, 64), (783, 50)] {
            for (left, right) in [(false, false), (true, false), (false, true), (true, true)] {
                let bases = usize::from(left) + usize::from(right);
                let mut regions = vec![2 * SUMSQ_BLOCKS + 2, m, n, m, n, m * n];
                regions.extend(std::iter::repeat_n(m * n, bases));
                let end = regions
                    .iter()
                    .fold(0, |off: usize, &len| off.next_multiple_of(64) + len);
                let len = kl_shampoo_update_scratch_len(m, n, left, right);
                assert!(end <= len, "[{m}, {n}] {left} {right}: {end} > {len}");
            }
        }
    }
}
