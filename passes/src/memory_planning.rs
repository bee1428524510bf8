//! `memory-planning`: gives every buffer of the lowered plan its arena and byte offset
//! (`schedule::MemoryPlan`), reusing the bytes of step-local buffers by liveness.
//!
//! Runs on the plan that `lower` left in [`PassContext::plan`] (the IR is unchanged):
//! - persistent buffers (parameters, gradients, optimizer state, data inputs, the loss,
//!   host-task operands, anything read before written; `schedule::Plan::residency` has the
//!   rules) get one place each in the `persistent` arena, in buffer order;
//! - transient buffers (step-local activations with a live range of step positions) share the
//!   `activations` arena: [`assign_offsets`] places them so that two buffers live at the same
//!   step position never share a byte.
//!
//! The plan is verified again afterwards, so a planner bug is a compile error, not a corrupt run.
//! `--print-after memory-planning` prints [`MemorySummary::report`]: the arenas, the peak live
//! bytes, the bytes saved against one place per buffer, and the largest buffers with their
//! offsets and live ranges.
use crate::liveness::human_bytes;
use crate::{Pass, PassContext, PassError};
use ir::Module;
use schedule::memory::align_up;
use schedule::{
    ArenaKind, ArenaPlan, BufferSlot, LiveRange, MemoryPlan, PersistReason, Plan, Residency,
    ARENA_ALIGN,
};
use std::collections::BTreeMap;
use std::fmt::Write;

/// A transient buffer to place: its size and live range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Size in bytes.
    pub bytes: usize,
    /// Step positions during which it must keep its bytes (inclusive).
    pub live: LiveRange,
    /// Positions of the *next* step during which it must keep its bytes too (a staging buffer
    /// whose copy out runs on into the next step's forward, `copy-out-overlap`); `None` for
    /// most blocks. It only has to stay apart from the other blocks' `live` there.
    pub also: Option<LiveRange>,
}

impl Block {
    /// A block live during `live` only.
    pub fn new(bytes: usize, live: LiveRange) -> Block {
        Block {
            bytes,
            live,
            also: None,
        }
    }

    /// True when the two blocks must not share a byte: their live ranges meet, or one's
    /// next-step range meets the other's live range.
    pub fn clashes(&self, other: &Block) -> bool {
        self.live.overlaps(&other.live)
            || self.also.is_some_and(|a| a.overlaps(&other.live))
            || other.also.is_some_and(|a| a.overlaps(&self.live))
    }
}

/// Byte offsets for `blocks` (multiples of `align`, a power of two) such that two blocks that
/// clash ([`Block::clashes`]: live ranges that overlap) never share a byte; returns the offsets (indexed like `blocks`) and the
/// arena size in bytes (the largest block end, rounded up to `align`).
///
/// The algorithm is *greedy by size* for interval lifetimes (Pisarchyk & Lee, "Efficient
/// Memory Management for Deep Neural Net Inference", 2020; TFLite's offset planner): blocks in
/// decreasing size (ties: earlier first use, then lower index, so the result is
/// deterministic), each at the lowest aligned offset at which it overlaps no already placed
/// block whose live range intersects its own. The big blocks settle the arena's shape first and
/// the small ones fill the gaps. The arena is never smaller than the peak of simultaneously
/// live bytes, and never larger than the aligned sizes summed. O(n²) for n blocks.
pub fn assign_offsets(blocks: &[Block], align: usize) -> (Vec<usize>, usize) {
    assert!(
        align.is_power_of_two(),
        "invariant: the alignment is a power of two"
    );
    let mut order: Vec<usize> = (0..blocks.len()).collect();
    order.sort_by(|&a, &b| {
        blocks[b]
            .bytes
            .cmp(&blocks[a].bytes)
            .then(blocks[a].live.first.cmp(&blocks[b].live.first))
            .then(a.cmp(&b))
    });
    let mut offsets = vec![0usize; blocks.len()];
    // Placed blocks, kept sorted by offset.
    let mut placed: Vec<usize> = Vec::with_capacity(blocks.len());
    let mut arena = 0usize;
    for &i in &order {
        let block = blocks[i];
        let mut candidate = 0usize;
        for &j in &placed {
            if !blocks[j].clashes(&block) {
                continue;
            }
            let start = offsets[j];
            if start >= candidate.saturating_add(block.bytes) {
                // The gap [candidate, start) fits, and every later placed block starts at or
                // after `start`: nothing else can overlap.
                break;
            }
            candidate = candidate.max(align_up(start.saturating_add(blocks[j].bytes), align));
        }
        offsets[i] = candidate;
        let at = placed.partition_point(|&j| offsets[j] <= candidate);
        placed.insert(at, i);
        arena = arena.max(candidate.saturating_add(block.bytes));
    }
    (offsets, align_up(arena, align))
}

