//! SOAP eigenbasis refreshes on the GPU (plan host task `EigenbasisRefresh`, reference
//! `soap.py` `get_orthogonal_matrix` / `get_orthogonal_matrix_QR`), through cuSOLVER and
//! cuBLAS (`Ssyevd` for the first basis; for the power iteration + QR after, by default the
//! Rayleigh–Cholesky QR on the tensor cores, [`QrMethod::RayleighCholeskyTc`], with
//! `Sgeqrf` + `Sorgqr` as its fallback) and the helper kernels of family `refresh`. The semantics are those of
//! `optim::eigenbasis_refresh`, step for step:
//!
//! - init (end of step 1): `Q ← eigvecs(F + 1e-30·I)`, columns in descending eigenvalue order;
//! - QR refresh: `est = diag(Qᵀ F Q)` (f64), `idx = argsort(est)` descending (stable, IEEE
//!   total order, on the device: kernel `argsort_desc`), `exp_avg_sq` permuted along the side
//!   by `idx`, `Q_new = qr(F Q[:, idx]).Q`, `exp_avg` re-projected with `C = Q_oldᵀ Q_new`
//!   (side 0: `E ← Cᵀ E`, side 1: `E ← E C`).
//!
//! A refresh is two halves, as on the CPU (`optim::refresh_compute` / `refresh_apply`):
//! `GpuRefresher::compute` enqueues the candidate basis, permutation and status words into a
//! `RefreshSlot` on the refresher's stream without blocking the host and without touching
//! the state; `apply` (the swap, on the compute stream) installs them once the host has read
//! the status words and `verdict` found them clean. So a numerical failure (non-finite factor
//! or basis, solver `info ≠ 0`, all-zero factor at a QR refresh, non-finite new basis) leaves
//! basis and moments untouched. The synchronous refresh (S = 0, and every first basis) runs
//! both halves back to back on the compute stream with one status read in between; the
//! asynchronous one (S > 0, `placement = gpu_side`) runs `compute` on the side
//! stream on a snapshot of the factor and `apply` at a later step boundary (see
//! `crate::engine`). cuSOLVER is column-major; a symmetric factor is its own transpose, and
//! `Q_oldᵀ F` computed row-major is `F Q_old` column-major, which is what the QR needs.
use crate::device::{Device, GemmMath};
use crate::error::{CudaError, Result};
use crate::gemm::{gemm_f32, gemm_f32_with, Dims};
use crate::kernels::Args;
use crate::memory::{Arena, Buf, Elem};
use crate::StreamKind;
use cudarc::cublas::sys as cbsys;
use cudarc::cusolver::sys as cs;

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
    /// An all-zero factor at a QR refresh: its power image has no rank.
    #[error("factor [{dim}x{dim}] is all zero: no rank to refresh from; basis kept")]
    NoRank {
        /// Side length.
        dim: usize,
    },
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
/// geqrf, `[2]` `info` of orgqr (ormqr), `[3]` non-finite entries of the new basis, `[4]` the
/// bit pattern of `max |F|` (0 = all-zero factor), `[5]` the first non-zero `Dpotrf` / `Spotrf`
/// info and `[6]` the bits of the last pass's `max|R − I|` of shifted CholeskyQR3 or the
/// Rayleigh–Cholesky QR, `[7]` their scratch. Words 5–7 only decide whether those methods'
/// result is used (a failure there falls back to Householder QR, whose words 1–2 count).
pub(crate) const STATUS_WORDS: usize = 8;

/// A cuSOLVER dense handle and the work buffers of one refresh at a time, bound to one stream
/// (the compute stream for synchronous refreshes, the side stream for
/// asynchronous ones). Everything it enqueues is stream-ordered, and [`GpuRefresher::compute`]
/// does not wait for the GPU itself — except with [`QrMethod::ShiftedCholeskyQr3`] and
/// [`QrMethod::RayleighCholesky`], which read their status words once per refresh (and
/// [`QrMethod::RayleighCholeskyTc`], once or twice) to decide on
/// the Householder fallback (and
/// cuSOLVER's `Sgeqrf`/`Sorgqr` block the calling thread on their own, seen on the H200).
pub(crate) struct GpuRefresher {
    handle: cs::cusolverDnHandle_t,
    stream: StreamKind,
    a: Buf,
    b: Buf,
    tau: Buf,
    est: Buf,
    work: Buf,
    max_dim: usize,
    /// How QR refreshes orthonormalise.
    qr: QrMethod,
    /// Host ms spent enqueueing: checks/kernels, GEMMs, syevd, geqrf/potrf, orgqr/trsm.
    phase_ms: std::cell::Cell<[f64; 5]>,
    /// Refreshes orthonormalised by shifted CholeskyQR3, and those that fell back to
    /// Householder.
    cholesky_counts: std::cell::Cell<(u64, u64)>,
    /// The float64 work of [`QrMethod::ShiftedCholeskyQr3`] (allocated when it is chosen).
    f64_work: Option<F64Work>,
    /// The f32 work of [`QrMethod::RayleighCholesky`]: `x` and `g`, `[d, d]` each (allocated
    /// when it is chosen), and their arena.
    rc_work: Option<RcWork>,
    /// [`QrMethod::RayleighCholeskyTc`] refreshes finished by one Newton–Schulz step, and by
    /// the second CholeskyQR pass.
    tc_second: std::cell::Cell<(u64, u64)>,
    /// `ASTERIA_CUDA_REFRESH_PHASES=sync`: the stream, synchronised after every timed phase,
    /// so the phase times ([`GpuRefresher::phase_ms_line`]) are GPU times (a profiling aid:
    /// it serialises the refresh with the host).
    phase_sync: Option<std::sync::Arc<cudarc::driver::CudaStream>>,
    /// `ASTERIA_CUDA_POTRF=xpotrf`: the Rayleigh–Cholesky QRs' Cholesky factorisations through
    /// cuSOLVER's 64-bit generic `cusolverDnXpotrf` (what PyTorch's `linalg.cholesky` calls)
    /// instead of `cusolverDnSpotrf`: its params handle, device workspace (bytes) and host
    /// workspace.
    xpotrf: Option<XPotrf>,
    /// Which triangle the Rayleigh–Cholesky QRs' Cholesky factorisations produce
    /// (column-major): `CUBLAS_FILL_MODE_LOWER` by default, `UPPER` with
    /// `ASTERIA_CUDA_POTRF_FILL=upper` (sessions 6–7's). The factor is the same matrix either
    /// way (`B = C Cᵀ` is unique); cuSOLVER's lower `Spotrf` is the path PyTorch's
    /// `linalg.cholesky` takes, which measured 1.26 ms at d = 3072 on the H200 against ~3.2 ms
    /// for the upper one in the refresher (BENCHMARKS.md, sessions 6–8).
    fill: cs::cublasFillMode_t,
}

/// Float64 buffers of shifted CholeskyQR3: the matrix being orthonormalised `x` and the Gram
/// matrix / Cholesky factor `g` (`[d, d]` each) and `Dpotrf`'s workspace.
struct F64Work {
    x: Buf,
    g: Buf,
    work: Buf,
    _arena: Arena,
}

/// The f32 work of the Rayleigh–Cholesky QRs: `x` and `g` (`[d, d]` each), and with
/// [`QrMethod::RayleighCholeskyTc`] the four 3xTF32 operand splits ([`gemm_3xtf32`]).
struct RcWork {
    x: Buf,
    g: Buf,
    split: Option<[Buf; 4]>,
    _arena: Arena,
}

/// cuSOLVER's generic 64-bit Cholesky factorisation (`cusolverDnXpotrf`, fp32) for
/// [`GpuRefresher`]: its params handle and workspaces, sized for the refresher's largest side.
struct XPotrf {
    params: cs::cusolverDnParams_t,
    work: Buf,
    /// Written by cuSOLVER during the call.
    host: std::cell::UnsafeCell<Vec<u8>>,
    _arena: Arena,
}

