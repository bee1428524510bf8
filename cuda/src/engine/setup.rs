//! Construction of a [`CudaEngine`]: the device and memory checks, the arenas, buffers,
//! scratch, bf16 shadows and saved attention copies (`with_device`), the CPU engine's
//! initialisation (`init_buffers`), and the buffer and memory accessors.
use super::profile::ProfileRows;
use super::{
    attn_dims, cuda_err, dims2, flash_math, tasks, CudaEngine, CudaOptions, SavedQkv, SavedSlot,
};
use crate::device::Device;
use crate::error::{CudaError, Tier};
use crate::memory::{Arena, Buf, Elem, BUF_ALIGN};
use crate::ops::{attention as at, kl_shampoo as kl, loss, nn, norm, optim as op, shampoo as sh};
use engine::{EngineError, EngineStats};
use schedule::{
    ArenaKind, AttentionKernel, BufferId, DType, Init, Op, Plan, Precision, Profile, TargetPlan,
};
use std::collections::HashMap;
use std::sync::Arc;

/// Checks that this engine can run the plan's bf16 buffers and saved attention statistics as
/// the plan asks (the `fuse` pass emits them only where it can; a hand-written or stale plan
/// is refused here rather than half-run): bf16 buffers need `precision = bf16` (the GEMMs that
/// read them are bf16 GEMMs); an `Attention` with a bf16 `out` or an `lse` needs the
/// tensor-core kernels (`attention` as resolved against the kernels that loaded).
fn check_fused(
    plan: &Plan,
    attention: AttentionKernel,
    precision: Precision,
) -> Result<(), EngineError> {
    let refuse = |what: String| Err(EngineError::Unsupported(format!("CUDA backend: {what}")));
    if precision != Precision::Bf16 {
        if let Some(b) = plan.buffers.iter().find(|b| b.dtype == DType::Bf16) {
            return refuse(format!(
                "buffer `{}` is bf16 but the plan's precision is fp32",
                b.name
            ));
        }
    }
    for o in plan.forward.iter().chain(&plan.backward) {
        if let Op::Attention {
            qkv,
            out,
            lse,
            batch,
            seq_len,
            n_heads,
        } = o
        {
            let d = attn_dims(
                *batch,
                *seq_len,
                *n_heads,
                dims2(&plan.buffer(*qkv).shape).1,
            );
            let tc = flash_math(attention, &d, precision) == Some(at::FlashMath::Bf16);
            let bf16 = |id: &BufferId| plan.buffer(*id).dtype == DType::Bf16;
            if !tc && (lse.is_some() || bf16(out) || bf16(qkv)) {
                return refuse(format!(
                    "attention `{}` has a bf16 input or output or saved statistics, which only \
                     the tensor-core kernels read and write, but attention runs as `{attention}` here",
                    plan.buffer(*out).name
                ));
            }
        }
    }
    Ok(())
}

