//! Host-side optimizer kernels, JIT-compiled with Cranelift.
//!
//! When a plan keeps optimizer state in host memory (the offload tiers: moments placed on
//! the host or staged from NVMe), the element-wise update runs on the host cores, as
//! ZeRO-Offload's CPU Adam does; the CPU engine runs every f32 update this way. This crate
//! generates that update as native code at plan time from the optimizer's **update rule**
//! (`optim::update`): [`RuleKernel::compile`] emits Cranelift IR for a rule, one instruction
//! per expression node, specialised to the plan's constants, and JIT-compiles it for the
//! host ISA. [`AdamWKernel`] is the kernel of AdamW's rule (`optim::update::adamw_rule`, the
//! rule the CUDA engine compiles through NVRTC), so AdamW, Lion and every rule-defined
//! optimizer are written once for both engines.
//!
//! # Why Cranelift
//!
//! - **Plan-specialised constants.** β₁, β₂, ε and the weight-decay coefficient are fixed
//!   for the whole run, so they are baked into the code as immediates (as are the choices
//!   they imply: the `lerp` branch, whether decay is applied at all). Only what changes per
//!   step (the scheduled learning rate and the bias corrections of step `t`, as the rule's
//!   step scalars) is passed at run time.
//! - **Generated from the update rule.** The kernel is emitted from the rule's expression
//!   (after `optim::update::simplify`), rather than hand-written per optimizer and ISA in
//!   intrinsics. A hand-written Cranelift emitter of AdamW's instruction sequence was
//!   measured against the generated kernel on the same pool and ran at the same throughput
//!   (BENCHMARKS.md); it was deleted.
//! - **No C toolchain.** Unlike ZeRO-Offload's CPU Adam (C++ with AVX intrinsics, built by
//!   a host compiler at install time), Cranelift is a pure-Rust library: no `cc`, no
//!   system compiler, no build-time ISA guess. `cranelift_native` detects the host's
//!   features (SSE4.x, AVX, ...) when the kernel is compiled.
//!
//! # Exactness
//!
//! A rule kernel is bit-identical to the rule interpreter (`optim::update::Program` at f32)
//! and [`AdamWKernel`] to the workspace reference `optim::adamw_update` at `f32` (PyTorch
//! `_single_tensor_adamw` semantics) and to [`adamw_reference`], a plain rustc-compiled loop
//! of the same math. The argument:
//!
//! - every per-step scalar is computed exactly as the reference does: in **f64**, then
//!   rounded once to f32 (`optim::update::adamw_scalars`: `decay = f32(1 − lr·wd)`,
//!   `step_size = f32(lr / (1 − β₁ᵗ))`, `bc2_sqrt = f32(√(1 − β₂ᵗ))`);
//! - the plan constants are rounded to f32 the same way (`f32(1 − β₁)`, `f32(β₂)`,
//!   `f32(1 − β₂)`, `f32(ε)`, and `1 − f32(1 − β₁)` in f32 for the `lerp` branch);
//! - the element-wise body performs the same f32 operations in the same order with the
//!   same association, e.g. `v·β₂ + (w₂·g)·g`; every one (`+ − × ÷ √`) is correctly
//!   rounded in IEEE-754 binary32, both in SIMD lanes and in scalar code; **no fused
//!   multiply-add** is used (the reference has none; Rust never contracts, and Cranelift
//!   only emits `fma` when the IR asks for it) and no reassociation is done (Cranelift
//!   has no fast-math rewrites; `simplify`'s rewrites keep every rounding);
//! - both run under the default floating-point environment (round-to-nearest-even,
//!   subnormals kept: neither sets FTZ/DAZ).
//!
//! NaN *payloads* are not part of the claim (a NaN input gives a NaN output in both, but
//! which input's payload propagates may differ between instruction selections); for
//! finite inputs every output bit matches. The tests (`tests/adamw.rs`, `tests/rule.rs`)
//! check this with `to_bits` over awkward lengths, steps and constant sets.
//!
//! # Vectorisation and threads
//!
//! The main loop processes `f32x4` vectors (Cranelift `F32X4`, SSE baseline on x86_64,
//! NEON on aarch64), followed by a scalar tail loop for the last `n mod 4` elements
//! (`element_loops`). [`RuleKernel::run`] and [`adamw_reference`] split large slices
//! (≥ [`PARALLEL_MIN_ELEMENTS`]) into chunks of [`CHUNK_ELEMENTS`] processed on the current
//! rayon pool, identically, so throughput comparisons between them are fair; the update is
//! element-wise, so the chunking does not change any result.
//!
//! # Benchmark
//!
//! `cargo run --release -p asteria-hostkernels --bin host-kernel-bench -- --elements N
//! --reps R --threads T` times [`AdamWKernel::update`] against [`adamw_reference`] on the
//! same pool and checks that their results are bit-identical. Both are memory-bound at
//! large sizes (28 bytes per element) and run at the same throughput (ratio ≈ 1).
#![deny(missing_docs)]

mod adamw;
mod rule;

pub use adamw::{
    adamw_reference, AdamWConstants, AdamWKernel, CHUNK_ELEMENTS, PARALLEL_MIN_ELEMENTS,
};
pub use rule::{Operand, RuleKernel};

