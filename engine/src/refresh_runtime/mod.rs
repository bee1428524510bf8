//! The refresh runtime both engines share: the scheduling of SOAP eigenbasis refreshes
//! ([`schedule::HostTask::EigenbasisRefresh`]) off the critical path with bounded staleness.
//! A backend ([`RefreshBackend`]) supplies only compute and data movement — the CPU engine's
//! host pool, the CUDA engine's side stream and pinned staging; [`RefreshRuntime`] decides,
//! at the end of every step, everything else:
//!
//! - **When a refresh is due** ([`refresh_due`]): the initial eigendecomposition at the end of
//!   step 1, then QR refreshes at the end of the steps t > 1 with
//!   (t − 1 − offset) mod frequency = 0. Until a task's first eigendecomposition succeeded,
//!   each due refresh retries it (a QR refresh of the all-zero initial basis has no rank).
//! - **Synchronous or not.** A first basis, a task with staleness S = 0, and every refresh under
//!   [`EngineOptions::synchronous_refresh`] run at once on the live state
//!   ([`RefreshBackend::run_now`]): the native SOAP behaviour. The synchronous refreshes of one
//!   boundary go to the backend together ([`RefreshBackend::run_now_batch`]), which may compute
//!   them at once (they touch disjoint state).
//! - **Shadow state and double buffering** (S > 0): the backend snapshots the factor (and the
//!   basis) and starts the computation ([`RefreshBackend::launch`]); training continues with the
//!   current basis; the result waits in the backend's back buffer.
//! - **Swap point**: the start of [`RefreshRuntime::step`] (the end of each step, after the
//!   optimizer program, before new refreshes launch) is the one boundary where results are
//!   installed ([`RefreshBackend::install`]), in task order. A finished result is swapped at the
//!   first boundary after it finished, or — the plan's `refresh_swap = deadline`
//!   ([`RefreshRuntime::swap_at_deadline`]) — exactly at its bound (reproducible runs,
//!   resumable bit for bit, at some cost in quality: on Moby Dick, tests/train_real_text.rs, 200
//!   SOAP steps at S = 5, 0.047 nats of validation loss against 0.005); a result launched at the end of step L is swapped at
//!   the end of step L + S at the latest (so the optimizer program of step L + S + 1 uses it),
//!   and only then does the step block on it ([`RefreshBackend::wait`]); a task due again while
//!   its previous refresh is in flight swaps that one in first. Swap staleness
//!   = (step of the swap) − L ∈ [0, S].
//! - **Zero factors**: a QR refresh of an exactly-zero factor (its gradients vanished) keeps
//!   the previous basis and is counted in [`EngineStats::zero_factor_refreshes`], not as a
//!   failure.
//! - **Failures**: a numerical failure keeps the previous basis and moments, is counted per task
//!   in [`EngineStats::refresh_failures`] and logged; a task failing
//!   [`EngineOptions::max_consecutive_refresh_failures`] times in a row stops the run
//!   ([`EngineError::RefreshFailures`]).
//! - **Counters**: the refresh fields of [`EngineStats`] and the per-step [`HostTaskReport`].
//!
//! [`inflight`] holds the in-flight bookkeeping (one refresh per task, deadlines, the swaps of
//! a boundary) and the host-pool job type both engines use.
pub mod inflight;

use crate::cpu::{EngineOptions, EngineStats};
use crate::EngineError;
use inflight::{InFlightSet, JobError, JobOutput, Swap};
use optim::{RefreshError, RefreshOutcome, RefreshResult};
use schedule::{BufferId, HostTask, Placement, Plan, RefreshMethod};
use std::time::Instant;

/// What [`RefreshRuntime::step`] did in one call (the end of one step).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostTaskReport {
    /// Refresh results installed (synchronous ones included).
    pub refreshed: usize,
    /// Refreshes that failed numerically; the previous basis was kept.
    pub failed: usize,
    /// Refreshes due at this step: computations started, synchronous ones (S = 0, t = 1)
    /// included.
    pub launched: usize,
    /// Results swapped in (installed) at this boundary, synchronous ones included
    /// (= `refreshed`).
    pub swapped: usize,
    /// Largest swap staleness (steps between the launching step and this one) over this
    /// call's swaps; `None` when nothing was swapped.
    pub max_swap_staleness: Option<u64>,
    /// Times the step blocked on a background result that was not finished.
    pub waits: usize,
    /// Time blocked on background results, ms.
    pub wait_ms: f64,
}

