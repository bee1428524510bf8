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
//!   (head dim ≤ 128, `wgmma` kernels on compute capability 9.0 and `mma.sync` elsewhere, see
//!   [`crate::FlashKernels`]; wider heads the GEMM path in bf16; the plan's `attention` option,
//!   [`flash_math`]), SOAP's per-step GEMMs
//!   (factor accumulation, projections) on bf16 operands ([`op::SoapProjections`]) and the
//!   moment re-projection of a refresh swap and KL-Shampoo's update GEMMs
//!   ([`crate::ops::kl_shampoo`], fp32 operands) on TF32 tensor cores. Master weights, moments,
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
//!
//! Layout: this file holds the engine, the program runner and the [`engine::StepExecutor`]
//! glue; construction, buffer initialisation and the buffer accessors are in `setup`, the op
//! dispatch in `exec`, `--profile` in `profile`, host tasks in `tasks` (their host-side
//! computations and installs in `host_refresh`).
use crate::device::{Device, GemmMath};
use crate::error::CudaError;
use crate::memory::{Arena, Buf};
use crate::ops::{attention as at, optim as op};
use crate::StreamKind;
use cudarc::driver::CudaEvent;
use engine::{EngineError, EngineOptions, EngineStats, HostTaskReport, StepExecutor};
use schedule::{AttentionKernel, BufferId, Op, Plan, Precision, Profile};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

mod copies;
mod exec;
pub mod gpu_trace;
mod host_refresh;
mod host_updates;
mod nvme_tier;
mod profile;
mod setup;
mod side_launcher;
mod tasks;

use profile::ProfileRows;

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
    /// Its slot in [`CudaEngine::saved_slots`].
    slot: usize,
}

/// One slot of the attention-saved arena, shared by qkv copies live at disjoint times.
struct SavedSlot {
    qkv16: Buf,
    /// The qkv whose copy the slot holds, and that qkv's write generation when it was made.
    holds: Option<(BufferId, u64)>,
}

/// Options of a [`CudaEngine`] that are not part of the plan: everything here changes how a
/// run is observed or which device runs it, never what it computes (the plan's
/// [`TargetPlan::Cuda`](schedule::TargetPlan::Cuda) options do that).
#[derive(Clone, Debug, Default)]
pub struct CudaOptions {
    /// Seed override, injected eigensolver and refresh failure limit, as for the CPU engine.
    pub engine: EngineOptions,
    /// Device ordinal; `None` = the plan's.
    pub device: Option<usize>,
    /// Per-op GPU timing (`--profile`), printed by [`CudaEngine::profile_table`].
    pub profile: Profile,
    /// Record every op's and side-stream refresh's GPU time span for `--trace`
    /// ([`CudaEngine::take_gpu_trace`]).
    pub trace: bool,
}

