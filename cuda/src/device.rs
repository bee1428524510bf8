//! [`Device`]: one CUDA context with the backend's streams ([`StreamKind`]: `compute`,
//! `copy-in`, `copy-out`, `side`), the cuBLAS handle, the NVRTC-compiled kernel families,
//! arenas per tier, the status word that kernels report bad indices through, and memory
//! accounting.
use crate::error::{catch, cublas, CudaError, Result, Tier};
use crate::kernels::{ArgKind, Args, FamilyLoad, Kernels, COMMON};
use crate::memory::{Arena, Buf, Elem, MemCounters};
use crate::nvrtc;
use cudarc::cublas::{result as cb, sys as cbsys};
use cudarc::driver::{
    result as drv, sys, CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig,
    PushKernelArg,
};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

/// True when the CUDA driver library can be loaded (checked before touching cudarc, whose
/// `CudaContext::new` panics without it).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The streams of the CUDA backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamKind {
    /// Forward, backward and optimizer kernels, one priority level below the side stream
    /// (when the device has more than one). cuBLAS runs here.
    Compute,
    /// Pinned host → GPU copies (prefetch of offloaded state).
    CopyIn,
    /// GPU → pinned host copies (eviction).
    CopyOut,
    /// Work off the critical path (GPU eigenbasis refreshes), at the device's greatest
    /// priority, above the compute stream's.
    Side,
}

/// What the driver says about the device.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Marketing name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// NVRTC target derived from it (`sm_90`).
    pub arch: String,
    /// Multiprocessors.
    pub sm_count: u32,
    /// Global memory in bytes.
    pub total_mem: usize,
    /// Shared memory a block may use with the opt-in
    /// (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`; 227 KiB on sm_90), bytes.
    pub max_shared_per_block_optin: usize,
    /// Driver API version as `(major, minor)` (13.0 → `(13, 0)`).
    pub driver_version: (i32, i32),
    /// NVRTC version.
    pub nvrtc_version: (i32, i32),
    /// cuBLAS version (`cublasGetVersion`, e.g. 130001).
    pub cublas_version: i32,
    /// PCI bus id as NVML names it (`00000000:19:00.0`): the GPU's identity across CUDA and
    /// NVML, whose device numbers may differ.
    pub pci_bus_id: String,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "device {}: {} ({}, {} SMs, {:.1} GiB), driver API {}.{}, NVRTC {}.{}, cuBLAS {}",
            self.ordinal,
            self.name,
            self.arch,
            self.sm_count,
            self.total_mem as f64 / (1u64 << 30) as f64,
            self.driver_version.0,
            self.driver_version.1,
            self.nvrtc_version.0,
            self.nvrtc_version.1,
            self.cublas_version
        )
    }
}

/// Dense bf16 tensor-core peak of the GPU named `name` (as the driver reports it), TFLOP/s,
/// from the vendor's data sheets (without sparsity): H100 / H200 / GH200 SXM 989.4, H100 PCIe
/// 756, A100 312. `None` for other GPUs (MFU is then not printed).
pub fn peak_bf16_tflops(name: &str) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    if n.contains("H100") && n.contains("PCIE") {
        Some(756.0)
    } else if n.contains("H100") || n.contains("H200") {
        Some(989.4)
    } else if n.contains("A100") {
        Some(312.0)
    } else {
        None
    }
}

/// The thread of [`Device::spawn_peak_sampler`]; dropping it stops and joins the thread.
#[derive(Debug)]
pub struct PeakSampler {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for PeakSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Memory use in bytes: what the arenas reserved (now and peak, per tier) and what the driver
/// reports used on the whole GPU (peak sampled at allocations and reports, and every 10 ms by
/// a training engine's [`PeakSampler`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryReport {
    /// GPU memory in total.
    pub device_total: usize,
    /// GPU memory free now.
    pub device_free: usize,
    /// Peak of `total − free` seen (includes the context, cuBLAS workspaces, other processes).
    pub device_peak_used: usize,
    /// Device-tier arena bytes reserved now / at peak.
    pub device_reserved: (usize, usize),
    /// Pinned-host arena bytes reserved now / at peak.
    pub pinned_reserved: (usize, usize),
}

