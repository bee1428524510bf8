//! `host_updates = sync | delayed` (a key of the spec's `target` block), the first step of
//! `tier-placement`: AdamW updates that run on the host cores, where their state lives
//! (ZeRO-Offload's CPU optimizer, Ren et al. 2021). See [`host_updates`].
use crate::tier_placement::candidates;
use crate::PassError;
use schedule::{ArenaKind, BufferId, BufferSlot, Op, Plan};
use std::collections::HashMap;

/// Under `host_updates = sync | delayed` (`mode`), moves every AdamW update whose state can
/// leave the device to the host (ZeRO-Offload's CPU optimizer): for each `adam_w` whose
/// gradient streams out (written by the backward, read by the optimizer program only, no
/// accumulation), whose parameter only the optimizer writes and whose moments only it
/// touches,
/// - a device copy `<param>.device` (initialised as the parameter, [`schedule::Init::CopyOf`])
///   takes the parameter's place in the forward and backward programs;
/// - the op runs on the host (`on_host`), on the parameter, gradient and moments, which the
///   caller places in the host tier (the returned ids, four per update: parameter, gradient,
///   first and second moment);
/// - a `copy_in` refreshes the device copy: under `sync` at the end of the optimizer program
///   (after the update: the same numbers as on the device), under `delayed` right before the
///   update (the previous step's parameters: the update overlaps the next forward and
///   backward, whose gradient is then taken one update late), and, during the learning-rate
///   warm-up (`last_step` = `warmup`), at the end as well: the delay starts after it.
///
/// # Errors
/// `host_updates` with `grad_accum > 1` (accumulated gradients stay on the device), or on a
/// unified-memory target (host memory is the device's there).
pub(crate) fn host_updates(
    plan: &mut Plan,
    mode: schedule::HostUpdates,
    host_ok: bool,
) -> Result<Vec<BufferId>, PassError> {
    if mode == schedule::HostUpdates::Off {
        return Ok(Vec::new());
    }
    let refuse = |message: String| PassError::Invalid {
        pass: "tier-placement",
        message,
    };
    if plan.train.grad_accum > 1 {
        return Err(refuse(format!(
            "`host_updates = {mode}` streams each gradient to the host once a step, but \
             `grad_accum = {}` accumulates them on the device; remove one of the two",
            plan.train.grad_accum
        )));
    }
    if !host_ok {
        return Err(refuse(format!(
            "`host_updates = {mode}`: this target has unified memory (host memory is the \
             device's), so moving the updates' state to the host frees nothing"
        )));
    }
    // Already placed (a plan compiled twice): nothing more.
    if plan.optimizer.iter().any(|o| o.on_host()) {
        return Ok(plan
            .optimizer
            .iter()
            .filter(|o| o.on_host())
            .flat_map(|o| match *o {
                Op::AdamW {
                    param,
                    grad,
                    exp_avg,
                    exp_avg_sq,
                    ..
                } => vec![param, grad, exp_avg, exp_avg_sq],
                _ => Vec::new(),
            })
            .collect());
    }
    let c = candidates(plan);
    let mut moved = Vec::new();
    let mut device_copies: HashMap<BufferId, BufferId> = HashMap::new();
    // Per moved update: the backward position of its gradient's last write, its ops (the
    // copy in first under `delayed`), its copy in (under `sync`).
    let mut groups: Vec<(usize, Vec<Op>, Option<Op>)> = Vec::new();
    let mut insert_at = None;
    let last_write = |plan: &Plan, g: BufferId| {
        plan.backward
            .iter()
            .rposition(|op| op.accesses().iter().any(|&(_, b, a)| b == g && a.writes()))
            .unwrap_or(0)
    };
    let old_ops = std::mem::take(&mut plan.optimizer);
    let mut out = Vec::with_capacity(3 * old_ops.len());
    for (index, op) in old_ops.iter().cloned().enumerate() {
        let Op::AdamW {
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            on_host: false,
            ..
        } = op
        else {
            out.push(op);
            continue;
        };
        // Its state touched by this update alone: no refresh re-projects the moments, and no
        // other optimizer op reads the parameter or the gradient.
        let others_touch = |id: BufferId| {
            old_ops
                .iter()
                .enumerate()
                .any(|(j, o)| j != index && o.operands().iter().any(|&(_, b)| b == id))
                || plan
                    .host_tasks
                    .iter()
                    .any(|t| t.operands().iter().any(|&(_, b)| b == id))
        };
        let movable = c.params.contains(&param)
            && c.grads.contains(&grad)
            && c.moments.contains(&exp_avg)
            && c.moments.contains(&exp_avg_sq)
            && !device_copies.contains_key(&param)
            && ![param, grad, exp_avg, exp_avg_sq]
                .iter()
                .any(|&id| others_touch(id) && id != grad)
            && !old_ops.iter().enumerate().any(|(j, o)| {
                j != index
                    && !matches!(o, Op::ClipGradNorm { .. })
                    && o.operands().iter().any(|&(_, b)| b == grad)
            });
        if !movable {
            out.push(op);
            continue;
        }
        let b = plan.buffer(param).clone();
        let dev = BufferId(plan.buffers.len() as u32);
        plan.buffers.push(schedule::Buffer {
            name: format!("{}.device", b.name),
            init: schedule::Init::CopyOf { of: param },
            ..b
        });
        plan.memory.slots.push(BufferSlot {
            arena: ArenaKind::Persistent,
            offset: 0,
        });
        device_copies.insert(param, dev);
        let copy = Op::CopyIn {
            src: param,
            dst: dev,
            last_step: None,
        };
        insert_at.get_or_insert(out.len());
        let mut ops = Vec::with_capacity(2);
        let mut sync_copy = None;
        if mode == schedule::HostUpdates::Delayed {
            ops.push(copy);
            // During the learning-rate warm-up the update is copied after it too: the delay
            // starts once the warm-up is over (ZeRO-Offload turns its delayed update on after
            // a few dozen synchronous steps).
            if plan.train.warmup_steps > 0 {
                sync_copy = Some(Op::CopyIn {
                    src: param,
                    dst: dev,
                    last_step: Some(plan.train.warmup_steps),
                });
            }
        } else {
            sync_copy = Some(copy);
        }
        let mut update = op.clone();
        if let Op::AdamW { on_host, .. } = &mut update {
            *on_host = true;
        }
        ops.push(update);
        groups.push((last_write(plan, grad), ops, sync_copy));
        moved.extend([param, grad, exp_avg, exp_avg_sq]);
    }
    // The updates in the order their gradients are finished (the backward runs from the last
    // layer to the first), where the first of them was: the order the engine's host worker
    // runs them, so that the next step's first copies wait for the earliest updates. They
    // touch disjoint state, so the order changes no number.
    if groups.is_empty() {
        plan.optimizer = out;
        let ops: std::collections::BTreeSet<&str> =
            plan.optimizer.iter().map(|o| o.name()).collect();
        return Err(refuse(format!(
            "`host_updates = {mode}` moves nothing: only AdamW's element-wise `adam_w` updates \
             run on the host (with their gradient streamed out and their state touched by \
             nothing else), and this optimizer program has none that can move (its ops: {}); \
             remove `host_updates`",
            ops.into_iter().collect::<Vec<_>>().join(", ")
        )));
    }
    groups.sort_by_key(|g| g.0);
    if let Some(at) = insert_at {
        let tail = out.split_off(at);
        for (_, ops, _) in &mut groups {
            out.append(ops);
        }
        out.extend(tail);
    }
    out.extend(groups.into_iter().filter_map(|g| g.2));
    plan.optimizer = out;
    for program in [&mut plan.forward, &mut plan.backward] {
        for op in program.iter_mut() {
            *op = crate::prefetch_insertion::replace_operands(op, &device_copies)?;
        }
    }
    Ok(moved)
}
