//! Memory: one allocation per arena, carved at aligned offsets (llm.c's "all parameters in one
//! allocation"), typed buffer handles, and device-wide accounting for peak-memory reports.
//!
//! An [`Arena`] owns one allocation in one [`Tier`]; [`Arena::carve`] hands out [`Buf`]s at
//! increasing aligned offsets, [`Arena::buf_at`] at an offset decided by the plan's memory plan
//! (buffers with disjoint live ranges share bytes). A `Buf` keeps the allocation alive (reference counted), so a
//! device pointer never dangles; [`Arena::reset`] rewinds the offset only when no `Buf` is
//! alive. The offset arithmetic lives in [`Carver`], which needs no GPU and is unit-tested.
use crate::error::{CudaError, Result, Tier};
use cudarc::driver::{result as drv, CudaContext};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Element type of a [`Buf`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    /// IEEE binary32.
    F32,
    /// 32-bit signed integer (token ids, status words).
    I32,
    /// bfloat16 (GEMM operands of the bf16 path).
    BF16,
    /// IEEE binary64 (reduction partials).
    F64,
}

impl Elem {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            Elem::BF16 => 2,
            Elem::F32 | Elem::I32 => 4,
            Elem::F64 => 8,
        }
    }
}

impl std::fmt::Display for Elem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Elem::F32 => "f32",
            Elem::I32 => "i32",
            Elem::BF16 => "bf16",
            Elem::F64 => "f64",
        })
    }
}

/// Bump allocator over `[0, capacity)` bytes with a high-water mark. Pure arithmetic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Carver {
    capacity: usize,
    offset: usize,
    peak: usize,
}

impl Carver {
    /// An empty carver over `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        Carver {
            capacity,
            offset: 0,
            peak: 0,
        }
    }

    /// Reserves `bytes` at the next offset aligned to `align` (a power of two); returns the
    /// offset, or `None` (state unchanged) when it would pass the capacity.
    pub fn carve(&mut self, bytes: usize, align: usize) -> Option<usize> {
        debug_assert!(
            align.is_power_of_two(),
            "invariant: alignment is a power of two"
        );
        let start = self.offset.checked_add(align - 1)? & !(align - 1);
        let end = start.checked_add(bytes)?;
        if end > self.capacity {
            return None;
        }
        self.offset = end;
        self.peak = self.peak.max(end);
        Some(start)
    }

    /// Reserves `bytes` at the given `offset` (a multiple of `align`, a power of two) — a
    /// placement decided elsewhere (the plan's memory plan), which may overlap earlier
    /// placements. Returns the offset, or `None` (state unchanged) when it is misaligned or
    /// would pass the capacity. Later [`Carver::carve`]s start after the placed bytes.
    pub fn place(&mut self, offset: usize, bytes: usize, align: usize) -> Option<usize> {
        debug_assert!(
            align.is_power_of_two(),
            "invariant: alignment is a power of two"
        );
        if offset & (align - 1) != 0 {
            return None;
        }
        let end = offset.checked_add(bytes)?;
        if end > self.capacity {
            return None;
        }
        self.offset = self.offset.max(end);
        self.peak = self.peak.max(end);
        Some(offset)
    }

    /// Bytes used up to the current offset.
    pub fn used(&self) -> usize {
        self.offset
    }

    /// Highest offset ever reached (survives [`Carver::reset`]).
    pub fn peak(&self) -> usize {
        self.peak
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Rewinds to offset 0.
    pub fn reset(&mut self) {
        self.offset = 0;
    }
}

/// Device-wide byte counters shared by every allocation of a [`crate::Device`].
#[derive(Debug, Default)]
pub(crate) struct MemCounters {
    reserved: [AtomicUsize; 2],
    peak_reserved: [AtomicUsize; 2],
    /// Peak of the driver's `total − free`, sampled at allocations and reports.
    pub(crate) peak_used: AtomicUsize,
}

impl MemCounters {
    fn slot(tier: Tier) -> usize {
        match tier {
            Tier::Device => 0,
            Tier::PinnedHost => 1,
        }
    }
    fn add(&self, tier: Tier, bytes: usize) {
        let i = Self::slot(tier);
        let now = self.reserved[i].fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_reserved[i].fetch_max(now, Ordering::Relaxed);
    }
    fn sub(&self, tier: Tier, bytes: usize) {
        self.reserved[Self::slot(tier)].fetch_sub(bytes, Ordering::Relaxed);
    }
    /// `(reserved now, peak reserved)` in bytes for `tier`.
    pub(crate) fn get(&self, tier: Tier) -> (usize, usize) {
        let i = Self::slot(tier);
        (
            self.reserved[i].load(Ordering::Relaxed),
            self.peak_reserved[i].load(Ordering::Relaxed),
        )
    }
    /// Samples the driver's used memory into the peak.
    pub(crate) fn sample(&self, ctx: &CudaContext) {
        if let Ok((free, total)) = ctx.mem_get_info() {
            self.peak_used
                .fetch_max(total.saturating_sub(free), Ordering::Relaxed);
        }
    }
}

