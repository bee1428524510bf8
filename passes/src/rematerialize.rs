//! `rematerialize`: optional activation recomputation, trading step time for activation memory.
//!
//! Every forward value the backward program reads is normally kept from its definition in the
//! forward to its last backward reader, so at the end of the forward the activations of every
//! layer are live at once. This pass recomputes a chosen set of them instead: for each backward
//! instruction that reads a chosen value it inserts, just before the first such reader, a copy
//! of the forward instruction that defines it (and, recursively, of the chosen values that
//! instruction reads), named `%<value>.remat`, and points the backward readers at the copies.
//! The originals then die at their last forward reader and `liveness` / `memory-planning`
//! give their bytes back. The copies run the same op on the same inputs, so on a deterministic
//! engine the gradients are bit-identical.
//!
//! The policy is the spec's `train { rematerialize = off | selective | layers }`
//! ([`ir::Rematerialize`], recorded in the plan's `train`):
//! - `selective`: outputs of normalisations (`layer_norm`, `rms_norm`) and activation functions
//!   (`gelu`, `swi_glu`) whose inputs the backward keeps anyway (a norm's input is read by its
//!   backward, an activation's input by the activation's backward). No GEMM is rerun.
//! - `layers`: every activation of transformer layer `i` (values named `h<i>.…` by
//!   `expand-model`, [`crate::expand_model::layer_of`]) except the values later layers read
//!   (the residual stream between layers) is recomputed at the start of layer `i`'s backward:
//!   per-layer checkpointing, about one extra forward per step.
//!
//! `--print-after rematerialize` prints the IR (the `.remat` copies sit in the backward section)
//! and a table of the recomputed values with their bytes and the GEMM FLOPs rerun.
use crate::expand_model::layer_of;
use crate::liveness::human_bytes;
use crate::{Pass, PassContext, PassError};
use ir::{InstId, Module, Op, Rematerialize as Policy, Section, ValueId};
use std::collections::{HashMap, HashSet};
use std::fmt::Write;

/// What the pass did, for its summary line and `--print-after`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RematReport {
    /// The policy applied.
    pub policy: Policy,
    /// Forward values whose backward readers now read a recomputed copy: `(name, bytes)`, in
    /// program order.
    pub recomputed: Vec<(String, usize)>,
    /// Forward instructions copied into the backward program.
    pub copies: usize,
    /// FLOPs of the GEMMs (`2·m·k·n` each) the copies rerun per step (attention's score and
    /// weighted-sum products included, counted unmasked).
    pub rerun_flops: f64,
}

impl RematReport {
    /// Bytes of the recomputed values (what no longer lives from forward to backward).
    pub fn bytes(&self) -> usize {
        self.recomputed.iter().map(|(_, b)| b).sum()
    }
}

/// The `rematerialize` pass.
#[derive(Default)]
pub struct Rematerialize {
    report: RematReport,
}

impl Rematerialize {
    /// What the last run did.
    pub fn report(&self) -> &RematReport {
        &self.report
    }
}

impl Pass for Rematerialize {
    fn name(&self) -> &'static str {
        "rematerialize"
    }

    fn run(&mut self, module: &mut Module, _cx: &mut PassContext) -> Result<String, PassError> {
        let policy = module.config.train.rematerialize;
        self.report = rematerialize(module, policy)?;
        let r = &self.report;
        Ok(match policy {
            Policy::Off => "off: every activation the backward reads is kept".into(),
            _ => format!(
                "{policy}: {} value(s) recomputed by {} copied op(s), {} of activations recomputed \
                 in the backward, {:.2} GFLOP of GEMMs rerun per step",
                r.recomputed.len(),
                r.copies,
                human_bytes(r.bytes()),
                r.rerun_flops / 1e9
            ),
        })
    }

    fn dump_extra(&self, _module: &Module, _cx: &PassContext) -> Option<String> {
        let r = &self.report;
        let mut s = format!(
            "; rematerialize = {}: {} value(s), {}, {:.2} GFLOP rerun per step\n",
            r.policy,
            r.recomputed.len(),
            human_bytes(r.bytes()),
            r.rerun_flops / 1e9
        );
        for (name, bytes) in &r.recomputed {
            let _ = writeln!(s, ";   %{name:<32} {:>12}", human_bytes(*bytes));
        }
        Some(s)
    }
}

/// Applies `policy` to `module` (after `fuse`, before `liveness`). `Off` changes nothing.
///
/// Errors: a chosen value defined by an instruction that cannot be rerun (in-place, state,
/// input) — a bug in the policy, reported rather than miscompiled.
pub fn rematerialize(module: &mut Module, policy: Policy) -> Result<RematReport, PassError> {
    let mut report = RematReport {
        policy,
        ..Default::default()
    };
    if policy == Policy::Off {
        return Ok(report);
    }
    let chosen = choose(module, policy);
    let backward: Vec<InstId> = module.section(Section::Backward).collect();
    let mut copies: HashMap<ValueId, ValueId> = HashMap::new();
    let mut recomputed: Vec<ValueId> = Vec::new();
    for reader in backward {
        let inst = module.inst(reader).clone();
        if !inst.args.iter().any(|a| chosen.contains(a)) {
            continue;
        }
        let mut args = inst.args.clone();
        for a in args.iter_mut() {
            if chosen.contains(a) {
                if !copies.contains_key(a) {
                    recomputed.push(*a);
                }
                *a = copy_of(module, *a, reader, &chosen, &mut copies, &mut report)?;
            }
        }
        module.replace_inst(reader, inst.op, &args);
    }
    // A forward attention whose softmax statistics only its (now recomputed) backward read
    // stops saving them: its `lse` goes, and with it the engine's saved copy of its qkv.
    let originals: Vec<ValueId> = copies.keys().copied().collect();
    for v in originals {
        let def = module.value(v).def;
        let inst = module.inst(def);
        if matches!(inst.op, Op::Attention { .. }) && inst.results.len() == 2 {
            let lse = inst.results[1];
            module.remove_unused_result(def, lse);
        }
    }
    // Values recomputed only as inputs of other copies are listed too: each lost its
    // backward lifetime.
    let mut listed: HashSet<ValueId> = recomputed.iter().copied().collect();
    let mut order: Vec<ValueId> = copies.keys().copied().collect();
    order.sort();
    for v in order {
        if listed.insert(v) {
            recomputed.push(v);
        }
    }
    recomputed.sort();
    report.recomputed = recomputed
        .into_iter()
        .map(|v| {
            let d = module.value(v);
            (d.name.clone(), d.ty.size_bytes())
        })
        .collect();
    Ok(report)
}

