//! Host tasks of the CUDA engine: SOAP eigenbasis refreshes, synchronous or off the critical
//! path with bounded staleness, with the
//! CPU engine's semantics (`engine::cpu`, module `host`): the same schedule
//! (`engine::cpu::refresh_due`), the same swap point and deadline
//! ([`engine::cpu::inflight::InFlightSet`]), the same counters and failure handling.
//!
//! **Synchronous** (S = 0, every first basis, or `EngineOptions::synchronous_refresh`):
//! `placement = gpu_side` runs [`GpuRefresher::compute`] and [`refresh::apply`] back to back on
//! the compute stream with one status read in between; `placement = host` downloads factor,
//! basis and moments, runs `optim::eigenbasis_refresh` on the host pool and uploads the result.
//!
//! **Asynchronous** (S > 0), the shadow state and the double buffer:
//! - at the end of step t the factor (and, for `gpu_side`, the basis) is copied on the compute
//!   stream into the task's device snapshot: the factor keeps accumulating while the refresh
//!   runs, and the side-stream work is enqueued later by another thread, so it must not read
//!   live state (the host path's copy-out is enqueued at once, behind the same event);
//! - `gpu_side`: the side stream (above the compute stream's priority) waits for that copy, computes the candidate basis
//!   and permutation into the task's [`RefreshSlot`] (the back buffer) through its own cuSOLVER
//!   and cuBLAS handles, copies the status words into pinned host memory and records the
//!   task's `done` event. That work is enqueued by a dedicated launcher thread, not the engine
//!   thread: cuSOLVER's `Sgeqrf` / `Sorgqr` block the calling host thread until their GPU work
//!   is done (measured on the H200: ~100 ms of host time per step for GPT-2 124M at S = 5,
//!   which serialised the refreshes with the step when called from the engine thread);
//! - `host`: the copy-out stream waits for the snapshot, copies factor and basis into pinned
//!   host memory and records an event; a host-pool worker waits for that event and runs
//!   `optim::refresh_compute` on the pinned data;
//! - at the start of each later `run_host_tasks` (the step boundary), finished results are
//!   swapped in, and a result launched at step L is swapped in at the end of step L + S at the
//!   latest, the engine blocking on it only then (each block is counted and timed). The swap
//!   checks the status ([`refresh::verdict`]; host results: `optim`'s own checks), uploads a
//!   host result into the back buffer through pinned memory, and runs [`refresh::apply`] on
//!   the compute stream: basis replaced, `exp_avg` re-projected, `exp_avg_sq` permuted.
use super::{cuda_err, dims2, CudaEngine};
use crate::error::{CudaError, Tier};
use crate::memory::{Arena, Buf, Elem};
use crate::refresh::{self, GpuRefresher, RefreshSlot, SwapWork, STATUS_WORDS};
use crate::{Device, StreamKind};
use cudarc::driver::CudaEvent;
use engine::cpu::inflight::{InFlightSet, Job, JobError, JobOutput, Swap};
use engine::{EngineError, HostTaskReport};
use optim::RefreshOutcome;
use schedule::{BufferId, HostTask, Placement, Plan};
use std::sync::{mpsc, Arc};
use std::time::Instant;

/// The operands and schedule of one `EigenbasisRefresh` task.
#[derive(Clone, Copy, Debug)]
pub(super) struct Task {
    factor: BufferId,
    basis: BufferId,
    side: u8,
    exp_avg: BufferId,
    exp_avg_sq: BufferId,
    frequency: u64,
    offset: u64,
    staleness: u32,
    on_gpu: bool,
}

impl Task {
    pub(super) fn of(task: &HostTask) -> Task {
        let HostTask::EigenbasisRefresh {
            factor,
            basis,
            side,
            exp_avg,
            exp_avg_sq,
            frequency,
            offset,
            staleness,
            placement,
        } = *task;
        Task {
            factor,
            basis,
            side,
            exp_avg,
            exp_avg_sq,
            frequency,
            offset,
            staleness,
            on_gpu: placement == Placement::GpuSide,
        }
    }

