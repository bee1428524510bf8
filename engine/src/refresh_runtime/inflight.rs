//! Bookkeeping of eigenbasis refreshes running off the critical path: at most one refresh per
//! host task in flight, each with the step that launched it and its staleness bound, and the
//! decision, at each step boundary, of which results are swapped in (finished ones, and the
//! ones whose bound is reached, which the engine then waits for) and in what order. Shared by
//! the CPU engine (host-pool jobs) and the CUDA engine (side-stream and host-pool jobs).
use optim::{RefreshError, RefreshResult};
use std::sync::mpsc;

/// What a background refresh computation produced.
pub type JobOutput<T> = Result<Option<RefreshResult<T>>, JobError>;

/// Why a background refresh produced no result.
#[derive(Debug)]
pub enum JobError {
    /// `refresh_compute` refused (numerical failure or caller bug).
    Refresh(RefreshError),
    /// The worker panicked or vanished (an engine bug; never a numerical failure).
    Lost(String),
}

/// A refresh computation running on the host pool; its output arrives on a channel.
pub struct Job<T> {
    rx: mpsc::Receiver<JobOutput<T>>,
    done: Option<JobOutput<T>>,
    /// The factor and basis snapshots it computes from (shared with the worker), when the
    /// launcher keeps them: a checkpoint records them so that a resumed run recomputes the same
    /// refresh (`refresh_compute` is a function of them and the step).
    inputs: Option<JobInputs<T>>,
}

/// The factor and basis snapshots of a [`Job`] (row-major, the task's side length squared).
pub type JobInputs<T> = (std::sync::Arc<Vec<T>>, std::sync::Arc<Vec<T>>);

impl<T> Job<T> {
    /// A job whose worker sends its output on the other end of `rx`.
    pub fn new(rx: mpsc::Receiver<JobOutput<T>>) -> Self {
        Job {
            rx,
            done: None,
            inputs: None,
        }
    }

    /// As [`Job::new`], keeping the snapshots the worker computes from.
    pub fn with_inputs(rx: mpsc::Receiver<JobOutput<T>>, inputs: JobInputs<T>) -> Self {
        Job {
            rx,
            done: None,
            inputs: Some(inputs),
        }
    }

    /// The snapshots the job computes from, if kept.
    pub fn inputs(&self) -> Option<&JobInputs<T>> {
        self.inputs.as_ref()
    }

    /// Whether the output is available (never blocks).
    pub fn poll(&mut self) -> bool {
        if self.done.is_none() {
            match self.rx.try_recv() {
                Ok(out) => self.done = Some(out),
                Err(mpsc::TryRecvError::Empty) => {}
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.done = Some(Err(JobError::Lost(
                        "refresh worker exited without a result".into(),
                    )))
                }
            }
        }
        self.done.is_some()
    }

    /// The output, blocking until it arrives; also returns whether this call had to block.
    pub fn wait(mut self) -> (JobOutput<T>, bool) {
        if let Some(out) = self.done.take() {
            return (out, false);
        }
        let out = self.rx.recv().unwrap_or_else(|_| {
            Err(JobError::Lost(
                "refresh worker exited without a result".into(),
            ))
        });
        (out, true)
    }
}

/// One refresh in flight.
#[derive(Debug)]
pub struct InFlight<J> {
    /// The 1-based step at whose end the refresh was launched (its factor snapshot's step).
    pub launched: u64,
    /// Staleness bound S, steps.
    pub staleness: u32,
    /// The computation.
    pub job: J,
}

impl<J> InFlight<J> {
    /// The last step boundary (end of step `launched + S`) at which the result may be swapped
    /// in: it must be installed before step `launched + S + 1` starts.
    pub fn deadline(&self) -> u64 {
        self.launched + u64::from(self.staleness)
    }
}

/// A swap decided at a step boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Swap {
    /// Host task index.
    pub task: usize,
    /// The result is not finished and the deadline is reached: the engine blocks on it.
    pub wait: bool,
}

/// The refreshes in flight, one slot per host task.
#[derive(Debug)]
pub struct InFlightSet<J> {
    slots: Vec<Option<InFlight<J>>>,
}

impl<J> InFlightSet<J> {
    /// No refresh in flight, for `tasks` host tasks.
    pub fn new(tasks: usize) -> Self {
        InFlightSet {
            slots: (0..tasks).map(|_| None).collect(),
        }
    }

    /// Whether `task` has a refresh in flight.
    pub fn is_in_flight(&self, task: usize) -> bool {
        self.slots.get(task).is_some_and(Option::is_some)
    }

    /// Number of refreshes in flight.
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Whether no refresh is in flight.
    pub fn is_empty(&self) -> bool {
        self.slots.iter().all(Option::is_none)
    }

    /// Registers a refresh of `task` launched at the end of step `launched` with bound
    /// `staleness`. A task holds at most one: when its slot is taken the job is handed back
    /// (the caller must swap the previous one in first).
    pub fn launch(&mut self, task: usize, launched: u64, staleness: u32, job: J) -> Result<(), J> {
        match self.slots.get_mut(task) {
            Some(slot @ None) => {
                *slot = Some(InFlight {
                    launched,
                    staleness,
                    job,
                });
                Ok(())
            }
            _ => Err(job),
        }
    }

