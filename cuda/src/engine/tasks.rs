//! The CUDA engine's refresh backend: the GPU mechanics of eigenbasis refreshes. The
//! scheduling — when a refresh is due, synchronous or in the background, the swap point, the
//! wait at the staleness bound, failure counting and counters — is
//! [`engine::refresh_runtime`]'s, shared with the CPU engine; this module supplies the
//! compute and data movement ([`RefreshBackend`] for [`CudaEngine`]).
//!
//! **Synchronous** (first basis, S = 0, `EngineOptions::synchronous_refresh`):
//! `placement = gpu_side` runs [`GpuRefresher::compute`] and [`refresh::apply`] back to back on
//! the compute stream with one status read in between; `placement = host` downloads factor,
//! basis and moments, runs `optim::eigenbasis_refresh` on the host pool and uploads the result
//! (module `host_refresh`, which also installs a checkpoint's refreshes at a resume). The end
//! of a boundary that ran one waits for the compute stream (only: side-stream and host work in
//! flight is not waited for).
//!
//! **In the background** (S > 0), the shadow state and the double buffer:
//! - at launch the factor is copied on the compute stream into the task's snapshot (device
//!   memory, or pinned host memory when the plan pins the shadows,
//!   `schedule::MemoryPlan::pinned_refresh_shadows`): the factor keeps accumulating while the
//!   refresh runs, and the side-stream work is enqueued later by another thread, so it must not
//!   read the live factor (the host path's copy-out is enqueued at once, behind the same
//!   event). The basis is read live: only this task's own install writes it, and the task's
//!   next launch comes after that install;
//! - `gpu_side`: the side stream (above the compute stream's priority) waits for that copy
//!   (a pinned snapshot: uploads it into its staging buffer first), computes the candidate
//!   basis and permutation into the task's [`RefreshSlot`] (the back buffer; pinned: through the
//!   staging slot, then downloaded) through its own cuSOLVER and cuBLAS handles, copies the
//!   status words into pinned host memory and records the task's `done` event. That work is enqueued by a dedicated
//!   launcher thread, not the engine thread: cuSOLVER's `Sgeqrf` / `Sorgqr` block the calling
//!   host thread until their GPU work is done (~100 ms of host time per step for GPT-2 124M at
//!   S = 5 on an H200, which serialised the refreshes with the step when called from the
//!   engine thread);
//! - `host`: the copy-out stream waits for the snapshot, copies factor and basis into pinned
//!   host memory and records an event; a host-pool worker waits for that event, runs
//!   `optim::refresh_compute` on the pinned data and stages the result in pinned memory;
//! - install (at the swap the runtime decides): the status is checked ([`refresh::verdict`];
//!   host results: `optim`'s own checks), a host result is uploaded into the back buffer from
//!   pinned memory, and [`refresh::apply`] runs on the compute stream: basis replaced,
//!   `exp_avg` re-projected, `exp_avg_sq` permuted.
//!
//! **Methods**: a task's `method` is the plan's. [`RefreshMethod::Soap`] is described above.
//! [`RefreshMethod::Qr`] (KL-Shampoo) computes `qr(F·Q).Q` with the columns in their order
//! (`optim::refresh_compute_method`; on the GPU the same QR without the sort) and installs the
//! basis alone ([`refresh::install_basis`], or `optim::refresh_apply` on the host): the task's
//! `exp_avg` / `exp_avg_sq` name KL-Shampoo's unrotated momentum, which a refresh never reads,
//! stages or writes (only its shape, `[m, n]`, is used). [`RefreshMethod::InverseRoot`]
//! (Shampoo) computes the factor's inverse root `(F + εI)^(−1/r)` at every refresh including
//! the first and installs it into the task's `basis` operand, the root buffer, like a QR
//! basis; `exp_avg` / `exp_avg_sq` name the root itself. Where the plan placed it: on the
//! host, `optim::refresh_compute_inverse_root` through [`host_compute`]; on the GPU (`gpu_side`:
//! the compute stream when synchronous, the side stream through the launcher thread when S > 0,
//! on a snapshot of the factor alone), [`GpuRefresher::compute_inverse_root`] (syevd, the
//! spectrum treatment in one kernel, one fp32 GEMM), whose status words are read as a first
//! eigendecomposition's (an all-zero factor has a root; a non-finite factor or root, or a
//! syevd failure, keeps the previous root and counts as a failed refresh).
use super::gpu_trace::GpuTrace;
use super::side_launcher::{SideLauncher, SideRequest, SideStaging};
use super::{cuda_err, dims2, CudaEngine};
use crate::error::{CudaError, Tier};
use crate::memory::{Arena, Buf, Elem};
use crate::refresh::{self, GpuRefresher, RefreshSlot, SwapWork, STATUS_WORDS};
use crate::{Device, StreamKind};
use cudarc::driver::CudaEvent;
use engine::refresh_runtime::inflight::{Job, JobError, JobOutput};
use engine::refresh_runtime::{Outcome, RefreshBackend, RefreshRuntime, RefreshTask};
use engine::{EngineError, EngineOptions, EngineStats, HostTaskReport};
use optim::RefreshOutcome;
use schedule::{Placement, Plan, RefreshMethod};
use std::sync::{mpsc, Arc};
use std::time::Instant;

