//! Eigenbasis refreshes on the GPU (plan host task `EigenbasisRefresh`; SOAP's reference
//! `soap.py` `get_orthogonal_matrix` / `get_orthogonal_matrix_QR`, KL-Shampoo's `KLOpt`),
//! through cuSOLVER, cuBLAS and the helper kernels of family `refresh`
//! (`cuda/kernels/refresh.cu`). The semantics are those of `optim::refresh_compute_method` and
//! `optim::refresh_apply`, step for step:
//!
//! - init (end of step 1, either method): `Q ← eigvecs(F + 1e-30·I)` (cuSOLVER `Ssyevd`),
//!   columns in descending eigenvalue order;
//! - QR refresh, [`RefreshMethod::Soap`]: `est = diag(Qᵀ F Q)` (f64), `idx = argsort(est)`
//!   descending (stable, IEEE total order, on the device: kernel `argsort_desc`), `exp_avg_sq`
//!   permuted along the side by `idx`, `Q_new = qr(F Q[:, idx]).Q`, `exp_avg` re-projected with
//!   `C = Q_oldᵀ Q_new` (side 0: `E ← Cᵀ E`, side 1: `E ← E C`);
//! - QR refresh, [`RefreshMethod::Qr`] (KL-Shampoo, `docs/kl-shampoo.md` §3):
//!   `Q_new = qr(F Q).Q` with the columns in their current order (no estimate, no sort, no
//!   permutation), installed alone ([`install_basis`]): KL-Shampoo's momentum is unrotated and
//!   it has no second moment.
//! - inverse root, [`RefreshMethod::InverseRoot`] (Shampoo, `docs/shampoo.md` §5;
//!   `optim::shampoo_inverse_root`), at every refresh including the first:
//!   `(λ, V) = eigh(F + ε·I)` (cuSOLVER `Ssyevd`), `λ' = λ − min λ + ε` where `min λ < ε`,
//!   `root = V diag(λ'^(−1/r)) Vᵀ` (kernel `inverse_root_scale_cols`, one fp32 GEMM), installed
//!   alone as the QR method's basis ([`GpuRefresher::compute_inverse_root`]).
//!
//! The QR is the Rayleigh–Cholesky QR on the tensor cores (`rayleigh.rs`: 3xTF32 GEMMs, lower
//! Cholesky factorisations, a Newton–Schulz second step), with cuSOLVER's Householder QR
//! (`householder.rs`: `Sgeqrf` + `Sorgqr`) as its fallback when a Cholesky factorisation fails
//! or the orthonormality gate trips.
//!
//! A refresh is two halves, as on the CPU (`optim::refresh_compute` / `refresh_apply`):
//! `GpuRefresher::compute` enqueues the candidate basis, permutation and status words into a
//! `RefreshSlot` on the refresher's stream without touching the state; `apply` (the swap,
//! on the compute stream; `swap.rs`) installs them once the host has read the status words and
//! `verdict` found them clean. So a numerical failure (non-finite factor or basis, solver
//! `info ≠ 0`, non-finite new basis) leaves basis and moments untouched; so does an all-zero
//! factor at a QR refresh (`zero_factor`), which the engine reports as skipped, not failed, as
//! on the CPU (`optim::RefreshOutcome::ZeroFactor`). The synchronous refresh (S = 0, and every first basis) runs both halves back to
//! back on the compute stream with one status read in between; the asynchronous one (S > 0,
//! `placement = gpu_side`) runs `compute` on the side stream on a snapshot of the factor and
//! `apply` at a later step boundary (see `crate::engine`). cuSOLVER is column-major; a
//! symmetric factor is its own transpose, and `Q_oldᵀ F` computed row-major is `F Q_old`
//! column-major, which is what the QR needs.
use crate::device::{Device, GemmMath};
use crate::error::{CudaError, Result};
use crate::gemm::{gemm_f32_with, Dims};
use crate::kernels::Args;
use crate::memory::{Arena, Buf, Elem};
use crate::StreamKind;
use cudarc::cusolver::sys as cs;
use schedule::RefreshMethod;

mod householder;
mod rayleigh;
mod swap;

pub(crate) use rayleigh::gemm_3xtf32;
pub use rayleigh::{RC_NS_TOL, RC_ORTHO_TOL, RC_SHIFT};
pub(crate) use swap::{apply, install_basis, SwapWork};

