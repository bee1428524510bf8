//! `fuse`: rewrites the IR into the fused ops the engines execute, so that an engine runs what
//! the plan says and plans no fusion of its own (everything is visible with
//! `--print-after fuse`). Runs after `expand-optimizer`, before `liveness` (memory is planned
//! for the fused program). Nine rules:
//!
//! - **`soap-update`** (instruction selection, CPU targets; on CUDA only with `--apply-rule
//!   soap-update`, [`Fuse::off_by_default`]: the CUDA engine's composed step measured faster):
//!   the composed SOAP step that
//!   `expand-optimizer` writes from `optim::optimizers::soap` — `project` the gradient into
//!   the eigenbases, the moments `elementwise_update` (result: the direction there), `project`
//!   it back, the step `elementwise_update` — becomes one `soap_update`, the hand-written op
//!   (CPU: the same f32 operations in the same order, bit-identical; CUDA: the projections'
//!   GEMMs around one kernel over the moments, the back-projection read in bf16 under bf16
//!   precision). It fuses only when both rules are exactly those `optim::optimizers::soap::rules`
//!   writes for the hyperparameters they carry (after `simplify`), each intermediate has no
//!   other reader and both projections use the same bases; otherwise the report says why and
//!   the composition runs as written (both engines run it: `project`'s GEMMs and the rules'
//!   generated kernels on the GPU).
//!
//! - **`shampoo-update`** (instruction selection, every target; `--skip-rule` leaves it out): the composed Shampoo step of
//!   `optim::optimizers::shampoo` — `shampoo_factor_update` of the gradient, the moments
//!   `elementwise_update` (results `Ḡ` and, with grafting, the Adam grafting step),
//!   `shampoo_precondition` of `Ḡ` with the inverse roots, `graft` (with grafting), the step
//!   `elementwise_update` — becomes one `shampoo_update` (CPU: the same operations in the same
//!   order, bit-identical; CUDA: its GEMMs and kernel). The same conditions as `soap-update`:
//!   both rules exactly those the definition writes for the hyperparameters they carry, every
//!   op of the same block size and factor hyperparameters, intermediates read only by the next
//!   op, the ops consecutive; otherwise the report says why and the composition runs as
//!   written (the CPU engine runs it; the CUDA engine refuses the composed ops).
//!
//! - **`kl-shampoo-update`** (instruction selection, every target): the composed KL-Shampoo
//!   step of `optim::optimizers::kl_shampoo` — the momentum `elementwise_update` (result: the
//!   new momentum), `project` into the bases, `kl_scale`, `project` back, the step
//!   `elementwise_update`, `kl_factor_update` — becomes one `kl_shampoo_update`, on the same
//!   conditions.
//!
//! - **`bias-epilogue`** (an egg rewrite, every target):
//!   `(bias_add (mat_mul ?ta ?tb ?a ?b) ?bias) → (mat_mul_bias ?ta ?tb ?a ?b ?bias)`.
//!   The product must have no reader but that `bias_add` (checked before the e-graph is built:
//!   a product with other readers enters it as an opaque value, which the pattern cannot
//!   match), and under bf16 GEMMs (CUDA, `precision = bf16`) the operands' rows must be
//!   16-byte aligned — `a` and `b` a multiple of 8 bf16 columns, the f32 output a multiple of
//!   4 — a condition on the rule (cuBLAS's unaligned kernels lose more than the fusion gains).
//!   The CPU engine computes `mat_mul_bias` as the product then the bias add, bit-identical to
//!   the pair; the CUDA engine as one cuBLASLt GEMM with a bias epilogue. Either way the
//!   product's buffer disappears from the plan.
//! - **`attention-saved`** (an egg rewrite, CUDA with `precision = bf16` and `attention` not
//!   `gemm`, heads of at most `schedule::BF16_ATTENTION_MAX_HEAD_DIM`: where the tensor-core
//!   kernels run):
//!   `(attention_backward ?g ?dout ?qkv) → (attention_backward_saved ?g ?dout ?qkv
//!   (attention ?g ?qkv))` if the e-graph holds that forward — hash-consing finds the
//!   `attention` of the same qkv and geometry, whose e-class also holds its output value. The
//!   forward gets a second result `lse` (its softmax statistics, f32 `[B·NH·T]`) and the
//!   backward reads `fwd_out` and `lse` instead of rerunning the forward's score pass; the
//!   memory plan keeps both alive until the backward.
//! - **`bf16-output`** (an analysis, CUDA with `precision = bf16` only): the output of a
//!   `layer_norm` (rows of at most `schedule::BF16_LAYERNORM_MAX_C`), `rms_norm`, `gelu`,
//!   `swi_glu`, `swi_glu_backward`, `gelu_backward`, `rope` (LLaMA's rotated qkv),
//!   `rope_backward`, `mat_mul`
//!   (the bf16 GEMM rounds its fp32 result in the epilogue), `mat_mul_bias`
//!   (rows of a multiple of 8; its bias is then cast to bf16 too, as PyTorch's autocast
//!   does: cuBLASLt's bias epilogue reads the bias in the output's type), `attention`
//!   (heads of at most `schedule::BF16_ATTENTION_MAX_HEAD_DIM`, the tensor-core kernels) or
//!   `cross_entropy_backward` whose every reader reads it as a GEMM operand (`a` / `b` of
//!   `mat_mul` / `mat_mul_bias`, which read bf16 under that precision anyway), as the input
//!   `x` of `swi_glu` / `gelu` and their backwards, or the `dout` of `swi_glu_backward` /
//!   `gelu_backward` (the MLP's `fc`, the largest activation, and the gradient a GEMM hands the
//!   activation's backward: the activation kernels read bf16 and compute in fp32, as PyTorch's
//!   autocast runs them on bf16 tensors), as the `x` of a `sum_rows` (GPT's c_fc bias
//!   gradient, summed in fp32 from the bf16 gradient as autocast's linear backward does), as
//!   the `logits` of `cross_entropy` /
//!   `cross_entropy_backward` when that backward writes a bf16 gradient (the LM head's output:
//!   the loss kernels read bf16, statistics in fp32) or as the saved `fwd_out` of an
//!   `attention_backward` (read in bf16 by the tensor-core backward), or as the `qkv` of
//!   `attention` / `attention_backward` or the `dout` of `attention_backward` where the
//!   tensor-core kernels run (GPT's `qkv`, LLaMA's rotated qkv: no per-call cast, no saved
//!   bf16 copy; the same bits, since those kernels read a bf16 copy rounded the same way) becomes `bf16`:
//!   the producer writes bf16 directly, the buffer takes half the bytes and no f32 copy exists.
//!   It is not an e-graph rewrite: it changes a value's type on a condition over *all* of its
//!   readers, which a term rewrite (local by nature) cannot see.
//! - **`bf16-cast`** (CUDA with `precision = bf16` only, after `bf16-output`): every value
//!   still f32 that a GEMM reads as `a` / `b` (weights, f32 activations, activation gradients),
//!   and the `bias` of a `mat_mul_bias` with a bf16 output,
//!   gets a `cast` to a bf16 value, inserted just before its first GEMM reader in each section
//!   (forward, backward); those GEMMs read the cast. The bf16 copies are plan buffers like any
//!   other, step-local and placed by the memory planner, so no engine keeps copies of its
//!   own, and the plan shows every rounding. How often a parameter is cast is the spec's
//!   `weight_casts` ([`ir::WeightCasts`], [`Fuse::weight_casts_once`]): `once` (the default
//!   unless a `gpu_memory` budget or rematerialisation asks for memory) casts it in the forward
//!   and the backward GEMMs read that copy, alive from the forward to its last backward GEMM (as
//!   PyTorch's autocast keeps its casts: 2 bytes per weight element at the activation peak);
//!   `twice` casts again in the backward, each copy alive only around its section's GEMMs (a
//!   read of the f32 weight and a write of half as many bytes more per step). Both read the
//!   same bits.
//! - **`sum-rows-cast`** (after `bf16-cast`, so where casts exist: CUDA with `precision =
//!   bf16`): a `sum_rows x` (a bias gradient) and a `cast x` of the same value in one
//!   section become one `sum_rows_cast x` that defines both (the column sums and the bf16
//!   copy, which keeps its name) at the `sum_rows`'s place, when that is before every reader
//!   of the copy: one read of the activation gradient instead of two. The GPU kernel adds the
//!   columns in `sum_rows`'s order (bit-identical sums) and rounds as `cast` does.
//! - **`clip-into-update`** (CUDA targets): when every gradient a `clip_grad_norm` clips is
//!   read after it only by `adam_w` updates, the clip gets a second result `clip_scale` (its
//!   factor, 1 when not clipping) instead of scaling the gradients in place, and each update
//!   reads `grad · clip_scale`: one pass over every gradient fewer, the same values (the
//!   product an in-place clip would store). SOAP plans keep the in-place clip (their factor
//!   accumulation and updates read the gradients too); the report says why.
//!
//! The e-graph language [`Dataflow`] holds only the ops the rewrite rules mention; every
//! other value is an opaque leaf `%name`. The runner has explicit iteration, node and time
//! limits ([`RUNNER_LIMITS`]); the cheapest term per root (fewest kernels, [`KernelCost`]) is
//! mapped back onto the instruction that defined the root's value.
use crate::{Pass, PassContext, PassError};
use egg::{EGraph, Extractor, Id, Runner, Symbol};
use ir::config::TargetConfig;
use ir::{DType, Module, Op, Precision, Section, ValueId};
use schedule::AttentionKernel;
use std::collections::HashMap;
use std::sync::Arc;