impl Drop for XPotrf {
    fn drop(&mut self) {
        // SAFETY: created in `XPotrf::new`, destroyed once.
        let _ = unsafe { cs::cusolverDnDestroyParams(self.params) };
    }
}

impl XPotrf {
    fn new(
        dev: &Device,
        h: cs::cusolverDnHandle_t,
        a: &Buf,
        d: usize,
        fill: cs::cublasFillMode_t,
    ) -> Result<XPotrf> {
        let mut params: cs::cusolverDnParams_t = std::ptr::null_mut();
        dev.context().bind_to_thread()?;
        // SAFETY: out-pointer to a live local.
        unsafe {
            check(
                "cusolverDnCreateParams",
                cs::cusolverDnCreateParams(&mut params),
            )?;
        }
        let (mut dev_bytes, mut host_bytes) = (0usize, 0usize);
        // SAFETY: out-pointers to live locals; the size query reads the dimensions only (`a`
        // is live device memory of at least d² f32).
        let rest = unsafe {
            check(
                "cusolverDnXpotrf_bufferSize",
                cs::cusolverDnXpotrf_bufferSize(
                    h,
                    params,
                    fill,
                    d as i64,
                    cs::cudaDataType::CUDA_R_32F,
                    a.ptr() as *const std::ffi::c_void,
                    d as i64,
                    cs::cudaDataType::CUDA_R_32F,
                    &mut dev_bytes,
                    &mut host_bytes,
                ),
            )
        }
        .and_then(|()| {
            let words = dev_bytes.div_ceil(4).max(1);
            let mut arena = dev.arena(
                "xpotrf-workspace",
                crate::Tier::Device,
                words * 4 + crate::memory::BUF_ALIGN,
            )?;
            Ok((arena.buf(Elem::F32, words)?, arena))
        });
        match rest {
            Ok((work, arena)) => Ok(XPotrf {
                params,
                work,
                host: std::cell::UnsafeCell::new(vec![0u8; host_bytes.max(1)]),
                _arena: arena,
            }),
            Err(e) => {
                // SAFETY: created above and not owned by anything yet.
                let _ = unsafe { cs::cusolverDnDestroyParams(params) };
                Err(e)
            }
        }
    }
}

/// `out ← α·op(A)·op(B) + β·out` for fp32 row-major operands (as [`gemm_f32_with`]), to about
/// fp32 accuracy on the TF32 tensor cores ("3xTF32"; Ootomo & Yokota, "Recovering single
/// precision accuracy from Tensor Cores while surpassing the FP32 theoretical peak
/// performance", IJHPCA 2022; CUTLASS's `OpMultiplyAddFastF32`): each operand is split on the
/// device into `hi = tf32(x)` (round to nearest) and `lo = x − hi`, and
/// `A·B ≈ lo_A·hi_B + hi_A·lo_B + hi_A·hi_B` by three cuBLAS GEMMs with
/// `CUBLAS_COMPUTE_32F_FAST_TF32` (`lo_A·lo_B`, ~2⁻²² of the product, is dropped). Relative
/// error ~1e-6 of `|A|·|B|` instead of TF32's ~1e-3, at three TF32 GEMMs' cost (on the H200
/// at d = 3072 about 0.6 ms against 1.5 ms for an fp32 SGEMM; `bench/qr_variants.py`).
/// `split`: four f32 buffers of at least the operands' lengths (`A` and `B` the same buffer:
/// split once, into the first two). Everything runs on `kind`'s stream.
///
/// # Errors
/// Operand shape errors and cuBLAS / launch failures.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_3xtf32(
    dev: &Device,
    kind: StreamKind,
    a: &Buf,
    a_dims: Dims,
    b: &Buf,
    b_dims: Dims,
    out: &Buf,
    trans_a: bool,
    trans_b: bool,
    alpha: f32,
    beta: f32,
    split: &[Buf; 4],
) -> Result<()> {
    let halves = |x: &Buf, h: &Buf, l: &Buf| -> Result<(Buf, Buf)> {
        let n = x.len();
        let (h, l) = (h.slice(0, n)?, l.slice(0, n)?);
        dev.launch_on(
            kind,
            "split_tf32",
            (dev.grid_for(n), 1, 1),
            (256, 1, 1),
            Args::new().buf(x).buf(&h).buf(&l).i64(n as i64),
        )?;
        Ok((h, l))
    };
    let (ah, al) = halves(a, &split[0], &split[1])?;
    let (bh, bl) = if a.ptr() == b.ptr() && a.len() == b.len() {
        (ah.clone(), al.clone())
    } else {
        halves(b, &split[2], &split[3])?
    };
    let tf = GemmMath::Tf32;
    let (ad, bd) = (a_dims, b_dims);
    gemm_f32_with(
        dev, kind, tf, &al, ad, &bh, bd, out, trans_a, trans_b, alpha, beta,
    )?;
    gemm_f32_with(
        dev, kind, tf, &ah, ad, &bl, bd, out, trans_a, trans_b, alpha, 1.0,
    )?;
    gemm_f32_with(
        dev, kind, tf, &ah, ad, &bh, bd, out, trans_a, trans_b, alpha, 1.0,
    )
}

