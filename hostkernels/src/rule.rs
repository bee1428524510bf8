//! Host kernels generated from an element-wise update rule (`optim::update`): one Cranelift
//! function per rule, specialised to its constants (immediates), `f32x4` main loop and scalar
//! tail, one IR instruction per expression node. The engines' reference semantics are the
//! rule interpreter's (`optim::update::Program` at f32): every node is an IEEE-754 binary32
//! operation rounded to nearest (`fadd fsub fmul fdiv sqrt fneg`, no fused multiply-add, no
//! reassociation: Cranelift has neither unless asked), `sign` and `select_lt` are compares and
//! selects, so the kernel is bit-identical to the interpreter for every input whose NaNs do
//! not matter (a NaN stays a NaN; its payload is not part of the claim).
//!
//! The function takes a pointer to the tensors' base pointers (the rule's order), the element
//! count and a pointer to the step scalars (f32, the rule's order); all are read once at entry.
use cranelift_codegen::ir::condcodes::FloatCC;
use cranelift_codegen::ir::types::{F32, F32X4, I64};
use cranelift_codegen::ir::{AbiParam, Endianness, InstBuilder, MemFlagsData, Type, Value};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_module::{Linkage, Module};
use optim::update::{RuleError, Update, UpdateRule};
use rayon::prelude::*;

use crate::{JitCode, KernelError, CHUNK_ELEMENTS, PARALLEL_MIN_ELEMENTS};

/// `(tensors, n, scalars)`: `tensors` points at the rule's tensor base pointers, `scalars` at
/// its step scalars.
type RuleFn = unsafe extern "C" fn(*const *mut f32, u64, *const f32);

/// Where a leaf's value comes from.
#[derive(Clone, Copy, Debug)]
enum Leaf {
    Tensor(usize),
    Scalar(usize),
    Const(f32),
}

/// A rule's nodes resolved: leaves by kind, the outputs and the tensors they overwrite.
struct Resolved {
    nodes: Vec<Update>,
    leaves: Vec<Option<Leaf>>,
    outputs: Vec<usize>,
    targets: Vec<usize>,
}

fn resolve(rule: &UpdateRule) -> Result<Resolved, RuleError> {
    // The interpreter's checks (outputs, unbound names) first, so both refuse the same rules.
    optim::update::Program::new(rule)?;
    let nodes: Vec<Update> = rule.expr.as_ref().to_vec();
    let find = |names: &[String], s: &str| names.iter().position(|n| n == s);
    let leaves = nodes
        .iter()
        .map(|n| match n {
            Update::Num(c) => Some(Leaf::Const(c.get())),
            Update::Var(s) => find(&rule.tensors, s.as_str())
                .map(Leaf::Tensor)
                .or_else(|| find(&rule.scalars, s.as_str()).map(Leaf::Scalar)),
            _ => None,
        })
        .collect();
    let Some(Update::List(outs)) = nodes.last() else {
        return Err(RuleError::Outputs("the root must be `(list ...)`".into()));
    };
    let outputs = outs.iter().map(|&i| usize::from(i)).collect();
    let targets = rule
        .outputs
        .iter()
        .map(|o| find(&rule.tensors, o).ok_or_else(|| RuleError::Unbound(o.clone())))
        .collect::<Result<_, _>>()?;
    Ok(Resolved {
        nodes,
        leaves,
        outputs,
        targets,
    })
}

/// An update rule compiled for the host.
pub struct RuleKernel {
    func: RuleFn,
    tensors: usize,
    scalars: usize,
    /// Which tensors the rule writes.
    written: Vec<bool>,
    ir: String,
    optimized_ir: String,
    disasm: String,
    /// The code `func` points into, freed with the kernel.
    _code: JitCode,
}

impl std::fmt::Debug for RuleKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuleKernel")
            .field("tensors", &self.tensors)
            .field("scalars", &self.scalars)
            .finish_non_exhaustive()
    }
}

fn codegen_err(e: impl std::fmt::Display) -> KernelError {
    KernelError::Codegen(e.to_string())
}

impl RuleKernel {
    /// Generates and JIT-compiles `rule` for the host (`cranelift_native`, `opt_level =
    /// "speed"`).
    ///
    /// # Errors
    /// [`KernelError::Rule`] for a rule the interpreter refuses too (outputs, unbound names);
    /// [`KernelError::UnsupportedHost`]; [`KernelError::Codegen`] (a bug).
    pub fn compile(rule: &UpdateRule) -> Result<RuleKernel, KernelError> {
        let r = resolve(rule).map_err(|e| KernelError::Rule(e.to_string()))?;
        let (mut module, call_conv) = crate::host_module()?;
        let mut ctx = module.make_context();
        ctx.func.signature.call_conv = call_conv;
        for _ in 0..3 {
            ctx.func.signature.params.push(AbiParam::new(I64));
        }
        let id = module
            .declare_function("asteria_rule_f32", Linkage::Local, &ctx.func.signature)
            .map_err(codegen_err)?;
        let mut fctx = FunctionBuilderContext::new();
        let frontend = module.isa().frontend_config();
        {
            let mut b = FunctionBuilder::new(&mut ctx.func, &mut fctx);
            build(&mut b, &r, rule.tensors.len(), rule.scalars.len());
            b.finalize(frontend);
        }
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
        // SAFETY: the finalized code of a function of signature (i64, i64, i64) -> () in the
        // platform's default call convention: the C ABI of `RuleFn` (pointers and u64).
        let func = unsafe { std::mem::transmute::<*const u8, RuleFn>(ptr) };
        let mut written = vec![false; rule.tensors.len()];
        for &t in &r.targets {
            written[t] = true;
        }
        Ok(RuleKernel {
            func,
            tensors: rule.tensors.len(),
            scalars: rule.scalars.len(),
            written,
            ir,
            optimized_ir,
            disasm,
            _code: JitCode::new(module),
        })
    }