    /// `optim` schedules by (t − 1) mod frequency: a step that is due under its rule.
    fn optim_step(&self, t: u64, init: bool) -> u64 {
        if init {
            1
        } else if self.offset == 0 {
            t
        } else {
            1 + self.frequency
        }
    }

    /// Side length of the factor.
    fn dim(&self, plan: &Plan) -> usize {
        dims2(&plan.buffer(self.factor).shape).0
    }
}

/// The per-task buffers of asynchronous refreshes (tasks with S > 0 only).
pub(super) struct Shadow {
    /// Device copy of the factor at launch, `[d, d]` f32.
    snapshot: Buf,
    /// Device copy of the basis at launch, `[d, d]` f32 (`gpu_side`; the CPU engine also
    /// snapshots it, and nothing outside the refresh may then race with it).
    basis_snapshot: Option<Buf>,
    /// The back buffer: candidate basis, permutation, status words (device).
    slot: RefreshSlot,
    /// Pinned copy of the status words (`gpu_side`).
    status_host: Buf,
    /// Pinned factor snapshot `[d, d]` (`host`).
    host_f: Option<Buf>,
    /// Pinned basis snapshot, then the result basis to upload, `[d, d]` (`host`).
    host_q: Option<Buf>,
    /// Pinned permutation to upload, `[d]` i32 (`host`).
    host_idx: Option<Buf>,
}

/// A refresh in flight.
pub(super) enum CudaJob {
    /// On the side stream: the launcher thread answers with the `done` event, recorded after
    /// the status words reached pinned memory (or with the CUDA error that stopped it).
    Gpu {
        reply: mpsc::Receiver<Result<CudaEvent, String>>,
        done: Option<Result<CudaEvent, String>>,
    },
    /// On the host pool.
    Host { job: Job<f32> },
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
        }
    }
}

/// One side-stream refresh for the launcher thread.
struct SideRequest {
    taken: CudaEvent,
    d: usize,
    snapshot: Buf,
    basis: Buf,
    slot: RefreshSlot,
    status_host: Buf,
    reply: mpsc::Sender<Result<CudaEvent, String>>,
}

/// The thread that owns the side-stream refresher and enqueues its work, one request at a
/// time, in launch order (see the module docs).
struct SideLauncher {
    tx: Option<mpsc::Sender<SideRequest>>,
    thread: Option<std::thread::JoinHandle<()>>,
    phases: Arc<std::sync::Mutex<String>>,
}

impl SideLauncher {
    fn spawn(dev: Arc<Device>, refresher: GpuRefresher) -> Result<SideLauncher, EngineError> {
        let (tx, rx) = mpsc::channel::<SideRequest>();
        let phases = Arc::new(std::sync::Mutex::new(String::new()));
        let shared = Arc::clone(&phases);
        let thread = std::thread::Builder::new()
            .name("asteria-side-refresh".into())
            .spawn(move || {
                for req in rx {
                    let r = (|| -> crate::error::Result<CudaEvent> {
                        dev.wait(StreamKind::Side, &req.taken)?;
                        refresher.compute(
                            &dev,
                            false,
                            req.d,
                            &req.snapshot,
                            &req.basis,
                            &req.slot,
                        )?;
                        dev.copy(&req.status_host, &req.slot.status, StreamKind::Side)?;
                        dev.record(StreamKind::Side, false)
                    })();
                    if let Ok(mut p) = shared.lock() {
                        *p = refresher.phase_ms_line();
                    }
                    let r = r.map_err(|e| {
                        // Work already enqueued keeps reading the snapshot and writing the
                        // slot: let it finish before anyone reuses them.
                        let _ = dev.stream(StreamKind::Side).synchronize();
                        e.to_string()
                    });
                    let _ = req.reply.send(r);
                }
                // The cuSOLVER handle goes before the device (and its streams), and only once
                // the side stream has finished the work enqueued through it (the end of a step
                // no longer waits for the side stream).
                let _ = dev.stream(StreamKind::Side).synchronize();
                drop(refresher);
            })
            .map_err(|e| EngineError::Unsupported(format!("side-stream launcher thread: {e}")))?;
        Ok(SideLauncher {
            tx: Some(tx),
            thread: Some(thread),
            phases,
        })
    }
}

