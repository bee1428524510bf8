//! The plan verifier's tier rules (offloaded buffers, their copies and the memory budgets), split
//! from [`crate::memory`], whose `verify_memory` calls them.
use crate::memory::{invalid, LiveRange, Residency};
use crate::{ArenaKind, BufferId, Op, Plan, PlanError};

/// The tier rules: arenas within their [`Budgets`]; an offloaded buffer (in the `host` or
/// `nvme` arena) is persistent, touched by no op but [`Op::CopyIn`] (as `src`) and
/// [`Op::CopyOut`] (as `dst`) and by no host task except as a refresh's moments (which the swap
/// re-projects where they live) or a SOAP refresh's factor and basis in the host tier; every copy moves between an offloaded buffer
/// and a device buffer; a host-placed update ([`Op::on_host`]) touches host-tier buffers
/// only; a device copy (a `CopyIn` destination initialised as a copy of its source) is
/// written by its copy alone; a staging buffer (any other `CopyIn` destination) is written first by its
/// `CopyIn` — no op touches it before the copy has brought its bytes — and, when an op writes
/// it, a `CopyOut` to its home follows the last such write (except a gradient's staging
/// copy: the gradient that left the device in the backward is not state).
pub(crate) fn verify_tiers(plan: &Plan) -> Result<(), PlanError> {
    let m = &plan.memory;
    let b = &m.budgets;
    let gib = |x: u64| crate::limits::human_size(u128::from(x));
    let over = |what: &str, key: &str, have: usize, budget: Option<u64>| match budget {
        Some(cap) if have as u64 > cap => Err(invalid(format!(
            "the {what} arenas need {} ({have} bytes), more than `{key}` = {} allows",
            gib(have as u64),
            gib(cap)
        ))),
        _ => Ok(()),
    };
    over("device", "gpu_memory / memory", m.device_bytes(), b.device)?;
    over(
        "host",
        "host_memory",
        m.arena_bytes(ArenaKind::Host),
        b.host,
    )?;
    over(
        "nvme",
        "nvme_memory",
        m.arena_bytes(ArenaKind::Nvme),
        b.nvme,
    )?;
    if m.arena_bytes(ArenaKind::Nvme) > 0 && b.nvme_dir.is_none() {
        return Err(invalid(
            "buffers are placed in the `nvme` arena but the plan names no NVMe directory".into(),
        ));
    }
    let tier = |id: BufferId| m.tier(id).unwrap_or(ArenaKind::Persistent);
    let name = |id: BufferId| &plan.buffer(id).name;
    for t in &plan.host_tasks {
        let crate::HostTask::EigenbasisRefresh { method, .. } = t;
        for (field, id) in t.operands() {
            // A refresh swap re-projects the moments where they live; a SOAP refresh reads its
            // factor and writes its basis where they live, which must be the host tier when
            // not the device (the CPU engine pages them in; the CUDA engine copies them into
            // its refreshers' and swap's device copies, `reserve::RefreshStaging`).
            let allowed = match field {
                "exp_avg" | "exp_avg_sq" => true,
                "factor" | "basis" => {
                    *method == crate::RefreshMethod::Soap && tier(id) == ArenaKind::Host
                }
                _ => false,
            };
            if !tier(id).on_device() && !allowed {
                return Err(invalid(format!(
                    "host task operand `{field}` `{}` is offloaded to the `{}` tier; only a \
                     refresh's moments may be, and a SOAP refresh's factor and basis in the \
                     host tier",
                    name(id),
                    tier(id)
                )));
            }
        }
    }
    let n = plan.buffers.len();
    // Per staging buffer: step position of its CopyIn, its last write, its CopyOut after it.
    let mut copied_in: Vec<Option<usize>> = vec![None; n];
    let mut last_write: Vec<Option<usize>> = vec![None; n];
    let mut copied_out: Vec<Option<usize>> = vec![None; n];
    let mut staging = vec![false; n];
    // A device copy (a host update's `<param>.device`, `Init::CopyOf` its source) carries the
    // last copy's values across steps: read before its copy, written by nothing else.
    let mut device_copy = vec![false; n];
    for (_, op) in plan.step_ops() {
        if let Op::CopyIn { src, dst, .. } = op {
            let copy = plan
                .buffers
                .get(dst.index())
                .is_some_and(|b| b.init == crate::Init::CopyOf { of: *src });
            if let Some(s) = staging.get_mut(dst.index()) {
                *s = !copy;
            }
            if let Some(d) = device_copy.get_mut(dst.index()) {
                *d = copy;
            }
        }
    }
    // Host updates run in the optimizer program, each refreshing its parameter's device copy
    // by a copy in that runs at every step; a warm-up-only copy (`last_step`) refreshes a
    // device copy, never a staging buffer.
    let n_fwd_bwd = plan.forward.len() + plan.backward.len();
    for (pos, op) in plan.step_ops() {
        if op.on_host() && pos < n_fwd_bwd {
            return Err(invalid(format!(
                "{} at {} runs on the host outside the optimizer program",
                op.name(),
                plan.step_position(pos)
            )));
        }
        if let Op::CopyIn {
            dst,
            last_step: Some(_),
            ..
        } = op
        {
            if !device_copy.get(dst.index()).is_some_and(|&d| d) {
                return Err(invalid(format!(
                    "copy_in at {} into `{}` runs at some steps only (`last_step`), but it is \
                     a staging buffer, not a device copy",
                    plan.step_position(pos),
                    name(*dst)
                )));
            }
        }
        if let Op::AdamW {
            param,
            on_host: true,
            ..
        } = op
        {
            let refreshed = plan.optimizer.iter().any(|o| {
                matches!(o, Op::CopyIn { src, dst, last_step: None }
                    if src == param && device_copy.get(dst.index()).is_some_and(|&d| d))
            });
            if !refreshed {
                return Err(invalid(format!(
                    "adam_w at {} updates `{}` on the host, but no copy_in at every step \
                     refreshes a device copy of it",
                    plan.step_position(pos),
                    name(*param)
                )));
            }
        }
    }
    for (pos, op) in plan.step_ops() {
        match op {
            Op::CopyIn { src, dst, .. }
            | Op::CopyOut {
                dst: src, src: dst, ..
            } => {
                // (`src` is the offloaded side, `dst` the device side, for both.)
                if tier(*src).on_device() || !tier(*dst).on_device() {
                    return Err(invalid(format!(
                        "{} `{}` -> `{}` at {}: a tier copy moves between an offloaded buffer \
                         and a device buffer",
                        op.name(),
                        name(*src),
                        name(*dst),
                        plan.step_position(pos)
                    )));
                }
                if matches!(op, Op::CopyIn { .. }) {
                    // A device copy may be refreshed twice (`host_updates = delayed` during
                    // the warm-up); a staging buffer is filled once.
                    let again_ok = device_copy.get(dst.index()).is_some_and(|&d| d);
                    if copied_in[dst.index()].is_some() && !again_ok {
                        return Err(invalid(format!(
                            "`{}` is the destination of two copy_in ops",
                            name(*dst)
                        )));
                    }
                    copied_in[dst.index()] = Some(pos);
                } else {
                    copied_out[dst.index()] = Some(pos);
                }
            }
            _ if op.on_host() => {
                // A host update runs where its state lives: every operand in the host tier.
                for (field, id) in op.operands() {
                    if tier(id) != ArenaKind::Host {
                        return Err(invalid(format!(
                            "{} at {} runs on the host, but its operand `{field}` `{}` is in \
                             the `{}` tier, not pinned host memory",
                            op.name(),
                            plan.step_position(pos),
                            name(id),
                            tier(id)
                        )));
                    }
                }
            }
            _ => {
                for (field, id, access) in op.accesses() {
                    if access.writes() && device_copy.get(id.index()).is_some_and(|&d| d) {
                        return Err(invalid(format!(
                            "{} at {} writes `{}`, a device copy that only its copy_in writes",
                            op.name(),
                            plan.step_position(pos),
                            name(id)
                        )));
                    }
                    if !tier(id).on_device() {
                        return Err(invalid(format!(
                            "{} at {} touches `{}` (operand `{field}`), which is offloaded to \
                             the `{}` tier; ops read its staging buffer after a copy_in",
                            op.name(),
                            plan.step_position(pos),
                            name(id),
                            tier(id)
                        )));
                    }
                    let i = id.index();
                    if i < n && copied_out[i].is_none() && access.writes() {
                        last_write[i] = Some(pos);
                    }
                    if i < n && copied_in[i].is_none() && staging[i] {
                        return Err(invalid(format!(
                            "{} at {} touches the staging buffer `{}` before its copy_in",
                            op.name(),
                            plan.step_position(pos),
                            name(id)
                        )));
                    }
                    if i < n && copied_out[i].is_some() && access.writes() {
                        return Err(invalid(format!(
                            "{} at {} writes the staging buffer `{}` after its copy_out: \
                             the write would be lost",
                            op.name(),
                            plan.step_position(pos),
                            name(id)
                        )));
                    }
                }
            }
        }
    }
    // A gradient's staging copy (its home is a gradient that left the device during the
    // backward) is clipped in place and dies with the step: nothing to write back.
    let mut gradient_staging = vec![false; n];
    for (_, op) in plan.step_ops() {
        if let Op::CopyIn { src, dst, .. } = op {
            if plan.buffer(*src).class == crate::BufferClass::Gradient {
                if let Some(g) = gradient_staging.get_mut(dst.index()) {
                    *g = true;
                }
            }
        }
    }
    for i in 0..n {
        if copied_in[i].is_some()
            && last_write[i].is_some()
            && copied_out[i].is_none()
            && !gradient_staging[i]
        {
            return Err(invalid(format!(
                "the staging buffer `{}` is written but never copied back to its home",
                plan.buffers[i].name
            )));
        }
    }
    Ok(())
}

