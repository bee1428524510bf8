//! `tier-placement`: under the spec's memory budgets (`target { gpu_memory = 24GiB
//! host_memory = 96GiB nvme = "DIR" nvme_memory = 200GiB }`, [`schedule::Budgets`]), chooses
//! for each persistent tensor whether it lives on the device, in host memory or on the NVMe
//! drive, and records the choice in the plan's memory plan (a buffer's tier is its arena:
//! `host` or `nvme` for offloaded state). `prefetch-insertion` then adds the copies that bring
//! offloaded state back around its uses, and `memory-planning` sizes the arenas and checks the
//! device budget.
//!
//! # What moves, and where
//! Without a budget nothing moves. Otherwise the pass computes the device bytes the plan needs
//! (persistent arena plus planned activations, plus what the target's engine allocates beside
//! them: [`schedule::reserve::engine_reserve`], e.g. the CUDA engine's saved attention copies
//! and refresh buffers), and while that exceeds the device budget it
//! offloads optimizer state, cheapest first by the cost model:
//! - **Refresh shadows first.** The shadows of asynchronous GPU-side refreshes (each refresh
//!   in flight holds a snapshot of its factor and the result basis waiting for its install,
//!   `2·d²` f32: at LLaMA 1.44B with staleness 5, 62 of them, 2.0 GiB) go to pinned host
//!   memory ([`schedule::MemoryPlan::pinned_refresh_shadows`]) before any moment: they cost
//!   one factor copied out per launch and one basis copied in per install (`(2d² + d)·4`
//!   bytes per refresh, i.e. per `precondition_frequency` steps), where a moment costs its
//!   bytes each way every step.
//! - **Candidates** are the moments (`exp_avg`, `exp_avg_sq`, of AdamW and of SOAP's rotated
//!   Adam), which only the optimizer program touches, once per step: one copy in and one copy
//!   out per step (a SOAP refresh swap also re-projects them, every `precondition_frequency`
//!   steps, where they live). Then, when every moment is not enough, the **gradients** that
//!   the backward writes and only the optimizer program reads (ZeRO-Offload's streaming:
//!   `prefetch-insertion` copies each out right after its last backward write, so the copy
//!   overlaps the rest of the backward, and back in before its update; the global-norm clip
//!   then reads per-gradient partial sums, [`schedule::Op::GradSumSquares`]), to pinned host
//!   memory only (never NVMe: they move every step). Then, last, the **Kronecker factors
//!   and eigenbases** of SOAP refreshes (the host tier only): the optimizer program stages
//!   each once a step (a factor copied in and out around its accumulation, a basis copied in
//!   only: the step reads it), and the refreshes read and write them where they live, between
//!   steps (the CPU engine pages them in; the CUDA engine copies them into `[d, d]` device
//!   copies of its refreshers and swap, which the device need counts from the first one
//!   moved: `schedule::reserve::RefreshStaging`). A refresh's own copies (a factor and a basis
//!   in at a GPU-placed refresh, the old basis in and the new one out at its swap, once per
//!   `precondition_frequency` steps) are priced amortised per step
//!   ([`refresh_copies_per_step`]). Factors are candidates before bases (the take-back of unneeded tensors, smallest first, may still
//!   keep a basis and return a factor). Last of all the **parameters** (pinned host memory
//!   only, and not under `grad_accum > 1`): `prefetch-insertion` copies one in before its
//!   first use in every program that reads it (the forward, the backward where it reads it,
//!   the optimizer) and back after its update, so it costs a copy in per such program.
//! - **Cost** per candidate: its per-step copy time over the tier's link (pinned host memory:
//!   the host↔GPU bandwidth of the target description, each way, the copies in and out
//!   running at once on a GPU's two copy engines; NVMe: the drive's read plus write
//!   bandwidth). Candidates go largest first (fewest copies per byte freed), then any that
//!   were not needed are taken back, smallest first.
//! - **Tier**: the host tier while `host_memory` allows, then the NVMe tier if the spec names
//!   one. On a unified-memory target (GH200, GB10: `unified_memory` in the description) host
//!   memory *is* device memory, so the host tier frees nothing there and the pass goes to NVMe
//!   directly.
//!
//! When every candidate is offloaded and the device still does not fit, the pass fails with the
//! budget, the need and the largest device consumers. `--print-after tier-placement` prints
//! every decision with its predicted copy time; `asteria explain` shows bytes per tier.
use crate::cost_model::TargetDescription;
use crate::liveness::human_bytes;
use crate::memory_planning::plan_memory;
use crate::prefetch_insertion::insert_prefetches;
use crate::{Pass, PassContext, PassError};
use ir::Module;
use schedule::memory::align_up;
use schedule::reserve::{engine_reserve, EngineReserve};
use schedule::{ArenaKind, ArenaPlan, Budgets, BufferClass, BufferId, BufferSlot, Op, Plan};
use std::fmt::Write;

mod over_budget;
use over_budget::over_budget;

/// Alignment of NVMe-tier offsets: one checksummed block of the engine's NVMe store (1 MiB).
pub const NVME_ALIGN: usize = 1 << 20;

