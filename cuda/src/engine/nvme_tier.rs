//! The NVMe tier of the CUDA engine: the plan buffers the compiler's `tier-placement` pass put
//! in the `nvme` arena live in an [`NvmeStore`] file in the plan's NVMe directory (the CPU
//! engine's file and region layout, [`engine::nvme::plan_store`] / [`engine::nvme::plan_regions`]
//! with scale 1: buffer `i`'s `numel × 4` f32 bytes at its plan slot offset, checksummed per
//! 1 MiB block), and move through pinned host *bounce slots* to and from their step-local
//! staging buffers on the device.
//!
//! - `CopyIn { src: nvme, dst }`: the engine thread waits for any pending write of `src`,
//!   takes a slot, reads the region into it (synchronously, every block's CRC32 checked), then
//!   enqueues the host→device copy into `dst` on the copy-in stream and records an event; the
//!   slot is busy until that event completes.
//! - `CopyOut { src, dst: nvme }`: the engine thread takes a slot, enqueues the device→host copy
//!   from `src` on the copy-out stream, records an event and hands the slot to the *writer
//!   thread* (one per engine, FIFO), which waits for the event, writes the slot to the region
//!   and frees the slot. The engine thread never waits for a disk write unless every slot is
//!   busy writing, or it reads a buffer whose write is still pending.
//! - Slots: [`NVME_SLOTS`] (4) of the largest NVMe buffer's bytes each, one pinned arena
//!   (`nvme-bounce`, counted with the engine's pinned bytes and listed by `arena_line`): enough
//!   for a copy in flight each way while the writer writes the previous copy out, and for a
//!   refresh swap's two moments. A slot is reused only after its host→device copy completed
//!   (event) or its write finished (ticket); when none is free the engine waits for the one
//!   used longest ago ([`pick`]).
//! - Writes are numbered by *tickets* in submission order; the writer completes them in that
//!   order, so "ticket t done" means every write up to t is on disk. A read of a buffer waits
//!   for the ticket of its last write; the end of a step ([`NvmeTier::finish_step`], from the
//!   engine's step synchronisation) waits for every ticket, so checkpoints and the next step
//!   see consistent state.
//! - A refresh swap that re-projects moments on NVMe pages them into slots
//!   ([`NvmeTier::page_in`]; the swap then treats them as pinned host moments) and writes them
//!   back after the swap's compute-stream work ([`NvmeTier::page_out`]). Accessors (`buffer`,
//!   `set_buffer`, checkpoints, the train-match) read and write regions directly.
//!
//! Errors: a failed read (checksum mismatch, truncated or unwritten block, I/O error) is
//! returned at once; a failed write (full disk, I/O error, a failed copy event) is kept by the
//! writer and returned by every later NVMe operation and by the step's synchronisation, as
//! [`CudaError::Tier`] (the engine reports `EngineError::Tier`). A region whose write failed
//! has its blocks marked unwritten, so it can never be read back as state.
use crate::device::Device;
use crate::error::{CudaError, Tier};
use crate::memory::{Arena, Buf, Elem, BUF_ALIGN};
use crate::StreamKind;
use cudarc::driver::CudaEvent;
use engine::nvme::NvmeStore;
use engine::EngineError;
use schedule::{BufferId, DType, Plan};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Pinned bounce slots of one engine (see the module docs).
pub(super) const NVME_SLOTS: usize = schedule::reserve::NVME_BOUNCE_SLOTS;

/// What the writer waits for before it writes a slot: the device→host copy into it.
pub(super) trait Fence: Send {
    /// Blocks until the copy completed.
    ///
    /// # Errors
    /// The copy (or an earlier asynchronous operation) failed.
    fn wait(&self) -> Result<(), String>;
}

impl Fence for CudaEvent {
    fn wait(&self) -> Result<(), String> {
        self.synchronize().map_err(|e| e.to_string())
    }
}

/// Host bytes a write reads: `len` bytes at `ptr`, kept allocated by `_keep` (the slot's
/// [`Buf`], which holds the pinned allocation).
pub(super) struct Source {
    ptr: *const u8,
    len: usize,
    _keep: Box<dyn Send>,
}

