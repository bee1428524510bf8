//! Refreshes the CUDA engine computes and installs on the host from downloaded state with the
//! CPU engine's functions (`optim`): the synchronous refresh of a `placement = host` task, the
//! install of a checkpoint's refreshes in flight at a resume, and the basis-only installs of
//! `RefreshMethod::Qr` (KL-Shampoo) and `RefreshMethod::InverseRoot` (Shampoo: the root
//! into the `basis` operand) tasks, whose moments are never downloaded or written. The
//! scheduling and the asynchronous paths (snapshots and results through pinned memory, the
//! side stream) are in `tasks`.
use super::tasks::{basis_only_method, dim, host_compute, CudaJob};
use super::{cuda_err, CudaEngine};
use crate::error::CudaError;
use engine::refresh_runtime::inflight::{JobError, JobOutput};
use engine::refresh_runtime::{Outcome, RefreshTask};
use engine::EngineError;
use optim::{RefreshError, RefreshOutcome, RefreshResult};
use rayon::prelude::*;
use std::sync::Arc;

/// Synchronous host refreshes whose state [`CudaEngine::refresh_now_host_batch`] holds on the
/// host at once, per host-pool thread: it bounds the host memory of a batch (LLaMA 1.44B's
/// Shampoo with blocks of 1024 has 2,898 inverse roots, each a 4 MiB factor, basis and result)
/// while keeping every worker busy.
const HOST_BATCH_PER_THREAD: usize = 4;

/// What one synchronous host refresh reads, downloaded ([`CudaEngine::host_input`]).
enum HostInput {
    /// A SOAP task: factor `f`, and basis, `exp_avg`, `exp_avg_sq` (`[d, d]`, `[m, n]`,
    /// `[m, n]` f32), updated in place by `optim::eigenbasis_refresh` at optim step `t`.
    Soap {
        task: RefreshTask,
        t: u64,
        f: Vec<f32>,
        state: [Vec<f32>; 3],
        m: usize,
        n: usize,
    },
    /// A `RefreshMethod::Qr` / `RefreshMethod::InverseRoot` task: factor and basis (`[d, d]`
    /// f32), read by [`host_compute`] at optim step `t`.
    BasisOnly {
        task: RefreshTask,
        t: u64,
        f: Vec<f32>,
        q: Vec<f32>,
        m: usize,
        n: usize,
    },
}

/// What a synchronous host refresh computed, to install ([`CudaEngine::host_install`]).
enum HostComputed {
    /// `optim::eigenbasis_refresh`'s outcome and the state it updated.
    Soap(Result<RefreshOutcome, RefreshError>, [Vec<f32>; 3]),
    /// [`host_compute`]'s result.
    BasisOnly(Result<Option<RefreshResult<f32>>, RefreshError>),
}

impl HostInput {
    /// The CPU engine's refresh on this input (any thread: it touches no engine state).
    fn compute(self, solver: &dyn optim::HostEigensolver) -> HostComputed {
        match self {
            HostInput::Soap {
                task,
                t,
                f,
                state: [mut q, mut ea, mut eas],
                m,
                n,
            } => {
                let out = optim::eigenbasis_refresh(
                    solver,
                    t,
                    task.frequency,
                    task.side,
                    &f,
                    &mut q,
                    &mut ea,
                    &mut eas,
                    m,
                    n,
                );
                HostComputed::Soap(out, [q, ea, eas])
            }
            HostInput::BasisOnly {
                task,
                t,
                f,
                q,
                m,
                n,
            } => HostComputed::BasisOnly(host_compute(solver, &task, t, &f, &q, m, n)),
        }
    }
}

impl CudaEngine {
    /// The host half of a synchronous refresh (`tasks`' `refresh_now`): the CPU engine's call
    /// (`optim::eigenbasis_refresh`) on the downloaded factor, basis and moments, on the host
    /// pool, and the new state uploaded; a `RefreshMethod::Qr` task's basis alone, a
    /// `RefreshMethod::InverseRoot` task's root alone.
    pub(super) fn refresh_now_host(
        &mut self,
        task: &RefreshTask,
        t: u64,
        init: bool,
    ) -> Result<Outcome, EngineError> {
        let input = self.host_input(task, t, init)?;
        let solver = Arc::clone(&self.solver);
        let computed = self.host_pool()?.install(|| input.compute(solver.as_ref()));
        self.host_install(task, computed)
    }