/// Elements of f32 scratch `op` needs (0 for none).
fn scratch_need(
    plan: &Plan,
    op: &Op,
    attention: AttentionKernel,
    precision: Precision,
    soap: op::SoapProjections,
) -> usize {
    let shape = |id: BufferId| plan.buffer(id).shape.as_slice();
    let rows = |id: BufferId| dims2(shape(id)).0;
    let cols = |id: BufferId| dims2(shape(id)).1;
    match op {
        Op::LayerNormBackward { x, .. } => norm::layernorm_backward_scratch_len(rows(*x), cols(*x)),
        Op::EmbeddingBackward { dtable, .. } => nn::embedding_backward_scratch_len(rows(*dtable)),
        Op::RmsNormBackward { x, .. } => norm::rmsnorm_backward_scratch_len(rows(*x), cols(*x)),
        Op::Rope {
            seq_len, head_dim, ..
        }
        | Op::RopeBackward {
            seq_len, head_dim, ..
        } => nn::rope_scratch_len(*seq_len, *head_dim),
        Op::SumRows { x, .. } | Op::SumRowsCast { x, .. } => {
            nn::sum_rows_scratch_len(rows(*x), cols(*x))
        }
        Op::Attention {
            qkv,
            batch,
            seq_len,
            n_heads,
            ..
        } => {
            let d = attn_dims(*batch, *seq_len, *n_heads, cols(*qkv));
            if let Some(math) = flash_math(attention, &d, precision) {
                at::flash_forward_scratch_len(&d, math)
            } else {
                at::attention_forward_scratch_len(&d)
            }
        }
        Op::AttentionBackward {
            qkv,
            batch,
            seq_len,
            n_heads,
            ..
        } => {
            let d = attn_dims(*batch, *seq_len, *n_heads, cols(*qkv));
            if let Some(math) = flash_math(attention, &d, precision) {
                at::flash_backward_scratch_len(&d, math)
            } else {
                at::attention_backward_scratch_len(&d)
            }
        }
        Op::CrossEntropy { targets, .. } => {
            loss::cross_entropy_scratch_len(plan.buffer(*targets).numel())
        }
        Op::ClipGradNorm { grads, .. } => loss::clip_grad_norm_scratch_len(grads.len()),
        Op::SoapUpdate {
            param,
            basis_left,
            basis_right,
            ..
        } => {
            let (m, n) = dims2(shape(*param));
            op::soap_update_scratch_len(m, n, basis_left.is_some(), basis_right.is_some(), soap)
        }
        Op::Project {
            x,
            basis_left,
            basis_right,
            ..
        } => {
            let (m, n) = dims2(shape(*x));
            op::project_scratch_len(m, n, basis_left.is_some(), basis_right.is_some(), soap)
        }
        Op::KlShampooUpdate {
            param,
            basis_left,
            basis_right,
            ..
        } => {
            let (m, n) = dims2(shape(*param));
            let (l, r) = (basis_left.is_some(), basis_right.is_some());
            kl::kl_shampoo_update_scratch_len(m, n, l, r)
        }
        Op::ShampooUpdate { param, hyper, .. } => {
            let b = usize::try_from(hyper.max_preconditioner_dim).unwrap_or(usize::MAX);
            let moment = hyper.beta1 != 0.0;
            sh::shampoo_update_scratch_len(shape(*param), b, moment, hyper.grafting)
        }
        Op::ShampooPrecondition {
            x,
            max_preconditioner_dim,
            ..
        } => sh::shampoo_precondition_scratch_len(shape(*x), *max_preconditioner_dim),
        Op::KlScale { x, .. } => kl::kl_scale_scratch_len(rows(*x), cols(*x)),
        Op::KlFactorUpdate {
            grad,
            basis_left,
            basis_right,
            ..
        } => kl::kl_factor_update_scratch_len(
            rows(*grad),
            cols(*grad),
            basis_left.is_some(),
            basis_right.is_some(),
        ),
        Op::Graft {
            x,
            max_preconditioner_dim,
            ..
        } => sh::graft_scratch_len(shape(*x), *max_preconditioner_dim),
        Op::SoapFactorUpdate {
            grad,
            factor_left,
            factor_right,
            ..
        } => {
            let (m, n) = dims2(shape(*grad));
            op::soap_factor_update_scratch_len(
                m,
                n,
                factor_left.is_some(),
                factor_right.is_some(),
                soap,
            )
        }
        _ => 0,
    }
}

fn aligned(bytes: usize) -> usize {
    bytes.next_multiple_of(BUF_ALIGN)
}

impl CudaEngine {
    /// Opens the plan's device, allocates every buffer and initialises it as the CPU engine
    /// does (see the module docs).
    ///
    /// # Errors
    /// [`EngineError::Plan`] for an invalid plan, [`EngineError::Unsupported`] wrapping the
    /// [`CudaError`] when there is no driver / device or an allocation fails, and
    /// [`EngineError::Option`] for a zero failure limit.
    pub fn new(plan: Plan, opts: CudaOptions) -> Result<CudaEngine, EngineError> {
        plan.verify()?;
        if opts.engine.max_consecutive_refresh_failures == 0 {
            return Err(EngineError::Option(
                "max_consecutive_refresh_failures must be at least 1".into(),
            ));
        }
        let (ordinal, precision) = match plan.target {
            TargetPlan::Cuda {
                device, precision, ..
            } => (device as usize, precision),
            TargetPlan::Cpu { .. } => {
                return Err(EngineError::Option(
                    "the plan targets the CPU engine; compile it with `target cuda { }` to run it on a GPU".into(),
                ))
            }
        };
        let ordinal = opts.device.unwrap_or(ordinal);
        let dev = Device::new(ordinal).map_err(|e| cuda_err("opening the device", e))?;
        Self::with_device(plan, opts, Arc::new(dev), precision)
    }

