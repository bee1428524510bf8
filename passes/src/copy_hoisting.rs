//! `copy-hoisting`: issues the optimizer program's copies in of state in pinned host memory
//! early, into the backward, where the device bytes allow.
//!
//! `prefetch-insertion` issues each staging copy in one offloaded update ahead of its use
//! ([`crate::prefetch_insertion::PREFETCH_DEPTH`]), inside the optimizer program. The
//! backward frees the activations the forward saved, so its later part has device bytes to
//! spare; a copy in moved there brings its tensor in while the GPU runs the backward, and the
//! optimizer program starts with it on the device. This pass moves each staging copy in up,
//! op by op, while
//! - no op it passes writes its source or touches its staging buffer (so it copies the same
//!   bytes: the same plan, computed the same way);
//! - the step's live transient bytes, with the staging buffer live from the new position on,
//!   stay at or under their peak;
//! - it stays behind the copy in moved before it (the copy-in stream runs them in turn, so
//!   they keep the order of their uses), and behind the backward's own copies in (parameters
//!   in host memory, which the backward waits for).
//!
//! The greedy offsets of `memory-planning` may place less tightly than the live-byte peak, so
//! the pass keeps a prefix of the moves (in program order; found by binary search, the
//! longest one when the arena grows with the prefix, which greedy placement does not
//! guarantee) whose activations arena is no larger than without them: the device need never
//! grows, and the budget `tier-placement` met stays met. Copies of gradients streamed out in
//! the backward (ZeRO-Offload's) stay where they are: moved up, they would only come back
//! right after leaving. Nothing moves under `grad_accum > 1` (the backward runs
//! once per micro-batch) or when nothing is offloaded.
//!
//! NVMe-tier copies stay where they are: the engines read their blocks through a few bounce
//! slots sized for copies issued one update ahead.
//!
//! Skippable (`--skip-pass copy-hoisting`) to compare the two schedules: the values computed
//! are the same bits either way; only when the copies run changes.
use crate::memory_planning::plan_memory;
use crate::{Pass, PassContext, PassError};
use ir::Module;
use schedule::memory::align_up;
use schedule::{ArenaKind, BufferClass, BufferId, Op, Plan, ARENA_ALIGN};
use std::collections::{HashMap, HashSet};

/// The `copy-hoisting` pass.
#[derive(Default)]
pub struct CopyHoisting;

impl Pass for CopyHoisting {
    fn name(&self) -> &'static str {
        "copy-hoisting"
    }

    fn run(&mut self, module: &mut Module, cx: &mut PassContext) -> Result<String, PassError> {
        let plan = cx.plan.as_mut().ok_or_else(|| PassError::Invalid {
            pass: "copy-hoisting",
            message: "no plan: run `lower` first".into(),
        })?;
        let h = hoist_copy_ins(plan);
        // The host→device time those bytes take (the target's link), now under the backward.
        let ms = crate::precond_scheduling::target_description(&module.config.target)
            .map(|d| d.host_tier_ms(h.backward_bytes))
            .unwrap_or(f64::NAN);
        Ok(if h.candidates == 0 {
            "no copies in to move".into()
        } else {
            format!(
                "{} of {} optimizer copies in ({}, predicted {ms:.2} ms host→device) issued \
                 during the backward, {} earlier in the optimizer program",
                h.into_backward,
                h.candidates,
                crate::liveness::human_bytes(h.backward_bytes),
                h.moved - h.into_backward
            )
        })
    }

    fn dump_after(&self, _module: &Module, cx: &PassContext) -> String {
        let Some(plan) = &cx.plan else {
            return "; plan after copy-hoisting: none".into();
        };
        crate::prefetch_insertion::copy_listing(plan, "copy-hoisting")
    }
}

/// What [`hoist_copy_ins`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hoisted {
    /// Staging copies in of the optimizer program (the candidates).
    pub candidates: usize,
    /// Copies moved (to an earlier position).
    pub moved: usize,
    /// Of those, copies now in the backward program.
    pub into_backward: usize,
    /// Bytes the copies in the backward bring in.
    pub backward_bytes: usize,
}

