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
/// `d² > m·n` it holds one chunk's intermediate of the two-step re-projection instead) and two
/// chunk buffers (`chunk` f32 each) that every moment passes through, a block of whole rows
/// (side 1) or whole columns (side 0) at a time: gathered from the moment (device or pinned
/// host memory, the plan's host tier), transformed, scattered back. `chunk` is
/// `schedule::reserve::swap_chunk_len` of the largest task, at least one line of the largest
/// side: the swap no longer needs buffers the size of the largest moment (at LLaMA 1.44B the
/// embedding's 393 MiB, three times). With `stage_basis`, a `[d, d]` device copy of an
/// eigenbasis kept in pinned host memory (`tier-placement`), which the re-projection reads
/// as `Q_old` (`schedule::reserve::RefreshStaging::swap_basis`).
pub(crate) struct SwapWork {
    c: Buf,
    a: Buf,
    b: Buf,
    q_old: Option<Buf>,
    chunk: usize,
}

impl SwapWork {
    /// Bytes [`SwapWork::new`] allocates for `max_dim`, `chunk` and `stage_basis`.
    pub(crate) fn bytes(max_dim: usize, chunk: usize, stage_basis: bool) -> usize {
        let d = max_dim.max(1);
        let stage = if stage_basis {
            d * d * 4 + crate::memory::BUF_ALIGN
        } else {
            0
        };
        (d * d + 2 * chunk.max(d)) * 4 + 3 * crate::memory::BUF_ALIGN + stage
    }

    /// One device arena for the largest factor side `max_dim`, with chunk buffers of `chunk`
    /// elements (raised to `max_dim`, one line of the largest side), and with `stage_basis`
    /// the device copy of an offloaded eigenbasis.
    pub(crate) fn new(
        dev: &Device,
        max_dim: usize,
        chunk: usize,
        stage_basis: bool,
    ) -> Result<SwapWork> {
        let d = max_dim.max(1);
        let chunk = chunk.max(d);
        let bytes = Self::bytes(d, chunk, stage_basis);
        let mut arena = dev.arena("refresh-swap", crate::Tier::Device, bytes)?;
        Ok(SwapWork {
            c: arena.buf(Elem::F32, d * d)?,
            a: arena.buf(Elem::F32, chunk)?,
            b: arena.buf(Elem::F32, chunk)?,
            q_old: if stage_basis {
                Some(arena.buf(Elem::F32, d * d)?)
            } else {
                None
            },
            chunk,
        })
    }
}

/// Checks that `basis` is a `[d, d]` f32 eigenbasis in device or pinned host memory (the
/// swap writes it with a copy, which reads and writes either).
fn check_basis(op: &'static str, basis: &Buf, dd: usize) -> Result<()> {
    if basis.elem() != Elem::F32 || basis.len() != dd {
        return Err(CudaError::Operand {
            op,
            operand: "basis",
            expected: format!("{dd} x f32"),
            got: format!("{} x {}", basis.len(), basis.elem()),
        });
    }
    Ok(())
}

/// The lines of a `[m, n]` moment that the swap of side `side` transforms independently (the
/// columns for side 0, whose rows the basis rotates; the rows for side 1), chunked: yields
/// `(first, count)` with `count · line ≤ chunk`.
fn chunks(side: u8, m: usize, n: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let (lines, line) = if side == 0 { (n, m) } else { (m, n) };
    let per = (chunk / line.max(1)).clamp(1, lines.max(1));
    (0..lines)
        .step_by(per)
        .map(move |first| (first, per.min(lines - first)))
}

