//! The Shampoo parameter update (plan op `ShampooUpdate`; Gupta et al. 2018 with Distributed
//! Shampoo's semantics, facebookresearch/optimizers, specified in `docs/shampoo.md`): cuBLAS
//! fp32 GEMMs on sub-matrices of the parameter's merged view around the kernels of family
//! `shampoo` (`cuda/kernels/shampoo.cu`). Semantics: `optim::shampoo_update`.
//!
//! The parameter is viewed row-major as its merged shape's matrix `[vm, vn]` and cut into the
//! blocks of `schedule::blocking::blocks(shape, B)` (`B = max_preconditioner_dim`): the regular
//! tiling by `B × B` tiles, a merged vector being the `[1, vn]` view with one-sided blocks. A
//! block is addressed in place: its gradient, moment and parameter are the sub-matrix at
//! element `r0·vn + c0` with row stride `vn` (cuBLAS `lda = vn`), never copied. One step, in
//! stream order on the compute stream (`a`, `c` from the host in f64, see
//! [`shampoo_update`]):
//!
//! ```text
//! per block: F_L ← a·F_L + c·G Gᵀ,  F_R ← a·F_R + c·Gᵀ G     GEMMs (α = c, β = a)
//!            F   ← a·F + c·gᵀ g   (vector block, k = 1)
//! M ← β₁M + (1 − β₁)G,  Ḡ = M/(1 − β₁ᵗ)                      shampoo_moments (whole param)
//! V ← γ₂V + (1 − γ₂)G², Pg = Ḡ/(√(V/(1 − γ₂ᵗ)) + γ_ε)       (grafting)
//! per block: X = root_L Ḡ_b;  P_b = X root_R                  GEMMs (vector: P_b = ḡ rootᵀ)
//! grafting:  s_b = ‖Pg_b‖/(‖P_b‖ + 1e-16)                    shampoo_graft_partials / _scale
//!            W ← W − lr·(s_b·P + wd·W)                        shampoo_apply
//! without:   W ← (1 − lr·wd)·W − lr·P_b                       the last GEMM (α = −lr, β)
//! ```
//!
//! At `t = 1` with grafting the step is `Pg` itself (no root GEMMs, no scale). Without a first
//! moment (`β₁ = 0`) `Ḡ` is the gradient buffer itself. The grafting norms are f64 partial
//! sums per block in a fixed order (no float atomics): the update is deterministic.
use super::int;
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::gemm::{gemm_f32_sub, Dims, SubMatrix};
use crate::kernels::Args;
use crate::memory::{Buf, Elem};
use schedule::blocking::{blocks, Block};
use schedule::ShampooHyper;

/// CUDA blocks per Shampoo block in the grafting norm reduction
/// (`schedule::reserve::SHAMPOO_GRAFT_CHUNKS`).
pub const GRAFT_CHUNKS: usize = schedule::reserve::SHAMPOO_GRAFT_CHUNKS;

/// Scratch elements (f32) of [`shampoo_update`] for a parameter of `shape` under block size
/// `b` (`max_preconditioner_dim`), with a first moment (`moment`: β₁ ≠ 0) and / or Adam
/// grafting (`grafting`); see `schedule::reserve::shampoo_update_scratch_len`, which the
/// compiler's memory estimate uses.
pub fn shampoo_update_scratch_len(
    shape: &[usize],
    b: usize,
    moment: bool,
    grafting: bool,
) -> usize {
    schedule::reserve::shampoo_update_scratch_len(shape, b, moment, grafting)
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

/// A block of a row-major `[.., vn]` buffer as a [`SubMatrix`].
fn sub<'a>(buf: &'a Buf, vn: usize, b: &Block) -> SubMatrix<'a> {
    SubMatrix {
        buf,
        offset: b.r0 * vn + b.c0,
        dims: Dims::new(b.rows, b.cols),
        ld: vn.max(1),
    }
}

/// The factor update's scalars `(a, c)` of `F ← a·F + c·C` at 1-based step `t`
/// (`optim::shampoo_update`'s, in f64): `(1, 1)` for β₂ ≥ 1 (a running sum); with bias
/// correction `a = β₂(1 − β₂ᵗ⁻¹)/(1 − β₂ᵗ)`, `c = (1 − β₂)/(1 − β₂ᵗ)` (the factor stored
/// bias-corrected); without it `(β₂, 1 − β₂)`.
pub fn factor_scalars(hp: &ShampooHyper, t: u64) -> (f64, f64) {
    let ti = t.min(i32::MAX as u64) as i32;
    if hp.beta2 >= 1.0 {
        (1.0, 1.0)
    } else if hp.use_bias_correction {
        let bc = |k: i32| 1.0 - hp.beta2.powi(k);
        (hp.beta2 * bc(ti - 1) / bc(ti), (1.0 - hp.beta2) / bc(ti))
    } else {
        (hp.beta2, 1.0 - hp.beta2)
    }
}

