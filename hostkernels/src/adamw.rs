//! The AdamW kernel: IR generation, JIT compilation, the run-time entry point, and the
//! rustc-compiled reference loop.
//!
//! The update is the one of `optim::adamw_update` (`optim/src/adamw.rs`) at `f32`:
//!
//! ```text
//! per step (f64, rounded once to f32):
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
use crate::JitCode;

use cranelift_codegen::ir::types::{F32, F32X4, F64, I64};
use cranelift_codegen::ir::{AbiParam, InstBuilder, MemFlagsData, Type, Value};
use cranelift_codegen::isa::TargetFrontendConfig;
use cranelift_codegen::Context;
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_module::{Linkage, Module};
use rayon::prelude::*;

use crate::KernelError;

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

/// The compiled function: `(param, grad, exp_avg, exp_avg_sq, n, lr, bc1, bc2)`, pointers
/// to `n` f32 each, `bc1 = 1 − β₁ᵗ`, `bc2 = 1 − β₂ᵗ` (f64).
type KernelFn = unsafe extern "C" fn(*mut f32, *const f32, *mut f32, *mut f32, u64, f64, f64, f64);

/// A JIT-compiled AdamW step for f32 slices, specialised to one set of [`AdamWConstants`].
///
/// Owns the Cranelift `JITModule` holding the code (freed on drop). `Send + Sync`: the
/// compiled code is immutable once finalized and only read through a function pointer, and
/// the module is only touched again when the kernel is dropped. One kernel can be shared by
/// any number of threads updating disjoint slices.
pub struct AdamWKernel {
    func: KernelFn,
    consts: AdamWConstants,
    ir: String,
    optimized_ir: String,
    disasm: String,
    /// The code `func` points into, freed with the kernel.
    _code: JitCode,
}

impl std::fmt::Debug for AdamWKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamWKernel")
            .field("consts", &self.consts)
            .finish_non_exhaustive()
    }
}

fn codegen_err(e: impl std::fmt::Display) -> KernelError {
    KernelError::Codegen(e.to_string())
}

impl AdamWKernel {
    /// Generates the IR for these constants and JIT-compiles it for the host
    /// (`cranelift_native`, `opt_level = "speed"`). Takes on the order of a millisecond.
    ///
    /// Any f64 values are accepted (as the reference accepts them); the kernel then computes
    /// whatever the reference computes.
    ///
    /// # Errors
    /// [`KernelError::UnsupportedHost`] when Cranelift has no backend for the host;
    /// [`KernelError::Codegen`] when a setting, the IR verifier or finalization fails
    /// (a bug).
    pub fn compile(c: &AdamWConstants) -> Result<AdamWKernel, KernelError> {
        let (mut module, call_conv) = crate::host_module()?;

        let mut ctx = module.make_context();
        let sig = &mut ctx.func.signature;
        sig.call_conv = call_conv;
        for _ in 0..5 {
            sig.params.push(AbiParam::new(I64)); // 4 pointers, n
        }
        for _ in 0..3 {
            sig.params.push(AbiParam::new(F64)); // lr, bc1, bc2
        }
        let id = module
            .declare_function("asteria_adamw_f32", Linkage::Local, &ctx.func.signature)
            .map_err(codegen_err)?;
        let mut fctx = FunctionBuilderContext::new();
        build_body(&mut ctx, &mut fctx, module.isa().frontend_config(), c);
        let ir = ctx.func.display().to_string();

        ctx.set_disasm(true);
        module.define_function(id, &mut ctx).map_err(codegen_err)?;
        let disasm = ctx
            .compiled_code()
            .and_then(|cc| cc.vcode.clone())
            .unwrap_or_default();
        let optimized_ir = ctx.func.display().to_string();
        module.clear_context(&mut ctx);
        module.finalize_definitions().map_err(codegen_err)?;
        let ptr = module.get_finalized_function(id);
        // SAFETY: `ptr` is the finalized code of a function whose Cranelift signature
        // (5 × i64, 3 × f64, no returns, the platform's default call convention) is the C
        // ABI of `KernelFn` (pointers and u64 are i64).
        let func = unsafe { std::mem::transmute::<*const u8, KernelFn>(ptr) };
        Ok(AdamWKernel {
            func,
            consts: *c,
            ir,
            optimized_ir,
            disasm,
            _code: JitCode::new(module),
        })
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
        let bc1 = 1.0 - self.consts.beta1.powi(ti);
        let bc2 = 1.0 - self.consts.beta2.powi(ti);
        let func = self.func;
        for_each_chunk(param, grad, exp_avg, exp_avg_sq, |p, g, m, v| {
            debug_assert!(p.len() == g.len() && m.len() == g.len() && v.len() == g.len());
            // SAFETY: the four slices have `g.len()` elements each (checked above; chunked
            // identically); the `&mut` ones are exclusive, so they do not overlap each
            // other or `g`; the code reads and writes exactly indices `0..n` of each with
            // unaligned-capable loads/stores and has no other side effects.
            unsafe {
                func(
                    p.as_mut_ptr(),
                    g.as_ptr(),
                    m.as_mut_ptr(),
                    v.as_mut_ptr(),
                    g.len() as u64,
                    lr,
                    bc1,
                    bc2,
                )
            }
        });
        Ok(())
    }