impl std::fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "GPU peak used {:.2} GiB of {:.1} GiB; device arenas {:.2} GiB (peak {:.2}); pinned arenas {:.2} GiB (peak {:.2})",
            gib(self.device_peak_used),
            gib(self.device_total),
            gib(self.device_reserved.0),
            gib(self.device_reserved.1),
            gib(self.pinned_reserved.0),
            gib(self.pinned_reserved.1)
        )
    }
}

/// Host element types that map to an [`Elem`], for uploads and downloads.
pub trait HostElem: Copy + Default + 'static {
    /// The matching element type.
    const ELEM: Elem;
}
impl HostElem for f32 {
    const ELEM: Elem = Elem::F32;
}
impl HostElem for i32 {
    const ELEM: Elem = Elem::I32;
}
impl HostElem for f64 {
    const ELEM: Elem = Elem::F64;
}
impl HostElem for half::bf16 {
    const ELEM: Elem = Elem::BF16;
}

/// An owned cuBLAS handle bound to one stream.
struct Cublas(cbsys::cublasHandle_t);

// SAFETY: a handle is used by one host thread at a time: the compute stream's by the engine
// thread, the side stream's by the thread that enqueues side-stream refreshes (one at a time,
// see `engine::tasks`). cuBLAS handles may move between threads.
unsafe impl Send for Cublas {}
// SAFETY: as above; shared references only hand the raw handle to calls made by its one user.
unsafe impl Sync for Cublas {}