/// One raw allocation; freed (after a context synchronize) when the last holder drops.
#[derive(Debug)]
struct Alloc {
    tier: Tier,
    base: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
    counters: Arc<MemCounters>,
}

impl Drop for Alloc {
    fn drop(&mut self) {
        // In-flight kernels may still use the memory: wait for them before freeing.
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        // SAFETY: `base` came from the matching allocation call and is freed exactly once.
        let freed = unsafe {
            match self.tier {
                Tier::Device => drv::free_sync(self.base),
                Tier::PinnedHost => drv::free_host(self.base as *mut std::ffi::c_void),
            }
        };
        if let Err(e) = freed {
            tracing::warn!(
                "freeing {} bytes of {} memory failed: {e}",
                self.bytes,
                self.tier
            );
        }
        self.counters.sub(self.tier, self.bytes);
    }
}

/// A typed, contiguous piece of an arena: `len` elements of `elem` at a fixed address.
///
/// Cloning is cheap (reference counted); every clone keeps the arena's allocation alive.
#[derive(Clone, Debug)]
pub struct Buf {
    alloc: Arc<Alloc>,
    offset: usize,
    elem: Elem,
    len: usize,
}

impl Buf {
    /// The address (device pointer, or host pointer for [`Tier::PinnedHost`]).
    pub fn ptr(&self) -> u64 {
        self.alloc.base + self.offset as u64
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when `len() == 0`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Element type.
    pub fn elem(&self) -> Elem {
        self.elem
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.elem.size_bytes()
    }
    /// The tier it lives in.
    pub fn tier(&self) -> Tier {
        self.alloc.tier
    }
    /// Elements `[start, start + len)` as their own `Buf` (same allocation).
    pub fn slice(&self, start: usize, len: usize) -> Result<Buf> {
        if start.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(CudaError::Invalid {
                op: "Buf::slice",
                what: format!(
                    "[{start}, {start}+{len}) is outside a buffer of {} elements",
                    self.len
                ),
            });
        }
        Ok(Buf {
            alloc: self.alloc.clone(),
            offset: self.offset + start * self.elem.size_bytes(),
            elem: self.elem,
            len,
        })
    }
    /// The same bytes viewed as `len` elements of `elem` (e.g. f32 scratch reused as f64).
    pub fn reinterpret(&self, elem: Elem, len: usize) -> Result<Buf> {
        if len * elem.size_bytes() > self.bytes() || self.ptr() % elem.size_bytes() as u64 != 0 {
            return Err(CudaError::Invalid {
                op: "Buf::reinterpret",
                what: format!(
                    "{len} x {elem} does not fit in {} x {}",
                    self.len, self.elem
                ),
            });
        }
        Ok(Buf {
            alloc: self.alloc.clone(),
            offset: self.offset,
            elem,
            len,
        })
    }
    /// Checks `elem`, `len` and the device tier for launcher `op`.
    pub(crate) fn expect(
        &self,
        op: &'static str,
        operand: &'static str,
        elem: Elem,
        len: usize,
    ) -> Result<()> {
        if self.elem != elem || self.tier() != Tier::Device {
            return Err(CudaError::Operand {
                op,
                operand,
                expected: format!("{elem} in device memory"),
                got: format!("{} in {} memory", self.elem, self.tier()),
            });
        }
        if self.len != len {
            return Err(CudaError::Shape {
                op,
                operand,
                expected: len,
                got: self.len,
            });
        }
        Ok(())
    }
    /// True when the two buffers' byte ranges overlap.
    pub fn overlaps(&self, other: &Buf) -> bool {
        let (a0, b0) = (self.ptr(), other.ptr());
        let (a1, b1) = (a0 + self.bytes() as u64, b0 + other.bytes() as u64);
        a0 < b1 && b0 < a1 && self.bytes() > 0 && other.bytes() > 0
    }
}

/// One allocation in one tier, carved into [`Buf`]s at aligned offsets.
#[derive(Debug)]
pub struct Arena {
    name: String,
    alloc: Arc<Alloc>,
    carver: Carver,
}

/// Default alignment of [`Arena::buf`]: 256 bytes (cuBLAS and vector loads are happy with it).
/// The plan's memory plan aligns its offsets the same way (`schedule::ARENA_ALIGN`).
pub const BUF_ALIGN: usize = 256;
const _: () = assert!(
    BUF_ALIGN == schedule::ARENA_ALIGN,
    "the plan's arena alignment must match the CUDA arena's"
);