/// Why a GPU refresh kept the previous basis (the numerical failures of
/// `optim::RefreshError`; the engine counts them).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RefreshFailure {
    /// The factor (or the stored basis) has NaN / Inf entries.
    #[error("factor or stored basis [{dim}x{dim}] has {count} non-finite entries; basis kept")]
    NonFinite {
        /// Side length.
        dim: usize,
        /// Non-finite entries.
        count: usize,
    },
    /// cuSOLVER returned `info ≠ 0`.
    #[error("cuSOLVER {call} returned info {info}; basis kept")]
    Solver {
        /// The routine.
        call: &'static str,
        /// Its info value.
        info: i32,
    },
    /// The new basis is non-finite.
    #[error("the new basis is non-finite; basis kept")]
    BadBasis,
    /// An all-zero factor at a QR refresh: its power image has no rank. The engine checks
    /// [`zero_factor`] first and counts such a refresh as skipped; only the self-test and
    /// calibration callers of [`verdict`] see this.
    #[error("factor [{dim}x{dim}] is all zero: no rank to refresh from; basis kept")]
    NoRank {
        /// Side length.
        dim: usize,
    },
}

/// `b` (`[d, d]` f32) where a refresh's kernels and GEMMs can read it: itself when it is in
/// device memory, else (a Kronecker factor or eigenbasis that `tier-placement` moved to pinned
/// host memory) copied on `stream` into the leading `d²` elements of `stage` first. `who` is
/// the launcher and operand, for errors.
///
/// # Errors
/// [`CudaError::Operand`] / [`CudaError::Shape`] when `b` is not `d²` f32, or is offloaded
/// and no staging buffer was allocated for it (the plan and the engine's allocations
/// disagree); the copy's status.
pub(crate) fn device_operand(
    dev: &Device,
    who: (&'static str, &'static str),
    b: &Buf,
    stage: Option<&Buf>,
    d: usize,
    stream: StreamKind,
) -> Result<Buf> {
    let (op, operand) = who;
    let dd = d * d;
    let stage = match (b.tier(), stage) {
        (crate::Tier::Device, _) | (_, None) => {
            b.expect(op, operand, Elem::F32, dd)?;
            return Ok(b.clone());
        }
        (_, Some(s)) => s,
    };
    if b.elem() != Elem::F32 || b.len() != dd {
        return Err(CudaError::Operand {
            op,
            operand,
            expected: format!("{dd} x f32"),
            got: format!("{} x {}", b.len(), b.elem()),
        });
    }
    let s = stage.slice(0, dd)?;
    dev.copy(&s, b, stream)?;
    Ok(s)
}

/// True when cuSOLVER (`libcusolver.so`) can be loaded.
pub fn cusolver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cs::is_culib_present() }
}

fn check(call: &'static str, s: cs::cusolverStatus_t) -> Result<()> {
    if s == cs::cusolverStatus_t::CUSOLVER_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Invalid {
            op: call,
            what: format!("cuSOLVER status {s:?}"),
        })
    }
}

/// Words of a refresh status buffer (i32, device, written by the refresh kernels and cuSOLVER
/// on the refresh's stream and read by the host only once the refresh's work is complete):
/// `[0]` non-finite entries of the factor and stored basis, `[1]` `info` of syevd (init) or
/// geqrf, `[2]` `info` of orgqr, `[3]` non-finite entries of the new basis, `[4]` the bit
/// pattern of `max |F|` (0 = all-zero factor), `[5]` the first non-zero `Spotrf` info of the
/// Rayleigh–Cholesky QR, `[6]` its orthonormality measure (f32 bits: `‖MᵀM − I‖_F²`, then the
/// second CholeskyQR pass's `max|R₂ − I|`) and `[7]` its scratch. Words 5–7 only decide
/// whether the Rayleigh–Cholesky result is used (a failure there falls back to Householder QR,
/// whose words 1–2 count).
pub(crate) const STATUS_WORDS: usize = 8;

/// How a [`GpuRefresher`] orthonormalises the power image `A = (F Q_old)[:, idx]` of a QR
/// refresh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QrMethod {
    /// cuSOLVER's Householder QR alone (`Sgeqrf` + `Sorgqr`; soap.py's `torch.linalg.qr`):
    /// what the Rayleigh–Cholesky QR falls back to, run on its own by the self-test.
    Householder,
    /// The tensor-core Rayleigh–Cholesky QR ([`rayleigh`]) with the Householder fallback: what
    /// [`GpuRefresher::new`] sets.
    RayleighCholeskyTc,
}

