//! GEMMs through cuBLAS with the row-major conventions of plan op `MatMul`:
//! `out[M, P] = op(a) · op(b)` (`+ out` when accumulating), `a` stored `[M, K]` (or `[K, M]`
//! with `trans_a`), `b` stored `[K, P]` (or `[P, K]` with `trans_b`).
//!
//! cuBLAS is column-major; a row-major `X` is the column-major `Xᵀ`, so `C = op(A) op(B)` is
//! computed as `Cᵀ = op(B)ᵀ op(A)ᵀ`: cuBLAS gets `(B, A)` with the same transpose flags,
//! `m = P`, `n = M`, leading dimensions the stored column counts. fp32 runs in plain fp32
//! (`CUBLAS_DEFAULT_MATH`, no TF32); the bf16 path takes bf16 operands with fp32 accumulation
//! and an fp32 output (`cublasGemmEx`, `CUBLAS_COMPUTE_32F`).
use crate::device::{Device, INT_MAX};
use crate::error::{cublas, CudaError, Result};
use crate::memory::{Buf, Elem};
use cudarc::cublas::{result as cb, sys as cbsys};
use std::ffi::c_void;

/// Stored shape of a row-major matrix operand, `[rows, cols]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Rows as stored.
    pub rows: usize,
    /// Columns as stored.
    pub cols: usize,
}

impl Dims {
    /// `[rows, cols]`.
    pub fn new(rows: usize, cols: usize) -> Dims {
        Dims { rows, cols }
    }
}

/// A checked row-major GEMM problem `out[m, p] = op(a)[m, k] · op(b)[k, p]` in cuBLAS terms.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) p: usize,
    pub(crate) trans_a: bool,
    pub(crate) trans_b: bool,
    /// Leading dimensions (row strides, elements) of the stored a, b and out when they are
    /// sub-matrices ([`gemm_f32_sub`]); `None`: each operand's stored column count.
    ld: Option<[usize; 3]>,
}

impl Geometry {
    /// Checks the inner dimensions agree and every size fits cuBLAS's `int`.
    pub(crate) fn new(
        op: &'static str,
        a: Dims,
        b: Dims,
        trans_a: bool,
        trans_b: bool,
    ) -> Result<Geometry> {
        let (m, k) = if trans_a {
            (a.cols, a.rows)
        } else {
            (a.rows, a.cols)
        };
        let (k2, p) = if trans_b {
            (b.cols, b.rows)
        } else {
            (b.rows, b.cols)
        };
        if k2 != k {
            return Err(CudaError::Shape {
                op,
                operand: "b (inner dimension)",
                expected: k,
                got: k2,
            });
        }
        if m > INT_MAX || k > INT_MAX || p > INT_MAX {
            return Err(CudaError::Invalid {
                op,
                what: format!("[{m}, {k}] x [{k}, {p}] exceeds cuBLAS's int range"),
            });
        }
        Ok(Geometry {
            m,
            k,
            p,
            trans_a,
            trans_b,
            ld: None,
        })
    }
    fn op(t: bool) -> cbsys::cublasOperation_t {
        if t {
            cbsys::cublasOperation_t::CUBLAS_OP_T
        } else {
            cbsys::cublasOperation_t::CUBLAS_OP_N
        }
    }
    fn lda(&self) -> i32 {
        match self.ld {
            Some([a, _, _]) => a as i32,
            None => (if self.trans_a { self.m } else { self.k }).max(1) as i32,
        }
    }
    fn ldb(&self) -> i32 {
        match self.ld {
            Some([_, b, _]) => b as i32,
            None => (if self.trans_b { self.k } else { self.p }).max(1) as i32,
        }
    }
    fn ldc(&self) -> i32 {
        match self.ld {
            Some([_, _, c]) => c as i32,
            None => self.p.max(1) as i32,
        }
    }
}

fn check_operands(
    op: &'static str,
    a: &Buf,
    a_dims: Dims,
    b: &Buf,
    b_dims: Dims,
    elem: Elem,
) -> Result<()> {
    a.expect(op, "a", elem, a_dims.rows * a_dims.cols)?;
    b.expect(op, "b", elem, b_dims.rows * b_dims.cols)
}