    fn with_device(
        plan: Plan,
        opts: CudaOptions,
        dev: Arc<Device>,
        precision: Precision,
    ) -> Result<CudaEngine, EngineError> {
        let reserved_before = dev.memory_report().device_reserved.0;
        // Memory before allocation: the plan's arenas alone (scratch and bf16 shadows come on
        // top) must fit the device's free memory, or the plan is refused before anything is
        // allocated.
        if let Ok((free, _total)) = dev.context().mem_get_info() {
            let planned = plan
                .memory
                .arenas
                .iter()
                // The host tier is pinned host memory, the NVMe tier a file.
                .filter(|a| a.kind.on_device())
                .fold(0u64, |t, a| t.saturating_add(a.bytes as u64));
            let place = format!("GPU {} ({})", dev.info().ordinal, dev.info().name);
            engine::fits::check_fits(&plan, &place, planned, free as u64)?;
        }
        let e = |w: &'static str| move |err: CudaError| cuda_err(w, err);
        // `auto` under bf16 wants the tensor-core attention family; if it did not load (e.g. a
        // GPU below sm_80), fall back to the GEMM path instead of failing at the first launch.
        let mut attention = match plan.target {
            TargetPlan::Cuda { attention, .. } => attention,
            TargetPlan::Cpu { .. } => AttentionKernel::Gemm,
        };
        if attention != AttentionKernel::Gemm
            && (attention == AttentionKernel::Fused || precision == Precision::Bf16)
        {
            let loaded = dev
                .kernel_loads()
                .iter()
                .any(|l| l.family == "flash_attention_tc" && l.origin.is_some());
            if !loaded {
                if attention == AttentionKernel::Fused {
                    return Err(EngineError::Unsupported(format!(
                        "`attention = fused`: the tensor-core attention kernels did not load on {} ({}); use `attention = auto` or `gemm`",
                        dev.info().name,
                        dev.info().arch
                    )));
                }
                tracing::warn!(
                    "`attention = auto`: the tensor-core attention kernels did not load; attention runs as GEMMs"
                );
                attention = AttentionKernel::Gemm;
            }
        }
        // Sizes: buffers, scratch, bf16 shadows.
        let programs = || {
            plan.forward
                .iter()
                .chain(&plan.backward)
                .chain(&plan.optimizer)
        };
        let soap = CudaEngine::soap_projections(precision);
        let scratch_len = programs()
            .map(|o| scratch_need(&plan, o, attention, precision, soap))
            .max()
            .unwrap_or(0)
            .max(2);
        check_fused(&plan, attention, precision)?;
        // Model GEMMs read their operands in the plan's dtypes: under bf16 the `fuse` pass
        // made every operand a bf16 plan buffer (a bf16 producer output or a `cast`); a GEMM
        // with f32 operands runs in f32. Only SOAP's bf16 eigenbases (below) get engine shadows.
        let mut needs_shadow = vec![false; plan.buffers.len()];
        // bf16 tensor-core GEMMs want every leading dimension a multiple of 8 elements (16
        // bytes); cuBLAS runs the others on slow unaligned kernels (GPT-2's LM head with
        // N = 50257: 13.3 ms against 2.4 ms at 50304 on the H200).
        if precision == Precision::Bf16 {
            let mut odd: Vec<usize> = plan
                .forward
                .iter()
                .chain(&plan.backward)
                .filter_map(|o| match o {
                    Op::MatMul { a, b, .. } | Op::MatMulBias { a, b, .. } => Some([*a, *b]),
                    _ => None,
                })
                .flatten()
                .map(|id| dims2(&plan.buffer(id).shape).1)
                .filter(|c| c % 8 != 0)
                .collect();
            odd.sort_unstable();
            odd.dedup();
            if !odd.is_empty() {
                tracing::warn!(
                    widths = ?odd,
                    "GEMM operands with a row length that is not a multiple of 8 run on unaligned \
                     cuBLAS kernels, several times slower; pad them (e.g. `vocab = 50304` for GPT-2)"
                );
            }
        }
        // SOAP's bf16 projections read bf16 bases: cast once per swap, not once per step (a
        // swap marks the shadow stale, `tasks.rs`).
        if soap == op::SoapProjections::Bf16 {
            for o in &plan.optimizer {
                if let Op::SoapUpdate {
                    basis_left,
                    basis_right,
                    ..
                }
                | Op::Project {
                    basis_left,
                    basis_right,
                    ..
                } = o
                {
                    for q in basis_left.iter().chain(basis_right) {
                        needs_shadow[q.index()] = true;
                    }
                }
            }
        }
        // Plan buffers: one arena per arena of the memory plan (verified: every slot aligned
        // and inside its arena, shared bytes only between disjoint live ranges), each buffer
        // at its planned offset.
        let mut arenas: Vec<(String, usize)> = Vec::new();
        let mut plan_arenas: Vec<(ArenaKind, Arena)> = Vec::new();
        // The NVMe tier: a swap file, bounce slots and a writer thread (`nvme_tier`); its
        // arena takes no device memory.
        let nvme = super::nvme_tier::NvmeTier::new(&dev, &plan)?;
        if let Some(nv) = &nvme {
            arenas.push(("nvme-bounce".to_string(), nv.pinned_bytes));
        }
        for a in &plan.memory.arenas {
            if a.bytes == 0 || a.kind == ArenaKind::Nvme {
                continue;
            }
            // The host tier is pinned host memory: the copy engines move it at full speed.
            let tier = if a.kind == ArenaKind::Host {
                Tier::PinnedHost
            } else {
                Tier::Device
            };
            let arena = dev.arena(a.kind.name(), tier, a.bytes).map_err(|err| {
                cuda_err(
                    &format!("allocating the `{}` arena ({} bytes)", a.kind, a.bytes),
                    err,
                )
            })?;
            arenas.push((a.kind.name().to_string(), a.bytes));
            plan_arenas.push((a.kind, arena));
        }
        let mut bufs = Vec::with_capacity(plan.buffers.len());
        for (i, (b, slot)) in plan.buffers.iter().zip(&plan.memory.slots).enumerate() {
            if let Some(nv) = nvme.as_ref().filter(|n| n.holds(BufferId(i as u32))) {
                bufs.push(
                    nv.placeholder()
                        .map_err(|err| cuda_err(&format!("placing buffer `{}`", b.name), err))?,
                );
                continue;
            }
            let elem = match b.dtype {
                DType::F32 => Elem::F32,
                DType::I32 => Elem::I32,
                DType::Bf16 => Elem::BF16,
            };
            let arena = plan_arenas
                .iter_mut()
                .find(|(k, _)| *k == slot.arena)
                .map(|(_, a)| a)
                .ok_or_else(|| {
                    EngineError::Unsupported(format!(
                        "CUDA backend: buffer #{i} `{}` is in arena `{}`, which has no bytes",
                        b.name, slot.arena
                    ))
                })?;
            bufs.push(
                arena
                    .buf_at(elem, b.numel(), slot.offset)
                    .map_err(|err| cuda_err(&format!("placing buffer `{}`", b.name), err))?,
            );
        }
        // Engine-owned: op scratch, bf16 shadows (never shared).
        let mut bytes = aligned(scratch_len * 4);
        bytes += plan
            .buffers
            .iter()
            .zip(&needs_shadow)
            .filter(|(_, &s)| s)
            .map(|(b, _)| aligned(b.numel() * 2))
            .sum::<usize>();
        let mut arena = dev
            .arena("engine", Tier::Device, bytes)
            .map_err(e("allocating the engine arena"))?;
        arenas.push(("engine".to_string(), bytes));
        let scratch = arena
            .buf(Elem::F32, scratch_len)
            .map_err(e("carving scratch"))?;
        let mut shadows = Vec::with_capacity(plan.buffers.len());
        for (b, &s) in plan.buffers.iter().zip(&needs_shadow) {
            shadows.push(if s {
                Some(
                    arena
                        .buf(Elem::BF16, b.numel())
                        .map_err(e("carving a bf16 shadow"))?,
                )
            } else {
                None
            });
        }

        // The bf16 qkv copies of the saving attentions (plan `Attention { lse: Some(..) }`),
        // in slots shared by copies live at disjoint times
        // (`schedule::reserve::saved_attention_slots`).
        let mut saved_qkv = HashMap::new();
        let mut saved_arena = None;
        let mut saved_slots = Vec::new();
        // Forward and backward: `rematerialize = layers` reruns saving attentions in the
        // backward program.
        let want = schedule::reserve::saved_attention_qkvs(&plan);
        if !want.is_empty() {
            let (slot_of, lens) = schedule::reserve::saved_attention_slots(&plan);
            let bytes: usize = lens.iter().map(|n| aligned(n * 2)).sum();
            let mut sa = dev
                .arena("attention-saved", Tier::Device, bytes)
                .map_err(e("allocating the attention-saved arena"))?;
            arenas.push(("attention-saved".to_string(), bytes));
            for &n in &lens {
                saved_slots.push(SavedSlot {
                    qkv16: sa
                        .buf(Elem::BF16, n)
                        .map_err(e("carving a saved bf16 qkv"))?,
                    holds: None,
                });
            }
            for ((qkv, n), slot) in want.into_iter().zip(slot_of) {
                let qkv16 = saved_slots[slot]
                    .qkv16
                    .slice(0, n)
                    .map_err(e("carving a saved bf16 qkv"))?;
                saved_qkv.insert(qkv, SavedQkv { qkv16, slot });
            }
            saved_arena = Some(sa);
        }

        // Refresh machinery: refreshers, swap buffers, shadows of asynchronous tasks.
        let gpu_trace = opts.trace.then(super::gpu_trace::GpuTrace::default);
        let refreshes = tasks::Refreshes::new(&dev, &plan, &opts.engine, gpu_trace.clone())?;
        let solver = opts.engine.solver(&plan)?;
        let profile = (opts.profile != Profile::Off).then(|| ProfileRows {
            events: opts.profile == Profile::Events,
            warm: false,
            rows: Default::default(),
        });
        let refresh_bytes = refreshes.bytes;

        // Element-wise update rules: each distinct rule compiled once, before anything runs
        // (a rule that does not parse or compile refuses the plan here).
        let mut update_kernels = HashMap::new();
        let mut adamw_kernels = HashMap::new();
        for op in &plan.optimizer {
            if let Op::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } = *op
            {
                let key = schedule::adamw_kernel_key(beta1, beta2, eps, weight_decay);
                if !adamw_kernels.contains_key(&key) {
                    let k = op::AdamWKernel::new(&dev, beta1, beta2, eps, weight_decay)
                        .map_err(e("compiling the AdamW kernel"))?;
                    adamw_kernels.insert(key, Arc::new(k));
                }
            }
            if let Op::ElementwiseUpdate { rule, .. } = op {
                let key = rule.kernel_key();
                if update_kernels.contains_key(&key) {
                    continue;
                }
                let r = optim::optimizers::update_rule(rule).map_err(|err| {
                    EngineError::Plan(schedule::PlanError::Invalid(format!(
                        "elementwise_update: the `{}` update rule: {err}",
                        rule.optimizer
                    )))
                })?;
                let k = op::UpdateKernel::new(&dev, &r)
                    .map_err(e("compiling an element-wise update rule"))?;
                update_kernels.insert(key, Arc::new(k));
            }
        }

