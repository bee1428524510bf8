//! Optimizer launchers: fused AdamW (plan op `AdamW`, generated from its update rule), the SOAP parameter
//! update (plan op `SoapUpdate`: cuBLAS projections around the fused eigenbasis-Adam kernel,
//! family `soap`), a composed SOAP step's eigenbasis projection (plan op `Project`, GEMMs), the
//! Kronecker-factor accumulation (plan op `SoapFactorUpdate`, GEMMs) and the element-wise
//! update kernels generated from update rules ([`UpdateKernel`]). Semantics match
//! `optim::adamw_update`, `optim::soap_update`, `optim::project`, `optim::soap_factor_update`.
use super::loss::{sumsq_partials, SUMSQ_BLOCKS};
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::gemm::{self, gemm_f32, Dims};
use crate::kernels::Args;
use crate::memory::{Buf, Elem};
use schedule::reserve::bf16_slots;
use schedule::SoapHyper;

/// AdamW hyperparameters of one step; `lr` is the scheduled learning rate of this step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// 1-based step (bias correction).
    pub t: u64,
    /// Scheduled learning rate.
    pub lr: f64,
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε added to the bias-corrected √v.
    pub eps: f64,
    /// Decoupled weight decay (multiplied by `lr`).
    pub weight_decay: f64,
}

/// Plan op `AdamW` (PyTorch `torch.optim.AdamW` semantics, torch.lerp for the first moment),
/// in place on param/exp_avg/exp_avg_sq; all four buffers the same length. `grad_scale`
/// (f32 `[1]`, a `ClipGradNorm`'s `scale`): the update reads `grad · grad_scale`.
///
/// The kernel is generated from AdamW's update rule (`optim::update::adamw_rule`, simplified)
/// for one set of constants: bit-identical to `optim::adamw_update` at f32 (the CPU engine's
/// AdamW), and as fast as the hand-written kernel it replaced (H200, BENCHMARKS.md).
pub struct AdamWKernel {
    kernel: UpdateKernel,
}

impl AdamWKernel {
    /// Generates and compiles the kernel for these constants (NVRTC, cached on disk).
    ///
    /// # Errors
    /// NVRTC or driver errors.
    pub fn new(dev: &Device, beta1: f64, beta2: f64, eps: f64, weight_decay: f64) -> Result<Self> {
        let rule = optim::update::adamw_rule(beta1, beta2, eps, weight_decay);
        let (expr, _) = optim::update::simplify(&rule.expr);
        let rule = optim::update::UpdateRule { expr, ..rule };
        Ok(AdamWKernel {
            kernel: UpdateKernel::new(dev, &rule)?,
        })
    }

    /// One step `s` (its constants must be the kernel's; `t` and `lr` are this step's).
    ///
    /// # Errors
    /// Operands of the wrong length or dtype; launch failures.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        dev: &Device,
        s: &AdamWStep,
        param: &Buf,
        grad: &Buf,
        exp_avg: &Buf,
        exp_avg_sq: &Buf,
        grad_scale: Option<&Buf>,
    ) -> Result<()> {
        let t = s.t.max(1).min(i32::MAX as u64) as i32;
        let scalars = optim::update::adamw_scalars(s.beta1, s.beta2, s.weight_decay, s.lr, t);
        self.kernel.run(
            dev,
            &[param, grad, exp_avg, exp_avg_sq],
            &scalars,
            grad_scale,
        )
    }
}

/// [`AdamWKernel`] for `s`'s constants, compiled for this call (NVRTC's disk cache makes a
/// repeat cheap; the engine keeps one kernel per set of constants instead).
///
/// # Errors
/// As [`AdamWKernel::new`] and [`AdamWKernel::run`].
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    dev: &Device,
    s: &AdamWStep,
    param: &Buf,
    grad: &Buf,
    exp_avg: &Buf,
    exp_avg_sq: &Buf,
    grad_scale: Option<&Buf>,
) -> Result<()> {
    AdamWKernel::new(dev, s.beta1, s.beta2, s.eps, s.weight_decay)?
        .run(dev, s, param, grad, exp_avg, exp_avg_sq, grad_scale)
}

