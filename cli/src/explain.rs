//! `asteria explain`: what a spec compiles to, without running it (bytes per class, the memory
//! plan, bytes per tier and predicted copies, ops per step, the preconditioner schedule).
use crate::commands::compile_spec;
use crate::PassFlags;
use miette::{miette, Result};
use passes::liveness::{class_name, human_bytes, is_persistent};
use schedule::{BufferClass, TargetPlan};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// `asteria explain`: memory per class and tier, ops per step.
pub fn explain(spec: &Path, overrides: &[String]) -> Result<()> {
    let (plan, liveness) = compile_spec(spec, &PassFlags::default(), overrides)?;
    let stdout = std::io::stdout();
    let mut o = stdout.lock();
    let params: usize = plan
        .params
        .iter()
        .map(|p| plan.buffer(p.param).numel())
        .sum();
    let micro = plan.train.grad_accum.max(1) as usize;
    let tokens = plan.data.batch_size * plan.data.seq_len * micro;
    let tier = match plan.target {
        TargetPlan::Cpu { .. } => "cpu",
        TargetPlan::Cuda { .. } => "gpu",
    };
    let _ = writeln!(
        o,
        "plan `{}`: {} parameters in {} tensors, {} tokens per step{}",
        plan.name,
        params,
        plan.params.len(),
        tokens,
        if micro > 1 {
            format!(
                " ({micro} micro-batches of {} x {}, gradients accumulated)",
                plan.data.batch_size, plan.data.seq_len
            )
        } else {
            String::new()
        }
    );
    let offloaded = plan
        .memory
        .arenas
        .iter()
        .any(|a| !a.kind.on_device() && a.bytes > 0);
    let _ = writeln!(
        o,
        "\nmemory per class{}:",
        if offloaded {
            " (see \"memory per tier\" for what `tier-placement` moved off the device)".to_string()
        } else {
            format!(" (all in the `{tier}` tier: no budget, or everything fits it)")
        }
    );
    // Staging buffers (copies of offloaded state, step-local) are listed on their own line; a
    // host update's persistent device copy (`<param>.device`, `Init::CopyOf`) is a parameter.
    let mut staged: Vec<usize> = plan
        .step_ops()
        .map(|(_, o)| o)
        .filter_map(|o| match o {
            schedule::Op::CopyIn { src, dst, .. }
                if plan.buffers[dst.index()].init != schedule::Init::CopyOf { of: *src } =>
            {
                Some(dst.index())
            }
            _ => None,
        })
        .collect();
    staged.sort_unstable();
    staged.dedup();
    // Host copies of the gradients that leave the device during the backward (copy-out
    // destinations there), also on their own line.
    let spilled: Vec<usize> = plan
        .backward
        .iter()
        .filter_map(|o| match o {
            schedule::Op::CopyOut { dst, .. } => Some(dst.index()),
            _ => None,
        })
        .collect();
    let staged_bytes_of = |class: BufferClass| -> usize {
        staged
            .iter()
            .chain(&spilled)
            .map(|&i| &plan.buffers[i])
            .filter(|b| b.class == class)
            .map(|b| b.size_bytes())
            .sum()
    };
    let mut total = 0;
    for class in [
        BufferClass::Parameter,
        BufferClass::Gradient,
        BufferClass::ExpAvg,
        BufferClass::ExpAvgSq,
        BufferClass::KroneckerFactor,
        BufferClass::Eigenbasis,
        BufferClass::EigenvalueEstimate,
        BufferClass::InverseRoot,
        BufferClass::Activation,
        BufferClass::Input,
        BufferClass::Scalar,
    ] {
        let b = plan.bytes_of(class) - staged_bytes_of(class);
        if b == 0 {
            continue;
        }
        total += b;
        let life = if is_persistent(class) {
            "persistent"
        } else if class == BufferClass::Gradient && micro > 1 {
            "per step (the totals live across its micro-batches)"
        } else {
            "per step"
        };
        let _ = writeln!(
            o,
            "  {:<17} {:>14} B  {:>11}  {life}",
            class_name(class),
            b,
            human_bytes(b)
        );
    }
    let staging: usize = staged.iter().map(|&i| plan.buffers[i].size_bytes()).sum();
    if staging > 0 {
        total += staging;
        let _ = writeln!(
            o,
            "  {:<17} {:>14} B  {:>11}  per step (device copies of offloaded state)",
            "staging",
            staging,
            human_bytes(staging)
        );
    }
    let spill: usize = spilled.iter().map(|&i| plan.buffers[i].size_bytes()).sum();
    if spill > 0 {
        total += spill;
        let _ = writeln!(
            o,
            "  {:<17} {:>14} B  {:>11}  per step (gradients streamed to pinned host memory in the backward)",
            "gradient (host)",
            spill,
            human_bytes(spill)
        );
    }
    let _ = writeln!(
        o,
        "  {:<17} {:>14} B  {:>11}",
        "total",
        total,
        human_bytes(total)
    );
    let _ = writeln!(
        o,
        "  peak live step-local tensors (with buffer reuse; the liveness pass, before tier placement): {}",
        human_bytes(liveness.peak_step_bytes)
    );
    let m = passes::memory_planning::MemorySummary::of(&plan);
    let _ = writeln!(
        o,
        "\nmemory plan (memory-planning; `--print-after memory-planning` lists the largest buffers):"
    );
    let _ = writeln!(
        o,
        "  arena persistent  {:>11}  {} buffers, one place each",
        human_bytes(m.persistent_bytes),
        m.persistent_buffers
    );
    let _ = writeln!(
        o,
        "  arena activations {:>11}  {} step-local buffers sharing bytes by liveness (peak live {})",
        human_bytes(m.activations_bytes),
        m.transient_buffers,
        human_bytes(m.peak_live_bytes)
    );
    let _ = writeln!(
        o,
        "  planned {:>11}  against {} with one place per buffer ({} saved)",
        human_bytes(m.planned_bytes()),
        human_bytes(m.unshared_bytes),
        human_bytes(m.saved_bytes())
    );
    let (tier_bytes, note) = match plan.target {
        TargetPlan::Cuda { .. } => (
            m.planned_bytes(),
            "the memory plan's arenas; engine scratch and bf16 shadows come on top",
        ),
        TargetPlan::Cpu { .. } => (
            total
                - (0..plan.buffers.len())
                    .map(|i| schedule::BufferId(i as u32))
                    .filter(|&id| plan.memory.tier(id).is_some_and(|k| !k.on_device()))
                    .map(|id| plan.buffer(id).size_bytes())
                    .sum::<usize>(),
            "the CPU engine keeps one allocation per buffer; the CUDA engine uses the memory plan",
        ),
    };
    let _ = writeln!(
        o,
        "\nmemory per tier:\n  {tier:<6} {:>11}  ({note})",
        human_bytes(tier_bytes)
    );
    let offloaded = plan.memory.arena_bytes(schedule::ArenaKind::Host) > 0
        || plan.memory.arena_bytes(schedule::ArenaKind::Nvme) > 0
        || plan.memory.pinned_refresh_shadows;
    let desc = if offloaded {
        let config = frontend::load_spec_with(spec, overrides)
            .map_err(miette::Report::new)?
            .config;
        Some(
            passes::precond_scheduling::target_description(&config.target)
                .map_err(|e| miette!("{e}"))?,
        )
    } else {
        None
    };
    let mut total_ms = 0.0;
    for kind in [schedule::ArenaKind::Host, schedule::ArenaKind::Nvme] {
        let bytes = plan.memory.arena_bytes(kind);
        let Some(desc) = desc.as_ref().filter(|_| bytes > 0) else {
            continue;
        };
        let ids: Vec<schedule::BufferId> = (0..plan.buffers.len())
            .map(|i| schedule::BufferId(i as u32))
            .filter(|&id| plan.memory.tier(id) == Some(kind))
            .collect();
        let moved: usize = ids.iter().map(|&id| plan.buffer(id).size_bytes()).sum();
        // A host update's moments never cross the link (its parameter comes in once, its
        // gradient goes out once).
        let stay: usize = plan
            .optimizer
            .iter()
            .filter(|op| op.on_host())
            .flat_map(|op| op.operands())
            .filter(|&(f, _)| f == "exp_avg" || f == "exp_avg_sq")
            .map(|(_, id)| plan.buffer(id).size_bytes())
            .sum();
        let ms = passes::tier_placement::tier_copy_ms(desc, kind, moved.saturating_sub(stay));
        total_ms += ms;
        // NVMe tensors take whole 1 MiB blocks: the arena exceeds their sum.
        let blocks = if kind == schedule::ArenaKind::Nvme && moved != bytes {
            format!(" of {} in whole 1 MiB blocks", human_bytes(moved))
        } else {
            String::new()
        };
        let _ = writeln!(
            o,
            "  {:<6} {:>11}  ({} tensors{blocks} offloaded by tier-placement; predicted copies \
             {ms:.2} ms per step on `{}`)",
            kind.name(),
            human_bytes(bytes),
            ids.len(),
            desc.name
        );
    }
    let host_updates = plan.optimizer.iter().filter(|op| op.on_host()).count();
    if host_updates > 0 {
        let _ = writeln!(
            o,
            "  updates on the host: {host_updates} adam_w (`host_updates = {}`; their parameters, \
             gradients and moments in the host tier)",
            plan.memory.budgets.host_updates
        );
    }
    if let Some(desc) = desc.as_ref().filter(|_| plan.memory.pinned_refresh_shadows) {
        let pinned = schedule::reserve::refresh_pinned_bytes(&plan);
        let ms =
            desc.host_tier_ms(schedule::reserve::pinned_shadow_copy_bytes_per_step(&plan) as usize);
        total_ms += ms;
        let _ = writeln!(
            o,
            "  pinned {:>11}  (refresh shadows, moved by tier-placement; predicted copies \
             {ms:.2} ms per step)",
            human_bytes(pinned)
        );
    }
    if offloaded {
        let _ = writeln!(
            o,
            "  copies {total_ms:.2} ms per step predicted in all (`--print-after tier-placement`)"
        );
        // Optimizer state brought in while the GPU runs the backward (`copy-hoisting`), as
        // opposed to the backward's own copies of parameters (`.staged.backward`).
        let hoisted: usize = plan
            .backward
            .iter()
            .filter_map(|op| match op {
                schedule::Op::CopyIn { src, dst, .. }
                    if plan.buffers[src.index()].class != BufferClass::Parameter =>
                {
                    Some(plan.buffers[dst.index()].size_bytes())
                }
                _ => None,
            })
            .sum();
        if hoisted > 0 {
            let ms = desc.as_ref().map_or(f64::NAN, |d| d.host_tier_ms(hoisted));
            let _ = writeln!(
                o,
                "         of which {} of optimizer state ({ms:.2} ms host→device) come in during \
                 the backward (`--print-after copy-hoisting`)",
                human_bytes(hoisted)
            );
        }
        // Copies out that may finish during the next step's forward (`copy-out-overlap`).
        let residency = plan.residency();
        let carried: usize = plan
            .optimizer_copy_out_sources(&residency)
            .iter()
            .zip(&plan.buffers)
            .filter(|(s, _)| **s)
            .map(|(_, b)| b.size_bytes())
            .sum();
        match plan.memory.carried_copy_outs {
            Some(k) => {
                let ms = desc.as_ref().map_or(f64::NAN, |d| d.host_tier_ms(carried));
                let _ = writeln!(
                    o,
                    "         copies out of {} ({ms:.2} ms device→host) may run on into the next \
                     step's forward, up to op {k} of {} (`--print-after copy-out-overlap`)",
                    human_bytes(carried),
                    plan.forward.len()
                );
                if let Some((p, q)) = passes::copy_out_overlap::first_forward_wait(&plan) {
                    let _ = writeln!(
                        o,
                        "         (forward op {p}, `{}`, waits for the copies out up to \
                         optimizer op {q})",
                        plan.forward[p].name()
                    );
                }
            }
            None if carried > 0 => {
                let why = plan
                    .copy_out_carry_blocker()
                    .unwrap_or("the forward's first op needs their bytes");
                let _ = writeln!(
                    o,
                    "         copies out of {} end with their step ({why})",
                    human_bytes(carried)
                );
            }
            None => {}
        }
    }
    if let Some(budget) = plan.memory.budgets.device {
        let arenas = plan.memory.device_bytes();
        let own = schedule::reserve::engine_reserve(&plan, arenas).total();
        let _ = writeln!(
            o,
            "  device budget {} (needed: {}, the planned device arenas {} and the engine's own {})",
            human_bytes(budget as usize),
            human_bytes(arenas + own),
            human_bytes(arenas),
            human_bytes(own)
        );
    }
    // The smallest device budget this spec fits: the plan before placement, everything
    // movable offloaded.
    if let schedule::TargetPlan::Cuda { .. } = plan.target {
        let config = frontend::load_spec_with(spec, overrides)
            .map_err(miette::Report::new)?
            .config;
        let budgets = config.target.budgets().clone();
        let desc = passes::precond_scheduling::target_description(&config.target)
            .map_err(|e| miette!("{e}"))?;
        let arenas = plan.memory.device_bytes();
        let need = arenas + schedule::reserve::engine_reserve(&plan, arenas).total();
        if let Some(memory) = desc.device_memory_bytes.filter(|&m| need as u64 > m) {
            let _ = writeln!(
                o,
                "  warning: the plan needs {} on the device, more than `{}`'s {} of device \
                 memory: it will not fit; set `gpu_memory` (the floor below) with `host_memory` \
                 or `nvme`",
                human_bytes(need),
                desc.name,
                human_bytes(memory as usize)
            );
        }
        // As compiled under some device budget (`weight_casts = auto` casts weights again in
        // the backward then, for memory).
        let mut config = config;
        if let ir::config::TargetConfig::Cuda { budgets: b, .. } = &mut config.target {
            b.device.get_or_insert(u64::MAX);
        }
        let mut module = ir::Module::new(config);
        let mut pm =
            passes::PassManager::new(passes::PassOptions::default()).map_err(|e| miette!("{e}"))?;
        let (cx, _) = pm
            .run(
                &mut module,
                Some("accumulate-gradients"),
                &mut std::io::sink(),
            )
            .map_err(|e| miette!("{e}"))?;
        if let Some(before) = cx.plan {
            match passes::tier_placement::device_floor(&before, &budgets, &desc) {
                Ok(floor) => {
                    // Whole MiB, rounded up: a value to pass as `gpu_memory` as printed.
                    let mib = floor.div_ceil(1 << 20);
                    let _ = writeln!(
                        o,
                        "  floor  {:>11}  ({}: on the device with everything tier-placement may \
                         move offloaded, the engine's own included: any `gpu_memory` from \
                         {mib}MiB up fits; a little below may too, keeping small tensors whose \
                         staging costs more than they free; `rematerialize` lowers the \
                         activations)",
                        format!("{mib}MiB"),
                        human_bytes(floor)
                    );
                }
                Err(e) => {
                    let _ = writeln!(o, "  floor  not reachable with these budgets: {e}");
                }
            }
        }
    }
    let _ = writeln!(o, "\nops per step:");
    for (section, prog) in [
        ("forward", &plan.forward),
        ("backward", &plan.backward),
        ("optimizer", &plan.optimizer),
    ] {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for op in prog {
            *counts.entry(op.name()).or_default() += 1;
        }
        let list: Vec<String> = counts.iter().map(|(k, v)| format!("{k}×{v}")).collect();
        // The forward and backward run once per micro-batch (`grad_accum`).
        let per = if micro > 1 && section != "optimizer" {
            format!("  (per micro-batch: ×{micro} per step)")
        } else {
            String::new()
        };
        let _ = writeln!(
            o,
            "  {section:<9} {:>4}  {}{per}",
            prog.len(),
            list.join(", ")
        );
    }
    let mut freq: BTreeMap<u64, usize> = BTreeMap::new();
    for t in &plan.host_tasks {
        let schedule::HostTask::EigenbasisRefresh { frequency, .. } = t;
        *freq.entry(*frequency).or_default() += 1;
    }
    for (f, n) in freq {
        let _ = writeln!(o, "  host      {n:>4}  eigenbasis_refresh every {f} steps");
    }
    Ok(())
}