        let tasks = plan.host_tasks.len();
        let n_bufs = plan.buffers.len();
        let peak_sampler = dev
            .spawn_peak_sampler(std::time::Duration::from_millis(10))
            .map_err(|e| tracing::warn!("no GPU memory sampler thread: {e}"))
            .ok();
        let mut eng = CudaEngine {
            update_kernels,
            adamw_kernels,
            dev,
            opts,
            precision,
            bufs,
            shadows,
            shadow_fresh: vec![false; n_bufs],
            shadow_casts: 0,
            write_gen: vec![0; n_bufs],
            saved_qkv,
            saved_slots,
            scratch,
            refreshes,
            stats: EngineStats {
                refresh_failures: vec![0; tasks],
                consecutive_refresh_failures: vec![0; tasks],
                ..EngineStats::default()
            },
            last_tokens: Vec::new(),
            last_targets: Vec::new(),
            _arenas: plan_arenas
                .into_iter()
                .map(|(_, a)| a)
                .chain(std::iter::once(arena))
                .chain(saved_arena)
                .collect(),
            arenas,
            refresh_bytes,
            reserved_before,
            _peak_sampler: peak_sampler,
            profile,
            copy_order: super::copies::CopyOrder::new(&plan),
            host_updates: super::host_updates::HostUpdates::new(
                &plan,
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            )
            .map_err(EngineError::Unsupported)?,
            copy_events: (0..plan.step_len()).map(|_| None).collect(),
            cut_step: false,
            attention,
            solver,
            energy: None,
            gpu_trace,
            nvme,
            plan,
        };
        eng.check_budget()?;
        eng.init_buffers()?;
        // Opened last: the counter starts with the run, not with the set-up.
        eng.energy = match crate::energy::EnergyMeter::open(&eng.dev.info().pci_bus_id) {
            Ok(m) => {
                tracing::info!(meter = %m.describe(), "GPU energy");
                Some(m)
            }
            Err(e) => {
                tracing::info!(reason = %e, "no GPU energy reading");
                None
            }
        };
        Ok(eng)
    }

    /// The plan's device budget (`gpu_memory`), enforced once everything is allocated and before
    /// anything runs, on the engine's arenas plus the process's memory outside them (the CUDA
    /// context and libraries, `schedule::reserve::CUDA_CONTEXT_BYTES`): over it, an error
    /// naming the arenas (the plan's and the engine's own) and that, largest first.
    fn check_budget(&self) -> Result<(), EngineError> {
        let Some(budget) = self.plan.memory.budgets.device else {
            return Ok(());
        };
        // This engine's own device allocations (another engine or a self-test on the same
        // device does not count against this plan's budget), plus what the process holds
        // outside every arena (context, kernel modules, library workspaces): NVML's count for
        // this process less all its arenas when NVML lists it, else the compiler's estimate.
        let reserved = self.dev.memory_report().device_reserved.0;
        let arenas = reserved.saturating_sub(self.reserved_before);
        let (outside, source) = match crate::energy::process_gpu_bytes(&self.dev.info().pci_bus_id)
        {
            Some(b) => ((b as usize).saturating_sub(reserved), "measured by NVML"),
            None => (schedule::reserve::CUDA_CONTEXT_BYTES, "estimated"),
        };
        let used = arenas + outside;
        let gib = |b: usize| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
        tracing::info!(
            "device budget {}: engine arenas {} + context and libraries {} ({source})",
            gib(budget as usize),
            gib(arenas),
            gib(outside)
        );
        // Device arenas only: the host tier's pinned arena and the NVMe tier's pinned bounce
        // slots do not count against the budget.
        let mut list: Vec<(String, usize)> = self
            .arenas
            .iter()
            .filter(|(n, _)| n != ArenaKind::Host.name() && n != "nvme-bounce")
            .cloned()
            .collect();
        list.push((
            "refresh work and shadows".into(),
            self.refresh_bytes - self.refreshes.pinned_bytes,
        ));
        list.push((format!("context and libraries ({source})"), outside));
        match budget_refusal(&self.plan, budget, used, list) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The CPU engine's initialisation (`engine::CpuEngine::new`), on the host, uploaded.
    fn init_buffers(&mut self) -> Result<(), EngineError> {
        let e = |err: CudaError| cuda_err("initialising buffers", err);
        let seed = self.opts.engine.seed.unwrap_or(self.plan.train.seed);
        for (i, (b, buf)) in self.plan.buffers.iter().zip(&self.bufs).enumerate() {
            // `Plan::initial` resolves a `CopyOf` (verified) to its source's init and stream.
            let (init, stream) = self.plan.initial(i).unwrap_or((Init::Zeros, i as u64));
            let on_nvme = self
                .nvme
                .as_ref()
                .is_some_and(|n| n.holds(BufferId(i as u32)));
            if buf.tier() == Tier::PinnedHost || on_nvme {
                // Offloaded state (host tier: pinned host memory; NVMe tier: its region in the
                // swap file), written from the host with the CPU engine's values.
                let mut v = vec![0f32; b.numel()];
                match (init, b.dtype) {
                    (Init::Zeros | Init::CopyOf { .. }, DType::F32) => {}
                    (Init::Ones, DType::F32) => v.iter_mut().for_each(|x| *x = 1.0),
                    (Init::Normal { std }, DType::F32) => {
                        engine::normal_fill(seed, stream, &mut v, |z| (std * z) as f32)
                    }
                    _ => {
                        return Err(EngineError::Unsupported(format!(
                            "CUDA backend: offloaded buffer `{}` is not f32",
                            b.name
                        )))
                    }
                }
                if let Some(nv) = self.nvme.as_mut().filter(|_| on_nvme) {
                    nv.write(BufferId(i as u32), &v).map_err(|err| {
                        EngineError::Tier(format!("initialising `{}`: {err}", b.name))
                    })?;
                    continue;
                }
                if buf.bytes() < v.len() * 4 {
                    return Err(EngineError::Unsupported(format!(
                        "CUDA backend: host-tier buffer `{}` is smaller than its plan buffer",
                        b.name
                    )));
                }
                // SAFETY: a pinned-host `Buf` is host memory of at least `v.len()` f32
                // (checked above), allocated while `self.bufs` lives; no copy from or to it
                // is pending before the first step.
                unsafe {
                    std::ptr::copy_nonoverlapping(v.as_ptr(), buf.ptr() as *mut f32, v.len())
                };
                continue;
            }
            match (init, b.dtype) {
                (Init::Zeros | Init::CopyOf { .. }, _) => self.dev.zero(buf).map_err(e)?,
                (Init::Ones, DType::F32) => {
                    self.dev.upload(buf, &vec![1.0f32; b.numel()]).map_err(e)?
                }
                (Init::Ones, DType::I32) => {
                    self.dev.upload(buf, &vec![1i32; b.numel()]).map_err(e)?
                }
                (Init::Normal { std }, DType::F32) => {
                    let mut v = vec![0f32; b.numel()];
                    engine::normal_fill(seed, stream, &mut v, |z| (std * z) as f32);
                    self.dev.upload(buf, &v).map_err(e)?
                }
                (Init::Normal { std }, DType::I32) => {
                    let mut v = vec![0i32; b.numel()];
                    engine::normal_fill(seed, stream, &mut v, |z| (std * z).round() as i32);
                    self.dev.upload(buf, &v).map_err(e)?
                }
                (Init::Ones | Init::Normal { .. }, DType::Bf16) => {
                    // Lowering gives activations (the only bf16 buffers) zero init.
                    return Err(EngineError::Unsupported(format!(
                        "CUDA backend: bf16 buffer `{}` with a non-zero init",
                        b.name
                    )));
                }
            }
        }
        self.dev.synchronize().map_err(e)
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Current and peak GPU memory (driver view and arenas).
    pub fn memory_report(&self) -> crate::MemoryReport {
        self.dev.memory_report()
    }

    /// One line naming every arena with its size in GiB, and the bytes the plan's buffers
    /// would take with one place each (`arenas: persistent 1.85 GiB, activations 15.23 GiB,
    /// engine 3.10 GiB, refresh 0.00 GiB; plan buffers unshared 33.82 GiB`).
    pub fn arena_line(&self) -> String {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let list: Vec<String> = self
            .arenas
            .iter()
            .map(|(n, b)| format!("{n} {:.2} GiB", gib(*b)))
            .collect();
        let unshared: usize = self
            .plan
            .buffers
            .iter()
            .map(|b| aligned(b.size_bytes()))
            .sum();
        format!(
            "arenas: {}, refresh {:.2} GiB; plan buffers unshared {:.2} GiB",
            list.join(", "),
            gib(self.refresh_bytes),
            gib(unshared)
        )
    }

    fn id(&self, name: &str) -> Result<BufferId, EngineError> {
        self.plan
            .buffers
            .iter()
            .position(|b| b.name == name)
            .map(|i| BufferId(i as u32))
            .ok_or_else(|| EngineError::UnknownBuffer(name.to_string()))
    }

    /// Buffer `name` downloaded as f64 (i32 and bf16 buffers converted exactly).
    ///
    /// # Errors
    /// [`EngineError::UnknownBuffer`] or a CUDA error.
    pub fn buffer(&self, name: &str) -> Result<Vec<f64>, EngineError> {
        let id = self.id(name)?;
        self.buffer_range(name, 0, self.plan.buffer(id).numel())
    }

    /// Elements `start..start + len` of buffer `name` as f64 (only they are downloaded).
    ///
    /// # Errors
    /// [`EngineError::UnknownBuffer`], [`EngineError::Length`] when the range leaves the
    /// buffer, or a CUDA error.
    pub fn buffer_range(
        &self,
        name: &str,
        start: usize,
        len: usize,
    ) -> Result<Vec<f64>, EngineError> {
        // Host updates (`host_updates`) or carried copies out may still be writing host-tier state.
        self.settle()?;
        let id = self.id(name)?;
        let numel = self.plan.buffer(id).numel();
        if start.checked_add(len).is_none_or(|end| end > numel) {
            return Err(EngineError::Length {
                buffer: name.to_string(),
                expected: numel,
                got: start.saturating_add(len),
            });
        }
        if let Some(nv) = self.nvme.as_ref().filter(|n| n.holds(id)) {
            let v = nv
                .read(id)
                .map_err(|err| EngineError::Tier(format!("reading `{name}`: {err}")))?;
            return Ok(v[start..start + len]
                .iter()
                .map(|&x| f64::from(x))
                .collect());
        }
        let e = |err| cuda_err("download", err);
        let b = &self.bufs[id.index()].slice(start, len).map_err(e)?;
        Ok(match b.elem() {
            Elem::I32 => self
                .dev
                .download::<i32>(b)
                .map_err(e)?
                .into_iter()
                .map(f64::from)
                .collect(),
            Elem::BF16 => self
                .dev
                .download::<half::bf16>(b)
                .map_err(e)?
                .into_iter()
                .map(|x| x.to_f64())
                .collect(),
            _ => self
                .dev
                .download::<f32>(b)
                .map_err(e)?
                .into_iter()
                .map(f64::from)
                .collect(),
        })
    }

    /// Overwrites buffer `name` with `values` (rounded to f32, to i32 or to bf16 by the buffer's
    /// dtype), as
    /// `engine::CpuEngine::set_buffer` (the train-match's `--resync` copies the CPU state in).
    ///
    /// # Errors
    /// [`EngineError::UnknownBuffer`], [`EngineError::Length`] on a wrong element count, or a
    /// CUDA error.
    pub fn set_buffer(&mut self, name: &str, values: &[f64]) -> Result<(), EngineError> {
        // Host updates (`host_updates`) or carried copies out may still be reading or writing
        // host-tier state.
        self.settle()?;
        let id = self.id(name)?;
        let expected = self.plan.buffer(id).numel();
        if values.len() != expected {
            return Err(EngineError::Length {
                buffer: name.to_string(),
                expected,
                got: values.len(),
            });
        }
        if let Some(nv) = self.nvme.as_mut().filter(|n| n.holds(id)) {
            let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
            nv.write(id, &v)
                .map_err(|err| EngineError::Tier(format!("writing `{name}`: {err}")))?;
            self.write_gen[id.index()] += 1;
            return Ok(());
        }
        let b = &self.bufs[id.index()];
        let e = |err| cuda_err("upload", err);
        match b.elem() {
            Elem::I32 => {
                let v: Vec<i32> = values.iter().map(|&x| x.round() as i32).collect();
                self.dev.upload(b, &v).map_err(e)?;
            }
            Elem::BF16 => {
                let v: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f64(x)).collect();
                self.dev.upload(b, &v).map_err(e)?;
            }
            _ => {
                let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
                self.dev.upload(b, &v).map_err(e)?;
            }
        }
        self.shadow_fresh[id.index()] = false;
        self.write_gen[id.index()] += 1;
        Ok(())
    }

    pub(super) fn b(&self, id: BufferId) -> &Buf {
        &self.bufs[id.index()]
    }

    pub(super) fn dims(&self, id: BufferId) -> (usize, usize) {
        dims2(&self.plan.buffer(id).shape)
    }
}