pub use schedule::refresh_due;

/// The outcome of one refresh as the runtime counts it: installed (`Ok(kind)`;
/// `Ok(Skipped)` = nothing to install) or a numerical failure (`Err(message)`: the previous
/// basis and moments were kept).
pub type Outcome = Result<RefreshOutcome, String>;

/// One `EigenbasisRefresh` host task of the plan: its operands and schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RefreshTask {
    /// Index in `plan.host_tasks`.
    pub index: usize,
    /// The Kronecker factor `[d, d]` f32.
    pub factor: BufferId,
    /// Its eigenbasis `[d, d]` f32.
    pub basis: BufferId,
    /// 0 = left factor (`d = m`), 1 = right factor (`d = n`).
    pub side: u8,
    /// Adam first moment in the eigenbasis, `[m, n]`.
    pub exp_avg: BufferId,
    /// Adam second moment in the eigenbasis, `[m, n]`.
    pub exp_avg_sq: BufferId,
    /// Steps between QR refreshes.
    pub frequency: u64,
    /// Stagger of the QR refreshes within a period, steps.
    pub offset: u64,
    /// Staleness bound S, steps (0 = synchronous).
    pub staleness: u32,
    /// Where the plan runs it.
    pub placement: Placement,
    /// What a refresh computes (SOAP's sort and re-projection, or KL-Shampoo's QR of the
    /// basis alone: then `exp_avg` and `exp_avg_sq` are not operands).
    pub method: RefreshMethod,
    /// The inverse root of a [`RefreshMethod::InverseRoot`] task (Shampoo).
    pub root: Option<schedule::InverseRoot>,
}

impl RefreshTask {
    /// Host task `index` of a plan.
    pub fn of(index: usize, task: &HostTask) -> Self {
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
            method,
            root,
        } = *task;
        RefreshTask {
            method,
            root,
            index,
            factor,
            basis,
            side,
            exp_avg,
            exp_avg_sq,
            frequency,
            offset,
            staleness,
            placement,
        }
    }

    /// Whether the task does work at the end of 1-based step `t` ([`refresh_due`]).
    pub fn due(&self, t: u64) -> bool {
        refresh_due(t, self.frequency, self.offset)
    }

    /// The step to hand `asteria-optim`, which schedules by (t − 1) mod frequency: one that is
    /// due under its rule (t itself when there is no stagger), or 1 for an initial
    /// eigendecomposition (`init`).
    pub fn optim_step(&self, t: u64, init: bool) -> u64 {
        if init {
            1
        } else if self.offset == 0 {
            t
        } else {
            1 + self.frequency
        }
    }

    /// Where errors of this task point: `host_tasks[i] (eigenbasis_refresh)`.
    pub fn location(&self) -> String {
        format!("host_tasks[{}] (eigenbasis_refresh)", self.index)
    }

    /// [`EngineError::Optim`] at this task (an engine or plan bug, never a numerical failure).
    pub fn error(&self, message: impl Into<String>) -> EngineError {
        EngineError::Optim {
            location: self.location(),
            message: message.into(),
        }
    }

    /// Sorts what `asteria-optim` returned: a numerical refusal is a counted failure
    /// (`Ok(Err(message))`); any other (shape or side mismatch) is an engine or plan bug.
    ///
    /// # Errors
    /// [`EngineError::Optim`] for a non-numerical refusal.
    pub fn outcome(
        &self,
        result: Result<RefreshOutcome, RefreshError>,
    ) -> Result<Outcome, EngineError> {
        match result {
            Ok(kind) => Ok(Ok(kind)),
            Err(e) if e.is_numerical() => Ok(Err(e.to_string())),
            Err(e) => Err(self.error(e.to_string())),
        }
    }

    /// Sorts the output of a background computation: a result to install (`Ok(Ok(result))`),
    /// or an outcome that is already final (`Ok(Err(outcome))`: nothing to install — not a
    /// refresh step, or an all-zero factor ([`RefreshOutcome::ZeroFactor`]) — or a numerical
    /// failure).
    ///
    /// # Errors
    /// [`EngineError::Optim`] for a lost worker or a non-numerical refusal.
    pub fn computed<T>(
        &self,
        out: JobOutput<T>,
    ) -> Result<Result<RefreshResult<T>, Outcome>, EngineError> {
        match out {
            Ok(Some(result)) if result.kind() == RefreshOutcome::ZeroFactor => {
                Ok(Err(Ok(RefreshOutcome::ZeroFactor)))
            }
            Ok(Some(result)) => Ok(Ok(result)),
            Ok(None) => Ok(Err(Ok(RefreshOutcome::Skipped))),
            Err(JobError::Refresh(e)) => self.outcome(Err(e)).map(Err),
            Err(JobError::Lost(message)) => Err(self.error(message)),
        }
    }
}

