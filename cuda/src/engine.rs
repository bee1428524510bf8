//! [`CudaEngine`]: runs a verified plan on one GPU through the launchers of [`crate::ops`] and
//! [`crate::gemm`], as an [`engine::StepExecutor`] (so `engine::train_with` drives it with the
//! same data, schedule, metrics and evaluation as the CPU engine).
//!
//! - Memory: one device arena per arena of the plan's memory plan (`persistent`: parameters,
//!   gradients, optimizer state, inputs, one place each; `activations`: step-local buffers
//!   sharing bytes by liveness), each plan buffer at its planned offset ([`Arena::buf_at`]);
//!   the engine's own `engine` arena holds the largest op scratch and (under bf16) the
//!   bf16 shadows of the f32 GEMM operands; eigenbasis-refresh work buffers and cuSOLVER's workspace
//!   have another. Sizes: [`CudaEngine::arenas`]; peak use:
//!   [`CudaEngine::memory_report`].
//! - bf16 shadows and shared bytes: a shadow caches the cast of one buffer and is marked stale
//!   whenever an op writes that buffer (`Op::accesses`), on `set_buffer` and `load_batch`. A buffer
//!   of the shared `activations` arena can have its bytes overwritten by another buffer only
//!   outside its live range, and its first access in every program run is a write (that is what
//!   makes it transient, `schedule::Plan::residency`), which marks the shadow stale before any
//!   read: a cached shadow is never used for bytes another buffer wrote.
//! - Fused ops and bf16 buffers come from the plan (the compiler's `fuse` pass decides them;
//!   this engine decides none): `MatMulBias` runs as one cuBLASLt GEMM with a bias epilogue
//!   (the GEMM then an in-place bias add where cuBLASLt did not load, or under fp32); a bf16
//!   plan buffer is allocated as bf16, written in bf16 by its producer (LayerNorm, GELU,
//!   tensor-core attention, `CrossEntropyBackward`) and read by bf16 GEMMs directly, with no
//!   f32 copy and no cast; an `Attention` with `lse` writes its row log-sum-exp into that plan
//!   buffer and its `AttentionBackward` reads it and `fwd_out` instead of rerunning the
//!   forward. The bf16 copy of qkv the tensor-core backward also reads is an engine cache
//!   (`attention-saved` arena), valid while qkv's write generation is unchanged.
//! - Init: the CPU engine's exact procedure (one `engine::Rng` seeded by the options' or the
//!   plan's seed, normal draws in buffer order) on the host, uploaded: the same seed gives
//!   bit-identical initial weights on both engines.
//! - Precision (`TargetPlan::Cuda::precision`): `fp32` runs every GEMM in plain fp32 (no TF32)
//!   and attention through the GEMM path; `bf16` runs the model GEMMs (plan `MatMul`s) with bf16
//!   inputs and fp32 accumulation and output, attention on the fused bf16 tensor-core kernels
//!   (head dim ≤ 64, else the GEMM path in bf16; the plan's `attention` option, [`flash_math`]), SOAP's per-step GEMMs
//!   (factor accumulation, projections) on bf16 operands ([`op::SoapProjections`]) and the
//!   moment re-projection of a refresh swap on TF32 tensor cores. Master weights, moments,
//!   elementwise optimizer math and the eigensolves and QRs of refreshes stay fp32.
//! - `ClipGradNorm` reads the norm back; a non-finite norm skips the rest of the optimizer
//!   program (counted in `EngineStats::skipped_steps`), as on the CPU.
//! - Bad token ids / targets: the kernels set the device status word; `forward` checks it
//!   ([`crate::Device::take_status`]) and reports the offending row and value.
//! - Host tasks (`EigenbasisRefresh`): on the GPU through cuSOLVER ([`crate::refresh`]) or on
//!   the host through `optim` (the CPU engine's functions), as the plan places each one
//!   (`precond-scheduling`, the spec's `refresh_placement`); synchronous for S = 0, else off the critical path on the side stream or
//!   the host pool with shadow states, double buffering and bounded staleness (module `tasks`:
//!   the GPU mechanics under the scheduling both engines share, `engine::refresh_runtime`).
use crate::device::{Device, GemmMath};
use crate::error::{CudaError, Tier};
use crate::gemm::{self, Dims};
use crate::memory::{Arena, Buf, Elem, BUF_ALIGN};
use crate::ops::{attention as at, loss, nn, optim as op};
use crate::StreamKind;
use cudarc::driver::CudaEvent;
use engine::{EngineError, EngineOptions, EngineStats, HostTaskReport, Rng, StepExecutor};
use schedule::{
    ArenaKind, AttentionKernel, BufferId, DType, Init, Op, Plan, Precision, Profile, TargetPlan,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

mod tasks;

/// The fused kernels' math for geometry `d` under the plan's attention option and
/// `precision`, or `None` for the GEMM path: `auto` takes the bf16 tensor-core kernels under
/// `precision = bf16`, the GEMM path under `fp32`; `fused` the tensor-core kernels whatever the
/// precision; heads wider than the kernels support take the GEMM path.
fn flash_math(
    attention: AttentionKernel,
    d: &at::AttnDims,
    precision: Precision,
) -> Option<at::FlashMath> {
    match (attention, precision) {
        (AttentionKernel::Gemm, _) | (AttentionKernel::Auto, Precision::Fp32) => None,
        (AttentionKernel::Fused, _) | (AttentionKernel::Auto, Precision::Bf16) => {
            at::flash_supported(d, at::FlashMath::Bf16).then_some(at::FlashMath::Bf16)
        }
    }
}

/// The bf16 copy of an attention's qkv (`[N, 3C]`) that a saving tensor-core forward (plan
/// `Attention { lse: Some(..) }`) makes for its backward, with qkv's write generation when it
/// was made: the backward reads it only while that generation still matches.
struct SavedQkv {
    qkv16: Buf,
    gen: Option<u64>,
}

/// `--profile` state: per `section/op[ shape]` the calls, GPU ms and host ms.
struct ProfileRows {
    /// CUDA events around each op instead of host syncs (`--profile events`).
    events: bool,
    rows: std::collections::BTreeMap<String, (u64, f64, f64)>,
}

/// Options of a [`CudaEngine`] that are not part of the plan: everything here changes how a
/// run is observed or which device runs it, never what it computes (the plan's
/// [`TargetPlan::Cuda`] options do that).
#[derive(Clone, Debug, Default)]
pub struct CudaOptions {
    /// Seed override, injected eigensolver and refresh failure limit, as for the CPU engine.
    pub engine: EngineOptions,
    /// Device ordinal; `None` = the plan's.
    pub device: Option<usize>,
    /// Per-op GPU timing (`--profile`), printed by [`CudaEngine::profile_table`].
    pub profile: Profile,
}

fn cuda_err(where_: &str, e: CudaError) -> EngineError {
    EngineError::Unsupported(format!("CUDA backend, {where_}: {e}"))
}

/// `(rows, cols)` of a buffer as the CPU engine sees it (`[r, c]`, `[n]` → `(1, n)`, higher
/// ranks: first dim × the rest).
fn dims2(shape: &[usize]) -> (usize, usize) {
    match shape {
        [r, c] => (*r, *c),
        [n] => (1, *n),
        s => (s.first().copied().unwrap_or(0), s.iter().skip(1).product()),
    }
}

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
    for o in &plan.forward {
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
            if !tc && (lse.is_some() || plan.buffer(*out).dtype == DType::Bf16) {
                return refuse(format!(
                    "attention `{}` has a bf16 output or saved statistics, which only the \
                     tensor-core kernels write, but attention runs as `{attention}` here",
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
        Op::LayerNormBackward { x, .. } => nn::layernorm_backward_scratch_len(rows(*x)),
        Op::RmsNormBackward { x, .. } => nn::rmsnorm_backward_scratch_len(rows(*x)),
        Op::SumRows { x, .. } => nn::sum_rows_scratch_len(rows(*x), cols(*x)),
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

fn attn_dims(batch: usize, seq_len: usize, n_heads: usize, qkv_cols: usize) -> at::AttnDims {
    at::AttnDims {
        batch,
        seq_len,
        n_heads,
        channels: qkv_cols / 3,
    }
}

fn aligned(bytes: usize) -> usize {
    bytes.next_multiple_of(BUF_ALIGN)
}

/// The CUDA interpreter of a [`Plan`]. See the module docs.
pub struct CudaEngine {
    plan: Plan,
    // Dropped before `dev`: the refreshers' cuSOLVER handles are bound to its streams.
    refreshes: tasks::Refreshes,
    dev: Arc<Device>,
    opts: CudaOptions,
    precision: Precision,
    bufs: Vec<Buf>,
    shadows: Vec<Option<Buf>>,
    shadow_fresh: Vec<bool>,
    /// f32 → bf16 shadow casts done so far (the profile attributes them to their op).
    shadow_casts: u64,
    /// Writes seen per buffer (the validity of a [`SavedQkv`]).
    write_gen: Vec<u64>,
    /// Per saving attention's qkv buffer, the bf16 copy its forward made for the backward.
    saved_qkv: HashMap<BufferId, SavedQkv>,
    scratch: Buf,
    stats: EngineStats,
    last_tokens: Vec<i32>,
    last_targets: Vec<i32>,
    _arenas: Vec<Arena>,
    /// `(name, bytes)` of the plan's arenas and the engine's own, in allocation order.
    arenas: Vec<(String, usize)>,
    refresh_bytes: usize,
    profile: Option<ProfileRows>,
    /// The host eigensolver (the plan's, or one injected by `EngineOptions`).
    solver: Arc<dyn optim::HostEigensolver>,
    /// The attention kernels: the plan's option, `auto` resolved against the kernels that
    /// loaded.
    attention: AttentionKernel,
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
        // Memory before allocation: the plan's arenas alone (scratch and bf16 shadows come on
        // top) must fit the device's free memory, or the plan is refused before anything is
        // allocated.
        if let Ok((free, _total)) = dev.context().mem_get_info() {
            let planned = plan
                .memory
                .arenas
                .iter()
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
        let mut needs_shadow = vec![false; plan.buffers.len()];
        // f32 GEMM operands get a bf16 shadow under bf16 (bf16 plan buffers are read as they are).
        if precision == Precision::Bf16 {
            for o in plan.forward.iter().chain(&plan.backward) {
                if let Op::MatMul { a, b, .. } | Op::MatMulBias { a, b, .. } = o {
                    for id in [a, b] {
                        needs_shadow[id.index()] = plan.buffer(*id).dtype == DType::F32;
                    }
                }
            }
        }
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
        for a in &plan.memory.arenas {
            if a.bytes == 0 {
                continue;
            }
            let arena = dev
                .arena(a.kind.name(), Tier::Device, a.bytes)
                .map_err(|err| {
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

        // The bf16 qkv copies of the saving attentions (plan `Attention { lse: Some(..) }`).
        let mut saved_qkv = HashMap::new();
        let mut saved_arena = None;
        let want: Vec<(BufferId, usize)> = plan
            .forward
            .iter()
            .filter_map(|o| match o {
                Op::Attention {
                    qkv, lse: Some(_), ..
                } => Some((*qkv, plan.buffer(*qkv).numel())),
                _ => None,
            })
            .collect();
        if !want.is_empty() {
            let bytes: usize = want.iter().map(|(_, n)| aligned(n * 2)).sum();
            let mut sa = dev
                .arena("attention-saved", Tier::Device, bytes)
                .map_err(e("allocating the attention-saved arena"))?;
            arenas.push(("attention-saved".to_string(), bytes));
            for (qkv, n) in want {
                if saved_qkv.contains_key(&qkv) {
                    continue;
                }
                let qkv16 = sa
                    .buf(Elem::BF16, n)
                    .map_err(e("carving a saved bf16 qkv"))?;
                saved_qkv.insert(qkv, SavedQkv { qkv16, gen: None });
            }
            saved_arena = Some(sa);
        }

        // Refresh machinery: refreshers, swap buffers, shadows of asynchronous tasks.
        let refreshes = tasks::Refreshes::new(&dev, &plan, &opts.engine)?;
        let solver = opts.engine.solver(&plan)?;
        let profile = (opts.profile != Profile::Off).then(|| ProfileRows {
            events: opts.profile == Profile::Events,
            rows: Default::default(),
        });
        let refresh_bytes = refreshes.bytes;

        let tasks = plan.host_tasks.len();
        let n_bufs = plan.buffers.len();
        let mut eng = CudaEngine {
            dev,
            opts,
            precision,
            bufs,
            shadows,
            shadow_fresh: vec![false; n_bufs],
            shadow_casts: 0,
            write_gen: vec![0; n_bufs],
            saved_qkv,
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
            profile,
            attention,
            solver,
            plan,
        };
        eng.init_buffers()?;
        Ok(eng)
    }

    /// The CPU engine's initialisation (`engine::CpuEngine::new`), on the host, uploaded.
    fn init_buffers(&mut self) -> Result<(), EngineError> {
        let e = |err: CudaError| cuda_err("initialising buffers", err);
        let mut rng = Rng::new(self.opts.engine.seed.unwrap_or(self.plan.train.seed));
        for (b, buf) in self.plan.buffers.iter().zip(&self.bufs) {
            match (b.init, b.dtype) {
                (Init::Zeros, _) => self.dev.zero(buf).map_err(e)?,
                (Init::Ones, DType::F32) => {
                    self.dev.upload(buf, &vec![1.0f32; b.numel()]).map_err(e)?
                }
                (Init::Ones, DType::I32) => {
                    self.dev.upload(buf, &vec![1i32; b.numel()]).map_err(e)?
                }
                (Init::Normal { std }, DType::F32) => {
                    let v: Vec<f32> = (0..b.numel())
                        .map(|_| (std * rng.normal()) as f32)
                        .collect();
                    self.dev.upload(buf, &v).map_err(e)?
                }
                (Init::Normal { std }, DType::I32) => {
                    let v: Vec<i32> = (0..b.numel())
                        .map(|_| (std * rng.normal()).round() as i32)
                        .collect();
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

    /// The per-op table of `--profile`, largest GPU time first; empty without it.
    /// `--profile ops`: every op is synchronized before and after, so "GPU ms" is
    /// its wall time including launch overhead (slower steps). `--profile events`:
    /// no host syncs inside a program; CUDA events on the compute stream around each op give
    /// its GPU time, "host ms" the time the engine thread spent enqueueing it, and a
    /// `SECTION/(GPU idle)` row per program the time the compute stream sat idle between its
    /// ops (waiting for the host to enqueue them).
    pub fn profile_table(&self) -> String {
        let Some(p) = &self.profile else {
            return String::new();
        };
        let mut rows: Vec<_> = p.rows.iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let total: f64 = rows.iter().map(|r| r.1 .1).sum();
        let mut s = String::from(
            "| op (section/name) | calls | GPU ms | host ms | share |\n|---|---|---|---|---|\n",
        );
        for (k, (n, ms, host)) in rows {
            s += &format!(
                "| {k} | {n} | {ms:.1} | {host:.1} | {:.1}% |\n",
                100.0 * ms / total.max(1e-9)
            );
        }
        s += &format!("| total | | {total:.1} | | |\n");
        s
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
        let b = &self.bufs[id.index()];
        let e = |err| cuda_err("download", err);
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
        let id = self.id(name)?;
        let expected = self.plan.buffer(id).numel();
        if values.len() != expected {
            return Err(EngineError::Length {
                buffer: name.to_string(),
                expected,
                got: values.len(),
            });
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

    fn b(&self, id: BufferId) -> &Buf {
        &self.bufs[id.index()]
    }

    fn dims(&self, id: BufferId) -> (usize, usize) {
        dims2(&self.plan.buffer(id).shape)
    }

    /// The bf16 copy of buffer `id`, cast now unless still fresh.
    fn shadow(&mut self, id: BufferId) -> Result<Buf, CudaError> {
        let s = self.shadows[id.index()].clone().ok_or(CudaError::Invalid {
            op: "mat_mul",
            what: format!("buffer {id} has no bf16 shadow"),
        })?;
        if !self.shadow_fresh[id.index()] {
            gemm::cast_f32_to_bf16(&self.dev, &self.bufs[id.index()], &s)?;
            self.shadow_fresh[id.index()] = true;
            self.shadow_casts += 1;
        }
        Ok(s)
    }

    /// Buffer `id` as a bf16 GEMM operand: a bf16 plan buffer itself, else its shadow.
    fn gemm_operand(&mut self, id: BufferId) -> Result<Buf, CudaError> {
        match self.bufs[id.index()].elem() {
            Elem::BF16 => Ok(self.bufs[id.index()].clone()),
            _ => self.shadow(id),
        }
    }

    /// Whether both operands can be read in bf16 (a bf16 plan buffer or a shadow).
    fn bf16_operands(&self, a: BufferId, b: BufferId) -> bool {
        let ok = |id: BufferId| {
            self.bufs[id.index()].elem() == Elem::BF16 || self.shadows[id.index()].is_some()
        };
        self.precision == Precision::Bf16 && ok(a) && ok(b)
    }

    /// Runs one op; `Ok(Some(norm))` from a `ClipGradNorm`.
    fn exec(&mut self, op: &Op, t: u64, lr_mult: f64) -> Result<Option<f64>, CudaError> {
        // A written buffer's bf16 shadow is stale (the same read/write classification the
        // memory planner uses: `schedule::Op::accesses`).
        for (_, id, access) in op.accesses() {
            if access.writes() {
                self.shadow_fresh[id.index()] = false;
                self.write_gen[id.index()] += 1;
            }
        }
        let dev = &self.dev;
        let s = &self.scratch;
        match op {
            Op::Embedding { table, ids, out } => {
                let (v, c) = self.dims(*table);
                nn::embedding_forward(dev, self.b(*table), self.b(*ids), self.b(*out), v, c)?;
            }
            Op::EmbeddingBackward { dout, ids, dtable } => {
                let (v, c) = self.dims(*dtable);
                nn::embedding_backward(dev, self.b(*dout), self.b(*ids), self.b(*dtable), v, c)?;
            }
            Op::AddPositional {
                x,
                pos,
                out,
                seq_len,
            } => {
                let c = self.dims(*x).1;
                nn::add_positional(dev, self.b(*x), self.b(*pos), self.b(*out), c, *seq_len)?;
            }
            Op::AddPositionalBackward {
                dout,
                dpos,
                seq_len,
            } => {
                let c = self.dims(*dout).1;
                nn::add_positional_backward(dev, self.b(*dout), self.b(*dpos), c, *seq_len)?;
            }
            Op::LayerNorm {
                x,
                weight,
                bias,
                out,
                eps,
            } if self.b(*out).elem() == Elem::BF16 => {
                let c = self.dims(*x).1;
                let bias = bias.map(|b| self.b(b));
                nn::layernorm_forward_bf16(
                    dev,
                    self.b(*x),
                    self.b(*weight),
                    bias,
                    self.b(*out),
                    c,
                    *eps,
                )?;
            }
            Op::LayerNorm {
                x,
                weight,
                bias,
                out,
                eps,
            } => {
                let c = self.dims(*x).1;
                let bias = bias.map(|b| self.b(b));
                nn::layernorm_forward(
                    dev,
                    self.b(*x),
                    self.b(*weight),
                    bias,
                    self.b(*out),
                    c,
                    *eps,
                )?;
            }
            Op::LayerNormBackward {
                dout,
                x,
                weight,
                dx,
                dweight,
                dbias,
                eps,
            } => {
                let c = self.dims(*x).1;
                let dbias = dbias.map(|b| self.b(b));
                nn::layernorm_backward(
                    dev,
                    self.b(*dout),
                    self.b(*x),
                    self.b(*weight),
                    self.b(*dx),
                    self.b(*dweight),
                    dbias,
                    c,
                    *eps,
                    s,
                )?;
            }
            Op::RmsNorm {
                x,
                weight,
                out,
                eps,
            } => {
                let c = self.dims(*x).1;
                nn::rmsnorm_forward(dev, self.b(*x), self.b(*weight), self.b(*out), c, *eps)?;
            }
            Op::RmsNormBackward {
                dout,
                x,
                weight,
                dx,
                dweight,
                eps,
            } => {
                let c = self.dims(*x).1;
                nn::rmsnorm_backward(
                    dev,
                    self.b(*dout),
                    self.b(*x),
                    self.b(*weight),
                    self.b(*dx),
                    self.b(*dweight),
                    c,
                    *eps,
                    s,
                )?;
            }
            Op::MatMul {
                a,
                b,
                out,
                trans_a,
                trans_b,
                accumulate,
            } => {
                let (ar, ac) = self.dims(*a);
                let (br, bc) = self.dims(*b);
                let (ad, bd) = (Dims::new(ar, ac), Dims::new(br, bc));
                if self.bf16_operands(*a, *b) {
                    let (sa, sb) = (self.gemm_operand(*a)?, self.gemm_operand(*b)?);
                    let out = self.b(*out);
                    gemm::matmul_bf16(
                        &self.dev,
                        &sa,
                        ad,
                        &sb,
                        bd,
                        out,
                        *trans_a,
                        *trans_b,
                        *accumulate,
                    )?;
                } else {
                    let (a, b, out) = (self.b(*a), self.b(*b), self.b(*out));
                    gemm::matmul(dev, a, ad, b, bd, out, *trans_a, *trans_b, *accumulate)?;
                }
            }
            Op::MatMulBias {
                a,
                b,
                bias,
                out,
                trans_a,
                trans_b,
            } => {
                let (ar, ac) = self.dims(*a);
                let (br, bc) = self.dims(*b);
                let (ad, bd) = (Dims::new(ar, ac), Dims::new(br, bc));
                let bf16 = self.bf16_operands(*a, *b);
                if bf16 && gemm::has_fused_bias(&self.dev) {
                    let (sa, sb) = (self.gemm_operand(*a)?, self.gemm_operand(*b)?);
                    gemm::gemm_bf16_bias(
                        &self.dev,
                        &sa,
                        ad,
                        &sb,
                        bd,
                        self.b(*bias),
                        self.b(*out),
                        *trans_a,
                        *trans_b,
                    )?;
                } else {
                    // The product, then the bias added in place (the unfused pair's math):
                    // under fp32, or where cuBLASLt did not load.
                    if bf16 {
                        let (sa, sb) = (self.gemm_operand(*a)?, self.gemm_operand(*b)?);
                        gemm::matmul_bf16(
                            &self.dev,
                            &sa,
                            ad,
                            &sb,
                            bd,
                            self.b(*out),
                            *trans_a,
                            *trans_b,
                            false,
                        )?;
                    } else {
                        let (a, b, o) = (self.b(*a), self.b(*b), self.b(*out));
                        gemm::matmul(dev, a, ad, b, bd, o, *trans_a, *trans_b, false)?;
                    }
                    let c = self.dims(*out).1;
                    let o = self.b(*out);
                    nn::bias_add(&self.dev, o, self.b(*bias), o, c)?;
                }
            }
            Op::BiasAdd { x, bias, out } => {
                let c = self.dims(*x).1;
                nn::bias_add(dev, self.b(*x), self.b(*bias), self.b(*out), c)?;
            }
            Op::SumRows { x, out } => {
                let c = self.dims(*x).1;
                nn::sum_rows(dev, self.b(*x), self.b(*out), c, s)?;
            }
            Op::Add { a, b, out } => nn::add(dev, self.b(*a), self.b(*b), self.b(*out))?,
            Op::Gelu { x, out } if self.b(*out).elem() == Elem::BF16 => {
                nn::gelu_forward_bf16(dev, self.b(*x), self.b(*out))?;
            }
            Op::Gelu { x, out } => nn::gelu_forward(dev, self.b(*x), self.b(*out))?,
            Op::GeluBackward { dout, x, dx } => {
                nn::gelu_backward(dev, self.b(*dout), self.b(*x), self.b(*dx))?
            }
            Op::SwiGlu { x, out } => {
                let f = self.dims(*out).1;
                nn::swiglu_forward(dev, self.b(*x), self.b(*out), f)?;
            }
            Op::SwiGluBackward { dout, x, dx } => {
                let f = self.dims(*dout).1;
                nn::swiglu_backward(dev, self.b(*dout), self.b(*x), self.b(*dx), f)?;
            }
            Op::Rope {
                x,
                out,
                seq_len,
                head_dim,
                rotated_cols,
                theta,
            } => {
                let d = nn::RopeDims {
                    width: self.dims(*x).1,
                    seq_len: *seq_len,
                    head_dim: *head_dim,
                    rotated_cols: *rotated_cols,
                    theta: *theta,
                };
                nn::rope_forward(dev, self.b(*x), self.b(*out), &d)?;
            }
            Op::RopeBackward {
                dout,
                dx,
                seq_len,
                head_dim,
                rotated_cols,
                theta,
            } => {
                let d = nn::RopeDims {
                    width: self.dims(*dout).1,
                    seq_len: *seq_len,
                    head_dim: *head_dim,
                    rotated_cols: *rotated_cols,
                    theta: *theta,
                };
                nn::rope_backward(dev, self.b(*dout), self.b(*dx), &d)?;
            }
            Op::Attention {
                qkv,
                out,
                lse,
                batch,
                seq_len,
                n_heads,
            } => {
                let d = attn_dims(*batch, *seq_len, *n_heads, self.dims(*qkv).1);
                let math = flash_math(self.attention, &d, self.precision);
                let qkv16 = self.saved_qkv.get(qkv).map(|sv| sv.qkv16.clone());
                match (lse, qkv16, math) {
                    // A saving forward: lse into its plan buffer, the bf16 qkv into the cache.
                    (Some(lse), Some(qkv16), Some(at::FlashMath::Bf16)) => {
                        let sv = at::FlashSaved {
                            lse: self.b(*lse),
                            qkv16: &qkv16,
                        };
                        at::flash_attention_forward_saving(
                            dev,
                            self.b(*qkv),
                            self.b(*out),
                            &d,
                            s,
                            &sv,
                        )?;
                        let gen = self.write_gen[qkv.index()];
                        if let Some(sv) = self.saved_qkv.get_mut(qkv) {
                            sv.gen = Some(gen);
                        }
                    }
                    (Some(_), ..) => {
                        return Err(CudaError::Invalid {
                            op: "attention",
                            what: "a saving attention (`lse`) needs the tensor-core kernels".into(),
                        })
                    }
                    (None, _, Some(math)) => {
                        at::flash_attention_forward(dev, self.b(*qkv), self.b(*out), &d, s, math)?
                    }
                    (None, _, None) => {
                        at::attention_forward(dev, self.b(*qkv), self.b(*out), &d, s)?
                    }
                }
            }
            Op::AttentionBackward {
                dout,
                qkv,
                fwd_out,
                lse,
                dqkv,
                batch,
                seq_len,
                n_heads,
            } => {
                let d = attn_dims(*batch, *seq_len, *n_heads, self.dims(*qkv).1);
                let math = flash_math(self.attention, &d, self.precision);
                // The forward's bf16 qkv, if made from the qkv these buffers hold now.
                let qkv16 = self
                    .saved_qkv
                    .get(qkv)
                    .filter(|sv| sv.gen == Some(self.write_gen[qkv.index()]))
                    .map(|sv| sv.qkv16.clone());
                let saved = match (fwd_out, lse, qkv16, math) {
                    (Some(o), Some(l), Some(q16), Some(at::FlashMath::Bf16)) => {
                        Some((self.gemm_operand(*o)?, *l, q16))
                    }
                    _ => None,
                };
                let (dev, s) = (&self.dev, &self.scratch);
                let (g, q, dq) = (self.b(*dout), self.b(*qkv), self.b(*dqkv));
                if let Some((o16, l, q16)) = saved {
                    let fs = at::FlashSaved {
                        lse: self.b(l),
                        qkv16: &q16,
                    };
                    at::flash_attention_backward_saved(dev, g, dq, &d, s, &fs, &o16)?;
                } else if let Some(math) = math {
                    at::flash_attention_backward(dev, g, q, dq, &d, s, math)?;
                } else {
                    at::attention_backward(dev, g, q, dq, &d, s)?;
                }
            }
            Op::CrossEntropy {
                logits,
                targets,
                loss: l,
            } => {
                let v = self.dims(*logits).1;
                loss::cross_entropy_forward(
                    dev,
                    self.b(*logits),
                    self.b(*targets),
                    self.b(*l),
                    v,
                    s,
                )?;
            }
            Op::CrossEntropyBackward {
                logits,
                targets,
                dlogits,
            } if self.b(*dlogits).elem() == Elem::BF16 => {
                let v = self.dims(*logits).1;
                loss::cross_entropy_backward_bf16(
                    dev,
                    self.b(*logits),
                    self.b(*targets),
                    self.b(*dlogits),
                    v,
                )?;
            }
            Op::CrossEntropyBackward {
                logits,
                targets,
                dlogits,
            } => {
                let v = self.dims(*logits).1;
                loss::cross_entropy_backward(
                    dev,
                    self.b(*logits),
                    self.b(*targets),
                    self.b(*dlogits),
                    v,
                )?;
            }
            Op::ClipGradNorm {
                grads,
                norm,
                max_norm,
            } => {
                let gs: Vec<&Buf> = grads.iter().map(|g| self.b(*g)).collect();
                loss::clip_grad_norm(dev, &gs, self.b(*norm), *max_norm, s)?;
                let v = dev.download::<f32>(self.b(*norm))?;
                return Ok(Some(v.first().map_or(f64::NAN, |&x| f64::from(x))));
            }
            Op::AdamW {
                param,
                grad,
                exp_avg,
                exp_avg_sq,
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let st = op::AdamWStep {
                    t,
                    lr: lr * lr_mult,
                    beta1: *beta1,
                    beta2: *beta2,
                    eps: *eps,
                    weight_decay: *weight_decay,
                };
                op::adamw(
                    dev,
                    &st,
                    self.b(*param),
                    self.b(*grad),
                    self.b(*exp_avg),
                    self.b(*exp_avg_sq),
                )?;
            }
            Op::SoapUpdate {
                param,
                grad,
                exp_avg,
                exp_avg_sq,
                basis_left,
                basis_right,
                hyper,
            } => {
                let (m, n) = self.dims(*param);
                let proj = CudaEngine::soap_projections(self.precision);
                let mut cached = [None, None];
                if proj == op::SoapProjections::Bf16 {
                    for (slot, q) in cached.iter_mut().zip([basis_left, basis_right]) {
                        if let Some(q) = q.filter(|q| self.shadows[q.index()].is_some()) {
                            *slot = Some(self.shadow(q)?);
                        }
                    }
                }
                let (dev, s) = (&self.dev, &self.scratch);
                op::soap_update(
                    dev,
                    t,
                    hyper.lr * lr_mult,
                    hyper,
                    self.b(*param),
                    self.b(*grad),
                    self.b(*exp_avg),
                    self.b(*exp_avg_sq),
                    basis_left.map(|q| self.b(q)),
                    basis_right.map(|q| self.b(q)),
                    m,
                    n,
                    s,
                    proj,
                    [cached[0].as_ref(), cached[1].as_ref()],
                )?;
            }
            Op::SoapFactorUpdate {
                grad,
                factor_left,
                factor_right,
                shampoo_beta,
            } => {
                let (m, n) = self.dims(*grad);
                op::soap_factor_update(
                    dev,
                    self.b(*grad),
                    factor_left.map(|f| self.b(f)),
                    factor_right.map(|f| self.b(f)),
                    m,
                    n,
                    *shampoo_beta,
                    s,
                    CudaEngine::soap_projections(self.precision),
                )?;
            }
        }
        Ok(None)
    }

    /// Runs one program; `false` when a non-finite gradient norm cut it short.
    fn run(&mut self, section: &'static str, t: u64, lr_mult: f64) -> Result<bool, EngineError> {
        let program = match section {
            "forward" => std::mem::take(&mut self.plan.forward),
            "backward" => std::mem::take(&mut self.plan.backward),
            _ => std::mem::take(&mut self.plan.optimizer),
        };
        let math = match (section, self.precision) {
            (_, Precision::Fp32) => GemmMath::Fp32,
            ("optimizer", Precision::Bf16) => GemmMath::Tf32,
            (_, Precision::Bf16) => GemmMath::Bf16,
        };
        // The fast mode of the plan MatMuls goes through the same device switch.
        let prev = self.dev.set_gemm_math(math);
        let mut result = Ok(true);
        let events = self.profile.as_ref().is_some_and(|p| p.events);
        let mut timeline: Vec<(String, CudaEvent, CudaEvent, f64)> = Vec::new();
        for (index, op) in program.iter().enumerate() {
            let started = self.profile.is_some().then(|| {
                if !events {
                    let _ = self.dev.synchronize();
                }
                let ev = events
                    .then(|| self.dev.record(StreamKind::Compute, true).ok())
                    .flatten();
                (Instant::now(), ev)
            });
            let casts_before = self.shadow_casts;
            let outcome = self.exec(op, t, lr_mult);
            if let Some((t0, ev0)) = started {
                let host_ms = t0.elapsed().as_secs_f64() * 1e3;
                let casts = self.shadow_casts - casts_before;
                let cast_note = if casts > 0 {
                    format!(" +{casts} cast")
                } else {
                    String::new()
                };
                let key = format!(
                    "{section}/{}{}{cast_note}",
                    op.name(),
                    self.profile_shape(op)
                );
                match ev0 {
                    Some(ev0) => {
                        if let Ok(ev1) = self.dev.record(StreamKind::Compute, true) {
                            timeline.push((key, ev0, ev1, host_ms));
                        }
                    }
                    None => {
                        let _ = self.dev.synchronize();
                        let ms = t0.elapsed().as_secs_f64() * 1e3;
                        if let Some(p) = self.profile.as_mut() {
                            let e = p.rows.entry(key).or_insert((0, 0.0, 0.0));
                            e.0 += 1;
                            e.1 += ms;
                            e.2 += host_ms;
                        }
                    }
                }
            }
            match outcome {
                Ok(None) => {}
                Ok(Some(norm)) => {
                    self.stats.last_grad_norm = Some(norm);
                    if !norm.is_finite() {
                        self.stats.skipped_steps += 1;
                        tracing::warn!(
                            step = t,
                            grad_norm = norm,
                            "non-finite gradient norm: skipping the optimizer update of this step"
                        );
                        result = Ok(false);
                        break;
                    }
                }
                Err(err) => {
                    result = Err(cuda_err(
                        &format!("{section}[{index}] ({})", op.name()),
                        err,
                    ));
                    break;
                }
            }
        }
        self.dev.set_gemm_math(prev);
        if !timeline.is_empty() {
            self.profile_timeline(section, &timeline);
        }
        match section {
            "forward" => self.plan.forward = program,
            "backward" => self.plan.backward = program,
            _ => self.plan.optimizer = program,
        }
        result
    }

    /// A refresh swap wrote basis `id`: its bf16 shadow (SOAP's bf16 projections) is stale.
    pub(crate) fn basis_changed(&mut self, id: BufferId) {
        self.shadow_fresh[id.index()] = false;
    }

    /// GEMM math of the swap's moment re-projection: the optimizer program's (TF32 under
    /// `precision = bf16`, fp32 under `precision = fp32`).
    pub(crate) fn swap_math(&self) -> GemmMath {
        match self.precision {
            Precision::Bf16 => GemmMath::Tf32,
            Precision::Fp32 => GemmMath::Fp32,
        }
    }

    /// The projections of `SoapUpdate`: bf16 operands under `precision = bf16`, fp32 operands
    /// (plain fp32 GEMMs) under `precision = fp32`.
    fn soap_projections(precision: Precision) -> op::SoapProjections {
        match precision {
            Precision::Bf16 => op::SoapProjections::Bf16,
            Precision::Fp32 => op::SoapProjections::Fp32Storage,
        }
    }

    /// Optimizer ops are profiled per parameter shape (` 768x3072`), GEMMs per operand shapes
    /// and transposes (` 16384x768·768x2304ᵀ`), others by name only.
    fn profile_shape(&self, op: &Op) -> String {
        match op {
            Op::MatMul {
                a,
                b,
                trans_a,
                trans_b,
                ..
            } => {
                let (ar, ac) = self.dims(*a);
                let (br, bc) = self.dims(*b);
                let t = |x: bool| if x { "ᵀ" } else { "" };
                format!(" {ar}x{ac}{}·{br}x{bc}{}", t(*trans_a), t(*trans_b))
            }
            Op::MatMulBias {
                a,
                b,
                trans_a,
                trans_b,
                ..
            } => {
                let (ar, ac) = self.dims(*a);
                let (br, bc) = self.dims(*b);
                let t = |x: bool| if x { "ᵀ" } else { "" };
                format!(" {ar}x{ac}{}·{br}x{bc}{} +bias", t(*trans_a), t(*trans_b))
            }
            Op::SoapUpdate { grad, .. } | Op::SoapFactorUpdate { grad, .. } => {
                let shape: Vec<String> = self
                    .plan
                    .buffer(*grad)
                    .shape
                    .iter()
                    .map(|d| d.to_string())
                    .collect();
                format!(" {}", shape.join("x"))
            }
            _ => String::new(),
        }
    }

    /// Waits for the program's events and adds each op's GPU time, and the compute stream's
    /// idle time between the first and the last op, to the profile.
    fn profile_timeline(
        &mut self,
        section: &str,
        timeline: &[(String, CudaEvent, CudaEvent, f64)],
    ) {
        let (Some(first), Some(last)) = (timeline.first(), timeline.last()) else {
            return;
        };
        if last.2.synchronize().is_err() {
            return;
        }
        let Some(p) = self.profile.as_mut() else {
            return;
        };
        let mut busy = 0.0f64;
        for (key, ev0, ev1, host_ms) in timeline {
            let ms = ev0.elapsed_ms(ev1).unwrap_or(0.0) as f64;
            busy += ms;
            let e = p.rows.entry(key.clone()).or_insert((0, 0.0, 0.0));
            e.0 += 1;
            e.1 += ms;
            e.2 += host_ms;
        }
        let span = first.1.elapsed_ms(&last.2).unwrap_or(0.0) as f64;
        let e = p
            .rows
            .entry(format!("{section}/(GPU idle)"))
            .or_insert((0, 0.0, 0.0));
        e.0 += 1;
        e.1 += (span - busy).max(0.0);
    }

    /// Turns the device status word into the CPU engine's error, naming row and value.
    fn check_status(&self) -> Result<(), EngineError> {
        match self.dev.take_status() {
            Ok(()) => Ok(()),
            Err(CudaError::IndexOutOfRange { position }) => {
                let p = position.max(0) as usize;
                let vocab = self
                    .plan
                    .forward
                    .iter()
                    .find_map(|o| match o {
                        Op::Embedding { table, .. } => Some(self.dims(*table).0),
                        _ => None,
                    })
                    .unwrap_or(0);
                let (what, value) = match self.last_tokens.get(p) {
                    Some(&v) if v < 0 || v as usize >= vocab => ("token id", v),
                    _ => ("target", self.last_targets.get(p).copied().unwrap_or(-1)),
                };
                Err(EngineError::IndexOutOfRange {
                    op: if what == "token id" {
                        "embedding"
                    } else {
                        "cross_entropy"
                    },
                    what,
                    position: p,
                    value: i64::from(value),
                    bound: vocab,
                })
            }
            Err(e) => Err(cuda_err("status", e)),
        }
    }
}

impl StepExecutor for CudaEngine {
    fn plan(&self) -> &Plan {
        &self.plan
    }

    fn load_batch(&mut self, tokens: &[i32], targets: &[i32]) -> Result<(), EngineError> {
        for (id, values) in [
            (self.plan.data.tokens, tokens),
            (self.plan.data.targets, targets),
        ] {
            let expected = self.plan.buffer(id).numel();
            if values.len() != expected {
                return Err(EngineError::Length {
                    buffer: self.plan.buffer(id).name.clone(),
                    expected,
                    got: values.len(),
                });
            }
            self.dev
                .upload(self.b(id), values)
                .map_err(|e| cuda_err("load_batch", e))?;
            self.shadow_fresh[id.index()] = false;
            self.write_gen[id.index()] += 1;
        }
        self.last_tokens.clear();
        self.last_tokens.extend_from_slice(tokens);
        self.last_targets.clear();
        self.last_targets.extend_from_slice(targets);
        Ok(())
    }

    fn forward(&mut self) -> Result<f64, EngineError> {
        self.run("forward", 0, 1.0)?;
        self.check_status()?;
        let v = self
            .dev
            .download::<f32>(self.b(self.plan.loss))
            .map_err(|e| cuda_err("reading the loss", e))?;
        Ok(v.first().map_or(f64::NAN, |&x| f64::from(x)))
    }

    fn backward(&mut self) -> Result<(), EngineError> {
        self.run("backward", 0, 1.0).map(|_| ())
    }

    fn optimizer_step(&mut self, t: u64, lr_multiplier: f64) -> Result<bool, EngineError> {
        self.run("optimizer", t.max(1), lr_multiplier)
    }

    fn run_host_tasks(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        self.host_tasks(t)
    }

    fn stats(&self) -> &EngineStats {
        &self.stats
    }

    fn describe(&self) -> String {
        let i = self.dev.info();
        format!(
            "cuda:{} {} ({}), attention kernels {}, profile {}",
            i.ordinal, i.name, i.arch, self.attention, self.opts.profile
        )
    }

    /// The end of a step: the compute and copy streams (side-stream refreshes run on; their
    /// results are waited for by event at the swap).
    fn synchronize(&mut self) -> Result<(), EngineError> {
        self.dev
            .synchronize_step()
            .map_err(|e| cuda_err("synchronize", e))
    }
}

impl Drop for CudaEngine {
    /// Side-stream refreshes may still be running when the engine goes (the end of a step no
    /// longer waits for them): wait for the whole device before the fields go. (The
    /// launcher thread, joined when the refreshes drop, also waits for the side stream before
    /// it destroys its cuSOLVER handle; every buffer's own drop synchronises the context.)
    fn drop(&mut self) {
        let _ = self.dev.synchronize();
    }
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
        assert_eq!(schedule::BF16_LAYERNORM_MAX_C, nn::LAYERNORM_WARP_MAX_C);
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
