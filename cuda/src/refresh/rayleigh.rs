//! The Rayleigh–Cholesky QR of the power image on the tensor cores: the QR refreshes'
//! orthonormalisation, with cuSOLVER's Householder QR ([`super::householder`]) as its fallback.
//!
//! `Q_p = Q_old[:, idx]` is orthonormal, so with `B = Q_pᵀ F Q_p` (symmetric positive
//! semidefinite) `F Q_p = Q_p B`, and with the Cholesky factorisation `B + s·I = C Cᵀ` (C
//! lower, `s` = [`RC_SHIFT`] of `max diag B`) `F Q_p ≈ Q_p C Cᵀ` with `Cᵀ` upper triangular,
//! hence `qr(F Q_p).Q = Q_p · qr(L).Q` for the unit lower-triangular `L = C diag(C)⁻¹`. The
//! ill-conditioning of the power image (that of `F`, where fp32 CholeskyQR2 of `F Q_p` itself
//! fails) sits in `diag C` and `Cᵀ`; `L`'s entries are the rotation of the old basis toward the
//! new one scaled by eigenvalue ratios ≤ 1 (the columns are sorted), so `L` is well
//! conditioned and CholeskyQR is accurate on it:
//!
//! 1. one CholeskyQR pass on `L` (`G = LᵀL`, cuSOLVER `Spotrf`, cuBLAS `Strsm`) gives `W₁`;
//! 2. `M = Q_p W₁` is read once: when `‖MᵀM − I‖_F ≤` [`RC_NS_TOL`], one Newton–Schulz step
//!    `M (3I − MᵀM)/2` (two GEMMs) finishes it — orthonormality error ≤ ¾·e² + fp32 rounding,
//!    a change of `O(e)` to the basis; above that tolerance a second CholeskyQR pass runs on
//!    `M`. Either way the second step works on `M`, not on `W₁` alone, so `Q_p`'s own rounding
//!    away from orthonormality is corrected at every refresh instead of carried into the next
//!    basis.
//!
//! Every GEMM (`F Q_old`, `B`, the Gram matrices, `Q_p W₁`) is [`gemm_3xtf32`]: fp32
//! accuracy from three TF32 tensor-core GEMMs. Work, all `[d, d]`: the power product and four
//! to six more GEMMs, two or three Cholesky factorisations (lower fill, cuSOLVER's fastest
//! `Spotrf` path) and one or two triangular solves, instead of Householder's latency-bound
//! panels: 8.1 ms per refresh at d = 3072 (H200, BENCHMARKS.md). The shift changes only
//! directions whose eigenvalues are below ~`s·max λ`, where the fp32 Householder QR of `F Q_p`
//! is rounding noise too. Checked on the device: when a Cholesky factorisation fails (an
//! indefinite factor) or the second CholeskyQR pass's `R` is further than [`RC_ORTHO_TOL`] from
//! the identity, the refresh is redone with Householder QR.
use super::{check, GpuRefresher};
use crate::device::{Device, GemmMath};
use crate::error::Result;
use crate::gemm::{gemm_f32_with, Dims};
use crate::kernels::Args;
use crate::memory::{Arena, Buf, Elem};
use crate::StreamKind;
use cudarc::cublas::sys as cbsys;
use cudarc::cusolver::sys as cs;

/// Largest `‖MᵀM − I‖_F` of `M = Q_p W₁` (after the first CholeskyQR pass) that one
/// Newton–Schulz step finishes: it leaves `‖QᵀQ − I‖₂ ≤ ¾‖MᵀM − I‖₂² + rounding ≤ ¾·1e-4 +
/// rounding`; above it the second CholeskyQR pass runs. The Frobenius norm bounds the spectral
/// norm the step's error depends on; the largest entry would not (it can be `d` times smaller).
pub const RC_NS_TOL: f32 = 1e-2;

/// Relative diagonal shift of `B = Q_pᵀ F Q_p`: its Cholesky factorisation is of
/// `B + s·max(diag B)·I`, positive definite in fp32 when `F`'s small eigenvalues round to zero
/// or below; an `F` that is still not (an indefinite factor) goes to Householder.
pub const RC_SHIFT: f32 = 1e-6;

