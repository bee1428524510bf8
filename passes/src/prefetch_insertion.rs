//! `prefetch-insertion`: for every buffer `tier-placement` offloaded (its slot is in the `host`
//! or `nvme` arena), adds a staging buffer `<name>.staged` on the device and the copies that
//! move the state through it each step:
//! - every op that used the offloaded buffer uses its staging buffer instead;
//! - a [`schedule::Op::CopyIn`] is issued [`PREFETCH_DEPTH`] offloaded updates before its first
//!   use (before the update of the previous tensor whose state is offloaded), so that while one
//!   tensor is updated the next comes in and the previous goes out (an engine runs copies on
//!   its copy streams or I/O threads and waits for one only where its bytes are next
//!   touched: the CUDA engine's host→device and device→host copies use separate copy
//!   engines);
//! - a [`schedule::Op::CopyOut`] follows the last op that writes it.
//!
//! A gradient that `tier-placement` moved to the host tier leaves during the backward instead
//! (`spill_gradients`): a copy out to `<grad>.host` after its last backward write, the
//! clip from partial sums, and the staging above for its uses in the optimizer program.
//!
//! A parameter that `tier-placement` moved is read by the forward and the backward too: each
//! of those programs that reads it gets a staging buffer `<name>.staged.forward` /
//! `.staged.backward` of its own, copied in by the same rule among that program's offloaded
//! first uses, and never copied back (only the optimizer writes a parameter; one written by
//! the forward or backward is refused). Copies in those programs need one forward and
//! backward per step, so `tier-placement` moves no parameter under `grad_accum > 1`.
//!
//! The staging buffers are step-local (the first op touching each is its copy): the
//! `memory-planning` pass gives them bytes of the activations arena only from their copy in to
//! their copy out — the pinned staging pool, sized by liveness. [`schedule::Plan::verify`]
//! checks that no op touches an offloaded buffer, none touches a staging buffer before its copy
//! in, and every written staging buffer is copied back.
use crate::{Pass, PassContext, PassError};
use ir::Module;
use schedule::memory::align_up;
use schedule::{ArenaKind, Buffer, BufferId, BufferSlot, Init, Op, Plan};
use std::collections::HashMap;

/// How many offloaded updates ahead of its first use a copy in is issued (1: double
/// buffering; a copy cannot start before the staging bytes it reuses are copied out, so
/// deeper prefetch only helps when the updates take longer than the copies).
pub const PREFETCH_DEPTH: usize = 1;

/// The `prefetch-insertion` pass.
#[derive(Default)]
pub struct PrefetchInsertion {
    copies: usize,
}

impl Pass for PrefetchInsertion {
    fn name(&self) -> &'static str {
        "prefetch-insertion"
    }

    fn run(&mut self, _module: &mut Module, cx: &mut PassContext) -> Result<String, PassError> {
        let plan = cx.plan.as_mut().ok_or_else(|| PassError::Invalid {
            pass: "prefetch-insertion",
            message: "no plan: run `lower` first".into(),
        })?;
        let (ins, outs) = insert_prefetches(plan)?;
        self.copies = ins + outs;
        Ok(if ins == 0 {
            "nothing offloaded: no copies".into()
        } else {
            format!(
                "{ins} copy_in / {outs} copy_out op(s), {ins} staging buffer(s), issued \
                 {PREFETCH_DEPTH} offloaded update(s) ahead"
            )
        })
    }

    fn dump_after(&self, _module: &Module, cx: &PassContext) -> String {
        let Some(plan) = &cx.plan else {
            return "; plan after prefetch-insertion: none".into();
        };
        let mut s = copy_listing(plan, "prefetch-insertion");
        s.push_str("; optimizer program after prefetch-insertion\n");
        for (i, op) in plan.optimizer.iter().enumerate() {
            let names: Vec<String> = op
                .operands()
                .iter()
                .map(|(f, id)| format!("{f}=%{}", plan.buffer(*id).name))
                .collect();
            s.push_str(&format!(
                ";   optimizer[{i}] {} {}\n",
                op.name(),
                names.join(" ")
            ));
        }
        s
    }
}