impl Plan {
    /// Per buffer (indexed like [`Plan::buffers`]): whether it is the step-local device source
    /// of a `CopyOut` of the optimizer program (a staging buffer; `residency` from
    /// [`Plan::residency`]): what [`crate::MemoryPlan::carried_copy_outs`] holds across the step
    /// boundary.
    pub fn optimizer_copy_out_sources(&self, residency: &[Residency]) -> Vec<bool> {
        let mut out = vec![false; self.buffers.len()];
        for op in &self.optimizer {
            if let Op::CopyOut { src, .. } = op {
                if matches!(residency.get(src.index()), Some(Residency::Transient(_))) {
                    out[src.index()] = true;
                }
            }
        }
        out
    }

    /// Why this plan cannot carry copies out across the step boundary, or `None` when it can:
    /// the host-side work between steps (eigenbasis refresh tasks, NVMe blocks, updates on
    /// the host cores) reads host memory that pending copies out would still be writing.
    pub fn copy_out_carry_blocker(&self) -> Option<&'static str> {
        if !self.host_tasks.is_empty() {
            return Some("the plan has eigenbasis refresh tasks");
        }
        if self.memory.slots.iter().any(|s| s.arena == ArenaKind::Nvme) {
            return Some("the plan has NVMe-tier state");
        }
        if self.step_ops().any(|(_, o)| o.on_host()) {
            return Some("the plan has updates on the host cores");
        }
        if !self
            .optimizer
            .iter()
            .any(|o| matches!(o, Op::CopyOut { .. }))
        {
            return Some("the optimizer program copies nothing out");
        }
        None
    }
}

