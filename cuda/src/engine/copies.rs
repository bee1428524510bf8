//! Stream ordering of the plan's tier copies. `CopyIn` runs on the copy-in stream and
//! `CopyOut` on the copy-out stream, so that bringing the next offloaded tensor in, writing the
//! last one back and the optimizer's compute overlap (host→device and device→host use separate
//! copy engines). Correctness comes from events, placed once at engine setup by
//! [`CopyOrder::new`] from what every op of the step touches:
//!
//! - an op on stream S that touches bytes an earlier op on another stream S' touched, one of
//!   the two writing them, waits for the event after that op (the latest such op: each stream
//!   runs in order, so the event also covers everything S' ran before it);
//! - a compute op is followed by an event only when a copy waits for it.
//!
//! Bytes are the plan's slots (arena, offset, size): a staging buffer shares the activations
//! arena with tensors that died earlier in the step, so a copy into it waits for the last
//! compute op that touched those bytes, and a compute op that reuses the bytes of a staging
//! buffer waits for its copy out. Across steps nothing is pending: the end of a step waits
//! for every stream ([`crate::Device::synchronize_step`]), and the end of the optimizer program
//! makes the compute stream wait for both copy streams, so that a refresh swap that re-projects
//! moments in the host tier (compute stream, right after the optimizer) sees their new values.
use crate::StreamKind;
use schedule::{ArenaKind, BufferId, Op, Plan};

/// Bytes of one arena, `(arena, start, end)`, with whether an op writes them.
type Touch = ((ArenaKind, usize, usize), bool);

/// Which stream runs an op: the copies on their copy streams, everything else on compute.
pub(super) fn stream_of(op: &Op) -> StreamKind {
    match op {
        Op::CopyIn { .. } => StreamKind::CopyIn,
        Op::CopyOut { .. } => StreamKind::CopyOut,
        _ => StreamKind::Compute,
    }
}

fn lane(s: StreamKind) -> usize {
    match s {
        StreamKind::Compute => 0,
        StreamKind::CopyIn => 1,
        _ => 2,
    }
}

/// The events and waits of one step (see the module docs), by step position
/// ([`Plan::step_ops`]).
#[derive(Debug, Default)]
pub(super) struct CopyOrder {
    /// Whether the plan has tier copies at all (else nothing here is used).
    pub(super) active: bool,
    /// Per step position: record an event on the op's stream after it.
    pub(super) record_after: Vec<bool>,
    /// Per step position: positions whose events the op's stream waits for before it.
    pub(super) waits: Vec<Vec<usize>>,
    /// Step positions of the first op of the forward, backward and optimizer programs.
    offsets: [usize; 3],
    /// The last copy-in and copy-out positions of the step (the compute stream waits for them
    /// at the end of the optimizer program, unless copies out are carried).
    pub(super) last_copies: Vec<usize>,
    /// Whether the plan carries its copies out into the next step
    /// (`schedule::MemoryPlan::carried_copy_outs`): the end of a step does not wait for the
    /// copy-out stream.
    pub(super) carried: bool,
    /// Per step position: the *previous* step's copies out (positions after this one, whose
    /// events still hold that step's record) that the op's stream waits for before it.
    pub(super) cross_waits: Vec<Vec<usize>>,
}