/// Every copy of `plan`'s step (forward, backward, optimizer), one line each, in step order:
/// its position, source and destination with their tiers, the stream it runs on (`copy_in`
/// on the copy-in stream, `copy_out` on the copy-out stream: an engine's host→device and
/// device→host copy engines, or its I/O threads for NVMe), and the ordering an engine derives
/// from the plan for it: the first later op that reads a copy in's destination waits for its
/// event, and a copy out starts after the op that last wrote its source. A copy in whose
/// destination nothing reads, or a copy out whose source nothing wrote, says so (the
/// verifier refuses the latter). `after` names the pass in the heading.
pub fn copy_listing(plan: &Plan, after: &str) -> String {
    let ops: Vec<(usize, &Op)> = plan.step_ops().collect();
    // The staging buffers' arena is the memory plan's business (`memory-planning` puts them
    // in the activations arena): `device` here.
    let tier = |id: BufferId| match plan.memory.tier(id) {
        Some(k) if k.on_device() => "device",
        Some(k) => k.name(),
        None => "?",
    };
    let (ins, outs) = ops.iter().fold((0, 0), |(i, o), (_, op)| match op {
        Op::CopyIn { .. } => (i + 1, o),
        Op::CopyOut { .. } => (i, o + 1),
        _ => (i, o),
    });
    let mut s = format!(
        "; copies after {after}: {ins} copy_in on the copy-in stream, {outs} copy_out on the \
         copy-out stream (step position: source [tier] -> destination [tier]; the op that \
         waits for each copy in's event, the op each copy out follows)\n"
    );
    let touches = |op: &Op, id: BufferId, write: bool| {
        op.accesses()
            .iter()
            .any(|(_, b, a)| *b == id && if write { a.writes() } else { a.reads() })
    };
    for (k, &(pos, op)) in ops.iter().enumerate() {
        let line = match op {
            Op::CopyIn { src, dst, .. } => {
                let reader = ops[k + 1..]
                    .iter()
                    .find(|(_, o)| !crate::tier_placement::is_copy(o) && touches(o, *dst, false))
                    .or_else(|| {
                        ops[k + 1..]
                            .iter()
                            .find(|(_, o)| matches!(o, Op::CopyOut { src, .. } if src == dst))
                    });
                let waits = reader.map_or("nothing reads it this step".to_string(), |(p, o)| {
                    format!("{} {} waits for it", plan.step_position(*p), o.name())
                });
                format!(
                    ";   {} copy_in  %{} [{}] -> %{} [{}]  copy-in stream; {waits}",
                    plan.step_position(pos),
                    plan.buffer(*src).name,
                    tier(*src),
                    plan.buffer(*dst).name,
                    tier(*dst)
                )
            }
            Op::CopyOut { src, dst, .. } => {
                let writer = ops[..k].iter().rev().find(|(_, o)| touches(o, *src, true));
                let follows = writer.map_or("nothing wrote its source".to_string(), |(p, o)| {
                    format!("after {} {}", plan.step_position(*p), o.name())
                });
                format!(
                    ";   {} copy_out %{} [{}] -> %{} [{}]  copy-out stream; {follows}",
                    plan.step_position(pos),
                    plan.buffer(*src).name,
                    tier(*src),
                    plan.buffer(*dst).name,
                    tier(*dst)
                )
            }
            _ => continue,
        };
        s.push_str(&line);
        s.push('\n');
    }
    s
}