/// Copies lines `first..first + count` of the `[m, n]` moment `x` into the contiguous chunk
/// `to` (`[m, count]` for side 0, `[count, n]` for side 1), or back with `back`.
#[allow(clippy::too_many_arguments)]
fn move_lines(
    dev: &Device,
    x: &Buf,
    chunk: &Buf,
    side: u8,
    m: usize,
    n: usize,
    (first, count): (usize, usize),
    back: bool,
) -> Result<()> {
    let (chunk_n, rows, cols, row, col) = if side == 0 {
        (count, m, count, 0, first)
    } else {
        (n, count, n, first, 0)
    };
    if back {
        dev.copy_block_f32(x, (n, row, col), chunk, (chunk_n, 0, 0), rows, cols)
    } else {
        dev.copy_block_f32(chunk, (chunk_n, 0, 0), x, (n, row, col), rows, cols)
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
    check_basis(OP, basis, d * d)?;
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
/// `idx`, then the basis overwritten (`optim::refresh_apply`, up to rounding). For a side `d`
/// no longer than the other dimension `o` the basis change `C = Q_oldᵀ Q_new` is formed first
/// (`2d³ + 2d²o` flops), else the moment goes through the old and new bases one after the
/// other (`4d²o`, as the reference SOAP's project-back / project does). Both transform each
/// column (side 0) or row (side 1) of a moment on its own, so the moments go through
/// [`SwapWork`]'s chunk buffers a block of lines at a time (gathered, transformed, scattered
/// back in place; device or pinned host memory alike). GEMMs run with `math`: fp32, or TF32
/// for the optimizer of a `precision = bf16` plan. The caller has made the compute stream wait
/// for the refresh and checked its [`verdict`](super::verdict).
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
    if dd > work.c.len() || d > work.chunk || q_new.len() < dd || idx.len() < d {
        return Err(CudaError::Invalid {
            op: OP,
            what: format!("[{m}, {n}] side {side} exceeds the swap buffers"),
        });
    }
    check_basis(OP, basis, dd)?;
    let q_new = q_new.slice(0, dd)?;
    if init {
        return dev.copy(basis, &q_new, StreamKind::Compute);
    }
    // The GEMMs read `Q_old` on the device: an offloaded basis through the staging copy.
    let home = basis;
    let basis = &super::device_operand(
        dev,
        (OP, "basis"),
        home,
        work.q_old.as_ref(),
        d,
        StreamKind::Compute,
    )?;
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
    let prev = dev.set_gemm_math(math);
    let r = (|| {
        let sq = Dims::new(d, d);
        let direct = dd <= mn;
        if direct {
            // C = Q_oldᵀ Q_new, then one GEMM per chunk.
            let c = work.c.slice(0, dd)?;
            gemm_f32(dev, basis, sq, &q_new, sq, &c, true, false, 1.0, 0.0)?;
        }
        for lines in chunks(side, m, n, work.chunk) {
            let len = lines.1 * if side == 0 { m } else { n };
            let (x, y) = (work.a.slice(0, len)?, work.b.slice(0, len)?);
            let e = if side == 0 {
                Dims::new(m, lines.1)
            } else {
                Dims::new(lines.1, n)
            };
            move_lines(dev, exp_avg, &x, side, m, n, lines, false)?;
            if direct {
                let c = work.c.slice(0, dd)?;
                if side == 0 {
                    gemm_f32(dev, &c, sq, &x, e, &y, true, false, 1.0, 0.0)?;
                } else {
                    gemm_f32(dev, &x, e, &c, sq, &y, false, false, 1.0, 0.0)?;
                }
            } else {
                // Back to the parameter's coordinates with Q_old, then into Q_new; `c` (d² >
                // m·n elements) holds the intermediate.
                let tmp = work.c.slice(0, len)?;
                if side == 0 {
                    gemm_f32(dev, basis, sq, &x, e, &tmp, false, false, 1.0, 0.0)?;
                    gemm_f32(dev, &q_new, sq, &tmp, e, &y, true, false, 1.0, 0.0)?;
                } else {
                    gemm_f32(dev, &x, e, basis, sq, &tmp, false, true, 1.0, 0.0)?;
                    gemm_f32(dev, &tmp, e, &q_new, sq, &y, false, false, 1.0, 0.0)?;
                }
            }
            move_lines(dev, exp_avg, &y, side, m, n, lines, true)?;
        }
        let kernel = if side == 0 {
            "permute_rows"
        } else {
            "permute_cols"
        };
        let idx = idx.slice(0, d)?;
        for lines in chunks(side, m, n, work.chunk) {
            let (rows, cols) = if side == 0 {
                (m, lines.1)
            } else {
                (lines.1, n)
            };
            let (x, y) = (work.a.slice(0, rows * cols)?, work.b.slice(0, rows * cols)?);
            move_lines(dev, exp_avg_sq, &x, side, m, n, lines, false)?;
            let args = Args::new()
                .buf(&x)
                .buf(&idx)
                .buf(&y)
                .i32(rows as i32)
                .i32(cols as i32);
            dev.launch(kernel, (dev.grid_for(rows * cols), 1, 1), (256, 1, 1), args)?;
            move_lines(dev, exp_avg_sq, &y, side, m, n, lines, true)?;
        }
        dev.copy(home, &q_new, StreamKind::Compute)
    })();
    dev.set_gemm_math(prev);
    r
}