/// The memory plan of `plan`: persistent buffers one after another in the `persistent` arena,
/// transient buffers in the `activations` arena at the offsets of [`assign_offsets`].
pub fn plan_memory(plan: &Plan) -> MemoryPlan {
    plan_memory_carrying(plan, None)
}

/// [`plan_memory`], with the staging buffers that the optimizer program copies out
/// (`schedule::Plan::optimizer_copy_out_sources`) also kept apart from every buffer live in the
/// next step's `forward[0..=k]` when `carry` is `Some(k)` (recorded as
/// `MemoryPlan::carried_copy_outs`).
pub fn plan_memory_carrying(plan: &Plan, carry: Option<usize>) -> MemoryPlan {
    let residency = plan.residency();
    let carried = match carry {
        Some(_) => plan.optimizer_copy_out_sources(&residency),
        None => vec![false; plan.buffers.len()],
    };
    let head = carry.map(|k| LiveRange { first: 0, last: k });
    let mut slots = vec![
        BufferSlot {
            arena: ArenaKind::Persistent,
            offset: 0,
        };
        plan.buffers.len()
    ];
    let mut transient = Vec::new();
    let mut blocks = Vec::new();
    let mut persistent_bytes = 0usize;
    for (i, (b, r)) in plan.buffers.iter().zip(&residency).enumerate() {
        // Offloaded buffers keep the slot `tier-placement` gave them.
        if let Some(slot) = plan.memory.slots.get(i).filter(|s| !s.arena.on_device()) {
            slots[i] = *slot;
            continue;
        }
        match r {
            Residency::Transient(live) => {
                transient.push(i);
                blocks.push(Block {
                    bytes: b.size_bytes(),
                    live: *live,
                    also: head.filter(|_| carried[i]),
                });
            }
            Residency::Persistent(_) => {
                slots[i].offset = persistent_bytes;
                persistent_bytes =
                    persistent_bytes.saturating_add(align_up(b.size_bytes(), ARENA_ALIGN));
            }
        }
    }
    let (offsets, activations_bytes) = assign_offsets(&blocks, ARENA_ALIGN);
    for (&i, offset) in transient.iter().zip(offsets) {
        slots[i] = BufferSlot {
            arena: ArenaKind::Activations,
            offset,
        };
    }
    let mut arenas = vec![
        ArenaPlan {
            kind: ArenaKind::Persistent,
            bytes: persistent_bytes,
        },
        ArenaPlan {
            kind: ArenaKind::Activations,
            bytes: activations_bytes,
        },
    ];
    arenas.extend(
        plan.memory
            .arenas
            .iter()
            .filter(|a| !a.kind.on_device())
            .copied(),
    );
    MemoryPlan {
        alignment: ARENA_ALIGN,
        arenas,
        slots,
        budgets: plan.memory.budgets.clone(),
        pinned_refresh_shadows: plan.memory.pinned_refresh_shadows,
        carried_copy_outs: carry,
    }
}

/// Figures of a plan's memory plan (all sizes in bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemorySummary {
    /// The `persistent` arena.
    pub persistent_bytes: usize,
    /// The `activations` arena.
    pub activations_bytes: usize,
    /// Every buffer in its own aligned place (what the engines allocated before this pass).
    pub unshared_bytes: usize,
    /// The transient buffers in their own aligned places.
    pub transient_unshared_bytes: usize,
    /// Most bytes of transient buffers live at one step position (a lower bound on the
    /// activations arena).
    pub peak_live_bytes: usize,
    /// Number of persistent buffers.
    pub persistent_buffers: usize,
    /// Number of transient buffers.
    pub transient_buffers: usize,
}