/// Adds the staging buffers and copies for every offloaded buffer of `plan` (see the module
/// docs). Returns the numbers of copy-ins and copy-outs. Errors when an offloaded buffer other
/// than a gradient is used outside the optimizer program, or a gradient was placed on NVMe
/// (not placements this version makes).
pub fn insert_prefetches(plan: &mut Plan) -> Result<(usize, usize), PassError> {
    let offloaded_now = |plan: &Plan| -> Vec<BufferId> {
        (0..plan.buffers.len())
            .map(|i| BufferId(i as u32))
            .filter(|&id| {
                plan.memory
                    .tier(id)
                    .is_some_and(|t| matches!(t, ArenaKind::Host | ArenaKind::Nvme))
            })
            .collect()
    };
    let offloaded = offloaded_now(plan);
    if offloaded.is_empty() {
        return Ok((0, 0));
    }
    let (homes, spill_outs) = spill_gradients(plan, &offloaded)?;
    let offloaded = offloaded_now(plan);
    // Offloaded buffers the forward or backward reads (parameters: written by the optimizer
    // alone) come in once per program that reads them, through a staging buffer of that
    // program; none may be written there.
    for op in plan.forward.iter().chain(&plan.backward) {
        if matches!(op, Op::CopyOut { .. }) {
            continue; // a gradient's copy to its host home (`spill_gradients`)
        }
        if let Some((_, id, _)) = op
            .accesses()
            .into_iter()
            .find(|&(_, id, a)| a.writes() && offloaded.contains(&id))
        {
            return Err(PassError::Invalid {
                pass: "prefetch-insertion",
                message: format!(
                    "`{}` is offloaded but `{}` in the forward or backward program writes it; \
                     only buffers those programs read (parameters) or gradients leave the \
                     device",
                    plan.buffer(id).name,
                    op.name()
                ),
            });
        }
    }
    let mut ins = 0;
    for program in ["forward", "backward"] {
        ins += stage_reads(plan, program, &offloaded)?;
    }
    // Staging buffers of the optimizer program, for the offloaded buffers its device ops use
    // (a host update works on its state where it lives; copies already in the program, a
    // host update's device copy and the clip factor's copy out, name their tier directly).
    let staged_here = |op: &Op| !op.on_host() && !crate::tier_placement::is_copy(op);
    let mut staged: HashMap<BufferId, BufferId> = HashMap::new();
    for &id in &offloaded {
        let used = plan
            .optimizer
            .iter()
            .any(|op| staged_here(op) && op.operands().iter().any(|&(_, b)| b == id));
        if used {
            staged.insert(id, staging_buffer(plan, id, "staged"));
        }
    }
    // First and last use, and whether written, per offloaded buffer.
    let mut first: HashMap<BufferId, usize> = HashMap::new();
    let mut last_write: HashMap<BufferId, usize> = HashMap::new();
    for (i, op) in plan.optimizer.iter().enumerate() {
        if !staged_here(op) {
            continue;
        }
        for (_, id, access) in op.accesses() {
            if staged.contains_key(&id) {
                first.entry(id).or_insert(i);
                if access.writes() {
                    last_write.insert(id, i);
                }
            }
        }
    }
    let mut issue_at = issue_points(&first);
    let mut out_after: HashMap<usize, Vec<BufferId>> = HashMap::new();
    for (&id, &l) in &last_write {
        // A gradient's staging copy is clipped in place, not state: it dies with the step.
        if !homes.contains(&id) {
            out_after.entry(l).or_default().push(id);
        }
    }
    let old = std::mem::take(&mut plan.optimizer);
    let mut outs = spill_outs;
    for (i, op) in old.into_iter().enumerate() {
        if let Some(list) = issue_at.get_mut(&i) {
            list.sort();
            for &id in list.iter() {
                plan.optimizer.push(Op::CopyIn {
                    src: id,
                    dst: staged[&id],
                    last_step: None,
                });
                ins += 1;
            }
        }
        plan.optimizer.push(if staged_here(&op) {
            replace_operands(&op, &staged)?
        } else {
            op
        });
        if let Some(list) = out_after.get_mut(&i) {
            list.sort();
            for &id in list.iter() {
                plan.optimizer.push(Op::CopyOut {
                    src: staged[&id],
                    dst: id,
                });
                outs += 1;
            }
        }
    }
    Ok((ins, outs))
}

/// A new step-local staging buffer `<name>.<suffix>` shaped like offloaded buffer `id` (its
/// slot a placeholder until `memory-planning` gives it bytes of the activations arena).
fn staging_buffer(plan: &mut Plan, id: BufferId, suffix: &str) -> BufferId {
    let placeholder = BufferSlot {
        arena: ArenaKind::Persistent,
        offset: 0,
    };
    copy_of(plan, id, suffix, placeholder)
}

/// A new zero-initialised buffer `<name>.<suffix>` shaped like `id`, in `slot`.
fn copy_of(plan: &mut Plan, id: BufferId, suffix: &str, slot: BufferSlot) -> BufferId {
    let b = plan.buffer(id).clone();
    let s = BufferId(plan.buffers.len() as u32);
    plan.buffers.push(Buffer {
        name: format!("{}.{suffix}", b.name),
        init: Init::Zeros,
        ..b
    });
    plan.memory.slots.push(slot);
    s
}