    /// The host halves of the synchronous refreshes `batch[i]` for `i` in `which` (all placed
    /// on the host), their outcomes in that order: per chunk of at most
    /// [`HOST_BATCH_PER_THREAD`] × the host pool's threads, the state is downloaded on this
    /// thread, the refreshes are computed at once on the host pool (one task per worker), and
    /// the results are installed here in order. The same functions as [`refresh_now_host`]
    /// on the same inputs, so the result is that of running them one after the other.
    ///
    /// [`refresh_now_host`]: CudaEngine::refresh_now_host
    pub(super) fn refresh_now_host_batch(
        &mut self,
        batch: &[(RefreshTask, bool)],
        which: &[usize],
        t: u64,
    ) -> Result<Vec<Outcome>, EngineError> {
        let pool = self.host_pool()?;
        let chunk = (pool.current_num_threads() * HOST_BATCH_PER_THREAD).max(1);
        let solver = Arc::clone(&self.solver);
        let mut out = Vec::with_capacity(which.len());
        for part in which.chunks(chunk) {
            let mut inputs = Vec::with_capacity(part.len());
            for &i in part {
                let (task, init) = &batch[i];
                inputs.push(self.host_input(task, t, *init)?);
            }
            let solver = solver.as_ref();
            // Several refreshes at once: one per pool thread, each single-threaded (as the
            // asynchronous host jobs run; nested parallel eigensolves only contend). One alone
            // keeps the pool's threads.
            let alone = inputs.len() == 1;
            let computed: Vec<HostComputed> = pool.install(|| {
                inputs
                    .into_par_iter()
                    .map(|input| {
                        if alone {
                            input.compute(solver)
                        } else {
                            optim::with_sequential(|| input.compute(solver))
                        }
                    })
                    .collect()
            });
            for (&i, c) in part.iter().zip(computed) {
                out.push(self.host_install(&batch[i].0, c)?);
            }
        }
        Ok(out)
    }

    /// Downloads what the host refresh of `task` reads: the factor and basis, and for a SOAP
    /// task the moments it re-projects.
    fn host_input(&self, task: &RefreshTask, t: u64, init: bool) -> Result<HostInput, EngineError> {
        let e = |err| cuda_err("eigenbasis refresh", err);
        let (m, n) = self.dims(task.exp_avg);
        let f = self.dev.download::<f32>(self.b(task.factor)).map_err(e)?;
        let t_optim = task.optim_step(t, init);
        if basis_only_method(task.method) {
            let q = self.dev.download::<f32>(self.b(task.basis)).map_err(e)?;
            return Ok(HostInput::BasisOnly {
                task: *task,
                t: t_optim,
                f,
                q,
                m,
                n,
            });
        }
        let [q, ea, eas] = self.download_refresh_state(task).map_err(e)?;
        Ok(HostInput::Soap {
            task: *task,
            t: t_optim,
            f,
            state: [q, ea, eas],
            m,
            n,
        })
    }

    /// Installs what [`HostInput::compute`] returned for `task`: a SOAP task's basis and
    /// moments uploaded (not for a skipped refresh or a zero factor), a basis-only task's basis
    /// or root through [`CudaEngine::install_basis_on_host`]; a numerical failure changes
    /// nothing.
    fn host_install(
        &mut self,
        task: &RefreshTask,
        c: HostComputed,
    ) -> Result<Outcome, EngineError> {
        let e = |err| cuda_err("eigenbasis refresh", err);
        match c {
            HostComputed::Soap(
                Ok(k @ (RefreshOutcome::Skipped | RefreshOutcome::ZeroFactor)),
                _,
            ) => Ok(Ok(k)),
            HostComputed::Soap(Ok(kind), [q, ea, eas]) => {
                self.upload_refresh_state(task, [&q, &ea, &eas])
                    .map_err(e)?;
                Ok(Ok(kind))
            }
            HostComputed::Soap(Err(err), _) | HostComputed::BasisOnly(Err(err)) => {
                task.outcome(Err(err))
            }
            HostComputed::BasisOnly(Ok(Some(result))) => self.install_basis_on_host(task, &result),
            HostComputed::BasisOnly(Ok(None)) => Ok(Ok(RefreshOutcome::Skipped)),
        }
    }

