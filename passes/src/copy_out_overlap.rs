//! `copy-out-overlap`: lets the optimizer program's copies out of host-tier state run on into
//! the next step's forward.
//!
//! Under a device budget, `prefetch-insertion` brings each offloaded tensor (moments, master
//! weights) into a step-local staging buffer for its update and copies it back out right after.
//! The copies out of the last updates end the step: without this pass the CUDA engine waits
//! for its copy-out stream at every step's end, and the next forward starts only then. The
//! next step's forward does not read optimizer state in pinned host memory (parameters it
//! copies in aside, which wait by event), and it starts with few live bytes, so those copies
//! can finish while it runs — if their staging buffers' bytes are not reused by the forward's
//! first ops.
//!
//! This pass re-runs the placement of `memory-planning` with every staging buffer that a
//! `CopyOut` of the optimizer program reads (`schedule::Plan::optimizer_copy_out_sources`)
//! also kept apart from all buffers live in the next step's `forward[0..=k]`
//! (`memory_planning::Block::also`), for a `k` found by binary search (the largest where the
//! arena grows with `k`, which greedy placement does not guarantee) at which the
//! activations arena is no larger than `memory-planning` made it: the device need never grows
//! and the budget stays met. It records `k` as `schedule::MemoryPlan::carried_copy_outs`,
//! which `Plan::verify` checks against the offsets. The CUDA engine then ends a step without
//! waiting for the copy-out stream; a next-step op that touches bytes a pending copy out reads
//! or writes (an op after `forward[k]` reusing its staging bytes, a copy in of the same host
//! tensor) waits for that copy by event, and anything that reads state from outside the
//! programs (evaluation, checkpoints, `read_state`, the end of the run) waits for all of them.
//!
//! Nothing is carried when the plan has eigenbasis refresh tasks, NVMe-tier state or updates on
//! the host cores: their host-side work between steps reads host memory that pending copies
//! out would still be writing (`schedule::Plan::copy_out_carry_blocker`). The CPU engine runs
//! its ops one after another and is unaffected.
//!
//! Skippable (`--skip-pass copy-out-overlap`) to compare the two schedules: the same bits
//! either way; only when the copies finish changes.
use crate::memory_planning::{check_budgets, plan_memory_carrying, MemorySummary};
use crate::{Pass, PassContext, PassError};
use ir::Module;
use schedule::{ArenaKind, Op, Plan};

/// The `copy-out-overlap` pass. Needs the memory plan of `memory-planning`.
#[derive(Default)]
pub struct CopyOutOverlap;

/// What [`carry_copy_outs`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Carried {
    /// The forward position up to which staging buffers keep their bytes, if any.
    pub until: Option<usize>,
    /// Staging buffers held across the step boundary, and their bytes.
    pub buffers: usize,
    /// Their bytes.
    pub bytes: usize,
    /// Why nothing is carried (`until` is `None`).
    pub reason: Option<String>,
}

/// The first op of the forward that touches bytes an optimizer `CopyOut` reads or writes (one
/// of the two writing them), with that copy's position in the optimizer program: where the
/// next step's forward waits for the carried copies out (the copy-out stream runs them in
/// order, so for every copy up to that one). Parameters in pinned host memory make it the
/// forward's first copy in, which reads what the previous optimizer copied out. `None` when
/// no forward op waits for one.
pub fn first_forward_wait(plan: &Plan) -> Option<(usize, usize)> {
    let range = |id: schedule::BufferId| {
        let slot = plan.memory.slot(id)?;
        let bytes = plan.buffers.get(id.index())?.size_bytes();
        Some((slot.arena, slot.offset, slot.offset + bytes))
    };
    let touches = |op: &Op| -> Vec<((ArenaKind, usize, usize), bool)> {
        op.accesses()
            .into_iter()
            .filter_map(|(_, id, a)| range(id).map(|r| (r, a.writes())))
            .collect()
    };
    let outs: Vec<(usize, Vec<_>)> = plan
        .optimizer
        .iter()
        .enumerate()
        .filter(|(_, o)| matches!(o, Op::CopyOut { .. }))
        .map(|(i, o)| (i, touches(o)))
        .collect();
    plan.forward.iter().enumerate().find_map(|(p, op)| {
        let mine = touches(op);
        outs.iter()
            .rev()
            .find(|(_, theirs)| {
                mine.iter().any(|&((ka, sa, ea), wa)| {
                    theirs
                        .iter()
                        .any(|&((kb, sb, eb), wb)| ka == kb && sa < eb && sb < ea && (wa || wb))
                })
            })
            .map(|&(q, _)| (p, q))
    })
}