/// How the QR refresh orthonormalises the power image `A = (F Q_old)[:, idx]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QrMethod {
    /// cuSOLVER `Sgeqrf` + `Sorgqr` (Householder; soap.py's `torch.linalg.qr`): the fallback
    /// of the Cholesky-based methods (and the default until session 8,
    /// `ASTERIA_CUDA_QR=householder`). cuSOLVER's QR also blocks the enqueueing host thread
    /// until its GPU work is done (seen on the H200).
    Householder,
    /// Householder QR with the explicit Q formed by `Sormqr` (the reflectors of `Sgeqrf`
    /// applied to the identity) instead of `Sorgqr`, in which the side launcher thread spends
    /// ~2.6× as long as in `Sgeqrf`. The same reflectors, so the same Q up to rounding; on the
    /// H200 it measured no faster (20.8 against 20.7 ms at d = 3072, BENCHMARKS.md session 6).
    HouseholderOrmqr,
    /// Shifted CholeskyQR3 in float64 (Fukaya, Kannan, Nakatsukasa, Yamamoto, Yanagisawa,
    /// "Shifted Cholesky QR for computing the QR factorization of ill-conditioned matrices",
    /// SIAM J. Sci. Comput. 2020): the f32 power image is widened to f64 with its columns
    /// normalised, then `G = AᵀA + s·I` with `s = 11(d² + d(d+1))·2⁻⁵³·‖A‖²` (`‖A‖² ≤ d` after
    /// the normalisation), `R = chol(G)` (cuSOLVER `Dpotrf`), `A ← A R⁻¹` (cuBLAS `Dtrsm`),
    /// and twice more without the shift (CholeskyQR2). All GEMM-shaped work on the FP64
    /// tensor cores, none of Householder's latency-bound panels, and stable up to
    /// `cond(A) ≈ 1e12` where fp32 CholeskyQR2 (tried first, BENCHMARKS.md) fails beyond
    /// `≈ 3e3`. The Q of a full-rank `A` is unique up to column signs, so this is Householder's
    /// basis up to signs, and SOAP is invariant to them (`exp_avg` is re-projected through
    /// `Q_oldᵀ Q_new`, `exp_avg_sq` is unchanged by a sign). Checked on the device: when a
    /// Cholesky factorisation fails (numerically rank-deficient `A`) or the last pass's `R`
    /// is further than [`CHOLESKY_ORTHO_TOL`] from the identity (the input to the last pass
    /// was not orthonormal enough), the refresh is redone with Householder QR.
    ShiftedCholeskyQr3,
    /// Rayleigh–Cholesky QR in fp32: the power image's QR through the stored basis. `Q_p =
    /// Q_old[:, idx]` is orthonormal, so with `B = Q_pᵀ F Q_p` (symmetric positive
    /// semidefinite) `F Q_p = Q_p B`, and with the Cholesky factorisation `B + s·I = C Cᵀ` (C
    /// lower, `s` = [`RC_SHIFT`] of `max diag B`) `F Q_p ≈ Q_p C Cᵀ` with `Cᵀ` upper
    /// triangular, hence `qr(F Q_p).Q = Q_p · qr(L).Q` for the unit lower-triangular
    /// `L = C diag(C)⁻¹`. The ill-conditioning of the power image (`cond F`, 1e7–1e9 and
    /// beyond on GPT-2's factors, where fp32 CholeskyQR2 of `F Q_p` fails) sits in `diag C`
    /// and `Cᵀ`; `L`'s entries are the rotation of the old basis toward the new one scaled by
    /// eigenvalue ratios ≤ 1 (the columns are sorted), cond(L) 15–850 on those factors, so
    /// CholeskyQR2 is accurate: one CholeskyQR pass on `L` (cuBLAS `Ssyrk`, cuSOLVER
    /// `Spotrf`, cuBLAS `Strsm`) gives `W₁`, and the second pass runs on `M = Q_p W₁`, which
    /// also corrects `Q_p`'s own rounding away from orthonormality (a second pass on `W₁`
    /// alone would carry it into every later basis). Work, all `[d, d]` and fp32: the shared
    /// `F Q_old` and two more GEMMs, two `Ssyrk`, three Cholesky factorisations and two
    /// triangular solves, instead of Householder's latency-bound panels (`Sgeqrf` + `Sorgqr`).
    /// The shift changes only directions whose eigenvalues are below ~`s·max λ` (where the fp32
    /// Householder QR is rounding noise too: `bench/qr_variants.py`). Checked on the device:
    /// when a Cholesky factorisation fails or the second pass's `R` is further than
    /// [`RC_ORTHO_TOL`] from the identity, the refresh is redone with Householder QR.
    RayleighCholesky,
    /// [`QrMethod::RayleighCholesky`] with its GEMMs on the tensor cores and a cheaper second
    /// pass: every GEMM (`F Q_old`, `B`, the Gram matrices, `Q_p W₁`) is `gemm_3xtf32`
    /// (fp32 accuracy from three TF32 GEMMs, ~2.5× faster than SGEMM on the H200), and after
    /// the CholeskyQR pass on `L` the product `M = Q_p W₁` is read once: when
    /// `‖MᵀM − I‖_F ≤` [`RC_NS_TOL`] one Newton–Schulz step `M (3I − MᵀM)/2` (two GEMMs)
    /// finishes it — orthonormality error ≤ ¾·e² + fp32 rounding, a change of `O(e)` to the
    /// basis, far below the rounding noise of the fp32 Householder QR itself on these factors
    /// (`bench/qr_variants.py`) — instead of the second CholeskyQR pass (`Spotrf` + `Strsm`,
    /// ~3 ms at d = 3072), which still runs above that tolerance. The same fallbacks to
    /// Householder QR. The default since session 8 (BENCHMARKS.md): with the lower-fill
    /// Cholesky factorisations 8.1 against Householder's 20.5 ms per refresh at d = 3072 on
    /// the H200 (4.98 against 13.6 at 2304), GPT-2 124M SOAP S=5 mean step 80 against 105 ms;
    /// at S=5 and S=0 its validation loss @300 ended between 0.056 below and 0.003 above
    /// Householder S=0's on seeds 1337, 7 and 42.
    /// (Session 7's upper-fill build ended 0.05–0.07 behind on seed 1337 in five of seven
    /// side-stream runs, level on seed 7; with this build no seed was behind.)
    #[default]
    RayleighCholeskyTc,
}

/// Largest `‖MᵀM − I‖_F` of [`QrMethod::RayleighCholeskyTc`]'s `M = Q_p W₁` that one
/// Newton–Schulz step finishes: it leaves `‖QᵀQ − I‖₂ ≤ ¾‖MᵀM − I‖₂² + rounding ≤ ¾·1e-4 +
/// rounding`; above it the second CholeskyQR pass runs. (Until the session-7 review the gate
/// was the largest entry, which can be `d` times smaller than the spectral norm.)
pub const RC_NS_TOL: f32 = 1e-2;

/// Relative diagonal shift of the Rayleigh–Cholesky QR's `B = Q_pᵀ F Q_p`: `B + s·max(diag B)·I`
/// is positive definite in fp32 on every factor `bench/qr_variants.py` captured from GPT-2 124M
/// but one (which goes to Householder), and the result matches a float64 Householder QR of `F Q_p`
/// to 1 − |cos| ≤ 1e-6 on the columns above 1e-2 of the largest estimate after the first
/// period (`bench/results/h200-s6-probes/qr-variants/`).
pub const RC_SHIFT: f32 = 1e-6;

/// Largest `max|R₂ − I|` of the Rayleigh–Cholesky QR's second CholeskyQR pass (about half the
/// orthonormality error of `Q_p W₁` after the first pass) before the refresh is redone by
/// Householder: below it, the second pass leaves the new basis orthonormal to fp32 rounding
/// (CholeskyQR2's bound, Yamamoto et al. 2015, needs the first pass's output to be
/// well-conditioned, not exact).
pub const RC_ORTHO_TOL: f32 = 0.05;

impl std::str::FromStr for QrMethod {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "householder" => Ok(QrMethod::Householder),
            "householder-ormqr" | "ormqr" => Ok(QrMethod::HouseholderOrmqr),
            "cholesky3" | "shifted-cholesky3" => Ok(QrMethod::ShiftedCholeskyQr3),
            "rc" | "rayleigh-cholesky" => Ok(QrMethod::RayleighCholesky),
            "rc-tc" | "rayleigh-cholesky-tc" => Ok(QrMethod::RayleighCholeskyTc),
            _ => Err(format!(
                "unknown QR method `{s}` (householder, householder-ormqr, cholesky3, rayleigh-cholesky or rayleigh-cholesky-tc)"
            )),
        }
    }
}

/// Largest `max|R₃ − I|` of shifted CholeskyQR3's last Cholesky factor (i.e. about half the
/// orthonormality error `max|QᵀQ − I|` of the input to the last pass) before the refresh is
/// redone by Householder: below it, the last pass leaves `Q` orthonormal to float64 rounding.
pub const CHOLESKY_ORTHO_TOL: f32 = 1e-4;

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

/// Bytes of the work buffers [`GpuRefresher::new`] carves before cuSOLVER's own workspace:
/// 2 `d×d` f32 matrices, tau, f64 estimates.
pub(crate) fn refresh_work_bytes(max_dim: usize) -> usize {
    let d = max_dim.max(1);
    (2 * d * d + d + 2 * d) * 4 + 6 * crate::memory::BUF_ALIGN
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
            call: "orgqr/ormqr",
            info: word(2),
        });
    }
    if word(3) > 0 {
        return Err(RefreshFailure::BadBasis);
    }
    Ok(())
}