mod rules;
mod select;
pub use rules::{geometry, rules, Dataflow, KernelCost, Shapes, RUNNER_LIMITS};

/// The fusions the target allows, from the module's `target` config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FuseTarget {
    /// GEMM operands are read as bf16 (CUDA, `precision = bf16`): bias epilogues need aligned
    /// rows, and `bf16-output` applies.
    pub bf16_gemms: bool,
    /// `attention` outputs may be bf16 (the tensor-core kernels write bf16).
    pub bf16_attention: bool,
}

impl FuseTarget {
    /// The fusions of `target`: bf16 GEMMs under CUDA with `precision = bf16`, and there bf16
    /// attention outputs and saved statistics unless `attention = gemm` (the tensor-core
    /// kernels, which write them, run for `auto` and `fused`); on the CPU or CUDA fp32 only the
    /// target-independent bias epilogue.
    pub fn of(target: &TargetConfig) -> FuseTarget {
        match target {
            TargetConfig::Cuda {
                precision: Precision::Bf16,
                attention,
                ..
            } => FuseTarget {
                bf16_gemms: true,
                bf16_attention: *attention != AttentionKernel::Gemm,
            },
            _ => FuseTarget {
                bf16_gemms: false,
                bf16_attention: false,
            },
        }
    }
}