/// What a backend supplies to the [`RefreshRuntime`]: compute and data movement, no
/// scheduling. Every method gets the task ([`RefreshTask`]) and the 1-based step `t` at whose
/// end it runs.
pub trait RefreshBackend {
    /// A refresh computation running off the critical path (it owns the task's shadow state
    /// until it is installed).
    type Job;
    /// A finished computation, ready to install.
    type Done;

    /// The engine's counters, whose refresh fields the runtime updates.
    fn stats(&mut self) -> &mut EngineStats;

    /// Computes and installs the refresh of `task` on the live factor, basis and moments now:
    /// the first eigendecomposition when `init`, else a QR refresh. `reference` asks for the
    /// reference path ([`EngineOptions::synchronous_refresh`]: one
    /// `optim::eigenbasis_refresh` call where the backend has one).
    ///
    /// # Errors
    /// A backend failure or an engine/plan bug; a numerical failure is `Ok(Err(message))`.
    fn run_now(
        &mut self,
        task: &RefreshTask,
        t: u64,
        init: bool,
        reference: bool,
    ) -> Result<Outcome, EngineError>;

    /// The synchronous refreshes of one boundary, `batch` = `(task, init)` in plan order (each
    /// as [`run_now`](Self::run_now)), with their outcomes in the same order. Refreshes of
    /// different tasks read and write disjoint state, so a backend may compute them at once
    /// and install them in any order; the default runs them one after the other. (At the
    /// first step every task's first basis or inverse root is due at once: thousands of
    /// independent eigendecompositions at the 1B scale.)
    ///
    /// # Errors
    /// As [`run_now`](Self::run_now), for the first task that fails that way.
    fn run_now_batch(
        &mut self,
        batch: &[(RefreshTask, bool)],
        t: u64,
        reference: bool,
    ) -> Result<Vec<Outcome>, EngineError>
    where
        Self: Sized,
    {
        run_one_by_one(self, batch, t, reference)
    }

    /// Snapshots the factor (and basis) of `task` and starts a QR refresh on the snapshot,
    /// without waiting for it; `None` when there is nothing to compute.
    ///
    /// # Errors
    /// A backend failure.
    fn launch(&mut self, task: &RefreshTask, t: u64) -> Result<Option<Self::Job>, EngineError>;

    /// Whether `job` is finished (never blocks).
    fn poll(&mut self, job: &mut Self::Job) -> bool;

    /// Blocks until `job` is finished; also returns whether it had to block (the runtime counts
    /// and times those waits).
    ///
    /// # Errors
    /// A lost worker or a backend failure.
    fn wait(
        &mut self,
        task: &RefreshTask,
        job: Self::Job,
    ) -> Result<(Self::Done, bool), EngineError>;

    /// Installs a finished refresh at the current step boundary: basis replaced, `exp_avg`
    /// re-projected, `exp_avg_sq` permuted — or reports its numerical failure, changing
    /// nothing.
    ///
    /// # Errors
    /// A backend failure or an engine/plan bug.
    fn install(&mut self, task: &RefreshTask, done: Self::Done) -> Result<Outcome, EngineError>;