impl Drop for SideLauncher {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
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
    /// Per task, `Some` when S > 0.
    shadows: Vec<Option<Shadow>>,
    pending: InFlightSet<CudaJob>,
    /// Whether the task's first eigendecomposition succeeded.
    initialized: Vec<bool>,
    host_pool: Option<Arc<rayon::ThreadPool>>,
    /// Host wall time spent in: launching side-stream refreshes, launching host refreshes,
    /// swapping in GPU results, swapping in host results, synchronous refreshes (ms).
    times: [f64; 5],
    _arenas: Vec<Arena>,
    /// Bytes allocated (device + pinned).
    pub(super) bytes: usize,
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

/// Writes a host refresh's new basis (f32 `[d, d]`) and, for a QR refresh, its permutation
/// (i32 `[d]`) into the task's pinned shadows `hq` / `hi`, on the pool thread that computed it,
/// so that the swap on the engine thread only enqueues the uploads (session 9: the engine
/// thread's two pinned copies per swap, ~0.25 ms each at d = 768, lengthened the step).
/// Safe to write: the worker owns the shadows from its launch (after the upload of the
/// task's previous result, ordered before this launch's snapshot) to its swap.
///
/// # Errors
/// A result of the wrong size ([`JobError::Lost`]).
fn stage_host_result(
    r: &optim::RefreshResult<f32>,
    d: usize,
    hq: &Buf,
    hi: &Buf,
) -> Result<(), JobError> {
    let init = r.kind() == RefreshOutcome::Initialized;
    if r.basis().len() != d * d || (!init && r.permutation().len() != d) {
        return Err(JobError::Lost(
            "internal: refresh result of the wrong size".into(),
        ));
    }
    pinned_write(hq, r.basis());
    if !init {
        let idx: Vec<i32> = r.permutation().iter().map(|&i| i as i32).collect();
        pinned_write(hi, &idx);
    }
    Ok(())
}

/// Threads of the CUDA engine's host refresh pool: every core but two (the engine thread that
/// enqueues the step, and the side-stream launcher), at least one.
pub(super) fn host_pool_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .saturating_sub(2)
        .max(1)
}