mod alloc;

/// Side length of the task's factor.
pub(super) fn dim(plan: &Plan, task: &RefreshTask) -> usize {
    dims2(&plan.buffer(task.factor).shape).0
}

/// Whether the plan placed the task on the GPU side stream.
fn on_gpu(task: &RefreshTask) -> bool {
    task.placement == Placement::GpuSide
}

/// The per-task buffers of asynchronous refreshes (tasks with S > 0 only).
pub(super) struct Shadow {
    /// Copy of the factor at launch, `[d, d]` f32: on the device, or in pinned host memory
    /// for a `gpu_side` task when the plan pins the shadows (`pinned`).
    snapshot: Buf,
    /// The back buffer: candidate basis, permutation, status words (on the device, or pinned
    /// like `snapshot`).
    slot: RefreshSlot,
    /// `snapshot` and `slot` are in pinned host memory
    /// (`schedule::MemoryPlan::pinned_refresh_shadows`, `gpu_side` tasks only): the side
    /// stream stages them through its device buffers, the install through the sync slot.
    pinned: bool,
    /// Pinned copy of the status words (`gpu_side`).
    status_host: Buf,
    /// Pinned factor snapshot `[d, d]` (`host`).
    host_f: Option<Buf>,
    /// Pinned basis snapshot, then the result basis to upload, `[d, d]` (`host`).
    host_q: Option<Buf>,
    /// Pinned permutation to upload, `[d]` i32 (`host`).
    host_idx: Option<Buf>,
}

/// Shadows of one placement and factor side that no refresh holds now.
struct ShadowPool {
    gpu_side: bool,
    dim: usize,
    free: Vec<Shadow>,
}

/// A refresh in flight.
pub enum CudaJob {
    /// On the side stream: the launcher thread answers with the `done` event, recorded after
    /// the status words reached pinned memory (or with the CUDA error that stopped it).
    Gpu {
        reply: mpsc::Receiver<Result<CudaEvent, String>>,
        done: Option<Result<CudaEvent, String>>,
    },
    /// On the host pool.
    Host { job: Job<f32> },
    /// Computed already: a CPU checkpoint's refresh in flight, recomputed from its snapshots
    /// at the resume (taken once, at the swap).
    Ready(Option<JobOutput<f32>>),
}

impl CudaJob {
    /// Whether the result can be swapped in without blocking.
    fn poll(&mut self) -> bool {
        match self {
            CudaJob::Gpu { reply, done } => {
                if done.is_none() {
                    match reply.try_recv() {
                        Ok(r) => *done = Some(r),
                        Err(mpsc::TryRecvError::Empty) => return false,
                        Err(mpsc::TryRecvError::Disconnected) => {
                            *done = Some(Err("the side-stream launcher thread exited".into()))
                        }
                    }
                }
                match done {
                    // An error here resurfaces at the swap's synchronize.
                    Some(Ok(ev)) => ev.try_is_complete().unwrap_or(true),
                    _ => true,
                }
            }
            CudaJob::Host { job } => job.poll(),
            CudaJob::Ready(_) => true,
        }
    }
}

/// The refresh machinery of one engine: refreshers, swap buffers, shadows, jobs in flight.
pub(super) struct Refreshes {
    /// Compute-stream refresher (synchronous GPU refreshes).
    sync: Option<GpuRefresher>,
    /// Its output slot.
    sync_slot: Option<RefreshSlot>,
    /// The side-stream refresher's launcher thread (asynchronous GPU refreshes).
    side: Option<SideLauncher>,
    /// Swap buffers (compute stream).
    swap: Option<SwapWork>,
    /// Shadows of asynchronous refreshes not in use, per placement and factor side.
    pools: Vec<ShadowPool>,
    /// Per task, the shadow its refresh in flight holds.
    held: Vec<Option<Shadow>>,
    /// The shared scheduling: refreshes in flight, first bases, failure limit (taken out
    /// while it drives the engine, [`CudaEngine::host_tasks`]).
    pub(super) runtime: RefreshRuntime<CudaJob>,
    /// A synchronous refresh enqueued compute-stream work at this boundary.
    synced: bool,
    host_pool: Option<Arc<rayon::ThreadPool>>,
    /// Host wall time spent in: launching side-stream refreshes, launching host refreshes,
    /// swapping in GPU results, swapping in host results, synchronous refreshes (ms).
    times: [f64; 5],
    _arenas: Vec<Arena>,
    /// Bytes allocated (device + pinned).
    pub(super) bytes: usize,
    /// Of which pinned host memory.
    pub(super) pinned_bytes: usize,
}

fn pinned_slice<T>(b: &Buf, len: usize) -> &[T] {
    debug_assert!(b.tier() == Tier::PinnedHost && b.bytes() >= len * std::mem::size_of::<T>());
    // SAFETY: a pinned-host `Buf` is host memory of at least `len` elements that stays
    // allocated while `b` lives; callers read only after the copies into it completed.
    unsafe { std::slice::from_raw_parts(b.ptr() as *const T, len) }
}

