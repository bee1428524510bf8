//! The CPU engine's refresh backend: SOAP eigenbasis refreshes through the configured
//! [`optim::HostEigensolver`] on the engine's host pool (a rayon pool separate from the kernel
//! pool, so eigensolver threads never share a core's AVX state with the kernels' threads).
//! The scheduling — when a refresh is due, synchronous or in the background, swap points,
//! waits at the staleness bound, failure counting — is [`crate::refresh_runtime`]'s.
//!
//! - **Synchronous** (first basis, S = 0): [`optim::refresh_compute`] on the live factor and
//!   basis on the host pool (the refreshes due at one boundary at once), then
//!   [`optim::refresh_apply`] (one after the other): bit-identical to
//!   [`optim::eigenbasis_refresh`], which the reference path
//!   ([`super::EngineOptions::synchronous_refresh`]) calls directly.
//! - **In the background** (S > 0): the factor and the current basis are copied (the shadow
//!   state) and `refresh_compute` runs on them as a host-pool job while training continues;
//!   the result waits in the job's channel (the back buffer) until the runtime installs it with
//!   `refresh_apply` on the calling thread. `placement = gpu_side` runs on the host pool too.
use super::store::{Loc, Store};
use super::{CpuEngine, EngineStats, Float};
use crate::refresh_runtime::inflight::{Job, JobError, JobOutput};
use crate::refresh_runtime::{HostTaskReport, Outcome, RefreshBackend, RefreshTask};
use crate::EngineError;
use optim::{
    eigenbasis_refresh, refresh_apply, refresh_compute_method, HostEigensolver, Real, RefreshError,
    RefreshOutcome, RefreshResult,
};
use rayon::prelude::*;
use schedule::RefreshMethod;
use std::sync::{mpsc, Arc};

/// The refresh runtime of a CPU engine over `T`.
pub(crate) type Runtime<T> = crate::refresh_runtime::RefreshRuntime<Job<T>>;

fn loc(task: &RefreshTask) -> Loc {
    Loc {
        section: "host_tasks",
        index: task.index,
        op: "eigenbasis_refresh",
    }
}

/// The parts of a [`CpuEngine`] a refresh reads and writes.
struct HostRefresher<'a, T> {
    store: &'a mut Store<T>,
    stats: &'a mut EngineStats,
    solver: &'a Arc<dyn HostEigensolver>,
    /// The kernel pool (swaps: `refresh_apply`'s GEMMs).
    pool: &'a Arc<rayon::ThreadPool>,
    /// The host pool (refresh computations).
    host_pool: &'a Arc<rayon::ThreadPool>,
    /// Offloaded state (moments; a SOAP refresh's factor and basis), brought in around the
    /// refreshes that read or write it.
    tiers: &'a mut super::tiers::Tiers<T>,
}

