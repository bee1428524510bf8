//! Host tasks: SOAP eigenbasis refreshes through the configured [`optim::HostEigensolver`] on
//! the engine's host pool (a rayon pool separate from the kernel pool, so eigensolver threads
//! never share a core's AVX state with the kernels' threads), off the critical path with
//! bounded staleness.
//!
//! **Shadow states and double buffering.** When a refresh with staleness S > 0 is due at the
//! end of step t, the factor and the current basis are copied (the shadow state) and
//! [`optim::refresh_compute`] runs on them on the host pool while training continues with the
//! current basis. The result waits in a back buffer (the job's channel).
//!
//! **Swap point.** The start of [`CpuEngine::run_host_tasks`] (the end of each step, after the
//! optimizer program and before new refreshes launch) is the one step boundary where results
//! are swapped in, with [`optim::refresh_apply`] on the calling thread, in task order, so the
//! moments of both sides of a parameter are rewritten one side after the other. A finished
//! result is swapped at the first boundary after it finished; a result launched at the end of
//! step L is swapped at the end of step L + S at the latest (so the optimizer program of step
//! L + S + 1 uses it), and only then does the engine block on it. Swap staleness = (step of
//! the swap) − L ∈ [0, S]. S = 0 (and the first basis, t = 1) computes and applies inline:
//! the native synchronous refresh, bit-identical to [`optim::eigenbasis_refresh`].
use super::inflight::{InFlightSet, Job, JobError, JobOutput, Swap};
use super::store::Loc;
use super::{CpuEngine, Float};
use crate::EngineError;
use optim::{
    eigenbasis_refresh, refresh_apply, refresh_compute, Real, RefreshError, RefreshOutcome,
};
use schedule::{BufferId, HostTask};
use std::sync::{mpsc, Arc};
use std::time::Instant;

/// What [`CpuEngine::run_host_tasks`] did in one call (the end of one step).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostTaskReport {
    /// Refresh results installed (inline ones included).
    pub refreshed: usize,
    /// Refreshes that failed numerically; the previous basis was kept.
    pub failed: usize,
    /// Refresh computations started (inline S = 0 ones and t = 1 included).
    pub launched: usize,
    /// Results swapped in (installed) at this boundary, inline ones included (= `refreshed`).
    pub swapped: usize,
    /// Largest swap staleness (steps between the launching step and this one) over this
    /// call's swaps; `None` when nothing was swapped.
    pub max_swap_staleness: Option<u64>,
    /// Times the engine blocked on a background result that was not finished.
    pub waits: usize,
    /// Time blocked on background results, ms.
    pub wait_ms: f64,
}

/// Whether an `EigenbasisRefresh` with `frequency` and stagger `offset` does work at the end of
/// 1-based step `t`: the initial eigendecomposition at t = 1, then QR refreshes at t > 1 with
/// `(t − 1 − offset) mod frequency = 0` (the first one at t = 1 + offset when offset > 0, as
/// the plan format documents; offset 0 is the reference schedule 1, 1 + f, 1 + 2f, ...).
pub fn refresh_due(t: u64, frequency: u64, offset: u64) -> bool {
    t == 1 || (t > 1 && t > offset && frequency > 0 && (t - 1 - offset) % frequency == 0)
}

/// Which refresh [`count_refresh_outcome`] counts: host task `task` of factor `factor`,
/// launched at the end of step `launched`, settled at the end of step `step`, with the run's
/// limit of consecutive failures.
#[derive(Clone, Copy, Debug)]
pub struct RefreshEvent<'a> {
    /// Host task index.
    pub task: usize,
    /// The factor's buffer name (for logs and errors).
    pub factor: &'a str,
    /// 1-based step whose end launched the refresh.
    pub launched: u64,
    /// 1-based step whose end installs (or drops) the result.
    pub step: u64,
    /// `EngineOptions::max_consecutive_refresh_failures`.
    pub limit: u32,
}