impl CopyOrder {
    /// The ordering of `plan`'s step (empty when it has no `CopyIn` / `CopyOut`).
    pub(super) fn new(plan: &Plan) -> CopyOrder {
        let n = plan.step_len();
        let offsets = [
            0,
            plan.forward.len(),
            plan.forward.len() + plan.backward.len(),
        ];
        if !plan
            .step_ops()
            .any(|(_, o)| matches!(o, Op::CopyIn { .. } | Op::CopyOut { .. }))
        {
            return CopyOrder {
                offsets,
                ..CopyOrder::default()
            };
        }
        // Byte range of a buffer: (arena, start, end).
        let range = |id: BufferId| -> Option<(ArenaKind, usize, usize)> {
            let slot = plan.memory.slot(id)?;
            let bytes = plan.buffers.get(id.index())?.size_bytes();
            Some((slot.arena, slot.offset, slot.offset + bytes))
        };
        // Per op: its stream and the ranges it touches, with whether it writes them.
        // A host-placed update is on no stream: `host_updates` orders it (events recorded at
        // its submission, the engine thread waiting for it before a conflicting op).
        let touched: Vec<(usize, Vec<Touch>)> = plan
            .step_ops()
            .map(|(_, op)| {
                if op.on_host() {
                    return (0, Vec::new());
                }
                let r = op
                    .accesses()
                    .into_iter()
                    .filter_map(|(_, id, a)| range(id).map(|r| (r, a.writes())))
                    .collect();
                (lane(stream_of(op)), r)
            })
            .collect();
        let conflicts = |a: &[Touch], b: &[Touch]| {
            a.iter().any(|&((ka, sa, ea), wa)| {
                b.iter()
                    .any(|&((kb, sb, eb), wb)| ka == kb && sa < eb && sb < ea && (wa || wb))
            })
        };
        let mut record_after = vec![false; n];
        let mut waits = vec![Vec::new(); n];
        // Vector clocks: clock[s][s2] = the latest position of stream s2 that stream s is
        // ordered after (an in-order stream finishes its ops in order); after[p] = the clock
        // of p's stream right after p (what an event after p carries).
        let mut clock = [[None::<usize>; 3]; 3];
        let mut after = vec![[None::<usize>; 3]; n];
        let copy_positions: Vec<usize> = (0..n).filter(|&p| touched[p].0 != 0).collect();
        for p in 0..n {
            let s = touched[p].0;
            // Only pairs with a copy on one side need events: compute ops among themselves
            // are ordered by their stream. For a compute op, the candidates are the copies
            // before it; for a copy, every earlier op of another stream.
            let candidates: Box<dyn Iterator<Item = usize>> = if s == 0 {
                Box::new(copy_positions.iter().copied().filter(|&q| q < p).rev())
            } else {
                Box::new((0..p).rev())
            };
            // The latest conflicting op of each other stream.
            let mut latest = [None::<usize>; 3];
            let mut open = [true; 3];
            open[s] = false;
            for q in candidates {
                let s2 = touched[q].0;
                if !open[s2] {
                    continue;
                }
                if clock[s][s2].is_some_and(|w| w >= q) {
                    open[s2] = false; // everything of s2 up to q is ordered already
                } else if conflicts(&touched[p].1, &touched[q].1) {
                    latest[s2] = Some(q);
                    open[s2] = false;
                }
                if !open.iter().any(|&o| o) {
                    break;
                }
            }
            // Wait for the later one first: its event may order the other too.
            let mut need: Vec<usize> = latest.iter().flatten().copied().collect();
            need.sort_unstable_by(|a, b| b.cmp(a));
            for q in need {
                let s2 = touched[q].0;
                if clock[s][s2].is_some_and(|w| w >= q) {
                    continue;
                }
                waits[p].push(q);
                record_after[q] = true;
                for x in 0..3 {
                    clock[s][x] = clock[s][x].max(after[q][x]);
                }
            }
            clock[s][s] = Some(p);
            after[p] = clock[s];
        }
        for &p in &copy_positions {
            record_after[p] = true;
        }
        let last = |l: usize| {
            copy_positions
                .iter()
                .rev()
                .find(|&&p| touched[p].0 == l)
                .copied()
        };
        let last_copies = [last(1), last(2)].into_iter().flatten().collect();
        let carried = plan.memory.carried_copy_outs.is_some();
        let cross_waits = if carried {
            cross_step_waits(&touched, conflicts)
        } else {
            vec![Vec::new(); n]
        };
        CopyOrder {
            active: true,
            record_after,
            waits,
            offsets,
            last_copies,
            carried,
            cross_waits,
        }
    }

    /// Step position of op `index` of `section` (`"forward"`, `"backward"`, else optimizer).
    pub(super) fn position(&self, section: &str, index: usize) -> usize {
        let base = match section {
            "forward" => self.offsets[0],
            "backward" => self.offsets[1],
            _ => self.offsets[2],
        };
        base + index
    }
}

