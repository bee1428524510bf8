//! SOAP eigenbasis refreshes on the GPU (plan host task `EigenbasisRefresh`, reference
//! `soap.py` `get_orthogonal_matrix` / `get_orthogonal_matrix_QR`), through cuSOLVER
//! (`Ssyevd` for the first basis, `Sgeqrf` + `Sorgqr` for the power iteration + QR after) and
//! the helper kernels of family `refresh`. The semantics are those of
//! `optim::eigenbasis_refresh`, step for step:
//!
//! - init (end of step 1): `Q ← eigvecs(F + 1e-30·I)`, columns in descending eigenvalue order;
//! - QR refresh: `est = diag(Qᵀ F Q)` (f64), `idx = argsort(est)` descending (stable, on the
//!   host: `d` numbers), `exp_avg_sq` permuted along the side by `idx`,
//!   `Q_new = qr(F Q[:, idx]).Q`, `exp_avg` re-projected with `C = Q_oldᵀ Q_new`
//!   (side 0: `E ← Cᵀ E`, side 1: `E ← E C`).
//!
//! Everything is computed into work buffers first and copied over the state only when the
//! result is finite, so a numerical failure (non-finite factor, solver `info ≠ 0`, non-finite
//! basis) leaves basis and moments untouched. cuSOLVER is column-major; a symmetric factor is
//! its own transpose, and `Q_oldᵀ F` computed row-major is `F Q_old` column-major, which is what
//! the QR needs. Work runs on the compute stream (synchronous refreshes; the side stream and
//! staleness are later work).
use crate::device::{Device, GemmMath};
use crate::error::{CudaError, Result};
use crate::gemm::{gemm_f32, Dims};
use crate::kernels::Args;
use crate::memory::{Arena, Buf, Elem};
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
    /// The new basis or the basis change is non-finite.
    #[error("the new basis is non-finite; basis kept")]
    BadBasis,
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

/// A cuSOLVER dense handle bound to the compute stream, with work buffers sized for factors
/// up to `max_dim` and moments up to `max_mn` elements.
pub(crate) struct GpuRefresher {
    handle: cs::cusolverDnHandle_t,
    a: Buf,
    b: Buf,
    c: Buf,
    w: Buf,
    tau: Buf,
    est: Buf,
    idx: Buf,
    info: Buf,
    work: Buf,
    e_new: Buf,
    v_new: Buf,
    max_dim: usize,
}

impl Drop for GpuRefresher {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { cs::cusolverDnDestroy(self.handle) };
    }
}

/// Elements (f32) of the work buffers [`GpuRefresher::new`] carves, before cuSOLVER's own
/// workspace: 3 `d×d` matrices, eigenvalues, tau, f64 estimates, indices, info, 2 moments.
pub(crate) fn refresh_work_bytes(max_dim: usize, max_mn: usize) -> usize {
    let d = max_dim.max(1);
    (3 * d * d + 2 * d + 2 * d + d + 2 + 2 * max_mn.max(1)) * 4 + 12 * crate::memory::BUF_ALIGN
}