// SAFETY: the bytes belong to `_keep`'s allocation, which moves with the source; the engine
// does not touch the slot until the write's ticket completed.
unsafe impl Send for Source {}

struct WriteJob {
    ticket: u64,
    offset: u64,
    src: Source,
    fence: Box<dyn Fence>,
}

/// What the writer has done: every ticket up to `completed`, and the first error.
#[derive(Default)]
struct Progress {
    completed: u64,
    error: Option<String>,
}

/// The writer thread of one store: writes submitted slots in ticket order (see the module docs).
pub(super) struct Writer {
    tx: Option<mpsc::Sender<WriteJob>>,
    progress: Arc<(Mutex<Progress>, Condvar)>,
    thread: Option<JoinHandle<()>>,
    /// Tickets handed out so far (the last one is `next - 1`; 0 means none).
    next: u64,
}

impl Writer {
    /// Starts the thread writing to `store`.
    pub(super) fn spawn(store: Arc<NvmeStore>) -> std::io::Result<Writer> {
        let (tx, rx) = mpsc::channel::<WriteJob>();
        let progress = Arc::new((Mutex::new(Progress::default()), Condvar::new()));
        let p = Arc::clone(&progress);
        let thread = std::thread::Builder::new()
            .name("asteria-nvme-writer".into())
            .spawn(move || {
                for job in rx {
                    let r = job.fence.wait().and_then(|()| {
                        // SAFETY: `src` covers `len` bytes of a live allocation (`_keep`) that
                        // the device→host copy (waited for above) filled and nobody writes
                        // until this ticket completes.
                        let bytes = unsafe { std::slice::from_raw_parts(job.src.ptr, job.src.len) };
                        store.write(job.offset, bytes).map_err(|e| e.to_string())
                    });
                    drop(job.src);
                    let (m, cv) = &*p;
                    let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
                    g.completed = job.ticket;
                    if let Err(e) = r {
                        g.error.get_or_insert(e);
                    }
                    cv.notify_all();
                }
            })?;
        Ok(Writer {
            tx: Some(tx),
            progress,
            thread: Some(thread),
            next: 1,
        })
    }

    /// Queues a write of `src` at `offset` after `fence`; returns its ticket.
    pub(super) fn submit(
        &mut self,
        offset: u64,
        src: Source,
        fence: Box<dyn Fence>,
    ) -> Result<u64, String> {
        let ticket = self.next;
        let job = WriteJob {
            ticket,
            offset,
            src,
            fence,
        };
        self.tx
            .as_ref()
            .ok_or("the writer thread is gone")?
            .send(job)
            .map_err(|_| "the writer thread stopped".to_string())?;
        self.next += 1;
        Ok(ticket)
    }

    /// Whether the write of `ticket` has finished (successfully or not).
    pub(super) fn is_done(&self, ticket: u64) -> bool {
        let g = self.progress.0.lock().unwrap_or_else(|e| e.into_inner());
        g.completed >= ticket
    }

    /// The first failed write so far.
    pub(super) fn error(&self) -> Option<String> {
        let g = self.progress.0.lock().unwrap_or_else(|e| e.into_inner());
        g.error.clone()
    }