impl<T: Float + Real> RefreshBackend for HostRefresher<'_, T> {
    type Job = Job<T>;
    type Done = JobOutput<T>;

    fn stats(&mut self) -> &mut EngineStats {
        self.stats
    }

    fn run_now(
        &mut self,
        task: &RefreshTask,
        t: u64,
        init: bool,
        reference: bool,
    ) -> Result<Outcome, EngineError> {
        if reference {
            return self.refresh_synchronously(task, t, init);
        }
        let out = self.compute_inline(task, t, init);
        self.install(task, out)
    }

    /// The `refresh_compute`s of the batch at once on the host pool (each reads only its own
    /// factor and basis), then their installs in order: the same calls on the same inputs as
    /// one after the other, so the same bits. The reference path stays one call at a time.
    fn run_now_batch(
        &mut self,
        batch: &[(RefreshTask, bool)],
        t: u64,
        reference: bool,
    ) -> Result<Vec<Outcome>, EngineError> {
        if reference || batch.len() < 2 {
            return crate::refresh_runtime::run_one_by_one(self, batch, t, reference);
        }
        let outs: Vec<JobOutput<T>> = {
            let this: &Self = self;
            this.host_pool.install(|| {
                batch
                    .par_iter()
                    .map(|(task, init)| this.compute_inline(task, t, *init))
                    .collect()
            })
        };
        batch
            .iter()
            .zip(outs)
            .map(|((task, _), out)| self.install(task, out))
            .collect()
    }

    fn launch(&mut self, task: &RefreshTask, t: u64) -> Result<Option<Job<T>>, EngineError> {
        let factor = Arc::new(self.state(task, task.factor)?);
        let basis = Arc::new(self.state(task, task.basis)?);
        Ok(Some(self.spawn(task, t, factor, basis)))
    }

    fn poll(&mut self, job: &mut Job<T>) -> bool {
        job.poll()
    }

    fn wait(
        &mut self,
        _task: &RefreshTask,
        job: Job<T>,
    ) -> Result<(JobOutput<T>, bool), EngineError> {
        Ok(job.wait())
    }

    /// `refresh_apply` of a computed refresh on the live basis and moments.
    fn install(&mut self, task: &RefreshTask, out: JobOutput<T>) -> Result<Outcome, EngineError> {
        let result: RefreshResult<T> = match task.computed(out)? {
            Ok(result) => result,
            Err(outcome) => return Ok(outcome),
        };
        let (m, n) = self.store.dims2(task.exp_avg);
        let pool = Arc::clone(self.pool);
        if matches!(task.method, RefreshMethod::Qr | RefreshMethod::InverseRoot) {
            // The basis (or root) only: KL-Shampoo's momentum is not an operand, Shampoo has
            // none.
            let paged = self
                .tiers
                .page_in(self.store, &[task.basis, task.factor], loc(task))?;
            let applied = self.store.with_outs(
                loc(task),
                &[("basis", task.basis)],
                &[task.factor],
                |_, o| {
                    let [q] = o else {
                        return Err(task.error("internal: operand count"));
                    };
                    Ok(refresh_apply(&result, q, &mut [], &mut [], m, n))
                },
            );
            self.tiers.page_out(self.store, &paged, loc(task))?;
            return task.outcome(applied?);
        }
        let outs = [
            ("basis", task.basis),
            ("exp_avg", task.exp_avg),
            ("exp_avg_sq", task.exp_avg_sq),
        ];
        let state = [task.exp_avg, task.exp_avg_sq, task.basis, task.factor];
        let paged = self.tiers.page_in(self.store, &state, loc(task))?;
        let applied = self
            .store
            .with_outs(loc(task), &outs, &[task.factor], |_, o| {
                let [q, ea, eas] = o else {
                    return Err(task.error("internal: operand count"));
                };
                Ok(pool.install(|| refresh_apply(&result, q, ea, eas, m, n)))
            });
        self.tiers.page_out(self.store, &paged, loc(task))?;
        task.outcome(applied?)
    }
}

impl<T: Float + Real> HostRefresher<'_, T> {
    /// `refresh_compute` on the live factor and basis, on the host pool (first basis, S = 0).
    fn compute_inline(&self, task: &RefreshTask, t: u64, init: bool) -> JobOutput<T> {
        let (m, n) = self.store.dims2(task.exp_avg);
        let (f, q) = match (self.state(task, task.factor), self.state(task, task.basis)) {
            (Ok(f), Ok(q)) => (f, q),
            (Err(e), _) | (_, Err(e)) => return Err(JobError::Lost(e.to_string())),
        };
        let solver = self.solver.as_ref();
        let t_optim = task.optim_step(t, init);
        let task = *task;
        self.host_pool
            .install(|| compute(solver, &task, t_optim, &f, &q, m, n))
            .map_err(JobError::Refresh)
    }

    /// The contents of `id`, an operand of `task`, wherever it lives (the working store, or
    /// the host or NVMe tier where `tier-placement` moved it).
    fn state(&self, task: &RefreshTask, id: schedule::BufferId) -> Result<Vec<T>, EngineError> {
        if self.tiers.is_offloaded(id) {
            let mut v = vec![T::zero(); self.store.shapes[id.index()].iter().product()];
            self.tiers.read(id, &mut v, loc(task))?;
            Ok(v)
        } else {
            Ok(self.store.f(id)?.to_vec())
        }
    }

    /// The reference path ([`super::EngineOptions::synchronous_refresh`]): one
    /// `optim::eigenbasis_refresh` call on the live buffers, ignoring the staleness.
    fn refresh_synchronously(
        &mut self,
        task: &RefreshTask,
        t: u64,
        init: bool,
    ) -> Result<Outcome, EngineError> {
        if matches!(task.method, RefreshMethod::Qr | RefreshMethod::InverseRoot) {
            let out = self.compute_inline(task, t, init);
            return self.install(task, out);
        }
        let solver = Arc::clone(self.solver);
        let pool = Arc::clone(self.host_pool);
        let (m, n) = self.store.dims2(task.exp_avg);
        let t_optim = task.optim_step(t, init);
        let outs = [
            ("basis", task.basis),
            ("exp_avg", task.exp_avg),
            ("exp_avg_sq", task.exp_avg_sq),
        ];
        let state = [task.exp_avg, task.exp_avg_sq, task.basis, task.factor];
        let paged = self.tiers.page_in(self.store, &state, loc(task))?;
        let outcome: Result<Result<RefreshOutcome, _>, EngineError> =
            self.store
                .with_outs(loc(task), &outs, &[task.factor], |s, o| {
                    let [q, ea, eas] = o else {
                        return Err(task.error("internal: operand count"));
                    };
                    let f = s.f(task.factor)?;
                    Ok(pool.install(|| {
                        eigenbasis_refresh(
                            solver.as_ref(),
                            t_optim,
                            task.frequency,
                            task.side,
                            f,
                            q,
                            ea,
                            eas,
                            m,
                            n,
                        )
                    }))
                });
        self.tiers.page_out(self.store, &paged, loc(task))?;
        task.outcome(outcome?)
    }
}