/// One offloaded tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The buffer.
    pub buffer: BufferId,
    /// Its name.
    pub name: String,
    /// Its bytes.
    pub bytes: usize,
    /// Where it goes (`Host` or `Nvme`).
    pub tier: ArenaKind,
    /// Predicted copy time per step (in and out), ms.
    pub copy_ms: f64,
    /// What it is (its group: a moment, gradient, Kronecker factor, eigenbasis, parameter),
    /// with `host update` when it is the state of an update that runs on the host.
    pub what: String,
}

/// What the pass decided.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Placement {
    /// The target description the costs come from.
    pub target: String,
    /// The budgets.
    pub budgets: Budgets,
    /// Device bytes the plan needs with everything on the device: its device arenas plus
    /// [`Placement::reserve`].
    pub device_need: usize,
    /// What the target's engine allocates beyond the plan's arenas (as placed).
    pub reserve: EngineReserve,
    /// The offloaded tensors, in buffer order.
    pub decisions: Vec<Decision>,
    /// Why the host tier was not used, if it was not.
    pub host_note: Option<String>,
    /// The refresh shadows moved to pinned host memory, if they were.
    pub shadows: Option<ShadowDecision>,
    /// Under `host_updates = sync | delayed`: the parameters whose AdamW update runs on the
    /// host, with their state's bytes there (parameter, gradient, moments).
    pub host_updates: Vec<(String, usize)>,
    /// The predicted host time of those updates per step, ms (`None` without host updates or
    /// when the target description has no `host_update_gbps`), and the predicted compute time
    /// of a step's forward and backward they run beside under `delayed`, ms.
    pub host_update_ms: Option<(f64, f64)>,
    /// The target description's device memory, bytes (`None`: not described).
    pub device_memory: Option<u64>,
    /// Pinned host bytes of the CUDA engine's NVMe bounce slots
    /// ([`schedule::reserve::nvme_bounce_bytes`]; 0 without NVMe state), within `host_memory`.
    pub nvme_bounce: usize,
}

/// The refresh shadows' move to pinned host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct ShadowDecision {
    /// Device bytes freed: the shadows of the GPU-side refreshes, less the side stream's
    /// staging set that pinned shadows need.
    pub device_bytes: usize,
    /// Pinned host bytes they take there.
    pub pinned_bytes: usize,
    /// Predicted copy time per step on the compute stream (factor out at each launch, basis
    /// in at each install), ms.
    pub copy_ms: f64,
}

impl Placement {
    /// A warning when the plan cannot fit the device the target describes: with no
    /// `gpu_memory` budget, a device need above the device's memory (nothing is placed without
    /// a budget, so the run would fail at allocation); with one, a budget above that memory.
    pub fn device_memory_warning(&self) -> Option<String> {
        let memory = self.device_memory?;
        match self.budgets.device {
            None if self.device_need as u64 > memory => Some(format!(
                "the plan needs {} on the device, more than `{}`'s {} of device memory: it \
                 will not fit; set `gpu_memory` in the target block (with `host_memory`, or \
                 `nvme` and `nvme_memory`) to place state off the device",
                human_bytes(self.device_need),
                self.target,
                human_bytes(memory as usize)
            )),
            Some(b) if b > memory => Some(format!(
                "`gpu_memory` {} is more than `{}`'s {} of device memory",
                human_bytes(b as usize),
                self.target,
                human_bytes(memory as usize)
            )),
            _ => None,
        }
    }

    /// Bytes placed in `tier`.
    pub fn bytes_in(&self, tier: ArenaKind) -> usize {
        self.decisions
            .iter()
            .filter(|d| d.tier == tier)
            .map(|d| d.bytes)
            .sum()
    }
    /// Predicted copy time per step of every offloaded tensor, ms: the copies in and out run
    /// at once on a GPU (each decision's `copy_ms` is its slower direction there), and they
    /// are not counted as hidden under the optimizer's compute, which is itself bound by
    /// memory bandwidth.
    pub fn copy_ms(&self) -> f64 {
        // (`+ 0.0`: the empty sum is -0.0.)
        self.decisions.iter().map(|d| d.copy_ms).sum::<f64>()
            + self.shadows.as_ref().map_or(0.0, |s| s.copy_ms)
            + 0.0
    }
}

/// The `tier-placement` pass.
#[derive(Default)]
pub struct TierPlacement {
    placement: Placement,
}

impl TierPlacement {
    /// What the last run decided.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }
}