/// Plan op `MatMul` in fp32: `out = op(a)·op(b)` (+ `out` when `accumulate`). See module docs.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    dev: &Device,
    a: &Buf,
    a_dims: Dims,
    b: &Buf,
    b_dims: Dims,
    out: &Buf,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<()> {
    gemm_f32(
        dev,
        a,
        a_dims,
        b,
        b_dims,
        out,
        trans_a,
        trans_b,
        1.0,
        if accumulate { 1.0 } else { 0.0 },
    )
}

/// `out = alpha · op(a)·op(b) + beta · out` in fp32 (row-major; see module docs).
#[allow(clippy::too_many_arguments)]
pub fn gemm_f32(
    dev: &Device,
    a: &Buf,
    a_dims: Dims,
    b: &Buf,
    b_dims: Dims,
    out: &Buf,
    trans_a: bool,
    trans_b: bool,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    gemm_f32_with(
        dev,
        crate::StreamKind::Compute,
        dev.gemm_math(),
        a,
        a_dims,
        b,
        b_dims,
        out,
        trans_a,
        trans_b,
        alpha,
        beta,
    )
}

/// [`gemm_f32`] on stream `kind` (the compute stream's cuBLAS handle, or the side stream's own
/// for [`crate::StreamKind::Side`]) with an explicit [`crate::GemmMath`] instead of the
/// device's current one (for work enqueued from another host thread, e.g. side-stream
/// refreshes).
#[allow(clippy::too_many_arguments)]
pub fn gemm_f32_with(
    dev: &Device,
    kind: crate::StreamKind,
    math: crate::GemmMath,
    a: &Buf,
    a_dims: Dims,
    b: &Buf,
    b_dims: Dims,
    out: &Buf,
    trans_a: bool,
    trans_b: bool,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    const OP: &str = "gemm_f32";
    check_operands(OP, a, a_dims, b, b_dims, Elem::F32)?;
    let g = Geometry::new(OP, a_dims, b_dims, trans_a, trans_b)?;
    out.expect(OP, "out", Elem::F32, g.m * g.p)?;
    gemm_strided_batched_f32_on(
        dev,
        kind,
        math,
        g,
        alpha,
        a.ptr(),
        0,
        b.ptr(),
        0,
        beta,
        out.ptr(),
        0,
        1,
    )
}

/// A row-major f32 sub-matrix of a buffer: `dims.rows` rows of `dims.cols` elements, the first
/// at element `offset`, consecutive rows `ld` elements apart (a block of a larger row-major
/// matrix with `ld` = its column count, addressed in place without a copy).
#[derive(Clone, Copy, Debug)]
pub struct SubMatrix<'a> {
    /// The buffer holding it (f32).
    pub buf: &'a Buf,
    /// Element offset of its first element.
    pub offset: usize,
    /// Its shape `[rows, cols]`.
    pub dims: Dims,
    /// Row stride, elements (at least `dims.cols`).
    pub ld: usize,
}