impl MemorySummary {
    /// The figures of `plan` (whose memory plan should be verified).
    pub fn of(plan: &Plan) -> MemorySummary {
        let residency = plan.residency();
        let aligned = |b: &schedule::Buffer| align_up(b.size_bytes(), ARENA_ALIGN);
        let transient = || {
            plan.buffers
                .iter()
                .zip(&residency)
                .filter(|(_, r)| matches!(r, Residency::Transient(_)))
        };
        MemorySummary {
            persistent_bytes: plan.memory.arena_bytes(ArenaKind::Persistent),
            activations_bytes: plan.memory.arena_bytes(ArenaKind::Activations),
            unshared_bytes: plan.buffers.iter().map(aligned).sum(),
            transient_unshared_bytes: transient().map(|(b, _)| aligned(b)).sum(),
            peak_live_bytes: plan.peak_live_bytes(&residency),
            persistent_buffers: plan.buffers.len() - transient().count(),
            transient_buffers: transient().count(),
        }
    }

    /// Bytes of all arenas.
    pub fn planned_bytes(&self) -> usize {
        self.persistent_bytes + self.activations_bytes
    }

    /// Bytes saved against one place per buffer.
    pub fn saved_bytes(&self) -> usize {
        self.unshared_bytes.saturating_sub(self.planned_bytes())
    }

    /// One line: arenas, peak live bytes, saving.
    pub fn line(&self) -> String {
        format!(
            "persistent arena {}, activations arena {} (peak live {}, unshared {}); {} in all, {} saved",
            human_bytes(self.persistent_bytes),
            human_bytes(self.activations_bytes),
            human_bytes(self.peak_live_bytes),
            human_bytes(self.transient_unshared_bytes),
            human_bytes(self.planned_bytes()),
            human_bytes(self.saved_bytes()),
        )
    }

    /// The `--print-after memory-planning` report (`;` comment lines): the arenas, peak live
    /// bytes, bytes saved, why buffers persist, and the `largest` biggest transient buffers
    /// with their offsets and live ranges.
    pub fn report(&self, plan: &Plan, largest: usize) -> String {
        let mut s = String::new();
        let pct = |a: usize, b: usize| 100.0 * a as f64 / b.max(1) as f64;
        let _ = writeln!(
            s,
            "; memory plan: offsets aligned to {} bytes",
            plan.memory.alignment
        );
        let _ = writeln!(
            s,
            ";   arena persistent  {:>14} B  {:>11}  {} buffers, one place each",
            self.persistent_bytes,
            human_bytes(self.persistent_bytes),
            self.persistent_buffers
        );
        let _ = writeln!(
            s,
            ";   arena activations {:>14} B  {:>11}  {} step-local buffers sharing bytes by liveness",
            self.activations_bytes,
            human_bytes(self.activations_bytes),
            self.transient_buffers
        );
        let _ = writeln!(
            s,
            "; peak live step-local bytes {} ({}): the activations arena is {:.1}% of it",
            self.peak_live_bytes,
            human_bytes(self.peak_live_bytes),
            pct(self.activations_bytes, self.peak_live_bytes)
        );
        let _ = writeln!(
            s,
            "; one place per buffer: {} ({}); planned: {} ({}); saved {} ({:.1}%)",
            self.unshared_bytes,
            human_bytes(self.unshared_bytes),
            self.planned_bytes(),
            human_bytes(self.planned_bytes()),
            human_bytes(self.saved_bytes()),
            pct(self.saved_bytes(), self.unshared_bytes)
        );
        let residency = plan.residency();
        let mut reasons: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for (b, r) in plan.buffers.iter().zip(&residency) {
            if let Residency::Persistent(why) = r {
                let key = match why {
                    PersistReason::ReadBeforeWrite { .. } => "read before written".to_string(),
                    w => w.describe(plan),
                };
                let e = reasons.entry(key).or_default();
                e.0 += 1;
                e.1 += b.size_bytes();
            }
        }
        let _ = writeln!(s, "; persistent because:");
        for (why, (n, bytes)) in &reasons {
            let _ = writeln!(
                s,
                ";   {why:<24} {n:>5} buffers {:>11}",
                human_bytes(*bytes)
            );
        }
        let mut list: Vec<(usize, LiveRange)> = residency
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.live_range().map(|l| (i, l)))
            .collect();
        list.sort_by(|a, b| {
            plan.buffers[b.0]
                .size_bytes()
                .cmp(&plan.buffers[a.0].size_bytes())
                .then(a.0.cmp(&b.0))
        });
        let _ = writeln!(
            s,
            "; largest step-local buffers (offset in the activations arena, live range):"
        );
        for &(i, live) in list.iter().take(largest) {
            let b = &plan.buffers[i];
            let _ = writeln!(
                s,
                ";   #{i:<5} {:<32} {:>11} at {:>12}  {}..{}",
                b.name,
                human_bytes(b.size_bytes()),
                plan.memory.slots[i].offset,
                plan.step_position(live.first),
                plan.step_position(live.last)
            );
        }
        s
    }
}

