//! The host-update worker: the `adam_w` ops that `tier-placement` placed on the host
//! (`host_updates = sync | delayed`, `Op::AdamW::on_host`) run here, on the host cores, on
//! their state in pinned host memory (parameter master copy, gradient home, moments), with the
//! kernel the CPU engine runs (`hostkernels::AdamWKernel`, generated with Cranelift from
//! AdamW's update rule), as ZeRO-Offload's CPU Adam does.
//!
//! Ordering, by step position ([`schedule::Plan::step_ops`]):
//! - **Before a host update**: at its submission the engine thread records an event on each
//!   stream that ran an earlier op of the step touching the update's bytes
//!   ([`HostUpdates::streams_before`]), and the worker synchronises them before it touches a
//!   byte. Everything such a stream enqueued before the update is then complete: its
//!   gradient's copy out (during the backward), the clip's factor, and, under `delayed`, the
//!   copy in that reads the parameter into its device copy before the update overwrites it.
//!   Under `sync` an update does not wait for the copy-in stream, so the copy in of the
//!   previous update's parameter overlaps it.
//! - **After a host update**: an op that touches bytes the update touches (one of the two
//!   writing them) is not enqueued before the update finished: the engine thread waits for it
//!   ([`HostUpdates::before_op`]). Under `sync` that is the copy in of the parameter's device
//!   copy in the same step; under `delayed` the next step's copy in, and the next step's copy
//!   out of the gradient into the home the update reads. Which positions conflict with which
//!   update is computed once from the plan's slots ([`HostUpdates::new`]); an update stays
//!   pending across the step boundary until an op needs it, so under `delayed` it overlaps the
//!   next step's forward and backward.
//! - Updates run one at a time, in submission order, each parallel over the worker's pool.
//!
//! Reading or writing state from outside the programs (checkpoints, export, a resume) first
//! waits for every submitted update ([`HostUpdates::join_all`]). A failed update (its events,
//! or the kernel refusing its operands) is reported at the next wait and skips every later one.
use crate::error::CudaError;
use crate::memory::Buf;
use cudarc::driver::CudaEvent;
use schedule::{ArenaKind, BufferId, Op, Plan};
use std::collections::HashMap;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A `len`-element f32 region of pinned host memory (a host-tier `Buf`).
#[derive(Clone, Copy)]
struct HostSlice {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the pointer is pinned host memory owned by the engine's buffers, which outlive the
// worker (`HostUpdates` joins it on drop and is dropped before the buffers); only one update
// touches a region at a time (the ordering in the module docs).
unsafe impl Send for HostSlice {}
// SAFETY: as above; a `HostSlice` is only dereferenced by the one update that owns it.
unsafe impl Sync for HostSlice {}

/// One submitted update.
struct Job {
    seq: u64,
    /// Events after everything enqueued before the update, one per stream.
    events: Vec<CudaEvent>,
    param: HostSlice,
    grad: HostSlice,
    exp_avg: HostSlice,
    exp_avg_sq: HostSlice,
    /// The clip's factor (`[1]`), multiplied into the gradient first (the bits an in-place
    /// clip stores), as the CPU engine's `grad_scale` path does.
    scale: Option<HostSlice>,
    t: u64,
    lr: f64,
    kernel: Arc<hostkernels::AdamWKernel>,
    /// `optimizer[i] (adam_w) <param>`, for errors.
    what: String,
}

/// The worker's progress: the last sequence number done (in order), the first error.
#[derive(Default)]
struct Progress {
    submitted: u64,
    done: u64,
    error: Option<String>,
    /// The worker thread has ended.
    stopped: bool,
}

type Shared = Arc<(Mutex<Progress>, Condvar)>;

/// Marks the worker stopped when dropped (the end of its loop, or its unwinding): updates that
/// were submitted and will not run fail their waiters instead of blocking them.
struct Stopped(Shared);

impl Drop for Stopped {
    fn drop(&mut self) {
        let (lock, cv) = &*self.0;
        let mut p = match lock.lock() {
            Ok(p) => p,
            Err(poisoned) => poisoned.into_inner(),
        };
        if p.done < p.submitted {
            p.error
                .get_or_insert_with(|| "the host-update worker stopped".into());
        }
        p.stopped = true;
        drop(p);
        cv.notify_all();
    }
}

/// The host-update worker of one engine (`None` in the engine when the plan has no host
/// update).
pub(crate) struct HostUpdates {
    tx: Option<mpsc::Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    progress: Shared,
    /// Per step position: the host-update positions whose bytes the op there touches (one of
    /// the two writing them); empty for host updates themselves (the worker runs in order).
    conflicts: Vec<Vec<usize>>,
    /// Per step position of a host update: the sequence number of its latest submission that
    /// no op has waited for yet.
    pending: Vec<Option<u64>>,
    /// The kernels, by `schedule::adamw_kernel_key`.
    kernels: HashMap<[u64; 4], Arc<hostkernels::AdamWKernel>>,
    /// Per step position of a host update: which streams (compute, copy in, copy out) ran an
    /// earlier op of the step that touches its bytes, so that the update waits for them at its
    /// submission; the others it need not wait for (under `sync` the copy in of the previous
    /// update's parameter, which then overlaps this update). Earlier steps' work is done: the
    /// engine waits for every stream at a step's end.
    streams: Vec<[bool; 3]>,
}

/// Bytes of one arena an op touches, with whether it writes them.
type Touch = ((ArenaKind, usize, usize), bool);

fn touches(plan: &Plan, op: &Op) -> Vec<Touch> {
    op.accesses()
        .into_iter()
        .filter_map(|(_, id, a)| {
            let slot = plan.memory.slot(id)?;
            let bytes = plan.buffers.get(id.index())?.size_bytes();
            Some(((slot.arena, slot.offset, slot.offset + bytes), a.writes()))
        })
        .collect()
}

fn conflict(a: &[Touch], b: &[Touch]) -> bool {
    a.iter().any(|&((ka, sa, ea), wa)| {
        b.iter()
            .any(|&((kb, sb, eb), wb)| ka == kb && sa < eb && sb < ea && (wa || wb))
    })
}

impl HostUpdates {
    /// The worker of `plan`'s host updates, or `None` when it has none. Compiles one kernel
    /// per set of AdamW constants and starts the worker thread with a pool of `threads`.
    ///
    /// # Errors
    /// A kernel that does not compile, or a pool or thread that cannot start.
    pub(crate) fn new(plan: &Plan, threads: usize) -> Result<Option<HostUpdates>, String> {
        let ops: Vec<&Op> = plan.step_ops().map(|(_, op)| op).collect();
        let hosts: Vec<usize> = (0..ops.len()).filter(|&p| ops[p].on_host()).collect();
        if hosts.is_empty() {
            return Ok(None);
        }
        let touched: Vec<Vec<Touch>> = ops.iter().map(|op| touches(plan, op)).collect();
        let conflicts = (0..ops.len())
            .map(|p| {
                if ops[p].on_host() {
                    return Vec::new();
                }
                hosts
                    .iter()
                    .copied()
                    .filter(|&h| conflict(&touched[p], &touched[h]))
                    .collect()
            })
            .collect();
        let lane = |op: &Op| match crate::engine::copies::stream_of(op) {
            crate::StreamKind::Compute => 0,
            crate::StreamKind::CopyIn => 1,
            _ => 2,
        };
        let mut streams = vec![[false; 3]; ops.len()];
        for &h in &hosts {
            for q in 0..h {
                if !ops[q].on_host() && conflict(&touched[q], &touched[h]) {
                    streams[h][lane(ops[q])] = true;
                }
            }
        }
        let kernels = engine::cpu::adamw_kernels(hosts.iter().map(|&h| ops[h]))?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("asteria-host-update-{i}"))
            .build()
            .map_err(|e| format!("starting the host-update pool: {e}"))?;
        let progress: Shared = Arc::default();
        let (tx, rx) = mpsc::channel::<Job>();
        let shared = Arc::clone(&progress);
        let worker = std::thread::Builder::new()
            .name("asteria-host-updates".into())
            .spawn(move || {
                // However the worker ends (its channel closed, or a panic), waiters wake up:
                // a wait for an update that will not run returns the error.
                let _stopped = Stopped(Arc::clone(&shared));
                for job in rx {
                    let failed = shared.0.lock().map(|p| p.error.is_some()).unwrap_or(true);
                    let result = if failed {
                        Ok(())
                    } else {
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            pool.install(|| run(&job))
                        }))
                        .unwrap_or_else(|_| Err(format!("{}: the update panicked", job.what)))
                    };
                    let (lock, cv) = &*shared;
                    if let Ok(mut p) = lock.lock() {
                        p.done = job.seq;
                        if let Err(e) = result {
                            p.error.get_or_insert(e);
                        }
                    }
                    cv.notify_all();
                }
            })
            .map_err(|e| format!("starting the host-update thread: {e}"))?;
        Ok(Some(HostUpdates {
            tx: Some(tx),
            worker: Some(worker),
            progress,
            pending: vec![None; ops.len()],
            conflicts,
            kernels,
            streams,
        }))
    }

    /// The streams (compute, copy in, copy out) the host update at step position `pos` waits
    /// for at its submission: those that ran an earlier op touching its bytes.
    pub(crate) fn streams_before(&self, pos: usize) -> [bool; 3] {
        self.streams.get(pos).copied().unwrap_or([true; 3])
    }

    /// Waits for the submitted host updates whose bytes the op at step position `pos`
    /// touches (see the module docs). Call before enqueuing it.
    pub(crate) fn before_op(&mut self, pos: usize) -> Result<(), CudaError> {
        let Some(list) = self.conflicts.get(pos) else {
            return Ok(());
        };
        let mut upto = None;
        for &h in list {
            if let Some(seq) = self.pending[h].take() {
                upto = upto.max(Some(seq));
            }
        }
        match upto {
            Some(seq) => {
                let _wait = tracing::debug_span!("wait_host_update", position = pos).entered();
                self.wait(seq)
            }
            None => Ok(()),
        }
    }

    /// The first failure of an update so far, without waiting.
    pub(crate) fn failure(&self) -> Option<CudaError> {
        let p = self.progress.0.lock().ok()?;
        p.error.as_ref().map(|e| CudaError::Invalid {
            op: "adam_w",
            what: format!("host update: {e}"),
        })
    }

    /// Every submitted update done (or the first failure).
    pub(crate) fn join_all(&self) -> Result<(), CudaError> {
        let submitted = self
            .progress
            .0
            .lock()
            .map(|p| p.submitted)
            .unwrap_or(u64::MAX);
        self.wait(submitted)
    }

    fn wait(&self, seq: u64) -> Result<(), CudaError> {
        let (lock, cv) = &*self.progress;
        let poisoned = || CudaError::Invalid {
            op: "adam_w",
            what: "the host-update worker stopped".into(),
        };
        let mut p = lock.lock().map_err(|_| poisoned())?;
        while p.done < seq && p.error.is_none() && !p.stopped {
            p = cv.wait(p).map_err(|_| poisoned())?;
        }
        if p.done < seq && p.error.is_none() {
            return Err(poisoned());
        }
        match &p.error {
            Some(e) => Err(CudaError::Invalid {
                op: "adam_w",
                what: format!("host update: {e}"),
            }),
            None => Ok(()),
        }
    }

    /// Submits the host update `op` at step position `pos` (optimizer step `t`, scheduled
    /// `lr_mult`), after `events` (recorded by the caller on every stream). `bufs` are the
    /// engine's buffers of `plan`, the operands pinned host memory.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn submit(
        &mut self,
        plan: &Plan,
        op: &Op,
        pos: usize,
        what: String,
        bufs: &[Buf],
        events: Vec<CudaEvent>,
        (t, lr_mult): (u64, f64),
    ) -> Result<(), CudaError> {
        let Op::AdamW {
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            grad_scale,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            on_host: true,
        } = *op
        else {
            return Err(CudaError::Invalid {
                op: op.name(),
                what: "only adam_w runs on the host".into(),
            });
        };
        let slice = |id: BufferId| -> Result<HostSlice, CudaError> {
            let b = bufs.get(id.index()).ok_or_else(|| CudaError::Invalid {
                op: "adam_w",
                what: format!("buffer {} out of range", id.0),
            })?;
            if b.tier() != crate::error::Tier::PinnedHost {
                return Err(CudaError::Invalid {
                    op: "adam_w",
                    what: format!("host update operand {} is not in pinned host memory", id.0),
                });
            }
            let len = plan.buffer(id).numel();
            if b.bytes() < len * 4 {
                return Err(CudaError::Invalid {
                    op: "adam_w",
                    what: format!(
                        "host update operand {} is smaller than its plan buffer",
                        id.0
                    ),
                });
            }
            Ok(HostSlice {
                ptr: b.ptr() as *mut f32,
                len,
            })
        };
        let kernel = self
            .kernels
            .get(&schedule::adamw_kernel_key(beta1, beta2, eps, weight_decay))
            .cloned()
            .ok_or_else(|| CudaError::Invalid {
                op: "adam_w",
                what: "no host kernel for these constants".into(),
            })?;
        let job = Job {
            seq: 0,
            events,
            param: slice(param)?,
            grad: slice(grad)?,
            exp_avg: slice(exp_avg)?,
            exp_avg_sq: slice(exp_avg_sq)?,
            scale: grad_scale.map(slice).transpose()?,
            t,
            lr: lr * lr_mult,
            kernel,
            what,
        };
        let stopped = || CudaError::Invalid {
            op: "adam_w",
            what: "the host-update worker stopped".into(),
        };
        let tx = self.tx.as_ref().ok_or_else(stopped)?;
        // Counted while the lock is held, so a waiter never sees a number that is not queued
        // (a failed send leaves the count as it was).
        let mut p = self.progress.0.lock().map_err(|_| stopped())?;
        let seq = p.submitted + 1;
        tx.send(Job { seq, ..job }).map_err(|_| stopped())?;
        p.submitted = seq;
        drop(p);
        self.pending[pos] = Some(seq);
        Ok(())
    }
}