impl Arena {
    /// Allocates `bytes` in `tier` (device memory must be bound to `ctx` on this thread).
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        counters: &Arc<MemCounters>,
        name: &str,
        tier: Tier,
        bytes: usize,
    ) -> Result<Arena> {
        ctx.bind_to_thread()?;
        let bytes = bytes.max(BUF_ALIGN);
        // SAFETY: plain allocations; the pointer is owned by `Alloc` and freed in its Drop.
        let base = unsafe {
            match tier {
                Tier::Device => drv::malloc_sync(bytes)?,
                Tier::PinnedHost => drv::malloc_host(bytes, 0)? as u64,
            }
        };
        counters.add(tier, bytes);
        counters.sample(ctx);
        let alloc = Arc::new(Alloc {
            tier,
            base,
            bytes,
            ctx: ctx.clone(),
            counters: counters.clone(),
        });
        Ok(Arena {
            name: name.to_string(),
            alloc,
            carver: Carver::new(bytes),
        })
    }

    /// Carves `len` elements of `elem` at the next [`BUF_ALIGN`]-aligned offset.
    pub fn buf(&mut self, elem: Elem, len: usize) -> Result<Buf> {
        self.carve(elem, len, BUF_ALIGN)
    }

    /// Carves `len` elements of `elem` at the next offset aligned to `align` bytes (a power of
    /// two, at least the element size).
    pub fn carve(&mut self, elem: Elem, len: usize, align: usize) -> Result<Buf> {
        let align = align.max(elem.size_bytes()).next_power_of_two();
        let bytes = byte_len("Arena::carve", elem, len)?;
        let at = self.carver.carve(bytes, align);
        self.buf_or_full(at, elem, len, bytes, align, self.carver.used())
    }

    /// The buffer at `at`, or [`CudaError::ArenaFull`] (asked `bytes` at `offset`) for `None`.
    fn buf_or_full(
        &self,
        at: Option<usize>,
        elem: Elem,
        len: usize,
        bytes: usize,
        align: usize,
        offset: usize,
    ) -> Result<Buf> {
        match at {
            Some(offset) => Ok(Buf {
                alloc: self.alloc.clone(),
                offset,
                elem,
                len,
            }),
            None => Err(CudaError::ArenaFull {
                name: self.name.clone(),
                tier: self.alloc.tier,
                asked: bytes,
                align,
                offset,
                capacity: self.carver.capacity(),
            }),
        }
    }

    /// `len` elements of `elem` at byte `offset` (a multiple of [`BUF_ALIGN`]) — the offset
    /// of a plan buffer in the plan's memory plan. Placed buffers may overlap each other (the
    /// plan shares bytes between buffers with disjoint live ranges); a later
    /// [`Arena::carve`] starts after every placed byte.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a misaligned offset or an overflowing size,
    /// [`CudaError::ArenaFull`] when the buffer would end past the capacity.
    pub fn buf_at(&mut self, elem: Elem, len: usize, offset: usize) -> Result<Buf> {
        let bytes = byte_len("Arena::buf_at", elem, len)?;
        if offset & (BUF_ALIGN - 1) != 0 {
            return Err(CudaError::Invalid {
                op: "Arena::buf_at",
                what: format!(
                    "offset {offset} in arena `{}` is not a multiple of {BUF_ALIGN} bytes",
                    self.name
                ),
            });
        }
        let at = self.carver.place(offset, bytes, BUF_ALIGN);
        self.buf_or_full(at, elem, len, bytes, BUF_ALIGN, offset)
    }

    /// Rewinds to offset 0. Fails with [`CudaError::ArenaBusy`] while any carved `Buf` lives.
    pub fn reset(&mut self) -> Result<()> {
        let live = Arc::strong_count(&self.alloc) - 1;
        if live > 0 {
            return Err(CudaError::ArenaBusy {
                name: self.name.clone(),
                live,
            });
        }
        self.carver.reset();
        Ok(())
    }

    /// The arena's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Its tier.
    pub fn tier(&self) -> Tier {
        self.alloc.tier
    }
    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.carver.capacity()
    }
    /// Bytes carved so far.
    pub fn used(&self) -> usize {
        self.carver.used()
    }
    /// Highest carved offset ever (bytes).
    pub fn peak(&self) -> usize {
        self.carver.peak()
    }
}

/// Bytes of `len` elements of `elem`, or [`CudaError::Invalid`] (naming `op`) on overflow.
fn byte_len(op: &'static str, elem: Elem, len: usize) -> Result<usize> {
    len.checked_mul(elem.size_bytes())
        .ok_or_else(|| CudaError::Invalid {
            op,
            what: format!("{len} elements of {elem} overflow usize"),
        })
}