/// A cuSOLVER dense handle and the work buffers of one refresh at a time, bound to one stream
/// (the compute stream for synchronous refreshes, the side stream for asynchronous ones).
/// Everything it enqueues is stream-ordered; [`GpuRefresher::compute`] blocks the calling
/// thread only to read the Rayleigh–Cholesky QR's status words (once per refresh, twice when
/// its second CholeskyQR pass runs) to decide on the Householder fallback, and inside
/// cuSOLVER's `Sgeqrf` / `Sorgqr`, which block on their own.
pub(crate) struct GpuRefresher {
    handle: cs::cusolverDnHandle_t,
    stream: StreamKind,
    /// `F Q_old` (`[d, d]` f32).
    a: Buf,
    /// `Q_p = Q_old[:, idx]`, or the Householder QR's matrix (`[d, d]` f32).
    b: Buf,
    tau: Buf,
    /// `diag(Qᵀ F Q)` (`[d]` f64).
    est: Buf,
    /// cuSOLVER's workspace (f32, the largest any call here needs).
    work: Buf,
    /// The Rayleigh–Cholesky QR's own buffers.
    rc: rayleigh::RcWork,
    max_dim: usize,
    /// Device copies of an offloaded Kronecker factor and eigenbasis (`[max_dim²]` f32 each;
    /// [`GpuRefresher::stage_offloaded`]), `None` when the plan keeps them on the device.
    stage_factor: Option<Buf>,
    stage_basis: Option<Buf>,
    qr: QrMethod,
    /// Host ms spent enqueueing: checks/kernels, GEMMs, syevd, geqrf/potrf, orgqr/trsm.
    phase_ms: std::cell::Cell<[f64; 5]>,
    /// QR refreshes done by the Rayleigh–Cholesky QR, and those redone by Householder.
    cholesky_counts: std::cell::Cell<(u64, u64)>,
    /// Rayleigh–Cholesky refreshes finished by one Newton–Schulz step, and by the second
    /// CholeskyQR pass.
    rc_second: std::cell::Cell<(u64, u64)>,
    /// Set by [`GpuRefresher::set_phase_sync`]: the stream, synchronised after every timed
    /// phase so the phase times are GPU times.
    phase_sync: Option<std::sync::Arc<cudarc::driver::CudaStream>>,
}

// SAFETY: the cuSOLVER handle is only used through `&self` by the one thread that owns the
// refresher at a time (the engine thread, or the side-stream launcher thread it was moved to);
// the `Cell` makes it `!Sync`, so it is never shared.
unsafe impl Send for GpuRefresher {}

impl Drop for GpuRefresher {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { cs::cusolverDnDestroy(self.handle) };
    }
}

/// Bytes of the work buffers [`GpuRefresher::new`] carves before cuSOLVER's own workspace, for
/// factors up to `max_dim`: 8 `d×d` f32 matrices (`a`, `b` and the Rayleigh–Cholesky QR's
/// `x`, `g` and four 3xTF32 operand splits), tau (f32) and the estimates (f64), aligned.
pub(crate) fn refresh_work_bytes(max_dim: usize) -> usize {
    let d = max_dim.max(1);
    (8 * d * d + d + 2 * d) * 4 + 10 * crate::memory::BUF_ALIGN
}

/// The outputs of one refresh computation: the candidate basis `q` (`[d, d]` f32 row-major,
/// columns = basis vectors, descending), the permutation `idx` (`[d]` i32; QR refreshes) and
/// the status words (`[STATUS_WORDS]` i32). Sized for the largest factor; a refresh of side
/// length d uses the leading parts.
#[derive(Clone)]
pub(crate) struct RefreshSlot {
    pub q: Buf,
    pub idx: Buf,
    pub status: Buf,
}

impl RefreshSlot {
    /// Carves a slot for factors up to `d` from `arena`.
    pub(crate) fn carve(arena: &mut Arena, d: usize) -> Result<RefreshSlot> {
        Ok(RefreshSlot {
            q: arena.buf(Elem::F32, d * d)?,
            idx: arena.buf(Elem::I32, d)?,
            status: arena.buf(Elem::I32, STATUS_WORDS)?,
        })
    }

    /// Bytes [`RefreshSlot::carve`] takes.
    pub(crate) fn bytes(d: usize) -> usize {
        (d * d + d + STATUS_WORDS) * 4 + 3 * crate::memory::BUF_ALIGN
    }
}

/// Whether the status words of a finished refresh say its factor was exactly zero at a QR
/// refresh (`max |F| = 0`, `init` false): the engine then keeps the previous basis and reports
/// the refresh as skipped (`optim::RefreshOutcome::ZeroFactor`), not failed, before asking
/// [`verdict`] (which refuses such a factor: its candidate basis is not installable). A
/// non-finite factor is not zero (its `max |F|` word is NaN's bits or the count says so).
pub(crate) fn zero_factor(init: bool, status: &[i32]) -> bool {
    let word = |i: usize| status.get(i).copied().unwrap_or(0);
    !init && word(0) == 0 && word(4) == 0 && status.len() > 4
}

/// Reads the status words of a finished refresh of side length `d`: `Ok(())` when the
/// candidate basis may be installed.
pub(crate) fn verdict(
    init: bool,
    d: usize,
    status: &[i32],
) -> std::result::Result<(), RefreshFailure> {
    let word = |i: usize| status.get(i).copied().unwrap_or(0);
    if word(0) > 0 {
        return Err(RefreshFailure::NonFinite {
            dim: d,
            count: word(0) as usize,
        });
    }
    if !init && word(4) == 0 {
        return Err(RefreshFailure::NoRank { dim: d });
    }
    if word(1) != 0 {
        return Err(RefreshFailure::Solver {
            call: if init { "syevd" } else { "geqrf" },
            info: word(1),
        });
    }
    if word(2) != 0 {
        return Err(RefreshFailure::Solver {
            call: "orgqr",
            info: word(2),
        });
    }
    if word(3) > 0 {
        return Err(RefreshFailure::BadBasis);
    }
    Ok(())
}