impl Refreshes {
    /// Allocates what the plan's tasks need, each where the plan placed it.
    pub(super) fn new(dev: &Arc<Device>, plan: &Plan) -> Result<Refreshes, EngineError> {
        let e = |w: &'static str| move |err: CudaError| cuda_err(w, err);
        let tasks: Vec<Task> = plan.host_tasks.iter().map(Task::of).collect();
        let (mut max_dim, mut max_mn) = (0usize, 0usize);
        for t in &tasks {
            max_dim = max_dim.max(t.dim(plan));
            max_mn = max_mn.max(plan.buffer(t.exp_avg).numel());
        }
        let any_gpu = tasks.iter().any(|t| t.on_gpu);
        let any_host = tasks.iter().any(|t| !t.on_gpu);
        let any_async = tasks.iter().any(|t| t.staleness > 0);
        let side_dim = tasks
            .iter()
            .filter(|t| t.on_gpu && t.staleness > 0)
            .map(|t| t.dim(plan))
            .max();
        let mut bytes = 0;
        let mut arenas = Vec::new();
        let (sync, sync_slot) = if any_gpu {
            let (r, b) = GpuRefresher::new(dev, StreamKind::Compute, max_dim)
                .map_err(e("setting up cuSOLVER refreshes"))?;
            bytes += b + RefreshSlot::bytes(max_dim);
            let mut a = dev
                .arena("refresh-slot", Tier::Device, RefreshSlot::bytes(max_dim))
                .map_err(e("allocating the refresh slot"))?;
            let slot =
                RefreshSlot::carve(&mut a, max_dim).map_err(e("carving the refresh slot"))?;
            arenas.push(a);
            (Some(r), Some(slot))
        } else {
            (None, None)
        };
        let side = match side_dim {
            Some(d) => {
                let (r, b) = GpuRefresher::new(dev, StreamKind::Side, d)
                    .map_err(e("setting up side-stream cuSOLVER refreshes"))?;
                bytes += b;
                Some(SideLauncher::spawn(Arc::clone(dev), r)?)
            }
            None => None,
        };
        let swap = if any_gpu || any_async {
            bytes += SwapWork::bytes(max_dim, max_mn);
            Some(SwapWork::new(dev, max_dim, max_mn).map_err(e("allocating the swap buffers"))?)
        } else {
            None
        };
        // Shadows: one device arena and one pinned arena for every task with S > 0.
        let align = crate::memory::BUF_ALIGN;
        let (mut dev_bytes, mut pin_bytes) = (0usize, 0usize);
        for t in tasks.iter().filter(|t| t.staleness > 0) {
            let d = t.dim(plan);
            dev_bytes += d * d * 4 + align + RefreshSlot::bytes(d);
            if t.on_gpu {
                dev_bytes += d * d * 4 + align;
            }
            pin_bytes += STATUS_WORDS * 4 + align;
            if !t.on_gpu {
                pin_bytes += 2 * d * d * 4 + d * 4 + 3 * align;
            }
        }
        let mut shadows = Vec::with_capacity(tasks.len());
        if dev_bytes > 0 {
            let mut da = dev
                .arena("refresh-shadows", Tier::Device, dev_bytes)
                .map_err(e("allocating refresh shadows"))?;
            let mut pa = dev
                .arena("refresh-shadows-pinned", Tier::PinnedHost, pin_bytes)
                .map_err(e("allocating pinned refresh shadows"))?;
            let c = e("carving refresh shadows");
            for t in &tasks {
                if t.staleness == 0 {
                    shadows.push(None);
                    continue;
                }
                let d = t.dim(plan);
                let host = |pa: &mut Arena, elem, len| -> Result<Option<Buf>, EngineError> {
                    if t.on_gpu {
                        Ok(None)
                    } else {
                        pa.buf(elem, len).map(Some).map_err(c)
                    }
                };
                let basis_snapshot = if t.on_gpu {
                    Some(da.buf(Elem::F32, d * d).map_err(c)?)
                } else {
                    None
                };
                shadows.push(Some(Shadow {
                    snapshot: da.buf(Elem::F32, d * d).map_err(c)?,
                    basis_snapshot,
                    slot: RefreshSlot::carve(&mut da, d).map_err(c)?,
                    status_host: pa.buf(Elem::I32, STATUS_WORDS).map_err(c)?,
                    host_f: host(&mut pa, Elem::F32, d * d)?,
                    host_q: host(&mut pa, Elem::F32, d * d)?,
                    host_idx: host(&mut pa, Elem::I32, d)?,
                }));
            }
            bytes += dev_bytes + pin_bytes;
            arenas.push(da);
            arenas.push(pa);
        } else {
            shadows.resize_with(tasks.len(), || None);
        }
        let host_pool = if any_host {
            Some(Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(host_pool_threads())
                    .thread_name(|i| format!("asteria-cuda-host-{i}"))
                    .build()
                    .map_err(|err| EngineError::Unsupported(format!("host pool: {err}")))?,
            ))
        } else {
            None
        };
        Ok(Refreshes {
            sync,
            sync_slot,
            side,
            swap,
            shadows,
            pending: InFlightSet::new(tasks.len()),
            initialized: vec![false; tasks.len()],
            host_pool,
            times: [0.0; 5],
            _arenas: arenas,
            bytes,
        })
    }
}

fn loc(index: usize) -> String {
    format!("host_tasks[{index}] (eigenbasis_refresh)")
}

/// The outcome of one refresh: installed (`Ok(kind)`) or a numerical failure (message).
type Outcome = Result<RefreshOutcome, String>;

impl CudaEngine {
    fn task(&self, index: usize) -> Task {
        Task::of(&self.plan.host_tasks[index])
    }

