//! The crate's one error type, [`CudaError`]: every fallible call of the CUDA backend returns it.
use std::fmt;

/// Which memory tier an arena lives in (for error messages and memory reports).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// GPU memory (`cuMemAlloc`).
    Device,
    /// Page-locked host memory (`cuMemHostAlloc`), reachable by the copy engines at full speed.
    PinnedHost,
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Device => "device",
            Tier::PinnedHost => "pinned-host",
        })
    }
}

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver library (`libcuda.so`) could not be loaded: no NVIDIA driver on this
    /// machine, or it is not on the loader's path.
    #[error(
        "no CUDA driver: {lib} could not be loaded (this machine has no NVIDIA driver, or it is not on \
         LD_LIBRARY_PATH); the CPU engine (`target cpu`, or `--device cpu` where a command takes it) needs none"
    )]
    NoDriver {
        /// The library that was looked for.
        lib: &'static str,
    },
    /// A CUDA toolkit library other than the driver is missing.
    #[error("CUDA library {lib} could not be loaded: {hint}")]
    MissingLibrary {
        /// The library (`libnvrtc.so`, `libcublas.so`).
        lib: &'static str,
        /// How to fix it.
        hint: &'static str,
    },
    /// The driver reported no device with this ordinal.
    #[error("no CUDA device {ordinal} (this machine has {count})")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A CUDA driver API call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A cuBLAS call failed.
    #[error("cuBLAS {op}: {source}")]
    Cublas {
        /// The GEMM or setup call.
        op: &'static str,
        /// The cuBLAS status.
        source: cudarc::cublas::result::CublasError,
    },
    /// NVRTC failed to compile a kernel family.
    #[error(
        "NVRTC could not compile kernel family `{family}` for {arch} (options {options:?}):\n{log}"
    )]
    Compile {
        /// The family (file stem in `cuda/kernels/`).
        family: &'static str,
        /// The target, e.g. `sm_90`.
        arch: String,
        /// The options passed to NVRTC.
        options: Vec<String>,
        /// The compiler's log.
        log: String,
    },
    /// An NVRTC API call (other than the compile itself) failed.
    #[error("NVRTC: {0}")]
    Nvrtc(#[from] cudarc::nvrtc::result::NvrtcError),
    /// A kernel family failed to build at start-up; its kernels cannot be launched.
    #[error("kernel `{kernel}` is unavailable: family `{family}` failed to load: {reason}")]
    KernelUnavailable {
        /// The kernel asked for.
        kernel: &'static str,
        /// Its family.
        family: &'static str,
        /// Why the family failed.
        reason: String,
    },
    /// cudarc panicked (it does so, for instance, when a symbol is missing from the driver).
    #[error("cudarc panicked during {during}: {message}")]
    Panic {
        /// What was being done.
        during: &'static str,
        /// The panic message.
        message: String,
    },
    /// An operand has the wrong number of elements.
    #[error("{op}: operand `{operand}` has {got} elements, expected {expected}")]
    Shape {
        /// The kernel launcher.
        op: &'static str,
        /// The operand.
        operand: &'static str,
        /// Elements expected from the dimensions.
        expected: usize,
        /// Elements found.
        got: usize,
    },
    /// An operand has the wrong element type or lives in the wrong tier.
    #[error("{op}: operand `{operand}` is {got}, expected {expected}")]
    Operand {
        /// The kernel launcher.
        op: &'static str,
        /// The operand.
        operand: &'static str,
        /// What was expected (`f32 in device memory`).
        expected: String,
        /// What was passed.
        got: String,
    },
    /// An argument is out of its valid range (zero head count, odd head_dim, dimension over
    /// `i32::MAX`, aliased operands, ...).
    #[error("{op}: {what}")]
    Invalid {
        /// The kernel launcher.
        op: &'static str,
        /// What is wrong.
        what: String,
    },
    /// An arena has no room left for a carve.
    #[error("{tier} arena `{name}` is full: {asked} bytes (align {align}) at offset {offset} > capacity {capacity}")]
    ArenaFull {
        /// The arena's name.
        name: String,
        /// Its tier.
        tier: Tier,
        /// Bytes asked for.
        asked: usize,
        /// Alignment asked for.
        align: usize,
        /// Current offset.
        offset: usize,
        /// Capacity in bytes.
        capacity: usize,
    },
    /// `Arena::reset` was called while buffers carved from it are still alive.
    #[error("arena `{name}` cannot be reset: {live} carved buffers are still alive")]
    ArenaBusy {
        /// The arena's name.
        name: String,
        /// Buffers still holding it.
        live: usize,
    },
    /// The NVMe tier failed (a checksum mismatch, a truncated swap file, a full disk, a failed
    /// write on the writer thread): the engine reports it as `EngineError::Tier` and stops.
    #[error("NVMe tier: {what}")]
    Tier {
        /// What failed, with the swap file's error.
        what: String,
    },
    /// A kernel found an index (token id or target) outside its range since the last
    /// [`crate::Device::take_status`]; `position` is the first bad row.
    #[error("an index was out of range on the GPU (first bad row {position}); nothing past it can be trusted")]
    IndexOutOfRange {
        /// First offending row.
        position: i64,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Runs `f`, turning a panic inside cudarc into [`CudaError::Panic`].
pub(crate) fn catch<T>(during: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "non-string panic payload".into());
            Err(CudaError::Panic { during, message })
        }
    }
}

/// Maps a cuBLAS status to [`CudaError::Cublas`] for `op`.
pub(crate) fn cublas(
    op: &'static str,
) -> impl FnOnce(cudarc::cublas::result::CublasError) -> CudaError {
    move |source| CudaError::Cublas { op, source }
}