/// Counts the outcome of one eigenbasis refresh the same way on every engine: an installed
/// result (`Ok(kind)`, not `Skipped`) is a swap of staleness `step − launched` and resets the
/// task's failure run (an `Initialized` one marks the task initialised); a numerical failure
/// (`Err(message)`: the previous basis was kept) is counted, logged with `tracing::warn!`, and
/// stops the run once the task has failed `limit` times in a row.
///
/// # Errors
/// [`EngineError::RefreshFailures`] at the limit.
pub fn count_refresh_outcome(
    stats: &mut super::EngineStats,
    report: &mut HostTaskReport,
    initialized: &mut [bool],
    ev: RefreshEvent<'_>,
    outcome: Result<RefreshOutcome, String>,
) -> Result<(), EngineError> {
    let index = ev.task;
    match outcome {
        Ok(RefreshOutcome::Skipped) => Ok(()),
        Ok(kind) => {
            if kind == RefreshOutcome::Initialized {
                if let Some(flag) = initialized.get_mut(index) {
                    *flag = true;
                }
            }
            let staleness = ev.step.saturating_sub(ev.launched);
            report.refreshed += 1;
            report.swapped += 1;
            report.max_swap_staleness = report.max_swap_staleness.max(Some(staleness));
            stats.refreshes += 1;
            stats.refresh_swaps += 1;
            stats.swap_staleness_sum += staleness;
            stats.max_swap_staleness = stats.max_swap_staleness.max(staleness);
            if let Some(run) = stats.consecutive_refresh_failures.get_mut(index) {
                *run = 0;
            }
            Ok(())
        }
        Err(msg) => {
            report.failed += 1;
            if let Some(n) = stats.refresh_failures.get_mut(index) {
                *n += 1;
            }
            let run = match stats.consecutive_refresh_failures.get_mut(index) {
                Some(run) => {
                    *run += 1;
                    *run
                }
                None => 1,
            };
            tracing::warn!(step = ev.step, launched = ev.launched, task = index, factor = %ev.factor,
                consecutive = run, error = %msg, "eigenbasis refresh failed; keeping the previous basis");
            if run >= ev.limit {
                return Err(EngineError::RefreshFailures {
                    task: index,
                    factor: ev.factor.to_string(),
                    failures: run,
                    limit: ev.limit,
                    last: msg,
                });
            }
            Ok(())
        }
    }
}

/// The operands of one `EigenbasisRefresh` task.
#[derive(Clone, Copy)]
struct Task {
    factor: BufferId,
    basis: BufferId,
    side: u8,
    exp_avg: BufferId,
    exp_avg_sq: BufferId,
    frequency: u64,
    offset: u64,
    staleness: u32,
}

impl Task {
    fn of(task: &HostTask) -> Self {
        let HostTask::EigenbasisRefresh {
            factor,
            basis,
            side,
            exp_avg,
            exp_avg_sq,
            frequency,
            offset,
            staleness,
            ..
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
        }
    }

    /// asteria-optim schedules by (t − 1) mod frequency; hand it a step that is due under its
    /// rule (t itself when there is no stagger), or 1 for an initial eigendecomposition.
    fn optim_step(&self, t: u64, init: bool) -> u64 {
        if init {
            1
        } else if self.offset == 0 {
            t
        } else {
            1 + self.frequency
        }
    }
}

/// The in-flight refreshes of an engine over `T`.
pub(crate) type Pending<T> = InFlightSet<Job<T>>;

fn loc(index: usize) -> Loc {
    Loc {
        section: "host_tasks",
        index,
        op: "eigenbasis_refresh",
    }
}