/// How SOAP's per-step GEMMs ([`soap_update`]'s eigenbasis projections and
/// [`soap_factor_update`]'s factor accumulation) run under `precision = bf16` (a
/// `precision = fp32` plan always uses plain fp32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SoapProjections {
    /// cuBLAS on the fp32 operands with the device's [`crate::GemmMath`] (TF32 under
    /// `precision = bf16`).
    Fp32Storage,
    /// Bases, gradient and intermediates cast to bf16, native bf16 GEMMs with fp32
    /// accumulation and fp32 outputs (the precision policy of the model GEMMs; the default).
    /// On the H200 this took SOAP's synchronous-free step from 187.3 to 179.6 ms on GPT-2 124M
    /// (AdamW 167.7 ms; BENCHMARKS.md), where cuBLAS's TF32 and FAST_16BF modes on
    /// fp32-stored operands run at ~95 TFLOP/s on SOAP's shapes.
    #[default]
    Bf16,
}

/// Scratch elements (f32) of [`soap_update`] for an `[m, n]` parameter with the given bases:
/// `3·m·n + 2·256 + 2` (projections, f64 partials, the RMS divisor) rounded up to a multiple of
/// 64 (256 bytes), plus with [`SoapProjections::Bf16`] and a basis the bf16 bases (`m²`, `n²`)
/// and two bf16 `[m, n]` matrices, each region rounded up to 256 bytes.
pub fn soap_update_scratch_len(
    m: usize,
    n: usize,
    left: bool,
    right: bool,
    proj: SoapProjections,
) -> usize {
    schedule::reserve::soap_update_scratch_len(m, n, left, right, proj == SoapProjections::Bf16)
}