/// Copies `src` into the pinned-host buffer `b`.
fn pinned_write<T: Copy>(b: &Buf, src: &[T]) {
    debug_assert!(b.tier() == Tier::PinnedHost && b.bytes() >= std::mem::size_of_val(src));
    // SAFETY: as `pinned_slice`, `b` holds at least `src.len()` elements; callers write only
    // while no copy from it is pending (the engine orders its copies on the compute stream
    // after this write) and no one reads it concurrently.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), b.ptr() as *mut T, src.len()) }
}

/// Writes a host refresh's new basis (f32 `[d, d]`) and, for a SOAP QR refresh, its permutation
/// (i32 `[d]`) into the task's pinned shadows `hq` / `hi`, on the pool thread that computed it,
/// so that the swap on the engine thread only enqueues the uploads (two pinned copies per swap
/// on the engine thread, ~0.25 ms each at d = 768, would lengthen the step).
/// Safe to write: the worker owns the shadows from its launch (after the upload of the
/// task's previous result, ordered before this launch's snapshot) to its swap.
///
/// # Errors
/// A result of the wrong size ([`JobError::Lost`]).
fn stage_host_result(
    r: &optim::RefreshResult<f32>,
    method: RefreshMethod,
    d: usize,
    hq: &Buf,
    hi: &Buf,
) -> Result<(), JobError> {
    let basis_only = basis_only(r.kind() == RefreshOutcome::Initialized, method);
    if r.basis().len() != d * d || (!basis_only && r.permutation().len() != d) {
        return Err(JobError::Lost(
            "internal: refresh result of the wrong size".into(),
        ));
    }
    pinned_write(hq, r.basis());
    if !basis_only {
        let idx: Vec<i32> = r.permutation().iter().map(|&i| i as i32).collect();
        pinned_write(hi, &idx);
    }
    Ok(())
}

/// Whether a refresh installs its basis alone: a first basis (any method) or any refresh of a
/// [`basis_only_method`].
fn basis_only(init: bool, method: RefreshMethod) -> bool {
    init || basis_only_method(method)
}

/// Whether every refresh of `method` installs its basis alone, no permutation and no moment:
/// [`RefreshMethod::Qr`] (KL-Shampoo's basis) and [`RefreshMethod::InverseRoot`] (Shampoo's
/// inverse root, installed into the task's `basis` operand, the root buffer).
pub(super) fn basis_only_method(method: RefreshMethod) -> bool {
    matches!(method, RefreshMethod::Qr | RefreshMethod::InverseRoot)
}

/// Whether a GPU refresh's status words are those of an eigendecomposition (a first basis, or
/// any [`RefreshMethod::InverseRoot`] refresh): an all-zero factor is a valid input there (its
/// basis is the identity's eigenvectors, its root `ε^(−1/r)·I`, as on the host), and word 1 is
/// syevd's info. Pass it as `init` to [`refresh::zero_factor`] and [`refresh::verdict`].
fn by_syevd(init: bool, method: RefreshMethod) -> bool {
    init || method == RefreshMethod::InverseRoot
}

/// The `root` (exponent, ε) of an `inverse_root` task (the plan verifier requires it).
fn task_root(task: &RefreshTask) -> Result<schedule::InverseRoot, EngineError> {
    task.root.ok_or_else(|| EngineError::Optim {
        location: task.location(),
        message: "internal: an inverse_root refresh without its root".into(),
    })
}

/// What a host refresh of `task` computes at optim step `t` (`RefreshTask::optim_step`) from
/// its factor `f` and basis `q` (`[d, d]` f32; the task's `exp_avg` is `[m, n]`): the CPU
/// engine's functions — `optim::refresh_compute_inverse_root` for method `inverse_root` (its
/// `root`; the task's `exp_avg` names the root itself, so `d = m = n`), else
/// `optim::refresh_compute_method`.
///
/// # Errors
/// As those functions (an `inverse_root` task without its `root` is
/// `RefreshError::InverseRootMethod`).
#[allow(clippy::too_many_arguments)]
pub(super) fn host_compute(
    solver: &dyn optim::HostEigensolver,
    task: &RefreshTask,
    t: u64,
    f: &[f32],
    q: &[f32],
    m: usize,
    n: usize,
) -> Result<Option<optim::RefreshResult<f32>>, optim::RefreshError> {
    match (task.method, task.root) {
        (RefreshMethod::InverseRoot, Some(root)) => {
            let d = if task.side == 0 { m } else { n };
            optim::refresh_compute_inverse_root(solver, t, task.frequency, task.side, f, d, root)
        }
        (method, _) => {
            optim::refresh_compute_method(solver, t, task.frequency, method, task.side, f, q, m, n)
        }
    }
}

/// Threads of the CUDA engine's host refresh pool: every core but two (the engine thread that
/// enqueues the step, and the side-stream launcher), at least one.
pub(super) fn host_pool_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .saturating_sub(2)
        .max(1)
}