impl GpuRefresher {
    /// Creates the handle (bound to `stream`) and allocates the work buffers (one device
    /// arena of [`refresh_work_bytes`]), cuSOLVER's workspace (a second arena, its size
    /// queried here) and those of QR method `qr` (see [`GpuRefresher::set_qr_method`]).
    /// Returns the refresher and the bytes it allocated.
    pub(crate) fn new(
        dev: &Device,
        stream: StreamKind,
        max_dim: usize,
        qr: QrMethod,
    ) -> Result<(GpuRefresher, usize)> {
        if !cusolver_present() {
            return Err(CudaError::MissingLibrary {
                lib: "libcusolver.so",
                hint: "install cuSOLVER or put the CUDA lib64 folder on LD_LIBRARY_PATH (or refresh on the host: ASTERIA_CUDA_REFRESH=host)",
            });
        }
        let d = max_dim.max(1);
        dev.context().bind_to_thread()?;
        let mut handle: cs::cusolverDnHandle_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a live handle slot; the stream belongs to this context.
        unsafe {
            check("cusolverDnCreate", cs::cusolverDnCreate(&mut handle))?;
            check(
                "cusolverDnSetStream",
                cs::cusolverDnSetStream(handle, dev.stream(stream).cu_stream() as cs::cudaStream_t),
            )?;
        }
        let bytes = refresh_work_bytes(d);
        let mut arena: Arena = dev.arena("refresh", crate::Tier::Device, bytes)?;
        let a = arena.buf(Elem::F32, d * d)?;
        let b = arena.buf(Elem::F32, d * d)?;
        let tau = arena.buf(Elem::F32, d)?;
        let est = arena.buf(Elem::F64, d)?;
        let w = tau.clone();
        let lwork = Self::lwork(handle, &a, &w, &tau, d)?;
        let mut ws = dev.arena("cusolver-workspace", crate::Tier::Device, lwork * 4)?;
        let work = ws.buf(Elem::F32, lwork)?;
        let fill = match std::env::var("ASTERIA_CUDA_POTRF_FILL").as_deref() {
            Ok("upper") => cs::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
            _ => cs::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
        };
        let xpotrf = match std::env::var("ASTERIA_CUDA_POTRF").as_deref() {
            Ok("xpotrf") => Some(XPotrf::new(dev, handle, &a, d, fill)?),
            _ => None,
        };
        let mut r = GpuRefresher {
            handle,
            stream,
            a,
            b,
            tau,
            est,
            work,
            max_dim: d,
            qr: QrMethod::Householder,
            phase_ms: std::cell::Cell::new([0.0; 5]),
            cholesky_counts: std::cell::Cell::new((0, 0)),
            f64_work: None,
            rc_work: None,
            tc_second: std::cell::Cell::new((0, 0)),
            phase_sync: (std::env::var("ASTERIA_CUDA_REFRESH_PHASES").as_deref() == Ok("sync"))
                .then(|| dev.stream(stream).clone()),
            xpotrf,
            fill,
        };
        let extra = r.set_qr_method(dev, qr)?;
        Ok((r, bytes + lwork * 4 + extra))
    }