    /// The CLIF text of the generated function (before Cranelift's optimizer): one
    /// instruction per expression node, the vector loop's on `f32x4`.
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

    /// Runs the update in place: `tensors` in the rule's order (all of one length; every
    /// tensor the rule writes must be an [`Operand::Write`]), this step's `scalars` in the
    /// rule's order. Long slices (≥ [`PARALLEL_MIN_ELEMENTS`]) run in [`CHUNK_ELEMENTS`]
    /// chunks on the current rayon pool; the update is element-wise, so chunking changes no
    /// result.
    ///
    /// # Errors
    /// [`KernelError::Rule`] for counts or lengths that do not match, or a written tensor
    /// passed read-only (nothing modified).
    pub fn run(&self, tensors: &mut [Operand<'_>], scalars: &[f32]) -> Result<(), KernelError> {
        if tensors.len() != self.tensors || scalars.len() != self.scalars {
            return Err(KernelError::Rule(format!(
                "{} tensors and {} scalars for a rule of {} and {}",
                tensors.len(),
                scalars.len(),
                self.tensors,
                self.scalars
            )));
        }
        let n = tensors.first().map_or(0, |t| t.len());
        if tensors.iter().any(|t| t.len() != n) {
            return Err(KernelError::Rule("tensors of different lengths".into()));
        }
        if let Some(i) =
            (0..self.tensors).find(|&i| self.written[i] && matches!(tensors[i], Operand::Read(_)))
        {
            return Err(KernelError::Rule(format!(
                "tensor {i} is written by the rule but passed read-only"
            )));
        }
        let call = |parts: &mut [Operand<'_>]| {
            let ptrs: Vec<*mut f32> = parts.iter_mut().map(|t| t.ptr()).collect();
            let len = parts.first().map_or(0, |t| t.len());
            // SAFETY: `ptrs` holds one pointer per tensor of the rule, each to `len` valid f32;
            // the written ones come from exclusive borrows (checked above), so nothing they
            // point at is aliased, and read-only ones are only loaded from. The code reads
            // and writes exactly indices `0..len` of each (unaligned-capable), reads the
            // rule's scalar count of f32 from `scalars`, and has no other side effects.
            unsafe { (self.func)(ptrs.as_ptr(), len as u64, scalars.as_ptr()) }
        };
        if n < PARALLEL_MIN_ELEMENTS || rayon::current_num_threads() <= 1 {
            call(tensors);
            return Ok(());
        }
        let mut chunks: Vec<Vec<Operand<'_>>> = (0..n.div_ceil(CHUNK_ELEMENTS))
            .map(|_| Vec::new())
            .collect();
        for t in tensors.iter_mut() {
            match t {
                Operand::Read(s) => {
                    for (c, part) in chunks.iter_mut().zip(s.chunks(CHUNK_ELEMENTS)) {
                        c.push(Operand::Read(part));
                    }
                }
                Operand::Write(s) => {
                    for (c, part) in chunks.iter_mut().zip(s.chunks_mut(CHUNK_ELEMENTS)) {
                        c.push(Operand::Write(part));
                    }
                }
            }
        }
        chunks.into_par_iter().for_each(|mut c| call(&mut c));
        Ok(())
    }
}

/// One tensor of a [`RuleKernel::run`]: read only, or read and written.
#[derive(Debug)]
pub enum Operand<'a> {
    /// Only read (the gradient; state the rule does not write).
    Read(&'a [f32]),
    /// Read and written in place.
    Write(&'a mut [f32]),
}

impl Operand<'_> {
    fn len(&self) -> usize {
        match self {
            Operand::Read(s) => s.len(),
            Operand::Write(s) => s.len(),
        }
    }
    /// The base pointer the generated code takes (it only stores through written ones).
    fn ptr(&mut self) -> *mut f32 {
        match self {
            Operand::Read(s) => s.as_ptr().cast_mut(),
            Operand::Write(s) => s.as_mut_ptr(),
        }
    }
}

/// Emits the rule's nodes on values of type `ty` (`F32` or `F32X4`); `load(i)` gives tensor
/// `i`'s element(s), `scalar(i)` step scalar `i` (already of `ty`). Returns each node's value.
fn emit(
    b: &mut FunctionBuilder<'_>,
    r: &Resolved,
    ty: Type,
    loads: &[Option<Value>],
    scalars: &[Value],
) -> Vec<Value> {
    let vector = ty == F32X4;
    let mut vals: Vec<Value> = Vec::with_capacity(r.nodes.len());
    let konst = |b: &mut FunctionBuilder<'_>, x: f32| {
        let c = b.ins().f32const(x);
        if vector {
            b.ins().splat(F32X4, c)
        } else {
            c
        }
    };
    // `cond ? x : y` for a float compare.
    let select =
        |b: &mut FunctionBuilder<'_>, cc: FloatCC, a: Value, c: Value, x: Value, y: Value| {
            let m = b.ins().fcmp(cc, a, c);
            if vector {
                let little = MemFlagsData::new().with_endianness(Endianness::Little);
                let m = b.ins().bitcast(F32X4, little, m);
                b.ins().bitselect(m, x, y)
            } else {
                b.ins().select(m, x, y)
            }
        };
    for (k, node) in r.nodes.iter().enumerate() {
        let v = |i: &egg::Id| vals[usize::from(*i)];
        let val = match (node, r.leaves[k]) {
            (_, Some(Leaf::Tensor(t))) => loads[t].expect("tensor leaves are loaded"),
            (_, Some(Leaf::Scalar(s))) => scalars[s],
            (_, Some(Leaf::Const(c))) => konst(b, c),
            (Update::Add([x, y]), None) => b.ins().fadd(v(x), v(y)),
            (Update::Sub([x, y]), None) => b.ins().fsub(v(x), v(y)),
            (Update::Mul([x, y]), None) => b.ins().fmul(v(x), v(y)),
            (Update::Div([x, y]), None) => b.ins().fdiv(v(x), v(y)),
            (Update::Neg([x]), None) => b.ins().fneg(v(x)),
            (Update::Sqrt([x]), None) => b.ins().sqrt(v(x)),
            (Update::Sign([x]), None) => {
                // x > 0 ? 1 : (x < 0 ? -1 : x): ±0 and NaN pass through.
                let (x, zero, one, minus) = (v(x), konst(b, 0.0), konst(b, 1.0), konst(b, -1.0));
                let neg = select(b, FloatCC::LessThan, x, zero, minus, x);
                select(b, FloatCC::GreaterThan, x, zero, one, neg)
            }
            (Update::SelectLt([a, c, x, y]), None) => {
                select(b, FloatCC::LessThan, v(a), v(c), v(x), v(y))
            }
            // `list` is the root (its items are read by the caller); leaves are resolved.
            _ => konst(b, 0.0),
        };
        vals.push(val);
    }
    vals
}