/// A finished refresh, ready to install.
pub enum Done {
    /// A side-stream result: its `done` event (complete), status words in pinned memory.
    Gpu(CudaEvent),
    /// A host-pool result, staged in the task's pinned shadows.
    Host(JobOutput<f32>),
    /// A result computed at a resume ([`CudaJob::Ready`]).
    Ready(JobOutput<f32>),
}

impl CudaEngine {
    /// Runs the host tasks at the end of 1-based step `t` through the shared refresh runtime
    /// ([`RefreshRuntime::step`]): installs finished (and due) results, then runs or launches
    /// the refreshes due now.
    pub(super) fn host_tasks(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        let mut runtime = std::mem::take(&mut self.refreshes.runtime);
        let report = runtime.step(t, self);
        self.refreshes.runtime = runtime;
        report
    }

    /// Waits for every refresh in flight and swaps it in, as at the end of step `t`.
    ///
    /// # Errors
    /// As [`StepExecutor::run_host_tasks`](engine::StepExecutor::run_host_tasks).
    pub fn finish_refreshes(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        let mut runtime = std::mem::take(&mut self.refreshes.runtime);
        let report = runtime.finish(t, self);
        self.refreshes.runtime = runtime;
        report
    }

    /// Where the host time of the refresh machinery went (ms; blocking waits excluded), one
    /// line: launches and swaps per placement, synchronous refreshes, and the host time of the
    /// refreshers' enqueue phases.
    pub fn refresh_timing(&self) -> String {
        let [lg, lh, sg, sh, sync] = self.refreshes.times;
        let side = self
            .refreshes
            .side
            .as_ref()
            .and_then(|s| s.phases.lock().ok().map(|p| p.clone()))
            .unwrap_or_default();
        let compute = self
            .refreshes
            .sync
            .as_ref()
            .map(GpuRefresher::phase_ms_line)
            .unwrap_or_default();
        format!(
            "refresh host ms: launch gpu_side {lg:.0}, launch host {lh:.0}, swap gpu_side {sg:.0}, swap host {sh:.0}, synchronous {sync:.0}; side launcher thread [{side}]; compute refresher [{compute}]"
        )
    }

    /// Refreshes running (or finished but not swapped in yet).
    pub fn refreshes_in_flight(&self) -> usize {
        self.refreshes.runtime.in_flight()
    }

    /// One synchronous refresh (see the module docs).
    fn refresh_now(
        &mut self,
        task: &RefreshTask,
        t: u64,
        init: bool,
    ) -> Result<Outcome, EngineError> {
        let (m, n) = self.dims(task.exp_avg);
        let e = |err| cuda_err("eigenbasis refresh", err);
        if on_gpu(task) {
            let (Some(r), Some(slot), Some(_)) = (
                self.refreshes.sync.as_ref(),
                self.refreshes.sync_slot.as_ref(),
                self.refreshes.swap.as_ref(),
            ) else {
                return Err(EngineError::Unsupported(
                    "internal: no GPU refresher".into(),
                ));
            };
            let d = dim(&self.plan, task);
            let (f, q) = (self.b(task.factor), self.b(task.basis));
            match task.method {
                RefreshMethod::InverseRoot => {
                    let root = task_root(task)?;
                    r.compute_inverse_root(&self.dev, d, root, f, slot)
                }
                method => r.compute(&self.dev, init, method, d, f, q, slot),
            }
            .map_err(e)?;
            let status = self.dev.download::<i32>(&slot.status).map_err(e)?;
            let eigh = by_syevd(init, task.method);
            if refresh::zero_factor(eigh, &status) {
                return Ok(Ok(RefreshOutcome::ZeroFactor));
            }
            if let Err(fail) = refresh::verdict(eigh, d, &status) {
                return Ok(Err(fail.to_string()));
            }
            if basis_only_method(task.method) {
                refresh::install_basis(&self.dev, &slot.q, q, d).map_err(e)?;
                self.basis_changed(task.basis);
                return Ok(Ok(if init {
                    RefreshOutcome::Initialized
                } else {
                    RefreshOutcome::Refreshed
                }));
            }
            let ([ea, eas], paged) = self
                .swap_moments([task.exp_avg, task.exp_avg_sq])
                .map_err(e)?;
            let (Some(slot), Some(work)) = (
                self.refreshes.sync_slot.as_ref(),
                self.refreshes.swap.as_ref(),
            ) else {
                return Err(EngineError::Unsupported(
                    "internal: no GPU refresher".into(),
                ));
            };
            refresh::apply(
                &self.dev,
                work,
                init,
                task.side,
                &slot.q,
                &slot.idx,
                self.b(task.basis),
                &ea,
                &eas,
                m,
                n,
                self.swap_math(),
            )
            .map_err(e)?;
            self.swap_moments_back(paged).map_err(e)?;
            self.basis_changed(task.basis);
            return Ok(Ok(if init {
                RefreshOutcome::Initialized
            } else {
                RefreshOutcome::Refreshed
            }));
        }
        self.refresh_now_host(task, t, init)
    }