    /// Runs the host tasks at the end of 1-based step `t`: swaps in finished (and due) results,
    /// then launches or runs the refreshes due now. See the module docs.
    pub(super) fn host_tasks(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        let start = Instant::now();
        let mut report = HostTaskReport::default();
        for swap in self.refreshes.pending.boundary(t, CudaJob::poll) {
            self.swap(swap, t, &mut report)?;
        }
        let mut synced = false;
        for index in 0..self.plan.host_tasks.len() {
            let task = self.task(index);
            if !engine::cpu::refresh_due(t, task.frequency, task.offset) {
                continue;
            }
            if self.refreshes.pending.is_in_flight(index) {
                self.swap(
                    Swap {
                        task: index,
                        wait: true,
                    },
                    t,
                    &mut report,
                )?;
            }
            report.launched += 1;
            self.stats.refreshes_launched += 1;
            let init = t == 1 || !self.refreshes.initialized[index];
            if task.dim(&self.plan) == 0 {
                continue; // an empty factor has nothing to refresh (`optim` skips it too)
            }
            let t0 = Instant::now();
            let slot = if init || task.staleness == 0 || self.opts.engine.synchronous_refresh {
                let outcome = self.refresh_now(index, task, t, init)?;
                self.record(index, task, t, t, outcome, &mut report)?;
                synced = true;
                4
            } else if task.on_gpu {
                self.launch_gpu(index, task, t)?;
                0
            } else {
                self.launch_host(index, task, t)?;
                1
            };
            self.refreshes.times[slot] += t0.elapsed().as_secs_f64() * 1e3;
        }
        if synced {
            // The compute stream only: side-stream and host work in flight is not waited for.
            self.dev
                .stream(StreamKind::Compute)
                .synchronize()
                .map_err(|e| cuda_err("refresh", e.into()))?;
        }
        self.stats.host_task_ms += start.elapsed().as_secs_f64() * 1e3;
        Ok(report)
    }

    /// Waits for every refresh in flight and swaps it in, as at the end of step `t`.
    ///
    /// # Errors
    /// As [`StepExecutor::run_host_tasks`](engine::StepExecutor::run_host_tasks).
    pub fn finish_refreshes(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        let mut report = HostTaskReport::default();
        for task in self.refreshes.pending.tasks() {
            self.swap(Swap { task, wait: true }, t, &mut report)?;
        }
        Ok(report)
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
        self.refreshes.pending.len()
    }

    /// One synchronous refresh (see the module docs).
    fn refresh_now(
        &mut self,
        index: usize,
        task: Task,
        t: u64,
        init: bool,
    ) -> Result<Outcome, EngineError> {
        let (m, n) = self.dims(task.exp_avg);
        let e = |err| cuda_err("eigenbasis refresh", err);
        if task.on_gpu {
            let (Some(r), Some(slot), Some(work)) = (
                self.refreshes.sync.as_ref(),
                self.refreshes.sync_slot.as_ref(),
                self.refreshes.swap.as_ref(),
            ) else {
                return Err(EngineError::Unsupported(
                    "internal: no GPU refresher".into(),
                ));
            };
            let d = task.dim(&self.plan);
            let (f, q) = (self.b(task.factor), self.b(task.basis));
            r.compute(&self.dev, init, d, f, q, slot).map_err(e)?;
            let status = self.dev.download::<i32>(&slot.status).map_err(e)?;
            if let Err(fail) = refresh::verdict(init, d, &status) {
                return Ok(Err(fail.to_string()));
            }
            let (ea, eas) = (self.b(task.exp_avg), self.b(task.exp_avg_sq));
            refresh::apply(
                &self.dev,
                work,
                init,
                task.side,
                &slot.q,
                &slot.idx,
                q,
                ea,
                eas,
                m,
                n,
                self.swap_math(),
            )
            .map_err(e)?;
            self.basis_changed(task.basis);
            return Ok(Ok(if init {
                RefreshOutcome::Initialized
            } else {
                RefreshOutcome::Refreshed
            }));
        }
        // Host: the CPU engine's call, on downloaded state.
        let f = self.dev.download::<f32>(self.b(task.factor)).map_err(e)?;
        let mut q = self.dev.download::<f32>(self.b(task.basis)).map_err(e)?;
        let mut ea = self.dev.download::<f32>(self.b(task.exp_avg)).map_err(e)?;
        let mut eas = self
            .dev
            .download::<f32>(self.b(task.exp_avg_sq))
            .map_err(e)?;
        let solver = Arc::clone(&self.solver);
        let pool = self.host_pool()?;
        let t_optim = task.optim_step(t, init);
        let out = pool.install(|| {
            optim::eigenbasis_refresh(
                solver.as_ref(),
                t_optim,
                task.frequency,
                task.side,
                &f,
                &mut q,
                &mut ea,
                &mut eas,
                m,
                n,
            )
        });
        match out {
            Ok(RefreshOutcome::Skipped) => Ok(Ok(RefreshOutcome::Skipped)),
            Ok(kind) => {
                self.dev.upload(self.b(task.basis), &q).map_err(e)?;
                self.dev.upload(self.b(task.exp_avg), &ea).map_err(e)?;
                self.dev.upload(self.b(task.exp_avg_sq), &eas).map_err(e)?;
                // The basis's cached bf16 copy (SOAP's bf16 projections) is stale now. Missing
                // here since 4dc42e8: every host-placed factor's first basis (always
                // synchronous) left the copy cast before it in use until the factor's first
                // asynchronous swap, which cost SOAP S=5 0.14 of validation loss on GPT-2.
                self.basis_changed(task.basis);
                Ok(Ok(kind))
            }
            Err(err) if err.is_numerical() => Ok(Err(err.to_string())),
            Err(err) => Err(EngineError::Optim {
                location: loc(index),
                message: err.to_string(),
            }),
        }
    }