impl<'a> SubMatrix<'a> {
    /// A whole buffer as a dense `[rows, cols]` matrix.
    pub fn whole(buf: &'a Buf, dims: Dims) -> SubMatrix<'a> {
        SubMatrix {
            buf,
            offset: 0,
            dims,
            ld: dims.cols.max(1),
        }
    }

    /// The device address of its first element, after checking that the buffer is f32, covers
    /// every row, and `ld` is at least the column count and fits cuBLAS's `int`.
    fn ptr(&self, op: &'static str, operand: &'static str) -> Result<u64> {
        let Dims { rows, cols } = self.dims;
        if self.buf.elem() != Elem::F32 || self.ld < cols.max(1) || self.ld > INT_MAX {
            return Err(CudaError::Invalid {
                op,
                what: format!(
                    "{operand}: a [{rows}, {cols}] sub-matrix with row stride {} of a {:?} buffer",
                    self.ld,
                    self.buf.elem()
                ),
            });
        }
        let end = if rows * cols == 0 {
            self.offset
        } else {
            self.offset + (rows - 1) * self.ld + cols
        };
        if end > self.buf.len() {
            return Err(CudaError::Shape {
                op,
                operand,
                expected: end,
                got: self.buf.len(),
            });
        }
        Ok(self.buf.ptr() + (self.offset * 4) as u64)
    }
}

/// `c = alpha · op(a)·op(b) + beta · c` in fp32 on row-major sub-matrices ([`SubMatrix`]: each
/// operand at a pointer offset with its own row stride, as cuBLAS's `lda` / `ldb` / `ldc`
/// allow), on the compute stream with the device's [`crate::GemmMath`]. `c`'s shape must be
/// `[m, p]` of `op(a)[m, k]·op(b)[k, p]`; `c` must not overlap `a` or `b`.
///
/// # Errors
/// Operands that are not f32, do not fit their buffers or disagree in shape
/// ([`CudaError::Shape`], [`CudaError::Invalid`]), sizes beyond `int`, or a cuBLAS error.
#[allow(clippy::too_many_arguments)]
pub fn gemm_f32_sub(
    dev: &Device,
    a: SubMatrix<'_>,
    b: SubMatrix<'_>,
    c: SubMatrix<'_>,
    trans_a: bool,
    trans_b: bool,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    const OP: &str = "gemm_f32_sub";
    let (pa, pb, pc) = (a.ptr(OP, "a")?, b.ptr(OP, "b")?, c.ptr(OP, "out")?);
    let mut g = Geometry::new(OP, a.dims, b.dims, trans_a, trans_b)?;
    if c.dims != Dims::new(g.m, g.p) {
        return Err(CudaError::Shape {
            op: OP,
            operand: "out",
            expected: g.m * g.p,
            got: c.dims.rows * c.dims.cols,
        });
    }
    g.ld = Some([a.ld, b.ld, c.ld]);
    gemm_strided_batched_f32_on(
        dev,
        crate::StreamKind::Compute,
        dev.gemm_math(),
        g,
        alpha,
        pa,
        0,
        pb,
        0,
        beta,
        pc,
        0,
        1,
    )
}

/// `batch` independent row-major GEMMs of geometry `g`, operand `i` at `ptr + i·stride`
/// (strides in elements). The caller guarantees the pointers cover the strided ranges.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_strided_batched_f32(
    dev: &Device,
    g: Geometry,
    alpha: f32,
    a: u64,
    stride_a: usize,
    b: u64,
    stride_b: usize,
    beta: f32,
    c: u64,
    stride_c: usize,
    batch: usize,
) -> Result<()> {
    gemm_strided_batched_f32_on(
        dev,
        crate::StreamKind::Compute,
        dev.gemm_math(),
        g,
        alpha,
        a,
        stride_a,
        b,
        stride_b,
        beta,
        c,
        stride_c,
        batch,
    )
}