impl<T: Float + Real> CpuEngine<T> {
    /// Runs the host tasks at the end of 1-based step `t` (see
    /// [`schedule::HostTask::EigenbasisRefresh`] for the schedule and the module docs for the
    /// swap point):
    /// 1. swaps in the background results that finished, and waits for (then swaps in) those
    ///    whose staleness bound ends at this step;
    /// 2. for each refresh due now: swaps in the task's previous refresh if it is still in
    ///    flight (waiting if needed), then at t = 1 (or while the task's first
    ///    eigendecomposition has not succeeded: it is retried at each due step) or S = 0
    ///    computes and applies inline, else
    ///    snapshots the factor and basis and launches [`optim::refresh_compute`] on the host
    ///    pool (`placement = gpu_side` runs there too on this engine).
    ///
    /// A numerical failure (non-finite factor, eigensolver failure, all-zero factor, bad
    /// basis) keeps the previous basis and moments untouched, is counted per task in
    /// [`super::EngineStats::refresh_failures`] and logged with `tracing::warn!`; with S > 0
    /// it is found when the result is swapped in.
    ///
    /// # Errors
    /// [`EngineError::RefreshFailures`] once one task has failed
    /// `max_consecutive_refresh_failures` times in a row; [`EngineError::Optim`] for a
    /// non-numerical refusal (shape or side mismatch: an engine or plan bug) or a lost worker.
    pub fn run_host_tasks(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        let start = Instant::now();
        let mut report = HostTaskReport::default();
        for swap in self.pending.boundary(t, Job::poll) {
            self.swap(swap, t, &mut report)?;
        }
        for index in 0..self.plan.host_tasks.len() {
            let task = Task::of(&self.plan.host_tasks[index]);
            if !refresh_due(t, task.frequency, task.offset) {
                continue;
            }
            if self.pending.is_in_flight(index) {
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
            // Until a first eigendecomposition succeeded, every due refresh retries it (a QR
            // refresh of the all-zero initial basis has no rank and would fail forever).
            let init = t == 1 || !self.initialized[index];
            if self.opts.synchronous_refresh {
                self.refresh_synchronously(index, task, t, init, &mut report)?;
            } else if init || task.staleness == 0 {
                let out = self.compute_inline(task, t, init);
                self.settle(index, task, t, t, out, &mut report)?;
            } else {
                self.launch(index, task, t)?;
            }
        }
        self.stats.host_task_ms += start.elapsed().as_secs_f64() * 1e3;
        Ok(report)
    }

    /// Waits for every refresh still in flight and swaps it in, as at the end of step `t`
    /// (e.g. after the last step, before reading bases or moments).
    ///
    /// # Errors
    /// As [`run_host_tasks`](Self::run_host_tasks).
    pub fn finish_refreshes(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        let mut report = HostTaskReport::default();
        for task in self.pending.tasks() {
            self.swap(Swap { task, wait: true }, t, &mut report)?;
        }
        Ok(report)
    }

    /// Refreshes currently running (or finished but not yet swapped in).
    pub fn refreshes_in_flight(&self) -> usize {
        self.pending.len()
    }

    /// `refresh_compute` on the live factor and basis, on the host pool (S = 0 and t = 1).
    fn compute_inline(&self, task: Task, t: u64, init: bool) -> JobOutput<T> {
        let (m, n) = self.store.dims2(task.exp_avg);
        let (f, q) = match (self.store.f(task.factor), self.store.f(task.basis)) {
            (Ok(f), Ok(q)) => (f, q),
            (Err(e), _) | (_, Err(e)) => return Err(JobError::Lost(e.to_string())),
        };
        let solver = self.solver.as_ref();
        let t_optim = task.optim_step(t, init);
        self.host_pool
            .install(|| refresh_compute(solver, t_optim, task.frequency, task.side, f, q, m, n))
            .map_err(JobError::Refresh)
    }

    /// Snapshots the factor and basis of `task` and starts `refresh_compute` on the host pool.
    fn launch(&mut self, index: usize, task: Task, t: u64) -> Result<(), EngineError> {
        let (m, n) = self.store.dims2(task.exp_avg);
        let factor = self.store.f(task.factor)?.to_vec();
        let basis = self.store.f(task.basis)?.to_vec();
        let solver = Arc::clone(&self.solver);
        let t_optim = task.optim_step(t, false);
        let (tx, rx) = mpsc::channel();
        self.host_pool.spawn(move || {
            // One refresh per pool thread, each single-threaded (throughput; see
            // `optim::with_sequential`).
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                optim::with_sequential(|| {
                    refresh_compute(
                        solver.as_ref(),
                        t_optim,
                        task.frequency,
                        task.side,
                        &factor,
                        &basis,
                        m,
                        n,
                    )
                })
            }));
            let out = match out {
                Ok(r) => r.map_err(JobError::Refresh),
                Err(_) => Err(JobError::Lost("refresh worker panicked".into())),
            };
            // The engine may be gone (dropped mid-run): then nobody wants the result.
            let _ = tx.send(out);
        });
        self.pending
            .launch(index, t, task.staleness, Job::new(rx))
            .map_err(|_| EngineError::Optim {
                location: loc(index).to_string(),
                message: "internal: a refresh is already in flight for this task".into(),
            })
    }

    /// Takes the in-flight refresh of `swap.task` (blocking when it is not finished) and
    /// installs it as at the end of step `t`.
    fn swap(&mut self, swap: Swap, t: u64, report: &mut HostTaskReport) -> Result<(), EngineError> {
        let Some(flight) = self.pending.take(swap.task) else {
            return Ok(());
        };
        let start = Instant::now();
        let (out, blocked) = flight.job.wait();
        if blocked {
            let ms = start.elapsed().as_secs_f64() * 1e3;
            report.waits += 1;
            report.wait_ms += ms;
            self.stats.refresh_waits += 1;
            self.stats.refresh_wait_ms += ms;
            tracing::debug!(
                step = t,
                task = swap.task,
                launched = flight.launched,
                wait_ms = ms,
                "waited for an eigenbasis refresh at its staleness bound"
            );
        }
        let task = Task::of(&self.plan.host_tasks[swap.task]);
        self.settle(swap.task, task, flight.launched, t, out, report)
    }

    /// Installs a computed refresh of task `index` (launched at the end of step `launched`)
    /// at the end of step `t` with `refresh_apply`, or counts its failure.
    fn settle(
        &mut self,
        index: usize,
        task: Task,
        launched: u64,
        t: u64,
        out: JobOutput<T>,
        report: &mut HostTaskReport,
    ) -> Result<(), EngineError> {
        let applied = match out {
            Ok(None) => return Ok(()),
            Ok(Some(result)) => {
                let (m, n) = self.store.dims2(task.exp_avg);
                let outs = [
                    ("basis", task.basis),
                    ("exp_avg", task.exp_avg),
                    ("exp_avg_sq", task.exp_avg_sq),
                ];
                let pool = Arc::clone(&self.pool);
                self.store
                    .with_outs(loc(index), &outs, &[task.factor], |_, o| {
                        let [q, ea, eas] = o else {
                            return Err(EngineError::Optim {
                                location: loc(index).to_string(),
                                message: "internal: operand count".into(),
                            });
                        };
                        Ok(pool.install(|| refresh_apply(&result, q, ea, eas, m, n)))
                    })?
            }
            Err(JobError::Refresh(e)) => Err(e),
            Err(JobError::Lost(message)) => {
                return Err(EngineError::Optim {
                    location: loc(index).to_string(),
                    message,
                })
            }
        };
        self.record(index, task, launched, t, applied, report)
    }

    /// Counts the outcome of one refresh of task `index` ([`count_refresh_outcome`]); a
    /// non-numerical refusal is an engine or plan bug and stops the run.
    fn record(
        &mut self,
        index: usize,
        task: Task,
        launched: u64,
        t: u64,
        outcome: Result<RefreshOutcome, RefreshError>,
        report: &mut HostTaskReport,
    ) -> Result<(), EngineError> {
        let outcome = match outcome {
            Ok(kind) => Ok(kind),
            Err(e) if e.is_numerical() => Err(e.to_string()),
            Err(e) => {
                return Err(EngineError::Optim {
                    location: loc(index).to_string(),
                    message: e.to_string(),
                })
            }
        };
        let name = self.store.names[task.factor.index()].clone();
        count_refresh_outcome(
            &mut self.stats,
            report,
            &mut self.initialized,
            RefreshEvent {
                task: index,
                factor: &name,
                launched,
                step: t,
                limit: self.opts.max_consecutive_refresh_failures,
            },
            outcome,
        )
    }

    /// The reference path ([`super::EngineOptions::synchronous_refresh`]): one
    /// `optim::eigenbasis_refresh` call on the live buffers, ignoring the staleness.
    fn refresh_synchronously(
        &mut self,
        index: usize,
        task: Task,
        t: u64,
        init: bool,
        report: &mut HostTaskReport,
    ) -> Result<(), EngineError> {
        let solver = Arc::clone(&self.solver);
        let pool = Arc::clone(&self.host_pool);
        let (m, n) = self.store.dims2(task.exp_avg);
        let t_optim = task.optim_step(t, init);
        let outs = [
            ("basis", task.basis),
            ("exp_avg", task.exp_avg),
            ("exp_avg_sq", task.exp_avg_sq),
        ];
        let outcome = self
            .store
            .with_outs(loc(index), &outs, &[task.factor], |s, o| {
                let [q, ea, eas] = o else {
                    return Err(EngineError::Optim {
                        location: loc(index).to_string(),
                        message: "internal: operand count".into(),
                    });
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
            })?;
        self.record(index, task, t, t, outcome, report)
    }
}

#[cfg(test)]
mod tests {
    use super::refresh_due;

    #[test]
    fn refresh_schedule_follows_frequency_and_offset() {
        let due = |f, o| {
            (1..=12)
                .filter(|&t| refresh_due(t, f, o))
                .collect::<Vec<u64>>()
        };
        assert_eq!(due(10, 0), vec![1, 11]);
        assert_eq!(due(3, 0), vec![1, 4, 7, 10]);
        assert_eq!(due(3, 1), vec![1, 2, 5, 8, 11]);
        assert_eq!(due(3, 2), vec![1, 3, 6, 9, 12]);
    }
}
