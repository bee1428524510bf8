//! `accumulate-gradients`: gradient accumulation over micro-batches (`train { grad_accum = N }`).
//! With N ≥ 2 every parameter's gradient buffer `grad.W` becomes the step's total. Where one
//! GEMM alone writes it (the weights of linear layers: most of the bytes), that
//! [`Op::MatMul`] gets `micro_accumulate = 1/N` and accumulates into the total itself (cuBLAS
//! β = 0 on the first micro-batch, 1 after): no extra buffer and no extra pass over the
//! gradient. Otherwise the backward program writes a new step-local buffer `grad.W.micro`
//! instead, and right after the last backward op that touches it an [`Op::GradAccumulate`]
//! adds `micro / N` into the total (storing it on the step's first micro-batch). On the CPU
//! engine both round the product, then the scaled sum: the same bits either way (cuBLAS
//! applies α and β in its own epilogue, so on the GPU the two forms agree to rounding, not
//! bit for bit). The engine runs forward and backward
//! N times on consecutive batches, then the optimizer program, which reads the totals
//! unchanged — so clipping, every optimizer, refreshes and checkpoints see one averaged
//! gradient per step, as with one batch of N × `batch_size` sequences (the same mean up to the
//! order of additions).
//!
//! Memory: the totals are read before they are written on all micro-batches but the first, so
//! they persist (`schedule::memory`'s rules) — one extra f32 copy of the gradients beside
//! the micro-batch's step-local ones, which live only from their first backward write to their
//! accumulation. Activations are those of one micro-batch. With N = 1 the plan is unchanged.
//!
//! Works on the plan (after `lower`, before `tier-placement`): `--print-after
//! accumulate-gradients` lists the backward program with its accumulations.
use crate::prefetch_insertion::replace_operands;
use crate::{Pass, PassContext, PassError};
use ir::Module;
use schedule::{Buffer, BufferClass, BufferId, Init, Op, Plan};
use std::collections::HashMap;

/// The `accumulate-gradients` pass.
#[derive(Default)]
pub struct AccumulateGradients;

impl Pass for AccumulateGradients {
    fn name(&self) -> &'static str {
        "accumulate-gradients"
    }

    fn run(&mut self, module: &mut Module, cx: &mut PassContext) -> Result<String, PassError> {
        let plan = cx.plan.as_mut().ok_or_else(|| PassError::Invalid {
            pass: "accumulate-gradients",
            message: "no plan: run `lower` first".into(),
        })?;
        let n = module.config.train.grad_accum;
        if n <= 1 {
            return Ok("grad_accum = 1: one batch per step, nothing accumulated".into());
        }
        let k = accumulate(plan, n)?;
        Ok(format!(
            "{} gradient(s) accumulated over {n} micro-batches of {} x {} tokens: {} in their \
             GEMM, {} by grad_accumulate",
            k.in_gemm + k.added,
            plan.data.batch_size,
            plan.data.seq_len,
            k.in_gemm,
            k.added
        ))
    }

    fn dump_after(&self, _module: &Module, cx: &PassContext) -> String {
        let Some(plan) = &cx.plan else {
            return "; plan after accumulate-gradients: none".into();
        };
        let mut s = format!(
            "; backward program after accumulate-gradients (grad_accum = {}; runs once per \
             micro-batch)\n",
            plan.train.grad_accum
        );
        for (i, op) in plan.backward.iter().enumerate() {
            let names: Vec<String> = op
                .operands()
                .iter()
                .map(|(f, id)| format!("{f}=%{}", plan.buffer(*id).name))
                .collect();
            let scale = match op {
                Op::GradAccumulate { scale, .. }
                | Op::MatMul {
                    micro_accumulate: Some(scale),
                    ..
                } => format!(" scale={scale}"),
                _ => String::new(),
            };
            s.push_str(&format!(
                ";   backward[{i}] {} {}{scale}\n",
                op.name(),
                names.join(" ")
            ));
        }
        s
    }
}

fn invalid(message: String) -> PassError {
    PassError::Invalid {
        pass: "accumulate-gradients",
        message,
    }
}