impl GpuRefresher {
    /// Creates the handle (bound to `stream`) and allocates the work buffers for factors up to
    /// `max_dim` (one device arena of [`refresh_work_bytes`]) and cuSOLVER's workspace (a
    /// second arena, its size queried here). QR refreshes use the tensor-core Rayleigh–Cholesky
    /// QR with the Householder fallback. Returns the refresher and the bytes it allocated.
    ///
    /// # Errors
    /// No cuSOLVER ([`CudaError::MissingLibrary`]), cuSOLVER handle or workspace-query
    /// failures, allocation failures.
    pub(crate) fn new(
        dev: &Device,
        stream: StreamKind,
        max_dim: usize,
    ) -> Result<(GpuRefresher, usize)> {
        if !cusolver_present() {
            return Err(CudaError::MissingLibrary {
                lib: "libcusolver.so",
                hint: "install cuSOLVER or put the CUDA lib64 folder on LD_LIBRARY_PATH (or place the refreshes on the host)",
            });
        }
        let d = max_dim.max(1);
        let bytes = refresh_work_bytes(d);
        let mut arena: Arena = dev.arena("refresh", crate::Tier::Device, bytes)?;
        let a = arena.buf(Elem::F32, d * d)?;
        let b = arena.buf(Elem::F32, d * d)?;
        let tau = arena.buf(Elem::F32, d)?;
        let est = arena.buf(Elem::F64, d)?;
        let rc = rayleigh::RcWork::carve(&mut arena, d)?;
        dev.context().bind_to_thread()?;
        let mut handle: cs::cusolverDnHandle_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a live handle slot.
        unsafe {
            check("cusolverDnCreate", cs::cusolverDnCreate(&mut handle))?;
        }
        // From here on `r`'s Drop destroys the handle, whatever fails. `work` is a placeholder
        // until cuSOLVER's workspace size is known.
        let mut r = GpuRefresher {
            handle,
            stream,
            work: tau.clone(),
            a,
            b,
            tau,
            est,
            rc,
            max_dim: d,
            stage_factor: None,
            stage_basis: None,
            qr: QrMethod::RayleighCholeskyTc,
            phase_ms: std::cell::Cell::new([0.0; 5]),
            cholesky_counts: std::cell::Cell::new((0, 0)),
            rc_second: std::cell::Cell::new((0, 0)),
            phase_sync: None,
        };
        // SAFETY: a live handle; the stream belongs to this context.
        unsafe {
            check(
                "cusolverDnSetStream",
                cs::cusolverDnSetStream(handle, dev.stream(stream).cu_stream() as cs::cudaStream_t),
            )?;
        }
        let lwork = r.lwork(d)?;
        let mut ws = dev.arena("cusolver-workspace", crate::Tier::Device, lwork * 4)?;
        r.work = ws.buf(Elem::F32, lwork)?;
        Ok((r, bytes + lwork * 4))
    }

    /// The largest workspace (f32 elements) syevd, geqrf, orgqr and the lower-fill potrf need
    /// at side length `d`.
    fn lwork(&self, d: usize) -> Result<usize> {
        let (h, a, tau) = (self.handle, &self.a, &self.tau);
        let n = d as i32;
        let (mut l1, mut l2, mut l3, mut l4) = (0i32, 0i32, 0i32, 0i32);
        // SAFETY: size queries only read the dimensions; the pointers are live device memory.
        unsafe {
            check(
                "cusolverDnSsyevd_bufferSize",
                cs::cusolverDnSsyevd_bufferSize(
                    h,
                    cs::cusolverEigMode_t::CUSOLVER_EIG_MODE_VECTOR,
                    cs::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
                    n,
                    a.ptr() as *const f32,
                    n,
                    // The eigenvalues: any [d] f32 buffer (a size query).
                    tau.ptr() as *const f32,
                    &mut l1,
                ),
            )?;
            check(
                "cusolverDnSgeqrf_bufferSize",
                cs::cusolverDnSgeqrf_bufferSize(h, n, n, a.ptr() as *mut f32, n, &mut l2),
            )?;
            check(
                "cusolverDnSorgqr_bufferSize",
                cs::cusolverDnSorgqr_bufferSize(
                    h,
                    n,
                    n,
                    n,
                    a.ptr() as *const f32,
                    n,
                    tau.ptr() as *const f32,
                    &mut l3,
                ),
            )?;
            check(
                "cusolverDnSpotrf_bufferSize",
                cs::cusolverDnSpotrf_bufferSize(
                    h,
                    cs::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
                    n,
                    a.ptr() as *mut f32,
                    n,
                    &mut l4,
                ),
            )?;
        }
        Ok(l1.max(l2).max(l3).max(l4).max(1) as usize)
    }