    /// The largest workspace (f32 elements) syevd, geqrf, orgqr, ormqr and potrf need at side
    /// length `d`.
    fn lwork(h: cs::cusolverDnHandle_t, a: &Buf, w: &Buf, tau: &Buf, d: usize) -> Result<usize> {
        let n = d as i32;
        let (mut l1, mut l2, mut l3, mut l4, mut l5) = (0i32, 0i32, 0i32, 0i32, 0i32);
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
                    w.ptr() as *const f32,
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
                "cusolverDnSormqr_bufferSize",
                cs::cusolverDnSormqr_bufferSize(
                    h,
                    cs::cublasSideMode_t::CUBLAS_SIDE_LEFT,
                    cs::cublasOperation_t::CUBLAS_OP_N,
                    n,
                    n,
                    n,
                    a.ptr() as *const f32,
                    n,
                    tau.ptr() as *const f32,
                    w.ptr() as *const f32,
                    n,
                    &mut l5,
                ),
            )?;
            // Both triangles (the refresher's fill is chosen after this query).
            for fill in [
                cs::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
                cs::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
            ] {
                let mut l = 0i32;
                check(
                    "cusolverDnSpotrf_bufferSize",
                    cs::cusolverDnSpotrf_bufferSize(h, fill, n, a.ptr() as *mut f32, n, &mut l),
                )?;
                l4 = l4.max(l);
            }
        }
        Ok(l1.max(l2).max(l3).max(l4).max(l5).max(1) as usize)
    }

    /// Sets how QR refreshes orthonormalise; returns the bytes newly allocated for it (the
    /// float64 buffers of shifted CholeskyQR3: `2·8·d² + 8·lwork`, the f32 ones of
    /// Rayleigh–Cholesky: `2·4·d²`, `6·4·d²` for its tensor-core variant (with the 3xTF32
    /// operand splits), for the refresher's largest side `d`, plus alignment). Buffers of a
    /// previous method that `qr` does not use are freed.
    ///
    /// # Errors
    /// Allocation or cuSOLVER workspace-query failures.
    pub(crate) fn set_qr_method(&mut self, dev: &Device, qr: QrMethod) -> Result<usize> {
        self.qr = qr;
        let tc = qr == QrMethod::RayleighCholeskyTc;
        if !matches!(
            qr,
            QrMethod::RayleighCholesky | QrMethod::RayleighCholeskyTc
        ) {
            self.rc_work = None;
        }
        if qr != QrMethod::ShiftedCholeskyQr3 {
            self.f64_work = None;
        }
        let has_split = self.rc_work.as_ref().is_some_and(|w| w.split.is_some());
        if (qr == QrMethod::RayleighCholesky && self.rc_work.is_none()) || (tc && !has_split) {
            let d = self.max_dim;
            let bufs = if tc { 6 } else { 2 };
            let bytes = bufs * (d * d * 4 + crate::memory::BUF_ALIGN);
            let mut arena = dev.arena("refresh-rc", crate::Tier::Device, bytes)?;
            let x = arena.buf(Elem::F32, d * d)?;
            let g = arena.buf(Elem::F32, d * d)?;
            let split = if tc {
                Some([
                    arena.buf(Elem::F32, d * d)?,
                    arena.buf(Elem::F32, d * d)?,
                    arena.buf(Elem::F32, d * d)?,
                    arena.buf(Elem::F32, d * d)?,
                ])
            } else {
                None
            };
            self.rc_work = Some(RcWork {
                x,
                g,
                split,
                _arena: arena,
            });
            return Ok(bytes);
        }
        if qr != QrMethod::ShiftedCholeskyQr3 || self.f64_work.is_some() {
            return Ok(0);
        }
        let d = self.max_dim;
        let align = crate::memory::BUF_ALIGN;
        let mut lwork = 0i32;
        dev.context().bind_to_thread()?;
        // SAFETY: a size query; it reads the dimensions only (the pointer is live memory).
        unsafe {
            check(
                "cusolverDnDpotrf_bufferSize",
                cs::cusolverDnDpotrf_bufferSize(
                    self.handle,
                    cs::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
                    d as i32,
                    self.a.ptr() as *mut f64,
                    d as i32,
                    &mut lwork,
                ),
            )?;
        }
        let lwork = (lwork.max(1)) as usize;
        let bytes = (2 * d * d + lwork) * 8 + 3 * align;
        let mut arena = dev.arena("refresh-f64", crate::Tier::Device, bytes)?;
        self.f64_work = Some(F64Work {
            x: arena.buf(Elem::F64, d * d)?,
            g: arena.buf(Elem::F64, d * d)?,
            work: arena.buf(Elem::F64, lwork)?,
            _arena: arena,
        });
        Ok(bytes)
    }

    /// QR refreshes done by shifted CholeskyQR3 or the Rayleigh–Cholesky QR (whichever is
    /// set), and those redone by Householder, so far.
    pub(crate) fn cholesky_counts(&self) -> (u64, u64) {
        self.cholesky_counts.get()
    }

    /// The host time of the enqueue phases, one line.
    pub(crate) fn phase_ms_line(&self) -> String {
        let [k, g, e, q, o] = self.phase_ms.get();
        let (c, f) = self.cholesky_counts.get();
        let phases = format!(
            "kernels {k:.0}, gemm {g:.0}, syevd {e:.0}, geqrf/potrf {q:.0}, orgqr/trsm {o:.0}"
        );
        match self.qr {
            QrMethod::Householder => format!("{phases}; QR Householder (orgqr)"),
            QrMethod::HouseholderOrmqr => format!("{phases}; QR Householder (ormqr)"),
            QrMethod::ShiftedCholeskyQr3 => {
                format!("{phases}; shifted CholeskyQR3 {c}, Householder fallbacks {f}")
            }
            QrMethod::RayleighCholesky => {
                format!("{phases}; Rayleigh-Cholesky {c}, Householder fallbacks {f}")
            }
            QrMethod::RayleighCholeskyTc => {
                let (ns, p2) = self.tc_second.get();
                format!("{phases}; Rayleigh-Cholesky 3xTF32 {c} (second step Newton-Schulz {ns}, CholeskyQR {p2}), Householder fallbacks {f}")
            }
        }
    }

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
    /// `init` = the first basis (`eigvecs(F + 1e-30·I)`, descending), else `est = diag(QᵀFQ)`,
    /// `idx = argsort(est)` descending (stable, on the device), `Q_new = qr(F·Q[:, idx]).Q`.
    /// GEMMs run in plain fp32 whatever the device's [`GemmMath`]; nothing here reads or sets
    /// device-wide state, so a side-stream refresher may enqueue from its own host thread.
    ///
    /// # Errors
    /// Shape errors (caller bugs) and CUDA / cuBLAS / cuSOLVER call failures. Numerical
    /// failures are not errors: they land in the status words ([`verdict`]).
    pub(crate) fn compute(
        &self,
        dev: &Device,
        init: bool,
        d: usize,
        factor: &Buf,
        basis: &Buf,
        slot: &RefreshSlot,
    ) -> Result<()> {
        const OP: &str = "eigenbasis_refresh";
        if d == 0 || d > self.max_dim || slot.q.len() < d * d || slot.idx.len() < d {
            return Err(CudaError::Invalid {
                op: OP,
                what: format!(
                    "side length {d} exceeds the work buffers (max dim {})",
                    self.max_dim
                ),
            });
        }
        factor.expect(OP, "factor", Elem::F32, d * d)?;
        basis.expect(OP, "basis", Elem::F32, d * d)?;
        slot.status.expect(OP, "status", Elem::I32, STATUS_WORDS)?;
        self.enqueue(dev, init, d, factor, basis, slot)
    }

    fn enqueue(
        &self,
        dev: &Device,
        init: bool,
        d: usize,
        factor: &Buf,
        basis: &Buf,
        slot: &RefreshSlot,
    ) -> Result<()> {
        let dd = d * d;
        let st = &slot.status;
        let (a, b) = (self.a.slice(0, dd)?, self.b.slice(0, dd)?);
        let q = slot.q.slice(0, dd)?;
        let idx = slot.idx.slice(0, d)?;
        let info = |w: usize| st.slice(w, 1).map(|s| s.ptr() as *mut i32);
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
            dev.copy(&a, factor, self.stream)?;
            self.launch(dev, "add_diag", d, Args::new().buf(&a).i32(n).f32(1e-30))?;
            dev.context().bind_to_thread()?;
            // SAFETY: a [d, d], w (= b's first d floats) [d], work of the queried size and the
            // info word are live device buffers; the handle runs on `self.stream`, after the
            // copies above.
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
                        b.ptr() as *mut f32,
                        self.work.ptr() as *mut f32,
                        self.work.len() as i32,
                        info(1)?,
                    ),
                )
            })?;
            self.launch(
                dev,
                "eigvecs_descending",
                dd,
                Args::new().buf(&a).buf(&q).i32(n),
            )?;
            return self.count_nonfinite(dev, &[&q], st, 3);
        }
        self.count_nonfinite(dev, &[factor, basis], st, 0)?;
        let sq = Dims::new(d, d);
        // a = F · Q_old; est_j = Σ_i Q[i, j] · a[i, j]; idx = argsort(est) descending.
        self.timed(1, || {
            if let Some(split) = self.tc_split() {
                return gemm_3xtf32(
                    dev,
                    self.stream,
                    factor,
                    sq,
                    basis,
                    sq,
                    &a,
                    false,
                    false,
                    1.0,
                    0.0,
                    split,
                );
            }
            gemm_f32_with(
                dev,
                self.stream,
                GemmMath::Fp32,
                factor,
                sq,
                basis,
                sq,
                &a,
                false,
                false,
                1.0,
                0.0,
            )
        })?;
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
        if matches!(
            self.qr,
            QrMethod::RayleighCholesky
                | QrMethod::RayleighCholeskyTc
                | QrMethod::ShiftedCholeskyQr3
        ) {
            let ok = if self.qr != QrMethod::ShiftedCholeskyQr3 {
                self.rayleigh_cholesky_qr(dev, d, basis, &a, &idx, &q, st)?
            } else {
                self.shifted_cholesky_qr3(dev, d, &a, &idx, &q, st)?
            };
            let (c, f) = self.cholesky_counts.get();
            self.cholesky_counts
                .set(if ok { (c + 1, f) } else { (c, f + 1) });
            if ok {
                return self.count_nonfinite(dev, &[&q], st, 3);
            }
        }
        // b (column-major) = (F Q)[:, idx]; QR in place; Q_new column-major in b.
        self.launch(
            dev,
            "gather_cols_transpose",
            dd,
            Args::new().buf(&a).buf(&idx).buf(&b).i32(n).i32(n),
        )?;
        dev.context().bind_to_thread()?;
        // SAFETY: b [d, d], tau [d], work of the queried size and the info words are live
        // device buffers on `self.stream`.
        self.timed(3, || unsafe {
            check(
                "cusolverDnSgeqrf",
                cs::cusolverDnSgeqrf(
                    self.handle,
                    n,
                    n,
                    b.ptr() as *mut f32,
                    n,
                    self.tau.ptr() as *mut f32,
                    self.work.ptr() as *mut f32,
                    self.work.len() as i32,
                    info(1)?,
                ),
            )
        })?;
        if self.qr == QrMethod::HouseholderOrmqr {
            // a (free now) = I; a ← H₁⋯H_d · I = Q_new column-major.
            dev.zero_on(&a, self.stream)?;
            self.launch(dev, "add_diag", d, Args::new().buf(&a).i32(n).f32(1.0))?;
            dev.context().bind_to_thread()?;
            // SAFETY: b [d, d] (the reflectors), tau [d], a [d, d], work of the queried size
            // and the info word are live device buffers on `self.stream`.
            self.timed(4, || unsafe {
                check(
                    "cusolverDnSormqr",
                    cs::cusolverDnSormqr(
                        self.handle,
                        cs::cublasSideMode_t::CUBLAS_SIDE_LEFT,
                        cs::cublasOperation_t::CUBLAS_OP_N,
                        n,
                        n,
                        n,
                        b.ptr() as *const f32,
                        n,
                        self.tau.ptr() as *const f32,
                        a.ptr() as *mut f32,
                        n,
                        self.work.ptr() as *mut f32,
                        self.work.len() as i32,
                        info(2)?,
                    ),
                )
            })?;
            self.launch(
                dev,
                "gather_cols_transpose",
                dd,
                Args::new().buf(&a).opt(None).buf(&q).i32(n).i32(n),
            )?;
            return self.count_nonfinite(dev, &[&q], st, 3);
        }
        // SAFETY: as above.
        self.timed(4, || unsafe {
            check(
                "cusolverDnSorgqr",
                cs::cusolverDnSorgqr(
                    self.handle,
                    n,
                    n,
                    n,
                    b.ptr() as *mut f32,
                    n,
                    self.tau.ptr() as *const f32,
                    self.work.ptr() as *mut f32,
                    self.work.len() as i32,
                    info(2)?,
                ),
            )
        })?;
        // q = Q_new row-major (the transpose of b's row-major view).
        self.launch(
            dev,
            "gather_cols_transpose",
            dd,
            Args::new().buf(&b).opt(None).buf(&q).i32(n).i32(n),
        )?;
        self.count_nonfinite(dev, &[&q], st, 3)
    }
}

impl GpuRefresher {
    /// The 3xTF32 operand splits when the method is [`QrMethod::RayleighCholeskyTc`].
    fn tc_split(&self) -> Option<&[Buf; 4]> {
        if self.qr != QrMethod::RayleighCholeskyTc {
            return None;
        }
        self.rc_work.as_ref().and_then(|w| w.split.as_ref())
    }