/// Rewrites the one-batch `plan` for `micro_batches` (≥ 2) micro-batches a step and records
/// the number in `plan.train.grad_accum` (module docs).
///
/// # Errors
/// The plan already accumulates, fewer than 2 micro-batches, or a parameter's gradient is
/// touched outside the backward and optimizer programs (the forward, a host task), or not
/// written by the backward.
pub fn accumulate(plan: &mut Plan, micro_batches: u64) -> Result<Accumulated, PassError> {
    if plan.train.grad_accum != 1 {
        return Err(invalid("the plan already accumulates".into()));
    }
    if micro_batches < 2 {
        return Err(invalid(format!(
            "{micro_batches} micro-batches: nothing to accumulate"
        )));
    }
    plan.train.grad_accum = micro_batches;
    let scale = 1.0 / micro_batches as f64;
    let mut micro: HashMap<BufferId, BufferId> = HashMap::new();
    // Accumulations to issue after backward op i.
    let mut after: HashMap<usize, Vec<(BufferId, BufferId)>> = HashMap::new();
    let grads: Vec<BufferId> = plan.params.iter().map(|p| p.grad).collect();
    let mut fused = 0;
    for g in grads {
        let name = plan.buffer(g).name.clone();
        if plan
            .forward
            .iter()
            .any(|op| op.operands().iter().any(|&(_, id)| id == g))
            || plan
                .host_tasks
                .iter()
                .any(|t| t.operands().iter().any(|&(_, id)| id == g))
        {
            return Err(invalid(format!(
                "gradient `{name}` is used outside the backward and optimizer programs"
            )));
        }
        let Some(last) = plan
            .backward
            .iter()
            .rposition(|op| op.operands().iter().any(|&(_, id)| id == g))
        else {
            return Err(invalid(format!(
                "gradient `{name}` is not written by the backward program"
            )));
        };
        let b = plan.buffer(g).clone();
        if b.dtype != schedule::DType::F32 {
            return Err(invalid(format!("gradient `{name}` is not f32")));
        }
        // A gradient only one GEMM writes (every linear layer's weight): the GEMM
        // accumulates itself (cuBLAS β), with no micro-batch buffer and no extra pass.
        let touching = plan
            .backward
            .iter()
            .filter(|op| op.operands().iter().any(|&(_, id)| id == g))
            .count();
        if touching == 1 {
            if let Op::MatMul {
                a,
                b: rhs,
                out,
                accumulate: false,
                micro_accumulate: micro_acc @ None,
                ..
            } = &mut plan.backward[last]
            {
                if *out == g && *a != g && *rhs != g {
                    *micro_acc = Some(scale);
                    fused += 1;
                    continue;
                }
            }
        }
        let m = BufferId(plan.buffers.len() as u32);
        plan.buffers.push(Buffer {
            name: format!("{name}.micro"),
            class: BufferClass::Gradient,
            init: Init::Zeros,
            ..b
        });
        micro.insert(g, m);
        after.entry(last).or_default().push((m, g));
    }
    let old = std::mem::take(&mut plan.backward);
    for (i, op) in old.into_iter().enumerate() {
        plan.backward.push(replace_operands(&op, &micro)?);
        if let Some(list) = after.get(&i) {
            for &(m, g) in list {
                plan.backward.push(Op::GradAccumulate {
                    micro: m,
                    total: g,
                    scale,
                });
            }
        }
    }
    // One place per buffer again (what `lower` left; `memory-planning` shares them later),
    // keeping the spec's budgets.
    let unshared = schedule::MemoryPlan::unshared(&plan.buffers);
    plan.memory.slots = unshared.slots;
    plan.memory.arenas = unshared.arenas;
    Ok(Accumulated {
        in_gemm: fused,
        added: micro.len(),
    })
}

/// What [`accumulate`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accumulated {
    /// Gradients whose only backward GEMM accumulates itself (`MatMul::micro_accumulate`).
    pub in_gemm: usize,
    /// Gradients written to a micro-batch buffer and added by a `GradAccumulate`.
    pub added: usize,
}