/// Moves the optimizer program's staging copies in of `plan` earlier (see the module docs).
pub fn hoist_copy_ins(plan: &mut Plan) -> Hoisted {
    let mut out = Hoisted::default();
    let (f, b) = (plan.forward.len(), plan.backward.len());
    let residency = plan.residency();
    let staging = |op: &Op| match *op {
        Op::CopyIn {
            src,
            dst,
            last_step: None,
        } if plan.memory.tier(src) == Some(ArenaKind::Host)
            && plan.buffer(src).class != BufferClass::Gradient =>
        {
            residency
                .get(dst.index())
                .and_then(|r| r.live_range())
                .map(|_| (src, dst))
        }
        _ => None,
    };
    out.candidates = plan
        .optimizer
        .iter()
        .filter(|o| staging(o).is_some())
        .count();
    if out.candidates == 0 || plan.train.grad_accum > 1 {
        return out;
    }
    // Live transient bytes per step position (as `memory-planning` counts them: aligned).
    let mut profile = vec![0usize; plan.step_len()];
    for (i, (buf, r)) in plan.buffers.iter().zip(&residency).enumerate() {
        // A streamed gradient's host home is step-local but not on the device.
        let off_device = plan
            .memory
            .slot(BufferId(i as u32))
            .is_some_and(|s| !s.arena.on_device());
        if let Some(live) = r.live_range().filter(|_| !off_device) {
            let bytes = align_up(buf.size_bytes(), ARENA_ALIGN);
            let end = live.last.saturating_add(1).min(profile.len());
            for p in profile.iter_mut().take(end).skip(live.first) {
                *p += bytes;
            }
        }
    }
    let peak = profile.iter().copied().max().unwrap_or(0);
    let ops: Vec<&Op> = plan.step_ops().map(|(_, o)| o).collect();
    // (original step position, new step position, bytes) of each moved copy, in order.
    let mut moves: Vec<(usize, usize, usize)> = Vec::new();
    // Not ahead of the backward's own copies in (parameters the backward reads): the copy-in
    // stream runs in program order, and those are on the backward's critical path.
    let mut floor = f + plan
        .backward
        .iter()
        .rposition(|o| matches!(o, Op::CopyIn { .. }))
        .map_or(0, |i| i + 1);
    for (i, op) in plan.optimizer.iter().enumerate() {
        let pos = f + b + i;
        let Some((src, dst)) = staging(op) else {
            if matches!(op, Op::CopyIn { .. }) {
                floor = floor.max(pos + 1); // an NVMe or gradient copy keeps its place
            }
            continue;
        };
        let bytes = align_up(plan.buffer(dst).size_bytes(), ARENA_ALIGN);
        let mut p = pos;
        while p > floor {
            let q = p - 1;
            let conflict = ops[q]
                .accesses()
                .iter()
                .any(|&(_, id, a)| id == dst || (id == src && a.writes()));
            if conflict || profile[q] + bytes > peak {
                break;
            }
            p = q;
        }
        // The next copy goes after this one (at the same position: after it, `rebuilt`
        // keeps the order of the moves; unmoved: after its position).
        floor = if p < pos { p } else { pos + 1 };
        if p < pos {
            for x in &mut profile[p..pos] {
                *x += bytes;
            }
            moves.push((pos, p, bytes));
        }
    }
    if moves.is_empty() {
        return out;
    }
    let arena = |p: &Plan| plan_memory(p).arena_bytes(ArenaKind::Activations);
    let before = arena(plan);
    let original = (plan.backward.clone(), plan.optimizer.clone());
    // A prefix of `moves` that keeps the arena (binary search; `k = 0` is the plan
    // as it was).
    let (mut lo, mut hi) = (0usize, moves.len());
    let mut best: Option<(Vec<Op>, Vec<Op>)> = None;
    while lo < hi {
        let k = (lo + hi).div_ceil(2);
        let (backward, optimizer) = rebuilt(plan, &original, &moves[..k]);
        plan.backward = backward;
        plan.optimizer = optimizer;
        if arena(plan) <= before {
            lo = k;
            best = Some((plan.backward.clone(), plan.optimizer.clone()));
        } else {
            hi = k - 1;
        }
        (plan.backward, plan.optimizer) = original.clone();
    }
    if let Some((backward, optimizer)) = best {
        plan.backward = backward;
        plan.optimizer = optimizer;
        out.moved = lo;
        for &(_, to, bytes) in &moves[..lo] {
            if to < f + b {
                out.into_backward += 1;
                out.backward_bytes += bytes;
            }
        }
    }
    out
}

/// The backward and optimizer programs of `original` (those of `plan`) with the copies of
/// `moves` (original step position, new step position) moved.
fn rebuilt(
    plan: &Plan,
    original: &(Vec<Op>, Vec<Op>),
    moves: &[(usize, usize, usize)],
) -> (Vec<Op>, Vec<Op>) {
    let (f, b) = (plan.forward.len(), original.0.len());
    let at_pos = |pos: usize| -> &Op {
        if pos < f + b {
            &original.0[pos - f]
        } else {
            &original.1[pos - f - b]
        }
    };
    let mut at: HashMap<usize, Vec<Op>> = HashMap::new();
    for &(from, to, _) in moves {
        at.entry(to).or_default().push(at_pos(from).clone());
    }
    let moved: HashSet<usize> = moves.iter().map(|&(from, _, _)| from).collect();
    let mut backward = Vec::with_capacity(b + moves.len());
    let mut optimizer = Vec::with_capacity(original.1.len());
    for pos in f..f + b + original.1.len() {
        let into = if pos < f + b {
            &mut backward
        } else {
            &mut optimizer
        };
        into.extend(at.remove(&pos).unwrap_or_default());
        if !moved.contains(&pos) {
            into.push(at_pos(pos).clone());
        }
    }
    (backward, optimizer)
}
