//! AdamW on the host: the kernel generated from AdamW's update rule, and the rustc-compiled
//! reference loop it is measured and checked against.
//!
//! The update is the one of `optim::adamw_update` (`optim/src/adamw.rs`) at `f32`:
//!
//! ```text
//! per step (f64, rounded once to f32: optim::update::adamw_scalars):
//!   decay     = f32(1 − lr·wd)                 (applied only if wd ≠ 0)
//!   step_size = f32(lr / (1 − β₁ᵗ))
//!   bc2_sqrt  = f32(√(1 − β₂ᵗ))
//! per element (f32, in this order):
//!   p ← p·decay
//!   m ← m + w₁·(g − m)            if w₁ = f32(1 − β₁) < 0.5   (torch.lerp)
//!   m ← g − (g − m)·(1 − w₁)      otherwise
//!   v ← v·β₂ + (w₂·g)·g           w₂ = f32(1 − β₂)
//!   p ← p − step_size·(m / (√v / bc2_sqrt + ε))
//! ```
//!
//! [`AdamWKernel`] is [`RuleKernel`] of `optim::update::adamw_rule` (simplified with egg): the
//! rule the CUDA engine compiles through NVRTC, so AdamW is written once for both engines.
//! It replaced a hand-written Cranelift emitter of the same instruction sequence after the two
//! measured the same throughput (BENCHMARKS.md, "Host AdamW kernel").
use crate::{KernelError, Operand, RuleKernel};
use rayon::prelude::*;

/// Elements per parallel chunk (256 KiB per array; a multiple of 4, so every chunk but the
/// last runs entirely in the vector loop).
pub const CHUNK_ELEMENTS: usize = 1 << 16;

/// Slices shorter than this are updated on the calling thread; longer ones are split into
/// [`CHUNK_ELEMENTS`] chunks on the current rayon pool (when it has more than one thread).
pub const PARALLEL_MIN_ELEMENTS: usize = 1 << 18;

/// The plan constants an [`AdamWKernel`] is specialised to: the fields of
/// `optim::AdamWParams` except the per-step learning rate. Plain numbers, in f64 as the
/// plan stores them; they are rounded to f32 (as the reference rounds them) when the kernel
/// is generated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConstants {
    /// β₁ of the first moment (e.g. 0.9).
    pub beta1: f64,
    /// β₂ of the second moment (e.g. 0.999).
    pub beta2: f64,
    /// ε added to the bias-corrected √v (e.g. 1e-8).
    pub eps: f64,
    /// Decoupled weight-decay coefficient (multiplied by the step's lr; 0 disables decay).
    pub weight_decay: f64,
}

/// f32 values derived from the constants, rounded exactly as the reference rounds them.
#[derive(Clone, Copy, Debug)]
struct Derived {
    /// `f32(1 − β₁)`, the `lerp` weight.
    w1: f32,
    /// `1 − w1` in f32 (the `lerp` weight ≥ 0.5 branch).
    one_minus_w1: f32,
    /// `w1 < 0.5` (which `lerp` formula).
    lerp_low: bool,
    /// `f32(β₂)`.
    beta2: f32,
    /// `f32(1 − β₂)`.
    w2: f32,
    /// `f32(ε)`.
    eps: f32,
    /// `wd ≠ 0`.
    decays: bool,
}

impl Derived {
    fn of(c: &AdamWConstants) -> Derived {
        let w1 = (1.0 - c.beta1) as f32;
        Derived {
            w1,
            one_minus_w1: 1.0f32 - w1,
            lerp_low: w1 < 0.5f32,
            beta2: c.beta2 as f32,
            w2: (1.0 - c.beta2) as f32,
            eps: c.eps as f32,
            decays: c.weight_decay != 0.0,
        }
    }
}