/// One update on the worker: its events, the clip's factor, the kernel.
fn run(job: &Job) -> Result<(), String> {
    // On the worker's thread of a `--trace` timeline: the wait for the streams, the update.
    let _update = tracing::debug_span!("host_update", op = %job.what, t = job.t).entered();
    {
        let _wait = tracing::debug_span!("host_update_wait").entered();
        for ev in &job.events {
            ev.synchronize()
                .map_err(|e| format!("{}: waiting for the streams: {e}", job.what))?;
        }
    }
    // SAFETY: see `HostSlice`: live pinned host memory of `len` f32 each, which no stream and
    // no other update touches while this one runs (the events above and the engine's waits).
    let (p, g, m, v) = unsafe {
        (
            std::slice::from_raw_parts_mut(job.param.ptr, job.param.len),
            std::slice::from_raw_parts(job.grad.ptr as *const f32, job.grad.len),
            std::slice::from_raw_parts_mut(job.exp_avg.ptr, job.exp_avg.len),
            std::slice::from_raw_parts_mut(job.exp_avg_sq.ptr, job.exp_avg_sq.len),
        )
    };
    let err = |e: hostkernels::KernelError| format!("{}: {e}", job.what);
    let Some(s) = job.scale else {
        return job.kernel.update(job.t, job.lr, p, g, m, v).map_err(err);
    };
    // SAFETY: as above; `[1]` f32.
    let s = unsafe { *s.ptr };
    if [p.len(), m.len(), v.len()] != [g.len(); 3] {
        return Err(format!("{}: operands of different lengths", job.what));
    }
    // `grad · scale` (the bits an in-place clip stores, as the CPU engine's `grad_scale`
    // path reads it) a chunk at a time into scratch of the worker's own: the gradient's home
    // is only read.
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    p.par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .try_for_each(|(((p, m), v), g)| {
            let scaled: Vec<f32> = g.iter().map(|&x| x * s).collect();
            job.kernel
                .update(job.t, job.lr, p, &scaled, m, v)
                .map_err(err)
        })
}