    /// The swaps at the boundary at the end of step `t`, in task order: every refresh whose
    /// job is finished (`finished` polls it, never blocking), and every refresh whose
    /// deadline is reached (`deadline ≤ t`; marked `wait` when not finished).
    /// With `at_deadline` a finished refresh waits for its deadline too: every result is
    /// swapped exactly at the end of step `launched + S`, whatever the timing (reproducible).
    pub fn boundary(
        &mut self,
        t: u64,
        at_deadline: bool,
        mut finished: impl FnMut(&mut J) -> bool,
    ) -> Vec<Swap> {
        let mut swaps = Vec::new();
        for (task, slot) in self.slots.iter_mut().enumerate() {
            if let Some(f) = slot {
                let done = finished(&mut f.job);
                if (done && !at_deadline) || f.deadline() <= t {
                    swaps.push(Swap { task, wait: !done });
                }
            }
        }
        swaps
    }

    /// Every refresh in flight, in task order: `(task, launched, staleness, job)`.
    pub fn iter(&self) -> impl Iterator<Item = (usize, u64, u32, &J)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|f| (i, f.launched, f.staleness, &f.job)))
    }

    /// Every task with a refresh in flight, in task order (to drain them all).
    pub fn tasks(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| self.is_in_flight(i))
            .collect()
    }

    /// Removes and returns the refresh of `task`.
    pub fn take(&mut self, task: usize) -> Option<InFlight<J>> {
        self.slots.get_mut(task).and_then(Option::take)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake job: finished or not.
    #[derive(Debug)]
    struct Fake(bool);

    #[test]
    fn deadline_is_launch_step_plus_staleness() {
        let f = InFlight {
            launched: 11,
            staleness: 3,
            job: (),
        };
        assert_eq!(f.deadline(), 14);
        let f = InFlight {
            launched: 11,
            staleness: 0,
            job: (),
        };
        assert_eq!(f.deadline(), 11);
    }

    #[test]
    fn unfinished_results_are_swapped_exactly_at_their_deadline() {
        let mut set = InFlightSet::new(3);
        set.launch(1, 11, 3, Fake(false)).expect("free slot");
        for t in 11..14 {
            assert!(set.boundary(t, false, |j| j.0).is_empty(), "t = {t}");
        }
        assert_eq!(
            set.boundary(14, false, |j| j.0),
            vec![Swap {
                task: 1,
                wait: true
            }]
        );
        let f = set.take(1).expect("in flight");
        assert_eq!((f.launched, f.deadline()), (11, 14));
        assert!(!set.is_in_flight(1) && set.len() == 0);
    }

    #[test]
    fn finished_results_are_swapped_at_the_first_boundary_in_task_order() {
        let mut set = InFlightSet::new(4);
        set.launch(3, 5, 5, Fake(true)).expect("free");
        set.launch(0, 6, 5, Fake(false)).expect("free");
        set.launch(2, 2, 5, Fake(false)).expect("free");
        set.launch(1, 6, 5, Fake(true)).expect("free");
        // Swapped at their deadlines only, finished or not: at t = 7 only 2 (deadline 7).
        let at_deadline: Vec<(usize, bool)> = set
            .boundary(7, true, |j| j.0)
            .iter()
            .map(|s| (s.task, s.wait))
            .collect();
        assert_eq!(at_deadline, vec![(2, true)]);
        // At t = 7: 1 and 3 are finished; 2 (deadline 7) must be waited for; 0 stays.
        let swaps = set.boundary(7, false, |j| j.0);
        let order: Vec<(usize, bool)> = swaps.iter().map(|s| (s.task, s.wait)).collect();
        assert_eq!(order, vec![(1, false), (2, true), (3, false)]);
        assert_eq!(set.tasks(), vec![0, 1, 2, 3]);
        for s in swaps {
            set.take(s.task).expect("in flight");
        }
        assert_eq!(set.tasks(), vec![0]);
    }

    #[test]
    fn one_refresh_per_task() {
        let mut set = InFlightSet::new(2);
        set.launch(0, 1, 2, Fake(false)).expect("free");
        assert!(set.launch(0, 2, 2, Fake(false)).is_err());
        assert!(set.launch(5, 2, 2, Fake(false)).is_err(), "no such task");
        set.take(0);
        set.launch(0, 2, 2, Fake(false)).expect("free again");
    }

    #[test]
    fn channel_jobs_poll_without_blocking_and_report_lost_workers() {
        let (tx, rx) = mpsc::channel::<JobOutput<f32>>();
        let mut job = Job::new(rx);
        assert!(!job.poll());
        tx.send(Ok(None)).expect("send");
        assert!(job.poll());
        let (out, blocked) = job.wait();
        assert!(matches!(out, Ok(None)) && !blocked);
        let (tx, rx) = mpsc::channel::<JobOutput<f32>>();
        drop(tx);
        let (out, _) = Job::new(rx).wait();
        assert!(matches!(out, Err(JobError::Lost(_))));
    }
}