/// AdamW for f32 slices on the host, specialised to one set of [`AdamWConstants`]: the
/// Cranelift kernel generated from `optim::update::adamw_rule` with the constants as
/// immediates (the `lerp` branch and whether decay applies are chosen at compile time).
///
/// `Send + Sync` (see [`RuleKernel`]): one kernel can be shared by any number of threads
/// updating disjoint slices.
#[derive(Debug)]
pub struct AdamWKernel {
    kernel: RuleKernel,
    consts: AdamWConstants,
}

impl AdamWKernel {
    /// Generates the rule for these constants, simplifies it with egg and JIT-compiles it
    /// for the host (`cranelift_native`, `opt_level = "speed"`). Takes on the order of a
    /// millisecond.
    ///
    /// Any f64 values are accepted (as the reference accepts them); the kernel then computes
    /// whatever the reference computes.
    ///
    /// # Errors
    /// [`KernelError::UnsupportedHost`] when Cranelift has no backend for the host;
    /// [`KernelError::Codegen`] or [`KernelError::Rule`] when generation fails (a bug).
    pub fn compile(c: &AdamWConstants) -> Result<AdamWKernel, KernelError> {
        let rule = optim::update::adamw_rule(c.beta1, c.beta2, c.eps, c.weight_decay);
        let (expr, _) = optim::update::simplify(&rule.expr);
        let kernel = RuleKernel::compile(&optim::update::UpdateRule { expr, ..rule })?;
        Ok(AdamWKernel { kernel, consts: *c })
    }

    /// The constants this kernel was compiled for.
    pub fn constants(&self) -> &AdamWConstants {
        &self.consts
    }

    /// One AdamW step at 1-based step `t`, in place on `param`, `exp_avg` (m) and
    /// `exp_avg_sq` (v), given `grad`; all four are f32 slices of the same length (any
    /// tensor shape, flattened). `lr` is this step's **scheduled** learning rate (plan lr ×
    /// schedule multiplier), dimensionless like the reference's. Bit-identical to
    /// `optim::adamw_update::<f32>` with the same `t`, `lr` and constants.
    ///
    /// Runs on the calling thread, or on the current rayon pool in [`CHUNK_ELEMENTS`]
    /// chunks when `grad.len() >= PARALLEL_MIN_ELEMENTS`.
    ///
    /// # Errors
    /// [`KernelError::ZeroStep`] for `t == 0`, [`KernelError::StepTooLarge`] for
    /// `t > i32::MAX`, [`KernelError::LengthMismatch`] when a slice's length differs from
    /// `grad.len()`; nothing is modified then.
    pub fn update(
        &self,
        t: u64,
        lr: f64,
        param: &mut [f32],
        grad: &[f32],
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
    ) -> Result<(), KernelError> {
        let ti = check(t, param, grad, exp_avg, exp_avg_sq)?;
        let c = &self.consts;
        let scalars = optim::update::adamw_scalars(c.beta1, c.beta2, c.weight_decay, lr, ti);
        self.kernel.run(
            &mut [
                Operand::Write(param),
                Operand::Read(grad),
                Operand::Write(exp_avg),
                Operand::Write(exp_avg_sq),
            ],
            &scalars,
        )
    }

    /// The Cranelift IR (CLIF text) of the generated function before Cranelift's optimizer.
    pub fn ir_text(&self) -> &str {
        self.kernel.ir_text()
    }

    /// The CLIF after Cranelift's mid-end, i.e. what was lowered to machine code.
    pub fn optimized_ir_text(&self) -> &str {
        self.kernel.optimized_ir_text()
    }

    /// The machine code Cranelift produced, as its VCode disassembly.
    pub fn disasm_text(&self) -> &str {
        self.kernel.disasm_text()
    }
}