    /// Waits until every write up to `ticket` finished; the first failed write so far is an
    /// error.
    pub(super) fn wait(&self, ticket: u64) -> Result<(), String> {
        let (m, cv) = &*self.progress;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        while g.completed < ticket {
            if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
                return Err("the NVMe writer thread stopped with writes pending".into());
            }
            g = cv
                .wait_timeout(g, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        match &g.error {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Waits for every write submitted so far.
    pub(super) fn wait_all(&self) -> Result<(), String> {
        self.wait(self.next - 1)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a bounce slot is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotUse {
    /// Nothing: it may be taken.
    Free,
    /// Taken by the engine thread (being filled, or holding a moment during a swap).
    Held,
    /// Source of a host→device copy (busy until its event completes); `seq` orders uses.
    In { seq: u64 },
    /// Waiting to be written, or being written (busy until `ticket` completes).
    Write { seq: u64, ticket: u64 },
}

/// How to get a slot: take slot `i` now, or wait for slot `i`'s copy or write first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pick {
    Take(usize),
    WaitFor(usize),
}

/// The next slot to use, given each slot's use and whether its copy or write is done (`done`,
/// same length; ignored for free and held slots): a free slot, else the busy slot whose work
/// is done and was started longest ago, else the busy slot started longest ago (to wait for);
/// `None` when every slot is held.
pub(super) fn pick(uses: &[SlotUse], done: &[bool]) -> Option<Pick> {
    if let Some(i) = uses.iter().position(|u| *u == SlotUse::Free) {
        return Some(Pick::Take(i));
    }
    let seq = |u: &SlotUse| match *u {
        SlotUse::In { seq } | SlotUse::Write { seq, .. } => Some(seq),
        _ => None,
    };
    let oldest = |want_done: bool| {
        uses.iter()
            .enumerate()
            .filter(|&(i, u)| seq(u).is_some() && (!want_done || done[i]))
            .min_by_key(|&(_, u)| seq(u))
            .map(|(i, _)| i)
    };
    oldest(true)
        .map(Pick::Take)
        .or_else(|| oldest(false).map(Pick::WaitFor))
}

fn tier_err(what: impl std::fmt::Display) -> CudaError {
    CudaError::Tier {
        what: what.to_string(),
    }
}

/// `bytes` as little-endian f32s (bit-exact).
fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The NVMe buffers of one engine, their bounce slots and the writer (see the module docs).
pub(super) struct NvmeTier {
    store: Arc<NvmeStore>,
    /// Per plan buffer: its region offset when it lives on NVMe.
    regions: Vec<Option<u64>>,
    /// Per plan buffer: its element count.
    numel: Vec<usize>,
    slots: Vec<Buf>,
    uses: Vec<SlotUse>,
    /// Per slot: the event after its host→device copy, while [`SlotUse::In`].
    in_events: Vec<Option<CudaEvent>>,
    /// Per plan buffer: the ticket of its last write, while it may be pending.
    pending: Vec<Option<u64>>,
    writer: Writer,
    seq: u64,
    /// Bytes of the pinned bounce arena.
    pub(super) pinned_bytes: usize,
    _arena: Arena,
}

impl NvmeTier {
    /// The plan's NVMe store (`None` when it places nothing on NVMe), its bounce slots and
    /// writer thread.
    ///
    /// # Errors
    /// [`EngineError::Tier`] for a non-f32 NVMe buffer and [`engine::nvme::plan_store`]'s
    /// errors (no directory, a full disk); a failed pinned allocation.
    pub(super) fn new(dev: &Device, plan: &Plan) -> Result<Option<NvmeTier>, EngineError> {
        let Some(store) = engine::nvme::plan_store(plan, 1)? else {
            return Ok(None);
        };
        let regions = engine::nvme::plan_regions(plan, 1);
        let mut max = 0usize;
        for (b, r) in plan.buffers.iter().zip(&regions) {
            if r.is_none() {
                continue;
            }
            if b.dtype != DType::F32 {
                return Err(EngineError::Tier(format!(
                    "`{}` is on NVMe but is {:?}; only f32 state is offloaded",
                    b.name, b.dtype
                )));
            }
            max = max.max(b.numel());
        }
        // What `tier-placement` counted in `host_memory` for them.
        let pinned_bytes = schedule::reserve::nvme_bounce_bytes(plan);
        debug_assert_eq!(
            pinned_bytes,
            NVME_SLOTS * (max.max(1) * 4).next_multiple_of(BUF_ALIGN)
        );
        let cuda = |w: &str| {
            let w = w.to_string();
            move |e: CudaError| EngineError::Unsupported(format!("CUDA backend, {w}: {e}"))
        };
        let mut arena = dev
            .arena("nvme-bounce", Tier::PinnedHost, pinned_bytes)
            .map_err(cuda("allocating the NVMe bounce slots"))?;
        let slots = (0..NVME_SLOTS)
            .map(|_| arena.buf(Elem::F32, max.max(1)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(cuda("carving the NVMe bounce slots"))?;
        let store = Arc::new(store);
        let writer = Writer::spawn(Arc::clone(&store))
            .map_err(|e| EngineError::Tier(format!("cannot start the NVMe writer thread: {e}")))?;
        Ok(Some(NvmeTier {
            store,
            regions,
            numel: plan.buffers.iter().map(|b| b.numel()).collect(),
            uses: vec![SlotUse::Free; NVME_SLOTS],
            in_events: (0..NVME_SLOTS).map(|_| None).collect(),
            pending: vec![None; plan.buffers.len()],
            slots,
            writer,
            seq: 0,
            pinned_bytes,
            _arena: arena,
        }))
    }

    /// A zero-length stand-in for an NVMe buffer in the engine's buffer table: no kernel can
    /// read or write it (any launcher refuses a pinned-host operand), so only this module
    /// touches NVMe state.
    pub(super) fn placeholder(&self) -> Result<Buf, CudaError> {
        self.slots[0].slice(0, 0)
    }

    /// Whether buffer `id` lives on NVMe.
    pub(super) fn holds(&self, id: BufferId) -> bool {
        matches!(self.regions.get(id.index()), Some(Some(_)))
    }

    fn region(&self, id: BufferId) -> Result<(u64, usize), CudaError> {
        match self.regions.get(id.index()) {
            Some(Some(at)) => Ok((*at, self.numel[id.index()])),
            _ => Err(tier_err(format!("buffer #{} is not on NVMe", id.0))),
        }
    }

    /// The writer's first failure, if any.
    fn check(&self) -> Result<(), CudaError> {
        match self.writer.error() {
            Some(e) => Err(tier_err(format!("an earlier write failed: {e}"))),
            None => Ok(()),
        }
    }

    /// Waits for the pending write of `id`, if any.
    fn wait_pending(&self, id: BufferId) -> Result<(), CudaError> {
        match self.pending.get(id.index()).copied().flatten() {
            Some(t) => self.writer.wait(t).map_err(tier_err),
            None => self.check(),
        }
    }

    /// Takes a slot (marked [`SlotUse::Held`]), waiting for one if all are busy.
    fn acquire(&mut self) -> Result<usize, CudaError> {
        let done = (0..NVME_SLOTS)
            .map(|i| match self.uses[i] {
                SlotUse::In { .. } => match &self.in_events[i] {
                    Some(ev) => ev.try_is_complete().map_err(CudaError::from),
                    None => Ok(true),
                },
                SlotUse::Write { ticket, .. } => Ok(self.writer.is_done(ticket)),
                _ => Ok(false),
            })
            .collect::<Result<Vec<bool>, _>>()?;
        let i = match pick(&self.uses, &done) {
            Some(Pick::Take(i)) => i,
            Some(Pick::WaitFor(i)) => {
                match self.uses[i] {
                    SlotUse::In { .. } => {
                        if let Some(ev) = &self.in_events[i] {
                            ev.synchronize()?;
                        }
                    }
                    SlotUse::Write { ticket, .. } => self.writer.wait(ticket).map_err(tier_err)?,
                    _ => {}
                }
                i
            }
            None => {
                return Err(CudaError::Invalid {
                    op: "nvme",
                    what: "every NVMe bounce slot is held".into(),
                })
            }
        };
        self.in_events[i] = None;
        self.uses[i] = SlotUse::Held;
        Ok(i)
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Slot `s` as `numel` f32.
    fn slot(&self, s: usize, numel: usize) -> Result<Buf, CudaError> {
        self.slots[s].slice(0, numel)
    }

    /// Reads `id`'s region into a newly taken slot, after its pending write.
    fn read_into_slot(&mut self, id: BufferId) -> Result<usize, CudaError> {
        let (at, numel) = self.region(id)?;
        self.wait_pending(id)?;
        let s = self.acquire()?;
        let slot = self.slot(s, numel)?;
        // SAFETY: the slot is pinned host memory of at least `numel` f32 that no copy uses
        // (`acquire` waited for its last copy or write) and only this thread touches while held.
        let bytes = unsafe { std::slice::from_raw_parts_mut(slot.ptr() as *mut u8, numel * 4) };
        if let Err(e) = self.store.read(at, bytes) {
            self.uses[s] = SlotUse::Free;
            return Err(tier_err(e));
        }
        Ok(s)
    }

    /// Hands held slot `s` to the writer for `id`'s region, after `fence`.
    fn submit_write(
        &mut self,
        s: usize,
        id: BufferId,
        fence: Box<dyn Fence>,
    ) -> Result<(), CudaError> {
        let (at, numel) = self.region(id)?;
        let slot = self.slot(s, numel)?;
        let src = Source {
            ptr: slot.ptr() as *const u8,
            len: numel * 4,
            _keep: Box::new(slot),
        };
        let ticket = match self.writer.submit(at, src, fence) {
            Ok(t) => t,
            Err(e) => {
                // The copy into the slot (copy-out or compute stream) is already enqueued and
                // nobody waits for it: the slot must not be taken again (as after a failed copy).
                self.uses[s] = SlotUse::Held;
                return Err(tier_err(e));
            }
        };
        let seq = self.next_seq();
        self.uses[s] = SlotUse::Write { seq, ticket };
        self.pending[id.index()] = Some(ticket);
        Ok(())
    }

    /// `CopyIn`: NVMe buffer `src` into the device staging buffer `dst`, on the copy-in stream
    /// (after the waits the engine placed on it).
    pub(super) fn copy_in(
        &mut self,
        dev: &Device,
        src: BufferId,
        dst: &Buf,
    ) -> Result<(), CudaError> {
        let s = self.read_into_slot(src)?;
        let r = self.slot(s, self.numel[src.index()]).and_then(|slot| {
            dev.copy(dst, &slot, StreamKind::CopyIn)?;
            dev.record(StreamKind::CopyIn, false)
        });
        match r {
            Ok(ev) => {
                let seq = self.next_seq();
                self.uses[s] = SlotUse::In { seq };
                self.in_events[s] = Some(ev);
                Ok(())
            }
            Err(e) => {
                // Nothing was enqueued, or the context is broken: the slot is not reused.
                self.uses[s] = SlotUse::Held;
                Err(e)
            }
        }
    }

    /// `CopyOut`: the device staging buffer `src` to NVMe buffer `dst`: a device→host copy on
    /// the copy-out stream, written by the writer thread.
    pub(super) fn copy_out(
        &mut self,
        dev: &Device,
        src: &Buf,
        dst: BufferId,
    ) -> Result<(), CudaError> {
        self.check()?;
        let (_, numel) = self.region(dst)?;
        let s = self.acquire()?;
        let r = self.slot(s, numel).and_then(|slot| {
            dev.copy(&slot, src, StreamKind::CopyOut)?;
            dev.record(StreamKind::CopyOut, false)
        });
        match r {
            Ok(ev) => self.submit_write(s, dst, Box::new(ev)),
            Err(e) => {
                self.uses[s] = SlotUse::Held;
                Err(e)
            }
        }
    }

    /// Brings NVMe buffer `id` into a slot for a refresh swap; returns the slot and its pinned
    /// buffer (`numel` f32), held until [`NvmeTier::page_out`] or [`NvmeTier::release`].
    pub(super) fn page_in(&mut self, id: BufferId) -> Result<(usize, Buf), CudaError> {
        let s = self.read_into_slot(id)?;
        Ok((s, self.slot(s, self.numel[id.index()])?))
    }

    /// Writes slot `s` (from [`NvmeTier::page_in`]) back to `id` after the work enqueued on
    /// `stream` so far.
    pub(super) fn page_out(
        &mut self,
        dev: &Device,
        s: usize,
        id: BufferId,
        stream: StreamKind,
    ) -> Result<(), CudaError> {
        let ev = dev.record(stream, false)?;
        self.submit_write(s, id, Box::new(ev))
    }

    /// Frees held slot `s` without writing it (a swap that left the moments alone); the caller
    /// has made sure no enqueued copy reads it any more.
    pub(super) fn release(&mut self, s: usize) {
        self.uses[s] = SlotUse::Free;
    }

    /// The end of a step, after the device's streams are idle: waits for every pending write
    /// and frees every slot.
    ///
    /// # Errors
    /// The first failed write.
    pub(super) fn finish_step(&mut self) -> Result<(), CudaError> {
        let r = self.writer.wait_all().map_err(tier_err);
        for (u, ev) in self.uses.iter_mut().zip(&mut self.in_events) {
            if matches!(u, SlotUse::In { .. } | SlotUse::Write { .. }) {
                *u = SlotUse::Free;
                *ev = None;
            }
        }
        self.pending.iter_mut().for_each(|p| *p = None);
        r
    }

    /// NVMe buffer `id` read back whole (after its pending write), as f32.
    pub(super) fn read(&self, id: BufferId) -> Result<Vec<f32>, CudaError> {
        let (at, numel) = self.region(id)?;
        self.wait_pending(id)?;
        let mut bytes = vec![0u8; numel * 4];
        self.store.read(at, &mut bytes).map_err(tier_err)?;
        Ok(f32s(&bytes))
    }

    /// Overwrites NVMe buffer `id` with `v` (its element count), synchronously.
    pub(super) fn write(&mut self, id: BufferId, v: &[f32]) -> Result<(), CudaError> {
        let (at, numel) = self.region(id)?;
        if v.len() != numel {
            return Err(CudaError::Shape {
                op: "nvme write",
                operand: "values",
                expected: numel,
                got: v.len(),
            });
        }
        self.wait_pending(id)?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.store.write(at, &bytes).map_err(tier_err)?;
        self.pending[id.index()] = None;
        Ok(())
    }

    /// Bytes read and written so far and whether the store uses O_DIRECT.
    pub(super) fn stats(&self) -> engine::nvme::NvmeStats {
        self.store.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_slot_is_taken_first_then_the_oldest_finished_one() {
        use SlotUse::*;
        let uses = [In { seq: 3 }, Free, Write { seq: 1, ticket: 1 }, Held];
        assert_eq!(pick(&uses, &[true; 4]), Some(Pick::Take(1)));
        let uses = [
            In { seq: 3 },
            Write { seq: 2, ticket: 2 },
            Write { seq: 1, ticket: 1 },
            Held,
        ];
        // Finished work is reused oldest first; held slots never are.
        assert_eq!(pick(&uses, &[true, true, true, true]), Some(Pick::Take(2)));
        assert_eq!(pick(&uses, &[true, true, false, true]), Some(Pick::Take(1)));
        // Nothing finished: wait for the oldest use.
        assert_eq!(pick(&uses, &[false; 4]), Some(Pick::WaitFor(2)));
        assert_eq!(pick(&[Held, Held], &[true, true]), None);
    }

    /// A fence that holds the writer until the test opens it (a device→host copy in flight).
    struct Gate(Arc<(Mutex<Option<Result<(), String>>>, Condvar)>);

    impl Fence for Gate {
        fn wait(&self) -> Result<(), String> {
            let (m, cv) = &*self.0;
            let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
            while g.is_none() {
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            g.clone().unwrap_or(Ok(()))
        }
    }

    fn gate() -> (Gate, impl Fn(Result<(), String>)) {
        let s = Arc::new((Mutex::new(None), Condvar::new()));
        let s2 = Arc::clone(&s);
        (Gate(s), move |r| {
            *s2.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            s2.1.notify_all();
        })
    }

    fn source(v: Vec<u8>) -> Source {
        Source {
            ptr: v.as_ptr(),
            len: v.len(),
            _keep: Box::new(v),
        }
    }

    fn store(name: &str) -> (Arc<NvmeStore>, std::path::PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("asteria-cuda-nvme-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let s = NvmeStore::create(&dir, "t.nvme", 4 << 20).expect("store");
        (Arc::new(s), dir)
    }

    #[test]
    fn writes_complete_in_ticket_order_after_their_fence() {
        let (st, dir) = store("order");
        let mut w = Writer::spawn(Arc::clone(&st)).expect("writer");
        let (g1, open1) = gate();
        let a = vec![7u8; 3000];
        let t1 = w
            .submit(0, source(a.clone()), Box::new(g1))
            .expect("submit");
        let b = vec![9u8; 5000];
        let t2 = w
            .submit(
                1 << 20,
                source(b.clone()),
                Box::new(Gate(Arc::new((Mutex::new(Some(Ok(()))), Condvar::new())))),
            )
            .expect("submit");
        assert!(t2 > t1);
        std::thread::sleep(Duration::from_millis(20));
        // The first write waits for its copy; the second waits behind it (FIFO).
        assert!(!w.is_done(t1) && !w.is_done(t2));
        open1(Ok(()));
        w.wait(t2).expect("both written");
        assert!(w.is_done(t1));
        let mut out = vec![0u8; 3000];
        st.read(0, &mut out).expect("read back");
        assert_eq!(out, a);
        let mut out = vec![0u8; 5000];
        st.read(1 << 20, &mut out).expect("read back");
        assert_eq!(out, b);
        drop(w);
        drop(st);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_failed_copy_or_write_is_reported_by_every_later_wait() {
        let (st, dir) = store("errors");
        let mut w = Writer::spawn(Arc::clone(&st)).expect("writer");
        let (g, open) = gate();
        let t = w
            .submit(0, source(vec![1u8; 10]), Box::new(g))
            .expect("submit");
        open(Err("copy failed".into()));
        let e = w.wait(t).expect_err("the failed copy is an error");
        assert!(e.contains("copy failed"), "{e}");
        // A region past the reservation: the write fails, the error stays the first one.
        let (g2, open2) = gate();
        open2(Ok(()));
        let t2 = w
            .submit(8 << 20, source(vec![1u8; 10]), Box::new(g2))
            .expect("submit");
        assert!(w.wait(t2).is_err());
        assert!(w.wait_all().unwrap_err().contains("copy failed"));
        // Nothing was written where the copy failed: the region cannot be read as state.
        assert!(st.read(0, &mut [0u8; 10]).is_err());
        drop(w);
        drop(st);
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Moments of a refresh swap paged in from NVMe: `(slot, buffer)` per paged moment.
pub(super) type Paged = Vec<(usize, BufferId)>;

impl super::CudaEngine {
    /// Buffer `id` as f32 on the host: downloaded (after the compute stream's work), or read
    /// from NVMe (after its pending write).
    pub(super) fn download_state(&self, id: BufferId) -> Result<Vec<f32>, CudaError> {
        match self.nvme.as_ref().filter(|n| n.holds(id)) {
            Some(nv) => nv.read(id),
            None => self.dev.download::<f32>(self.b(id)),
        }
    }

    /// Writes `v` to f32 buffer `id`: uploaded, or written to NVMe.
    pub(super) fn upload_state(&mut self, id: BufferId, v: &[f32]) -> Result<(), CudaError> {
        match self.nvme.as_mut().filter(|n| n.holds(id)) {
            Some(nv) => nv.write(id, v),
            None => self.dev.upload(self.b(id), v),
        }
    }

    /// The moments `ids` of a refresh swap as buffers the swap can read and write: a device or
    /// pinned-host buffer as it is, an NVMe buffer paged into a bounce slot (listed in the
    /// returned [`Paged`] for [`CudaEngine::swap_moments_back`]).
    pub(super) fn swap_moments(
        &mut self,
        ids: [BufferId; 2],
    ) -> Result<([Buf; 2], Paged), CudaError> {
        let mut paged = Paged::new();
        let mut out = Vec::with_capacity(2);
        for id in ids {
            match self.nvme.as_mut().filter(|n| n.holds(id)) {
                Some(nv) => match nv.page_in(id) {
                    Ok((s, b)) => {
                        paged.push((s, id));
                        out.push(b);
                    }
                    Err(e) => {
                        for &(s, _) in &paged {
                            nv.release(s);
                        }
                        return Err(e);
                    }
                },
                None => out.push(self.b(id).clone()),
            }
        }
        let [a, b]: [Buf; 2] = out.try_into().map_err(|_| CudaError::Invalid {
            op: "refresh swap",
            what: "internal: two moments expected".into(),
        })?;
        Ok(([a, b], paged))
    }

    /// Writes the moments [`CudaEngine::swap_moments`] paged in back to NVMe, after the swap's
    /// work on the compute stream.
    pub(super) fn swap_moments_back(&mut self, paged: Paged) -> Result<(), CudaError> {
        let Some(nv) = self.nvme.as_mut() else {
            return Ok(());
        };
        for (s, id) in paged {
            nv.page_out(&self.dev, s, id, StreamKind::Compute)?;
        }
        Ok(())
    }

    /// Bytes the NVMe tier read and wrote so far (`None` without one).
    pub fn nvme_stats(&self) -> Option<engine::nvme::NvmeStats> {
        self.nvme.as_ref().map(|n| n.stats())
    }
}