    /// `out = op(A)·op(B)` (`[d, d]` f32 row-major) on this refresher's stream: plain SGEMM,
    /// or [`gemm_3xtf32`] under [`QrMethod::RayleighCholeskyTc`].
    #[allow(clippy::too_many_arguments)]
    fn gemm_sq(
        &self,
        dev: &Device,
        d: usize,
        a: &Buf,
        trans_a: bool,
        b: &Buf,
        trans_b: bool,
        out: &Buf,
    ) -> Result<()> {
        let sq = Dims::new(d, d);
        self.timed(1, || match self.tc_split() {
            Some(split) => gemm_3xtf32(
                dev,
                self.stream,
                a,
                sq,
                b,
                sq,
                out,
                trans_a,
                trans_b,
                1.0,
                0.0,
                split,
            ),
            None => gemm_f32_with(
                dev,
                self.stream,
                GemmMath::Fp32,
                a,
                sq,
                b,
                sq,
                out,
                trans_a,
                trans_b,
                1.0,
                0.0,
            ),
        })
    }

    /// The Rayleigh–Cholesky QR (see [`QrMethod::RayleighCholesky`] and
    /// [`QrMethod::RayleighCholeskyTc`]) of `A = (F Q_old)[:, idx]` (`fq` = `F Q_old`, f32
    /// row-major) into `q` (f32 row-major `[d, d]`); `Ok(false)` when it must be redone by
    /// Householder. Uses the refresher's `b` (`Q_p`) and its f32 work buffers, and `q` as
    /// scratch; `fq` is left as it is for that fallback. Status word 5 collects the `Spotrf`
    /// infos (the first non-zero), word 6 the bits of the second pass's `max|R₂ − I|` (or,
    /// under the tensor-core variant, first `max|MᵀM − I|`), word 7 is scratch. Blocks the
    /// calling thread to read them: once, and under the tensor-core variant once more when the
    /// second CholeskyQR pass runs.
    #[allow(clippy::too_many_arguments)]
    fn rayleigh_cholesky_qr(
        &self,
        dev: &Device,
        d: usize,
        basis: &Buf,
        fq: &Buf,
        idx: &Buf,
        q: &Buf,
        st: &Buf,
    ) -> Result<bool> {
        let work = self.rc_work.as_ref().ok_or_else(|| CudaError::Invalid {
            op: "rayleigh_cholesky_qr",
            what: "work buffers not allocated (set_qr_method)".into(),
        })?;
        let tc = self.tc_split().is_some();
        let dd = d * d;
        let n = d as i32;
        let (x, g) = (work.x.slice(0, dd)?, work.g.slice(0, dd)?);
        let qp = self.b.slice(0, dd)?;
        // Q_p = Q_old[:, idx] into b; A_p = (F Q_old)[:, idx] into q (overwritten last).
        self.launch(
            dev,
            "permute_cols",
            dd,
            Args::new().buf(basis).buf(idx).buf(&qp).i32(n).i32(n),
        )?;
        self.launch(
            dev,
            "permute_cols",
            dd,
            Args::new().buf(fq).buf(idx).buf(q).i32(n).i32(n),
        )?;
        // g = B = Q_pᵀ A_p (row-major; symmetric up to rounding, so also its column-major
        // view), shifted.
        self.gemm_sq(dev, d, &qp, true, q, false, &g)?;
        dev.context().bind_to_thread()?;
        self.timed(0, || {
            dev.launch_on(
                self.stream,
                "add_diag_rel",
                (1, 1, 1),
                (256, 1, 1),
                Args::new().buf(&g).i32(n).f32(RC_SHIFT),
            )
        })?;
        let (info_all, info_pass) = (st.slice(5, 1)?, st.slice(7, 1)?);
        let potrf = |info: &Buf| -> Result<()> {
            if let Some(x) = &self.xpotrf {
                // SAFETY: g [d, d] f32, the device workspace (sized for the largest side), the
                // host workspace and the info word are live; the handle is on `self.stream`.
                return self.timed(3, || unsafe {
                    check(
                        "cusolverDnXpotrf",
                        cs::cusolverDnXpotrf(
                            self.handle,
                            x.params,
                            self.fill,
                            d as i64,
                            cs::cudaDataType::CUDA_R_32F,
                            g.ptr() as *mut std::ffi::c_void,
                            d as i64,
                            cs::cudaDataType::CUDA_R_32F,
                            x.work.ptr() as *mut std::ffi::c_void,
                            x.work.len() * 4,
                            (*x.host.get()).as_mut_ptr() as *mut std::ffi::c_void,
                            (*x.host.get()).len(),
                            info.ptr() as *mut i32,
                        ),
                    )
                });
            }
            // SAFETY: g [d, d] f32, the f32 workspace (sized for either fill's Spotrf of the
            // largest side in `lwork`) and the info word are live device buffers on `self.stream`.
            self.timed(3, || unsafe {
                check(
                    "cusolverDnSpotrf",
                    cs::cusolverDnSpotrf(
                        self.handle,
                        self.fill,
                        n,
                        g.ptr() as *mut f32,
                        n,
                        self.work.ptr() as *mut f32,
                        self.work.len() as i32,
                        info.ptr() as *mut i32,
                    ),
                )
            })
        };
        // B + sI = C Cᵀ, C lower: with the upper fill g holds U = Cᵀ column-major, i.e. C
        // row-major, and x = L = C diag(C)⁻¹ is written row-major; with the lower fill g holds
        // C column-major and x is L column-major (the kernel's `col` flag: the same formula on
        // the transposed index, so both read and write coalesced).
        let lower = self.fill == cs::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER;
        potrf(&info_all)?;
        self.launch(
            dev,
            "unit_lower_from_chol",
            dd,
            Args::new().buf(&g).buf(&x).i32(n).i32(lower as i32),
        )?;
        // CholeskyQR2, the first pass on L, the second on the product with Q_p (so Q_p's own
        // rounding away from orthonormality is corrected at every refresh instead of carried
        // into the next basis). Both passes: G = XᵀX, its Cholesky factorisation G = RᵀR
        // (upper fill: R in g's upper triangle; lower fill: Rᵀ in its lower one), X ← X R⁻¹.
        let h = dev.cublas_handle_on(self.stream);
        let (one, zero) = (1.0f32, 0.0f32);
        // `m` column-major [d, d]; `transposed`: the buffer holds Xᵀ column-major (X
        // row-major), so G = X Xᵀ of the buffer and X R⁻¹ is R⁻ᵀ applied from the left.
        let (cb_fill, t_op, n_op) = if lower {
            (
                cbsys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
                cbsys::cublasOperation_t::CUBLAS_OP_N,
                cbsys::cublasOperation_t::CUBLAS_OP_T,
            )
        } else {
            (
                cbsys::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
                cbsys::cublasOperation_t::CUBLAS_OP_T,
                cbsys::cublasOperation_t::CUBLAS_OP_N,
            )
        };
        let pass = |m: &Buf, transposed: bool, last: bool| -> Result<()> {
            // Transposed: Xᵀ ← R⁻ᵀ Xᵀ from the left (lower fill: R⁻ᵀ = (Rᵀ)⁻¹, op N on the
            // stored Rᵀ); otherwise X ← X R⁻¹ from the right (lower fill: op T on Rᵀ).
            let (op, side, trsm_op) = if transposed {
                (
                    cbsys::cublasOperation_t::CUBLAS_OP_N,
                    cbsys::cublasSideMode_t::CUBLAS_SIDE_LEFT,
                    t_op,
                )
            } else {
                (
                    cbsys::cublasOperation_t::CUBLAS_OP_T,
                    cbsys::cublasSideMode_t::CUBLAS_SIDE_RIGHT,
                    n_op,
                )
            };
            if tc {
                // The full symmetric G from the row-major view (Y = Xᵀ when not transposed):
                // G = XᵀX = Y Yᵀ, or XᵀX of the row-major X.
                self.gemm_sq(dev, d, m, transposed, m, !transposed, &g)?;
            } else {
                self.timed(1, || {
                    dev.context().bind_to_thread()?;
                    // SAFETY: m and g are live [d, d] f32 device buffers; alpha/beta are host
                    // scalars (the handle's default pointer mode); the handle is on this
                    // stream.
                    unsafe {
                        cbsys::cublasSsyrk_v2(
                            h,
                            cb_fill,
                            op,
                            n,
                            n,
                            &one,
                            m.ptr() as *const f32,
                            n,
                            &zero,
                            g.ptr() as *mut f32,
                            n,
                        )
                    }
                    .result()
                    .map_err(crate::error::cublas("ssyrk"))
                })?;
            }
            potrf(&info_pass)?;
            self.launch(
                dev,
                "first_nonzero_info",
                1,
                Args::new().buf(&info_pass).buf(&info_all),
            )?;
            if last {
                self.launch(
                    dev,
                    "upper_identity_error_bits_f32",
                    dd,
                    Args::new()
                        .buf(&g)
                        .i32(n)
                        .buf(&st.slice(6, 1)?)
                        .i32(lower as i32),
                )?;
            }
            self.timed(4, || {
                dev.context().bind_to_thread()?;
                // SAFETY: g and m are live [d, d] f32 device buffers; alpha is a host scalar;
                // the handle is bound to `self.stream`.
                unsafe {
                    cbsys::cublasStrsm_v2(
                        h,
                        side,
                        cb_fill,
                        trsm_op,
                        cbsys::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
                        n,
                        n,
                        &one,
                        g.ptr() as *const f32,
                        n,
                        m.ptr() as *mut f32,
                        n,
                    )
                }
                .result()
                .map_err(crate::error::cublas("strsm"))
            })
        };
        // Words 5 (first non-zero potrf info) and 6 (an f32 as bits: NaN stays NaN, and every
        // comparison with it fails).
        let read = |st: &Buf| -> Result<(i32, f32)> {
            let w = dev.download_on::<i32>(&st.slice(5, 2)?, self.stream)?;
            Ok((w[0], f32::from_bits(w[1] as u32)))
        };
        // x = W₁ = L R₁⁻¹ (row-major; lower fill: column-major).
        pass(&x, !lower, false)?;
        // q = M = Q_p · W₁ (row-major).
        self.gemm_sq(dev, d, &qp, false, &x, lower, q)?;
        if tc {
            // g = MᵀM; word 6 = ‖MᵀM − I‖_F² (f32 bits); g ← E = (I − MᵀM)/2.
            self.gemm_sq(dev, d, q, true, q, false, &g)?;
            self.launch(
                dev,
                "newton_schulz_poly",
                dd,
                Args::new().buf(&g).i32(n).buf(&st.slice(6, 1)?),
            )?;
            let (info, fro2) = read(st)?;
            if info != 0 {
                return Ok(false);
            }
            let (ns, p2) = self.tc_second.get();
            // NaN compares false: the second pass, then Householder.
            if fro2.sqrt() <= RC_NS_TOL {
                // Q_new = M (3I − MᵀM)/2 = M + M E: x ← M, x += M E with one TF32 GEMM
                // (‖E‖_F ≤ RC_NS_TOL/2, so TF32's 2⁻¹¹ relative error on M E adds ≲ 2.5e-6),
                // q ← x.
                self.timed(0, || dev.copy(&x, q, self.stream))?;
                let sq = Dims::new(d, d);
                self.timed(1, || {
                    gemm_f32_with(
                        dev,
                        self.stream,
                        GemmMath::Tf32,
                        q,
                        sq,
                        &g,
                        sq,
                        &x,
                        false,
                        false,
                        1.0,
                        1.0,
                    )
                })?;
                self.timed(0, || dev.copy(q, &x, self.stream))?;
                self.tc_second.set((ns + 1, p2));
                return Ok(true);
            }
            self.tc_second.set((ns, p2 + 1));
            dev.zero_on(&st.slice(6, 1)?, self.stream)?;
        }
        // q = M R₂⁻¹ = Q_new, R₂ ≈ I measured (its distance is M's orthonormality error).
        pass(q, true, true)?;
        let (info, err) = read(st)?;
        Ok(info == 0 && err <= RC_ORTHO_TOL)
    }