    pub(super) fn host_pool(&self) -> Result<Arc<rayon::ThreadPool>, EngineError> {
        self.refreshes
            .host_pool
            .clone()
            .ok_or_else(|| EngineError::Unsupported("internal: no host pool".into()))
    }

    fn shadow_of(&self, task: &RefreshTask) -> Result<&Shadow, EngineError> {
        self.refreshes
            .held
            .get(task.index)
            .and_then(Option::as_ref)
            .ok_or_else(|| EngineError::Optim {
                location: task.location(),
                message: "internal: no shadow buffers for an asynchronous refresh".into(),
            })
    }

    /// Takes a shadow from the task's pool for its launch. The pools hold as many shadows as
    /// refreshes can be in flight at once (`schedule::reserve::refresh_pools`), so one is
    /// always free; work enqueued with the previous holder's shadow is ordered before the new
    /// holder's snapshot on the compute stream.
    fn take_shadow(&mut self, task: &RefreshTask) -> Result<(), EngineError> {
        let (gpu, d) = (on_gpu(task), dim(&self.plan, task));
        let shadow = self
            .refreshes
            .pools
            .iter_mut()
            .find(|p| p.gpu_side == gpu && p.dim == d)
            .and_then(|p| p.free.pop())
            .ok_or_else(|| EngineError::Optim {
                location: task.location(),
                message: "internal: every refresh shadow of this size is in use".into(),
            })?;
        if let Some(old) = self
            .refreshes
            .held
            .get_mut(task.index)
            .and_then(|h| h.replace(shadow))
        {
            self.give_back(gpu, d, old);
        }
        Ok(())
    }

    /// Returns the shadow `task` holds to its pool (after its install was enqueued).
    fn release_shadow(&mut self, task: &RefreshTask) {
        if let Some(sh) = self
            .refreshes
            .held
            .get_mut(task.index)
            .and_then(Option::take)
        {
            let (gpu, d) = (on_gpu(task), dim(&self.plan, task));
            self.give_back(gpu, d, sh);
        }
    }

    fn give_back(&mut self, gpu: bool, d: usize, sh: Shadow) {
        if let Some(p) = self
            .refreshes
            .pools
            .iter_mut()
            .find(|p| p.gpu_side == gpu && p.dim == d)
        {
            p.free.push(sh);
        }
    }

    /// Snapshot on the compute stream, refresh on the side stream through the launcher thread
    /// (see the module docs).
    fn launch_gpu(&mut self, task: &RefreshTask) -> Result<CudaJob, EngineError> {
        let e = |err| cuda_err("launching a side-stream refresh", err);
        let d = dim(&self.plan, task);
        self.take_shadow(task)?;
        let sh = self.shadow_of(task)?;
        let tx = self
            .refreshes
            .side
            .as_ref()
            .and_then(|s| s.tx.clone())
            .ok_or_else(|| EngineError::Unsupported("internal: no side-stream refresher".into()))?;
        // The live basis: only this task's install writes it, after this refresh (the side
        // stream reads it behind `taken`, after any earlier install on the compute stream).
        let basis = self.b(task.basis).clone();
        let dev = &self.dev;
        let root = match task.method {
            RefreshMethod::InverseRoot => Some(task_root(task)?),
            _ => None,
        };
        // Into device memory, or to the host (pinned shadows): either way in stream order
        // before the next write of the factor.
        let factor = self.b(task.factor);
        if factor.tier() != Tier::Device && sh.snapshot.tier() != Tier::Device {
            // A factor in the host tier into a pinned snapshot: host-to-host copies block the
            // calling thread until the stream has drained, so the bytes go through the
            // compute-stream refresher's device copy instead (two asynchronous copies).
            let bounce = self
                .refreshes
                .sync
                .as_ref()
                .and_then(GpuRefresher::factor_stage)
                .ok_or_else(|| EngineError::Unsupported("internal: no factor staging copy".into()))
                .and_then(|b| b.slice(0, d * d).map_err(e))?;
            dev.copy(&bounce, factor, StreamKind::Compute).map_err(e)?;
            dev.copy(&sh.snapshot, &bounce, StreamKind::Compute)
                .map_err(e)?;
        } else {
            dev.copy(&sh.snapshot, factor, StreamKind::Compute)
                .map_err(e)?;
        }
        let taken = dev.record(StreamKind::Compute, false).map_err(e)?;
        let (reply, rx) = mpsc::channel();
        let req = SideRequest {
            taken,
            method: task.method,
            root,
            d,
            snapshot: sh.snapshot.clone(),
            basis,
            slot: sh.slot.clone(),
            pinned: sh.pinned,
            status_host: sh.status_host.clone(),
            reply,
            name: self.plan.buffer(task.factor).name.clone(),
        };
        tx.send(req).map_err(|_| EngineError::Optim {
            location: task.location(),
            message: "the side-stream launcher thread exited".into(),
        })?;
        Ok(CudaJob::Gpu {
            reply: rx,
            done: None,
        })
    }