    /// [`engine::StepExecutor::restore_refreshes`] of the CUDA engine (see there).
    pub(super) fn install_recorded_refreshes(
        &mut self,
        refreshes: &[engine::checkpoint::InFlightRefresh],
    ) -> Result<(), EngineError> {
        for r in refreshes {
            let task = *self.refreshes.runtime.tasks().get(r.task).ok_or_else(|| {
                EngineError::Checkpoint(format!("refresh task {} is not in the plan", r.task))
            })?;
            let d = dim(&self.plan, &task);
            if r.factor.len() != d * d || r.basis.len() != d * d {
                return Err(EngineError::Checkpoint(format!(
                    "refresh task {}: snapshots of {} and {} values, the plan's factor is {d} x {d}",
                    r.task,
                    r.factor.len(),
                    r.basis.len()
                )));
            }
            let (m, n) = self.dims(task.exp_avg);
            let f: Vec<f32> = r.factor.iter().map(|&x| x as f32).collect();
            let q0: Vec<f32> = r.basis.iter().map(|&x| x as f32).collect();
            let out = host_compute(
                self.solver.as_ref(),
                &task,
                task.optim_step(r.launched, false),
                &f,
                &q0,
                m,
                n,
            )
            .map_err(JobError::Refresh);
            self.refreshes
                .runtime
                .relaunch(r.task, r.launched, CudaJob::Ready(Some(out)))
                .map_err(EngineError::Checkpoint)?;
        }
        Ok(())
    }

    /// Installs a result computed on the host from a checkpoint's snapshots: the CPU engine's
    /// install (`optim::refresh_apply`) on the downloaded basis and moments, uploaded back.
    pub(super) fn swap_ready(
        &mut self,
        task: &RefreshTask,
        out: JobOutput<f32>,
    ) -> Result<Outcome, EngineError> {
        let e = |err| cuda_err("installing a checkpoint's refresh", err);
        let result = match task.computed(out)? {
            Ok(result) => result,
            Err(outcome) => return Ok(outcome),
        };
        let (m, n) = self.dims(task.exp_avg);
        if basis_only_method(task.method) {
            return self.install_basis_on_host(task, &result);
        }
        let [mut q, mut ea, mut eas] = self.download_refresh_state(task).map_err(e)?;
        match optim::refresh_apply(&result, &mut q, &mut ea, &mut eas, m, n) {
            Ok(kind @ (RefreshOutcome::Refreshed | RefreshOutcome::Initialized)) => {
                self.upload_refresh_state(task, [&q, &ea, &eas])
                    .map_err(e)?;
                Ok(Ok(kind))
            }
            Ok(kind) => Ok(Ok(kind)),
            Err(err) => task.outcome(Err(err)),
        }
    }

    /// Installs a host result of a basis-only task (`RefreshMethod::Qr` or
    /// `RefreshMethod::InverseRoot`, computed from a snapshot or
    /// downloaded state): what `optim::refresh_apply` does with it — a new basis (refreshed or
    /// initialised) uploaded into the task's basis, nothing for a zero factor — and no moment
    /// touched.
    fn install_basis_on_host(
        &mut self,
        task: &RefreshTask,
        result: &optim::RefreshResult<f32>,
    ) -> Result<Outcome, EngineError> {
        let e = |err| cuda_err("installing an eigenbasis", err);
        match result.kind() {
            kind @ (RefreshOutcome::Refreshed | RefreshOutcome::Initialized) => {
                self.dev
                    .upload(self.b(task.basis), result.basis())
                    .map_err(e)?;
                self.basis_changed(task.basis);
                Ok(Ok(kind))
            }
            kind => Ok(Ok(kind)),
        }
    }

    /// The task's eigenbasis, `exp_avg` and `exp_avg_sq`, downloaded for an install on the
    /// host.
    fn download_refresh_state(&self, task: &RefreshTask) -> Result<[Vec<f32>; 3], CudaError> {
        Ok([
            self.dev.download::<f32>(self.b(task.basis))?,
            self.download_state(task.exp_avg)?,
            self.download_state(task.exp_avg_sq)?,
        ])
    }

    /// Uploads what [`CudaEngine::download_refresh_state`] downloaded, after a host install;
    /// the basis's cached bf16 copy (SOAP's bf16 projections) is stale then.
    fn upload_refresh_state(
        &mut self,
        task: &RefreshTask,
        [q, ea, eas]: [&[f32]; 3],
    ) -> Result<(), CudaError> {
        self.dev.upload(self.b(task.basis), q)?;
        self.upload_state(task.exp_avg, ea)?;
        self.upload_state(task.exp_avg_sq, eas)?;
        self.basis_changed(task.basis);
        Ok(())
    }
}