/// The CUDA engine's refusal of a plan whose device allocations exceed its `gpu_memory`
/// budget, before anything runs: `used` bytes (the engine's arenas plus the process's memory
/// outside them) against `budget`, naming the largest of `consumers` (`(name, bytes)`: the
/// arenas, the refresh work, the context and libraries) and the plan's largest tensors on the
/// device, with what to do. `None` when `used` fits.
pub(crate) fn budget_refusal(
    plan: &Plan,
    budget: u64,
    used: usize,
    mut consumers: Vec<(String, usize)>,
) -> Option<EngineError> {
    if used as u64 <= budget {
        return None;
    }
    let gib = |b: usize| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
    consumers.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut named: Vec<String> = consumers
        .iter()
        .filter(|(_, b)| *b > 0)
        .take(6)
        .map(|(n, b)| format!("{n} {}", gib(*b)))
        .collect();
    let mut tensors: Vec<(usize, &str)> = plan
        .buffers
        .iter()
        .enumerate()
        .filter(|(i, _)| {
            plan.memory
                .tier(schedule::BufferId(*i as u32))
                .is_none_or(|k| k.on_device())
        })
        .map(|(_, b)| (b.size_bytes(), b.name.as_str()))
        .collect();
    tensors.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    let largest: Vec<String> = tensors
        .iter()
        .take(4)
        .map(|(b, n)| format!("%{n} {}", gib(*b)))
        .collect();
    if !largest.is_empty() {
        named.push(format!(
            "the plan's largest tensors on the device: {}",
            largest.join(", ")
        ));
    }
    named.push(format!(
        "compile with a `gpu_memory` at most {} to leave this engine the {} it needs beyond \
         the plan's estimate",
        gib((budget as usize).saturating_sub(used - budget as usize)),
        gib(used - budget as usize)
    ));
    Some(EngineError::OutOfMemory {
        plan: plan.name.clone(),
        place: format!("the `gpu_memory` budget of {}", gib(budget as usize)),
        needed: gib(used),
        available: gib(budget as usize),
        largest: named.join("; "),
    })
}

