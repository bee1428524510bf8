//! The side-stream launcher thread of the CUDA engine's asynchronous GPU refreshes: it owns the
//! side-stream [`GpuRefresher`] and enqueues each refresh's work in launch order, because
//! cuSOLVER's `Sgeqrf` / `Sorgqr` block their calling host thread until the GPU work is done
//! (see [`super::tasks`]).
use super::gpu_trace::GpuTrace;
use crate::memory::Buf;
use crate::refresh::{GpuRefresher, RefreshSlot};
use crate::{Device, StreamKind};
use cudarc::driver::CudaEvent;
use engine::EngineError;
use schedule::RefreshMethod;
use std::sync::{mpsc, Arc};

/// One side-stream refresh for the launcher thread.
pub(super) struct SideRequest {
    pub(super) taken: CudaEvent,
    pub(super) method: RefreshMethod,
    /// The root of a [`RefreshMethod::InverseRoot`] task (computed by
    /// [`GpuRefresher::compute_inverse_root`] from the snapshot alone; `basis` is unused).
    pub(super) root: Option<schedule::InverseRoot>,
    pub(super) d: usize,
    pub(super) snapshot: Buf,
    pub(super) basis: Buf,
    pub(super) slot: RefreshSlot,
    /// `snapshot` and `slot` are in pinned host memory: staged through [`SideStaging`].
    pub(super) pinned: bool,
    pub(super) status_host: Buf,
    pub(super) reply: mpsc::Sender<Result<CudaEvent, String>>,
    /// The task's location (`--trace` slice names).
    pub(super) name: String,
}

/// The side stream's device copies of a pinned shadow (`schedule::MemoryPlan::
/// pinned_refresh_shadows`), sized for the largest side-stream factor and reused by one
/// refresh after the other (the side stream runs them in order): the factor snapshot is
/// copied in before the refresh, and the basis, permutation and status words out after it.
pub(super) struct SideStaging {
    pub(super) factor: Buf,
    pub(super) slot: RefreshSlot,
}

/// The thread that owns the side-stream refresher and enqueues its work, one request at a
/// time, in launch order (see the module docs).
pub(super) struct SideLauncher {
    pub(super) tx: Option<mpsc::Sender<SideRequest>>,
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
    pub(super) phases: Arc<std::sync::Mutex<String>>,
}

impl SideLauncher {
    pub(super) fn spawn(
        dev: Arc<Device>,
        refresher: GpuRefresher,
        staging: Option<SideStaging>,
        trace: Option<GpuTrace>,
    ) -> Result<SideLauncher, EngineError> {
        let (tx, rx) = mpsc::channel::<SideRequest>();
        let phases = Arc::new(std::sync::Mutex::new(String::new()));
        let shared = Arc::clone(&phases);
        let thread = std::thread::Builder::new()
            .name("asteria-side-refresh".into())
            .spawn(move || {
                for req in rx {
                    let r = (|| -> crate::error::Result<CudaEvent> {
                        dev.wait(StreamKind::Side, &req.taken)?;
                        let start = trace
                            .as_ref()
                            .and_then(|_| GpuTrace::mark(&dev, StreamKind::Side));
                        let dd = req.d * req.d;
                        // A pinned shadow: the factor in, the refresh on the staging buffers.
                        let staged = match (&staging, req.pinned) {
                            (Some(st), true) => {
                                let f = st.factor.slice(0, dd)?;
                                dev.copy(&f, &req.snapshot, StreamKind::Side)?;
                                Some((f, &st.slot))
                            }
                            (None, true) => {
                                return Err(crate::error::CudaError::Invalid {
                                    op: "side-stream refresh",
                                    what: "a pinned shadow without side-stream staging".into(),
                                })
                            }
                            _ => None,
                        };
                        let (factor, slot) = match &staged {
                            Some((f, slot)) => (f, *slot),
                            None => (&req.snapshot, &req.slot),
                        };
                        match (req.method, req.root) {
                            (RefreshMethod::InverseRoot, Some(root)) => {
                                refresher.compute_inverse_root(&dev, req.d, root, factor, slot)?
                            }
                            (method, _) => refresher
                                .compute(&dev, false, method, req.d, factor, &req.basis, slot)?,
                        }
                        // ... and the result out to the pinned slot.
                        if staged.is_some() {
                            dev.copy(&req.slot.q, &slot.q.slice(0, dd)?, StreamKind::Side)?;
                            dev.copy(&req.slot.idx, &slot.idx.slice(0, req.d)?, StreamKind::Side)?;
                        }
                        dev.copy(&req.status_host, &slot.status, StreamKind::Side)?;
                        if let (Some(tr), Some(start)) = (&trace, start) {
                            if let Some(end) = GpuTrace::mark(&dev, StreamKind::Side) {
                                tr.push("side", format!("refresh {}", req.name), start, end);
                            }
                        }
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