impl Drop for Cublas {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle`, destroyed once.
        let _ = unsafe { cb::destroy_handle(self.0) };
    }
}

/// One GPU: context, streams, cuBLAS, kernels, arenas. See the module docs.
pub struct Device {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy_in: Arc<CudaStream>,
    copy_out: Arc<CudaStream>,
    side: Arc<CudaStream>,
    cublas: Cublas,
    cublas_side: Cublas,
    /// cuBLASLt for fused-epilogue GEMMs (`None` without the library).
    blas_lt: Option<crate::lt::BlasLt>,
    kernels: Kernels,
    info: DeviceInfo,
    counters: Arc<MemCounters>,
    status: Buf,
    _internal: Arena,
    gemm_math: AtomicU8,
    flash_kernels: AtomicU8,
}

/// Which fused attention kernels run `precision = bf16` attention
/// ([`crate::ops::attention`]): both compute the same math (bf16 operands into the tensor cores,
/// fp32 accumulation and softmax, the same tiles and causal masks; results differ only by the
/// order of fp32 additions inside an MMA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashKernels {
    /// `mma.sync m16n8k16` (`flash_attention_tc.cu`): every device from compute capability 8.0.
    Mma,
    /// Hopper's warpgroup MMA (`wgmma`, `flash_attention_wgmma.cu`): compute capability 9.0,
    /// head dims 33..=128 (narrower heads keep the `mma.sync` kernels). The default there.
    Wgmma,
}

/// How the fp32-storage GEMMs ([`crate::gemm::gemm_f32`] and the attention GEMMs) compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmMath {
    /// Plain fp32 (`CUBLAS_DEFAULT_MATH`, no TF32): the default, and always for optimizer math.
    Fp32,
    /// Inputs rounded to bf16 inside cuBLAS, fp32 accumulation and output
    /// (`CUBLAS_COMPUTE_32F_FAST_16BF`): the model GEMMs of a `precision = bf16` plan.
    Bf16,
    /// TF32 tensor cores (inputs rounded to a 10-bit mantissa, fp32 accumulation and output;
    /// `CUBLAS_COMPUTE_32F_FAST_TF32`, PyTorch's `allow_tf32 = True`): SOAP's per-step GEMMs
    /// (factor accumulation, projections) of a `precision = bf16` plan. Refreshes stay fp32.
    Tf32,
}

impl GemmMath {
    fn code(self) -> u8 {
        match self {
            GemmMath::Fp32 => 0,
            GemmMath::Bf16 => 1,
            GemmMath::Tf32 => 2,
        }
    }
    fn from_code(c: u8) -> GemmMath {
        match c {
            1 => GemmMath::Bf16,
            2 => GemmMath::Tf32,
            _ => GemmMath::Fp32,
        }
    }
}

/// A kernel compiled from source generated at run time ([`Device::compile_runtime`]), with
/// the parameter kinds its launches are checked against.
pub struct RuntimeKernel {
    name: String,
    func: CudaFunction,
    kinds: Vec<ArgKind>,
}

impl RuntimeKernel {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Dynamic shared memory a launch may take without raising the function's limit (48 KiB).
const DEFAULT_DYNAMIC_SMEM: u32 = 48 * 1024;

/// 1 << 31 − 1: dimensions passed to kernels as `int` must stay below it.
pub(crate) const INT_MAX: usize = i32::MAX as usize;

impl Device {
    /// Opens device `ordinal`: context, streams, cuBLAS handle, and every kernel family
    /// compiled by NVRTC for the device's compute capability (or read from the kernel cache).
    ///
    /// # Errors
    /// [`CudaError::NoDriver`] when `libcuda` cannot be loaded (never a panic),
    /// [`CudaError::MissingLibrary`] for NVRTC or cuBLAS, [`CudaError::NoDevice`] for a bad
    /// ordinal, driver errors otherwise. A family that fails to compile does not fail `new`:
    /// see [`Device::kernel_loads`].
    pub fn new(ordinal: usize) -> Result<Device> {
        if !driver_present() {
            return Err(CudaError::NoDriver { lib: "libcuda.so" });
        }
        // SAFETY (both): only dlopen attempts.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaError::MissingLibrary {
                lib: "libnvrtc.so",
                hint: "install the CUDA toolkit's NVRTC or put its lib64 folder on LD_LIBRARY_PATH",
            });
        }
        if !unsafe { cbsys::is_culib_present() } {
            return Err(CudaError::MissingLibrary {
                lib: "libcublas.so",
                hint: "install cuBLAS or put the CUDA lib64 folder on LD_LIBRARY_PATH",
            });
        }
        catch("Device::new", || Self::open(ordinal))
    }

    fn open(ordinal: usize) -> Result<Device> {
        drv::init()?;
        let count = CudaContext::device_count()?.max(0) as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let cc = ctx.compute_capability()?;
        let arch = nvrtc::arch_for(cc);
        let (least, greatest) = drv::stream::get_priority_range()?;
        // The side stream (eigenbasis refreshes) runs one priority level above the compute
        // stream, so its kernels are scheduled as soon as they are enqueued instead of being
        // starved behind the training kernels and then bunching up at the staleness bound.
        let (compute_p, side_p) = if greatest < least {
            (greatest + 1, greatest)
        } else {
            (greatest, least)
        };
        let compute = ctx.new_stream_with_priority(compute_p)?;
        let copy_in = ctx.new_stream()?;
        let copy_out = ctx.new_stream()?;
        let side = ctx.new_stream_with_priority(side_p)?;

        let handle = cb::create_handle().map_err(cublas("create_handle"))?;
        let cublas_h = Cublas(handle);
        let side_handle = cb::create_handle().map_err(cublas("create_handle"))?;
        let cublas_side = Cublas(side_handle);
        for (h, s) in [(handle, &compute), (side_handle, &side)] {
            // SAFETY: live handle and stream.
            unsafe {
                cb::set_stream(h, s.cu_stream() as cbsys::cudaStream_t)
                    .map_err(cublas("set_stream"))?;
                cbsys::cublasSetMathMode(h, cbsys::cublasMath_t::CUBLAS_DEFAULT_MATH)
                    .result()
                    .map_err(cublas("set_math_mode"))?;
            }
        }
        let mut cublas_version = 0;
        // SAFETY: live handle, out-pointer to a live integer.
        let _ = unsafe { cbsys::cublasGetVersion_v2(handle, &mut cublas_version) };
        let mut dv = 0;
        // SAFETY: out-pointer to a live integer.
        unsafe { sys::cuDriverGetVersion(&mut dv) }.result()?;

        let info = DeviceInfo {
            ordinal,
            name: ctx.name()?,
            compute_capability: cc,
            arch: arch.clone(),
            sm_count: ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
                .max(1) as u32,
            total_mem: ctx.total_mem()?,
            max_shared_per_block_optin: ctx
                .attribute(
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )?
                .max(0) as usize,
            driver_version: (dv / 1000, (dv % 1000) / 10),
            nvrtc_version: nvrtc::nvrtc_version()?,
            cublas_version,
            pci_bus_id: format!(
                "{:08x}:{:02x}:{:02x}.0",
                ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
                ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
                ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
            ),
        };
        let include = nvrtc::include_dir();
        if include.is_none() {
            tracing::warn!("no CUDA include folder found ($CUDA_HOME/include, /usr/local/cuda/include): families that include cuda_bf16.h will fail");
        }
        let options = nvrtc::options(&arch, include.as_deref());
        let cache = nvrtc::cache_dir();
        let kernels = Kernels::load(&ctx, &arch, &options, cache.as_deref());

        let counters = Arc::new(MemCounters::default());
        let mut internal = Arena::new(&ctx, &counters, "internal", Tier::Device, 1 << 16)?;
        let status = internal.buf(Elem::I32, 1)?;
        let blas_lt = crate::lt::BlasLt::new(&ctx, &counters, cc.0.max(0) as u32);
        let dev = Device {
            ctx,
            compute,
            copy_in,
            copy_out,
            side,
            cublas: cublas_h,
            cublas_side,
            blas_lt,
            kernels,
            info,
            counters,
            status,
            _internal: internal,
            gemm_math: AtomicU8::new(GemmMath::Fp32.code()),
            flash_kernels: AtomicU8::new(u8::from(cc == (9, 0))),
        };
        dev.upload(&dev.status, &[i32::MAX])?;
        Ok(dev)
    }

    /// Sets how later fp32-storage GEMMs compute (see [`GemmMath`]); returns the previous mode.
    pub fn set_gemm_math(&self, math: GemmMath) -> GemmMath {
        GemmMath::from_code(self.gemm_math.swap(math.code(), Ordering::Relaxed))
    }

    /// The current [`GemmMath`].
    pub fn gemm_math(&self) -> GemmMath {
        GemmMath::from_code(self.gemm_math.load(Ordering::Relaxed))
    }

    /// The fused attention kernels this device runs: [`FlashKernels::Wgmma`] on compute
    /// capability 9.0, else [`FlashKernels::Mma`] (unless [`Device::set_flash_kernels`] chose).
    pub fn flash_kernels(&self) -> FlashKernels {
        if self.flash_kernels.load(Ordering::Relaxed) == 1 {
            FlashKernels::Wgmma
        } else {
            FlashKernels::Mma
        }
    }

    /// Chooses the fused attention kernels (the self-test checks both families on an H200);
    /// returns the previous choice.
    ///
    /// # Errors
    /// [`FlashKernels::Wgmma`] on a device other than compute capability 9.0.
    pub fn set_flash_kernels(&self, k: FlashKernels) -> Result<FlashKernels> {
        if k == FlashKernels::Wgmma && self.info.compute_capability != (9, 0) {
            return Err(CudaError::Invalid {
                op: "set_flash_kernels",
                what: format!(
                    "the wgmma attention kernels need compute capability 9.0; {} is {}.{}",
                    self.info.name, self.info.compute_capability.0, self.info.compute_capability.1
                ),
            });
        }
        let prev = self.flash_kernels();
        self.flash_kernels
            .store(u8::from(k == FlashKernels::Wgmma), Ordering::Relaxed);
        Ok(prev)
    }

    /// What the driver says about the device.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// How each kernel family was loaded (compiled or cached, time, failure).
    pub fn kernel_loads(&self) -> &[FamilyLoad] {
        &self.kernels.loads
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream of `kind`.
    pub fn stream(&self, kind: StreamKind) -> &Arc<CudaStream> {
        match kind {
            StreamKind::Compute => &self.compute,
            StreamKind::CopyIn => &self.copy_in,
            StreamKind::CopyOut => &self.copy_out,
            StreamKind::Side => &self.side,
        }
    }

    /// Records an event on stream `kind` (timing enabled when `timing`).
    pub fn record(&self, kind: StreamKind, timing: bool) -> Result<CudaEvent> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        Ok(self.stream(kind).record_event(Some(flags))?)
    }

    /// Makes stream `kind` wait for `event` (no host blocking).
    pub fn wait(&self, kind: StreamKind, event: &CudaEvent) -> Result<()> {
        Ok(self.stream(kind).wait(event)?)
    }

    /// Blocks the host until every stream is idle.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind_to_thread()?;
        Ok(self.ctx.synchronize()?)
    }

    /// Waits for the compute and copy streams only — a training step's own work — and not
    /// for the side stream, whose eigenbasis refreshes are meant to run across step
    /// boundaries (their results are waited for through events, at the swap).
    /// [`Device::synchronize`] here would finish, inside the step, every refresh the
    /// side-stream launcher thread had enqueued by then.
    ///
    /// # Errors
    /// A failed synchronisation (an earlier asynchronous error surfaces here).
    pub fn synchronize_step(&self) -> Result<()> {
        self.ctx.bind_to_thread()?;
        self.compute.synchronize()?;
        self.copy_in.synchronize()?;
        Ok(self.copy_out.synchronize()?)
    }

    /// Waits for the streams `kinds` only (the end of a step whose copies out run on into the
    /// next: compute and copy-in; before reading state from outside the programs: copy-out).
    ///
    /// # Errors
    /// A failed synchronisation (an earlier asynchronous error surfaces here).
    pub fn synchronize_streams(&self, kinds: &[StreamKind]) -> Result<()> {
        self.ctx.bind_to_thread()?;
        for &k in kinds {
            self.stream(k).synchronize()?;
        }
        Ok(())
    }

    /// Allocates an arena of `bytes` in `tier`.
    pub fn arena(&self, name: &str, tier: Tier, bytes: usize) -> Result<Arena> {
        Arena::new(&self.ctx, &self.counters, name, tier, bytes)
    }

    /// Starts a thread that samples the driver's used memory (`cuMemGetInfo`: total − free,
    /// the whole GPU) into [`MemoryReport::device_peak_used`] every `period`, so that the
    /// reported peak also covers memory taken and given back between allocations and reports
    /// (library workspaces, another process). It stops when the returned handle drops.
    ///
    /// # Errors
    /// The thread could not be spawned.
    pub fn spawn_peak_sampler(&self, period: std::time::Duration) -> std::io::Result<PeakSampler> {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (ctx, counters, flag) = (self.ctx.clone(), self.counters.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("gpu-peak-sampler".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    counters.sample(&ctx);
                    std::thread::park_timeout(period);
                }
            })?;
        Ok(PeakSampler {
            stop,
            thread: Some(thread),
        })
    }

    /// Current and peak memory use.
    pub fn memory_report(&self) -> MemoryReport {
        self.counters.sample(&self.ctx);
        let (free, total) = self.ctx.mem_get_info().unwrap_or((0, self.info.total_mem));
        MemoryReport {
            device_total: total,
            device_free: free,
            device_peak_used: self.counters.peak_used.load(Ordering::Relaxed),
            device_reserved: self.counters.get(Tier::Device),
            pinned_reserved: self.counters.get(Tier::PinnedHost),
        }
    }

    /// Copies `src` into `dst` (same element type and length) on the compute stream, and waits.
    pub fn upload<T: HostElem>(&self, dst: &Buf, src: &[T]) -> Result<()> {
        self.check_host("upload", dst, T::ELEM, src.len())?;
        self.ctx.bind_to_thread()?;
        // SAFETY: `dst` holds `src.len()` elements of T (checked); ordered after earlier
        // compute work, and `src` outlives the copy (we wait for it).
        unsafe { drv::memcpy_htod_async(dst.ptr(), src, self.compute.cu_stream()) }?;
        Ok(self.compute.synchronize()?)
    }

    /// Copies `src` back to the host after the compute stream's earlier work, and waits.
    pub fn download<T: HostElem>(&self, src: &Buf) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len()];
        self.check_host("download", src, T::ELEM, out.len())?;
        self.ctx.bind_to_thread()?;
        // SAFETY: `src` holds `out.len()` elements of T (checked); ordered after earlier
        // compute work, and `out` outlives the copy (we wait for it).
        unsafe { drv::memcpy_dtoh_async(&mut out, src.ptr(), self.compute.cu_stream()) }?;
        self.compute.synchronize()?;
        Ok(out)
    }

    /// Copies `src` back to the host after stream `kind`'s earlier work, and waits for that
    /// stream only (the side-stream refresh reads its status words this way).
    pub fn download_on<T: HostElem>(&self, src: &Buf, kind: StreamKind) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len()];
        self.check_host("download", src, T::ELEM, out.len())?;
        self.ctx.bind_to_thread()?;
        let stream = self.stream(kind);
        // SAFETY: `src` holds `out.len()` elements of T (checked); ordered after earlier work
        // on `kind`, and `out` outlives the copy (we wait for it).
        unsafe { drv::memcpy_dtoh_async(&mut out, src.ptr(), stream.cu_stream()) }?;
        stream.synchronize()?;
        Ok(out)
    }

    fn check_host(&self, op: &'static str, b: &Buf, elem: Elem, len: usize) -> Result<()> {
        if b.elem() != elem || b.len() != len {
            return Err(CudaError::Operand {
                op,
                operand: "buffer",
                expected: format!("{len} x {elem}"),
                got: format!("{} x {}", b.len(), b.elem()),
            });
        }
        Ok(())
    }

    /// Fills a 4-byte-element buffer with the bit pattern `bits` on the compute stream.
    pub fn fill_bits32(&self, b: &Buf, bits: u32) -> Result<()> {
        if b.elem().size_bytes() != 4 {
            return Err(CudaError::Invalid {
                op: "fill_bits32",
                what: format!("{} elements are not 4 bytes", b.elem()),
            });
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: `b` covers `len` 4-byte words; stream-ordered on compute.
        unsafe { sys::cuMemsetD32Async(b.ptr(), bits, b.len(), self.compute.cu_stream()) }
            .result()?;
        Ok(())
    }

    /// Fills an f32 buffer with quiet NaNs (poisoning outputs before a check).
    pub fn poison(&self, b: &Buf) -> Result<()> {
        self.fill_bits32(b, 0x7fc0_0000)
    }

    /// Zeroes any buffer on the compute stream.
    pub fn zero(&self, b: &Buf) -> Result<()> {
        self.ctx.bind_to_thread()?;
        // SAFETY: `b` covers `bytes()` bytes; stream-ordered on compute.
        unsafe { drv::memset_d8_async(b.ptr(), 0, b.bytes(), self.compute.cu_stream()) }?;
        Ok(())
    }

    /// Copies `src` into `dst` (same size, any tiers: device, pinned host) on stream `kind`.
    pub fn copy(&self, dst: &Buf, src: &Buf, kind: StreamKind) -> Result<()> {
        if dst.bytes() != src.bytes() {
            return Err(CudaError::Shape {
                op: "copy",
                operand: "dst",
                expected: src.bytes(),
                got: dst.bytes(),
            });
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: both ranges are live allocations of this context (unified addressing).
        unsafe {
            sys::cuMemcpyAsync(
                dst.ptr(),
                src.ptr(),
                src.bytes(),
                self.stream(kind).cu_stream(),
            )
        }
        .result()?;
        Ok(())
    }

    /// Copies a `rows × cols` f32 block between row-major matrices on the compute stream, one
    /// `cuMemcpy2DAsync`: element (i, j) of the block is `src[(src_row + i) · src_n + src_col +
    /// j]` and goes to `dst[(dst_row + i) · dst_n + dst_col + j]` (plan ops `BlockCopy` /
    /// `BlockWrite`; the refresh swap's chunks). Either matrix may be device or pinned host
    /// memory (a pinned one is addressed through unified addressing).
    ///
    /// # Errors
    /// [`CudaError::Shape`] when the block does not fit either buffer; the driver's status.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_block_f32(
        &self,
        dst: &Buf,
        (dst_n, dst_row, dst_col): (usize, usize, usize),
        src: &Buf,
        (src_n, src_row, src_col): (usize, usize, usize),
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let fits = |b: &Buf, n: usize, r: usize, c: usize| {
            rows == 0 || (c + cols <= n && ((r + rows - 1) * n + c + cols) * 4 <= b.bytes())
        };
        if !fits(dst, dst_n, dst_row, dst_col) || !fits(src, src_n, src_row, src_col) {
            return Err(CudaError::Shape {
                op: "copy_block",
                operand: "dst",
                expected: rows * cols * 4,
                got: dst.bytes(),
            });
        }
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        let kind = |b: &Buf| {
            if b.tier() == crate::Tier::Device {
                sys::CUmemorytype::CU_MEMORYTYPE_DEVICE
            } else {
                sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED
            }
        };
        let p = sys::CUDA_MEMCPY2D_st {
            srcXInBytes: src_col * 4,
            srcY: src_row,
            srcMemoryType: kind(src),
            srcHost: std::ptr::null(),
            srcDevice: src.ptr(),
            srcArray: std::ptr::null_mut(),
            srcPitch: src_n * 4,
            dstXInBytes: dst_col * 4,
            dstY: dst_row,
            dstMemoryType: kind(dst),
            dstHost: std::ptr::null_mut(),
            dstDevice: dst.ptr(),
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_n * 4,
            WidthInBytes: cols * 4,
            Height: rows,
        };
        // SAFETY: both ranges were checked to lie inside live allocations of this context.
        unsafe { sys::cuMemcpy2DAsync_v2(&p, self.compute.cu_stream()) }.result()?;
        Ok(())
    }