    /// Snapshot on the compute stream, D2H into pinned memory on the copy-out stream,
    /// `optim::refresh_compute` on the host pool (see the module docs).
    fn launch_host(&mut self, task: &RefreshTask, t: u64) -> Result<CudaJob, EngineError> {
        let e = |err| cuda_err("launching a host refresh", err);
        let d = dim(&self.plan, task);
        let (m, n) = self.dims(task.exp_avg);
        self.take_shadow(task)?;
        let sh = self.shadow_of(task)?;
        let (Some(hf), Some(hq), Some(hi)) =
            (sh.host_f.clone(), sh.host_q.clone(), sh.host_idx.clone())
        else {
            return Err(EngineError::Unsupported(
                "internal: no pinned shadows".into(),
            ));
        };
        let dev = &self.dev;
        dev.copy(&sh.snapshot, self.b(task.factor), StreamKind::Compute)
            .map_err(e)?;
        let taken = dev.record(StreamKind::Compute, false).map_err(e)?;
        dev.wait(StreamKind::CopyOut, &taken).map_err(e)?;
        dev.copy(&hf, &sh.snapshot, StreamKind::CopyOut)
            .map_err(e)?;
        // A basis in the host tier is read where it lives by the worker (a host-to-host copy
        // would block this thread until the copy-out stream drained). Only this task's
        // install writes it, enqueued on the compute stream before `taken`.
        let basis = self.b(task.basis);
        let basis_home = (basis.tier() != Tier::Device).then(|| basis.clone());
        if basis_home.is_none() {
            dev.copy(&hq, basis, StreamKind::CopyOut).map_err(e)?;
        }
        let copied = dev.record(StreamKind::CopyOut, false).map_err(e)?;
        let solver = Arc::clone(&self.solver);
        let t_optim = task.optim_step(t, false);
        let (method, task_copy) = (task.method, *task);
        let (tx, rx) = mpsc::channel::<JobOutput<f32>>();
        self.host_pool()?.spawn(move || {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                copied.synchronize().map_err(|err| {
                    JobError::Lost(format!("waiting for the factor snapshot: {err}"))
                })?;
                let f = pinned_slice::<f32>(&hf, d * d).to_vec();
                let q = pinned_slice::<f32>(basis_home.as_ref().unwrap_or(&hq), d * d).to_vec();
                // One refresh per pool thread, each single-threaded: the throughput setting
                // `asteria calibrate` measures for the cost model.
                let result = optim::with_sequential(|| {
                    host_compute(solver.as_ref(), &task_copy, t_optim, &f, &q, m, n)
                })
                .map_err(JobError::Refresh)?;
                // A zero factor installs nothing (an empty result): nothing to stage.
                let installs =
                    |r: &&optim::RefreshResult<f32>| r.kind() != RefreshOutcome::ZeroFactor;
                if let Some(r) = result.as_ref().filter(installs) {
                    stage_host_result(r, method, d, &hq, &hi)?;
                }
                Ok(result)
            }));
            let out = match out {
                Ok(r) => r,
                Err(_) => Err(JobError::Lost("refresh worker panicked".into())),
            };
            let _ = tx.send(out);
        });
        Ok(CudaJob::Host { job: Job::new(rx) })
    }

    fn swap_gpu(&mut self, task: &RefreshTask, done: &CudaEvent) -> Result<Outcome, EngineError> {
        let e = |err| cuda_err("swapping in a refresh", err);
        let d = dim(&self.plan, task);
        let (m, n) = self.dims(task.exp_avg);
        let sh = self.shadow_of(task)?;
        let status = pinned_slice::<i32>(&sh.status_host, STATUS_WORDS);
        let eigh = by_syevd(false, task.method);
        if refresh::zero_factor(eigh, status) {
            return Ok(Ok(RefreshOutcome::ZeroFactor));
        }
        if let Err(fail) = refresh::verdict(eigh, d, status) {
            return Ok(Err(fail.to_string()));
        }
        self.dev.wait(StreamKind::Compute, done).map_err(e)?;
        let (q, idx) = self.installable(task, d).map_err(e)?;
        if basis_only_method(task.method) {
            refresh::install_basis(&self.dev, &q, self.b(task.basis), d).map_err(e)?;
            self.basis_changed(task.basis);
            return Ok(Ok(RefreshOutcome::Refreshed));
        }
        let ([ea, eas], paged) = self
            .swap_moments([task.exp_avg, task.exp_avg_sq])
            .map_err(e)?;
        let work = self
            .refreshes
            .swap
            .as_ref()
            .ok_or_else(|| EngineError::Unsupported("internal: no swap buffers".into()))?;
        refresh::apply(
            &self.dev,
            work,
            false,
            task.side,
            &q,
            &idx,
            self.b(task.basis),
            &ea,
            &eas,
            m,
            n,
            self.swap_math(),
        )
        .map_err(e)?;
        self.swap_moments_back(paged).map_err(e)?;
        self.basis_changed(task.basis);
        Ok(Ok(RefreshOutcome::Refreshed))
    }

    /// The candidate basis and permutation of `task`'s finished side-stream refresh (side
    /// `d`) on the device: its shadow's slot, or for a pinned shadow copies in the sync slot
    /// (uploaded on the compute stream, which has waited for the refresh; the sync refresher
    /// uses that slot only on the same stream).
    fn installable(&self, task: &RefreshTask, d: usize) -> crate::error::Result<(Buf, Buf)> {
        let sh = self
            .shadow_of(task)
            .map_err(|err| crate::error::CudaError::Invalid {
                op: "refresh install",
                what: err.to_string(),
            })?;
        if !sh.pinned {
            return Ok((sh.slot.q.clone(), sh.slot.idx.clone()));
        }
        let sync =
            self.refreshes
                .sync_slot
                .as_ref()
                .ok_or_else(|| crate::error::CudaError::Invalid {
                    op: "refresh install",
                    what: "a pinned shadow without the sync slot to upload it into".into(),
                })?;
        let (q, idx) = (sync.q.slice(0, d * d)?, sync.idx.slice(0, d)?);
        self.dev.copy(&q, &sh.slot.q, StreamKind::Compute)?;
        self.dev.copy(&idx, &sh.slot.idx, StreamKind::Compute)?;
        Ok((q, idx))
    }

    fn swap_host(
        &mut self,
        task: &RefreshTask,
        out: JobOutput<f32>,
    ) -> Result<Outcome, EngineError> {
        let e = |err| cuda_err("swapping in a host refresh", err);
        let result = match task.computed(out)? {
            Ok(result) => result,
            Err(outcome) => return Ok(outcome),
        };
        let d = dim(&self.plan, task);
        let (m, n) = self.dims(task.exp_avg);
        let sh = self.shadow_of(task)?;
        let (Some(hq), Some(hi)) = (sh.host_q.as_ref(), sh.host_idx.as_ref()) else {
            return Err(EngineError::Unsupported(
                "internal: no pinned shadows".into(),
            ));
        };
        let init = result.kind() == RefreshOutcome::Initialized;
        // The worker staged the new basis and permutation in the pinned shadows
        // (`stage_host_result`), off the engine thread.
        if basis_only_method(task.method) {
            // The basis alone (or the inverse root), straight from the pinned shadow.
            refresh::install_basis(&self.dev, hq, self.b(task.basis), d).map_err(e)?;
            self.basis_changed(task.basis);
            return Ok(Ok(result.kind()));
        }
        let (q_dev, idx_dev) = (
            sh.slot.q.slice(0, d * d).map_err(e)?,
            sh.slot.idx.slice(0, d).map_err(e)?,
        );
        self.dev.copy(&q_dev, hq, StreamKind::Compute).map_err(e)?;
        if !init {
            self.dev
                .copy(&idx_dev, hi, StreamKind::Compute)
                .map_err(e)?;
        }
        let ([ea, eas], paged) = self
            .swap_moments([task.exp_avg, task.exp_avg_sq])
            .map_err(e)?;
        let sh = self.shadow_of(task)?;
        let work = self
            .refreshes
            .swap
            .as_ref()
            .ok_or_else(|| EngineError::Unsupported("internal: no swap buffers".into()))?;
        refresh::apply(
            &self.dev,
            work,
            init,
            task.side,
            &sh.slot.q,
            &sh.slot.idx,
            self.b(task.basis),
            &ea,
            &eas,
            m,
            n,
            self.swap_math(),
        )
        .map_err(e)?;
        self.swap_moments_back(paged).map_err(e)?;
        self.basis_changed(task.basis);
        Ok(Ok(result.kind()))
    }
}