/// Validates `t` and the lengths (the reference's order: param, exp_avg, exp_avg_sq
/// against grad) and returns `t` as the `powi` exponent.
fn check(
    t: u64,
    param: &[f32],
    grad: &[f32],
    exp_avg: &[f32],
    exp_avg_sq: &[f32],
) -> Result<i32, KernelError> {
    if t == 0 {
        return Err(KernelError::ZeroStep);
    }
    let ti = i32::try_from(t).map_err(|_| KernelError::StepTooLarge(t))?;
    let n = grad.len();
    for (operand, got) in [
        ("param", param.len()),
        ("exp_avg", exp_avg.len()),
        ("exp_avg_sq", exp_avg_sq.len()),
    ] {
        if got != n {
            return Err(KernelError::LengthMismatch {
                operand,
                expected: n,
                got,
            });
        }
    }
    Ok(ti)
}

/// Runs `f` on the whole slices, or on matching [`CHUNK_ELEMENTS`] chunks in parallel on
/// the current rayon pool for long slices. Shared by the kernel and the reference.
fn for_each_chunk<F>(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], f: F)
where
    F: Fn(&mut [f32], &[f32], &mut [f32], &mut [f32]) + Sync,
{
    if g.len() < PARALLEL_MIN_ELEMENTS || rayon::current_num_threads() <= 1 {
        f(p, g, m, v);
        return;
    }
    p.par_chunks_mut(CHUNK_ELEMENTS)
        .zip(g.par_chunks(CHUNK_ELEMENTS))
        .zip(m.par_chunks_mut(CHUNK_ELEMENTS))
        .zip(v.par_chunks_mut(CHUNK_ELEMENTS))
        .for_each(|(((p, g), m), v)| f(p, g, m, v));
}

/// The comparison baseline: the same AdamW step as [`AdamWKernel::update`] (same arguments,
/// same errors, same chunking and threads), as a plain scalar loop compiled by rustc (which
/// may auto-vectorise it). The math is `optim::adamw_update` at f32, with the `lerp` and
/// decay branches hoisted out of the loop.
///
/// # Errors
/// As [`AdamWKernel::update`].
pub fn adamw_reference(
    c: &AdamWConstants,
    t: u64,
    lr: f64,
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
) -> Result<(), KernelError> {
    let ti = check(t, param, grad, exp_avg, exp_avg_sq)?;
    let d = Derived::of(c);
    let [decay, step_size, bc2_sqrt] =
        optim::update::adamw_scalars(c.beta1, c.beta2, c.weight_decay, lr, ti);
    for_each_chunk(param, grad, exp_avg, exp_avg_sq, |p, g, m, v| {
        match (d.decays, d.lerp_low) {
            (true, true) => ref_loop::<true, true>(&d, decay, step_size, bc2_sqrt, p, g, m, v),
            (true, false) => ref_loop::<true, false>(&d, decay, step_size, bc2_sqrt, p, g, m, v),
            (false, true) => ref_loop::<false, true>(&d, decay, step_size, bc2_sqrt, p, g, m, v),
            (false, false) => ref_loop::<false, false>(&d, decay, step_size, bc2_sqrt, p, g, m, v),
        }
    });
    Ok(())
}

#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn ref_loop<const DECAY: bool, const LERP_LOW: bool>(
    d: &Derived,
    decay: f32,
    step_size: f32,
    bc2_sqrt: f32,
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
) {
    let (w1, one_minus_w1, beta2, w2, eps) = (d.w1, d.one_minus_w1, d.beta2, d.w2, d.eps);
    let n = grad.len();
    let (param, exp_avg, exp_avg_sq) = (&mut param[..n], &mut exp_avg[..n], &mut exp_avg_sq[..n]);
    for i in 0..n {
        let g = grad[i];
        let mut p = param[i];
        if DECAY {
            p *= decay;
        }
        let m = exp_avg[i];
        let m = if LERP_LOW {
            m + w1 * (g - m)
        } else {
            g - (g - m) * one_minus_w1
        };
        let v = exp_avg_sq[i] * beta2 + w2 * g * g;
        let denom = v.sqrt() / bc2_sqrt + eps;
        p -= step_size * (m / denom);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = p;
    }
}