/// The next step's forward positions `0..=k` during which the optimizer's copies out may still
/// run ([`crate::MemoryPlan::carried_copy_outs`]), or `None`; an error when `k` leaves the
/// forward or the plan has work between steps that reads what the copies write
/// ([`Plan::copy_out_carry_blocker`]).
pub(crate) fn carried_head(plan: &Plan) -> Result<Option<LiveRange>, PlanError> {
    match plan.memory.carried_copy_outs {
        None => Ok(None),
        Some(k) if k >= plan.forward.len() => Err(invalid(format!(
            "copies out are carried to forward position {k}, but the forward has {} ops",
            plan.forward.len()
        ))),
        Some(k) => match plan.copy_out_carry_blocker() {
            Some(why) => Err(invalid(format!(
                "copies out are carried into the next step, but {why}"
            ))),
            None => Ok(Some(LiveRange { first: 0, last: k })),
        },
    }
}

/// Why buffers `i` and `j` (live in the step during `ri` and `rj`), which share bytes, clash
/// under a carry into `head` of the next step: one is a carried copy out's source
/// (`carried_src`) and the other is live during `head`. `None` when they do not clash so.
pub(crate) fn carried_clash(
    plan: &Plan,
    head: LiveRange,
    carried_src: &[bool],
    (i, ri): (usize, LiveRange),
    (j, rj): (usize, LiveRange),
) -> Option<String> {
    let (src, other) = if carried_src[i] && rj.overlaps(&head) {
        (i, j)
    } else if carried_src[j] && ri.overlaps(&head) {
        (j, i)
    } else {
        return None;
    };
    Some(format!(
        "buffer #{src} `{}` is copied out across the step boundary until forward position {}, \
         but #{other} `{}` is live then",
        plan.buffers[src].name, head.last, plan.buffers[other].name
    ))
}