    /// Called once at the end of each [`RefreshRuntime::step`] (the CUDA engine waits for the
    /// compute-stream work of synchronous refreshes here).
    ///
    /// # Errors
    /// A backend failure.
    fn end_boundary(&mut self) -> Result<(), EngineError> {
        Ok(())
    }
}

/// [`RefreshBackend::run_now_batch`] one task after the other: [`RefreshBackend::run_now`] on
/// each, in order (the default, and a backend's fallback for batches it does not parallelise).
///
/// # Errors
/// The first [`RefreshBackend::run_now`] error.
pub fn run_one_by_one<B: RefreshBackend>(
    backend: &mut B,
    batch: &[(RefreshTask, bool)],
    t: u64,
    reference: bool,
) -> Result<Vec<Outcome>, EngineError> {
    batch
        .iter()
        .map(|(task, init)| backend.run_now(task, t, *init, reference))
        .collect()
}

/// The scheduling state of a plan's refreshes: what is in flight, which tasks have a first
/// basis, and the run's refresh options. Generic over the backend's job type `J`.
pub struct RefreshRuntime<J> {
    tasks: Vec<RefreshTask>,
    /// Factor buffer names, per task (logs, errors).
    names: Vec<String>,
    pending: InFlightSet<J>,
    /// Per task: whether its first eigendecomposition succeeded.
    initialized: Vec<bool>,
    /// [`EngineOptions::synchronous_refresh`].
    synchronous: bool,
    /// [`EngineOptions::max_consecutive_refresh_failures`].
    limit: u32,
    /// Install every background result exactly at its deadline (launch step + S), finished
    /// earlier or not: the plan's `refresh_swap = deadline` (reproducible runs; a resumed run
    /// replays the uninterrupted one). Else at the first boundary after it finished.
    at_deadline: bool,
}

impl<J> Default for RefreshRuntime<J> {
    /// A runtime without tasks.
    fn default() -> Self {
        RefreshRuntime {
            tasks: Vec::new(),
            names: Vec::new(),
            pending: InFlightSet::new(0),
            initialized: Vec::new(),
            synchronous: false,
            limit: 1,
            at_deadline: false,
        }
    }
}

impl<J> RefreshRuntime<J> {
    /// Per task, whether its first eigendecomposition succeeded (a checkpoint records it: a
    /// resumed run must not redo a first basis).
    pub fn initialized(&self) -> &[bool] {
        &self.initialized
    }

    /// Restores [`RefreshRuntime::initialized`] from a checkpoint.
    ///
    /// # Errors
    /// A list of another length than the plan's tasks (the message says both).
    pub fn set_initialized(&mut self, flags: &[bool]) -> Result<(), String> {
        if flags.len() != self.initialized.len() {
            return Err(format!(
                "{} refresh tasks recorded, the plan has {}",
                flags.len(),
                self.initialized.len()
            ));
        }
        self.initialized.copy_from_slice(flags);
        Ok(())
    }

    /// The runtime of `plan`'s host tasks under `opts`; nothing in flight.
    pub fn new(plan: &Plan, opts: &EngineOptions) -> Self {
        let tasks: Vec<RefreshTask> = plan
            .host_tasks
            .iter()
            .enumerate()
            .map(|(i, t)| RefreshTask::of(i, t))
            .collect();
        RefreshRuntime {
            names: tasks
                .iter()
                .map(|t| plan.buffer(t.factor).name.clone())
                .collect(),
            pending: InFlightSet::new(tasks.len()),
            initialized: vec![false; tasks.len()],
            synchronous: opts.synchronous_refresh,
            limit: opts.max_consecutive_refresh_failures,
            at_deadline: plan.train.refresh_swap == schedule::RefreshSwap::Deadline,
            tasks,
        }
    }

    /// Whether background results are installed exactly at their deadline (the plan's
    /// `refresh_swap`).
    pub fn swap_at_deadline(&self) -> bool {
        self.at_deadline
    }