#[cfg(test)]
mod fusion_tests {
    //! The engine decides no fusion; it checks that it can run the plan's fused ops and bf16
    //! buffers as asked (`check_fused`), with the kernel limits the compiler plans against.
    use super::*;

    fn gpt2_124m_plan() -> Plan {
        let spec = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/gpt2-124m.asteria");
        let config = frontend::load_spec(&spec).expect("examples/gpt2-124m.asteria loads");
        let mut module = ir::Module::new(config);
        let mut pm = passes::PassManager::new(passes::PassOptions::default()).expect("passes");
        let mut sink = Vec::new();
        let (cx, _) = pm.run(&mut module, None, &mut sink).expect("pipeline");
        cx.plan.expect("a plan")
    }

    #[test]
    fn the_compilers_bf16_limits_are_this_engines_kernel_limits() {
        assert_eq!(schedule::BF16_LAYERNORM_MAX_C, norm::LAYERNORM_WARP_MAX_C);
        let d = |head: usize| at::AttnDims {
            batch: 1,
            seq_len: 8,
            n_heads: 2,
            channels: 2 * head,
        };
        let max = schedule::BF16_ATTENTION_MAX_HEAD_DIM;
        assert!(at::flash_supported(&d(max), at::FlashMath::Bf16));
        assert!(!at::flash_supported(&d(max + 8), at::FlashMath::Bf16));
    }