/// The GPU mechanics under the shared refresh runtime. Host time of each kind of work goes to
/// [`CudaEngine::refresh_timing`]'s counters. An empty factor has nothing to refresh: it is
/// neither run nor launched.
impl RefreshBackend for CudaEngine {
    type Job = CudaJob;
    type Done = Done;

    fn stats(&mut self) -> &mut EngineStats {
        &mut self.stats
    }

    /// See the module docs; `reference` changes nothing here (both paths are one synchronous
    /// refresh).
    fn run_now(
        &mut self,
        task: &RefreshTask,
        t: u64,
        init: bool,
        _reference: bool,
    ) -> Result<Outcome, EngineError> {
        if dim(&self.plan, task) == 0 {
            return Ok(Ok(RefreshOutcome::Skipped));
        }
        let t0 = Instant::now();
        let outcome = self.refresh_now(task, t, init);
        self.refreshes.synced |= outcome.is_ok();
        self.refreshes.times[4] += t0.elapsed().as_secs_f64() * 1e3;
        outcome
    }

    /// Host-placed refreshes computed at once on the host pool (`host_refresh`'s
    /// `refresh_now_host_batch`); side-stream ones one after the other on the compute stream.
    fn run_now_batch(
        &mut self,
        batch: &[(RefreshTask, bool)],
        t: u64,
        _reference: bool,
    ) -> Result<Vec<Outcome>, EngineError> {
        let t0 = Instant::now();
        let mut outcomes: Vec<Option<Outcome>> = (0..batch.len()).map(|_| None).collect();
        let mut host = Vec::new();
        for (i, (task, init)) in batch.iter().enumerate() {
            if dim(&self.plan, task) == 0 {
                outcomes[i] = Some(Ok(RefreshOutcome::Skipped));
            } else if on_gpu(task) {
                let outcome = self.refresh_now(task, t, *init)?;
                self.refreshes.synced = true;
                outcomes[i] = Some(outcome);
            } else {
                host.push(i);
            }
        }
        // (A plan whose refreshes all run on the side stream has no host pool.)
        if !host.is_empty() {
            for (i, outcome) in host
                .iter()
                .copied()
                .zip(self.refresh_now_host_batch(batch, &host, t)?)
            {
                outcomes[i] = Some(outcome);
            }
        }
        self.refreshes.times[4] += t0.elapsed().as_secs_f64() * 1e3;
        outcomes
            .into_iter()
            .map(|o| {
                o.ok_or_else(|| {
                    EngineError::Unsupported("internal: a refresh without an outcome".into())
                })
            })
            .collect()
    }

