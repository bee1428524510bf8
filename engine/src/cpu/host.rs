//! Host tasks: SOAP eigenbasis refreshes through the configured [`optim::HostEigensolver`],
//! run synchronously on the engine's host pool (a rayon pool separate from the kernel pool,
//! so eigensolver threads never share a core's AVX state with the kernels' threads).
use super::store::Loc;
use super::{CpuEngine, Float};
use crate::EngineError;
use optim::{eigenbasis_refresh, Real, RefreshOutcome};
use schedule::HostTask;
use std::sync::Arc;
use std::time::Instant;

/// What [`CpuEngine::run_host_tasks`] did in one call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostTaskReport {
    /// Tasks whose basis was (re)computed.
    pub refreshed: usize,
    /// Tasks that failed numerically and kept their previous basis.
    pub failed: usize,
}

/// Whether an `EigenbasisRefresh` with `frequency` and stagger `offset` does work at the end of
/// 1-based step `t`: the initial eigendecomposition at t = 1, then QR refreshes at t > 1 with
/// `(t − 1 − offset) mod frequency = 0`.
pub fn refresh_due(t: u64, frequency: u64, offset: u64) -> bool {
    t == 1 || (t > 1 + offset && frequency > 0 && (t - 1 - offset) % frequency == 0)
}

impl<T: Float + Real> CpuEngine<T> {
    /// Runs the host tasks due at the end of 1-based step `t` (see
    /// [`schedule::HostTask::EigenbasisRefresh`] for the schedule), synchronously.
    ///
    /// A numerical failure (non-finite factor, eigensolver failure, bad basis) keeps the
    /// previous basis and moments untouched, is counted per task in
    /// [`super::EngineStats::refresh_failures`] and logged with `tracing::warn!`.
    ///
    /// # Errors
    /// [`EngineError::RefreshFailures`] once one task has failed
    /// `max_consecutive_refresh_failures` times in a row; [`EngineError::Optim`] for a
    /// non-numerical refusal (shape or side mismatch: an engine or plan bug).
    pub fn run_host_tasks(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        let start = Instant::now();
        let mut report = HostTaskReport::default();
        let solver = Arc::clone(&self.opts.eigensolver);
        let pool = Arc::clone(&self.host_pool);
        let limit = self.opts.max_consecutive_refresh_failures;
        for index in 0..self.plan.host_tasks.len() {
            // `staleness` and `placement` are honoured as 0 and `host`: this engine refreshes
            // synchronously on the host pool (the bound is trivially met).
            let HostTask::EigenbasisRefresh {
                factor,
                basis,
                side,
                exp_avg,
                exp_avg_sq,
                frequency,
                offset,
                ..
            } = self.plan.host_tasks[index].clone();
            if !refresh_due(t, frequency, offset) {
                continue;
            }
            // asteria-optim schedules by (t − 1) mod frequency; hand it a step that is due under
            // its rule (t itself when there is no stagger).
            let t_optim = if t == 1 || offset == 0 {
                t
            } else {
                1 + frequency
            };
            let (m, n) = self.store.dims2(exp_avg);
            let loc = Loc {
                section: "host_tasks",
                index,
                op: "eigenbasis_refresh",
            };
            let outs = [
                ("basis", basis),
                ("exp_avg", exp_avg),
                ("exp_avg_sq", exp_avg_sq),
            ];
            let outcome = self.store.with_outs(loc, &outs, &[factor], |s, o| {
                let [q, ea, eas] = o else {
                    return Err(EngineError::Optim {
                        location: loc.to_string(),
                        message: "internal: operand count".into(),
                    });
                };
                let f = s.f(factor)?;
                Ok(pool.install(|| {
                    eigenbasis_refresh(
                        solver.as_ref(),
                        t_optim,
                        frequency,
                        side,
                        f,
                        q,
                        ea,
                        eas,
                        m,
                        n,
                    )
                }))
            })?;
            match outcome {
                Ok(RefreshOutcome::Skipped) => {}
                Ok(_) => {
                    report.refreshed += 1;
                    self.stats.refreshes += 1;
                    self.stats.consecutive_refresh_failures[index] = 0;
                }
                Err(e) if e.is_numerical() => {
                    report.failed += 1;
                    self.stats.refresh_failures[index] += 1;
                    self.stats.consecutive_refresh_failures[index] += 1;
                    let run = self.stats.consecutive_refresh_failures[index];
                    let name = self.store.names[factor.index()].clone();
                    tracing::warn!(step = t, task = index, factor = %name, consecutive = run, error = %e,
                        "eigenbasis refresh failed; keeping the previous basis");
                    if run >= limit {
                        return Err(EngineError::RefreshFailures {
                            task: index,
                            factor: name,
                            failures: run,
                            limit,
                            last: e.to_string(),
                        });
                    }
                }
                Err(e) => {
                    return Err(EngineError::Optim {
                        location: loc.to_string(),
                        message: e.to_string(),
                    })
                }
            }
        }
        self.stats.host_task_ms += start.elapsed().as_secs_f64() * 1e3;
        Ok(report)
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
        assert_eq!(due(3, 1), vec![1, 5, 8, 11]);
        assert_eq!(due(3, 2), vec![1, 6, 9, 12]);
    }
}