/// Where the copies in go, by the op index of their first use (`first`): the ops that first
/// use offloaded buffers, in order; the copy in for the j-th is issued before the
/// (j - [`PREFETCH_DEPTH`])-th (at the start of the program for the first ones), so that
/// while one tensor is used the next comes in and the previous goes out.
fn issue_points(first: &HashMap<BufferId, usize>) -> HashMap<usize, Vec<BufferId>> {
    let mut users: Vec<usize> = first.values().copied().collect();
    users.sort_unstable();
    users.dedup();
    let mut issue_at: HashMap<usize, Vec<BufferId>> = HashMap::new();
    for (&id, &f) in first {
        let j = users.partition_point(|&u| u < f);
        let at = if j >= PREFETCH_DEPTH {
            users[j - PREFETCH_DEPTH]
        } else {
            0
        };
        issue_at.entry(at).or_default().push(id);
    }
    issue_at
}

/// The forward or backward program (`program`) reading offloaded buffers (parameters, which
/// only the optimizer writes): each gets a staging buffer `<name>.staged.<program>`, a
/// [`Op::CopyIn`] issued as in the optimizer program ([`issue_points`]), and no copy out (the
/// program does not write it; `insert_prefetches` refuses one that does). A gradient's copy to
/// its host home is not a use. Returns the copies in added.
fn stage_reads(plan: &mut Plan, program: &str, offloaded: &[BufferId]) -> Result<usize, PassError> {
    let ops = match program {
        "forward" => &plan.forward,
        _ => &plan.backward,
    };
    let mut first: HashMap<BufferId, usize> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        if matches!(op, Op::CopyOut { .. }) {
            continue;
        }
        for (_, id) in op.operands() {
            if offloaded.contains(&id) {
                first.entry(id).or_insert(i);
            }
        }
    }
    if first.is_empty() {
        return Ok(0);
    }
    let mut ids: Vec<BufferId> = first.keys().copied().collect();
    ids.sort();
    let mut staged: HashMap<BufferId, BufferId> = HashMap::new();
    for id in ids {
        staged.insert(id, staging_buffer(plan, id, &format!("staged.{program}")));
    }
    let mut issue_at = issue_points(&first);
    let old = std::mem::take(match program {
        "forward" => &mut plan.forward,
        _ => &mut plan.backward,
    });
    let mut out = Vec::with_capacity(old.len() + staged.len());
    for (i, op) in old.into_iter().enumerate() {
        if let Some(list) = issue_at.get_mut(&i) {
            list.sort();
            for &id in list.iter() {
                out.push(Op::CopyIn {
                    src: id,
                    dst: staged[&id],
                    last_step: None,
                });
            }
        }
        // A spill's copy out names the gradient's home, not a staged buffer.
        out.push(if matches!(op, Op::CopyOut { .. }) {
            op
        } else {
            replace_operands(&op, &staged)?
        });
    }
    match program {
        "forward" => plan.forward = out,
        _ => plan.backward = out,
    }
    Ok(staged.len())
}

