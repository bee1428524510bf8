//! `tier-placement`'s error when no placement meets the device budget: the budget, the need,
//! what stays after every movable tensor left, and the largest consumers.
use crate::liveness::human_bytes;
use crate::memory_planning::plan_memory;
use crate::PassError;
use schedule::reserve::engine_reserve;
use schedule::{Budgets, BufferClass, BufferId, Plan};

/// The error when the device budget cannot be met: budget, need (everything on the device,
/// and what stays there with every movable tensor offloaded, staging buffers included), the
/// largest consumers.
pub(super) fn over_budget(
    plan: &Plan,
    budgets: &Budgets,
    (need, left): (usize, usize),
    moved: &[BufferId],
) -> PassError {
    let mut sizes: Vec<(usize, String)> = plan
        .buffers
        .iter()
        .enumerate()
        .filter(|(i, _)| !moved.contains(&BufferId(*i as u32)))
        .map(|(_, b)| {
            (
                b.size_bytes(),
                format!("%{} {}", b.name, human_bytes(b.size_bytes())),
            )
        })
        .collect();
    sizes.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut largest: Vec<String> = sizes.into_iter().take(5).map(|(_, s)| s).collect();
    let reserve = engine_reserve(plan, plan_memory(plan).device_bytes());
    if reserve.total() > 0 {
        largest.push(format!(
            "the engine's own {} ({})",
            human_bytes(reserve.total()),
            reserve.describe()
        ));
    }
    let moved_bytes: usize = moved.iter().map(|&c| plan.buffer(c).size_bytes()).sum();
    let grads_moved = moved
        .iter()
        .any(|&c| plan.buffer(c).class == BufferClass::Gradient);
    let refresh_moved = moved.iter().any(|&c| {
        matches!(
            plan.buffer(c).class,
            BufferClass::KroneckerFactor | BufferClass::Eigenbasis
        )
    });
    let params_moved = moved
        .iter()
        .any(|&c| plan.buffer(c).class == BufferClass::Parameter);
    let mut groups = vec!["the optimizer moments"];
    if grads_moved {
        groups.push("the gradients");
    }
    if refresh_moved {
        groups.push("the Kronecker factors and eigenbases");
    }
    if params_moved {
        groups.push("the parameters");
    }
    let what = match groups.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => groups.join(""),
    };
    let accumulating = if plan.train.grad_accum > 1 {
        format!(
            " (gradients and parameters stay on the device under grad_accum = {}: the \
             gradients' totals live across the micro-batches, and every micro-batch reads the \
             parameters)",
            plan.train.grad_accum
        )
    } else {
        String::new()
    };
    let remat = if plan.train.rematerialize == schedule::Rematerialize::Layers {
        String::new()
    } else {
        format!(
            " (or set `rematerialize = layers` in the train block, now `{}`: it recomputes \
             each layer's activations in the backward)",
            plan.train.rematerialize
        )
    };
    let after_shadows = if plan.memory.pinned_refresh_shadows {
        ", after the refresh shadows"
    } else {
        ""
    };
    PassError::Invalid {
        pass: "tier-placement",
        message: format!(
            "the device budget {} cannot be met: the plan needs {} on the device, and \
             offloading every movable tensor ({what}: {}{after_shadows}) still leaves {} \
             there{accumulating}, the staging buffers that bring them back for their updates \
             included; the largest \
             device consumers: {}; raise the budget, or lower batch_size or seq_len{remat}",
            budgets
                .device
                .map_or("(none)".to_string(), |b| human_bytes(b as usize)),
            human_bytes(need),
            human_bytes(moved_bytes),
            human_bytes(left),
            largest.join(", ")
        ),
    }
}