/// What `fuse` did, for the dump and the summary line.
#[derive(Clone, Debug, Default)]
pub struct FuseReport {
    /// The target's fusions.
    pub target: Option<FuseTarget>,
    /// `bias-epilogue` rewrites: `(result, removed product)` names.
    pub bias_epilogues: Vec<(String, String)>,
    /// `bias_add`s of a GEMM product left unfused, with the reason.
    pub blocked: Vec<(String, String)>,
    /// `attention-saved` rewrites: `(dqkv, forward output)` names.
    pub attention_saved: Vec<(String, String)>,
    /// Values made bf16 by `bf16-output`, with their producer op.
    pub bf16_outputs: Vec<(String, &'static str)>,
    /// `bf16-cast`: `(f32 value, its bf16 cast, section)`.
    pub bf16_casts: Vec<(String, String, &'static str)>,
    /// Whether weights were cast once per step (`None`: no bf16 GEMMs).
    pub weight_casts_once: Option<bool>,
    /// Forward casts of parameters that backward GEMMs read too (`weight_casts = once`).
    pub kept_casts: Vec<(ValueId, String)>,
    /// `sum-rows-cast`: `(x, column sums, bf16 copy)` names.
    pub sum_rows_casts: Vec<(String, String, String)>,
    /// `clip-into-update`: the clip's `scale` and how many updates read it, or why not.
    pub clip_into_update: Option<Result<(String, usize), String>>,
    /// Why the e-graph runner stopped (`Saturated` normally).
    pub stop_reason: Option<String>,
    /// `soap-update` rewrites.
    pub soap_updates: usize,
    /// Composed SOAP steps left unfused: `(parameter, why)`.
    pub soap_blocked: Vec<(String, String)>,
    /// `shampoo-update` rewrites.
    pub shampoo_updates: usize,
    /// Composed Shampoo steps left unfused: `(parameter, why)`.
    pub shampoo_blocked: Vec<(String, String)>,
    /// `kl-shampoo-update` rewrites.
    pub kl_shampoo_updates: usize,
    /// Composed KL-Shampoo steps left unfused: `(parameter, why)`.
    pub kl_shampoo_blocked: Vec<(String, String)>,
}

/// The `fuse` pass. See the module docs.
#[derive(Default)]
pub struct Fuse {
    report: FuseReport,
    /// Instruction-selection rules not to apply ([`Fuse::SKIPPABLE_RULES`]; `--skip-rule`).
    skip_rules: Vec<String>,
    /// Rules to apply where the target's default leaves them out ([`Fuse::off_by_default`];
    /// `--apply-rule`).
    apply_rules: Vec<String>,
}

fn invalid(message: impl Into<String>) -> PassError {
    PassError::Invalid {
        pass: "fuse",
        message: message.into(),
    }
}

fn rank2(m: &Module, v: ValueId) -> Option<(usize, usize)> {
    match m.value(v).ty.shape[..] {
        [r, c] => Some((r, c)),
        _ => None,
    }
}

/// An instruction added to the e-graph as a root: a `bias_add` of a single-reader GEMM
/// product, or an `attention_backward`.
struct Candidate {
    inst: ir::InstId,
    root: Id,
    /// The product's name (`bias_add` roots).
    product: String,
}

impl Fuse {
    /// The rules `--skip-rule` and `--apply-rule` may name: the instruction selections of
    /// composed optimizer steps (the same semantics as the composition, its own rounding),
    /// e.g. to measure a hand-written op against its composition. Every composition runs on
    /// both engines.
    pub const SKIPPABLE_RULES: [&'static str; 3] =
        ["soap-update", "shampoo-update", "kl-shampoo-update"];

    /// The rules `--apply-rule` may name: those some target leaves out by default
    /// ([`Fuse::off_by_default`]).
    pub const APPLICABLE_RULES: [&'static str; 1] = ["soap-update"];

    /// The pass without the rules `skip` and with the rules `apply` where the target would
    /// leave them out (each one of [`Fuse::SKIPPABLE_RULES`], none in both lists; checked by
    /// [`crate::PassManager::new`]).
    pub fn with_rules(skip: &[String], apply: &[String]) -> Fuse {
        Fuse {
            skip_rules: skip.to_vec(),
            apply_rules: apply.to_vec(),
            ..Fuse::default()
        }
    }

    /// Why the target leaves rule `name` out by default, if it does: `soap-update` on a CUDA
    /// target, where the composed step (`project`'s GEMMs and the kernels generated from the
    /// rules) measured faster than the hand-written `soap_update` and needs less memory (H200:
    /// 1.056× the step rate and 1.05 GiB less at LLaMA 1.44B, 1.012× and 0.43 GiB less at
    /// GPT-2 124M; BENCHMARKS.md, "Element-wise update kernels"). The CPU engine keeps the op, its
    /// reference `optim::soap_update` (the two agree bit for bit there).
    pub fn off_by_default(name: &str, target: &TargetConfig) -> Option<&'static str> {
        match (name, target) {
            ("soap-update", TargetConfig::Cuda { .. }) => Some(
                "on a CUDA target the composed SOAP step is faster than soap_update (H200, \
                 BENCHMARKS.md)",
            ),
            _ => None,
        }
    }

    /// Whether the rule `name` runs on `target`: not skipped, and either on by default there
    /// or applied by `--apply-rule`.
    pub(crate) fn applies(&self, name: &str, target: &TargetConfig) -> bool {
        !self.skip_rules.iter().any(|r| r == name)
            && (Fuse::off_by_default(name, target).is_none()
                || self.apply_rules.iter().any(|r| r == name))
    }

    /// The report of the last run.
    pub fn report(&self) -> &FuseReport {
        &self.report
    }

    /// The egg rules: builds one term per `bias_add` of a single-reader GEMM product and per
    /// `attention_backward`, plus each `attention` forward (its e-class holding its output
    /// value), runs the rules, and rewrites each root instruction whose cheapest term is fused.
    fn rewrite(&mut self, m: &mut Module, target: FuseTarget) -> Result<(), PassError> {
        let name = |m: &Module, v: ValueId| Symbol::from(m.display_value(v));
        let mut shapes: HashMap<Symbol, (usize, usize)> = HashMap::new();
        let mut eg = EGraph::<Dataflow, ()>::default();
        let mut candidates = Vec::new();
        let insts: Vec<_> = [Section::Forward, Section::Backward]
            .iter()
            .flat_map(|&s| m.section(s).collect::<Vec<_>>())
            .collect();
        let tc_heads = |m: &Module, qkv: ValueId, n_heads: usize| {
            rank2(m, qkv).is_some_and(|(_, w)| {
                n_heads > 0 && w / 3 / n_heads <= schedule::BF16_ATTENTION_MAX_HEAD_DIM
            })
        };
        for id in insts {
            let inst = m.inst(id);
            match inst.op {
                Op::BiasAdd if inst.args.len() == 2 => {
                    let (x, bias) = (inst.args[0], inst.args[1]);
                    let def = m.inst(m.value(x).def);
                    let Op::MatMul { trans_a, trans_b } = def.op else {
                        continue;
                    };
                    let readers = m.uses(x).len();
                    if readers != 1 || def.section != inst.section {
                        let why = format!("{} has {readers} readers", m.display_value(x));
                        self.report
                            .blocked
                            .push((m.display_value(inst.results[0]), why));
                        continue;
                    }
                    let (a, b) = (def.args[0], def.args[1]);
                    for v in [a, b] {
                        if let Some(s) = rank2(m, v) {
                            shapes.insert(name(m, v), s);
                        }
                    }
                    let ta = eg.add(Dataflow::Flag(trans_a));
                    let tb = eg.add(Dataflow::Flag(trans_b));
                    let av = eg.add(Dataflow::Value(name(m, a)));
                    let bv = eg.add(Dataflow::Value(name(m, b)));
                    let mm = eg.add(Dataflow::MatMul([ta, tb, av, bv]));
                    let bs = eg.add(Dataflow::Value(name(m, bias)));
                    let root = eg.add(Dataflow::BiasAdd([mm, bs]));
                    candidates.push(Candidate {
                        inst: id,
                        root,
                        product: m.display_value(x),
                    });
                }
                Op::Attention {
                    batch,
                    seq_len,
                    n_heads,
                } if target.bf16_attention
                    && inst.results.len() == 1
                    && tc_heads(m, inst.args[0], n_heads) =>
                {
                    let g = eg.add(Dataflow::Value(geometry(batch, seq_len, n_heads)));
                    let q = eg.add(Dataflow::Value(name(m, inst.args[0])));
                    let fwd = eg.add(Dataflow::Attention([g, q]));
                    let out = eg.add(Dataflow::Value(name(m, inst.results[0])));
                    eg.union(fwd, out);
                }
                Op::AttentionBackward {
                    batch,
                    seq_len,
                    n_heads,
                } if target.bf16_attention && inst.args.len() == 2 => {
                    let g = eg.add(Dataflow::Value(geometry(batch, seq_len, n_heads)));
                    let d = eg.add(Dataflow::Value(name(m, inst.args[0])));
                    let q = eg.add(Dataflow::Value(name(m, inst.args[1])));
                    let root = eg.add(Dataflow::AttentionBackward([g, d, q]));
                    candidates.push(Candidate {
                        inst: id,
                        root,
                        product: String::new(),
                    });
                }
                _ => {}
            }
        }
        if candidates.is_empty() {
            return Ok(());
        }
        eg.rebuild();
        let rules = rules(target, Arc::new(shapes)).map_err(invalid)?;
        let runner = Runner::<Dataflow, ()>::default()
            .with_iter_limit(RUNNER_LIMITS.0)
            .with_node_limit(RUNNER_LIMITS.1)
            .with_time_limit(RUNNER_LIMITS.2)
            .with_egraph(eg)
            .run(&rules);
        self.report.stop_reason = runner.stop_reason.as_ref().map(|r| format!("{r:?}"));
        let extractor = Extractor::new(&runner.egraph, KernelCost);
        for c in &candidates {
            let (_, best) = extractor.find_best(runner.egraph.find(c.root));
            let flag_of = |id: &Id| match best[*id] {
                Dataflow::Flag(f) => Ok(f),
                ref other => Err(invalid(format!("expected a flag leaf, found {other:?}"))),
            };
            let value_of = |m: &Module, id: &Id| match &best[*id] {
                Dataflow::Value(s) => s
                    .as_str()
                    .strip_prefix('%')
                    .and_then(|n| m.value_by_name(n))
                    .ok_or_else(|| invalid(format!("unknown value {s} in an extracted term"))),
                other => Err(invalid(format!("expected a value leaf, found {other:?}"))),
            };
            let root_op = m.inst(c.inst).op.clone();
            match (best.as_ref().last(), &root_op) {
                (Some(Dataflow::MatMulBias([ta, tb, a, b, bias])), Op::BiasAdd) => {
                    let op = Op::MatMulBias {
                        trans_a: flag_of(ta)?,
                        trans_b: flag_of(tb)?,
                    };
                    let args = [value_of(m, a)?, value_of(m, b)?, value_of(m, bias)?];
                    m.replace_inst(c.inst, op, &args);
                    let result = m.display_value(m.inst(c.inst).results[0]);
                    self.report.bias_epilogues.push((result, c.product.clone()));
                }
                (Some(Dataflow::BiasAdd(_)), Op::BiasAdd) => {
                    let result = m.display_value(m.inst(c.inst).results[0]);
                    self.report
                        .blocked
                        .push((result, "operand rows not 16-byte aligned for bf16".into()));
                }
                (
                    Some(Dataflow::AttentionBackwardSaved([_, dout, qkv, fwd])),
                    Op::AttentionBackward { .. },
                ) => {
                    let (dout, qkv, out) =
                        (value_of(m, dout)?, value_of(m, qkv)?, value_of(m, fwd)?);
                    let forward = m.value(out).def;
                    let lse = match m.inst(forward).results.get(1) {
                        Some(&l) => l,
                        None => {
                            let Op::Attention {
                                batch,
                                seq_len,
                                n_heads,
                            } = m.inst(forward).op
                            else {
                                return Err(invalid(format!(
                                    "{} is not an attention output",
                                    m.display_value(out)
                                )));
                            };
                            let hint = format!("{}.lse", m.value(out).name);
                            let ty = ir::TensorType::f32([batch * n_heads * seq_len]);
                            m.add_result(forward, &hint, ty)
                        }
                    };
                    m.replace_inst(c.inst, root_op.clone(), &[dout, qkv, out, lse]);
                    let dqkv = m.display_value(m.inst(c.inst).results[0]);
                    self.report
                        .attention_saved
                        .push((dqkv, m.display_value(out)));
                }
                (Some(Dataflow::AttentionBackward(_)), Op::AttentionBackward { .. }) => {}
                (other, op) => {
                    return Err(invalid(format!(
                        "extracted {other:?} for a `{}` root",
                        op.name()
                    )))
                }
            }
        }
        m.remove_dead();
        Ok(())
    }

    /// `bf16-output`: marks the outputs that only GEMMs read (see the module docs).
    fn bf16_outputs(&mut self, m: &mut Module, target: FuseTarget) {
        if !target.bf16_gemms {
            return;
        }
        // To a fixed point: a reader's condition can depend on another value's dtype (the
        // logits may be bf16 once the gradient their backward writes is), and marks only grow.
        loop {
            let mut marked = Vec::new();
            for s in [Section::Forward, Section::Backward] {
                for id in m.section(s) {
                    let inst = m.inst(id);
                    let fits = match inst.op {
                        Op::LayerNorm { .. } => inst
                            .args
                            .first()
                            .and_then(|&x| rank2(m, x))
                            .is_some_and(|(_, c)| c <= schedule::BF16_LAYERNORM_MAX_C),
                        Op::Attention { n_heads, .. } => {
                            target.bf16_attention
                                && inst.args.first().and_then(|&q| rank2(m, q)).is_some_and(
                                    |(_, w)| {
                                        n_heads > 0
                                            && w / 3 / n_heads
                                                <= schedule::BF16_ATTENTION_MAX_HEAD_DIM
                                    },
                                )
                        }
                        Op::Gelu
                        | Op::SwiGlu
                        | Op::SwiGluBackward
                        | Op::GeluBackward
                        | Op::RmsNorm { .. }
                        | Op::Rope { .. }
                        | Op::RopeBackward { .. }
                        | Op::MatMul { .. }
                        | Op::CrossEntropyBackward => true,
                        // The bias epilogue rounds in the GEMM (cuBLASLt, bf16 D): rows of a
                        // multiple of 8 bf16 (16 bytes), as its alignment wants.
                        Op::MatMulBias { .. } => inst
                            .results
                            .first()
                            .and_then(|&o| rank2(m, o))
                            .is_some_and(|(_, p)| p % 8 == 0),
                        _ => false,
                    };
                    let Some(&out) = inst.results.first().filter(|_| fits) else {
                        continue;
                    };
                    let uses = m.uses(out);
                    // Whether an attention reader runs on the tensor-core kernels, which read
                    // qkv and dout in bf16 (they cast f32 ones per call otherwise).
                    let tc = |r: &ir::Inst| match r.op {
                        Op::Attention { n_heads, .. } | Op::AttentionBackward { n_heads, .. } => {
                            let qkv = if matches!(r.op, Op::Attention { .. }) {
                                0
                            } else {
                                1
                            };
                            target.bf16_attention
                                && r.args.get(qkv).and_then(|&q| rank2(m, q)).is_some_and(
                                    |(_, w)| {
                                        n_heads > 0
                                            && w / 3 / n_heads
                                                <= schedule::BF16_ATTENTION_MAX_HEAD_DIM
                                    },
                                )
                        }
                        _ => false,
                    };
                    let gemm_only = !uses.is_empty()
                        && uses.iter().all(|&u| {
                            let r = m.inst(u);
                            // Positions at which `out` may be read in bf16.
                            let ok = |i: usize| match r.op {
                                Op::MatMul { .. } | Op::MatMulBias { .. } => i < 2,
                                // qkv; dout, qkv and the saved forward output.
                                Op::Attention { .. } => i == 0 && tc(r),
                                Op::AttentionBackward { .. } => i == 2 || (i < 2 && tc(r)),
                                // The activation kernels read x (and the backward's dout,
                                // at 0) in either dtype.
                                Op::SwiGlu | Op::Gelu => i == 0,
                                Op::SwiGluBackward | Op::GeluBackward => i < 2,
                                // A bias gradient's column sums (fp32 sums of the bf16 values).
                                Op::SumRows => i == 0,
                                // The logits, where the backward writes a bf16 gradient.
                                Op::CrossEntropy => i == 0,
                                Op::CrossEntropyBackward => {
                                    i == 0
                                        && r.results
                                            .first()
                                            .is_some_and(|&d| m.value(d).ty.dtype == DType::Bf16)
                                }
                                _ => false,
                            };
                            matches!(r.section, Section::Forward | Section::Backward)
                                && r.args.iter().enumerate().all(|(i, &a)| a != out || ok(i))
                        });
                    if gemm_only && m.value(out).ty.dtype == DType::F32 {
                        marked.push((out, inst.op.name()));
                    }
                }
            }
            if marked.is_empty() {
                break;
            }
            for (v, op) in marked {
                m.set_dtype(v, DType::Bf16);
                self.report.bf16_outputs.push((m.display_value(v), op));
            }
        }
    }

    /// Whether `bf16-cast` casts each weight once per step ([`ir::WeightCasts`]): `once`, or
    /// `auto` without a `gpu_memory` budget and without rematerialisation.
    pub fn weight_casts_once(config: &ir::config::Config) -> bool {
        config.weight_casts_once()
    }

    /// `bf16-cast`: a bf16 `cast` of every f32 GEMM operand, once per section, before its first
    /// GEMM reader there; with `once` ([`Fuse::weight_casts_once`]) a parameter's forward cast
    /// also serves its backward GEMMs (see the module docs).
    fn bf16_casts(&mut self, m: &mut Module, target: FuseTarget) {
        if !target.bf16_gemms {
            return;
        }
        let once = Fuse::weight_casts_once(&m.config);
        self.report.weight_casts_once = Some(once);
        let params: std::collections::HashSet<ValueId> = m.parameters().into_iter().collect();
        // The forward's casts of parameters, which the backward reads under `once`.
        let mut kept: HashMap<ValueId, ValueId> = HashMap::new();
        for (section, label) in [
            (Section::Forward, "forward"),
            (Section::Backward, "backward"),
        ] {
            let gemms: Vec<ir::InstId> = m
                .section(section)
                .filter(|&i| matches!(m.inst(i).op, Op::MatMul { .. } | Op::MatMulBias { .. }))
                .collect();
            let mut casts: HashMap<ValueId, ValueId> = match section {
                Section::Backward if once => kept.clone(),
                _ => HashMap::new(),
            };
            for g in gemms {
                let inst = m.inst(g).clone();
                let mut args = inst.args.clone();
                // A bf16 `mat_mul_bias` output takes a bf16 bias too: cuBLASLt's bias epilogue
                // reads the bias in D's type (as PyTorch's autocast rounds a linear's bias).
                let bf16_bias = matches!(inst.op, Op::MatMulBias { .. })
                    && inst
                        .results
                        .first()
                        .is_some_and(|&o| m.value(o).ty.dtype == DType::Bf16);
                let operands = if bf16_bias { 3 } else { 2 };
                for arg in args.iter_mut().take(operands) {
                    let v = m.value(*arg);
                    if v.ty.dtype != DType::F32 {
                        continue;
                    }
                    let cast = match casts.get(arg) {
                        Some(&c) => {
                            if section == Section::Backward
                                && kept.get(arg) == Some(&c)
                                && !self.report.kept_casts.iter().any(|k| k.0 == c)
                            {
                                self.report.kept_casts.push((c, m.display_value(c)));
                            }
                            c
                        }
                        None => {
                            let ty = ir::TensorType {
                                dtype: DType::Bf16,
                                shape: v.ty.shape.clone(),
                            };
                            let hint = format!("{}.bf16", v.name);
                            let c = m.insert1_before(g, section, Op::Cast, &[*arg], &hint, ty);
                            self.report.bf16_casts.push((
                                m.display_value(*arg),
                                m.display_value(c),
                                label,
                            ));
                            casts.insert(*arg, c);
                            if section == Section::Forward && params.contains(arg) {
                                kept.insert(*arg, c);
                            }
                            c
                        }
                    };
                    *arg = cast;
                }
                if args != inst.args {
                    m.replace_inst(g, inst.op.clone(), &args);
                }
            }
        }
    }
}

impl Fuse {
    /// `sum-rows-cast`: a `sum_rows x` (a bias gradient) and a `cast x` (x's bf16 copy for
    /// its GEMMs) of the same f32 value in one section become one `sum_rows_cast x` at the
    /// `sum_rows`'s place, defining both values (the copy keeps its name) — one read of x
    /// instead of two. Only where the `sum_rows` comes before every reader of the copy.
    fn sum_rows_casts(&mut self, m: &mut Module) {
        for section in [Section::Forward, Section::Backward] {
            let order: Vec<ir::InstId> = m.section(section).collect();
            let pos = |i: ir::InstId| order.iter().position(|&o| o == i);
            let mut sums: HashMap<ValueId, ir::InstId> = HashMap::new();
            let mut pairs = Vec::new();
            for &i in &order {
                let inst = m.inst(i);
                match inst.op {
                    Op::SumRows => {
                        sums.entry(inst.args[0]).or_insert(i);
                    }
                    Op::Cast => {
                        if let Some(&s) = sums.get(&inst.args[0]) {
                            pairs.push((s, i));
                        }
                    }
                    _ => {}
                }
            }
            for (s, c) in pairs {
                let (x, copy) = (m.inst(c).args[0], m.inst(c).results[0]);
                let users = m.uses(copy);
                let Some(at) = pos(s) else { continue };
                if users.iter().any(|&u| pos(u).is_none_or(|p| p <= at)) {
                    continue;
                }
                let ty = m.value(copy).ty.clone();
                m.replace_inst(s, Op::SumRowsCast, &[x]);
                let fused = m.add_result(s, &m.value(copy).name.clone(), ty);
                for u in users {
                    let args: Vec<ValueId> = m
                        .inst(u)
                        .args
                        .iter()
                        .map(|&a| if a == copy { fused } else { a })
                        .collect();
                    let op = m.inst(u).op.clone();
                    m.replace_inst(u, op, &args);
                }
                m.swap_names(fused, copy);
                self.report.sum_rows_casts.push((
                    m.display_value(x),
                    m.display_value(m.inst(s).results[0]),
                    m.display_value(fused),
                ));
            }
        }
        m.remove_dead();
    }
}

impl Fuse {
    /// `clip-into-update` (CUDA targets): when every gradient a `clip_grad_norm` clips is read
    /// after it only by `adam_w` updates (as their `grad`), the clip gets a second result
    /// `scale` (f32 `[1]`: its factor, 1 when not clipping) instead of scaling the gradients in
    /// place, and each update reads `grad · scale` — one pass over the gradients fewer. All or
    /// nothing: with any other reader (SOAP's updates and factor accumulation) the clip stays.
    fn clip_into_update(&mut self, m: &mut Module) {
        let order: Vec<ir::InstId> = m.insts().collect();
        let pos = |i: ir::InstId| order.iter().position(|&o| o == i);
        let Some(clip) = order
            .iter()
            .copied()
            .find(|&i| matches!(m.inst(i).op, Op::ClipGradNorm { .. }))
        else {
            return;
        };
        if m.inst(clip).results.len() != 1 {
            return;
        }
        let at = pos(clip);
        let mut updates = Vec::new();
        for &g in &m.inst(clip).args {
            for u in m.uses(g) {
                let inst = m.inst(u);
                match inst.op {
                    _ if u == clip => {}
                    Op::GradOf => {}
                    Op::AdamW { .. }
                        if inst.args.len() == 4 && inst.args[1] == g && pos(u) > at =>
                    {
                        updates.push(u)
                    }
                    _ => {
                        self.report.clip_into_update = Some(Err(format!(
                            "{} is also read by {}",
                            m.display_value(g),
                            inst.op.name()
                        )));
                        return;
                    }
                }
            }
        }
        let ty = ir::TensorType {
            dtype: DType::F32,
            shape: vec![1],
        };
        let scale = m.add_result(clip, "clip_scale", ty);
        for &u in &updates {
            let mut args = m.inst(u).args.clone();
            args.push(scale);
            let op = m.inst(u).op.clone();
            m.replace_inst(u, op, &args);
        }
        self.report.clip_into_update = Some(Ok((m.display_value(scale), updates.len())));
    }
}

/// The spelling of the spec's `weight_casts`, with what `auto` chose.
fn weight_casts_name(config: &ir::config::Config) -> String {
    match &config.target {
        TargetConfig::Cuda {
            weight_casts: ir::WeightCasts::Auto,
            ..
        } => format!(
            "auto: {}",
            if Fuse::weight_casts_once(config) {
                "no gpu_memory budget, no rematerialisation"
            } else {
                "a gpu_memory budget or rematerialisation"
            }
        ),
        TargetConfig::Cuda { weight_casts, .. } => weight_casts.name().to_string(),
        TargetConfig::Cpu { .. } => "-".to_string(),
    }
}

impl Pass for Fuse {
    fn name(&self) -> &'static str {
        "fuse"
    }

    fn run(&mut self, module: &mut Module, _cx: &mut PassContext) -> Result<String, PassError> {
        if module.section(Section::Forward).next().is_none() {
            return Err(invalid("no forward program: run `expand-model` first"));
        }
        let target = FuseTarget::of(&module.config.target);
        self.report = FuseReport {
            target: Some(target),
            ..FuseReport::default()
        };
        self.rewrite(module, target)?;
        self.composed_updates(module)?;
        self.bf16_outputs(module, target);
        self.bf16_casts(module, target);
        self.sum_rows_casts(module);
        if matches!(module.config.target, TargetConfig::Cuda { .. }) {
            self.clip_into_update(module);
        }
        let r = &self.report;
        Ok(format!(
            "{} soap updates, {} shampoo updates, {} kl-shampoo updates, {} bias epilogues ({} blocked), {} saved attention statistics, {} bf16 outputs, {} bf16 casts, {} sum-rows casts, {} updates read the clip factor",
            r.soap_updates,
            r.shampoo_updates,
            r.kl_shampoo_updates,
            r.bias_epilogues.len(),
            r.blocked.len(),
            r.attention_saved.len(),
            r.bf16_outputs.len(),
            r.bf16_casts.len(),
            r.sum_rows_casts.len(),
            match &r.clip_into_update {
                Some(Ok((_, n))) => *n,
                _ => 0,
            }
        ))
    }

    fn dump_extra(&self, module: &Module, _cx: &PassContext) -> Option<String> {
        let r = &self.report;
        let mut s = String::from("; fuse report\n");
        if let Some(t) = r.target {
            s.push_str(&format!(
                "; target: bf16 GEMMs {}, bf16 attention outputs {}\n",
                t.bf16_gemms, t.bf16_attention
            ));
        }
        if let Some(reason) = &r.stop_reason {
            s.push_str(&format!("; e-graph runner stopped: {reason}\n"));
        }
        if r.soap_updates > 0 {
            s.push_str(&format!(
                "; soap-update: {} composed SOAP steps (project, moments, project back, step) \
                 -> soap_update\n",
                r.soap_updates
            ));
        }
        for rule in &self.skip_rules {
            s.push_str(&format!(
                "; {rule}: skipped (--skip-rule): those steps stay composed\n"
            ));
        }
        // The optimizers whose composed steps the module has (a rule's step is named after its
        // optimizer): a rule left out by default is reported only where it had work.
        let composed: Vec<&str> = module
            .section(Section::Optimizer)
            .filter_map(|i| match &module.inst(i).op {
                Op::ElementwiseUpdate { rule } => Some(rule.optimizer.as_str()),
                _ => None,
            })
            .collect();
        for rule in Fuse::SKIPPABLE_RULES {
            let optimizer = rule.trim_end_matches("-update").replace('-', "_");
            let selected = match rule {
                "soap-update" => r.soap_updates,
                "shampoo-update" => r.shampoo_updates,
                _ => r.kl_shampoo_updates,
            };
            if selected == 0 && !composed.contains(&optimizer.as_str()) {
                continue;
            }
            if let Some(why) = Fuse::off_by_default(rule, &module.config.target) {
                if !self.skip_rules.iter().any(|r| r == rule) {
                    s.push_str(&match self.apply_rules.iter().any(|r| r == rule) {
                        true => format!("; {rule}: applied (--apply-rule), though {why}\n"),
                        false => format!(
                            "; {rule}: not applied: {why}; those steps stay composed \
                             (--apply-rule {rule} selects the op)\n"
                        ),
                    });
                }
            }
        }
        for (param, why) in &r.soap_blocked {
            s.push_str(&format!("; soap-update blocked for {param}: {why}\n"));
        }
        if r.shampoo_updates > 0 {
            s.push_str(&format!(
                "; shampoo-update: {} composed Shampoo steps (factor update, moments, \
                 precondition, graft, step) -> shampoo_update\n",
                r.shampoo_updates
            ));
        }
        for (param, why) in &r.shampoo_blocked {
            s.push_str(&format!("; shampoo-update blocked for {param}: {why}\n"));
        }
        if r.kl_shampoo_updates > 0 {
            s.push_str(&format!(
                "; kl-shampoo-update: {} composed KL-Shampoo steps (momentum, project, kl_scale, \
                 project back, step, factor update) -> kl_shampoo_update\n",
                r.kl_shampoo_updates
            ));
        }
        for (param, why) in &r.kl_shampoo_blocked {
            s.push_str(&format!("; kl-shampoo-update blocked for {param}: {why}\n"));
        }
        for (result, product) in &r.bias_epilogues {
            s.push_str(&format!(
                "; bias-epilogue: {result} = mat_mul_bias (product {product} removed)\n"
            ));
        }
        for (result, why) in &r.blocked {
            s.push_str(&format!("; bias-epilogue blocked for {result}: {why}\n"));
        }
        for (dqkv, out) in &r.attention_saved {
            s.push_str(&format!(
                "; attention-saved: {dqkv} reads {out} and its lse from the forward\n"
            ));
        }
        for (value, op) in &r.bf16_outputs {
            s.push_str(&format!("; bf16-output: {value} ({op})\n"));
        }
        if let Some(once) = r.weight_casts_once {
            s.push_str(&match once {
                true => format!(
                    "; bf16-cast: weights cast once per step (weight_casts {}): {} forward \
                     copies kept for the backward\n",
                    weight_casts_name(&module.config),
                    r.kept_casts.len()
                ),
                false => format!(
                    "; bf16-cast: weights cast in the forward and again in the backward \
                     (weight_casts {})\n",
                    weight_casts_name(&module.config)
                ),
            });
        }
        for (value, cast, section) in &r.bf16_casts {
            s.push_str(&format!("; bf16-cast: {cast} = cast {value} ({section})\n"));
        }
        for (_, cast) in &r.kept_casts {
            s.push_str(&format!("; bf16-cast: {cast} kept for the backward\n"));
        }
        match &r.clip_into_update {
            Some(Ok((scale, n))) => s.push_str(&format!(
                "; clip-into-update: clip_grad_norm writes {scale}; {n} adam_w read grad · {scale}\n"
            )),
            Some(Err(why)) => s.push_str(&format!("; clip-into-update blocked: {why}\n")),
            None => {}
        }
        for (x, sums, copy) in &r.sum_rows_casts {
            s.push_str(&format!(
                "; sum-rows-cast: {sums}, {copy} = sum_rows_cast {x} (one pass over {x})\n"
            ));
        }
        Some(s)
    }
}
