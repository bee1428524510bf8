//! The GPU side of `--trace`: when [`super::CudaOptions::trace`] is set, every op of the
//! forward, backward and optimizer programs gets a pair of timing events on the stream it runs
//! on (compute, copy-in, copy-out), and every side-stream refresh a pair on the side stream
//! (recorded by the launcher thread). At each step's synchronize the completed pairs become
//! [`GpuSlice`]s with host times: a timing event recorded on the idle compute stream is waited
//! for and stamped with `Instant::now()`, and each slice starts `elapsed(start event, that
//! event)` before it. Pairs whose work is still running (a refresh crossing the step boundary)
//! wait for a later step. Measurement only: the events change no result, and cost about two
//! event records per op.
use crate::device::{Device, StreamKind};
use cudarc::driver::CudaEvent;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Slices kept at most (about 100 bytes each); later ones are counted, not kept.
pub const MAX_SLICES: usize = 2_000_000;

/// One span of GPU work on one stream, in host time.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuSlice {
    /// `compute`, `copy-in`, `copy-out` or `side`.
    pub stream: &'static str,
    /// The op (`forward/mat_mul_bias`) or refresh (`refresh h3.attn.c_proj.weight (left)`).
    pub name: String,
    /// When the GPU started it.
    pub start: Instant,
    /// How long it ran, µs.
    pub dur_us: f64,
}

/// The label of a stream in the trace.
pub fn stream_label(kind: StreamKind) -> &'static str {
    match kind {
        StreamKind::Compute => "compute",
        StreamKind::CopyIn => "copy-in",
        StreamKind::CopyOut => "copy-out",
        StreamKind::Side => "side",
    }
}

struct Pending {
    stream: &'static str,
    name: String,
    start: CudaEvent,
    end: CudaEvent,
}

/// Event pairs recorded and not yet turned into slices (shared with the side-stream launcher
/// thread), and the slices made so far.
#[derive(Clone, Default)]
pub(crate) struct GpuTrace {
    pending: Arc<Mutex<Vec<Pending>>>,
    slices: Arc<Mutex<(Vec<GpuSlice>, u64)>>,
}

impl GpuTrace {
    /// Records a timing event on `kind` (the start or end of a slice).
    pub(crate) fn mark(dev: &Device, kind: StreamKind) -> Option<CudaEvent> {
        dev.record(kind, true).ok()
    }

    /// Queues the slice between two recorded events.
    pub(crate) fn push(
        &self,
        stream: &'static str,
        name: String,
        start: CudaEvent,
        end: CudaEvent,
    ) {
        if let Ok(mut p) = self.pending.lock() {
            p.push(Pending {
                stream,
                name,
                start,
                end,
            });
        }
    }

    /// Turns every completed pair into a slice (call when the compute stream is idle: after
    /// a step's synchronize).
    pub(crate) fn flush(&self, dev: &Device) {
        let Ok(base) = dev.record(StreamKind::Compute, true) else {
            return;
        };
        if base.synchronize().is_err() {
            return;
        }
        let now = Instant::now();
        let Ok(mut pending) = self.pending.lock() else {
            return;
        };
        let Ok(mut slices) = self.slices.lock() else {
            return;
        };
        let mut keep = Vec::new();
        for p in pending.drain(..) {
            if !p.end.try_is_complete().unwrap_or(false) {
                keep.push(p);
                continue;
            }
            let (Ok(before), Ok(dur)) = (p.start.elapsed_ms(&base), p.start.elapsed_ms(&p.end))
            else {
                continue;
            };
            let Some(start) =
                now.checked_sub(Duration::from_secs_f64(before.max(0.0) as f64 / 1e3))
            else {
                continue;
            };
            if slices.0.len() < MAX_SLICES {
                slices.0.push(GpuSlice {
                    stream: p.stream,
                    name: p.name,
                    start,
                    dur_us: dur.max(0.0) as f64 * 1e3,
                });
            } else {
                slices.1 += 1;
            }
        }
        *pending = keep;
    }

    /// The slices so far and the number dropped over [`MAX_SLICES`]; empties the trace.
    pub(crate) fn take(&self) -> (Vec<GpuSlice>, u64) {
        self.slices
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default()
    }
}