    /// Gives the refresher a device copy (`[max_dim²]` f32, one arena) for a Kronecker factor
    /// (`factor`) and / or an eigenbasis (`basis`) that the plan keeps in pinned host memory
    /// (`schedule::reserve::RefreshStaging`): [`GpuRefresher::compute`] then copies such an
    /// operand there on its own stream before it reads it. Returns the bytes allocated.
    ///
    /// # Errors
    /// Allocation failures.
    pub(crate) fn stage_offloaded(
        &mut self,
        dev: &Device,
        factor: bool,
        basis: bool,
    ) -> Result<usize> {
        let n = usize::from(factor) + usize::from(basis);
        if n == 0 {
            return Ok(0);
        }
        let dd = self.max_dim * self.max_dim;
        let bytes = n * (dd * 4 + crate::memory::BUF_ALIGN);
        let mut arena: Arena = dev.arena("refresh-staging", crate::Tier::Device, bytes)?;
        if factor {
            self.stage_factor = Some(arena.buf(Elem::F32, dd)?);
        }
        if basis {
            self.stage_basis = Some(arena.buf(Elem::F32, dd)?);
        }
        Ok(bytes)
    }

    /// The device copy [`GpuRefresher::stage_offloaded`] allocated for an offloaded Kronecker
    /// factor (`[max_dim²]` f32), if any. Its contents are only meaningful within one
    /// operation on the refresher's stream: the engine also bounces a pinned factor's snapshot
    /// into pinned memory through it, in that stream's order.
    pub(crate) fn factor_stage(&self) -> Option<&Buf> {
        self.stage_factor.as_ref()
    }

    /// Sets how QR refreshes orthonormalise: the self-test runs [`QrMethod::Householder`]
    /// alone as the fallback's own case; everything else keeps what [`GpuRefresher::new`]
    /// set. Allocates nothing (the Rayleigh–Cholesky buffers are always there).
    pub(crate) fn set_qr_method(&mut self, qr: QrMethod) {
        self.qr = qr;
    }

    /// Synchronises the refresher's stream after every timed phase from now on, so that
    /// [`GpuRefresher::phase_ms_line`] reports GPU times instead of host enqueue times. A
    /// measurement aid (`asteria calibrate --sync-phases`): it serialises every refresh with
    /// the host.
    pub(crate) fn set_phase_sync(&mut self, dev: &Device) {
        self.phase_sync = Some(dev.stream(self.stream).clone());
    }

    /// QR refreshes done by the Rayleigh–Cholesky QR, and those redone by Householder, so far.
    pub(crate) fn cholesky_counts(&self) -> (u64, u64) {
        self.cholesky_counts.get()
    }

    /// The time of the refresh phases so far (ms, summed; host enqueue times, or GPU times
    /// after [`GpuRefresher::set_phase_sync`]) and the QR's counters, one line.
    pub(crate) fn phase_ms_line(&self) -> String {
        let [k, g, e, q, o] = self.phase_ms.get();
        let (c, f) = self.cholesky_counts.get();
        let phases = format!(
            "kernels {k:.0}, gemm {g:.0}, syevd {e:.0}, geqrf/potrf {q:.0}, orgqr/trsm {o:.0}"
        );
        match self.qr {
            QrMethod::Householder => format!("{phases}; QR Householder"),
            QrMethod::RayleighCholeskyTc => {
                let (ns, p2) = self.rc_second.get();
                format!("{phases}; Rayleigh-Cholesky 3xTF32 {c} (second step Newton-Schulz {ns}, CholeskyQR {p2}), Householder fallbacks {f}")
            }
        }
    }

    /// Runs `f` and adds its time to phase `phase` (see `phase_ms`).
    fn timed<T>(&self, phase: usize, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let t0 = std::time::Instant::now();
        let r = f();
        if let (Some(s), Ok(_)) = (&self.phase_sync, &r) {
            s.synchronize().map_err(crate::error::CudaError::from)?;
        }
        let mut p = self.phase_ms.get();
        p[phase] += t0.elapsed().as_secs_f64() * 1e3;
        self.phase_ms.set(p);
        r
    }

    fn launch(&self, dev: &Device, kernel: &'static str, n: usize, args: Args) -> Result<()> {
        self.timed(0, || {
            dev.launch_on(
                self.stream,
                kernel,
                (dev.grid_for(n), 1, 1),
                (256, 1, 1),
                args,
            )
        })
    }

    /// `status[word] += #non-finite entries of each of bufs`.
    fn count_nonfinite(
        &self,
        dev: &Device,
        bufs: &[&Buf],
        status: &Buf,
        word: usize,
    ) -> Result<()> {
        let count = status.slice(word, 1)?;
        for b in bufs {
            let n = b.len();
            self.launch(
                dev,
                "count_nonfinite",
                n,
                Args::new().buf(b).i64(n as i64).buf(&count),
            )?;
        }
        Ok(())
    }