/// Largest `max|R₂ − I|` of the second CholeskyQR pass (about half the orthonormality error of
/// `M = Q_p W₁`) before the refresh is redone by Householder: below it, the second pass leaves
/// the new basis orthonormal to fp32 rounding (CholeskyQR2's bound, Yamamoto et al. 2015, needs
/// the first pass's output to be well-conditioned, not exact).
pub const RC_ORTHO_TOL: f32 = 0.05;

/// The Rayleigh–Cholesky QR's f32 work, `[d, d]` each: `x` (`L`, then `W₁`), `g` (`B`, the Gram
/// matrices and their Cholesky factors) and the four 3xTF32 operand splits ([`gemm_3xtf32`]).
pub(super) struct RcWork {
    x: Buf,
    g: Buf,
    split: [Buf; 4],
}

impl RcWork {
    /// Carves the buffers for factors up to `d` from `arena` (counted in
    /// [`super::refresh_work_bytes`]).
    pub(super) fn carve(arena: &mut Arena, d: usize) -> Result<RcWork> {
        let dd = d * d;
        Ok(RcWork {
            x: arena.buf(Elem::F32, dd)?,
            g: arena.buf(Elem::F32, dd)?,
            split: [
                arena.buf(Elem::F32, dd)?,
                arena.buf(Elem::F32, dd)?,
                arena.buf(Elem::F32, dd)?,
                arena.buf(Elem::F32, dd)?,
            ],
        })
    }
}

/// `out ← α·op(A)·op(B) + β·out` for fp32 row-major operands (as [`gemm_f32_with`]), to about
/// fp32 accuracy on the TF32 tensor cores ("3xTF32"; Ootomo & Yokota, "Recovering single
/// precision accuracy from Tensor Cores while surpassing the FP32 theoretical peak
/// performance", IJHPCA 2022; CUTLASS's `OpMultiplyAddFastF32`): each operand is split on the
/// device into `hi = tf32(x)` (round to nearest) and `lo = x − hi`, and
/// `A·B ≈ lo_A·hi_B + hi_A·lo_B + hi_A·hi_B` by three cuBLAS GEMMs with
/// `CUBLAS_COMPUTE_32F_FAST_TF32` (`lo_A·lo_B`, ~2⁻²² of the product, is dropped). Relative
/// error ~1e-6 of `|A|·|B|` instead of TF32's ~1e-3, at three TF32 GEMMs' cost.
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