/// Plan op `ShampooUpdate` on one parameter of `shape` (all its blocks) at 1-based engine step
/// `t` with the scheduled learning rate `lr` (`hp.lr` is not read), on the compute stream (see
/// the module docs for the order):
///
/// - every block's factors accumulate its gradient `F ← a·F + c·C` ([`factor_scalars`]; `C` is
///   `G Gᵀ` and `Gᵀ G` of a matrix block, `gᵀ g` of a vector block);
/// - `M ← β₁M + (1 − β₁)G` and `Ḡ = M/(1 − β₁ᵗ)` (without bias correction `Ḡ = M`; with
///   `β₁ = 0`, `Ḡ = G` and `exp_avg` is not touched);
/// - with grafting `V ← γ₂V + (1 − γ₂)G²` and `Pg = Ḡ/(√(V/(1 − γ₂ᵗ)) + γ_ε)`;
/// - each block's step `P = root_L Ḡ root_R` (`root Ḡ` of a vector block, the roots as they
///   are: identity before the first refresh), with grafting scaled by `‖Pg‖/(‖P‖ + 1e-16)`
///   of the block, and `P = Pg` at `t = 1` with grafting;
/// - `W ← W − lr·(P + wd·W)`.
///
/// Operands, all f32 row-major in the merged view's order: `param`, `grad`, `exp_avg` and
/// `graft_sq` (present iff `hp.grafting`) of the parameter's element count; `factors[k]` and
/// `roots[k]` `[d, d]` for the k-th side of the blocks in block order (rows then columns of a
/// matrix block, one side for a vector block); `scratch` of at least
/// [`shampoo_update_scratch_len`] f32 elements, overlapping no operand. The GEMMs run with
/// the device's [`crate::GemmMath`] (fp32, or TF32 under `precision = bf16`). An empty
/// parameter is left as it is.
///
/// # Errors
/// Operands of the wrong length or dtype, a wrong number of factors or roots, a short scratch
/// ([`CudaError::Shape`], [`CudaError::Operand`]), sizes beyond the kernels' `int` range
/// ([`CudaError::Invalid`]), cuBLAS and launch failures. Shapes are checked before anything
/// is enqueued.
#[allow(clippy::too_many_arguments)]
pub fn shampoo_update(
    dev: &Device,
    t: u64,
    lr: f64,
    hp: &ShampooHyper,
    param: &Buf,
    grad: &Buf,
    exp_avg: &Buf,
    graft_sq: Option<&Buf>,
    shape: &[usize],
    factors: &[&Buf],
    roots: &[&Buf],
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "shampoo_update";
    let bsz = usize::try_from(hp.max_preconditioner_dim)
        .unwrap_or(usize::MAX)
        .max(1);
    let ((vm, vn), blks) = blocks(shape, bsz);
    let numel = vm * vn;
    for (name, b) in [("param", param), ("grad", grad), ("exp_avg", exp_avg)] {
        b.expect(OP, name, Elem::F32, numel)?;
    }
    match (graft_sq, hp.grafting) {
        (Some(v), true) => v.expect(OP, "graft_sq", Elem::F32, numel)?,
        (None, false) => {}
        (v, _) => {
            return Err(CudaError::Shape {
                op: OP,
                operand: "graft_sq",
                expected: if hp.grafting { numel } else { 0 },
                got: v.map_or(0, Buf::len),
            })
        }
    }
    let sides: Vec<usize> = blks.iter().flat_map(Block::sides).collect();
    for (operand, list) in [("factors", factors), ("roots", roots)] {
        if list.len() != sides.len() {
            return Err(CudaError::Shape {
                op: OP,
                operand,
                expected: sides.len(),
                got: list.len(),
            });
        }
    }
    for ((f, r), d) in factors.iter().zip(roots).zip(&sides) {
        f.expect(OP, "factor", Elem::F32, d * d)?;
        r.expect(OP, "root", Elem::F32, d * d)?;
    }
    let moment = hp.beta1 != 0.0;
    let need = shampoo_update_scratch_len(shape, bsz, moment, hp.grafting);
    super::check_scratch(OP, scratch, need)?;
    let (vmi, vni) = (int(OP, "rows", vm)?, int(OP, "cols", vn)?);
    let nbc = vn.div_ceil(bsz);
    let (bszi, nbci) = (
        int(OP, "block size", bsz.min(vm.max(vn)))?,
        int(OP, "blocks", nbc)?,
    );
    let nblocks = int(OP, "blocks", blks.len())?;
    if numel == 0 {
        return Ok(());
    }
    // The tiling the kernels assume (block index br·nbc + bc) is `blocks`' order.
    debug_assert!(blks
        .iter()
        .enumerate()
        .all(|(i, b)| b.r0 == (i / nbc) * bsz && b.c0 == (i % nbc) * bsz));

    let mut carve = Carve { scratch, off: 0 };
    let gbar = if moment {
        Some(carve.take(numel)?)
    } else {
        None
    };
    let (pg, p, partials, scale) = if hp.grafting {
        let pg = carve.take(numel)?;
        let p = carve.take(numel)?;
        let partials = carve
            .take(4 * blks.len() * GRAFT_CHUNKS)?
            .reinterpret(Elem::F64, 2 * blks.len() * GRAFT_CHUNKS)?;
        let scale = carve
            .take(2 * blks.len())?
            .reinterpret(Elem::F64, blks.len())?;
        (Some(pg), Some(p), Some(partials), Some(scale))
    } else {
        (None, None, None, None)
    };
    let x = match blks
        .iter()
        .filter(|b| !b.vector)
        .map(|b| b.rows * b.cols)
        .max()
    {
        Some(len) => Some(carve.take(len)?),
        None => None,
    };

    // Factors from the raw gradient: F ← a·F + c·C (β = a, α = c of the GEMM).
    accumulate_factors(dev, factor_scalars(hp, t), vn, &blks, grad, factors)?;

    // Moments over the whole parameter.
    let ti = t.min(i32::MAX as u64) as i32;
    let bc1 = if hp.use_bias_correction && moment {
        1.0 - hp.beta1.powi(ti)
    } else {
        1.0
    };
    let gbc = 1.0 - hp.grafting_beta2.powi(ti);
    if moment || hp.grafting {
        let args = Args::new()
            .buf(grad)
            .opt(gbar.as_ref().map(|_| exp_avg))
            .opt(gbar.as_ref())
            .opt(pg.as_ref().and(graft_sq))
            .opt(pg.as_ref())
            .i64(numel as i64)
            .f32(hp.beta1 as f32)
            .f32((1.0 - hp.beta1) as f32)
            .f64(bc1)
            .f32(hp.grafting_beta2 as f32)
            .f32((1.0 - hp.grafting_beta2) as f32)
            .f64(gbc)
            .f64(hp.grafting_epsilon);
        dev.launch(
            "shampoo_moments",
            (dev.grid_for(numel), 1, 1),
            (256, 1, 1),
            args,
        )?;
    }
    let gbar = gbar.as_ref().unwrap_or(grad);
    let elementwise = (dev.grid_for(numel), 1, 1);
    let apply = |p: &Buf, scale: Option<&Buf>| {
        let args = Args::new()
            .buf(param)
            .buf(p)
            .opt(scale)
            .i64(numel as i64)
            .i32(vni)
            .i32(bszi)
            .i32(nbci)
            .f32(lr as f32)
            .f32(hp.weight_decay as f32);
        dev.launch("shampoo_apply", elementwise, (256, 1, 1), args)
    };
    if let (true, Some(pg)) = (t == 1, &pg) {
        // The Adam step alone: no root exists yet.
        return apply(pg, None);
    }

    // P = root_L Ḡ root_R per block: into `p` with grafting, else straight into the parameter
    // (W ← (1 − lr·wd)·W − lr·P as the last GEMM's α, β).
    let decay = 1.0 - lr * hp.weight_decay;
    let (target, alpha, beta) = match &p {
        Some(p) => (p, 1.0, 0.0),
        None => (param, (-lr) as f32, decay as f32),
    };
    let mut k = 0;
    for b in &blks {
        let (gb, out) = (sub(gbar, vn, b), sub(target, vn, b));
        if b.vector {
            let r = SubMatrix::whole(roots[k], Dims::new(b.cols, b.cols));
            gemm_f32_sub(dev, gb, r, out, false, true, alpha, beta)?;
        } else {
            let x = x.as_ref().ok_or(CudaError::Invalid {
                op: OP,
                what: "internal: a matrix block without a work matrix".into(),
            })?;
            let xs = SubMatrix::whole(x, Dims::new(b.rows, b.cols));
            let rl = SubMatrix::whole(roots[k], Dims::new(b.rows, b.rows));
            let rr = SubMatrix::whole(roots[k + 1], Dims::new(b.cols, b.cols));
            gemm_f32_sub(dev, rl, gb, xs, false, false, 1.0, 0.0)?;
            gemm_f32_sub(dev, xs, rr, out, false, false, alpha, beta)?;
        }
        k += b.sides().len();
    }
    let (Some(p), Some(pg), Some(partials), Some(scale)) = (&p, &pg, &partials, &scale) else {
        return Ok(());
    };

    // Grafting: per-block norms (f64 partials, fixed order), the scales, the update.
    let args = Args::new()
        .buf(p)
        .buf(pg)
        .buf(partials)
        .i32(vmi)
        .i32(vni)
        .i32(bszi)
        .i32(nbci)
        .i32(nblocks);
    let grid_y = blks.len().min(65_535) as u32;
    dev.launch(
        "shampoo_graft_partials",
        (GRAFT_CHUNKS as u32, grid_y, 1),
        (256, 1, 1),
        args,
    )?;
    let args = Args::new()
        .buf(partials)
        .buf(scale)
        .i32(nblocks)
        .i32(GRAFT_CHUNKS as i32);
    dev.launch(
        "shampoo_graft_scale",
        (dev.grid_for(blks.len()), 1, 1),
        (256, 1, 1),
        args,
    )?;
    apply(p, Some(scale))
}