/// The function body: pointers and scalars read at entry, a bottom-tested `f32x4` loop, then
/// a scalar tail (`crate::element_loops`, whose docs say why).
fn build(b: &mut FunctionBuilder<'_>, r: &Resolved, n_tensors: usize, n_scalars: usize) {
    let entry = b.create_block();
    b.append_block_params_for_function_params(entry);
    b.switch_to_block(entry);
    let a = b.block_params(entry).to_vec();
    let (tp, n, sp) = (a[0], a[1], a[2]);
    let plain = MemFlagsData::new().with_notrap();
    let bases: Vec<Value> = (0..n_tensors)
        .map(|i| b.ins().load(I64, plain, tp, (8 * i) as i32))
        .collect();
    let scalars: Vec<Value> = (0..n_scalars)
        .map(|i| b.ins().load(F32, plain, sp, (4 * i) as i32))
        .collect();
    let splats: Vec<Value> = scalars.iter().map(|&s| b.ins().splat(F32X4, s)).collect();
    let used: Vec<bool> = (0..n_tensors)
        .map(|t| {
            r.leaves
                .iter()
                .any(|l| matches!(l, Some(Leaf::Tensor(x)) if *x == t))
        })
        .collect();
    let mem = MemFlagsData::new().with_notrap();
    let body = |b: &mut FunctionBuilder<'_>, ty: Type, sc: &[Value], off: Value| {
        let addrs: Vec<Value> = bases.iter().map(|&p| b.ins().iadd(p, off)).collect();
        let loads: Vec<Option<Value>> = (0..n_tensors)
            .map(|t| used[t].then(|| b.ins().load(ty, mem, addrs[t], 0)))
            .collect();
        let vals = emit(b, r, ty, &loads, sc);
        // Every output is computed from the old values before any is stored.
        for (&node, &t) in r.outputs.iter().zip(&r.targets) {
            b.ins().store(mem, vals[node], addrs[t], 0);
        }
    };
    crate::element_loops(b, n, &mut |b, ty, off| {
        let sc = if ty == F32X4 { &splats } else { &scalars };
        body(b, ty, sc, off)
    });
}