    /// Shifted CholeskyQR3 (see [`QrMethod::ShiftedCholeskyQr3`]) of `A = (F Q_old)[:, idx]`
    /// (`fq` = `F Q_old`, f32 row-major) into `q` (f32 row-major `[d, d]`); `Ok(false)` when it
    /// must be redone by Householder. Status word 5 collects the three `Dpotrf` infos (the
    /// first non-zero), word 6 the bits of `max|R₃ − I|`, word 7 is scratch. Blocks the
    /// calling thread once, at the end, to read them.
    fn shifted_cholesky_qr3(
        &self,
        dev: &Device,
        d: usize,
        fq: &Buf,
        idx: &Buf,
        q: &Buf,
        st: &Buf,
    ) -> Result<bool> {
        let w = self.f64_work.as_ref().ok_or_else(|| CudaError::Invalid {
            op: "shifted_cholesky_qr3",
            what: "float64 work buffers not allocated (set_qr_method)".into(),
        })?;
        let dd = d * d;
        let n = d as i32;
        let (x, g) = (w.x.slice(0, dd)?, w.g.slice(0, dd)?);
        // x = A (row-major f64), columns normalised. Row-major x is column-major Aᵀ.
        self.launch(
            dev,
            "permute_cols_f64",
            dd,
            Args::new().buf(fq).buf(idx).buf(&x).i32(n).i32(n),
        )?;
        self.launch(
            dev,
            "normalize_cols_f64",
            d,
            Args::new().buf(&x).i32(n).i32(n),
        )?;
        let (info_all, info_pass) = (st.slice(5, 1)?, st.slice(7, 1)?);
        let h = dev.cublas_handle_on(self.stream);
        let (one, zero) = (1.0f64, 0.0f64);
        // ‖A‖₂² ≤ ‖A‖_F² ≤ d (unit columns; a zero column adds nothing).
        let df = d as f64;
        let shift = 11.0 * (df * df + df * (df + 1.0)) * f64::EPSILON / 2.0 * df;
        for pass in 0..3 {
            // G = AᵀA: column-major, G = X Xᵀ with X = Aᵀ (the buffer as it is).
            self.timed(1, || {
                dev.context().bind_to_thread()?;
                // SAFETY: x and g are live [d, d] f64 device buffers; alpha/beta are host
                // scalars (the handle's default pointer mode); the handle is on this stream.
                unsafe {
                    cbsys::cublasDgemm_v2(
                        h,
                        cbsys::cublasOperation_t::CUBLAS_OP_N,
                        cbsys::cublasOperation_t::CUBLAS_OP_T,
                        n,
                        n,
                        n,
                        &one,
                        x.ptr() as *const f64,
                        n,
                        x.ptr() as *const f64,
                        n,
                        &zero,
                        g.ptr() as *mut f64,
                        n,
                    )
                }
                .result()
                .map_err(crate::error::cublas("dgemm"))
            })?;
            if pass == 0 {
                self.launch(
                    dev,
                    "add_diag_f64",
                    d,
                    Args::new().buf(&g).i32(n).f64(shift),
                )?;
            }
            let info = if pass == 0 { &info_all } else { &info_pass };
            // SAFETY: g [d, d] f64, the f64 workspace of the queried size and the info word
            // are live device buffers on `self.stream`.
            self.timed(3, || unsafe {
                check(
                    "cusolverDnDpotrf",
                    cs::cusolverDnDpotrf(
                        self.handle,
                        cs::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
                        n,
                        g.ptr() as *mut f64,
                        n,
                        w.work.ptr() as *mut f64,
                        w.work.len() as i32,
                        info.ptr() as *mut i32,
                    ),
                )
            })?;
            if pass > 0 {
                self.launch(
                    dev,
                    "first_nonzero_info",
                    1,
                    Args::new().buf(&info_pass).buf(&info_all),
                )?;
            }
            if pass == 2 {
                // max|R₃ − I| over the upper triangle.
                self.launch(
                    dev,
                    "upper_identity_error_bits",
                    dd,
                    Args::new().buf(&g).i32(n).buf(&st.slice(6, 1)?),
                )?;
            }
            // G = UᵀU, U in g's column-major upper triangle. Row-major A U⁻¹ is column-major
            // U⁻ᵀ Aᵀ: solve Uᵀ Y = X in place. (After a failed potrf the result is garbage;
            // the info word discards it below.)
            self.timed(4, || {
                // SAFETY: g and x are live [d, d] f64 device buffers; alpha is a host scalar;
                // the handle is bound to `self.stream`.
                unsafe {
                    cbsys::cublasDtrsm_v2(
                        h,
                        cbsys::cublasSideMode_t::CUBLAS_SIDE_LEFT,
                        cbsys::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
                        cbsys::cublasOperation_t::CUBLAS_OP_T,
                        cbsys::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
                        n,
                        n,
                        &one,
                        g.ptr() as *const f64,
                        n,
                        x.ptr() as *mut f64,
                        n,
                    )
                }
                .result()
                .map_err(crate::error::cublas("dtrsm"))
            })?;
        }
        self.launch(
            dev,
            "f64_to_f32",
            dd,
            Args::new().buf(&x).buf(q).i64(dd as i64),
        )?;
        let w = dev.download_on::<i32>(&st.slice(5, 2)?, self.stream)?;
        let err = f32::from_bits(w[1].max(0) as u32);
        Ok(w[0] == 0 && err <= CHOLESKY_ORTHO_TOL)
    }
}

