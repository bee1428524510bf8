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
use optim::RefreshOutcome;
use std::sync::Arc;

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
        let (m, n) = self.dims(task.exp_avg);
        let e = |err| cuda_err("eigenbasis refresh", err);
        // Host: the CPU engine's call, on downloaded state.
        let f = self.dev.download::<f32>(self.b(task.factor)).map_err(e)?;
        if basis_only_method(task.method) {
            return self.refresh_now_basis_only(task, t, init, &f);
        }
        let [mut q, mut ea, mut eas] = self.download_refresh_state(task).map_err(e)?;
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
            Ok(k @ (RefreshOutcome::Skipped | RefreshOutcome::ZeroFactor)) => Ok(Ok(k)),
            Ok(kind) => {
                self.upload_refresh_state(task, [&q, &ea, &eas])
                    .map_err(e)?;
                Ok(Ok(kind))
            }
            Err(err) => task.outcome(Err(err)),
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

    /// A synchronous host refresh of a `RefreshMethod::Qr` or `RefreshMethod::InverseRoot`
    /// task: [`host_compute`] on the downloaded factor `f` and basis (on the host pool; the
    /// inverse root reads the factor alone), installed by
    /// [`CudaEngine::install_basis_on_host`]; the momentum is neither downloaded nor written.
    fn refresh_now_basis_only(
        &mut self,
        task: &RefreshTask,
        t: u64,
        init: bool,
        f: &[f32],
    ) -> Result<Outcome, EngineError> {
        let e = |err| cuda_err("eigenbasis refresh", err);
        let (m, n) = self.dims(task.exp_avg);
        let q = self.dev.download::<f32>(self.b(task.basis)).map_err(e)?;
        let solver = Arc::clone(&self.solver);
        let t_optim = task.optim_step(t, init);
        let out = self
            .host_pool()?
            .install(|| host_compute(solver.as_ref(), task, t_optim, f, &q, m, n));
        match out {
            Ok(Some(result)) => self.install_basis_on_host(task, &result),
            Ok(None) => Ok(Ok(RefreshOutcome::Skipped)),
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