#[allow(clippy::too_many_arguments)]
fn gemm_strided_batched_f32_on(
    dev: &Device,
    kind: crate::StreamKind,
    math: crate::GemmMath,
    g: Geometry,
    alpha: f32,
    a: u64,
    stride_a: usize,
    b: u64,
    stride_b: usize,
    beta: f32,
    c: u64,
    stride_c: usize,
    batch: usize,
) -> Result<()> {
    if g.m == 0 || g.p == 0 || batch == 0 {
        return Ok(());
    }
    if batch > INT_MAX {
        return Err(CudaError::Invalid {
            op: "gemm_f32",
            what: format!("batch {batch} exceeds int"),
        });
    }
    dev.context().bind_to_thread()?;
    let h = dev.cublas_handle_on(kind);
    let fast = match math {
        crate::device::GemmMath::Fp32 => None,
        crate::device::GemmMath::Bf16 => {
            Some(cbsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF)
        }
        crate::device::GemmMath::Tf32 => {
            Some(cbsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32)
        }
    };
    if let Some(compute) = fast {
        let f32t = cbsys::cudaDataType::CUDA_R_32F;
        // SAFETY: as below; fp32 storage, bf16-rounded inputs, fp32 accumulation.
        return unsafe {
            cb::gemm_strided_batched_ex(
                h,
                Geometry::op(g.trans_b),
                Geometry::op(g.trans_a),
                g.p as i32,
                g.m as i32,
                g.k as i32,
                (&alpha as *const f32).cast::<c_void>(),
                b as *const c_void,
                f32t,
                g.ldb(),
                stride_b as i64,
                a as *const c_void,
                f32t,
                g.lda(),
                stride_a as i64,
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                f32t,
                g.ldc(),
                stride_c as i64,
                batch as i32,
                compute,
                cbsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .map_err(cublas("gemm_strided_batched_ex (fast bf16/tf32)"))
        };
    }
    // SAFETY: the callers checked that every operand covers its (strided) matrix; alpha/beta
    // are host scalars (the handle's default pointer mode).
    unsafe {
        if batch == 1 {
            cb::sgemm(
                h,
                Geometry::op(g.trans_b),
                Geometry::op(g.trans_a),
                g.p as i32,
                g.m as i32,
                g.k as i32,
                &alpha,
                b as *const f32,
                g.ldb(),
                a as *const f32,
                g.lda(),
                &beta,
                c as *mut f32,
                g.ldc(),
            )
            .map_err(cublas("sgemm"))
        } else {
            cb::sgemm_strided_batched(
                h,
                Geometry::op(g.trans_b),
                Geometry::op(g.trans_a),
                g.p as i32,
                g.m as i32,
                g.k as i32,
                &alpha,
                b as *const f32,
                g.ldb(),
                stride_b as i64,
                a as *const f32,
                g.lda(),
                stride_a as i64,
                &beta,
                c as *mut f32,
                g.ldc(),
                stride_c as i64,
                batch as i32,
            )
            .map_err(cublas("sgemm_strided_batched"))
        }
    }
}

/// bf16 operands, fp32 accumulation: `out = op(a)·op(b)` (+ `out` when `accumulate`). `a`,
/// `b` are [`Elem::BF16`] (see [`cast_f32_to_bf16`]); `out` is f32 or bf16 (see [`gemm_bf16`]).
#[allow(clippy::too_many_arguments)]
pub fn matmul_bf16(
    dev: &Device,
    a: &Buf,
    a_dims: Dims,
    b: &Buf,
    b_dims: Dims,
    out: &Buf,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<()> {
    let beta = if accumulate { 1.0 } else { 0.0 };
    gemm_bf16(dev, a, a_dims, b, b_dims, out, trans_a, trans_b, 1.0, beta)
}

/// bf16 operands, fp32 accumulation: `out = α·op(a)·op(b) + β·out` (cuBLAS `GemmEx`,
/// `CUBLAS_COMPUTE_32F`, compute stream). `a`, `b` are [`Elem::BF16`]; `out` is f32, or bf16
/// (the fp32 result rounded to nearest in the epilogue: what an f32 output followed by
/// [`cast_f32_to_bf16`] gives, without the f32 round trip through memory).
///
/// # Errors
/// Operand shapes or dtypes that do not match, or a cuBLAS error.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16(
    dev: &Device,
    a: &Buf,
    a_dims: Dims,
    b: &Buf,
    b_dims: Dims,
    out: &Buf,
    trans_a: bool,
    trans_b: bool,
    alpha: f32,
    beta: f32,
) -> Result<()> {
    const OP: &str = "gemm_bf16";
    check_operands(OP, a, a_dims, b, b_dims, Elem::BF16)?;
    let g = Geometry::new(OP, a_dims, b_dims, trans_a, trans_b)?;
    let (out_elem, out_type) = if out.elem() == Elem::BF16 {
        (Elem::BF16, cbsys::cudaDataType::CUDA_R_16BF)
    } else {
        (Elem::F32, cbsys::cudaDataType::CUDA_R_32F)
    };
    out.expect(OP, "out", out_elem, g.m * g.p)?;
    if g.m == 0 || g.p == 0 {
        return Ok(());
    }
    dev.context().bind_to_thread()?;
    // SAFETY: operands checked above; alpha/beta are host f32 scalars matching COMPUTE_32F.
    unsafe {
        cb::gemm_ex(
            dev.cublas_handle(),
            Geometry::op(g.trans_b),
            Geometry::op(g.trans_a),
            g.p as i32,
            g.m as i32,
            g.k as i32,
            (&alpha as *const f32).cast::<c_void>(),
            b.ptr() as *const c_void,
            cbsys::cudaDataType::CUDA_R_16BF,
            g.ldb(),
            a.ptr() as *const c_void,
            cbsys::cudaDataType::CUDA_R_16BF,
            g.lda(),
            (&beta as *const f32).cast::<c_void>(),
            out.ptr() as *mut c_void,
            out_type,
            g.ldc(),
            cbsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cbsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(cublas("gemm_ex bf16"))
    }
}

/// bf16 operands, fp32 accumulation: `out = op(a)·op(b) + bias` with `bias` (`[P]`) added to
/// every row of `out` (`[M, P]`) in fp32 in the GEMM's epilogue; `out` and `bias` both f32, or
/// both [`Elem::BF16`] (the fp32 sum rounded to nearest even) (cuBLASLt `CUBLASLT_EPILOGUE_BIAS`, compute
/// stream): plan ops `MatMul` + `BiasAdd` in one pass over the output. `a`, `b` are
/// [`Elem::BF16`].
///
/// # Errors
/// Operand shapes or dtypes that do not match, cuBLASLt missing on this machine
/// ([`has_fused_bias`] says so beforehand), or a cuBLASLt error.
#[allow(clippy::too_many_arguments)]
pub fn gemm_bf16_bias(
    dev: &Device,
    a: &Buf,
    a_dims: Dims,
    b: &Buf,
    b_dims: Dims,
    bias: &Buf,
    out: &Buf,
    trans_a: bool,
    trans_b: bool,
) -> Result<()> {
    const OP: &str = "gemm_bf16_bias";
    check_operands(OP, a, a_dims, b, b_dims, Elem::BF16)?;
    let g = Geometry::new(OP, a_dims, b_dims, trans_a, trans_b)?;
    let d_bf16 = out.elem() == Elem::BF16;
    out.expect(
        OP,
        "out",
        if d_bf16 { Elem::BF16 } else { Elem::F32 },
        g.m * g.p,
    )?;
    bias.expect(OP, "bias", if d_bf16 { Elem::BF16 } else { Elem::F32 }, g.p)?;
    if g.m == 0 || g.p == 0 {
        return Ok(());
    }
    if g.k == 0 {
        return Err(CudaError::Invalid {
            op: OP,
            what: "an empty inner dimension (the result would be the bias alone)".into(),
        });
    }
    let lt = dev.blas_lt().ok_or(CudaError::Invalid {
        op: OP,
        what: "cuBLASLt (libcublasLt.so) is not available".into(),
    })?;
    dev.context().bind_to_thread()?;
    // Row-major out = op(a)·op(b) is column-major outᵀ = op(b)ᵀ·op(a)ᵀ (module docs): cuBLASLt's
    // A is our b, its B our a, both described as stored (column-major [cols, rows]).
    let stored = |d: Dims| (d.cols as u64, d.rows as u64, d.cols.max(1) as i64);
    let lg = crate::lt::LtGeometry {
        m: g.p as u64,
        n: g.m as u64,
        k: g.k as u64,
        trans_a: trans_b,
        trans_b: trans_a,
        a: stored(b_dims),
        b: stored(a_dims),
        d_bf16,
    };
    let stream = dev.stream(crate::StreamKind::Compute).cu_stream() as _;
    // SAFETY: every operand checked above to cover its matrix; the workspace and handle belong
    // to this device; the stream is its compute stream.
    unsafe { lt.matmul_bias(lg, b.ptr(), a.ptr(), bias.ptr(), out.ptr(), stream) }
}

/// Whether [`gemm_bf16_bias`] can run on `dev` (cuBLASLt loaded).
pub fn has_fused_bias(dev: &Device) -> bool {
    dev.blas_lt().is_some()
}

/// `out = bf16(x)` elementwise (round to nearest even) on the compute stream.
pub fn cast_f32_to_bf16(dev: &Device, x: &Buf, out: &Buf) -> Result<()> {
    x.expect("cast_f32_to_bf16", "x", Elem::F32, x.len())?;
    out.expect("cast_f32_to_bf16", "out", Elem::BF16, x.len())?;
    let n = x.len();
    let args = crate::kernels::Args::new().buf(x).buf(out).i64(n as i64);
    dev.launch("cast_f32_bf16", (dev.grid_for(n), 1, 1), (256, 1, 1), args)
}