/// Plan op `SoapUpdate` on a parameter `[m, n]` at 1-based step `t` with scheduled `lr`
/// (`hp.lr` is ignored): nothing at `t ≤ 1`; otherwise with k = t − 1,
/// `G' = Q_Lᵀ G Q_R`, fused `exp_avg ← β₁·exp_avg + (1−β₁)G'`,
/// `exp_avg_sq ← β₂·exp_avg_sq + (1−β₂)G'²`, `pre = exp_avg/(√exp_avg_sq + ε)`,
/// `N = Q_L pre Q_Rᵀ` (optionally divided by `1e-30 + RMS(N)`),
/// `W ← W − lr·√(1−β₂ᵏ)/(1−β₁ᵏ)·N`, then `W ← W − lr·wd·W` (fused into the last projection
/// GEMM's α/β when there is a basis and no RMS normalisation). A missing basis is the identity.
/// `scratch` f32 of at least [`soap_update_scratch_len`]; `proj` says how the projections run;
/// `cached` are bf16 copies of `[Q_L, Q_R]` `[m, m]`, `[n, n]` kept by the caller while the
/// bases do not change (used under [`SoapProjections::Bf16`]; a `None` is cast here, each step).
/// Reference: `SOAP.step` of nikhilvyas/SOAP `soap.py` (Vyas et al., 2024).
///
/// # Errors
/// Operands of the wrong size or dtype, a short scratch ([`CudaError::Shape`]), cuBLAS and
/// launch failures.
#[allow(clippy::too_many_arguments)]
pub fn soap_update(
    dev: &Device,
    t: u64,
    lr: f64,
    hp: &SoapHyper,
    param: &Buf,
    grad: &Buf,
    exp_avg: &Buf,
    exp_avg_sq: &Buf,
    basis_left: Option<&Buf>,
    basis_right: Option<&Buf>,
    m: usize,
    n: usize,
    scratch: &Buf,
    proj: SoapProjections,
    cached: [Option<&Buf>; 2],
) -> Result<()> {
    const OP: &str = "soap_update";
    let mn = m * n;
    for (name, b) in [
        ("param", param),
        ("grad", grad),
        ("exp_avg", exp_avg),
        ("exp_avg_sq", exp_avg_sq),
    ] {
        b.expect(OP, name, Elem::F32, mn)?;
    }
    if let Some(q) = basis_left {
        q.expect(OP, "basis_left", Elem::F32, m * m)?;
    }
    if let Some(q) = basis_right {
        q.expect(OP, "basis_right", Elem::F32, n * n)?;
    }
    let need = soap_update_scratch_len(m, n, basis_left.is_some(), basis_right.is_some(), proj);
    if scratch.len() < need || scratch.elem() != Elem::F32 {
        return Err(CudaError::Shape {
            op: OP,
            operand: "scratch",
            expected: need,
            got: scratch.len(),
        });
    }
    if t <= 1 || mn == 0 {
        return Ok(());
    }
    let k = i32::try_from(t - 1).unwrap_or(i32::MAX);
    // Layout: f64 partials first (8-byte aligned like the scratch itself), the divisor, then
    // the three [m, n] work matrices.
    let head = 2 * SUMSQ_BLOCKS + 2;
    let partials = scratch
        .slice(0, 2 * SUMSQ_BLOCKS)?
        .reinterpret(Elem::F64, SUMSQ_BLOCKS)?;
    let divisor = scratch.slice(2 * SUMSQ_BLOCKS, 1)?;
    let gp = scratch.slice(head, mn)?;
    let tmp = scratch.slice(head + mn, mn)?;
    let pre = scratch.slice(head + 2 * mn, mn)?;
    let (dm, dn, dmm, dnn) = (
        Dims::new(m, n),
        Dims::new(m, n),
        Dims::new(m, m),
        Dims::new(n, n),
    );

    // bf16 work area (SoapProjections::Bf16): the bases, then two [m, n] matrices.
    let bf = if proj == SoapProjections::Bf16 && (basis_left.is_some() || basis_right.is_some()) {
        let mut off = (3 * mn + head).next_multiple_of(64);
        let mut carve = |len: usize| -> Result<Buf> {
            let b = scratch
                .slice(off, bf16_slots(len))?
                .reinterpret(Elem::BF16, len)?;
            off += bf16_slots(len);
            Ok(b)
        };
        // A basis's bf16 copy: the caller's (cast when the basis last changed), else cast now
        // into scratch.
        let mut bf16_basis =
            |q: Option<&Buf>, cached: Option<&Buf>, d: usize| -> Result<Option<Buf>> {
                let Some(q) = q else { return Ok(None) };
                let b = carve(d * d)?;
                match cached {
                    Some(c) => {
                        c.expect(OP, "cached bf16 basis", Elem::BF16, d * d)?;
                        Ok(Some(c.clone()))
                    }
                    None => {
                        gemm::cast_f32_to_bf16(dev, q, &b)?;
                        Ok(Some(b))
                    }
                }
            };
        let ql = bf16_basis(basis_left, cached[0], m)?;
        let qr = bf16_basis(basis_right, cached[1], n)?;
        let (x, y) = (carve(mn)?, carve(mn)?);
        Some((ql, qr, x, y))
    } else {
        None
    };

    // G' = Q_Lᵀ G Q_R. Under bf16 projections a product that feeds the next GEMM is written
    // as bf16 by that GEMM itself (no f32 intermediate and cast).
    let mut cur = grad.clone();
    if let Some((ql_b, qr_b, x, y)) = &bf {
        gemm::cast_f32_to_bf16(dev, grad, x)?;
        let mut cur_b = x;
        if let Some(q) = ql_b {
            if qr_b.is_some() {
                gemm::matmul_bf16(dev, q, dmm, x, dm, y, true, false, false)?;
                cur_b = y;
            } else {
                gemm::matmul_bf16(dev, q, dmm, x, dm, &tmp, true, false, false)?;
                cur = tmp.clone();
            }
        }
        if let Some(q) = qr_b {
            gemm::matmul_bf16(dev, cur_b, dm, q, dnn, &gp, false, false, false)?;
            cur = gp.clone();
        }
    } else {
        if let Some(ql) = basis_left {
            gemm_f32(dev, ql, dmm, &cur, dm, &tmp, true, false, 1.0, 0.0)?;
            cur = tmp.clone();
        }
        if let Some(qr) = basis_right {
            gemm_f32(dev, &cur, dm, qr, dnn, &gp, false, false, 1.0, 0.0)?;
            cur = gp.clone();
        }
    }
    // Under bf16 projections `pre` goes straight to bf16 (into x: the gradient's bf16 copy
    // was read by the forward projections, done by now in stream order).
    let pre_bf = bf.as_ref().map(|(_, _, x, _)| x);
    let args = Args::new()
        .buf(&cur)
        .buf(exp_avg)
        .buf(exp_avg_sq)
        .buf(&pre)
        .opt(pre_bf)
        .i64(mn as i64)
        .f32(hp.beta1 as f32)
        .f32((1.0 - hp.beta1) as f32)
        .f32(hp.beta2 as f32)
        .f32((1.0 - hp.beta2) as f32)
        .f32(hp.eps as f32);
    dev.launch(
        "soap_adam_eigen",
        (dev.grid_for(mn), 1, 1),
        (256, 1, 1),
        args,
    )?;

    let mut step = lr;
    if hp.correct_bias {
        step = step * (1.0 - hp.beta2.powi(k)).sqrt() / (1.0 - hp.beta1.powi(k));
    }
    // Decoupled weight decay after the step: W ← (W − step·N)(1 − lr·wd).
    let decay = if hp.weight_decay > 0.0 {
        1.0 - lr * hp.weight_decay
    } else {
        1.0
    };
    // N = Q_L pre Q_Rᵀ. Without the RMS normalisation the last projection GEMM applies the
    // update itself: W ← α·(…)·Q_Rᵀ + β·W with α = −step·(1 − lr·wd), β = 1 − lr·wd (the same
    // arithmetic as `soap_apply`, one pass over W fewer, up to rounding).
    let fused = !hp.normalize_grads && (basis_left.is_some() || basis_right.is_some());
    let (alpha, beta) = ((-step * decay) as f32, decay as f32);
    let mut upd = pre.clone();
    if let Some((ql_b, qr_b, x, y)) = &bf {
        let mut cur_b = x;
        if let Some(q) = ql_b {
            if fused && qr_b.is_none() {
                return gemm::gemm_bf16(dev, q, dmm, x, dn, param, false, false, alpha, beta);
            }
            if qr_b.is_some() {
                gemm::matmul_bf16(dev, q, dmm, x, dn, y, false, false, false)?;
                cur_b = y;
            } else {
                gemm::matmul_bf16(dev, q, dmm, x, dn, &tmp, false, false, false)?;
                upd = tmp.clone();
            }
        }
        if let Some(q) = qr_b {
            if fused {
                return gemm::gemm_bf16(dev, cur_b, dn, q, dnn, param, false, true, alpha, beta);
            }
            gemm::matmul_bf16(dev, cur_b, dn, q, dnn, &gp, false, true, false)?;
            upd = gp.clone();
        }
    } else {
        if let Some(ql) = basis_left {
            if fused && basis_right.is_none() {
                return gemm_f32(dev, ql, dmm, &upd, dn, param, false, false, alpha, beta);
            }
            gemm_f32(dev, ql, dmm, &upd, dn, &tmp, false, false, 1.0, 0.0)?;
            upd = tmp.clone();
        }
        if let Some(qr) = basis_right {
            if fused {
                return gemm_f32(dev, &upd, dn, qr, dnn, param, false, true, alpha, beta);
            }
            gemm_f32(dev, &upd, dn, qr, dnn, &gp, false, true, 1.0, 0.0)?;
            upd = gp.clone();
        }
    }
    if hp.normalize_grads {
        sumsq_partials(dev, &upd, &partials, 0)?;
        let args = Args::new()
            .buf(&partials)
            .i32(SUMSQ_BLOCKS as i32)
            .i64(mn as i64)
            .buf(&divisor);
        dev.launch("rms_finalize", (1, 1, 1), (256, 1, 1), args)?;
    }
    let args = Args::new()
        .buf(param)
        .buf(&upd)
        .i64(mn as i64)
        .f32(-step as f32)
        .opt(hp.normalize_grads.then_some(&divisor))
        .i32((hp.weight_decay > 0.0) as i32)
        .f32((-lr * hp.weight_decay) as f32);
    dev.launch("soap_apply", (dev.grid_for(mn), 1, 1), (256, 1, 1), args)
}