    /// Reads and clears the status word that kernels set when an index (token id, target) was
    /// out of range. Synchronizes the compute stream.
    ///
    /// # Errors
    /// [`CudaError::IndexOutOfRange`] with the first bad row since the last call.
    pub fn take_status(&self) -> Result<()> {
        let v = self.download::<i32>(&self.status)?;
        if v[0] != i32::MAX {
            self.upload(&self.status, &[i32::MAX])?;
            return Err(CudaError::IndexOutOfRange {
                position: v[0] as i64,
            });
        }
        Ok(())
    }

    pub(crate) fn status(&self) -> &Buf {
        &self.status
    }

    /// cuBLASLt (compute stream only), when the library loaded.
    pub(crate) fn blas_lt(&self) -> Option<&crate::lt::BlasLt> {
        self.blas_lt.as_ref()
    }

    pub(crate) fn cublas_handle(&self) -> cbsys::cublasHandle_t {
        self.cublas.0
    }

    /// The cuBLAS handle bound to stream `kind`: the side stream has its own (refreshes run
    /// there); every other kind gets the compute stream's.
    pub(crate) fn cublas_handle_on(&self, kind: StreamKind) -> cbsys::cublasHandle_t {
        match kind {
            StreamKind::Side => self.cublas_side.0,
            _ => self.cublas.0,
        }
    }