impl GpuRefresher {
    /// Creates the handle (bound to the compute stream) and allocates the work buffers (one
    /// device arena of [`refresh_work_bytes`]) and cuSOLVER's workspace (a second arena, its
    /// size queried here). Returns the refresher and the bytes it allocated.
    pub(crate) fn new(
        dev: &Device,
        max_dim: usize,
        max_mn: usize,
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
                cs::cusolverDnSetStream(
                    handle,
                    dev.stream(crate::StreamKind::Compute).cu_stream() as cs::cudaStream_t,
                ),
            )?;
        }
        let bytes = refresh_work_bytes(d, max_mn);
        let mut arena: Arena = dev.arena("refresh", crate::Tier::Device, bytes)?;
        let a = arena.buf(Elem::F32, d * d)?;
        let b = arena.buf(Elem::F32, d * d)?;
        let c = arena.buf(Elem::F32, d * d)?;
        let w = arena.buf(Elem::F32, d)?;
        let tau = arena.buf(Elem::F32, d)?;
        let est = arena.buf(Elem::F64, d)?;
        let idx = arena.buf(Elem::I32, d)?;
        let info = arena.buf(Elem::I32, 2)?;
        let e_new = arena.buf(Elem::F32, max_mn.max(1))?;
        let v_new = arena.buf(Elem::F32, max_mn.max(1))?;
        let lwork = Self::lwork(handle, &a, &w, &tau, d)?;
        let mut ws = dev.arena("cusolver-workspace", crate::Tier::Device, lwork * 4)?;
        let work = ws.buf(Elem::F32, lwork)?;
        Ok((
            GpuRefresher {
                handle,
                a,
                b,
                c,
                w,
                tau,
                est,
                idx,
                info,
                work,
                e_new,
                v_new,
                max_dim: d,
            },
            bytes + lwork * 4,
        ))
    }

    /// The largest workspace (f32 elements) syevd, geqrf and orgqr need at side length `d`.
    fn lwork(h: cs::cusolverDnHandle_t, a: &Buf, w: &Buf, tau: &Buf, d: usize) -> Result<usize> {
        let n = d as i32;
        let (mut l1, mut l2, mut l3) = (0i32, 0i32, 0i32);
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
        }
        Ok(l1.max(l2).max(l3).max(1) as usize)
    }

    /// Counts NaN/Inf in `bufs` (one sync).
    fn nonfinite(&self, dev: &Device, bufs: &[&Buf]) -> Result<usize> {
        let count = self.info.slice(1, 1)?;
        dev.zero(&count)?;
        for b in bufs {
            let n = b.len();
            let args = Args::new().buf(b).i64(n as i64).buf(&count);
            dev.launch(
                "count_nonfinite",
                (dev.grid_for(n), 1, 1),
                (256, 1, 1),
                args,
            )?;
        }
        Ok(dev.download::<i32>(&count)?[0].max(0) as usize)
    }

    fn info_value(&self, dev: &Device) -> Result<i32> {
        Ok(dev.download::<i32>(&self.info.slice(0, 1)?)?[0])
    }

    /// One refresh of `basis` (`[d, d]`, d = m for side 0, n for side 1) from `factor`, with
    /// the moments `[m, n]`. `init` = the first (eigh) basis, else power iteration + QR.
    /// `Ok(Err(_))` is a numerical failure with the state untouched.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn refresh(
        &self,
        dev: &Device,
        init: bool,
        side: u8,
        factor: &Buf,
        basis: &Buf,
        exp_avg: &Buf,
        exp_avg_sq: &Buf,
        m: usize,
        n: usize,
    ) -> Result<std::result::Result<(), RefreshFailure>> {
        const OP: &str = "eigenbasis_refresh";
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
        if d == 0 {
            return Ok(Ok(()));
        }
        if d > self.max_dim || m * n > self.e_new.len() {
            return Err(CudaError::Invalid {
                op: OP,
                what: format!(
                    "[{m}, {n}] side {side} exceeds the work buffers (max dim {})",
                    self.max_dim
                ),
            });
        }
        factor.expect(OP, "factor", Elem::F32, d * d)?;
        basis.expect(OP, "basis", Elem::F32, d * d)?;
        exp_avg.expect(OP, "exp_avg", Elem::F32, m * n)?;
        exp_avg_sq.expect(OP, "exp_avg_sq", Elem::F32, m * n)?;
        let prev = dev.set_gemm_math(GemmMath::Fp32);
        let r = if init {
            self.init(dev, d, factor, basis)
        } else {
            self.qr(dev, d, side, factor, basis, exp_avg, exp_avg_sq, m, n)
        };
        dev.set_gemm_math(prev);
        r
    }

    fn init(
        &self,
        dev: &Device,
        d: usize,
        factor: &Buf,
        basis: &Buf,
    ) -> Result<std::result::Result<(), RefreshFailure>> {
        let count = self.nonfinite(dev, &[factor])?;
        if count > 0 {
            return Ok(Err(RefreshFailure::NonFinite { dim: d, count }));
        }
        let dd = d * d;
        let (a, b) = (self.a.slice(0, dd)?, self.b.slice(0, dd)?);
        dev.copy(&a, factor, crate::StreamKind::Compute)?;
        let args = Args::new().buf(&a).i32(d as i32).f32(1e-30);
        dev.launch("add_diag", (dev.grid_for(d), 1, 1), (256, 1, 1), args)?;
        let n = d as i32;
        dev.context().bind_to_thread()?;
        // SAFETY: a [d, d], w [d], work of the queried size and info are live device buffers;
        // the handle runs on the compute stream after the copies above.
        unsafe {
            check(
                "cusolverDnSsyevd",
                cs::cusolverDnSsyevd(
                    self.handle,
                    cs::cusolverEigMode_t::CUSOLVER_EIG_MODE_VECTOR,
                    cs::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
                    n,
                    a.ptr() as *mut f32,
                    n,
                    self.w.ptr() as *mut f32,
                    self.work.ptr() as *mut f32,
                    self.work.len() as i32,
                    self.info.ptr() as *mut i32,
                ),
            )?;
        }
        let info = self.info_value(dev)?;
        if info != 0 {
            return Ok(Err(RefreshFailure::Solver {
                call: "syevd",
                info,
            }));
        }
        let args = Args::new().buf(&a).buf(&b).i32(n);
        dev.launch(
            "eigvecs_descending",
            (dev.grid_for(dd), 1, 1),
            (256, 1, 1),
            args,
        )?;
        if self.nonfinite(dev, &[&b])? > 0 {
            return Ok(Err(RefreshFailure::BadBasis));
        }
        dev.copy(basis, &b, crate::StreamKind::Compute)?;
        Ok(Ok(()))
    }

    #[allow(clippy::too_many_arguments)]
    fn qr(
        &self,
        dev: &Device,
        d: usize,
        side: u8,
        factor: &Buf,
        basis: &Buf,
        exp_avg: &Buf,
        exp_avg_sq: &Buf,
        m: usize,
        n: usize,
    ) -> Result<std::result::Result<(), RefreshFailure>> {
        let count = self.nonfinite(dev, &[factor, basis])?;
        if count > 0 {
            return Ok(Err(RefreshFailure::NonFinite { dim: d, count }));
        }
        let dd = d * d;
        let (a, b, c) = (
            self.a.slice(0, dd)?,
            self.b.slice(0, dd)?,
            self.c.slice(0, dd)?,
        );
        let sq = Dims::new(d, d);
        // a = F · Q_old; est_j = Σ_i Q[i, j] · a[i, j].
        gemm_f32(dev, factor, sq, basis, sq, &a, false, false, 1.0, 0.0)?;
        let est = self.est.slice(0, d)?;
        let args = Args::new().buf(basis).buf(&a).buf(&est).i32(d as i32);
        dev.launch("column_dots", (dev.grid_for(d), 1, 1), (256, 1, 1), args)?;
        let est_h = dev.download::<f64>(&est)?;
        let mut order: Vec<usize> = (0..d).collect();
        order.sort_by(|&x, &y| est_h[y].total_cmp(&est_h[x]));
        let idx_h: Vec<i32> = order.iter().map(|&i| i as i32).collect();
        let idx = self.idx.slice(0, d)?;
        dev.upload(&idx, &idx_h)?;
        // b (column-major) = (F Q)[:, idx]; QR in place; Q_new column-major in b.
        let args = Args::new()
            .buf(&a)
            .buf(&idx)
            .buf(&b)
            .i32(d as i32)
            .i32(d as i32);
        dev.launch(
            "gather_cols_transpose",
            (dev.grid_for(dd), 1, 1),
            (256, 1, 1),
            args,
        )?;
        let nn = d as i32;
        dev.context().bind_to_thread()?;
        // SAFETY: b [d, d], tau [d], work of the queried size, info: live device buffers on
        // the compute stream.
        unsafe {
            check(
                "cusolverDnSgeqrf",
                cs::cusolverDnSgeqrf(
                    self.handle,
                    nn,
                    nn,
                    b.ptr() as *mut f32,
                    nn,
                    self.tau.ptr() as *mut f32,
                    self.work.ptr() as *mut f32,
                    self.work.len() as i32,
                    self.info.ptr() as *mut i32,
                ),
            )?;
        }
        let info = self.info_value(dev)?;
        if info != 0 {
            return Ok(Err(RefreshFailure::Solver {
                call: "geqrf",
                info,
            }));
        }
        // SAFETY: as above.
        unsafe {
            check(
                "cusolverDnSorgqr",
                cs::cusolverDnSorgqr(
                    self.handle,
                    nn,
                    nn,
                    nn,
                    b.ptr() as *mut f32,
                    nn,
                    self.tau.ptr() as *const f32,
                    self.work.ptr() as *mut f32,
                    self.work.len() as i32,
                    self.info.ptr() as *mut i32,
                ),
            )?;
        }
        let info = self.info_value(dev)?;
        if info != 0 {
            return Ok(Err(RefreshFailure::Solver {
                call: "orgqr",
                info,
            }));
        }
        // c = Q_new row-major (the transpose of b's row-major view).
        let args = Args::new()
            .buf(&b)
            .opt(None)
            .buf(&c)
            .i32(d as i32)
            .i32(d as i32);
        dev.launch(
            "gather_cols_transpose",
            (dev.grid_for(dd), 1, 1),
            (256, 1, 1),
            args,
        )?;
        // a = C = Q_oldᵀ Q_new; exp_avg re-projected into e_new.
        gemm_f32(dev, basis, sq, &c, sq, &a, true, false, 1.0, 0.0)?;
        let mn = m * n;
        let (e_new, v_new) = (self.e_new.slice(0, mn)?, self.v_new.slice(0, mn)?);
        let e = Dims::new(m, n);
        if side == 0 {
            gemm_f32(dev, &a, sq, exp_avg, e, &e_new, true, false, 1.0, 0.0)?;
        } else {
            gemm_f32(dev, exp_avg, e, &a, sq, &e_new, false, false, 1.0, 0.0)?;
        }
        if self.nonfinite(dev, &[&c, &a])? > 0 {
            return Ok(Err(RefreshFailure::BadBasis));
        }
        let kernel = if side == 0 {
            "permute_rows"
        } else {
            "permute_cols"
        };
        let args = Args::new()
            .buf(exp_avg_sq)
            .buf(&idx)
            .buf(&v_new)
            .i32(m as i32)
            .i32(n as i32);
        dev.launch(kernel, (dev.grid_for(mn), 1, 1), (256, 1, 1), args)?;
        dev.copy(basis, &c, crate::StreamKind::Compute)?;
        dev.copy(exp_avg, &e_new, crate::StreamKind::Compute)?;
        dev.copy(exp_avg_sq, &v_new, crate::StreamKind::Compute)?;
        Ok(Ok(()))
    }
}