/// A JIT module for the host ISA (`cranelift_native`, `opt_level = "speed"`, not PIC) and the
/// ISA's default calling convention: what every kernel of this crate is compiled into.
pub(crate) fn host_module(
) -> Result<(cranelift_jit::JITModule, cranelift_codegen::isa::CallConv), KernelError> {
    use cranelift_codegen::settings::{self, Configurable};
    let codegen = |e: &dyn std::fmt::Display| KernelError::Codegen(e.to_string());
    let mut flags = settings::builder();
    flags.set("opt_level", "speed").map_err(|e| codegen(&e))?;
    flags.set("is_pic", "false").map_err(|e| codegen(&e))?;
    let isa = cranelift_native::builder()
        .map_err(|e| KernelError::UnsupportedHost(e.into()))?
        .finish(settings::Flags::new(flags))
        .map_err(|e| codegen(&e))?;
    let call_conv = isa.default_call_conv();
    let builder =
        cranelift_jit::JITBuilder::with_isa(isa, cranelift_module::default_libcall_names());
    Ok((cranelift_jit::JITModule::new(builder), call_conv))
}

/// Owns a finalized JIT module and frees its code on drop. Behind a mutex only so that the
/// kernels holding it are `Sync` without `unsafe` (`JITModule` is `Send` but not `Sync`); it is
/// never locked outside `drop`.
pub(crate) struct JitCode(std::sync::Mutex<Option<cranelift_jit::JITModule>>);

impl JitCode {
    pub(crate) fn new(module: cranelift_jit::JITModule) -> JitCode {
        JitCode(std::sync::Mutex::new(Some(module)))
    }
}

impl Drop for JitCode {
    fn drop(&mut self) {
        let module = self.0.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(module) = module {
            // SAFETY: `drop` has exclusive access to the kernel that owns this code (it is
            // dropped with it), so nothing calls into the code now or later.
            unsafe { module.free_memory() };
        }
    }
}

/// Emits the element loops every host kernel of this crate shares, continuing the current
/// block (the entry, where the per-call values were computed): a bottom-tested `f32x4` loop
/// over the first `n & !3` elements, then a bottom-tested scalar tail; `body(b, ty, off)` emits
/// one iteration of type `ty` (`F32X4` or `F32`) at byte offset `off`. Ends the function
/// (`return`) and seals its blocks. Each loop is a single block whose immediate dominator lies
/// outside every loop, so Cranelift's loop-invariant code motion hoists the entry's values
/// (top-tested loops lost that: the entry's values stayed inside the loop).
pub(crate) fn element_loops(
    b: &mut cranelift_frontend::FunctionBuilder<'_>,
    n: cranelift_codegen::ir::Value,
    body: &mut dyn FnMut(
        &mut cranelift_frontend::FunctionBuilder<'_>,
        cranelift_codegen::ir::Type,
        cranelift_codegen::ir::Value,
    ),
) {
    use cranelift_codegen::ir::condcodes::IntCC;
    use cranelift_codegen::ir::types::{F32, F32X4, I64};
    use cranelift_codegen::ir::{BlockArg, InstBuilder};
    let (vec_body, tail_head, tail_body, exit) = (
        b.create_block(),
        b.create_block(),
        b.create_block(),
        b.create_block(),
    );
    for blk in [vec_body, tail_head, tail_body] {
        b.append_block_param(blk, I64);
    }
    let nvec = b.ins().band_imm_s(n, -4i64);
    let end_vec = b.ins().ishl_imm_u(nvec, 2);
    let end = b.ins().ishl_imm_u(n, 2);
    let zero = b.ins().iconst(I64, 0);
    let at = |v| [BlockArg::Value(v)];
    b.ins()
        .brif(end_vec, vec_body, &at(zero), tail_head, &at(zero));
    // Vector loop (entered only when there is at least one vector).
    b.switch_to_block(vec_body);
    let off = b.block_params(vec_body)[0];
    body(b, F32X4, off);
    let next = b.ins().iadd_imm_u(off, 16);
    let more = b.ins().icmp(IntCC::UnsignedLessThan, next, end_vec);
    b.ins()
        .brif(more, vec_body, &at(next), tail_head, &at(next));
    // Scalar tail: 0–3 elements.
    b.switch_to_block(tail_head);
    let off = b.block_params(tail_head)[0];
    let more = b.ins().icmp(IntCC::UnsignedLessThan, off, end);
    b.ins().brif(more, tail_body, &at(off), exit, &[]);
    b.switch_to_block(tail_body);
    let off = b.block_params(tail_body)[0];
    body(b, F32, off);
    let next = b.ins().iadd_imm_u(off, 4);
    let more = b.ins().icmp(IntCC::UnsignedLessThan, next, end);
    b.ins().brif(more, tail_body, &at(next), exit, &[]);
    b.switch_to_block(exit);
    b.ins().return_(&[]);
    b.seal_all_blocks();
}

/// Why a kernel could not be compiled or run. Run-time errors ([`KernelError::ZeroStep`],
/// [`KernelError::StepTooLarge`], [`KernelError::LengthMismatch`]) are reported before
/// any slice is modified.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The host ISA is not supported by Cranelift (or could not be detected).
    #[error("host ISA not supported by Cranelift: {0}")]
    UnsupportedHost(String),
    /// Cranelift rejected a setting, the IR, or could not finalize the code.
    #[error("Cranelift code generation failed: {0}")]
    Codegen(String),
    /// Steps are 1-based; `t = 0` has no bias correction (1 − β⁰ = 0).
    #[error("step t must be >= 1 (steps are 1-based), got 0")]
    ZeroStep,
    /// The bias corrections use `powi` with an `i32` exponent, as the reference does.
    #[error("step t = {0} exceeds i32::MAX")]
    StepTooLarge(u64),
    /// An update rule the generator (and the interpreter) refuses, or operands that do not
    /// match it.
    #[error("update rule: {0}")]
    Rule(String),
    /// A slice's length differs from `grad`'s.
    #[error("{operand} has {got} elements, expected {expected} (the length of grad)")]
    LengthMismatch {
        /// `"param"`, `"exp_avg"` or `"exp_avg_sq"`.
        operand: &'static str,
        /// `grad.len()`.
        expected: usize,
        /// The operand's length.
        got: usize,
    },
}