    /// Every refresh in flight, in task order: `(task, launched, staleness, job)`.
    pub fn in_flight_jobs(&self) -> impl Iterator<Item = (usize, u64, u32, &J)> {
        self.pending.iter()
    }

    /// Puts back a refresh of `task` launched at the end of step `launched` (a checkpoint's,
    /// recomputed from its snapshots) with the task's staleness bound.
    ///
    /// # Errors
    /// No such task, or one already in flight.
    pub fn relaunch(&mut self, task: usize, launched: u64, job: J) -> Result<(), String> {
        let staleness = self.tasks.get(task).map(|t| t.staleness).ok_or_else(|| {
            format!(
                "refresh task {task} is not in the plan ({} tasks)",
                self.tasks.len()
            )
        })?;
        self.pending
            .launch(task, launched, staleness, job)
            .map_err(|_| format!("refresh task {task} already has a refresh in flight"))
    }

    /// The plan's refresh tasks, in plan order.
    pub fn tasks(&self) -> &[RefreshTask] {
        &self.tasks
    }

    /// Refreshes running (or finished but not swapped in yet).
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The host tasks at the end of 1-based step `t` (see the module docs):
    /// 1. installs the background results that finished, and waits for (then installs) those
    ///    whose staleness bound ends at this step;
    /// 2. for each refresh due now: installs the task's previous refresh if it is still in
    ///    flight (waiting if needed), then runs it synchronously (first basis, S = 0,
    ///    [`EngineOptions::synchronous_refresh`]) or launches it in the background.
    ///
    /// Adds the time spent to [`EngineStats::host_task_ms`].
    ///
    /// # Errors
    /// [`EngineError::RefreshFailures`] once one task has failed
    /// `max_consecutive_refresh_failures` times in a row; the backend's errors.
    pub fn step<B: RefreshBackend<Job = J>>(
        &mut self,
        t: u64,
        backend: &mut B,
    ) -> Result<HostTaskReport, EngineError> {
        let start = Instant::now();
        let mut report = HostTaskReport::default();
        for swap in self
            .pending
            .boundary(t, self.at_deadline, |job| backend.poll(job))
        {
            self.swap(backend, swap, t, &mut report)?;
        }
        // Synchronous refreshes due now, run together after the loop: (task index, init).
        let mut now: Vec<(usize, bool)> = Vec::new();
        for index in 0..self.tasks.len() {
            let task = self.tasks[index];
            if !task.due(t) {
                continue;
            }
            if self.pending.is_in_flight(index) {
                let swap = Swap {
                    task: index,
                    wait: true,
                };
                self.swap(backend, swap, t, &mut report)?;
            }
            report.launched += 1;
            backend.stats().refreshes_launched += 1;
            let init = t == 1 || !self.initialized[index];
            let name = self.names[index].as_str();
            if self.synchronous || init || task.staleness == 0 {
                now.push((index, init));
            } else if let Some(job) = tracing::info_span!("refresh launch", name, step = t)
                .in_scope(|| backend.launch(&task, t))?
            {
                self.pending
                    .launch(index, t, task.staleness, job)
                    .map_err(|_| {
                        task.error("internal: a refresh is already in flight for this task")
                    })?;
            }
        }
        if !now.is_empty() {
            let batch: Vec<(RefreshTask, bool)> =
                now.iter().map(|&(i, init)| (self.tasks[i], init)).collect();
            let outcomes =
                tracing::info_span!("refreshes (synchronous)", count = batch.len(), step = t)
                    .in_scope(|| backend.run_now_batch(&batch, t, self.synchronous))?;
            if outcomes.len() != now.len() {
                return Err(EngineError::Unsupported(format!(
                    "internal: {} outcomes for {} synchronous refreshes",
                    outcomes.len(),
                    now.len()
                )));
            }
            for (&(index, _), outcome) in now.iter().zip(outcomes) {
                self.count(backend.stats(), &mut report, index, t, t, outcome)?;
            }
        }
        backend.end_boundary()?;
        backend.stats().host_task_ms += start.elapsed().as_secs_f64() * 1e3;
        Ok(report)
    }

