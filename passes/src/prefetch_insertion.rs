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
//! The staging buffers are step-local (the first op touching each is its copy): the
//! `memory-planning` pass gives them bytes of the activations arena only from their copy in to
//! their copy out — the pinned staging pool, sized by liveness. [`schedule::Plan::verify`]
//! checks that no op touches an offloaded buffer, none touches a staging buffer before its copy
//! in, and every written staging buffer is copied back.
use crate::{Pass, PassContext, PassError};
use ir::Module;
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
        let mut s = String::from("; optimizer program after prefetch-insertion\n");
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

/// Adds the staging buffers and copies for every offloaded buffer of `plan` (see the module
/// docs). Returns the numbers of copy-ins and copy-outs. Errors when an offloaded buffer is
/// used outside the optimizer program (not a placement this version makes).
pub fn insert_prefetches(plan: &mut Plan) -> Result<(usize, usize), PassError> {
    let offloaded: Vec<BufferId> = (0..plan.buffers.len())
        .map(|i| BufferId(i as u32))
        .filter(|&id| {
            plan.memory
                .tier(id)
                .is_some_and(|t| matches!(t, ArenaKind::Host | ArenaKind::Nvme))
        })
        .collect();
    if offloaded.is_empty() {
        return Ok((0, 0));
    }
    for op in plan.forward.iter().chain(&plan.backward) {
        if let Some((_, id)) = op
            .operands()
            .into_iter()
            .find(|(_, id)| offloaded.contains(id))
        {
            return Err(PassError::Invalid {
                pass: "prefetch-insertion",
                message: format!(
                    "`{}` is offloaded but `{}` in the forward or backward program uses it; \
                     only optimizer state is offloaded",
                    plan.buffer(id).name,
                    op.name()
                ),
            });
        }
    }
    // Staging buffers.
    let mut staged: HashMap<BufferId, BufferId> = HashMap::new();
    for &id in &offloaded {
        let b = plan.buffer(id).clone();
        let s = BufferId(plan.buffers.len() as u32);
        plan.buffers.push(Buffer {
            name: format!("{}.staged", b.name),
            init: Init::Zeros,
            ..b
        });
        plan.memory.slots.push(BufferSlot {
            arena: ArenaKind::Persistent,
            offset: 0,
        });
        staged.insert(id, s);
    }
    // First and last use, and whether written, per offloaded buffer.
    let mut first: HashMap<BufferId, usize> = HashMap::new();
    let mut last_write: HashMap<BufferId, usize> = HashMap::new();
    for (i, op) in plan.optimizer.iter().enumerate() {
        for (_, id, access) in op.accesses() {
            if staged.contains_key(&id) {
                first.entry(id).or_insert(i);
                if access.writes() {
                    last_write.insert(id, i);
                }
            }
        }
    }
    // The ops that first use offloaded state, in order: the copy in for the j-th is issued
    // before the (j - PREFETCH_DEPTH)-th (at the start of the program for the first ones), so
    // that while one tensor is updated the next comes in and the previous goes out.
    let mut users: Vec<usize> = first.values().copied().collect();
    users.sort_unstable();
    users.dedup();
    let mut issue_at: HashMap<usize, Vec<BufferId>> = HashMap::new();
    for (&id, &f) in &first {
        let j = users.partition_point(|&u| u < f);
        let at = if j >= PREFETCH_DEPTH {
            users[j - PREFETCH_DEPTH]
        } else {
            0
        };
        issue_at.entry(at).or_default().push(id);
    }
    let mut out_after: HashMap<usize, Vec<BufferId>> = HashMap::new();
    for (&id, &l) in &last_write {
        out_after.entry(l).or_default().push(id);
    }
    let old = std::mem::take(&mut plan.optimizer);
    let (mut ins, mut outs) = (0, 0);
    for (i, op) in old.into_iter().enumerate() {
        if let Some(list) = issue_at.get_mut(&i) {
            list.sort();
            for &id in list.iter() {
                plan.optimizer.push(Op::CopyIn {
                    src: id,
                    dst: staged[&id],
                });
                ins += 1;
            }
        }
        plan.optimizer.push(replace_operands(&op, &staged)?);
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

/// `op` with every operand found in `map` replaced by its image (through the op's JSON form:
/// the fields named by [`Op::operands`] hold plain integers, or lists of them).
fn replace_operands(op: &Op, map: &HashMap<BufferId, BufferId>) -> Result<Op, PassError> {
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