impl<T: Float + Real> HostRefresher<'_, T> {
    /// Starts the QR refresh of `task` launched at the end of step `t` on the host pool from
    /// the snapshots `factor`, `basis` (kept in the job: a checkpoint records them).
    fn spawn(
        &mut self,
        task: &RefreshTask,
        t: u64,
        factor: Arc<Vec<T>>,
        basis: Arc<Vec<T>>,
    ) -> Job<T> {
        let (m, n) = self.store.dims2(task.exp_avg);
        let solver = Arc::clone(self.solver);
        let (keep_f, keep_b) = (Arc::clone(&factor), Arc::clone(&basis));
        let t_optim = task.optim_step(t, false);
        let task = *task;
        let (tx, rx) = mpsc::channel();
        let name = self.store.names[task.factor.index()].clone();
        self.host_pool.spawn(move || {
            // The trace's slice of this refresh, on its pool thread (`asteria train --trace`).
            let _span =
                tracing::info_span!("refresh", name = name.as_str(), launched = t).entered();
            // One refresh per pool thread, each single-threaded (throughput; see
            // `optim::with_sequential`).
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                optim::with_sequential(|| {
                    compute(solver.as_ref(), &task, t_optim, &factor, &basis, m, n)
                })
            }));
            let out = match out {
                Ok(r) => r.map_err(JobError::Refresh),
                Err(_) => Err(JobError::Lost("refresh worker panicked".into())),
            };
            // The engine may be gone (dropped mid-run): then nobody wants the result.
            let _ = tx.send(out);
        });
        Job::with_inputs(rx, (keep_f, keep_b))
    }
}

impl<T: Float + Real> CpuEngine<T> {
    /// The part of the engine the refresh runtime drives, and the runtime itself.
    fn refresher(&mut self) -> (&mut Runtime<T>, HostRefresher<'_, T>) {
        (
            &mut self.refresh,
            HostRefresher {
                store: &mut self.store,
                stats: &mut self.stats,
                solver: &self.solver,
                pool: &self.pool,
                host_pool: &self.host_pool,
                tiers: &mut self.tiers,
            },
        )
    }

    /// Runs the host tasks at the end of 1-based step `t`
    /// ([`crate::refresh_runtime::RefreshRuntime::step`]): installs the background refreshes
    /// that finished or reached their staleness bound, then runs or launches the refreshes due
    /// now.
    ///
    /// An all-zero factor at a QR refresh keeps the previous basis and is counted in
    /// [`super::EngineStats::zero_factor_refreshes`], not as a failure. A numerical failure
    /// (non-finite factor, eigensolver failure, vanishing non-zero factor, bad basis) keeps the previous basis and moments untouched, is counted per task in
    /// [`super::EngineStats::refresh_failures`] and logged with `tracing::warn!`; with S > 0
    /// it is found when the result is swapped in.
    ///
    /// # Errors
    /// [`EngineError::RefreshFailures`] once one task has failed
    /// `max_consecutive_refresh_failures` times in a row; [`EngineError::Optim`] for a
    /// non-numerical refusal (shape or side mismatch: an engine or plan bug) or a lost worker.
    pub fn run_host_tasks(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        let (runtime, mut backend) = self.refresher();
        runtime.step(t, &mut backend)
    }

