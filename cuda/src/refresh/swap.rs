//! The swap of a computed refresh into the optimizer state, on the compute stream: SOAP's
//! ([`apply`]: basis, re-projected `exp_avg`, permuted `exp_avg_sq`) with its work buffers
//! ([`SwapWork`]), or the basis alone ([`install_basis`]: first bases, KL-Shampoo's QR).
use crate::device::{Device, GemmMath};
use crate::error::{CudaError, Result};
use crate::gemm::{gemm_f32, Dims};
use crate::kernels::Args;
use crate::memory::{Buf, Elem};
use crate::StreamKind;

/// Work buffers of [`apply`] on the compute stream: the basis change `C` (`[d, d]`; when
/// `d² > m·n` it holds the `[m, n]` intermediate of the two-step re-projection instead) and the
/// new moments (`[m·n]` each), sized for the largest task; with `staged`, a third `[m·n]`
/// buffer that brings a moment kept in pinned host memory (the plan's host tier) onto the
/// device for the swap's GEMMs and permutation.
pub(crate) struct SwapWork {
    c: Buf,
    e_new: Buf,
    v_new: Buf,
    staged: Option<Buf>,
}

impl SwapWork {
    /// Bytes [`SwapWork::new`] allocates.
    pub(crate) fn bytes(max_dim: usize, max_mn: usize, staged: bool) -> usize {
        let moments = if staged { 3 } else { 2 };
        (max_dim.max(1).pow(2) + moments * max_mn.max(1)) * 4 + 4 * crate::memory::BUF_ALIGN
    }

    /// One device arena for the largest factor side `max_dim` and moment size `max_mn`;
    /// `staged` when some task's moments are off the device.
    pub(crate) fn new(
        dev: &Device,
        max_dim: usize,
        max_mn: usize,
        staged: bool,
    ) -> Result<SwapWork> {
        let (d, mn) = (max_dim.max(1), max_mn.max(1));
        let bytes = Self::bytes(d, mn, staged);
        let mut arena = dev.arena("refresh-swap", crate::Tier::Device, bytes)?;
        Ok(SwapWork {
            c: arena.buf(Elem::F32, d * d)?,
            e_new: arena.buf(Elem::F32, mn)?,
            v_new: arena.buf(Elem::F32, mn)?,
            staged: if staged {
                Some(arena.buf(Elem::F32, mn)?)
            } else {
                None
            },
        })
    }

    /// `moment` itself when it is device memory, else a copy of it in the staging buffer
    /// (enqueued on the compute stream).
    fn on_device(&self, dev: &Device, moment: &Buf, mn: usize) -> Result<Buf> {
        if moment.tier() == crate::Tier::Device {
            return Ok(moment.clone());
        }
        let staged = self.staged.as_ref().ok_or_else(|| CudaError::Invalid {
            op: "refresh_apply",
            what: "a moment in pinned host memory but no staging buffer".into(),
        })?;
        let staged = staged.slice(0, mn)?;
        dev.copy(&staged, moment, StreamKind::Compute)?;
        Ok(staged)
    }
}

/// Installs a computed basis alone (`basis ← q_new[..d²]`, `[d, d]` f32), on the compute
/// stream: the install of a first eigendecomposition (what [`apply`] does for an init) and of
/// every [`schedule::RefreshMethod::Qr`] refresh, whose optimizer (KL-Shampoo) keeps its
/// momentum unrotated and has no second moment: nothing else is read or written
/// (`optim::refresh_apply` of such a result). The caller has made the compute stream wait for
/// the refresh and checked its [`verdict`](super::verdict).
///
/// # Errors
/// A basis that is not `[d, d]` f32 or a `q_new` shorter than `d²` (caller bugs), and copy
/// failures.
pub(crate) fn install_basis(dev: &Device, q_new: &Buf, basis: &Buf, d: usize) -> Result<()> {
    const OP: &str = "refresh_install_basis";
    basis.expect(OP, "basis", Elem::F32, d * d)?;
    if q_new.len() < d * d {
        return Err(CudaError::Shape {
            op: OP,
            operand: "q_new",
            expected: d * d,
            got: q_new.len(),
        });
    }
    dev.copy(basis, &q_new.slice(0, d * d)?, StreamKind::Compute)
}

/// Installs a computed SOAP refresh (the swap of the double buffer), on the compute stream:
/// for an init, `basis ← q`; else `exp_avg` re-projected into the new eigenbasis (side 0:
/// `E ← Q_newᵀ Q_old E`, side 1: `E ← E Q_oldᵀ Q_new`), `exp_avg_sq` permuted along the side by
/// `idx`, then basis and moments overwritten (`optim::refresh_apply`, up to rounding). For a
/// side `d` no longer than the other dimension `o` the basis change `C = Q_oldᵀ Q_new` is formed
/// first (`2d³ + 2d²o` flops), else the moment goes through the old and new bases one after the
/// other (`4d²o`, as the reference SOAP's project-back / project does). GEMMs run with `math`:
/// fp32, or TF32 for the optimizer of a `precision = bf16` plan. Moments in pinned host
/// memory (the plan's host tier) are copied onto the device one at a time through the staging
/// buffer and the results copied back, all on the compute stream. The caller has made the
/// compute stream wait for the refresh and checked its [`verdict`](super::verdict).
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
    // The moments may be device or pinned host memory (`SwapWork::on_device` stages them).
    for (name, b) in [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
        if b.elem() != Elem::F32 || b.len() != mn {
            return Err(CudaError::Operand {
                op: OP,
                operand: name,
                expected: format!("{mn} x f32"),
                got: format!("{} x {}", b.len(), b.elem()),
            });
        }
    }
    let exp_avg_out = exp_avg;
    let prev = dev.set_gemm_math(math);
    let r = (|| {
        let (e_new, v_new) = (work.e_new.slice(0, mn)?, work.v_new.slice(0, mn)?);
        let exp_avg_in = work.on_device(dev, exp_avg, mn)?;
        let exp_avg = &exp_avg_in;
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
        // The new exp_avg leaves e_new before the staging buffer takes exp_avg_sq.
        dev.copy(&exp_avg_out, &e_new, StreamKind::Compute)?;
        let exp_avg_sq_in = work.on_device(dev, exp_avg_sq, mn)?;
        let idx = idx.slice(0, d)?;
        let args = Args::new()
            .buf(&exp_avg_sq_in)
            .buf(&idx)
            .buf(&v_new)
            .i32(m as i32)
            .i32(n as i32);
        dev.launch(kernel, (dev.grid_for(mn), 1, 1), (256, 1, 1), args)?;
        dev.copy(basis, &q_new, StreamKind::Compute)?;
        dev.copy(exp_avg_sq, &v_new, StreamKind::Compute)
    })();
    dev.set_gemm_math(prev);
    r
}