/// `F_k ← a·F_k + c·C_k` for every side of every block (`C` = `G Gᵀ`, `Gᵀ G` of a matrix
/// block, `gᵀ g` of a vector block; one GEMM each with α = c, β = a), `grad` row-major
/// `[.., vn]`. Shapes are the caller's to check.
fn accumulate_factors(
    dev: &Device,
    (fa, fc): (f64, f64),
    vn: usize,
    blks: &[Block],
    grad: &Buf,
    factors: &[&Buf],
) -> Result<()> {
    let (fa, fc) = (fa as f32, fc as f32);
    let mut k = 0;
    for b in blks {
        let g = sub(grad, vn, b);
        if b.vector {
            let f = SubMatrix::whole(factors[k], Dims::new(b.cols, b.cols));
            gemm_f32_sub(dev, g, g, f, true, false, fc, fa)?;
        } else {
            let fl = SubMatrix::whole(factors[k], Dims::new(b.rows, b.rows));
            gemm_f32_sub(dev, g, g, fl, false, true, fc, fa)?;
            let fr = SubMatrix::whole(factors[k + 1], Dims::new(b.cols, b.cols));
            gemm_f32_sub(dev, g, g, fr, true, false, fc, fa)?;
        }
        k += b.sides().len();
    }
    Ok(())
}