    fn host_pool(&self) -> Result<Arc<rayon::ThreadPool>, EngineError> {
        self.refreshes
            .host_pool
            .clone()
            .ok_or_else(|| EngineError::Unsupported("internal: no host pool".into()))
    }

    fn shadow_of(&self, index: usize) -> Result<&Shadow, EngineError> {
        self.refreshes
            .shadows
            .get(index)
            .and_then(Option::as_ref)
            .ok_or_else(|| EngineError::Optim {
                location: loc(index),
                message: "internal: no shadow buffers for an asynchronous refresh".into(),
            })
    }

    fn register(
        &mut self,
        index: usize,
        task: Task,
        t: u64,
        job: CudaJob,
    ) -> Result<(), EngineError> {
        self.refreshes
            .pending
            .launch(index, t, task.staleness, job)
            .map_err(|_| EngineError::Optim {
                location: loc(index),
                message: "internal: a refresh is already in flight for this task".into(),
            })
    }

    /// Snapshot on the compute stream, refresh on the side stream through the launcher thread
    /// (see the module docs).
    fn launch_gpu(&mut self, index: usize, task: Task, t: u64) -> Result<(), EngineError> {
        let e = |err| cuda_err("launching a side-stream refresh", err);
        let d = task.dim(&self.plan);
        let sh = self.shadow_of(index)?;
        let tx = self
            .refreshes
            .side
            .as_ref()
            .and_then(|s| s.tx.clone())
            .ok_or_else(|| EngineError::Unsupported("internal: no side-stream refresher".into()))?;
        let basis = sh
            .basis_snapshot
            .clone()
            .ok_or_else(|| EngineError::Unsupported("internal: no basis snapshot".into()))?;
        let dev = &self.dev;
        dev.copy(&sh.snapshot, self.b(task.factor), StreamKind::Compute)
            .map_err(e)?;
        dev.copy(&basis, self.b(task.basis), StreamKind::Compute)
            .map_err(e)?;
        let taken = dev.record(StreamKind::Compute, false).map_err(e)?;
        let (reply, rx) = mpsc::channel();
        let req = SideRequest {
            taken,
            d,
            snapshot: sh.snapshot.clone(),
            basis,
            slot: sh.slot.clone(),
            status_host: sh.status_host.clone(),
            reply,
        };
        tx.send(req).map_err(|_| EngineError::Optim {
            location: loc(index),
            message: "the side-stream launcher thread exited".into(),
        })?;
        self.register(
            index,
            task,
            t,
            CudaJob::Gpu {
                reply: rx,
                done: None,
            },
        )
    }