/// Places `plan`'s memory again with its optimizer copies out carried into the next step's
/// forward as far as the activations arena allows (binary search; see the module docs), replacing
/// `plan.memory` when any position is reachable. `plan` must carry the memory plan of
/// `memory-planning`.
pub fn carry_copy_outs(plan: &mut Plan) -> Carried {
    if let Some(why) = plan.copy_out_carry_blocker() {
        return Carried {
            reason: Some(why.into()),
            ..Carried::default()
        };
    }
    let residency = plan.residency();
    let sources = plan.optimizer_copy_out_sources(&residency);
    let (buffers, bytes) = sources
        .iter()
        .zip(&plan.buffers)
        .filter(|(s, _)| **s)
        .fold((0, 0), |(n, b), (_, buf)| (n + 1, b + buf.size_bytes()));
    if buffers == 0 {
        return Carried {
            reason: Some("no step-local staging buffer is copied out".into()),
            ..Carried::default()
        };
    }
    if plan.forward.is_empty() {
        return Carried {
            reason: Some("the plan has no forward program".into()),
            ..Carried::default()
        };
    }
    let before = plan.memory.arena_bytes(ArenaKind::Activations);
    let budgets = plan.memory.budgets.clone();
    // A `k` whose arena is no larger (binary search over `k + 1` in `0..=len`; 0 means
    // nothing carried).
    let (mut lo, mut hi) = (0usize, plan.forward.len());
    let mut best = None;
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        let m = plan_memory_carrying(plan, Some(mid - 1));
        if m.arena_bytes(ArenaKind::Activations) <= before {
            lo = mid;
            best = Some(m);
        } else {
            hi = mid - 1;
        }
    }
    let Some(mut memory) = best else {
        return Carried {
            reason: Some("the forward's first op already needs the staging buffers' bytes".into()),
            ..Carried::default()
        };
    };
    memory.budgets = budgets;
    plan.memory = memory;
    Carried {
        until: Some(lo - 1),
        buffers,
        bytes,
        reason: None,
    }
}

impl Pass for CopyOutOverlap {
    fn name(&self) -> &'static str {
        "copy-out-overlap"
    }

    fn run(&mut self, module: &mut Module, cx: &mut PassContext) -> Result<String, PassError> {
        let plan = cx.plan.as_mut().ok_or_else(|| PassError::Invalid {
            pass: "copy-out-overlap",
            message: "no plan: run `lower` and `memory-planning` first".into(),
        })?;
        let c = carry_copy_outs(plan);
        let Some(k) = c.until else {
            return Ok(format!(
                "nothing carried into the next step: {}",
                c.reason.unwrap_or_default()
            ));
        };
        check_budgets(plan)?;
        plan.verify().map_err(|e| PassError::Invalid {
            pass: "copy-out-overlap",
            message: format!("the placed plan fails verification (compiler bug): {e}"),
        })?;
        cx.memory = Some(MemorySummary::of(plan));
        let ms = crate::precond_scheduling::target_description(&module.config.target)
            .map(|d| d.host_tier_ms(c.bytes))
            .unwrap_or(f64::NAN);
        let waits = match first_forward_wait(plan) {
            Some((p, q)) => format!(
                "; forward[{p}] `{}` waits for the copies out up to optimizer[{q}]",
                plan.forward[p].name()
            ),
            None => String::new(),
        };
        Ok(format!(
            "copies out of {} staging buffers ({}, predicted {ms:.2} ms device→host) may run \
             until forward[{k}] `{}` of the next step ({} forward ops){waits}",
            c.buffers,
            crate::liveness::human_bytes(c.bytes),
            plan.forward[k].name(),
            plan.forward.len()
        ))
    }

    fn dump_after(&self, _module: &Module, cx: &PassContext) -> String {
        let Some(plan) = &cx.plan else {
            return "; plan after copy-out-overlap: none".into();
        };
        let mut s = String::from("; copies out after copy-out-overlap\n");
        match plan.memory.carried_copy_outs {
            Some(k) => s.push_str(&format!(
                "; carried into the next step until forward[{k}] ({})\n",
                plan.forward[k].name()
            )),
            None => s.push_str("; none carried: every copy out ends with its step\n"),
        }
        for (pos, op) in plan.step_ops() {
            if let Op::CopyOut { src, dst, .. } = op {
                let slot = plan.memory.slots[src.index()];
                s.push_str(&format!(
                    ";   {:<24} %{} ({} at {}) -> %{}\n",
                    plan.step_position(pos),
                    plan.buffer(*src).name,
                    slot.arena,
                    slot.offset,
                    plan.buffer(*dst).name
                ));
            }
        }
        s
    }
}