impl Drop for HostUpdates {
    /// Finishes the submitted updates and stops the worker before the engine's buffers go.
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::copies::{stream_of, CopyOrder};
    use crate::StreamKind;

    /// examples/tiny-tiers.asteria's model with `host_updates = mode` and no budget.
    fn host_update_plan(mode: schedule::HostUpdates) -> Plan {
        let spec = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/tiny-tiers.asteria");
        let mut config = frontend::load_spec(&spec).expect("examples/tiny-tiers.asteria loads");
        if let ir::config::TargetConfig::Cpu { budgets, .. } = &mut config.target {
            *budgets = schedule::Budgets {
                host_updates: mode,
                ..Default::default()
            };
        }
        let mut module = ir::Module::new(config);
        let mut pm = passes::PassManager::new(passes::PassOptions::default()).expect("passes");
        let (cx, _) = pm
            .run(&mut module, None, &mut Vec::new())
            .expect("pipeline");
        cx.plan.expect("a plan")
    }

    const LANES: usize = 4; // compute, copy in, copy out, host
    type Clock = [Option<usize>; LANES];

    fn join(a: &mut Clock, b: &Clock) {
        for i in 0..LANES {
            a[i] = a[i].max(b[i]);
        }
    }

    fn lane(op: &Op) -> usize {
        if op.on_host() {
            return 3;
        }
        match stream_of(op) {
            StreamKind::Compute => 0,
            StreamKind::CopyIn => 1,
            _ => 2,
        }
    }