/// A compile error when the planned arenas exceed a budget of the plan's
/// [`schedule::Budgets`], naming the largest consumers of that tier. The device tier counts
/// the engine's own allocations too ([`schedule::reserve::engine_reserve`]).
pub fn check_budgets(plan: &Plan) -> Result<(), PassError> {
    let m = &plan.memory;
    let b = &m.budgets;
    let reserve = schedule::reserve::engine_reserve(plan, m.device_bytes());
    type Tier = (&'static str, usize, Option<u64>, fn(ArenaKind) -> bool);
    let tiers: [Tier; 3] = [
        (
            "the device (`gpu_memory` / `memory`)",
            m.device_bytes() + reserve.total(),
            b.device,
            |k| k.on_device(),
        ),
        (
            "`host_memory`",
            m.arena_bytes(ArenaKind::Host),
            b.host,
            |k| k == ArenaKind::Host,
        ),
        (
            "`nvme_memory`",
            m.arena_bytes(ArenaKind::Nvme),
            b.nvme,
            |k| k == ArenaKind::Nvme,
        ),
    ];
    for (what, have, budget, member) in tiers {
        let Some(cap) = budget else { continue };
        if have as u64 <= cap {
            continue;
        }
        let mut list: Vec<(usize, &str)> = plan
            .buffers
            .iter()
            .zip(&m.slots)
            .filter(|(_, s)| member(s.arena) && s.arena != ArenaKind::Activations)
            .map(|(b, _)| (b.size_bytes(), b.name.as_str()))
            .collect();
        list.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
        let mut largest: Vec<String> = list
            .iter()
            .take(5)
            .map(|(n, name)| format!("%{name} {}", human_bytes(*n)))
            .collect();
        if member(ArenaKind::Activations) && reserve.total() > 0 {
            largest.push(format!(
                "the engine's own {} ({})",
                human_bytes(reserve.total()),
                reserve.describe()
            ));
        }
        if member(ArenaKind::Activations) {
            largest.insert(
                0,
                format!(
                    "the activations arena {}",
                    human_bytes(m.arena_bytes(ArenaKind::Activations))
                ),
            );
        }
        return Err(PassError::Invalid {
            pass: "memory-planning",
            message: format!(
                "{what} budget of {} cannot be met: the planned arenas need {}; the largest \
                 consumers: {}",
                human_bytes(cap as usize),
                human_bytes(have),
                largest.join(", ")
            ),
        });
    }
    Ok(())
}

/// The `memory-planning` pass. Needs the plan of `lower`; replaces its memory plan, verifies
/// the result and leaves the figures in [`PassContext::memory`].
pub struct MemoryPlanning;

impl Pass for MemoryPlanning {
    fn name(&self) -> &'static str {
        "memory-planning"
    }
    fn run(&mut self, module: &mut Module, cx: &mut PassContext) -> Result<String, PassError> {
        let plan = cx.plan.as_mut().ok_or_else(|| PassError::Invalid {
            pass: "memory-planning",
            message: "no plan to place: run `lower` first".into(),
        })?;
        plan.memory = plan_memory(plan);
        plan.memory.budgets = module.config.target.budgets().clone();
        check_budgets(plan)?;
        plan.verify().map_err(|e| PassError::Invalid {
            pass: "memory-planning",
            message: format!("the planned plan fails verification (compiler bug): {e}"),
        })?;
        let summary = MemorySummary::of(plan);
        let line = summary.line();
        cx.memory = Some(summary);
        Ok(line)
    }
    fn dump_after(&self, _module: &Module, cx: &PassContext) -> String {
        match (&cx.plan, &cx.memory) {
            (Some(plan), Some(m)) => {
                format!(
                    "; memory plan after memory-planning\n{}",
                    m.report(plan, 12)
                )
            }
            _ => "; memory plan after memory-planning: no plan".into(),
        }
    }
}