/// Scratch elements (f32) of [`project`] for an `[m, n]` operand with the given bases (see
/// [`schedule::reserve::project_scratch_len`]).
pub fn project_scratch_len(
    m: usize,
    n: usize,
    left: bool,
    right: bool,
    proj: SoapProjections,
) -> usize {
    schedule::reserve::project_scratch_len(m, n, left, right, proj == SoapProjections::Bf16)
}

/// Plan op `Project` (a composed SOAP step's eigenbasis projection, `optim::project` /
/// `optim::project_back`): `out = Q_Lᵀ x Q_R` (`back = false`) or `out = Q_L x Q_Rᵀ` (`back`),
/// `x`, `out` f32 `[m, n]`, `Q_L` f32 `[m, m]`, `Q_R` f32 `[n, n]`, a missing basis the
/// identity (none: `out = x`). The GEMMs run as [`soap_update`]'s do under `proj`: plain fp32
/// (with the device's [`crate::GemmMath`]), or `x` and the bases in bf16 with fp32
/// accumulation, the product that feeds the second GEMM written as bf16 by the first and `out`
/// in fp32. `cached`: bf16 copies of `[Q_L, Q_R]` the caller keeps while the bases do not
/// change (a `None` is cast here). `scratch` f32 of at least [`project_scratch_len`]. Compute
/// stream.
///
/// # Errors
/// Operands of the wrong size or dtype, a short scratch ([`CudaError::Shape`]), cuBLAS and
/// launch failures.
#[allow(clippy::too_many_arguments)]
pub fn project(
    dev: &Device,
    x: &Buf,
    out: &Buf,
    basis_left: Option<&Buf>,
    basis_right: Option<&Buf>,
    m: usize,
    n: usize,
    back: bool,
    scratch: &Buf,
    proj: SoapProjections,
    cached: [Option<&Buf>; 2],
) -> Result<()> {
    const OP: &str = "project";
    let mn = m * n;
    x.expect(OP, "x", Elem::F32, mn)?;
    out.expect(OP, "out", Elem::F32, mn)?;
    if let Some(q) = basis_left {
        q.expect(OP, "basis_left", Elem::F32, m * m)?;
    }
    if let Some(q) = basis_right {
        q.expect(OP, "basis_right", Elem::F32, n * n)?;
    }
    let (left, right) = (basis_left.is_some(), basis_right.is_some());
    let need = project_scratch_len(m, n, left, right, proj);
    if scratch.len() < need || (need > 0 && scratch.elem() != Elem::F32) {
        return Err(CudaError::Shape {
            op: OP,
            operand: "scratch",
            expected: need,
            got: scratch.len(),
        });
    }
    if mn == 0 {
        return Ok(());
    }
    if !left && !right {
        return dev.copy(out, x, crate::StreamKind::Compute);
    }
    let (dm, dmm, dnn) = (Dims::new(m, n), Dims::new(m, m), Dims::new(n, n));
    // Forward: Q_Lᵀ (· x) then (·) Q_R; back: Q_L (· x) then (·) Q_Rᵀ.
    let (ta, tb) = (!back, back);
    if proj == SoapProjections::Bf16 {
        let mut off = if left && right {
            mn.next_multiple_of(64)
        } else {
            0
        };
        let mut carve = |len: usize| -> Result<Buf> {
            let b = scratch
                .slice(off, bf16_slots(len))?
                .reinterpret(Elem::BF16, len)?;
            off += bf16_slots(len);
            Ok(b)
        };
        let mut bf16_basis = |q: Option<&Buf>, c: Option<&Buf>, d: usize| -> Result<Option<Buf>> {
            let Some(q) = q else { return Ok(None) };
            let b = carve(d * d)?;
            match c {
                Some(c) => {
                    c.expect(OP, "cached bf16 basis", Elem::BF16, d * d)?;
                    Ok(Some(c.clone()))
                }
                None => {
                    gemm::cast_f32_to_bf16(dev, q, &b)?;
                    Ok(Some(b))
                }
            }
        };
        let ql = bf16_basis(basis_left, cached[0], m)?;
        let qr = bf16_basis(basis_right, cached[1], n)?;
        let (xb, yb) = (carve(mn)?, carve(mn)?);
        gemm::cast_f32_to_bf16(dev, x, &xb)?;
        return match (&ql, &qr) {
            (Some(ql), Some(qr)) => {
                gemm::matmul_bf16(dev, ql, dmm, &xb, dm, &yb, ta, false, false)?;
                gemm::matmul_bf16(dev, &yb, dm, qr, dnn, out, false, tb, false)
            }
            (Some(ql), None) => gemm::matmul_bf16(dev, ql, dmm, &xb, dm, out, ta, false, false),
            (None, Some(qr)) => gemm::matmul_bf16(dev, &xb, dm, qr, dnn, out, false, tb, false),
            (None, None) => Ok(()),
        };
    }
    match (basis_left, basis_right) {
        (Some(ql), Some(qr)) => {
            let tmp = scratch.slice(0, mn)?;
            gemm_f32(dev, ql, dmm, x, dm, &tmp, ta, false, 1.0, 0.0)?;
            gemm_f32(dev, &tmp, dm, qr, dnn, out, false, tb, 1.0, 0.0)
        }
        (Some(ql), None) => gemm_f32(dev, ql, dmm, x, dm, out, ta, false, 1.0, 0.0),
        (None, Some(qr)) => gemm_f32(dev, x, dm, qr, dnn, out, false, tb, 1.0, 0.0),
        (None, None) => Ok(()),
    }
}