/// The blocks of a parameter of `shape` under `max_preconditioner_dim` `b` (at least 1), with
/// its merged view's `[vm, vn]`, after checking `bufs` (`(name, buffer)`, each of the view's
/// element count) and `mats` (`[d, d]` per side of the blocks, in block order), if any.
fn checked_blocks(
    op: &'static str,
    shape: &[usize],
    b: u64,
    bufs: &[(&'static str, &Buf)],
    mats: Option<(&'static str, &[&Buf])>,
) -> Result<((usize, usize), usize, Vec<Block>)> {
    let bsz = usize::try_from(b).unwrap_or(usize::MAX).max(1);
    let ((vm, vn), blks) = blocks(shape, bsz);
    for (name, buf) in bufs {
        buf.expect(op, name, Elem::F32, vm * vn)?;
    }
    let Some(mats) = mats else {
        return Ok(((vm, vn), bsz, blks));
    };
    let sides: Vec<usize> = blks.iter().flat_map(Block::sides).collect();
    if mats.1.len() != sides.len() {
        return Err(CudaError::Shape {
            op,
            operand: mats.0,
            expected: sides.len(),
            got: mats.1.len(),
        });
    }
    for (m, d) in mats.1.iter().zip(&sides) {
        m.expect(op, mats.0, Elem::F32, d * d)?;
    }
    Ok(((vm, vn), bsz, blks))
}

/// Plan op `ShampooFactorUpdate` (the first op of Shampoo's composed step): every block's
/// factors `F ← a·F + c·C` at 1-based step `t` with `(a, c)` =
/// `optim::factor_coefficients(beta2, use_bias_correction, t)` (`C` as in
/// [`shampoo_update`]). `grad` f32 of `shape`'s element count, `factors` `[d, d]` f32 per side
/// in block order; fp32 GEMMs (the device's [`crate::GemmMath`]). Semantics:
/// `optim::shampoo_factor_update`.
///
/// # Errors
/// Operands of the wrong length, dtype or count ([`CudaError::Shape`],
/// [`CudaError::Operand`]); cuBLAS failures.
pub fn shampoo_factor_update(
    dev: &Device,
    t: u64,
    (beta2, use_bias_correction): (f64, bool),
    (shape, b): (&[usize], u64),
    grad: &Buf,
    factors: &[&Buf],
) -> Result<()> {
    const OP: &str = "shampoo_factor_update";
    let ((_, vn), _, blks) =
        checked_blocks(OP, shape, b, &[("grad", grad)], Some(("factor", factors)))?;
    let coefficients = optim::factor_coefficients(beta2, use_bias_correction, t);
    accumulate_factors(dev, coefficients, vn, &blks, grad, factors)
}

/// Scratch elements (f32) of [`shampoo_precondition`]: the largest matrix block's work matrix
/// (`schedule::reserve::shampoo_precondition_scratch_len`, which the compiler plans with).
pub fn shampoo_precondition_scratch_len(shape: &[usize], b: u64) -> usize {
    schedule::reserve::shampoo_precondition_scratch_len(shape, b)
}

/// Plan op `ShampooPrecondition`: per block of `x` (f32 row-major in the merged view of
/// `shape`), `out_b = R_1ᵀ x_b R_2` for a matrix block (two GEMMs through `scratch`) and
/// `out_b = x_b R_1` for a vector block, with `roots` `[d, d]` f32 per side in block order.
/// Semantics: `optim::shampoo_precondition`. `scratch` at least
/// [`shampoo_precondition_scratch_len`] f32 elements, overlapping no operand.
///
/// # Errors
/// As [`shampoo_factor_update`], and a short scratch ([`CudaError::Shape`]).
pub fn shampoo_precondition(
    dev: &Device,
    (shape, b): (&[usize], u64),
    x: &Buf,
    out: &Buf,
    roots: &[&Buf],
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "shampoo_precondition";
    let ((_, vn), _, blks) = checked_blocks(
        OP,
        shape,
        b,
        &[("x", x), ("out", out)],
        Some(("root", roots)),
    )?;
    let need = shampoo_precondition_scratch_len(shape, b);
    super::check_scratch(OP, scratch, need)?;
    let mut k = 0;
    for bl in &blks {
        let (xb, ob) = (sub(x, vn, bl), sub(out, vn, bl));
        if bl.vector {
            let r = SubMatrix::whole(roots[k], Dims::new(bl.cols, bl.cols));
            gemm_f32_sub(dev, xb, r, ob, false, false, 1.0, 0.0)?;
        } else {
            let w = SubMatrix::whole(scratch, Dims::new(bl.rows, bl.cols));
            let rl = SubMatrix::whole(roots[k], Dims::new(bl.rows, bl.rows));
            let rr = SubMatrix::whole(roots[k + 1], Dims::new(bl.cols, bl.cols));
            gemm_f32_sub(dev, rl, xb, w, true, false, 1.0, 0.0)?;
            gemm_f32_sub(dev, w, rr, ob, false, false, 1.0, 0.0)?;
        }
        k += bl.sides().len();
    }
    Ok(())
}

/// Scratch elements (f32) of [`graft`]: the per-block f64 norm partials and scales
/// (`schedule::reserve::graft_scratch_len`).
pub fn graft_scratch_len(shape: &[usize], b: u64) -> usize {
    schedule::reserve::graft_scratch_len(shape, b)
}

/// Plan op `Graft` (Adam grafting per block): `out_b = x_b · ‖graft_b‖ / (‖x_b‖ + 1e-16)` with
/// the Frobenius norms and the scale in f64 (partial sums per block in a fixed order: the
/// result is deterministic), each element rounded once; `out = graft` at step `t = 1`. All
/// f32 row-major in the merged view of `shape`, blocked by `b`; `scratch` at least
/// [`graft_scratch_len`] f32 elements. Semantics: `optim::graft`.
///
/// # Errors
/// As [`shampoo_precondition`].
#[allow(clippy::too_many_arguments)]
pub fn graft(
    dev: &Device,
    t: u64,
    (shape, b): (&[usize], u64),
    x: &Buf,
    graft: &Buf,
    out: &Buf,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "graft";
    let bufs = [("x", x), ("graft", graft), ("out", out)];
    let ((vm, vn), bsz, blks) = checked_blocks(OP, shape, b, &bufs, None)?;
    let numel = vm * vn;
    if numel == 0 {
        return Ok(());
    }
    if t <= 1 {
        return dev.copy(out, graft, crate::StreamKind::Compute);
    }
    let need = graft_scratch_len(shape, b);
    super::check_scratch(OP, scratch, need)?;
    let n = blks.len();
    let mut carve = Carve { scratch, off: 0 };
    let partials = carve
        .take(4 * n * GRAFT_CHUNKS)?
        .reinterpret(Elem::F64, 2 * n * GRAFT_CHUNKS)?;
    let scale = carve.take(2 * n)?.reinterpret(Elem::F64, n)?;
    let (vmi, vni) = (int(OP, "rows", vm)?, int(OP, "cols", vn)?);
    let bszi = int(OP, "block size", bsz.min(vm.max(vn)))?;
    let nbci = int(OP, "blocks", vn.div_ceil(bsz))?;
    let nblocks = int(OP, "blocks", n)?;
    let args = Args::new()
        .buf(x)
        .buf(graft)
        .buf(&partials)
        .i32(vmi)
        .i32(vni)
        .i32(bszi)
        .i32(nbci)
        .i32(nblocks);
    let grid_y = n.min(65_535) as u32;
    dev.launch(
        "shampoo_graft_partials",
        (GRAFT_CHUNKS as u32, grid_y, 1),
        (256, 1, 1),
        args,
    )?;
    let args = Args::new()
        .buf(&partials)
        .buf(&scale)
        .i32(nblocks)
        .i32(GRAFT_CHUNKS as i32);
    dev.launch(
        "shampoo_graft_scale",
        (dev.grid_for(n), 1, 1),
        (256, 1, 1),
        args,
    )?;
    let args = Args::new()
        .buf(x)
        .buf(&scale)
        .buf(out)
        .i64(numel as i64)
        .i32(vni)
        .i32(bszi)
        .i32(nbci);
    dev.launch(
        "shampoo_graft_apply",
        (dev.grid_for(numel), 1, 1),
        (256, 1, 1),
        args,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The regions [`shampoo_update`] carves, in its order (each start rounded up to 64
    /// elements), fit the scratch length the compiler plans with.
    #[test]
    fn scratch_len_covers_the_carved_regions() {
        let shapes: [&[usize]; 6] = [&[37, 23], &[100], &[1, 50], &[3, 4, 5], &[64, 64], &[7]];
        for shape in shapes {
            for b in [1usize, 4, 16, 1024] {
                for (moment, grafting) in
                    [(false, false), (true, false), (false, true), (true, true)]
                {
                    let ((vm, vn), blks) = blocks(shape, b);
                    let numel = vm * vn;
                    let mut regions = Vec::new();
                    if moment {
                        regions.push(numel);
                    }
                    if grafting {
                        regions.extend([
                            numel,
                            numel,
                            4 * blks.len() * GRAFT_CHUNKS,
                            2 * blks.len(),
                        ]);
                    }
                    if let Some(x) = blks
                        .iter()
                        .filter(|b| !b.vector)
                        .map(|b| b.rows * b.cols)
                        .max()
                    {
                        regions.push(x);
                    }
                    let end = regions
                        .iter()
                        .fold(0, |off: usize, &len| off.next_multiple_of(64) + len);
                    let len = shampoo_update_scratch_len(shape, b, moment, grafting);
                    assert!(end <= len, "{shape:?} b={b}: {end} > {len}");
                }
            }
        }
    }

    /// The kernels' block index `(i / B)·nbc + j / B` is `blocks`' order.
    #[test]
    fn blocks_are_the_regular_tiling() {
        let shapes: [&[usize]; 4] = [&[37, 23], &[100], &[1, 50], &[2048, 3]];
        for shape in shapes {
            for b in [1usize, 5, 16, 1024] {
                let ((_, vn), blks) = blocks(shape, b);
                let nbc = vn.div_ceil(b);
                for (i, blk) in blks.iter().enumerate() {
                    assert_eq!(
                        (blk.r0, blk.c0),
                        ((i / nbc) * b, (i % nbc) * b),
                        "{shape:?} {b}"
                    );
                }
            }
        }
    }
}