    /// Replays `steps` steps as the engine runs them: three in-order streams with the copy
    /// events of `order`, the host worker (in order; at a submission it knows everything
    /// enqueued on the streams `needs` names for it), the engine thread's waits for host updates (`conflicts`, as
    /// `HostUpdates::before_op` takes them) and the end of every step waiting for the streams
    /// but not for the host. Returns the first pair of step instances (earlier, later) on
    /// different lanes that touch the same bytes, one writing, left unordered.
    fn unordered(
        plan: &Plan,
        order: &CopyOrder,
        (conflicts, needs): (&[Vec<usize>], &[[bool; 3]]),
        steps: usize,
    ) -> Option<(usize, usize)> {
        let ops: Vec<&Op> = plan.step_ops().map(|(_, o)| o).collect();
        let n = ops.len();
        let total = n * steps;
        let mut streams = [[None::<usize>; LANES]; 3];
        let mut host = [None::<usize>; LANES];
        let mut engine = [None::<usize>; LANES];
        let mut at_event: Vec<Clock> = vec![[None; LANES]; total];
        let mut known: Vec<Clock> = vec![[None; LANES]; total];
        let mut pending: Vec<Option<usize>> = vec![None; n];
        for k in 0..total {
            let (step, p) = (k / n, k % n);
            let l = lane(ops[p]);
            // The engine thread's waits for host updates before it enqueues this op.
            for &h in &conflicts[p] {
                if let Some(j) = pending[h].take() {
                    let done = at_event[j];
                    join(&mut engine, &done);
                }
            }
            if l == 3 {
                for (s, needed) in streams.iter().zip(needs[p]) {
                    if needed {
                        join(&mut host, s);
                    }
                }
                join(&mut host, &engine);
                known[k] = host;
                host[3] = Some(k);
                at_event[k] = host;
                pending[p] = Some(k);
            } else {
                let mut c = streams[l];
                for &q in &order.waits[p] {
                    join(&mut c, &at_event[step * n + q]);
                }
                join(&mut c, &engine);
                known[k] = c;
                c[l] = Some(k);
                at_event[k] = c;
                streams[l] = c;
            }
            if p == n - 1 {
                // `synchronize_step`: every stream done, the host not waited for.
                let mut all = engine;
                for s in &streams {
                    join(&mut all, s);
                }
                engine = all;
                for s in streams.iter_mut() {
                    join(s, &all);
                }
            }
        }
        let touched: Vec<Vec<Touch>> = ops.iter().map(|o| touches(plan, o)).collect();
        for b in 0..total {
            let (lb, tb) = (lane(ops[b % n]), &touched[b % n]);
            for a in 0..b {
                let la = lane(ops[a % n]);
                if la == lb {
                    continue;
                }
                if conflict(&touched[a % n], tb) && known[b][la].is_none_or(|x| x < a) {
                    return Some((a, b));
                }
            }
        }
        None
    }