    fn launch(&mut self, task: &RefreshTask, t: u64) -> Result<Option<CudaJob>, EngineError> {
        if dim(&self.plan, task) == 0 {
            return Ok(None);
        }
        let t0 = Instant::now();
        let (job, slot) = if on_gpu(task) {
            (self.launch_gpu(task)?, 0)
        } else {
            (self.launch_host(task, t)?, 1)
        };
        self.refreshes.times[slot] += t0.elapsed().as_secs_f64() * 1e3;
        Ok(Some(job))
    }

    fn poll(&mut self, job: &mut CudaJob) -> bool {
        job.poll()
    }

    /// A side-stream job: the launcher's reply, then its `done` event synchronised; a host job:
    /// its channel.
    fn wait(&mut self, task: &RefreshTask, job: CudaJob) -> Result<(Done, bool), EngineError> {
        match job {
            CudaJob::Gpu { reply, done } => {
                let mut job = CudaJob::Gpu { reply, done };
                let blocked = !job.poll();
                let CudaJob::Gpu { reply, done } = job else {
                    unreachable!("constructed above")
                };
                let done = match done {
                    Some(r) => r,
                    None => reply
                        .recv()
                        .unwrap_or_else(|_| Err("the side-stream launcher thread exited".into())),
                }
                .map_err(|msg| task.error(format!("side-stream refresh: {msg}")))?;
                done.synchronize()
                    .map_err(|err| cuda_err("swapping in a refresh", err.into()))?;
                Ok((Done::Gpu(done), blocked))
            }
            CudaJob::Host { job } => {
                let (out, blocked) = job.wait();
                Ok((Done::Host(out), blocked))
            }
            CudaJob::Ready(out) => Ok((
                Done::Ready(out.unwrap_or_else(|| {
                    Err(JobError::Lost(
                        "a resumed refresh was installed twice".into(),
                    ))
                })),
                false,
            )),
        }
    }

    fn install(&mut self, task: &RefreshTask, done: Done) -> Result<Outcome, EngineError> {
        let t0 = Instant::now();
        let (outcome, slot) = match done {
            Done::Gpu(event) => (self.swap_gpu(task, &event), 2),
            Done::Host(out) => (self.swap_host(task, out), 3),
            Done::Ready(out) => (self.swap_ready(task, out), 3),
        };
        // Installed (or refused): the shadow is free for the next launch.
        self.release_shadow(task);
        let outcome = outcome?;
        self.refreshes.times[slot] += t0.elapsed().as_secs_f64() * 1e3;
        Ok(outcome)
    }

    /// Waits for the compute stream when a synchronous refresh ran at this boundary (only:
    /// side-stream and host work in flight is not waited for).
    fn end_boundary(&mut self) -> Result<(), EngineError> {
        if std::mem::take(&mut self.refreshes.synced) {
            self.dev
                .stream(StreamKind::Compute)
                .synchronize()
                .map_err(|e| cuda_err("refresh", e.into()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use schedule::{BufferId, HostTask};

    fn refresh(placement: Placement) -> HostTask {
        HostTask::EigenbasisRefresh {
            factor: BufferId(0),
            basis: BufferId(1),
            side: 0,
            exp_avg: BufferId(2),
            exp_avg_sq: BufferId(3),
            frequency: 10,
            offset: 4,
            staleness: 5,
            placement,
            method: RefreshMethod::Soap,
            root: None,
        }
    }

    /// A task runs where the plan placed it, with the plan's staleness and offset.
    #[test]
    fn tasks_follow_the_plan() {
        let gpu = RefreshTask::of(0, &refresh(Placement::GpuSide));
        assert!(on_gpu(&gpu));
        assert_eq!((gpu.staleness, gpu.offset, gpu.frequency), (5, 4, 10));
        let host = RefreshTask::of(1, &refresh(Placement::Host));
        assert!(!on_gpu(&host));
        assert_eq!((host.staleness, host.offset), (5, 4));
    }
}