/// `op` with every operand found in `map` replaced by its image (through the op's JSON form:
/// the fields named by [`Op::operands`] hold plain integers, or lists of them).
pub(crate) fn replace_operands(
    op: &Op,
    map: &HashMap<BufferId, BufferId>,
) -> Result<Op, PassError> {
    let hits: Vec<(&'static str, BufferId)> = op
        .operands()
        .into_iter()
        .filter(|(_, id)| map.contains_key(id))
        .collect();
    if hits.is_empty() {
        return Ok(op.clone());
    }
    let bug = |e: serde_json::Error| PassError::Invalid {
        pass: "prefetch-insertion",
        message: format!("rewriting the operands of `{}`: {e}", op.name()),
    };
    let mut v = serde_json::to_value(op).map_err(bug)?;
    for (field, id) in hits {
        let (from, to) = (
            serde_json::Value::from(id.0),
            serde_json::Value::from(map[&id].0),
        );
        match v.get_mut(field) {
            // A list operand (`state` of an element-wise update): the matching entries.
            Some(serde_json::Value::Array(items)) => {
                for item in items.iter_mut().filter(|x| **x == from) {
                    *item = to.clone();
                }
            }
            Some(slot) => *slot = to,
            None => {}
        }
    }
    serde_json::from_value(v).map_err(bug)
}

/// Gradients leaving the device (ZeRO-Offload's gradient streaming): every offloaded buffer
/// that the backward writes is a gradient placed in the host tier by `tier-placement`. Its
/// plan buffer stays the backward's device output (step-local again); a new buffer
/// `<grad>.host` takes its host slot, and
/// - in the backward, right after the gradient's last write: a [`Op::GradSumSquares`] into
///   the clip's partials (for every gradient the clip reads, offloaded or not), then a
///   [`Op::CopyOut`] to `<grad>.host` — its device bytes are free once the copy completes;
/// - the optimizer program's [`Op::ClipGradNorm`] reads the partials instead of the
///   gradients and writes its factor to a `scale` buffer; where it scaled the gradients in
///   place, a [`Op::ScaleByScalar`] does it before each gradient's first use (the same bits);
/// - the optimizer's uses read `<grad>.host`, which the caller stages like any offloaded
///   state (a copy in before its first use; none back: the clipped copy is not state).
///
/// Returns the homes and the number of copies out added. Errors on a gradient offloaded to
/// the NVMe tier (streamed every step, it goes to pinned host memory only).
fn spill_gradients(
    plan: &mut Plan,
    offloaded: &[BufferId],
) -> Result<(Vec<BufferId>, usize), PassError> {
    let written_in_backward = |plan: &Plan, id: BufferId| {
        plan.backward
            .iter()
            .any(|op| op.accesses().iter().any(|&(_, b, a)| b == id && a.writes()))
    };
    let grads: Vec<BufferId> = offloaded
        .iter()
        .copied()
        .filter(|&id| written_in_backward(plan, id))
        .collect();
    if grads.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let invalid = |message: String| PassError::Invalid {
        pass: "prefetch-insertion",
        message,
    };
    // Homes: the gradients' host slots; the gradients go back to the activations arena
    // (`memory-planning` gives them bytes by liveness).
    let mut home: HashMap<BufferId, BufferId> = HashMap::new();
    for &g in &grads {
        let slot = plan.memory.slots[g.index()];
        if slot.arena != ArenaKind::Host {
            return Err(invalid(format!(
                "the gradient `{}` is placed in the `{}` tier; gradients leave the device for \
                 pinned host memory only",
                plan.buffer(g).name,
                slot.arena
            )));
        }
        let h = copy_of(plan, g, "host", slot);
        plan.memory.slots[g.index()] = BufferSlot {
            arena: ArenaKind::Activations,
            offset: 0,
        };
        home.insert(g, h);
    }
    // The clip, in its partials form.
    let clip_at = plan
        .optimizer
        .iter()
        .position(|op| matches!(op, Op::ClipGradNorm { .. }));
    let mut scale_before_use: Option<(BufferId, Vec<BufferId>)> = None;
    let mut sums: Vec<(BufferId, usize)> = Vec::new(); // (gradient, slot)
    let mut partials = None;
    if let Some(at) = clip_at {
        let Op::ClipGradNorm {
            grads: clip_grads,
            norm,
            scale,
            max_norm,
            partials: None,
        } = plan.optimizer[at].clone()
        else {
            return Err(invalid(
                "the clip already reads partial sums: gradients were offloaded twice".into(),
            ));
        };
        let class = plan.buffer(norm).class;
        let p = BufferId(plan.buffers.len() as u32);
        plan.buffers.push(Buffer {
            name: "grad_norm_partials".into(),
            shape: vec![2 * schedule::reserve::SUMSQ_BLOCKS * clip_grads.len().max(1)],
            dtype: schedule::DType::F32,
            class,
            init: Init::Zeros,
        });
        plan.memory.slots.push(BufferSlot {
            arena: ArenaKind::Persistent,
            offset: 0,
        });
        partials = Some(p);
        let s = match scale {
            Some(s) => s,
            None => {
                let s = BufferId(plan.buffers.len() as u32);
                plan.buffers.push(Buffer {
                    name: "grad_clip_scale".into(),
                    shape: vec![1],
                    dtype: schedule::DType::F32,
                    class,
                    init: Init::Zeros,
                });
                plan.memory.slots.push(BufferSlot {
                    arena: ArenaKind::Activations,
                    offset: 0,
                });
                if max_norm.is_some() {
                    scale_before_use = Some((s, clip_grads.clone()));
                }
                s
            }
        };
        plan.optimizer[at] = Op::ClipGradNorm {
            grads: Vec::new(),
            norm,
            scale: Some(s),
            max_norm,
            partials: Some(p),
        };
        sums = clip_grads.iter().copied().zip(0..).collect();
    }
    // The backward: sums of squares and copies out after each gradient's last write.
    let last_write = |plan: &Plan, id: BufferId| {
        plan.backward
            .iter()
            .rposition(|op| op.accesses().iter().any(|&(_, b, a)| b == id && a.writes()))
    };
    let mut after: HashMap<Option<usize>, Vec<Op>> = HashMap::new();
    for &(g, slot) in &sums {
        if let Some(p) = partials {
            after
                .entry(last_write(plan, g))
                .or_default()
                .push(Op::GradSumSquares {
                    grad: g,
                    partials: p,
                    slot,
                });
        }
    }
    let mut outs = 0;
    for &g in &grads {
        after
            .entry(last_write(plan, g))
            .or_default()
            .push(Op::CopyOut {
                src: g,
                dst: home[&g],
            });
        outs += 1;
    }
    let old = std::mem::take(&mut plan.backward);
    // A clip gradient the backward never writes (its zeros): summed at the start.
    plan.backward
        .extend(after.remove(&None).unwrap_or_default());
    for (i, op) in old.into_iter().enumerate() {
        plan.backward.push(op);
        if let Some(list) = after.remove(&Some(i)) {
            plan.backward.extend(list);
        }
    }
    // A host update reads the clip's factor on the host: a copy `<scale>.host`, copied out
    // right after the clip (the in-place clip's scaling of its gradient becomes the update's
    // `grad_scale`: the same product, `clip::scaled`).
    let host_scale = match (
        &plan.optimizer.iter().any(|o| o.on_host()),
        clip_at,
        partials,
    ) {
        (true, Some(at), Some(_)) => match plan.optimizer[at] {
            Op::ClipGradNorm {
                scale: Some(s),
                max_norm: Some(_),
                ..
            } => {
                let offset = align_up(plan.memory.arena_bytes(ArenaKind::Host), 256);
                let h = copy_of(
                    plan,
                    s,
                    "host",
                    BufferSlot {
                        arena: ArenaKind::Host,
                        offset,
                    },
                );
                let end = offset + align_up(plan.buffer(h).size_bytes(), 256);
                match plan
                    .memory
                    .arenas
                    .iter_mut()
                    .find(|a| a.kind == ArenaKind::Host)
                {
                    Some(a) => a.bytes = a.bytes.max(end),
                    None => plan.memory.arenas.push(schedule::ArenaPlan {
                        kind: ArenaKind::Host,
                        bytes: end,
                    }),
                }
                Some((s, h))
            }
            _ => None,
        },
        _ => None,
    };
    // The optimizer: uses of a gradient read its home (staged by the caller); the in-place
    // clip's scaling before each gradient's first use after the clip.
    let old = std::mem::take(&mut plan.optimizer);
    let mut pending: Vec<BufferId> = Vec::new();
    let homed = |g: BufferId| home.get(&g).copied().unwrap_or(g);
    let scale_op = |g: BufferId, s: BufferId| Op::ScaleByScalar {
        x: homed(g),
        scale: s,
    };
    for (i, op) in old.into_iter().enumerate() {
        let mut op = replace_operands(&op, &home)?;
        // A host update reads the clip's factor from its host copy, as its `grad_scale`, also
        // where the clip scaled the gradients in place (the same product).
        if let (
            Some((s, h)),
            Op::AdamW {
                grad,
                grad_scale,
                on_host: true,
                ..
            },
        ) = (host_scale, &mut op)
        {
            let in_place = pending.iter().any(|&g| homed(g) == *grad);
            if *grad_scale == Some(s) || in_place {
                *grad_scale = Some(h);
                let g = *grad;
                pending.retain(|&x| homed(x) != g);
            }
        }
        if let Some((s, _)) = &scale_before_use {
            if Some(i) > clip_at {
                let uses: Vec<BufferId> = op.operands().iter().map(|&(_, b)| b).collect();
                for &g in pending.iter().filter(|&&g| uses.contains(&homed(g))) {
                    plan.optimizer.push(scale_op(g, *s));
                }
                pending.retain(|&g| !uses.contains(&homed(g)));
            }
        }
        let is_clip = Some(i) == clip_at;
        plan.optimizer.push(op);
        if is_clip {
            if let Some((s, gs)) = &scale_before_use {
                // Gradients on the device are scaled right after the clip, as the in-place
                // clip did; offloaded ones where they come back.
                for &g in gs {
                    if home.contains_key(&g) {
                        pending.push(g);
                    } else {
                        plan.optimizer.push(scale_op(g, *s));
                    }
                }
            }
            if let Some((s, h)) = host_scale {
                plan.optimizer.push(Op::CopyOut { src: s, dst: h });
                outs += 1;
            }
        }
    }
    Ok((home.values().copied().collect(), outs))
}
