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
//! buffer waits for its copy out. Across steps, by default nothing is pending: the end of a
//! step waits for every stream ([`crate::Device::synchronize_step`]), and the end of the
//! optimizer program makes the compute stream wait for both copy streams, so that a refresh
//! swap that re-projects moments in the host tier (compute stream, right after the optimizer)
//! sees their new values. A plan whose copies out are carried into the next step
//! (`schedule::MemoryPlan::carried_copy_outs`, set by `copy-out-overlap` only for plans without
//! refresh tasks, NVMe state or host updates) ends a step waiting for the compute and copy-in
//! streams only; the next step's ops that touch bytes of a copy out still pending wait for its
//! event ([`CopyOrder::cross_waits`]), and a step whose optimizer program stopped early (a
//! skipped step) waits for every stream at its end.
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
///
/// This needs the previous step to have issued every copy out: then each event at `q > p`
/// holds the latest record of that position, and waiting for it covers every earlier copy out.
/// A step whose optimizer program stopped early (a skipped step) leaves older events at its
/// later positions, so the engine waits for the copy-out stream at its end instead.
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

    /// The byte ranges `op` touches in `plan`'s slots, with whether it writes them.
    fn touched_bytes(plan: &Plan, op: &Op) -> Vec<Touch> {
        op.accesses()
            .into_iter()
            .map(|(_, id, a)| {
                let slot = plan.memory.slot(id).expect("every buffer has a slot");
                let b = plan.buffer(id).size_bytes();
                ((slot.arena, slot.offset, slot.offset + b), a.writes())
            })
            .collect()
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
        let touched = |o: &Op| touched_bytes(plan, o);
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

    /// A run of step positions issued in order, after the host's wait.
    type Segment = (std::ops::Range<usize>, HostWait);

    /// How the host waits before a segment of a replay ([`replay`]).
    #[derive(Clone, Copy, Debug)]
    enum HostWait {
        /// Nothing (the next program of the same step, an evaluation's forward).
        Nothing,
        /// The compute and copy-in streams (the end of a step whose copies out are carried).
        ComputeAndCopyIn,
        /// Every stream (the end of a step otherwise).
        All,
    }

    /// Replays `segments` (runs of step positions, each issued in order after the host wait)
    /// on three in-order streams as the engine issues them: an op waits, before it, for the
    /// latest record of each position its [`CopyOrder`] names (the cross-step waits when
    /// carried, then the step's own); a recorded position keeps only its latest event.
    /// Returns the first pair of conflicting ops on different streams (global issue indices)
    /// that nothing orders.
    fn replay(plan: &Plan, order: &CopyOrder, segments: &[Segment]) -> Option<(usize, usize)> {
        let ops: Vec<&Op> = plan.step_ops().map(|(_, o)| o).collect();
        let touched = |o: &Op| touched_bytes(plan, o);
        let join = |a: &mut [Option<usize>; 3], b: &[Option<usize>; 3]| {
            for i in 0..3 {
                a[i] = a[i].max(b[i]);
            }
        };
        // Per stream: the latest global index of each stream it is ordered after.
        let mut clock = [[None::<usize>; 3]; 3];
        // Per position: the clock of its latest record.
        let mut event: Vec<Option<[Option<usize>; 3]>> = vec![None; ops.len()];
        // Issued ops: (position, stream, clock before it).
        let mut issued: Vec<(usize, usize, [Option<usize>; 3])> = Vec::new();
        for (range, wait) in segments {
            let synced: &[usize] = match wait {
                HostWait::Nothing => &[],
                HostWait::ComputeAndCopyIn => &[0, 1],
                HostWait::All => &[0, 1, 2],
            };
            let mut host = [None::<usize>; 3];
            for &l in synced {
                let c = clock[l];
                join(&mut host, &c);
            }
            for c in &mut clock {
                join(c, &host);
            }
            for p in range.clone() {
                if ops[p].on_host() {
                    continue;
                }
                let s = lane(stream_of(ops[p]));
                let cross = if order.carried {
                    &order.cross_waits[p][..]
                } else {
                    &[]
                };
                for &q in cross.iter().chain(&order.waits[p]) {
                    if let Some(ev) = event[q] {
                        join(&mut clock[s], &ev);
                    }
                }
                let g = issued.len();
                issued.push((p, s, clock[s]));
                clock[s][s] = Some(g);
                if order.record_after[p] {
                    event[p] = Some(clock[s]);
                }
            }
        }
        let touches: Vec<Vec<Touch>> = ops.iter().map(|o| touched(o)).collect();
        for (y, &(py, sy, known)) in issued.iter().enumerate() {
            for (x, &(px, sx, _)) in issued.iter().enumerate().take(y) {
                if sx == sy {
                    continue;
                }
                let conflict = touches[py].iter().any(|&((ka, sa, ea), wa)| {
                    touches[px]
                        .iter()
                        .any(|&((kb, sb, eb), wb)| ka == kb && sa < eb && sb < ea && (wa || wb))
                });
                if conflict && known[sx].is_none_or(|k| k < x) {
                    return Some((x, y));
                }
            }
        }
        None
    }

    /// examples/tiny-tiers.asteria under the largest budget whose plan carries its copies out
    /// to at least `forward[3]` and copies no parameter in.
    fn carried_plan() -> Plan {
        plan_below(6 << 20, |p| {
            p.memory.carried_copy_outs.is_some_and(|k| k >= 3)
                && !p.forward.iter().any(|o| matches!(o, Op::CopyIn { .. }))
        })
    }

    #[test]
    fn carried_copies_out_are_ordered_before_the_next_steps_ops_that_touch_their_bytes() {
        use HostWait::*;
        let plan = carried_plan();
        let k = plan.memory.carried_copy_outs.expect("carried");
        let order = CopyOrder::new(&plan);
        assert!(order.carried);
        let n = plan.step_len();
        let (f, b) = (plan.forward.len(), plan.backward.len());
        let clip = plan
            .optimizer
            .iter()
            .position(|o| matches!(o, Op::ClipGradNorm { .. }))
            .map(|i| f + b + i)
            .expect("the spec clips");
        let step = |w| (0..n, w);
        let cases: Vec<(&str, Vec<Segment>)> = vec![
            (
                "three steps",
                vec![step(All), step(ComputeAndCopyIn), step(ComputeAndCopyIn)],
            ),
            (
                "an evaluation between two steps",
                vec![step(All), (0..f, ComputeAndCopyIn), step(Nothing)],
            ),
            (
                "a step skipped at the clip (its end waits for every stream)",
                vec![
                    step(All),
                    (0..clip + 1, ComputeAndCopyIn),
                    step(All),
                    step(ComputeAndCopyIn),
                ],
            ),
        ];
        for (what, segments) in &cases {
            assert_eq!(replay(&plan, &order, segments), None, "{what}");
        }
        // The carry buys something: the forward's first k + 1 ops wait for no copy out.
        assert!(
            order.cross_waits[..=k].iter().all(Vec::is_empty),
            "forward ops up to {k} wait for copies out: {:?}",
            &order.cross_waits[..=k]
        );
        // The replay can fail: without the cross-step waits some pair is unordered (the
        // next step's copies in of the same moments read what the copies out write) …
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
        assert!(replay(&plan, &broken, &cases[0].1).is_some());
        // … and the plan without the carry is ordered by waiting for every stream.
        let mut plain = plan.clone();
        plain.memory.carried_copy_outs = None;
        let plain_order = CopyOrder::new(&plain);
        assert!(!plain_order.carried);
        assert_eq!(
            replay(&plain, &plain_order, &[step(All), step(All), step(All)]),
            None
        );
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