/// Scratch elements (f32) of [`soap_factor_update`] for an `[m, n]` gradient: the bf16 copy of
/// the gradient under [`SoapProjections::Bf16`] when there is a factor, else 0.
pub fn soap_factor_update_scratch_len(
    m: usize,
    n: usize,
    left: bool,
    right: bool,
    proj: SoapProjections,
) -> usize {
    if proj == SoapProjections::Bf16 && (left || right) {
        bf16_slots(m * n)
    } else {
        0
    }
}

/// Plan op `SoapFactorUpdate`: `L ← β·L + (1−β)·G Gᵀ` `[m, m]`, `R ← β·R + (1−β)·Gᵀ G`
/// `[n, n]` (cuBLAS GEMMs with α = 1−β, β = shampoo_beta); a `None` factor is skipped.
/// Under [`SoapProjections::Bf16`] `G` is cast to bf16 (in `scratch`, at least
/// [`soap_factor_update_scratch_len`] f32 elements) and the GEMMs are native bf16 with fp32
/// accumulation into the fp32 factors; otherwise fp32-storage GEMMs with the device's
/// [`crate::GemmMath`].
///
/// # Errors
/// A scratch shorter than [`soap_factor_update_scratch_len`] ([`CudaError::Shape`]), operands
/// of the wrong size, cuBLAS and launch failures.
#[allow(clippy::too_many_arguments)]
pub fn soap_factor_update(
    dev: &Device,
    grad: &Buf,
    factor_left: Option<&Buf>,
    factor_right: Option<&Buf>,
    m: usize,
    n: usize,
    shampoo_beta: f64,
    scratch: &Buf,
    proj: SoapProjections,
) -> Result<()> {
    let g = Dims::new(m, n);
    let (alpha, beta) = ((1.0 - shampoo_beta) as f32, shampoo_beta as f32);
    let need =
        soap_factor_update_scratch_len(m, n, factor_left.is_some(), factor_right.is_some(), proj);
    if need > 0 {
        if scratch.len() < need || scratch.elem() != Elem::F32 {
            return Err(CudaError::Shape {
                op: "soap_factor_update",
                operand: "scratch",
                expected: need,
                got: scratch.len(),
            });
        }
        let gb = scratch
            .slice(0, bf16_slots(m * n))?
            .reinterpret(Elem::BF16, m * n)?;
        gemm::cast_f32_to_bf16(dev, grad, &gb)?;
        if let Some(l) = factor_left {
            gemm::gemm_bf16(dev, &gb, g, &gb, g, l, false, true, alpha, beta)?;
        }
        if let Some(r) = factor_right {
            gemm::gemm_bf16(dev, &gb, g, &gb, g, r, true, false, alpha, beta)?;
        }
        return Ok(());
    }
    if let Some(l) = factor_left {
        gemm_f32(dev, grad, g, grad, g, l, false, true, alpha, beta)?;
    }
    if let Some(r) = factor_right {
        gemm_f32(dev, grad, g, grad, g, r, true, false, alpha, beta)?;
    }
    Ok(())
}