impl GpuRefresher {
    /// `out = op(A)·op(B)` (`[d, d]` f32 row-major) by [`gemm_3xtf32`] on this refresher's
    /// stream, timed as a GEMM phase.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_sq(
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
        self.timed(1, || {
            gemm_3xtf32(
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
                &self.rc.split,
            )
        })
    }

    /// `Spotrf` (lower fill) of the column-major `[d, d]` f32 `g` in place, its info into the
    /// status word `info`.
    fn potrf_lower(&self, d: usize, g: &Buf, info: &Buf) -> Result<()> {
        let n = d as i32;
        // SAFETY: g [d, d] f32, the f32 workspace (sized for the lower-fill Spotrf of the
        // largest side) and the info word are live device buffers on `self.stream`.
        self.timed(3, || unsafe {
            check(
                "cusolverDnSpotrf",
                cs::cusolverDnSpotrf(
                    self.handle,
                    cs::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
                    n,
                    g.ptr() as *mut f32,
                    n,
                    self.work.ptr() as *mut f32,
                    self.work.len() as i32,
                    info.ptr() as *mut i32,
                ),
            )
        })
    }

    /// The Rayleigh–Cholesky QR (see the module docs) of `A = (F Q_old)[:, idx]` (`fq` =
    /// `F Q_old`, f32 row-major; `idx` `None`: the columns in their order, `RefreshMethod::Qr`)
    /// into `q` (f32 row-major `[d, d]`); `Ok(false)` when it must be redone by Householder.
    /// Uses the refresher's `b` (`Q_p`, when permuted) and its [`RcWork`], and `q` as scratch;
    /// `fq` is left as it is for that fallback. Unsorted columns can make `L` ill-conditioned
    /// (a later column with a larger eigenvalue than an earlier one); the same gates then hand
    /// the refresh to Householder. Status word 5 collects the `Spotrf` infos (the first
    /// non-zero), word 6 the bits of first `‖MᵀM − I‖_F²`, then of the second pass's
    /// `max|R₂ − I|`; word 7 is scratch. Blocks the calling thread to read them: once, and once
    /// more when the second CholeskyQR pass runs.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rayleigh_cholesky_qr(
        &self,
        dev: &Device,
        d: usize,
        basis: &Buf,
        fq: &Buf,
        idx: Option<&Buf>,
        q: &Buf,
        st: &Buf,
    ) -> Result<bool> {
        let dd = d * d;
        let n = d as i32;
        let (x, g) = (self.rc.x.slice(0, dd)?, self.rc.g.slice(0, dd)?);
        let (qp, ap) = match idx {
            Some(idx) => {
                // Q_p = Q_old[:, idx] into b; A_p = (F Q_old)[:, idx] into q (overwritten last).
                let qp = self.b.slice(0, dd)?;
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
                (qp, q.clone())
            }
            // The columns in their order: Q_p = Q_old and A_p = F Q_old themselves (only read).
            None => (basis.slice(0, dd)?, fq.slice(0, dd)?),
        };
        // g = B = Q_pᵀ A_p (row-major; symmetric up to rounding, so also its column-major
        // view), shifted.
        self.gemm_sq(dev, d, &qp, true, &ap, false, &g)?;
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
        // B + sI = C Cᵀ: g holds C column-major (lower triangle), and x = L = C diag(C)⁻¹ is
        // written column-major.
        self.potrf_lower(d, &g, &info_all)?;
        self.launch(
            dev,
            "unit_lower_from_chol",
            dd,
            Args::new().buf(&g).buf(&x).i32(n),
        )?;
        let h = dev.cublas_handle_on(self.stream);
        let one = 1.0f32;
        // One CholeskyQR pass on the column-major `[d, d]` buffer `m`: G = XᵀX, its Cholesky
        // factorisation G = RᵀR (Rᵀ in g's lower triangle), X ← X R⁻¹. `transposed`: the
        // buffer holds Xᵀ column-major (X row-major), so X R⁻¹ is R⁻ᵀ applied from the left
        // (op N on the stored Rᵀ); otherwise from the right (op T on it). `last`: word 6 gets
        // `max|R − I|`.
        let pass = |m: &Buf, transposed: bool, last: bool| -> Result<()> {
            let (side, trsm_op) = if transposed {
                (
                    cbsys::cublasSideMode_t::CUBLAS_SIDE_LEFT,
                    cbsys::cublasOperation_t::CUBLAS_OP_N,
                )
            } else {
                (
                    cbsys::cublasSideMode_t::CUBLAS_SIDE_RIGHT,
                    cbsys::cublasOperation_t::CUBLAS_OP_T,
                )
            };
            // The full symmetric G from the row-major view (Y = Xᵀ when not transposed):
            // G = XᵀX = Y Yᵀ, or XᵀX of the row-major X.
            self.gemm_sq(dev, d, m, transposed, m, !transposed, &g)?;
            self.potrf_lower(d, &g, &info_pass)?;
            self.launch(
                dev,
                "first_nonzero_info",
                1,
                Args::new().buf(&info_pass).buf(&info_all),
            )?;
            if last {
                self.launch(
                    dev,
                    "lower_identity_error_bits",
                    dd,
                    Args::new().buf(&g).i32(n).buf(&st.slice(6, 1)?),
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
                        cbsys::cublasFillMode_t::CUBLAS_FILL_MODE_LOWER,
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
        // x = W₁ = L R₁⁻¹ (column-major).
        pass(&x, false, false)?;
        // q = M = Q_p · W₁ (row-major).
        self.gemm_sq(dev, d, &qp, false, &x, true, q)?;
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
        let (ns, p2) = self.rc_second.get();
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
            self.rc_second.set((ns + 1, p2));
            return Ok(true);
        }
        self.rc_second.set((ns, p2 + 1));
        dev.zero_on(&st.slice(6, 1)?, self.stream)?;
        // q = M R₂⁻¹ = Q_new, R₂ ≈ I measured (its distance is M's orthonormality error).
        pass(q, true, true)?;
        let (info, err) = read(st)?;
        Ok(info == 0 && err <= RC_ORTHO_TOL)
    }
}