fn cuda_err(where_: &str, e: CudaError) -> EngineError {
    match e {
        // An NVMe tier failure (checksum, truncated file, full disk) is the CPU engine's
        // `EngineError::Tier`, wherever it surfaces (a refresh swap, a host install).
        CudaError::Tier { what } => EngineError::Tier(format!("{where_}: {what}")),
        e => EngineError::Unsupported(format!("CUDA backend, {where_}: {e}")),
    }
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

fn attn_dims(batch: usize, seq_len: usize, n_heads: usize, qkv_cols: usize) -> at::AttnDims {
    at::AttnDims {
        batch,
        seq_len,
        n_heads,
        channels: qkv_cols / 3,
    }
}

/// The CUDA interpreter of a [`Plan`]. See the module docs.
pub struct CudaEngine {
    plan: Plan,
    // Dropped before the buffers: its worker writes pinned host memory of `bufs`.
    /// The worker of the plan's host-placed `adam_w` updates (`host_updates`); `None` without.
    host_updates: Option<host_updates::HostUpdates>,
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
    /// The attention-saved arena's slots.
    saved_slots: Vec<SavedSlot>,
    scratch: Buf,
    stats: EngineStats,
    last_tokens: Vec<i32>,
    last_targets: Vec<i32>,
    _arenas: Vec<Arena>,
    /// `(name, bytes)` of the plan's arenas and the engine's own, in allocation order.
    arenas: Vec<(String, usize)>,
    refresh_bytes: usize,
    /// Device bytes reserved on the device before this engine allocated anything (another
    /// engine's or a self-test's; not counted against this plan's `gpu_memory`).
    reserved_before: usize,
    /// Samples the driver's used memory every 10 ms into the reported peak while the engine
    /// lives (`None` when the thread could not start: the peak is then sampled at
    /// allocations and reports only).
    _peak_sampler: Option<crate::device::PeakSampler>,
    profile: Option<ProfileRows>,
    /// Events and waits of the tier copies on the copy streams ([`copies::CopyOrder`]).
    copy_order: copies::CopyOrder,
    /// This step's events by step position (what [`copies::CopyOrder::record_after`] asks).
    copy_events: Vec<Option<CudaEvent>>,
    /// The optimizer program of this step stopped early (a skipped step): its end waits for
    /// every copy out even when they are carried (`copies::CopyOrder::carried`).
    cut_step: bool,
    /// The host eigensolver (the plan's, or one injected by `EngineOptions`).
    solver: Arc<dyn optim::HostEigensolver>,
    /// The attention kernels: the plan's option, `auto` resolved against the kernels that
    /// loaded.
    attention: AttentionKernel,
    /// The GPU's energy through NVML (`None` where NVML or its readings are missing).
    energy: Option<crate::energy::EnergyMeter>,
    /// The streams' timeline for `--trace` (`None` without it).
    gpu_trace: Option<gpu_trace::GpuTrace>,
    /// The plan's NVMe tier (`None` when it places nothing on NVMe); its buffers' entries in
    /// `bufs` are zero-length stand-ins ([`nvme_tier::NvmeTier::placeholder`]).
    nvme: Option<nvme_tier::NvmeTier>,
    /// The plan's element-wise update rules, compiled, by `ElementwiseRule::kernel_key`.
    update_kernels: HashMap<String, Arc<crate::ops::optim::UpdateKernel>>,
    /// The AdamW kernels of the plan's `AdamW` ops, one per set of constants
    /// (`schedule::adamw_kernel_key`).
    adamw_kernels: HashMap<[u64; 4], Arc<crate::ops::optim::AdamWKernel>>,
}

impl CudaEngine {
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
        // The first training step (and the evaluation before it) is warm-up: module loads and
        // cuBLASLt's heuristic queries (~4 ms per GEMM geometry) would land on their ops.
        let profiling = self.profile.as_ref().is_some_and(|p| p.warm);
        let mut timeline: Vec<(String, CudaEvent, CudaEvent, f64)> = Vec::new();
        for (index, op) in program.iter().enumerate() {
            let started = profiling.then(|| {
                if !events {
                    let _ = self.dev.synchronize();
                }
                let ev = events
                    .then(|| self.dev.record(StreamKind::Compute, true).ok())
                    .flatten();
                (Instant::now(), ev)
            });
            let casts_before = self.shadow_casts;
            let pos = self.copy_order.position(section, index);
            // A warm-up-only copy past its last step does nothing: nothing to wait for.
            let skipped = matches!(op, Op::CopyIn { last_step: Some(l), .. } if t > *l);
            let outcome = (if skipped {
                Ok(())
            } else {
                self.before_host_updates(pos)
            })
            .and_then(|()| self.order_copies(op, pos, true))
            .and_then(|()| {
                if op.on_host() {
                    self.submit_host_update(op, pos, (section, index), (t, lr_mult))
                        .map(|()| None)
                } else {
                    self.exec_traced(section, op, t, lr_mult)
                }
            })
            .and_then(|r| self.order_copies(op, pos, false).map(|()| r));
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
                Err(CudaError::Tier { what }) => {
                    result = Err(EngineError::Tier(format!(
                        "{section}[{index}] ({}): {what}",
                        op.name()
                    )));
                    break;
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
        if section == "optimizer" && !matches!(result, Ok(true)) {
            // Cut short (a skipped step, an error): its copies out stop at the break, so the
            // previous step's events of the later positions are older than the copies still
            // pending; the end of this step waits for the copy-out stream instead.
            self.cut_step = true;
        }
        if section == "optimizer" && self.copy_order.active && !self.copy_order.carried {
            // A refresh swap (compute stream, next) may re-project moments of the host tier:
            // it must see what the copy-out stream writes there.
            if let Err(e) = self.wait_last_copies() {
                result = result.and(Err(cuda_err("optimizer copies", e)));
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

    /// [`CudaEngine::exec`], between two timing events on the op's stream under `--trace`.
    fn exec_traced(
        &mut self,
        section: &str,
        op: &Op,
        t: u64,
        lr_mult: f64,
    ) -> Result<Option<f64>, CudaError> {
        let Some(tr) = self.gpu_trace.clone() else {
            return self.exec(op, t, lr_mult);
        };
        let stream = copies::stream_of(op);
        let start = gpu_trace::GpuTrace::mark(&self.dev, stream);
        let r = self.exec(op, t, lr_mult);
        if let (Some(start), Some(end)) = (start, gpu_trace::GpuTrace::mark(&self.dev, stream)) {
            let name = format!("{section}/{}{}", op.name(), self.profile_shape(op));
            tr.push(gpu_trace::stream_label(stream), name, start, end);
        }
        r
    }

    /// The GPU slices `--trace` recorded so far (every op on its stream, side-stream
    /// refreshes) and how many were dropped over [`gpu_trace::MAX_SLICES`]; empty without
    /// [`CudaOptions::trace`]. Drains them.
    pub fn take_gpu_trace(&mut self) -> (Vec<gpu_trace::GpuSlice>, u64) {
        match &self.gpu_trace {
            Some(tr) => {
                // The end of the run: let refreshes still running on the side stream finish,
                // so that their slices are complete.
                let _ = self.dev.synchronize();
                tr.flush(&self.dev);
                tr.take()
            }
            None => (Vec::new(), 0),
        }
    }

    /// The tier copies' stream ordering around the op at step position `pos`: before it
    /// (`before`), its stream waits for the events [`copies::CopyOrder`] names; after it, an
    /// event is recorded on its stream when a later op waits for it. Nothing when the plan has
    /// no copies.
    fn order_copies(&mut self, op: &Op, pos: usize, before: bool) -> Result<(), CudaError> {
        if !self.copy_order.active {
            return Ok(());
        }
        let stream = copies::stream_of(op);
        if before {
            // Copies out of the step before, still running (`carried_copy_outs`): their
            // events hold that step's record until this step issues them again. None before
            // the first step.
            for &q in &self.copy_order.cross_waits[pos] {
                if let Some(ev) = &self.copy_events[q] {
                    self.dev.wait(stream, ev)?;
                }
            }
            for &q in &self.copy_order.waits[pos] {
                let ev = self.copy_events[q]
                    .as_ref()
                    .ok_or_else(|| CudaError::Invalid {
                        op: op.name(),
                        what: format!(
                            "step position {pos} waits for position {q}, which recorded no event"
                        ),
                    })?;
                self.dev.wait(stream, ev)?;
            }
        } else if self.copy_order.record_after[pos] {
            self.copy_events[pos] = Some(self.dev.record(stream, false)?);
        }
        Ok(())
    }

    /// Waits for the host updates the op at step position `pos` must follow
    /// ([`host_updates::HostUpdates::before_op`]).
    fn before_host_updates(&mut self, pos: usize) -> Result<(), CudaError> {
        match self.host_updates.as_mut() {
            Some(h) => h.before_op(pos),
            None => Ok(()),
        }
    }

    /// Hands the host-placed update `op` (at `section[index]`, step position `pos`) to the
    /// host-update worker, after events on the streams that ran an earlier op touching its
    /// bytes ([`host_updates::HostUpdates::streams_before`]).
    fn submit_host_update(
        &mut self,
        op: &Op,
        pos: usize,
        (section, index): (&str, usize),
        t_lr: (u64, f64),
    ) -> Result<(), CudaError> {
        let Some(h) = self.host_updates.as_mut() else {
            return Err(CudaError::Invalid {
                op: op.name(),
                what: "a host-placed update, but the engine started no host-update worker".into(),
            });
        };
        let mut events = Vec::with_capacity(3);
        let needed = h.streams_before(pos);
        for (kind, needed) in [StreamKind::Compute, StreamKind::CopyIn, StreamKind::CopyOut]
            .into_iter()
            .zip(needed)
        {
            if needed {
                events.push(self.dev.record(kind, false)?);
            }
        }
        let param = match op {
            Op::AdamW { param, .. } => self.plan.buffer(*param).name.clone(),
            _ => String::new(),
        };
        let what = format!("{section}[{index}] ({}) `{param}`", op.name());
        h.submit(&self.plan, op, pos, what, &self.bufs, events, t_lr)
    }

    /// Every submitted host update finished and every copy out done: before state is read or
    /// written from outside the programs (`buffer`, `buffer_range`, `set_buffer`:
    /// checkpoints, export, a resume, a train-match), at the end of a run and when the engine
    /// goes. (Under `carried_copy_outs` the step's copies out may still be writing pinned
    /// host memory.)
    pub(crate) fn settle(&self) -> Result<(), EngineError> {
        if self.copy_order.carried {
            self.dev
                .synchronize_streams(&[StreamKind::CopyOut])
                .map_err(|e| cuda_err("copies out", e))?;
        }
        match &self.host_updates {
            Some(h) => h.join_all().map_err(|e| cuda_err("host updates", e)),
            None => Ok(()),
        }
    }

    /// Makes the compute stream wait for the step's last copy in and copy out.
    fn wait_last_copies(&self) -> Result<(), CudaError> {
        for &p in &self.copy_order.last_copies {
            if let Some(ev) = &self.copy_events[p] {
                self.dev.wait(StreamKind::Compute, ev)?;
            }
        }
        Ok(())
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

    fn backward(&mut self, micro: u64) -> Result<(), EngineError> {
        // `t` of the backward's ops: the micro-batch (`GradAccumulate` stores on 0, adds after).
        self.run("backward", micro, 1.0).map(|_| ())
    }

    fn optimizer_step(&mut self, t: u64, lr_multiplier: f64) -> Result<bool, EngineError> {
        let r = self.run("optimizer", t.max(1), lr_multiplier);
        if let Some(p) = self.profile.as_mut() {
            p.warm = true;
        }
        r
    }

    fn run_host_tasks(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        self.host_tasks(t)
    }

    fn stats(&self) -> &EngineStats {
        &self.stats
    }

    fn describe(&self) -> String {
        let i = self.dev.info();
        // Which fused kernels `auto` / `fused` attention runs on this device.
        let fused = match self.dev.flash_kernels() {
            crate::FlashKernels::Wgmma => "wgmma",
            crate::FlashKernels::Mma => "mma.sync",
        };
        format!(
            "cuda:{} {} ({}), attention kernels {} (fused: {fused}), profile {}",
            i.ordinal, i.name, i.arch, self.attention, self.opts.profile
        )
    }

    /// The end of a step: the compute and copy streams (side-stream refreshes run on; their
    /// results are waited for by event at the swap).
    /// Pending NVMe writes finish here too (an error of one stops the run).
    fn synchronize(&mut self) -> Result<(), EngineError> {
        let cut = std::mem::take(&mut self.cut_step);
        if self.copy_order.carried && !cut {
            // The copies out run on into the next step (`carried_copy_outs`): its ops that
            // touch their bytes wait by event; `settle` waits for them before any read from
            // outside the programs.
            self.dev
                .synchronize_streams(&[StreamKind::Compute, StreamKind::CopyIn])
                .map_err(|e| cuda_err("synchronize", e))?;
        } else {
            self.dev
                .synchronize_step()
                .map_err(|e| cuda_err("synchronize", e))?;
        }
        // A host update that failed (still pending under `delayed`) stops the run here.
        if let Some(e) = self.host_updates.as_ref().and_then(|h| h.failure()) {
            return Err(cuda_err("host updates", e));
        }
        if let Some(nv) = self.nvme.as_mut() {
            nv.finish_step()
                .map_err(|e| EngineError::Tier(format!("the end of the step: {e}")))?;
        }
        if let Some(tr) = &self.gpu_trace {
            tr.flush(&self.dev);
        }
        Ok(())
    }

    fn read_state(&self, name: &str) -> Result<Vec<f64>, EngineError> {
        self.buffer(name)
    }

    fn read_range(&self, name: &str, start: usize, len: usize) -> Result<Vec<f64>, EngineError> {
        self.buffer_range(name, start, len)
    }

    fn finish(&mut self) -> Result<(), EngineError> {
        self.settle()
    }

    fn energy_j(&self) -> Option<f64> {
        self.energy.as_ref().and_then(|m| m.joules())
    }

    fn energy_source(&self) -> Option<String> {
        self.energy.as_ref().map(|m| m.describe())
    }

    fn write_state(&mut self, name: &str, values: &[f64]) -> Result<(), EngineError> {
        self.set_buffer(name, values)
    }

    fn stats_mut(&mut self) -> Result<&mut EngineStats, EngineError> {
        Ok(&mut self.stats)
    }

    fn refreshes_initialized(&self) -> Vec<bool> {
        self.refreshes.runtime.initialized().to_vec()
    }

    fn set_refreshes_initialized(&mut self, flags: &[bool]) -> Result<(), EngineError> {
        self.refreshes
            .runtime
            .set_initialized(flags)
            .map_err(EngineError::Checkpoint)
    }

    fn drain_refreshes(&mut self, t: u64) -> Result<(), EngineError> {
        self.finish_refreshes(t).map(|_| ())
    }

    /// Refreshes in flight come only from CPU-engine checkpoints with staleness > 0 (the CUDA
    /// engine drains its own before it checkpoints). Each is computed now on the host from the
    /// checkpoint's factor and basis snapshots (`optim::refresh_compute`, as the CPU engine's
    /// job would) and put back in flight as a finished job: the refresh runtime installs it
    /// at its step (its launch plus the staleness under `refresh_swap = deadline`, the next
    /// boundary under `finished`) with the CPU engine's install (`optim::refresh_apply` on the
    /// downloaded basis and moments). A refresh that failed keeps the previous basis and counts
    /// as a failure of its factor, as it would have in the CPU run.
    fn restore_refreshes(
        &mut self,
        refreshes: &[engine::checkpoint::InFlightRefresh],
    ) -> Result<(), EngineError> {
        self.install_recorded_refreshes(refreshes)
    }
}

impl Drop for CudaEngine {
    /// Side-stream refreshes may still be running when the engine goes (the end of a step no
    /// longer waits for them): wait for the whole device before the fields go. (The
    /// launcher thread, joined when the refreshes drop, also waits for the side stream before
    /// it destroys its cuSOLVER handle; every buffer's own drop synchronises the context.)
    fn drop(&mut self) {
        let _ = self.settle();
        let _ = self.dev.synchronize();
    }
}

#[cfg(test)]
mod cuda_err_tests {
    use super::*;

    #[test]
    fn an_nvme_tier_failure_is_a_tier_error_wherever_it_surfaces() {
        let e = cuda_err(
            "eigenbasis refresh",
            CudaError::Tier {
                what: "block 3 is corrupt".into(),
            },
        );
        assert!(
            matches!(&e, EngineError::Tier(m) if m.contains("eigenbasis refresh") && m.contains("block 3")),
            "{e:?}"
        );
        let e = cuda_err(
            "download",
            CudaError::Invalid {
                op: "x",
                what: "y".into(),
            },
        );
        assert!(matches!(e, EngineError::Unsupported(_)), "{e:?}");
    }
}