    /// Waits for every refresh in flight and installs it, as at the end of step `t` (after the
    /// last step, before reading bases or moments).
    ///
    /// # Errors
    /// As [`step`](Self::step).
    pub fn finish<B: RefreshBackend<Job = J>>(
        &mut self,
        t: u64,
        backend: &mut B,
    ) -> Result<HostTaskReport, EngineError> {
        let mut report = HostTaskReport::default();
        for task in self.pending.tasks() {
            self.swap(backend, Swap { task, wait: true }, t, &mut report)?;
        }
        Ok(report)
    }

    /// Takes the in-flight refresh of `swap.task` (blocking when it is not finished) and
    /// installs it as at the end of step `t`.
    fn swap<B: RefreshBackend<Job = J>>(
        &mut self,
        backend: &mut B,
        swap: Swap,
        t: u64,
        report: &mut HostTaskReport,
    ) -> Result<(), EngineError> {
        let Some(flight) = self.pending.take(swap.task) else {
            return Ok(());
        };
        let task = self.tasks[swap.task];
        let name = self.names[swap.task].as_str();
        let start = Instant::now();
        let (done, blocked) = tracing::info_span!("refresh wait", name, step = t)
            .in_scope(|| backend.wait(&task, flight.job))?;
        if blocked {
            let ms = start.elapsed().as_secs_f64() * 1e3;
            report.waits += 1;
            report.wait_ms += ms;
            let stats = backend.stats();
            stats.refresh_waits += 1;
            stats.refresh_wait_ms += ms;
            tracing::debug!(
                step = t,
                task = swap.task,
                launched = flight.launched,
                wait_ms = ms,
                "waited for an eigenbasis refresh at its staleness bound"
            );
        }
        let outcome =
            tracing::info_span!("refresh swap", name, step = t, launched = flight.launched)
                .in_scope(|| backend.install(&task, done))?;
        self.count(
            backend.stats(),
            report,
            swap.task,
            flight.launched,
            t,
            outcome,
        )
    }