    /// The Cranelift IR (CLIF text) of the generated function as emitted, before
    /// Cranelift's optimizer (for `--print`-style inspection). The vector loop's
    /// operations are on `f32x4`.
    pub fn ir_text(&self) -> &str {
        &self.ir
    }

    /// The CLIF after Cranelift's mid-end (e-graph rewrites, loop-invariant code motion),
    /// i.e. what was lowered to machine code.
    pub fn optimized_ir_text(&self) -> &str {
        &self.optimized_ir
    }

    /// The machine code Cranelift produced, as its VCode disassembly (host instructions,
    /// e.g. `vdivps`/`vsqrtps` on x86_64 with AVX, `divps`/`sqrtps` with SSE only).
    pub fn disasm_text(&self) -> &str {
        &self.disasm
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
    let decay = (1.0 - lr * c.weight_decay) as f32;
    let step_size = (lr / (1.0 - c.beta1.powi(ti))) as f32;
    let bc2_sqrt = (1.0 - c.beta2.powi(ti)).sqrt() as f32;
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

/// The per-element values the body needs, as f32 scalars or f32x4 splats.
struct Operands {
    decay: Value,
    step_size: Value,
    bc2_sqrt: Value,
    w1: Value,
    one_minus_w1: Value,
    beta2: Value,
    w2: Value,
    eps: Value,
}

/// Emits the element-wise update on `(p, g, m, v)` (all of one type, `F32` or `F32X4`)
/// and returns the new `(p, m, v)`; the same instruction sequence as `ref_loop`.
fn emit_update(
    b: &mut FunctionBuilder<'_>,
    d: &Derived,
    k: &Operands,
    p: Value,
    g: Value,
    m: Value,
    v: Value,
) -> (Value, Value, Value) {
    let mut p = p;
    if d.decays {
        p = b.ins().fmul(p, k.decay);
    }
    let diff = b.ins().fsub(g, m);
    let m = if d.lerp_low {
        // m + w1·(g − m)
        let t = b.ins().fmul(k.w1, diff);
        b.ins().fadd(m, t)
    } else {
        // g − (g − m)·(1 − w1)
        let t = b.ins().fmul(diff, k.one_minus_w1);
        b.ins().fsub(g, t)
    };
    // v·β₂ + (w₂·g)·g
    let vb = b.ins().fmul(v, k.beta2);
    let wg = b.ins().fmul(k.w2, g);
    let wgg = b.ins().fmul(wg, g);
    let v = b.ins().fadd(vb, wgg);
    // √v / bc2_sqrt + ε
    let s = b.ins().sqrt(v);
    let s = b.ins().fdiv(s, k.bc2_sqrt);
    let denom = b.ins().fadd(s, k.eps);
    // p − step_size·(m / denom)
    let q = b.ins().fdiv(m, denom);
    let q = b.ins().fmul(k.step_size, q);
    let p = b.ins().fsub(p, q);
    (p, m, v)
}

/// Builds the function body into `ctx.func` (whose signature is already set).
///
/// ```text
/// entry(p, g, m, v, n, lr, bc1, bc2):
///   per-step scalars in f64 → fdemote; splats; end_vec = (n & !3)·4; end = n·4
///   end_vec ≠ 0 ? vec_body(0) : tail_head(0)
/// vec_body(off):  f32x4 loads at base+off, update, stores;
///                 off + 16 < end_vec ? vec_body(off + 16) : tail_head(off + 16)
/// tail_head(off): off < end ? tail_body(off) : exit
/// tail_body(off): f32 loads, update, stores; off + 4 < end ? tail_body(off + 4) : exit
/// ```
///
/// The loops are bottom-tested (rotated): each is a single block whose immediate dominator
/// lies outside every loop, so Cranelift's loop-invariant code motion hoists the per-step
/// scalars, splats and constants out of them. (With top-tested loops the scalar tail's
/// header is dominated by the vector loop's header, and the elaborator's loop stack then
/// loses the vector loop: everything was recomputed per iteration, f64 `fdiv`/`sqrt`
/// included.)
fn build_body(
    ctx: &mut Context,
    fctx: &mut FunctionBuilderContext,
    frontend: TargetFrontendConfig,
    c: &AdamWConstants,
) {
    let d = Derived::of(c);
    let mut b = FunctionBuilder::new(&mut ctx.func, fctx);
    let entry = b.create_block();
    b.append_block_params_for_function_params(entry);

    b.switch_to_block(entry);
    let a = b.block_params(entry).to_vec();
    let (pp, gp, mp, vp, n, lr, bc1, bc2) = (a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
    // Per-step scalars, in f64 then rounded once to f32, as the reference.
    let one = b.ins().f64const(1.0);
    let decay = if d.decays {
        let wd = b.ins().f64const(c.weight_decay);
        let lr_wd = b.ins().fmul(lr, wd);
        let x = b.ins().fsub(one, lr_wd);
        b.ins().fdemote(F32, x)
    } else {
        b.ins().f32const(1.0f32) // unused
    };
    let step = b.ins().fdiv(lr, bc1);
    let step_size = b.ins().fdemote(F32, step);
    let bc2s = b.ins().sqrt(bc2);
    let bc2_sqrt = b.ins().fdemote(F32, bc2s);
    let scalars = Operands {
        decay,
        step_size,
        bc2_sqrt,
        w1: b.ins().f32const(d.w1),
        one_minus_w1: b.ins().f32const(d.one_minus_w1),
        beta2: b.ins().f32const(d.beta2),
        w2: b.ins().f32const(d.w2),
        eps: b.ins().f32const(d.eps),
    };
    let splat = |b: &mut FunctionBuilder<'_>, x: Value| b.ins().splat(F32X4, x);
    let vectors = Operands {
        decay: splat(&mut b, scalars.decay),
        step_size: splat(&mut b, scalars.step_size),
        bc2_sqrt: splat(&mut b, scalars.bc2_sqrt),
        w1: splat(&mut b, scalars.w1),
        one_minus_w1: splat(&mut b, scalars.one_minus_w1),
        beta2: splat(&mut b, scalars.beta2),
        w2: splat(&mut b, scalars.w2),
        eps: splat(&mut b, scalars.eps),
    };
    // Unaligned (no `aligned` flag), non-trapping: the caller guarantees valid slices.
    let mem = MemFlagsData::new().with_notrap();

    // Emits loads at base+off of `ty`, the update, and stores; returns nothing.
    let body = |b: &mut FunctionBuilder<'_>, ty: Type, k: &Operands, off: Value| {
        let pa = b.ins().iadd(pp, off);
        let ga = b.ins().iadd(gp, off);
        let ma = b.ins().iadd(mp, off);
        let va = b.ins().iadd(vp, off);
        let p = b.ins().load(ty, mem, pa, 0);
        let g = b.ins().load(ty, mem, ga, 0);
        let m = b.ins().load(ty, mem, ma, 0);
        let v = b.ins().load(ty, mem, va, 0);
        let (p, m, v) = emit_update(b, &d, k, p, g, m, v);
        b.ins().store(mem, m, ma, 0);
        b.ins().store(mem, v, va, 0);
        b.ins().store(mem, p, pa, 0);
    };

    crate::element_loops(&mut b, n, &mut |b, ty, off| {
        let k = if ty == F32X4 { &vectors } else { &scalars };
        body(b, ty, k, off)
    });
    b.finalize(frontend);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_is_send_sync() {
        fn assert<T: Send + Sync>() {}
        assert::<AdamWKernel>();
    }
}