/// The forward values `policy` recomputes.
fn choose(module: &Module, policy: Policy) -> HashSet<ValueId> {
    let forward: Vec<InstId> = module.section(Section::Forward).collect();
    let mut chosen = HashSet::new();
    match policy {
        Policy::Off => {}
        Policy::Selective => {
            for &i in &forward {
                let inst = module.inst(i);
                let cheap = matches!(
                    inst.op,
                    Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::Gelu | Op::SwiGlu
                );
                // Its inputs must be kept anyway (read by some backward instruction), or the
                // copy would keep a bigger tensor alive than the one it saves.
                if cheap
                    && inst.results.len() == 1
                    && inst.args.iter().all(|&a| kept_anyway(module, a))
                {
                    chosen.insert(inst.results[0]);
                }
            }
        }
        Policy::Layers => {
            let layer_of_inst = |i: InstId| {
                module
                    .inst(i)
                    .results
                    .first()
                    .and_then(|&r| layer_of(&module.value(r).name))
            };
            for &i in &forward {
                let inst = module.inst(i);
                let Some(layer) = layer_of_inst(i) else {
                    continue;
                };
                if inst.op.is_in_place() || inst.results.is_empty() {
                    continue;
                }
                for &r in &inst.results {
                    // A value some forward instruction outside its layer reads is a
                    // checkpoint (the residual stream); the rest is recomputed.
                    let boundary = module.uses(r).into_iter().any(|u| {
                        module.inst(u).section == Section::Forward
                            && layer_of_inst(u) != Some(layer)
                    });
                    if !boundary {
                        chosen.insert(r);
                    }
                }
            }
        }
    }
    chosen
}

/// Whether `v` lives into the backward program whatever this pass does: state, inputs, or a
/// forward value some backward instruction reads.
fn kept_anyway(module: &Module, v: ValueId) -> bool {
    let def = module.inst(module.value(v).def);
    def.section == Section::State
        || module
            .uses(v)
            .into_iter()
            .any(|u| module.inst(u).section == Section::Backward)
}

/// The recomputed copy of `v` (inserting it, and the copies of the chosen values its defining
/// instruction reads, just before `before`).
fn copy_of(
    module: &mut Module,
    v: ValueId,
    before: InstId,
    chosen: &HashSet<ValueId>,
    copies: &mut HashMap<ValueId, ValueId>,
    report: &mut RematReport,
) -> Result<ValueId, PassError> {
    if let Some(&c) = copies.get(&v) {
        return Ok(c);
    }
    let def_id = module.value(v).def;
    let def = module.inst(def_id).clone();
    if def.op.is_in_place() || matches!(def.op, Op::State { .. } | Op::Input { .. }) {
        return Err(PassError::Invalid {
            pass: "rematerialize",
            message: format!(
                "{} is defined by `{}`, which cannot be rerun",
                module.display_value(v),
                def.op.name()
            ),
        });
    }
    let mut args = def.args.clone();
    for a in args.iter_mut() {
        if chosen.contains(a) {
            *a = copy_of(module, *a, before, chosen, copies, report)?;
        }
    }
    report.rerun_flops += gemm_flops(module, &def.op, &def.args, &def.results);
    let results = def
        .results
        .iter()
        .map(|&r| {
            let d = module.value(r);
            (format!("{}.remat", d.name), d.ty.clone())
        })
        .collect();
    let (_, new) = module.insert_before(before, Section::Backward, def.op.clone(), &args, results);
    report.copies += 1;
    for (&old, &n) in def.results.iter().zip(&new) {
        copies.insert(old, n);
    }
    Ok(copies[&v])
}

/// `2·m·k·n` of a GEMM (`mat_mul`, `mat_mul_bias`), `4·B·T²·C` of an attention; 0 otherwise.
fn gemm_flops(module: &Module, op: &Op, args: &[ValueId], results: &[ValueId]) -> f64 {
    let shape = |v: ValueId| module.value(v).ty.shape.clone();
    match op {
        Op::MatMul { trans_a, .. } | Op::MatMulBias { trans_a, .. } => {
            let (Some(&a), Some(&out)) = (args.first(), results.first()) else {
                return 0.0;
            };
            let (a, out) = (shape(a), shape(out));
            let k = if *trans_a { a.first() } else { a.get(1) };
            match (out.as_slice(), k) {
                ([m, n], Some(&k)) => 2.0 * *m as f64 * k as f64 * *n as f64,
                _ => 0.0,
            }
        }
        Op::Attention { batch, seq_len, .. } => {
            let c = results
                .first()
                .and_then(|&o| shape(o).get(1).copied())
                .unwrap_or(0);
            4.0 * *batch as f64 * (*seq_len as f64).powi(2) * c as f64
        }
        _ => 0.0,
    }
}