impl Pass for TierPlacement {
    fn name(&self) -> &'static str {
        "tier-placement"
    }

    fn run(&mut self, module: &mut Module, cx: &mut PassContext) -> Result<String, PassError> {
        let budgets = module.config.target.budgets().clone();
        let plan = cx.plan.as_mut().ok_or_else(|| PassError::Invalid {
            pass: "tier-placement",
            message: "no plan to place: run `lower` first".into(),
        })?;
        let desc = crate::precond_scheduling::target_description(&module.config.target)?;
        self.placement = place(plan, &budgets, &desc)?;
        if let Some(w) = self.placement.device_memory_warning() {
            tracing::warn!("tier-placement: {w}");
        }
        if budgets.is_empty() {
            return Ok("no budget: every buffer on the device".into());
        }
        let p = &self.placement;
        Ok(format!(
            "on `{}`: device needs {} of {}; {}{} tensor(s) offloaded, {} to host, {} to nvme; \
             predicted copies {:.2} ms per step",
            p.target,
            human_bytes(p.device_need),
            budgets
                .device
                .map_or("no limit".to_string(), |b| human_bytes(b as usize)),
            p.shadows.as_ref().map_or(String::new(), |s| format!(
                "refresh shadows pinned ({} freed), ",
                human_bytes(s.device_bytes)
            )),
            p.decisions.len(),
            human_bytes(p.bytes_in(ArenaKind::Host)),
            human_bytes(p.bytes_in(ArenaKind::Nvme)),
            p.copy_ms()
        ))
    }

    fn dump_after(&self, _module: &Module, _cx: &PassContext) -> String {
        report(&self.placement)
    }
}

/// The `--print-after tier-placement` report: budgets, need, and every decision.
pub fn report(p: &Placement) -> String {
    let mut s = String::from("; tier placement\n");
    let b = |x: Option<u64>| x.map_or("no limit".to_string(), |v| human_bytes(v as usize));
    let _ = writeln!(
        s,
        "; target `{}`: gpu/device budget {}, host {}, nvme {} ({})",
        p.target,
        b(p.budgets.device),
        b(p.budgets.host),
        b(p.budgets.nvme),
        p.budgets.nvme_dir.as_deref().unwrap_or("no directory")
    );
    let _ = writeln!(
        s,
        "; device need with every tensor on the device: {} (the engine's own: {})",
        human_bytes(p.device_need),
        p.reserve.describe()
    );
    if let Some(w) = p.device_memory_warning() {
        let _ = writeln!(s, "; warning: {w}");
    }
    if let Some(note) = &p.host_note {
        let _ = writeln!(s, "; host tier not used: {note}");
    }
    if let Some(sh) = &p.shadows {
        let _ = writeln!(
            s,
            ";   refresh shadows (factor snapshots, result bases) {:>11} device -> pinned host \
             {}  copies {:>8.3} ms/step",
            human_bytes(sh.device_bytes),
            human_bytes(sh.pinned_bytes),
            sh.copy_ms
        );
    }
    if !p.host_updates.is_empty() {
        let _ = writeln!(
            s,
            "; host_updates = {}: {} AdamW update(s) run on the host, their parameters, \
             gradients and moments in pinned host memory ({}); the forward and backward read \
             `<param>.device` copies",
            p.budgets.host_updates,
            p.host_updates.len(),
            human_bytes(p.host_updates.iter().map(|h| h.1).sum())
        );
        match p.host_update_ms {
            Some((host, step)) => {
                let when = match (p.budgets.host_updates, host <= step) {
                    (schedule::HostUpdates::Delayed, true) => {
                        "delayed: hidden under the next step's forward and backward"
                    }
                    (schedule::HostUpdates::Delayed, false) => {
                        "delayed: longer than the next step's forward and backward, which \
                         waits for the rest"
                    }
                    _ => "sync: on the step, after its backward",
                };
                let _ = writeln!(
                    s,
                    "; predicted host update {host:.2} ms per step ({when}), beside a forward \
                     and backward of {step:.2} ms"
                );
            }
            None => {
                let _ = writeln!(
                    s,
                    "; host update time not predicted: the target description has no \
                     `host_update_gbps` (`asteria calibrate` measures it)"
                );
            }
        }
    }
    if p.budgets.is_empty() {
        let _ = writeln!(s, "; no budget in the target block: nothing to place");
    } else if p.decisions.is_empty() && p.shadows.is_none() {
        let _ = writeln!(s, "; everything fits the device budget: nothing offloaded");
    }
    for d in &p.decisions {
        let _ = writeln!(
            s,
            ";   %{:<36} {:>11}  -> {:<4}  copies {:>8.3} ms/step  ({})",
            d.name,
            human_bytes(d.bytes),
            d.tier.name(),
            d.copy_ms,
            d.what
        );
    }
    if p.nvme_bounce > 0 {
        let _ = writeln!(
            s,
            "; NVMe bounce slots: {} x {} pinned ({}), {}",
            schedule::reserve::NVME_BOUNCE_SLOTS,
            human_bytes(p.nvme_bounce / schedule::reserve::NVME_BOUNCE_SLOTS),
            human_bytes(p.nvme_bounce),
            if p.host_note.is_some() {
                "in the memory the host and the device share"
            } else {
                "within `host_memory`"
            }
        );
    }
    let _ = writeln!(
        s,
        "; host {}, nvme {}; predicted copies {:.2} ms per step (copies in and out overlap each \
         other, not the memory-bound optimizer program)",
        human_bytes(p.bytes_in(ArenaKind::Host)),
        human_bytes(p.bytes_in(ArenaKind::Nvme)),
        p.copy_ms()
    );
    s
}