/// The waits of ops of a step for the copies out of the step before, which may still be
/// running when it starts (`touched`: per step position its lane and byte ranges, as in
/// [`CopyOrder::new`]). At a step's start the compute and copy-in streams are idle (the host
/// waited for them); the copy-out stream runs the previous step's copies in order. An op at
/// position `p` conflicting with a previous-step copy out at `q > p` waits for the latest such
/// `q` its stream has not waited for yet; a copy out at `q < p` was issued again in this step
/// before `p`, and the step's own events order `p` after that later instance. Copies out
/// themselves follow the previous ones on their stream.
fn cross_step_waits(
    touched: &[(usize, Vec<Touch>)],
    conflicts: impl Fn(&[Touch], &[Touch]) -> bool,
) -> Vec<Vec<usize>> {
    let n = touched.len();
    let outs: Vec<usize> = (0..n).filter(|&q| touched[q].0 == 2).collect();
    let mut waits = vec![Vec::new(); n];
    // Per lane: the latest previous-step copy out it has waited for.
    let mut known = [None::<usize>; 3];
    for p in 0..n {
        let s = touched[p].0;
        if s == 2 || touched[p].1.is_empty() {
            continue;
        }
        let hit = outs
            .iter()
            .rev()
            .copied()
            .take_while(|&q| q > p && known[s].is_none_or(|k| q > k))
            .find(|&q| conflicts(&touched[p].1, &touched[q].1));
        if let Some(q) = hit {
            waits[p].push(q);
            known[s] = Some(q);
        }
    }
    waits
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan of examples/tiny-tiers.asteria: moments in the host and NVMe tiers, their
    /// staging buffers sharing the activations arena.
    fn tiered_plan() -> Plan {
        let spec = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/tiny-tiers.asteria");
        let config = frontend::load_spec(&spec).expect("examples/tiny-tiers.asteria loads");
        let mut module = ir::Module::new(config);
        let mut pm = passes::PassManager::new(passes::PassOptions::default()).expect("passes");
        let mut sink = Vec::new();
        let (cx, _) = pm.run(&mut module, None, &mut sink).expect("pipeline");
        cx.plan.expect("a plan")
    }

    /// The plan of examples/tiny-tiers.asteria under the largest device budget (64 KiB steps)
    /// at which gradients leave the device in the backward: copies out during the backward,
    /// copies in of gradients and moments in the optimizer.
    fn streamed_gradient_plan() -> Plan {
        plan_below(6 << 20, |p| {
            p.backward.iter().any(|o| matches!(o, Op::CopyOut { .. }))
        })
    }

    /// The same under the largest budget at which parameters leave too: copies in during the
    /// forward and the backward as well.
    fn offloaded_parameter_plan() -> Plan {
        plan_below(6 << 20, |p| {
            p.forward.iter().any(|o| matches!(o, Op::CopyIn { .. }))
        })
    }

    /// examples/tiny-tiers.asteria (host tier only) under the largest device budget, in 64
    /// KiB steps below `start`, whose plan `wanted` accepts.
    fn plan_below(start: u64, wanted: impl Fn(&Plan) -> bool) -> Plan {
        let spec = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/tiny-tiers.asteria");
        let mut budget = start;
        loop {
            budget -= 64 << 10;
            let mut config = frontend::load_spec(&spec).expect("examples/tiny-tiers.asteria loads");
            if let ir::config::TargetConfig::Cpu { budgets, .. } = &mut config.target {
                budgets.device = Some(budget);
                budgets.nvme_dir = None;
                budgets.nvme = None;
                budgets.host = None;
            }
            let mut module = ir::Module::new(config);
            let mut pm = passes::PassManager::new(passes::PassOptions::default()).expect("passes");
            let (cx, _) = pm
                .run(&mut module, None, &mut Vec::new())
                .expect("a budget above the parameters compiles");
            let plan = cx.plan.expect("a plan");
            if wanted(&plan) {
                return plan;
            }
        }
    }

    /// Replays the step on three in-order streams with `order`'s events and returns the first
    /// pair (earlier, later) of conflicting ops on different streams that the events leave
    /// unordered. `known[p][s]` = the latest position of stream s known finished when op p
    /// starts (vector clocks; an in-order stream finishes its ops in order).
    fn unordered(plan: &Plan, order: &CopyOrder) -> Option<(usize, usize)> {
        let ops: Vec<&Op> = plan.step_ops().map(|(_, o)| o).collect();
        let n = ops.len();
        let mut clock = [[None::<usize>; 3]; 3]; // per stream: what it knows of each stream
        let mut at_event: Vec<[Option<usize>; 3]> = vec![[None; 3]; n];
        let mut known = vec![[None::<usize>; 3]; n];
        let join = |a: &mut [Option<usize>; 3], b: &[Option<usize>; 3]| {
            for i in 0..3 {
                a[i] = a[i].max(b[i]);
            }
        };
        for p in 0..n {
            let s = lane(stream_of(ops[p]));
            for &q in &order.waits[p] {
                assert!(
                    order.record_after[q],
                    "position {p} waits for {q}, which records nothing"
                );
                let ev = at_event[q];
                join(&mut clock[s], &ev);
            }
            known[p] = clock[s];
            clock[s][s] = Some(p);
            at_event[p] = clock[s];
        }
        let touched = |o: &Op| -> Vec<Touch> {
            o.accesses()
                .into_iter()
                .map(|(_, id, a)| {
                    let slot = plan.memory.slot(id).expect("every buffer has a slot");
                    let b = plan.buffer(id).size_bytes();
                    ((slot.arena, slot.offset, slot.offset + b), a.writes())
                })
                .collect()
        };
        for p in 0..n {
            let sp = lane(stream_of(ops[p]));
            let tp = touched(ops[p]);
            for (q, op_q) in ops.iter().enumerate().take(p) {
                let sq = lane(stream_of(op_q));
                if sq == sp {
                    continue;
                }
                let tq = touched(op_q);
                let conflict = tp.iter().any(|&((ka, sa, ea), wa)| {
                    tq.iter()
                        .any(|&((kb, sb, eb), wb)| ka == kb && sa < eb && sb < ea && (wa || wb))
                });
                if conflict && known[p][sq].is_none_or(|k| k < q) {
                    return Some((q, p));
                }
            }
        }
        None
    }

    #[test]
    fn every_conflicting_pair_of_streams_is_ordered_by_an_event() {
        for plan in [
            tiered_plan(),
            streamed_gradient_plan(),
            offloaded_parameter_plan(),
        ] {
            every_conflict_ordered(&plan);
        }
    }

    fn every_conflict_ordered(plan: &Plan) {
        let plan = plan.clone();
        let order = CopyOrder::new(&plan);
        assert!(order.active, "the tiny tiered plan has copies");
        let copies = plan
            .step_ops()
            .filter(|(_, o)| matches!(o, Op::CopyIn { .. } | Op::CopyOut { .. }))
            .count();
        assert!(copies >= 4, "{copies} copies");
        assert_eq!(unordered(&plan, &order), None);
        // Every op that reads a staging buffer waits for its copy in (directly or through an
        // earlier compute op), and no compute op waits for nothing it conflicts with: fewer
        // waits than ops.
        let waits: usize = order.waits.iter().map(Vec::len).sum();
        assert!(waits > 0 && waits < plan.step_len(), "{waits} waits");
        // The replay can fail: without one of the waits some pair is unordered.
        for p in 0..order.waits.len() {
            for k in 0..order.waits[p].len() {
                let mut broken = CopyOrder {
                    active: true,
                    record_after: order.record_after.clone(),
                    waits: order.waits.clone(),
                    offsets: order.offsets,
                    last_copies: order.last_copies.clone(),
                    carried: order.carried,
                    cross_waits: order.cross_waits.clone(),
                };
                broken.waits[p].remove(k);
                assert!(
                    unordered(&plan, &broken).is_some(),
                    "the wait of position {p} for {} is not needed",
                    order.waits[p][k]
                );
            }
        }
    }

    /// Replays two consecutive steps of a plan whose copies out are carried
    /// (`carried_copy_outs`): the first as [`unordered`] does, then the host's end of step
    /// (compute and copy-in streams waited for, the copy-out stream not), then the second with
    /// its own events and the cross-step waits on the first step's copies out. Returns the
    /// first conflicting pair (first-step position, second-step position) left unordered.
    fn unordered_across_steps(plan: &Plan, order: &CopyOrder) -> Option<(usize, usize)> {
        let ops: Vec<&Op> = plan.step_ops().map(|(_, o)| o).collect();
        let n = ops.len();
        // Global positions: step one 0..n, step two n..2n.
        let mut clock = [[None::<usize>; 3]; 3];
        let mut at_event: Vec<[Option<usize>; 3]> = vec![[None; 3]; 2 * n];
        let mut known = vec![[None::<usize>; 3]; 2 * n];
        let join = |a: &mut [Option<usize>; 3], b: &[Option<usize>; 3]| {
            for i in 0..3 {
                a[i] = a[i].max(b[i]);
            }
        };
        for g in 0..2 * n {
            let (step, p) = (g / n, g % n);
            if g == n {
                // The end of step one: the host waited for compute and copy-in.
                let mut host = clock[0];
                join(&mut host, &clock[1]);
                for c in &mut clock {
                    join(c, &host);
                }
            }
            let s = lane(stream_of(ops[p]));
            if ops[p].on_host() {
                continue;
            }
            if step == 1 {
                for &q in &order.cross_waits[p] {
                    let ev = at_event[q];
                    join(&mut clock[s], &ev);
                }
            }
            for &q in &order.waits[p] {
                let ev = at_event[step * n + q];
                join(&mut clock[s], &ev);
            }
            known[g] = clock[s];
            clock[s][s] = Some(g);
            at_event[g] = clock[s];
        }
        let touched = |o: &Op| -> Vec<Touch> {
            o.accesses()
                .into_iter()
                .map(|(_, id, a)| {
                    let slot = plan.memory.slot(id).expect("every buffer has a slot");
                    let b = plan.buffer(id).size_bytes();
                    ((slot.arena, slot.offset, slot.offset + b), a.writes())
                })
                .collect()
        };
        for p in 0..n {
            let tp = touched(ops[p]);
            let sp = lane(stream_of(ops[p]));
            for q in 0..n {
                let sq = lane(stream_of(ops[q]));
                if sq == sp || ops[q].on_host() || ops[p].on_host() {
                    continue;
                }
                let tq = touched(ops[q]);
                let conflict = tp.iter().any(|&((ka, sa, ea), wa)| {
                    tq.iter()
                        .any(|&((kb, sb, eb), wb)| ka == kb && sa < eb && sb < ea && (wa || wb))
                });
                if conflict && known[n + p][sq].is_none_or(|k| k < q) {
                    return Some((q, p));
                }
            }
        }
        None
    }

    #[test]
    fn carried_copies_out_are_ordered_before_the_next_steps_ops_that_touch_their_bytes() {
        let mut carried = 0;
        for plan in [streamed_gradient_plan(), offloaded_parameter_plan()] {
            let Some(k) = plan.memory.carried_copy_outs else {
                continue;
            };
            carried += 1;
            let order = CopyOrder::new(&plan);
            assert!(order.carried);
            assert_eq!(unordered(&plan, &order), None);
            assert_eq!(unordered_across_steps(&plan, &order), None);
            // The carry buys something: the forward's first k + 1 ops do not wait for a copy
            // out (in this plan they copy no parameter in either).
            if !plan.forward.iter().any(|o| matches!(o, Op::CopyIn { .. })) {
                assert!(
                    order.cross_waits[..=k].iter().all(Vec::is_empty),
                    "forward ops up to {k} wait for copies out: {:?}",
                    &order.cross_waits[..=k]
                );
            }
            // The replay can fail: without the cross-step waits some pair is unordered (the
            // next step's copies in of the same moments read what the copies out write).
            let waits: usize = order.cross_waits.iter().map(Vec::len).sum();
            assert!(waits > 0, "no op waits for the previous step's copies out");
            let broken = CopyOrder {
                active: true,
                record_after: order.record_after.clone(),
                waits: order.waits.clone(),
                offsets: order.offsets,
                last_copies: order.last_copies.clone(),
                carried: true,
                cross_waits: vec![Vec::new(); order.cross_waits.len()],
            };
            assert!(unordered_across_steps(&plan, &broken).is_some());
        }
        assert!(carried > 0, "no test plan carries its copies out");
    }

    #[test]
    fn a_plan_without_copies_needs_no_events() {
        let spec =
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny.asteria");
        let config = frontend::load_spec(&spec).expect("examples/tiny.asteria loads");
        let mut module = ir::Module::new(config);
        let mut pm = passes::PassManager::new(passes::PassOptions::default()).expect("passes");
        let (cx, _) = pm
            .run(&mut module, None, &mut Vec::new())
            .expect("pipeline");
        let plan = cx.plan.expect("a plan");
        let order = CopyOrder::new(&plan);
        assert!(!order.active);
        assert_eq!(
            order.position("optimizer", 2),
            plan.forward.len() + plan.backward.len() + 2
        );
    }
}