    /// The refusal names the budget, the need, the largest consumers (largest first) and the
    /// plan's largest device tensors, and says what budget to compile with; a plan that fits is
    /// not refused, and a tensor moved off the device is not named.
    #[test]
    fn a_plan_over_its_budget_is_refused_naming_its_consumers() {
        const GIB: usize = 1 << 30;
        let plan = gpt2_124m_plan();
        let consumers = || {
            vec![
                ("persistent".to_string(), 2 * GIB),
                ("activations".to_string(), 5 * GIB),
                ("refresh work and shadows".to_string(), 0),
                ("context and libraries (measured by NVML)".to_string(), GIB),
            ]
        };
        assert!(budget_refusal(&plan, 8 * GIB as u64, 8 * GIB, consumers()).is_none());
        let e = budget_refusal(&plan, 7 * GIB as u64, 8 * GIB, consumers()).expect("over");
        let text = e.to_string();
        assert!(matches!(e, EngineError::OutOfMemory { .. }), "{e:?}");
        for want in [
            "`gpu_memory` budget of 7.00 GiB",
            "8.00 GiB",
            "activations 5.00 GiB; persistent 2.00 GiB; context and libraries",
            "at most 6.00 GiB",
            "the plan's largest tensors on the device: %d.logits 1.54 GiB",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        assert!(
            !text.contains("refresh work"),
            "zero-byte consumers are left out: {text}"
        );
        // A tensor moved to host memory is no longer named.
        let mut moved = plan.clone();
        let at: Vec<usize> = (0..moved.buffers.len())
            .filter(|&i| moved.buffers[i].name == "d.logits")
            .collect();
        assert_eq!(at.len(), 1, "one d.logits");
        moved.memory.slots[at[0]].arena = ArenaKind::Host;
        let text = budget_refusal(&moved, 7 * GIB as u64, 8 * GIB, consumers())
            .expect("over")
            .to_string();
        assert!(!text.contains("%d.logits "), "{text}");
    }

    #[test]
    fn fused_plans_run_only_with_the_kernels_they_were_compiled_for() {
        let plan = gpt2_124m_plan();
        assert!(plan.buffers.iter().any(|b| b.dtype == DType::Bf16));
        check_fused(&plan, AttentionKernel::Auto, Precision::Bf16).expect("as compiled");
        // bf16 attention outputs and saved statistics need the tensor-core kernels.
        let err = check_fused(&plan, AttentionKernel::Gemm, Precision::Bf16).unwrap_err();
        assert!(err.to_string().contains("tensor-core"), "{err}");
        // bf16 buffers need bf16 GEMMs.
        let err = check_fused(&plan, AttentionKernel::Fused, Precision::Fp32).unwrap_err();
        assert!(err.to_string().contains("precision is fp32"), "{err}");
    }
}