    /// Zeroes any buffer on stream `kind`.
    pub fn zero_on(&self, b: &Buf, kind: StreamKind) -> Result<()> {
        self.ctx.bind_to_thread()?;
        // SAFETY: `b` covers `bytes()` bytes; stream-ordered on `kind`.
        unsafe { drv::memset_d8_async(b.ptr(), 0, b.bytes(), self.stream(kind).cu_stream()) }?;
        Ok(())
    }

    /// Blocks for a grid-stride loop over `n` elements with 256 threads a block: enough to
    /// fill the GPU (32 blocks per SM at most), at least 1.
    pub(crate) fn grid_for(&self, n: usize) -> u32 {
        let want = n.div_ceil(256).max(1);
        want.min(self.info.sm_count as usize * 32) as u32
    }

    /// Launches `kernel` on the compute stream.
    pub(crate) fn launch(
        &self,
        kernel: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: Args,
    ) -> Result<()> {
        self.launch_on(StreamKind::Compute, kernel, grid, block, args)
    }

    /// Launches `kernel` on stream `kind`.
    pub(crate) fn launch_on(
        &self,
        kind: StreamKind,
        kernel: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: Args,
    ) -> Result<()> {
        self.launch_with(kind, kernel, grid, block, 0, args)
    }

    /// Launches `kernel` on the compute stream with `smem` bytes of dynamic shared memory (its
    /// `extern __shared__` array). Above the default 48 KiB the function's
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` is raised to `smem` first.
    ///
    /// # Errors
    /// As [`Device::launch`]; [`CudaError::Invalid`] when the device's opt-in shared memory
    /// per block ([`DeviceInfo::max_shared_per_block_optin`]) is smaller than `smem` plus the
    /// kernel's static shared memory.
    pub(crate) fn launch_smem(
        &self,
        kernel: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: Args,
    ) -> Result<()> {
        self.launch_with(StreamKind::Compute, kernel, grid, block, smem, args)
    }

    /// Compiles `source` (one `extern "C"` kernel named `name`, generated at run time: an
    /// optimizer's update rule) with NVRTC for this device, through the kernel cache, and
    /// loads it.
    ///
    /// # Errors
    /// A source without that kernel or with parameters other than pointers, `int`, `long long`,
    /// `float` and `double`; NVRTC's compile log; driver errors.
    pub fn compile_runtime(&self, name: &str, source: &str) -> Result<RuntimeKernel> {
        let invalid = |what: String| CudaError::Invalid {
            op: "compile_runtime",
            what,
        };
        let sigs = crate::kernels::kernel_signatures(source).map_err(invalid)?;
        let kinds = sigs
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, k)| k)
            .ok_or_else(|| invalid(format!("the source defines no kernel `{name}`")))?;
        let options = nvrtc::options(&self.info.arch, nvrtc::include_dir().as_deref());
        let full = format!("{COMMON}\n#line 1 \"generated.cu\"\n{source}");
        let (cubin, _) = nvrtc::load_or_compile(
            "generated",
            &full,
            &self.info.arch,
            &options,
            nvrtc::cache_dir().as_deref(),
        )?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
        let func = module.load_function(name)?;
        Ok(RuntimeKernel {
            name: name.to_string(),
            func,
            kinds,
        })
    }

    /// Launches a [`RuntimeKernel`] on the compute stream after checking `args` against its
    /// parameter list.
    ///
    /// # Errors
    /// Arguments that do not match its parameters; launch failures.
    pub(crate) fn launch_runtime(
        &self,
        k: &RuntimeKernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: Args,
    ) -> Result<()> {
        if args.kinds != k.kinds {
            return Err(CudaError::Invalid {
                op: "launch_runtime",
                what: format!(
                    "kernel `{}`: arguments {:?} do not match its parameters {:?}",
                    k.name, args.kinds, k.kinds
                ),
            });
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: block,
            shared_mem_bytes: 0,
        };
        let mut b = self.stream(StreamKind::Compute).launch_builder(&k.func);
        for s in &args.slots {
            b.arg(s);
        }
        // SAFETY: the arguments match the kernel's parameter list (checked above); the caller
        // passes pointers to live buffers whose sizes it checked.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn launch_with(
        &self,
        kind: StreamKind,
        kernel: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: Args,
    ) -> Result<()> {
        let func = self.kernels.get(kernel, &args)?;
        if smem > DEFAULT_DYNAMIC_SMEM {
            self.ctx.bind_to_thread()?;
            // The kernel's static shared memory comes on top of the dynamic bytes.
            let total = smem as usize + func.shared_size_bytes()?.max(0) as usize;
            if total > self.info.max_shared_per_block_optin {
                return Err(CudaError::Invalid {
                    op: kernel,
                    what: format!(
                        "needs {total} bytes of shared memory per block; {} allows {}",
                        self.info.name, self.info.max_shared_per_block_optin
                    ),
                });
            }
            func.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: block,
            shared_mem_bytes: smem,
        };
        let mut b = self.stream(kind).launch_builder(func);
        for s in &args.slots {
            b.arg(s);
        }
        // SAFETY: `get` checked the arguments against the kernel's parameter list; the
        // launchers pass pointers to live buffers whose sizes they checked.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