/// An element-wise update rule ([`optim::update::UpdateRule`]) compiled for this device: the
/// CUDA C that [`optim::update::cuda_kernel`] generates from the rule's expression.
pub struct UpdateKernel {
    kernel: crate::RuntimeKernel,
    tensors: usize,
    scalars: usize,
    /// The rule reads a gradient `g`: the kernel takes the nullable `g_scale`.
    scaled: bool,
}

impl UpdateKernel {
    /// Generates and compiles `rule`'s kernel (`asteria_update_<name>`).
    ///
    /// # Errors
    /// A rule the generator refuses ([`optim::update::RuleError`]); NVRTC or driver errors.
    pub fn new(dev: &Device, rule: &optim::update::UpdateRule) -> Result<UpdateKernel> {
        let src = optim::update::cuda_kernel(rule).map_err(|e| CudaError::Invalid {
            op: "update_rule",
            what: e.to_string(),
        })?;
        let kernel = dev.compile_runtime(&format!("asteria_update_{}", rule.name), &src)?;
        Ok(UpdateKernel {
            kernel,
            tensors: rule.tensors.len(),
            scalars: rule.scalars.len(),
            scaled: rule.tensors.iter().any(|t| t == "g"),
        })
    }

    /// Runs the update in place over `tensors` (f32, one length, in the rule's order) with
    /// this step's `scalars`; `g_scale` (f32 `[1]`, a rule over a gradient `g` only): the
    /// update reads `g · g_scale`.
    ///
    /// # Errors
    /// Counts, lengths or element types that do not match the rule; a `g_scale` for a rule
    /// without `g`; launch failures.
    pub fn run(
        &self,
        dev: &Device,
        tensors: &[&Buf],
        scalars: &[f32],
        g_scale: Option<&Buf>,
    ) -> Result<()> {
        const OP: &str = "update_rule";
        if tensors.len() != self.tensors || scalars.len() != self.scalars {
            return Err(CudaError::Invalid {
                op: OP,
                what: format!(
                    "{} tensors and {} scalars for a rule of {} and {}",
                    tensors.len(),
                    scalars.len(),
                    self.tensors,
                    self.scalars
                ),
            });
        }
        let n = tensors.first().map_or(0, |b| b.len());
        let mut args = Args::new();
        for (i, b) in tensors.iter().enumerate() {
            const NAMES: [&str; 5] = ["tensor 0", "tensor 1", "tensor 2", "tensor 3", "tensor"];
            b.expect(OP, NAMES[i.min(4)], Elem::F32, n)?;
            args = args.buf(b);
        }
        args = args.i64(n as i64);
        for &x in scalars {
            args = args.f32(x);
        }
        match (self.scaled, g_scale) {
            (true, s) => {
                if let Some(b) = s {
                    b.expect(OP, "g_scale", Elem::F32, 1)?;
                }
                args = args.opt(s);
            }
            (false, None) => {}
            (false, Some(_)) => {
                return Err(CudaError::Invalid {
                    op: OP,
                    what: "a g_scale for a rule that reads no gradient `g`".into(),
                })
            }
        }
        dev.launch_runtime(&self.kernel, (dev.grid_for(n), 1, 1), (256, 1, 1), args)
    }
}