/// Work buffers of [`apply`] on the compute stream: the basis change `C` (`[d, d]`; when
/// `d² > m·n` it holds the `[m, n]` intermediate of the two-step re-projection instead) and the
/// new moments (`[m·n]` each), sized for the largest task.
pub(crate) struct SwapWork {
    c: Buf,
    e_new: Buf,
    v_new: Buf,
}

impl SwapWork {
    /// Bytes [`SwapWork::new`] allocates.
    pub(crate) fn bytes(max_dim: usize, max_mn: usize) -> usize {
        (max_dim.max(1).pow(2) + 2 * max_mn.max(1)) * 4 + 3 * crate::memory::BUF_ALIGN
    }

    /// One device arena for the largest factor side `max_dim` and moment size `max_mn`.
    pub(crate) fn new(dev: &Device, max_dim: usize, max_mn: usize) -> Result<SwapWork> {
        let (d, mn) = (max_dim.max(1), max_mn.max(1));
        let mut arena = dev.arena("refresh-swap", crate::Tier::Device, Self::bytes(d, mn))?;
        Ok(SwapWork {
            c: arena.buf(Elem::F32, d * d)?,
            e_new: arena.buf(Elem::F32, mn)?,
            v_new: arena.buf(Elem::F32, mn)?,
        })
    }
}

/// Installs a computed refresh (the swap of the double buffer), on the compute stream: for an
/// init, `basis ← q`; else `exp_avg` re-projected into the new eigenbasis (side 0:
/// `E ← Q_newᵀ Q_old E`, side 1: `E ← E Q_oldᵀ Q_new`), `exp_avg_sq` permuted along the side by
/// `idx`, then basis and moments overwritten (`optim::refresh_apply`, up to rounding). For a
/// side `d` no longer than the other dimension `o` the basis change `C = Q_oldᵀ Q_new` is formed
/// first (`2d³ + 2d²o` flops), else the moment goes through the old and new bases one after the
/// other (`4d²o`, as the reference SOAP's project-back / project does). GEMMs run with `math`:
/// fp32, or TF32 for the optimizer of a `precision = bf16` plan. The caller has made the
/// compute stream wait for the refresh and checked its [`verdict`].
///
/// # Errors
/// Shape errors (caller bugs) and CUDA / cuBLAS call failures.
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply(
    dev: &Device,
    work: &SwapWork,
    init: bool,
    side: u8,
    q_new: &Buf,
    idx: &Buf,
    basis: &Buf,
    exp_avg: &Buf,
    exp_avg_sq: &Buf,
    m: usize,
    n: usize,
    math: GemmMath,
) -> Result<()> {
    const OP: &str = "refresh_apply";
    let d = match side {
        0 => m,
        1 => n,
        s => {
            return Err(CudaError::Invalid {
                op: OP,
                what: format!("side {s}"),
            })
        }
    };
    let (dd, mn) = (d * d, m * n);
    if dd > work.c.len() || mn > work.e_new.len() || q_new.len() < dd || idx.len() < d {
        return Err(CudaError::Invalid {
            op: OP,
            what: format!("[{m}, {n}] side {side} exceeds the swap buffers"),
        });
    }
    basis.expect(OP, "basis", Elem::F32, dd)?;
    let q_new = q_new.slice(0, dd)?;
    if init {
        return dev.copy(basis, &q_new, StreamKind::Compute);
    }
    exp_avg.expect(OP, "exp_avg", Elem::F32, mn)?;
    exp_avg_sq.expect(OP, "exp_avg_sq", Elem::F32, mn)?;
    let prev = dev.set_gemm_math(math);
    let r = (|| {
        let (e_new, v_new) = (work.e_new.slice(0, mn)?, work.v_new.slice(0, mn)?);
        let sq = Dims::new(d, d);
        let e = Dims::new(m, n);
        if d * d <= mn {
            // C = Q_oldᵀ Q_new, then one GEMM on the moment.
            let c = work.c.slice(0, dd)?;
            gemm_f32(dev, basis, sq, &q_new, sq, &c, true, false, 1.0, 0.0)?;
            if side == 0 {
                gemm_f32(dev, &c, sq, exp_avg, e, &e_new, true, false, 1.0, 0.0)?;
            } else {
                gemm_f32(dev, exp_avg, e, &c, sq, &e_new, false, false, 1.0, 0.0)?;
            }
        } else {
            // Back to the parameter's coordinates with Q_old, then into Q_new; `c` (d² > m·n
            // elements) holds the intermediate.
            let tmp = work.c.slice(0, mn)?;
            if side == 0 {
                gemm_f32(dev, basis, sq, exp_avg, e, &tmp, false, false, 1.0, 0.0)?;
                gemm_f32(dev, &q_new, sq, &tmp, e, &e_new, true, false, 1.0, 0.0)?;
            } else {
                gemm_f32(dev, exp_avg, e, basis, sq, &tmp, false, true, 1.0, 0.0)?;
                gemm_f32(dev, &tmp, e, &q_new, sq, &e_new, false, false, 1.0, 0.0)?;
            }
        }
        let kernel = if side == 0 {
            "permute_rows"
        } else {
            "permute_cols"
        };
        let idx = idx.slice(0, d)?;
        let args = Args::new()
            .buf(exp_avg_sq)
            .buf(&idx)
            .buf(&v_new)
            .i32(m as i32)
            .i32(n as i32);
        dev.launch(kernel, (dev.grid_for(mn), 1, 1), (256, 1, 1), args)?;
        dev.copy(basis, &q_new, StreamKind::Compute)?;
        dev.copy(exp_avg, &e_new, StreamKind::Compute)?;
        dev.copy(exp_avg_sq, &v_new, StreamKind::Compute)
    })();
    dev.set_gemm_math(prev);
    r
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
        // potrf / orthonormality words (CholeskyQR3 fell back) do not matter.
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
        // An all-zero factor is fine for the first basis (eigh of 1e-30·I).
        assert_eq!(verdict(true, 8, &status(&[(4, 0)])), Ok(()));
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
                call: "orgqr/ormqr",
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
    fn qr_method_names_parse() {
        assert_eq!("householder".parse(), Ok(QrMethod::Householder));
        assert_eq!("cholesky3".parse(), Ok(QrMethod::ShiftedCholeskyQr3));
        assert!("cholesky2".parse::<QrMethod>().is_err());
        assert!("cholesky".parse::<QrMethod>().is_err());
        assert_eq!("rc-tc".parse(), Ok(QrMethod::RayleighCholeskyTc));
        assert_eq!(QrMethod::default(), QrMethod::RayleighCholeskyTc);
    }
}