    /// Waits for every refresh still in flight and swaps it in, as at the end of step `t`
    /// (e.g. after the last step, before reading bases or moments).
    ///
    /// # Errors
    /// As [`run_host_tasks`](Self::run_host_tasks).
    pub fn finish_refreshes(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        let (runtime, mut backend) = self.refresher();
        runtime.finish(t, &mut backend)
    }

    /// Refreshes currently running (or finished but not yet swapped in).
    pub fn refreshes_in_flight(&self) -> usize {
        self.refresh.in_flight()
    }

    /// Per refresh task, whether its first eigendecomposition succeeded.
    pub fn refreshes_initialized(&self) -> Vec<bool> {
        self.refresh.initialized().to_vec()
    }

    /// Restores [`CpuEngine::refreshes_initialized`] (from a checkpoint).
    ///
    /// # Errors
    /// [`EngineError::Checkpoint`] when the list does not match the plan's tasks.
    pub fn set_refreshes_initialized(&mut self, flags: &[bool]) -> Result<(), EngineError> {
        self.refresh
            .set_initialized(flags)
            .map_err(EngineError::Checkpoint)
    }

    /// Counters, writable (a checkpoint restores the failure counters and skipped steps).
    pub fn stats_mut(&mut self) -> &mut EngineStats {
        &mut self.stats
    }

    /// The refreshes in flight with the snapshots they compute from, in task order (what a
    /// checkpoint records instead of draining them).
    pub fn in_flight_refreshes(&self) -> Vec<crate::checkpoint::InFlightRefresh> {
        self.refresh
            .in_flight_jobs()
            .filter_map(|(task, launched, _, job)| {
                job.inputs()
                    .map(|(f, b)| crate::checkpoint::InFlightRefresh {
                        task,
                        launched,
                        factor: f.iter().map(|&x| Float::to_f64(x)).collect(),
                        basis: b.iter().map(|&x| Float::to_f64(x)).collect(),
                    })
            })
            .collect()
    }

    /// Restarts a checkpoint's refreshes in flight from their snapshots (each recomputes the
    /// result the interrupted run would have installed at its deadline).
    ///
    /// # Errors
    /// [`EngineError::Checkpoint`] for a task not in the plan, one already in flight, or
    /// snapshots of the wrong size.
    pub fn relaunch_refreshes(
        &mut self,
        refreshes: &[crate::checkpoint::InFlightRefresh],
    ) -> Result<(), EngineError> {
        for r in refreshes {
            let task = *self.refresh.tasks().get(r.task).ok_or_else(|| {
                EngineError::Checkpoint(format!("refresh task {} is not in the plan", r.task))
            })?;
            let (want_f, want_b) = (
                self.plan.buffer(task.factor).numel(),
                self.plan.buffer(task.basis).numel(),
            );
            if r.factor.len() != want_f || r.basis.len() != want_b {
                return Err(EngineError::Checkpoint(format!(
                    "refresh task {}: snapshots of {} and {} values, the plan's factor and basis hold {want_f} and {want_b}",
                    r.task,
                    r.factor.len(),
                    r.basis.len()
                )));
            }
            let to_t = |v: &[f64]| Arc::new(v.iter().map(|&x| T::from_f64(x)).collect::<Vec<T>>());
            let (f, b) = (to_t(&r.factor), to_t(&r.basis));
            let (runtime, mut backend) = self.refresher();
            let job = backend.spawn(&task, r.launched, f, b);
            runtime
                .relaunch(r.task, r.launched, job)
                .map_err(EngineError::Checkpoint)?;
        }
        Ok(())
    }
}

/// The refresh `task` computes at (optim) step `t` from `factor` and `basis` (`[d, d]`; the
/// task's moments `[m, n]`): `optim::refresh_compute_method`, or for method `inverse_root` the
/// factor's inverse root (`optim::refresh_compute_inverse_root`).
fn compute<T: Real>(
    solver: &dyn HostEigensolver,
    task: &RefreshTask,
    t: u64,
    factor: &[T],
    basis: &[T],
    m: usize,
    n: usize,
) -> Result<Option<RefreshResult<T>>, RefreshError> {
    match (task.method, task.root) {
        (RefreshMethod::InverseRoot, Some(root)) => {
            let d = if task.side == 0 { m } else { n };
            optim::refresh_compute_inverse_root(
                solver,
                t,
                task.frequency,
                task.side,
                factor,
                d,
                root,
            )
        }
        (method, _) => refresh_compute_method(
            solver,
            t,
            task.frequency,
            method,
            task.side,
            factor,
            basis,
            m,
            n,
        ),
    }
}