    /// Counts the outcome of one refresh of task `index`, launched at the end of step
    /// `launched` and settled at the end of step `step`: an installed result (not `Skipped`)
    /// is a swap of staleness `step − launched` and resets the task's failure run (an
    /// `Initialized` one marks the task initialised); an all-zero factor (`ZeroFactor`) is
    /// counted in [`EngineStats::zero_factor_refreshes`], neither a swap nor a failure; a
    /// numerical failure is counted, logged
    /// with `tracing::warn!`, and stops the run once the task has failed `limit` times in a
    /// row.
    fn count(
        &mut self,
        stats: &mut EngineStats,
        report: &mut HostTaskReport,
        index: usize,
        launched: u64,
        step: u64,
        outcome: Outcome,
    ) -> Result<(), EngineError> {
        match outcome {
            Ok(RefreshOutcome::Skipped) => Ok(()),
            Ok(RefreshOutcome::ZeroFactor) => {
                // Not a failure and not a swap: the factor's gradients vanished, the previous
                // basis stays. The failure run is left as it is.
                stats.zero_factor_refreshes += 1;
                let factor = self.names.get(index).map_or("", String::as_str);
                tracing::debug!(step, launched, task = index, factor = %factor,
                    "eigenbasis refresh skipped: the factor is all zero; keeping the previous basis");
                Ok(())
            }
            Ok(kind) => {
                if kind == RefreshOutcome::Initialized {
                    if let Some(flag) = self.initialized.get_mut(index) {
                        *flag = true;
                    }
                }
                let staleness = step.saturating_sub(launched);
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
                let factor = self.names.get(index).map_or("", String::as_str);
                tracing::warn!(step, launched, task = index, factor = %factor, consecutive = run,
                    error = %msg, "eigenbasis refresh failed; keeping the previous basis");
                if run >= self.limit {
                    return Err(EngineError::RefreshFailures {
                        task: index,
                        factor: factor.to_string(),
                        failures: run,
                        limit: self.limit,
                        last: msg,
                    });
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend whose background jobs finish after `polls` polls and whose refreshes succeed
    /// unless `fail` is set; it logs what the runtime asked of it.
    #[derive(Default)]
    struct Fake {
        stats: EngineStats,
        polls: u32,
        fail: bool,
        log: Vec<String>,
    }

    impl RefreshBackend for Fake {
        type Job = (u64, u32);
        type Done = u64;
        fn stats(&mut self) -> &mut EngineStats {
            &mut self.stats
        }
        fn run_now(
            &mut self,
            task: &RefreshTask,
            t: u64,
            init: bool,
            _: bool,
        ) -> Result<Outcome, EngineError> {
            self.log
                .push(format!("now {} t{t} init {init}", task.index));
            Ok(match (self.fail, init) {
                (true, _) => Err("bad".into()),
                (false, true) => Ok(RefreshOutcome::Initialized),
                (false, false) => Ok(RefreshOutcome::Refreshed),
            })
        }
        fn launch(
            &mut self,
            task: &RefreshTask,
            t: u64,
        ) -> Result<Option<(u64, u32)>, EngineError> {
            self.log.push(format!("launch {} t{t}", task.index));
            Ok(Some((t, self.polls)))
        }
        fn poll(&mut self, job: &mut (u64, u32)) -> bool {
            job.1 = job.1.saturating_sub(1);
            job.1 == 0
        }
        fn wait(&mut self, _: &RefreshTask, job: (u64, u32)) -> Result<(u64, bool), EngineError> {
            Ok((job.0, job.1 > 0))
        }
        fn install(&mut self, task: &RefreshTask, launched: u64) -> Result<Outcome, EngineError> {
            self.log
                .push(format!("install {} from t{launched}", task.index));
            Ok(if self.fail {
                Err("bad".into())
            } else {
                Ok(RefreshOutcome::Refreshed)
            })
        }
    }

    fn runtime(staleness: u32, limit: u32) -> RefreshRuntime<(u64, u32)> {
        let task = RefreshTask::of(
            0,
            &HostTask::EigenbasisRefresh {
                factor: BufferId(0),
                basis: BufferId(1),
                side: 0,
                exp_avg: BufferId(2),
                exp_avg_sq: BufferId(3),
                frequency: 4,
                offset: 0,
                staleness,
                placement: Placement::Host,
                method: RefreshMethod::Soap,
                root: None,
            },
        );
        RefreshRuntime {
            tasks: vec![task],
            names: vec!["L".into()],
            pending: InFlightSet::new(1),
            initialized: vec![false],
            synchronous: false,
            limit,
            at_deadline: false,
        }
    }

    #[test]
    fn first_basis_is_synchronous_and_slow_results_are_waited_for_at_the_bound() {
        let mut rt = runtime(2, 3);
        let mut b = Fake {
            polls: 100,
            stats: EngineStats {
                refresh_failures: vec![0],
                consecutive_refresh_failures: vec![0],
                ..EngineStats::default()
            },
            ..Fake::default()
        };
        for t in 1..=8 {
            let r = rt.step(t, &mut b).expect("step");
            assert_eq!(r.waits, usize::from(t == 7), "t = {t}");
        }
        assert_eq!(
            b.log,
            ["now 0 t1 init true", "launch 0 t5", "install 0 from t5"]
        );
        assert_eq!((b.stats.refresh_swaps, b.stats.max_swap_staleness), (2, 2));
        assert_eq!(b.stats.refreshes_launched, 2);
    }

    #[test]
    fn consecutive_failures_stop_the_run_at_the_limit() {
        let mut rt = runtime(0, 2);
        let mut b = Fake {
            fail: true,
            stats: EngineStats {
                refresh_failures: vec![0],
                consecutive_refresh_failures: vec![0],
                ..EngineStats::default()
            },
            ..Fake::default()
        };
        let r = rt.step(1, &mut b).expect("one failure is tolerated");
        assert_eq!(r.failed, 1);
        // The first basis never succeeded: step 5 retries the eigendecomposition.
        let e = rt.step(5, &mut b).expect_err("second failure in a row");
        assert!(
            matches!(e, EngineError::RefreshFailures { failures: 2, .. }),
            "{e}"
        );
        assert_eq!(b.log, ["now 0 t1 init true", "now 0 t5 init true"]);
    }

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