/// Offloads candidates of `plan` until its device bytes fit `budgets.device`, writing the
/// `host` / `nvme` slots and arenas into `plan.memory`. Errors when the budget cannot be met.
pub fn place(
    plan: &mut Plan,
    budgets: &Budgets,
    desc: &TargetDescription,
) -> Result<Placement, PassError> {
    let mut placement = Placement {
        target: desc.name.clone(),
        budgets: budgets.clone(),
        device_memory: desc.device_memory_bytes,
        ..Default::default()
    };
    let device_need = |p: &Plan| {
        let m = plan_memory(p).device_bytes();
        m + engine_reserve(p, m).total()
    };
    // Decided afresh on every run (a plan placed before starts from the device).
    plan.memory.pinned_refresh_shadows = false;
    placement.device_need = device_need(plan);
    placement.reserve = engine_reserve(plan, plan_memory(plan).device_bytes());
    let cap = budgets.device.map_or(usize::MAX, |b| b as usize);
    let host_ok = !desc.unified_memory;
    // Host updates first: their state leaves the device whatever the budget.
    let forced = crate::host_updates::host_updates(plan, budgets.host_updates, host_ok)?;
    placement.host_updates = forced
        .chunks(4)
        .map(|c| {
            (
                plan.buffer(c[0]).name.clone(),
                c.iter().map(|&b| plan.buffer(b).size_bytes()).sum(),
            )
        })
        .collect();
    if !forced.is_empty() {
        let elements: usize = forced.chunks(4).map(|c| plan.buffer(c[0]).numel()).sum();
        let bytes = elements * crate::cost_model::ADAMW_BYTES_PER_ELEMENT;
        placement.host_update_ms = desc.host_update_gbps.map(|g| {
            (
                bytes as f64 / (g * 1e6),
                plan.model_flops_per_step() / (desc.train_tflops * 1e9),
            )
        });
    }
    let with_forced =
        |chosen: &[BufferId]| -> Vec<BufferId> { forced.iter().chain(chosen).copied().collect() };
    // The device need with `chosen` offloaded (host and NVMe budgets unchecked), copies in.
    let need_of = |plan: &Plan, chosen: &[BufferId]| -> Result<usize, PassError> {
        let mut trial = plan.clone();
        let unlimited = Budgets {
            host: None,
            nvme: None,
            ..budgets.clone()
        };
        assign(
            &mut trial,
            &with_forced(chosen),
            &unlimited,
            desc,
            host_ok,
            &mut Vec::new(),
        )?;
        insert_prefetches(&mut trial)?;
        Ok(device_need(&trial))
    };
    let done = |plan: &mut Plan,
                chosen: &[BufferId],
                placement: &mut Placement|
     -> Result<(), PassError> {
        assign(
            plan,
            &with_forced(chosen),
            budgets,
            desc,
            host_ok,
            &mut placement.decisions,
        )?;
        placement.decisions.sort_by_key(|d| d.buffer);
        placement.reserve = engine_reserve(plan, plan_memory(plan).device_bytes());
        placement.nvme_bounce = schedule::reserve::nvme_bounce_bytes(plan);
        Ok(())
    };
    if need_of(plan, &[])? <= cap {
        if !forced.is_empty() {
            done(plan, &[], &mut placement)?;
        }
        return Ok(placement);
    }
    // Refresh shadows first (see the module docs), when pinning them frees device bytes: the
    // shadows of GPU-side refreshes leave, the side stream's staging set comes.
    if host_ok && schedule::reserve::refresh_shadow_device_bytes(plan) > 0 {
        let mut trial = plan.clone();
        trial.memory.pinned_refresh_shadows = true;
        let freed = engine_reserve(plan, 0)
            .refresh
            .saturating_sub(engine_reserve(&trial, 0).refresh);
        let pinned_bytes = schedule::reserve::refresh_pinned_bytes(&trial);
        if freed > 0 && budgets.host.is_none_or(|h| pinned_bytes as u64 <= h) {
            plan.memory.pinned_refresh_shadows = true;
            placement.shadows = Some(ShadowDecision {
                device_bytes: freed,
                pinned_bytes,
                copy_ms: desc.host_tier_ms(schedule::reserve::pinned_shadow_copy_bytes_per_step(
                    plan,
                ) as usize),
            });
            if need_of(plan, &[])? <= cap {
                if forced.is_empty() {
                    placement.reserve = engine_reserve(plan, plan_memory(plan).device_bytes());
                } else {
                    done(plan, &[], &mut placement)?;
                }
                return Ok(placement);
            }
        }
    }
    if !host_ok {
        placement.host_note = Some(format!(
            "`{}` has unified memory: host memory is the device's, offloading there frees nothing",
            desc.name
        ));
    }
    // Moments first, then gradients (when the host tier is there for them); each group
    // largest first, ties in buffer order.
    let Candidates {
        moments: mut candidates,
        mut grads,
        mut refresh,
        mut params,
    } = candidates(plan);
    let by_size = |v: &mut Vec<BufferId>| {
        v.sort_by(|&a, &b| {
            let (x, y) = (plan.buffer(a).size_bytes(), plan.buffer(b).size_bytes());
            y.cmp(&x).then(a.cmp(&b))
        })
    };
    by_size(&mut candidates);
    by_size(&mut grads);
    by_size(&mut refresh);
    by_size(&mut params);
    // Factors before bases: a factor costs its copies only; a refresh also reads and writes
    // its basis where it lives.
    refresh.sort_by_key(|&c| plan.buffer(c).class == BufferClass::Eigenbasis);
    if host_ok {
        candidates.extend(grads);
        candidates.extend(refresh);
        candidates.extend(params);
    }
    // Greedy on the estimate: freeing a tensor's persistent bytes.
    let mut excess = device_need(plan).saturating_sub(cap);
    let mut chosen: Vec<BufferId> = Vec::new();
    for &c in &candidates {
        if excess == 0 {
            break;
        }
        chosen.push(c);
        excess = excess.saturating_sub(align_up(plan.buffer(c).size_bytes(), 256));
    }
    // Then exact: with the staging copies in place, add more until the device fits; take
    // back the smallest ones that are not needed.
    // The device need does not depend on which offload tier takes a tensor: the search runs
    // without the host and NVMe limits (`need_of`), and the final assignment checks them (so
    // a prefix that overflows `host_memory` before the take-back below is not a failure).
    let trial_need = |chosen: &[BufferId]| need_of(plan, chosen);
    let fits = |chosen: &[BufferId]| -> Result<Option<usize>, PassError> {
        let need = trial_need(chosen)?;
        Ok((need <= cap).then_some(need))
    };
    // Each trial rewrites and plans the whole step (~50 ms at 1.44B), so both searches are
    // binary, on counts: offloading one more candidate never adds device bytes, and returning
    // one more never removes any (up to the staging buffers' sharing of the activations arena,
    // which is why every answer is the result of an exact trial).
    //
    // Along the candidates' prefixes a trial does not fit, then fits, then fails (from the
    // first tensor the host and NVMe budgets cannot hold on): the first prefix that does not
    // "not fit" either fits, or its failure is the error, or none does and the budget cannot
    // be met.
    let not_fit = |k: usize| matches!(fits(&candidates[..k]), Ok(None));
    if not_fit(chosen.len()) {
        let (mut lo, mut hi) = (chosen.len(), candidates.len() + 1);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if not_fit(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        if hi > candidates.len() {
            let left = trial_need(&candidates)?;
            return Err(over_budget(
                plan,
                budgets,
                (placement.device_need, left),
                &candidates,
            ));
        }
        // Fits, or the assignment's own error.
        fits(&candidates[..hi])?;
        chosen = candidates[..hi].to_vec();
    }
    // Take back the smallest ones that are not needed: the most of them, smallest first, whose
    // return still fits (`lo` returned fits, `hi` + 1 does not).
    let mut by_size = chosen.clone();
    by_size.sort_by_key(|&c| (plan.buffer(c).size_bytes(), c));
    let without = |k: usize| -> Vec<BufferId> {
        let back = &by_size[..k];
        chosen
            .iter()
            .copied()
            .filter(|c| !back.contains(c))
            .collect()
    };
    let (mut lo, mut hi) = (0, by_size.len());
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(&without(mid))?.is_some() {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let mut kept = without(lo);
    // Then one at a time, while a tensor is no larger than the room left: returning it adds
    // its bytes to the device, less at most its staging buffer's share of the activations.
    if let Some(mut need) = fits(&kept)? {
        for &c in &by_size[lo..] {
            if align_up(plan.buffer(c).size_bytes(), 256) > cap - need {
                break;
            }
            let trial: Vec<BufferId> = kept.iter().copied().filter(|&x| x != c).collect();
            if let Some(n) = fits(&trial)? {
                kept = trial;
                need = n;
            }
        }
    }
    done(plan, &kept, &mut placement)?;
    Ok(placement)
}

/// The device bytes of `plan` (as `lower` and `accumulate-gradients` leave it, before
/// placement), the engine's own included, with the refresh shadows pinned and every tensor
/// this pass may move offloaded (within `budgets`' host and NVMe limits, the staging buffers
/// that bring them back included): what `asteria explain` reports as the floor. Every device
/// budget from it up can be met (the pass offloads candidates until the device fits, at worst
/// all of them); a little below it may be too, when keeping a small tensor saves more
/// staging bytes than it takes.
///
/// # Errors
/// When the host and NVMe budgets cannot hold every movable tensor (the floor is then not
/// reachable with these budgets), or the prefetch rewrite fails.
pub fn device_floor(
    plan: &Plan,
    budgets: &Budgets,
    desc: &TargetDescription,
) -> Result<usize, PassError> {
    let mut trial = plan.clone();
    let host_ok = !desc.unified_memory;
    trial.memory.pinned_refresh_shadows =
        host_ok && schedule::reserve::refresh_shadow_device_bytes(plan) > 0;
    let forced = crate::host_updates::host_updates(&mut trial, budgets.host_updates, host_ok)?;
    let Candidates {
        moments: mut all,
        grads,
        refresh,
        params,
    } = candidates(&trial);
    all.splice(0..0, forced);
    if host_ok {
        all.extend(grads);
        all.extend(refresh);
        all.extend(params);
    }
    let unlimited = Budgets {
        device: None,
        ..budgets.clone()
    };
    assign(&mut trial, &all, &unlimited, desc, host_ok, &mut Vec::new())?;
    insert_prefetches(&mut trial)?;
    let m = plan_memory(&trial).device_bytes();
    Ok(m + engine_reserve(&trial, m).total())
}

/// The tensors this version may offload: f32 moments touched by the optimizer program (and by
/// refresh swaps) only; second, f32 gradients that the backward writes and only the optimizer
/// program reads (streamed to pinned host memory as they are finished); third, the Kronecker
/// factors and eigenbases of SOAP refreshes, which only the optimizer program (once a step)
/// and the refresh tasks (between steps, where the state lives) touch.
pub(crate) fn candidates(plan: &Plan) -> Candidates {
    let n = plan.buffers.len();
    let mut in_forward = vec![false; n];
    let mut by_backward = vec![false; n];
    for op in &plan.forward {
        for (_, id) in op.operands() {
            if let Some(o) = in_forward.get_mut(id.index()) {
                *o = true;
            }
        }
    }
    for op in &plan.backward {
        for (_, id, a) in op.accesses() {
            if a.writes() {
                if let Some(w) = by_backward.get_mut(id.index()) {
                    *w = true;
                }
            }
        }
    }
    let mut written_outside = vec![false; n];
    for op in plan.forward.iter().chain(&plan.backward) {
        for (_, id, a) in op.accesses() {
            if a.writes() {
                if let Some(w) = written_outside.get_mut(id.index()) {
                    *w = true;
                }
            }
        }
    }
    let mut in_tasks = vec![false; n];
    for t in &plan.host_tasks {
        for (_, id) in t.operands() {
            if let Some(o) = in_tasks.get_mut(id.index()) {
                *o = true;
            }
        }
    }
    let mut outside = vec![false; n];
    for op in plan.forward.iter().chain(&plan.backward) {
        for (_, id) in op.operands() {
            if let Some(o) = outside.get_mut(id.index()) {
                *o = true;
            }
        }
    }
    // A refresh's moments may move (its swap re-projects them where they live), and so may a
    // SOAP refresh's factor and basis (the refresh reads and writes them where they live).
    let mut refresh_state = vec![false; n];
    for t in &plan.host_tasks {
        let schedule::HostTask::EigenbasisRefresh { method, .. } = t;
        for (field, id) in t.operands() {
            let i = id.index();
            match field {
                "exp_avg" | "exp_avg_sq" => continue,
                "factor" | "basis" if *method == schedule::RefreshMethod::Soap => {
                    if let Some(r) = refresh_state.get_mut(i) {
                        *r = true;
                    }
                    continue;
                }
                _ => {}
            }
            if let Some(o) = outside.get_mut(i) {
                *o = true;
            }
        }
    }
    let mut used = vec![false; n];
    for op in &plan.optimizer {
        for (_, id) in op.operands() {
            if let Some(u) = used.get_mut(id.index()) {
                *u = true;
            }
        }
    }
    // Host updates' state (placed already) and the device copies their copies refresh.
    for op in &plan.optimizer {
        if op.on_host() || is_copy(op) {
            for (_, id) in op.operands() {
                if let Some(o) = outside.get_mut(id.index()) {
                    *o = true;
                }
                if let Some(u) = used.get_mut(id.index()) {
                    *u = false;
                }
            }
        }
    }
    let moments = (0..n)
        .filter(|&i| {
            let b = &plan.buffers[i];
            matches!(b.class, BufferClass::ExpAvg | BufferClass::ExpAvgSq)
                && b.dtype == schedule::DType::F32
                && used[i]
                && !outside[i]
        })
        .map(|i| BufferId(i as u32))
        .collect();
    // Accumulated gradients live across the step's micro-batches: none leaves the device.
    let streamable = plan.train.grad_accum <= 1;
    let grads = (0..n)
        .filter(|&i| {
            let b = &plan.buffers[i];
            streamable
                && b.class == BufferClass::Gradient
                && b.dtype == schedule::DType::F32
                && used[i]
                && by_backward[i]
                && !in_forward[i]
                && !in_tasks[i]
        })
        .map(|i| BufferId(i as u32))
        .collect();
    let refresh = (0..n)
        .filter(|&i| {
            let b = &plan.buffers[i];
            matches!(
                b.class,
                BufferClass::KroneckerFactor | BufferClass::Eigenbasis
            ) && b.dtype == schedule::DType::F32
                && refresh_state[i]
                && used[i]
                && !outside[i]
        })
        .map(|i| BufferId(i as u32))
        .collect();
    // Parameters are read by the forward and backward too: each program that reads one copies
    // it in again (`prefetch-insertion`), so they come last; the copies cross programs, which
    // a step of accumulated micro-batches does not allow.
    let params = (0..n)
        .filter(|&i| {
            let b = &plan.buffers[i];
            streamable
                && b.class == BufferClass::Parameter
                && b.dtype == schedule::DType::F32
                && used[i]
                && !written_outside[i]
                && !in_tasks[i]
        })
        .map(|i| BufferId(i as u32))
        .collect();
    Candidates {
        moments,
        grads,
        refresh,
        params,
    }
}

/// The groups of tensors `tier-placement` may move, in the order it considers them
/// ([`candidates`]).
pub(crate) struct Candidates {
    pub(crate) moments: Vec<BufferId>,
    pub(crate) grads: Vec<BufferId>,
    pub(crate) refresh: Vec<BufferId>,
    pub(crate) params: Vec<BufferId>,
}

/// How many programs of the step read `id` (forward, backward, optimizer): the copies in a
/// moved tensor costs per step (a parameter: one per program reading it).
fn programs_reading(plan: &Plan, id: BufferId) -> usize {
    [&plan.forward, &plan.backward, &plan.optimizer]
        .iter()
        .filter(|p| {
            p.iter()
                .any(|op| op.operands().iter().any(|&(_, b)| b == id))
        })
        .count()
        .max(1)
}

/// Predicted copy time per step (ms) of `bytes` of moments in `tier` on `desc`: the host tier's
/// slower direction on a GPU (the copies in and out run at once on its two copy engines) or
/// both directions one after the other without one; the NVMe tier's read plus write.
pub fn tier_copy_ms(desc: &TargetDescription, tier: ArenaKind, bytes: usize) -> f64 {
    match tier {
        ArenaKind::Host => {
            let ways = if desc.host_gpu_gbps.is_some() {
                1.0
            } else {
                2.0
            };
            ways * desc.host_tier_ms(bytes)
        }
        _ => desc.nvme_ms(bytes, false) + desc.nvme_ms(bytes, true),
    }
}

/// The copies of a Kronecker factor or eigenbasis `id` in the host tier that its refreshes make
/// besides the optimizer's staging, per step (each a whole `[d, d]` copy, amortised over the
/// refresh's `precondition_frequency`; on a GPU the two directions overlap, so the larger
/// count): a GPU-placed refresh copies the factor in and the stored basis in (the QR step
/// starts from it), and its swap copies the old basis in and installs the new one out; a
/// host-placed refresh reads and writes them where they live, and its swap copies the old
/// basis in.
fn refresh_copies_per_step(plan: &Plan, id: BufferId) -> f64 {
    plan.host_tasks
        .iter()
        .map(|t| {
            let schedule::HostTask::EigenbasisRefresh {
                factor,
                basis,
                frequency,
                placement,
                ..
            } = t;
            let gpu = *placement == schedule::Placement::GpuSide;
            let copies = if *factor == id {
                if gpu {
                    1.0
                } else {
                    0.0
                }
            } else if *basis == id {
                if gpu {
                    2.0
                } else {
                    1.0
                }
            } else {
                0.0
            };
            copies / (*frequency).max(1) as f64
        })
        .sum()
}

/// Places `chosen` in the host tier while its budget allows (and `host_ok`), then on NVMe:
/// slots and arenas of `plan.memory`. Under a `host_memory` budget, the CUDA engine's NVMe
/// bounce slots ([`schedule::reserve::nvme_bounce_bytes`], four of the largest NVMe tensor,
/// pinned) share it with the host tier: the placement is repeated with that much less host
/// memory until the slots of what it puts on NVMe fit (each round can only move more to NVMe,
/// so the slots only grow; it ends when they fit or nothing does). Errors when neither tier
/// has room.
fn assign(
    plan: &mut Plan,
    chosen: &[BufferId],
    budgets: &Budgets,
    desc: &TargetDescription,
    host_ok: bool,
    decisions: &mut Vec<Decision>,
) -> Result<(), PassError> {
    if budgets.host.is_none() || budgets.nvme_dir.is_none() {
        return assign_reserving(plan, chosen, budgets, desc, host_ok, 0, decisions);
    }
    let mut bounce = 0;
    loop {
        let mut trial = plan.clone();
        let mut made = Vec::new();
        assign_reserving(
            &mut trial, chosen, budgets, desc, host_ok, bounce, &mut made,
        )?;
        let need = schedule::reserve::nvme_bounce_bytes(&trial);
        if need <= bounce {
            *plan = trial;
            decisions.extend(made);
            return Ok(());
        }
        bounce = need;
    }
}

/// [`assign`] with `bounce` bytes of `host_memory` kept for the NVMe bounce slots.
fn assign_reserving(
    plan: &mut Plan,
    chosen: &[BufferId],
    budgets: &Budgets,
    desc: &TargetDescription,
    host_ok: bool,
    bounce: usize,
    decisions: &mut Vec<Decision>,
) -> Result<(), PassError> {
    // The pinned refresh shadows share `host_memory` with the host tier, and so do the NVMe
    // bounce slots and the host copy of the clip's factor that host updates read
    // (`prefetch-insertion`).
    let scale_copy = if plan.optimizer.iter().any(|o| o.on_host()) {
        256
    } else {
        0
    };
    let host_cap = budgets.host.map_or(usize::MAX, |b| {
        (b as usize)
            .saturating_sub(schedule::reserve::refresh_pinned_bytes(plan))
            .saturating_sub(bounce)
            .saturating_sub(scale_copy)
    });
    let nvme_cap = if budgets.nvme_dir.is_some() {
        budgets.nvme.map_or(usize::MAX, |b| b as usize)
    } else {
        0
    };
    let (mut host, mut nvme) = (0usize, 0usize);
    // Tensors only pinned host memory may take (gradients, factors and bases, parameters)
    // claim it first; moments fill what is left, then NVMe.
    // A host update's operands live where it runs: the parameter is copied in once a step
    // (to its device copy), the gradient out once, the moments never.
    let mut on_host: Vec<(BufferId, &'static str)> = Vec::new();
    for op in plan.optimizer.iter().filter(|o| o.on_host()) {
        on_host.extend(op.operands().into_iter().map(|(f, id)| (id, f)));
    }
    let host_update_field = |c: BufferId| on_host.iter().find(|&&(id, _)| id == c).map(|&(_, f)| f);
    let host_only = |c: BufferId| {
        host_update_field(c).is_some()
            || !matches!(
                plan.buffer(c).class,
                BufferClass::ExpAvg | BufferClass::ExpAvgSq
            )
    };
    let ordered: Vec<BufferId> = chosen
        .iter()
        .copied()
        .filter(|&c| host_only(c))
        .chain(chosen.iter().copied().filter(|&c| !host_only(c)))
        .collect();
    for c in ordered {
        let bytes = plan.buffer(c).size_bytes();
        let gradient = plan.buffer(c).class == BufferClass::Gradient;
        let refresh = matches!(
            plan.buffer(c).class,
            BufferClass::KroneckerFactor | BufferClass::Eigenbasis
        );
        let param = plan.buffer(c).class == BufferClass::Parameter;
        let (tier, offset, copy_ms) = if host_ok && host.saturating_add(bytes) <= host_cap {
            let at = host;
            host = align_up(host.saturating_add(bytes), 256);
            // A parameter comes in once per program that reads it (its one copy out overlaps).
            let ins = match host_update_field(c) {
                Some("param") | Some("grad") => 1.0,
                Some(_) => 0.0,
                None if param => programs_reading(plan, c) as f64,
                None if refresh => 1.0 + refresh_copies_per_step(plan, c),
                None => 1.0,
            };
            (
                ArenaKind::Host,
                at,
                ins * tier_copy_ms(desc, ArenaKind::Host, bytes),
            )
        } else if !gradient
            && !refresh
            && !param
            && host_update_field(c).is_none()
            && nvme.saturating_add(bytes) <= nvme_cap
        {
            let at = nvme;
            nvme = align_up(nvme.saturating_add(bytes), NVME_ALIGN);
            (
                ArenaKind::Nvme,
                at,
                tier_copy_ms(desc, ArenaKind::Nvme, bytes),
            )
        } else {
            let why = if host_update_field(c).is_some() {
                "and the state of an update that runs on the host (`host_updates`) lives in \
                 pinned host memory only"
                    .to_string()
            } else if gradient {
                "and gradients (streamed out and back every step) go to pinned host memory \
                 only"
                    .to_string()
            } else if refresh {
                "and Kronecker factors and eigenbases (read by the refreshes where they live) \
                 go to pinned host memory only"
                    .to_string()
            } else if param {
                "and parameters (copied in by every program that reads them) go to pinned \
                 host memory only"
                    .to_string()
            } else if budgets.nvme_dir.is_none() {
                "and the spec names no `nvme` directory".to_string()
            } else {
                format!(
                    "and `nvme_memory` ({}) is full too: {} placed there, each tensor in whole \
                     1 MiB blocks",
                    human_bytes(nvme_cap),
                    human_bytes(nvme)
                )
            };
            return Err(PassError::Invalid {
                pass: "tier-placement",
                message: format!(
                    "`{}` ({}) must leave the device, but the host tier {} {why}",
                    plan.buffer(c).name,
                    human_bytes(bytes),
                    if host_ok {
                        format!(
                            "has {} left of `host_memory`",
                            human_bytes(host_cap.saturating_sub(host))
                        )
                    } else {
                        "frees nothing on this unified-memory target".to_string()
                    }
                ),
            });
        };
        plan.memory.slots[c.index()] = BufferSlot {
            arena: tier,
            offset,
        };
        let class = crate::liveness::class_name(plan.buffer(c).class);
        decisions.push(Decision {
            buffer: c,
            name: plan.buffer(c).name.clone(),
            bytes,
            tier,
            copy_ms,
            what: match host_update_field(c) {
                Some(_) => format!("{class}, host update"),
                None => class.to_string(),
            },
        });
    }
    plan.memory
        .arenas
        .retain(|a| matches!(a.kind, ArenaKind::Persistent | ArenaKind::Activations));
    for (kind, bytes) in [(ArenaKind::Host, host), (ArenaKind::Nvme, nvme)] {
        if bytes > 0 {
            plan.memory.arenas.push(ArenaPlan {
                kind,
                bytes: align_up(bytes, 256),
            });
        }
    }
    Ok(())
}

/// Whether `op` is one of the tier copies (for reports).
pub fn is_copy(op: &Op) -> bool {
    matches!(op, Op::CopyIn { .. } | Op::CopyOut { .. })
}