    /// Enqueues one refresh computation of a factor of side length `d` on this refresher's
    /// stream, reading `factor` and `basis` (`[d, d]` f32; `basis` unused when `init`) and
    /// writing `slot` (see [`RefreshSlot`], [`STATUS_WORDS`]); the state is not touched.
    /// `init` = the first basis (`eigvecs(F + 1e-30·I)`, descending, either method), else for
    /// [`RefreshMethod::Soap`] `est = diag(QᵀFQ)`, `idx = argsort(est)` descending (stable, on
    /// the device), `Q_new = qr(F·Q[:, idx]).Q`, and for [`RefreshMethod::Qr`]
    /// `Q_new = qr(F·Q).Q` (columns in their order; `slot.idx` is not written). Both QRs take
    /// the same path (the Rayleigh–Cholesky QR, or Householder as set by
    /// [`GpuRefresher::set_qr_method`], with the same fallback and status words).
    /// GEMMs run at fp32 accuracy (3xTF32) whatever the device's [`crate::GemmMath`]; nothing
    /// here reads or sets device-wide state, so a side-stream refresher may enqueue from its
    /// own host thread.
    ///
    /// # Errors
    /// Shape errors (caller bugs) and CUDA / cuBLAS / cuSOLVER call failures. Numerical
    /// failures are not errors: they land in the status words ([`verdict`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn compute(
        &self,
        dev: &Device,
        init: bool,
        method: RefreshMethod,
        d: usize,
        factor: &Buf,
        basis: &Buf,
        slot: &RefreshSlot,
    ) -> Result<()> {
        const OP: &str = "eigenbasis_refresh";
        if method == RefreshMethod::InverseRoot {
            return Err(CudaError::Invalid {
                op: OP,
                what: "method inverse_root (Shampoo): use GpuRefresher::compute_inverse_root"
                    .into(),
            });
        }
        if d == 0 || d > self.max_dim || slot.q.len() < d * d || slot.idx.len() < d {
            return Err(CudaError::Invalid {
                op: OP,
                what: format!(
                    "side length {d} exceeds the work buffers (max dim {})",
                    self.max_dim
                ),
            });
        }
        let factor = device_operand(
            dev,
            (OP, "factor"),
            factor,
            self.stage_factor.as_ref(),
            d,
            self.stream,
        )?;
        // The first basis does not read the stored one.
        let basis = if init {
            basis.clone()
        } else {
            device_operand(
                dev,
                (OP, "basis"),
                basis,
                self.stage_basis.as_ref(),
                d,
                self.stream,
            )?
        };
        slot.status.expect(OP, "status", Elem::I32, STATUS_WORDS)?;
        self.enqueue(dev, init, method, d, &factor, &basis, slot)
    }

    #[allow(clippy::too_many_arguments)]
    fn enqueue(
        &self,
        dev: &Device,
        init: bool,
        method: RefreshMethod,
        d: usize,
        factor: &Buf,
        basis: &Buf,
        slot: &RefreshSlot,
    ) -> Result<()> {
        let dd = d * d;
        let st = &slot.status;
        let a = self.a.slice(0, dd)?;
        let q = slot.q.slice(0, dd)?;
        let idx = slot.idx.slice(0, d)?;
        let n = d as i32;
        dev.zero_on(st, self.stream)?;
        let absmax = st.slice(4, 1)?;
        self.launch(
            dev,
            "abs_max_bits",
            dd,
            Args::new().buf(factor).i64(dd as i64).buf(&absmax),
        )?;
        if init {
            self.count_nonfinite(dev, &[factor], st, 0)?;
            self.eigh_init(dev, d, factor, &q, st)?;
            return self.count_nonfinite(dev, &[&q], st, 3);
        }
        self.count_nonfinite(dev, &[factor, basis], st, 0)?;
        // a = F · Q_old; SOAP: est_j = Σ_i Q[i, j] · a[i, j]; idx = argsort(est) descending.
        // KL-Shampoo's QR keeps the columns in their order (no permutation).
        self.gemm_sq(dev, d, factor, false, basis, false, &a)?;
        let perm = match method {
            RefreshMethod::Soap => {
                let est = self.est.slice(0, d)?;
                self.timed(0, || {
                    dev.launch_on(
                        self.stream,
                        "column_dots",
                        (d.div_ceil(32) as u32, 1, 1),
                        (32, 32, 1),
                        Args::new().buf(basis).buf(&a).buf(&est).i32(n),
                    )
                })?;
                self.launch(
                    dev,
                    "argsort_desc",
                    d,
                    Args::new().buf(&est).buf(&idx).i32(n),
                )?;
                Some(&idx)
            }
            RefreshMethod::Qr | RefreshMethod::InverseRoot => None,
        };
        if self.qr == QrMethod::RayleighCholeskyTc {
            let ok = self.rayleigh_cholesky_qr(dev, d, basis, &a, perm, &q, st)?;
            let (c, f) = self.cholesky_counts.get();
            self.cholesky_counts
                .set(if ok { (c + 1, f) } else { (c, f + 1) });
            if ok {
                return self.count_nonfinite(dev, &[&q], st, 3);
            }
        }
        self.householder_qr(dev, d, &a, perm, &q, st)?;
        self.count_nonfinite(dev, &[&q], st, 3)
    }

    /// The first basis: `q = eigvecs(F + 1e-30·I)` (row-major, columns in descending
    /// eigenvalue order) by cuSOLVER `Ssyevd`, its info in status word 1. Uses `a` and `b`.
    fn eigh_init(&self, dev: &Device, d: usize, factor: &Buf, q: &Buf, st: &Buf) -> Result<()> {
        let dd = d * d;
        let n = d as i32;
        let (a, b) = (self.a.slice(0, dd)?, self.b.slice(0, dd)?);
        dev.copy(&a, factor, self.stream)?;
        self.launch(dev, "add_diag", d, Args::new().buf(&a).i32(n).f32(1e-30))?;
        self.syevd(dev, d, &a, &b, &st.slice(1, 1)?)?;
        self.launch(
            dev,
            "eigvecs_descending",
            dd,
            Args::new().buf(&a).buf(q).i32(n),
        )
    }

    /// cuSOLVER `Ssyevd` (eigenvalues and vectors, lower fill) of the symmetric `[d, d]` f32
    /// `a` in place on this refresher's stream: `a` becomes the eigenvectors (column-major,
    /// ascending eigenvalues), `w` (`[d]` f32) the eigenvalues, `info` (one i32 word) the
    /// solver's info.
    fn syevd(&self, dev: &Device, d: usize, a: &Buf, w: &Buf, info: &Buf) -> Result<()> {
        let n = d as i32;
        dev.context().bind_to_thread()?;
        // SAFETY: a [d, d], w [d], work of the queried size (syevd at the largest side) and the
        // info word are live device buffers; the handle runs on `self.stream`, after the work
        // enqueued there before.
        self.timed(2, || unsafe {
            check(
                "cusolverDnSsyevd",
                cs::cusolverDnSsyevd(
                    self.handle,
                    cs::cusolverEigMode_t::CUSOLVER_EIG_MODE_VECTOR,
                    cs::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
                    n,
                    a.ptr() as *mut f32,
                    n,
                    w.ptr() as *mut f32,
                    self.work.ptr() as *mut f32,
                    self.work.len() as i32,
                    info.ptr() as *mut i32,
                ),
            )
        })
    }

    /// Enqueues Shampoo's inverse root of a factor of side length `d` on this refresher's
    /// stream (plan method [`RefreshMethod::InverseRoot`], `optim::shampoo_inverse_root`
    /// step for step, Distributed Shampoo's `matrix_inverse_root`): `A = F + ε·I` (ε rounded
    /// to f32 and added in f32, as the host does), `(λ, V) = eigh(A)` by cuSOLVER `Ssyevd`,
    /// `λ' = λ − min λ + ε` when `min λ < ε` (else `λ' = λ`), and
    /// `root = V diag(λ'^(−1/r)) Vᵀ` (the spectrum treatment in f64: kernel
    /// `inverse_root_scale_cols`, then one fp32 cuBLAS GEMM) into `slot.q` (`[d, d]` f32;
    /// `slot.idx` is not written). Reads `factor` (`[d, d]` f32) only. Status words as
    /// [`STATUS_WORDS`]: `[0]` non-finite entries of the factor, `[1]` syevd's info, `[3]`
    /// non-finite entries of the root; ask [`verdict`] with `init = true` (an all-zero factor
    /// is a valid input: its root is `ε^(−1/r)·I`). Uses the work buffers `a` (the
    /// eigenvectors), `b` (the scaled eigenvectors) and `tau` (the eigenvalues).
    ///
    /// # Errors
    /// Shape errors (caller bugs) and CUDA / cuBLAS / cuSOLVER call failures. Numerical
    /// failures are not errors: they land in the status words.
    pub(crate) fn compute_inverse_root(
        &self,
        dev: &Device,
        d: usize,
        root: schedule::InverseRoot,
        factor: &Buf,
        slot: &RefreshSlot,
    ) -> Result<()> {
        const OP: &str = "eigenbasis_refresh";
        if d == 0 || d > self.max_dim || slot.q.len() < d * d {
            return Err(CudaError::Invalid {
                op: OP,
                what: format!(
                    "side length {d} exceeds the work buffers (max dim {})",
                    self.max_dim
                ),
            });
        }
        if root.exponent == 0 {
            return Err(CudaError::Invalid {
                op: OP,
                what: "inverse root exponent 0".into(),
            });
        }
        factor.expect(OP, "factor", Elem::F32, d * d)?;
        slot.status.expect(OP, "status", Elem::I32, STATUS_WORDS)?;
        let dd = d * d;
        let n = d as i32;
        let st = &slot.status;
        let (a, b) = (self.a.slice(0, dd)?, self.b.slice(0, dd)?);
        let w = self.tau.slice(0, d)?;
        let q = slot.q.slice(0, dd)?;
        dev.zero_on(st, self.stream)?;
        self.count_nonfinite(dev, &[factor], st, 0)?;
        dev.copy(&a, factor, self.stream)?;
        self.launch(
            dev,
            "add_diag",
            d,
            Args::new().buf(&a).i32(n).f32(root.epsilon as f32),
        )?;
        self.syevd(dev, d, &a, &w, &st.slice(1, 1)?)?;
        // b = V's columns scaled (column-major), i.e. diag(w)·Vᵀ row-major; one block of 256
        // threads per column (the kernel's reduction assumes 256).
        let expo = -1.0 / f64::from(root.exponent);
        self.timed(0, || {
            dev.launch_on(
                self.stream,
                "inverse_root_scale_cols",
                (d.min(65_535) as u32, 1, 1),
                (256, 1, 1),
                Args::new()
                    .buf(&a)
                    .buf(&w)
                    .buf(&b)
                    .i32(n)
                    .f64(root.epsilon)
                    .f64(expo),
            )
        })?;
        // Row-major, `a` is Vᵀ and `b` is diag(w)·Vᵀ: root = V diag(w) Vᵀ = aᵀ·b.
        let sq = Dims::new(d, d);
        self.timed(1, || {
            gemm_f32_with(
                dev,
                self.stream,
                GemmMath::Fp32,
                &a,
                sq,
                &b,
                sq,
                &q,
                true,
                false,
                1.0,
                0.0,
            )
        })?;
        self.count_nonfinite(dev, &[&q], st, 3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(words: &[(usize, i32)]) -> [i32; STATUS_WORDS] {
        let mut s = [0; STATUS_WORDS];
        s[4] = 1; // a non-zero factor
        for &(i, v) in words {
            s[i] = v;
        }
        s
    }

    #[test]
    fn clean_status_words_install_the_basis() {
        assert_eq!(verdict(false, 8, &status(&[])), Ok(()));
        // The Rayleigh–Cholesky words (its fallback was taken) do not matter.
        assert_eq!(verdict(false, 8, &status(&[(5, 3), (6, 99)])), Ok(()));
    }

    #[test]
    fn each_failure_keeps_the_previous_basis_with_its_reason() {
        assert_eq!(
            verdict(false, 8, &status(&[(0, 2)])),
            Err(RefreshFailure::NonFinite { dim: 8, count: 2 })
        );
        assert_eq!(
            verdict(false, 8, &status(&[(4, 0)])),
            Err(RefreshFailure::NoRank { dim: 8 })
        );
        // An all-zero factor is fine for the first basis (eigh of 1e-30·I); at a QR refresh
        // the engine reports it as skipped (`zero_factor`) before asking the verdict.
        assert_eq!(verdict(true, 8, &status(&[(4, 0)])), Ok(()));
        assert!(zero_factor(false, &status(&[(4, 0)])));
        assert!(!zero_factor(true, &status(&[(4, 0)])));
        assert!(!zero_factor(false, &status(&[])));
        assert!(!zero_factor(false, &status(&[(0, 3), (4, 0)])));
        assert!(!zero_factor(false, &[]));
        assert_eq!(
            verdict(true, 8, &status(&[(1, 5)])),
            Err(RefreshFailure::Solver {
                call: "syevd",
                info: 5
            })
        );
        assert_eq!(
            verdict(false, 8, &status(&[(1, -3)])),
            Err(RefreshFailure::Solver {
                call: "geqrf",
                info: -3
            })
        );
        assert_eq!(
            verdict(false, 8, &status(&[(2, 1)])),
            Err(RefreshFailure::Solver {
                call: "orgqr",
                info: 1
            })
        );
        assert_eq!(
            verdict(false, 8, &status(&[(3, 1)])),
            Err(RefreshFailure::BadBasis)
        );
        // A short status buffer reads as zeros (no panic).
        assert_eq!(verdict(true, 8, &[]), Ok(()));
    }

    #[test]
    fn work_bytes_cover_the_carved_buffers() {
        let align = crate::memory::BUF_ALIGN;
        for d in [1usize, 7, 783, 3072] {
            // a, b, x, g, 4 splits; tau; est (f64), each rounded up to the alignment.
            let up = |bytes: usize| bytes.div_ceil(align) * align;
            let need = 8 * up(d * d * 4) + up(d * 4) + up(d * 8);
            assert!(refresh_work_bytes(d) >= need, "d = {d}");
        }
    }
}