    #[test]
    fn host_updates_are_ordered_against_every_stream_across_steps() {
        for mode in [schedule::HostUpdates::Sync, schedule::HostUpdates::Delayed] {
            let plan = host_update_plan(mode);
            let order = CopyOrder::new(&plan);
            let updates = HostUpdates::new(&plan, 1)
                .expect("kernels compile")
                .expect("the plan has host updates");
            let hosts = plan.optimizer.iter().filter(|o| o.on_host()).count();
            assert!(hosts > 10, "{mode}: {hosts} host updates");
            let needs = &updates.streams;
            assert_eq!(
                unordered(&plan, &order, (&updates.conflicts, needs), 3),
                None,
                "{mode}"
            );
            // An update waits for the copy-in stream only under `delayed` (its parameter's
            // copy in reads the home before the update writes it), and for the copy-out
            // stream (its gradient's copy out) in both modes.
            for (p, op) in plan.step_ops() {
                if op.on_host() {
                    assert_eq!(
                        needs[p][1],
                        mode == schedule::HostUpdates::Delayed,
                        "{mode}: position {p}"
                    );
                    assert!(needs[p][2], "{mode}: position {p}");
                }
            }
            // The updates' waits for the streams are needed: without them some pair is
            // unordered (a stream's wait can be redundant for one update, covered through
            // another stream's events, so this is checked for all of them at once).
            let blind = vec![[false; 3]; needs.len()];
            assert!(
                unordered(&plan, &order, (&updates.conflicts, &blind), 3).is_some(),
                "{mode}: the updates' stream waits order nothing"
            );
            // The engine's waits are needed: without them some pair is unordered, and under
            // `delayed` the waits reach into the next step.
            let none = vec![Vec::new(); updates.conflicts.len()];
            let broken =
                unordered(&plan, &order, (&none, needs), 3).expect("unordered without the waits");
            if mode == schedule::HostUpdates::Delayed {
                // The first conflicting op of step 2 with a step-1 update precedes that
                // update's position: the wait crosses the step boundary.
                let cross = plan
                    .step_ops()
                    .any(|(p, _)| updates.conflicts[p].iter().any(|&h| h > p));
                assert!(
                    cross,
                    "delayed: some op waits for the previous step's update"
                );
            }
            eprintln!(
                "{mode}: without the waits, {} / {} unordered",
                broken.0, broken.1
            );
        }
    }
}