    /// Snapshot on the compute stream, D2H into pinned memory on the copy-out stream,
    /// `optim::refresh_compute` on the host pool (see the module docs).
    fn launch_host(&mut self, index: usize, task: Task, t: u64) -> Result<(), EngineError> {
        let e = |err| cuda_err("launching a host refresh", err);
        let d = task.dim(&self.plan);
        let (m, n) = self.dims(task.exp_avg);
        let sh = self.shadow_of(index)?;
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
        dev.copy(&hq, self.b(task.basis), StreamKind::CopyOut)
            .map_err(e)?;
        let copied = dev.record(StreamKind::CopyOut, false).map_err(e)?;
        let solver = Arc::clone(&self.solver);
        let t_optim = task.optim_step(t, false);
        let (tx, rx) = mpsc::channel::<JobOutput<f32>>();
        self.host_pool()?.spawn(move || {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                copied.synchronize().map_err(|err| {
                    JobError::Lost(format!("waiting for the factor snapshot: {err}"))
                })?;
                let f = pinned_slice::<f32>(&hf, d * d).to_vec();
                let q = pinned_slice::<f32>(&hq, d * d).to_vec();
                // One refresh per pool thread, each single-threaded: the throughput setting
                // `asteria calibrate` measures for the cost model.
                let result = optim::with_sequential(|| {
                    optim::refresh_compute(
                        solver.as_ref(),
                        t_optim,
                        task.frequency,
                        task.side,
                        &f,
                        &q,
                        m,
                        n,
                    )
                })
                .map_err(JobError::Refresh)?;
                if let Some(r) = &result {
                    stage_host_result(r, d, &hq, &hi)?;
                }
                Ok(result)
            }));
            let out = match out {
                Ok(r) => r,
                Err(_) => Err(JobError::Lost("refresh worker panicked".into())),
            };
            let _ = tx.send(out);
        });
        self.register(index, task, t, CudaJob::Host { job: Job::new(rx) })
    }

    /// Takes the in-flight refresh of `swap.task` (blocking when unfinished) and installs it
    /// as at the end of step `t`.
    fn swap(&mut self, swap: Swap, t: u64, report: &mut HostTaskReport) -> Result<(), EngineError> {
        let Some(flight) = self.refreshes.pending.take(swap.task) else {
            return Ok(());
        };
        let index = swap.task;
        let task = self.task(index);
        let e = |err| cuda_err("swapping in a refresh", err);
        let started = Instant::now();
        let (outcome, blocked, waited, slot) = match flight.job {
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
                .map_err(|msg| EngineError::Optim {
                    location: loc(index),
                    message: format!("side-stream refresh: {msg}"),
                })?;
                done.synchronize().map_err(|err| e(err.into()))?;
                let waited = started.elapsed();
                let outcome = self.swap_gpu(index, task, &done)?;
                (outcome, blocked, waited, 2)
            }
            CudaJob::Host { job } => {
                let (out, blocked) = job.wait();
                let waited = started.elapsed();
                (self.swap_host(index, task, out)?, blocked, waited, 3)
            }
        };
        self.refreshes.times[slot] += (started.elapsed() - waited).as_secs_f64() * 1e3;
        if blocked {
            let ms = waited.as_secs_f64() * 1e3;
            report.waits += 1;
            report.wait_ms += ms;
            self.stats.refresh_waits += 1;
            self.stats.refresh_wait_ms += ms;
            tracing::debug!(
                step = t,
                task = index,
                launched = flight.launched,
                wait_ms = ms,
                "waited for an eigenbasis refresh at its staleness bound"
            );
        }
        self.record(index, task, flight.launched, t, outcome, report)
    }

    fn swap_gpu(
        &mut self,
        index: usize,
        task: Task,
        done: &CudaEvent,
    ) -> Result<Outcome, EngineError> {
        let e = |err| cuda_err("swapping in a refresh", err);
        let d = task.dim(&self.plan);
        let (m, n) = self.dims(task.exp_avg);
        let sh = self.shadow_of(index)?;
        let status = pinned_slice::<i32>(&sh.status_host, STATUS_WORDS);
        if let Err(fail) = refresh::verdict(false, d, status) {
            return Ok(Err(fail.to_string()));
        }
        let work = self
            .refreshes
            .swap
            .as_ref()
            .ok_or_else(|| EngineError::Unsupported("internal: no swap buffers".into()))?;
        self.dev.wait(StreamKind::Compute, done).map_err(e)?;
        let (q, ea, eas) = (
            self.b(task.basis),
            self.b(task.exp_avg),
            self.b(task.exp_avg_sq),
        );
        refresh::apply(
            &self.dev,
            work,
            false,
            task.side,
            &sh.slot.q,
            &sh.slot.idx,
            q,
            ea,
            eas,
            m,
            n,
            self.swap_math(),
        )
        .map_err(e)?;
        self.basis_changed(task.basis);
        Ok(Ok(RefreshOutcome::Refreshed))
    }

    fn swap_host(
        &mut self,
        index: usize,
        task: Task,
        out: JobOutput<f32>,
    ) -> Result<Outcome, EngineError> {
        let e = |err| cuda_err("swapping in a host refresh", err);
        let result = match out {
            Ok(None) => return Ok(Ok(RefreshOutcome::Skipped)),
            Ok(Some(result)) => result,
            Err(JobError::Refresh(err)) if err.is_numerical() => return Ok(Err(err.to_string())),
            Err(JobError::Refresh(err)) => {
                return Err(EngineError::Optim {
                    location: loc(index),
                    message: err.to_string(),
                })
            }
            Err(JobError::Lost(message)) => {
                return Err(EngineError::Optim {
                    location: loc(index),
                    message,
                })
            }
        };
        let d = task.dim(&self.plan);
        let (m, n) = self.dims(task.exp_avg);
        let sh = self.shadow_of(index)?;
        let (Some(hq), Some(hi)) = (sh.host_q.as_ref(), sh.host_idx.as_ref()) else {
            return Err(EngineError::Unsupported(
                "internal: no pinned shadows".into(),
            ));
        };
        let init = result.kind() == RefreshOutcome::Initialized;
        // The worker staged the new basis and permutation in the pinned shadows
        // (`stage_host_result`), off the engine thread.
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
        let work = self
            .refreshes
            .swap
            .as_ref()
            .ok_or_else(|| EngineError::Unsupported("internal: no swap buffers".into()))?;
        let (q, ea, eas) = (
            self.b(task.basis),
            self.b(task.exp_avg),
            self.b(task.exp_avg_sq),
        );
        refresh::apply(
            &self.dev,
            work,
            init,
            task.side,
            &sh.slot.q,
            &sh.slot.idx,
            q,
            ea,
            eas,
            m,
            n,
            self.swap_math(),
        )
        .map_err(e)?;
        self.basis_changed(task.basis);
        Ok(Ok(result.kind()))
    }

    /// Counts the outcome of one refresh of task `index` (launched at the end of step
    /// `launched`, settled at the end of step `t`) as the CPU engine does
    /// ([`engine::cpu::count_refresh_outcome`]).
    fn record(
        &mut self,
        index: usize,
        task: Task,
        launched: u64,
        t: u64,
        outcome: Outcome,
        report: &mut HostTaskReport,
    ) -> Result<(), EngineError> {
        let name = self.plan.buffer(task.factor).name.clone();
        engine::cpu::count_refresh_outcome(
            &mut self.stats,
            report,
            &mut self.refreshes.initialized,
            engine::cpu::RefreshEvent {
                task: index,
                factor: &name,
                launched,
                step: t,
                limit: self.opts.engine.max_consecutive_refresh_failures,
            },
            outcome,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }
    }

    /// A task runs where the plan placed it, with the plan's staleness and offset.
    #[test]
    fn tasks_follow_the_plan() {
        let gpu = Task::of(&refresh(Placement::GpuSide));
        assert!(gpu.on_gpu);
        assert_eq!((gpu.staleness, gpu.offset, gpu.frequency), (5, 4, 10));
        let host = Task::of(&refresh(Placement::Host));
        assert!(!host.on_gpu);
        assert_eq!((host.staleness, host.offset), (5, 4));
    }
}
