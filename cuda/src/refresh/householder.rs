//! Householder QR of the power image through cuSOLVER (`Sgeqrf` + `Sorgqr`; soap.py's
//! `torch.linalg.qr`): the fallback of the Rayleigh–Cholesky QR ([`super::rayleigh`]), taken
//! when one of its Cholesky factorisations fails or its orthonormality gate trips. The same for
//! either refresh method (with or without SOAP's column permutation).
use super::{check, GpuRefresher};
use crate::device::Device;
use crate::error::Result;
use crate::kernels::Args;
use crate::memory::Buf;
use cudarc::cusolver::sys as cs;

impl GpuRefresher {
    /// `q = qr(A).Q` for `A = (F Q_old)[:, idx]` (`fq` = `F Q_old`, `[d, d]` f32 row-major;
    /// `idx` `None`: the columns in their order; `q` row-major `[d, d]`), by cuSOLVER's
    /// `Sgeqrf` + `Sorgqr` in the refresher's `b` (column-major) with their infos in status
    /// words 1 and 2. Both calls block the calling thread until their GPU work is done
    /// (cuSOLVER's own synchronisation).
    pub(super) fn householder_qr(
        &self,
        dev: &Device,
        d: usize,
        fq: &Buf,
        idx: Option<&Buf>,
        q: &Buf,
        st: &Buf,
    ) -> Result<()> {
        let dd = d * d;
        let n = d as i32;
        let b = self.b.slice(0, dd)?;
        let info = |w: usize| st.slice(w, 1).map(|s| s.ptr() as *mut i32);
        // b (column-major) = (F Q)[:, idx]; QR in place; Q_new column-major in b.
        self.launch(
            dev,
            "gather_cols_transpose",
            dd,
            Args::new().buf(fq).opt(idx).buf(&b).i32(n).i32(n),
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
            Args::new().buf(&b).opt(None).buf(q).i32(n).i32(n),
        )
    }
}
