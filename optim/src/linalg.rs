//! Small dense linear-algebra helpers on row-major slices, backed by faer: GEMM and the
//! Q factor of a Householder QR.
use crate::{check_len, Real, ShapeError};
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::householder::{
    apply_block_householder_sequence_on_the_left_in_place_scratch,
    apply_block_householder_sequence_on_the_left_in_place_with_conj,
};
use faer::linalg::matmul::matmul as faer_matmul;
use faer::linalg::qr::no_pivoting::factor::{
    qr_in_place, qr_in_place_scratch, recommended_block_size,
};
use faer::reborrow::ReborrowMut;
use faer::{Accum, Conj, Mat, MatMut, MatRef, Par};

/// Work (in multiply-adds) below which faer runs single-threaded: spawning onto the rayon
/// pool costs more than it saves for small factors.
const PAR_THRESHOLD_FLOPS: usize = 1 << 21;

thread_local! {
    static SEQUENTIAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with every faer operation of this crate on the calling thread single-threaded
/// (`Par::Seq`), whatever the enclosing rayon pool. For throughput: a pool that runs one
/// eigenbasis refresh per core finishes more refreshes per second than one that splits each
/// refresh over all cores (faer's QR and `eigh` scale poorly at Kronecker-factor sizes;
/// 768×768 power iteration + QR on 16 H200-host cores: BENCHMARKS.md). Nests; restores the
/// previous setting on return (also on unwind).
pub fn with_sequential<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SEQUENTIAL.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SEQUENTIAL.with(|s| s.replace(true)));
    f()
}

/// Whether [`with_sequential`] is in force on this thread, or the current rayon pool has one
/// thread: faer must then run `Par::Seq`.
pub(crate) fn sequential() -> bool {
    SEQUENTIAL.with(|s| s.get()) || rayon::current_num_threads() <= 1
}

/// faer parallelism for an operation of about `flops` multiply-adds: sequential when small
/// (or under [`with_sequential`]), otherwise all threads of the current rayon pool.
pub(crate) fn par_for(flops: usize) -> Par {
    if flops < PAR_THRESHOLD_FLOPS || sequential() {
        Par::Seq
    } else {
        Par::rayon(0)
    }
}

/// Row-major `[r, c]` view.
pub(crate) fn view<T: Real>(a: &[T], r: usize, c: usize) -> MatRef<'_, T> {
    MatRef::from_row_major_slice(a, r, c)
}

/// Row-major `[r, c]` mutable view.
pub(crate) fn view_mut<T: Real>(a: &mut [T], r: usize, c: usize) -> MatMut<'_, T> {
    MatMut::from_row_major_slice_mut(a, r, c)
}

/// `dst = beta·dst + alpha·lhs·rhs` (`beta = None`: overwrite) on faer views.
pub(crate) fn gemm<T: Real>(
    dst: MatMut<'_, T>,
    beta: Option<T>,
    lhs: MatRef<'_, T>,
    rhs: MatRef<'_, T>,
    alpha: T,
) {
    let flops = dst.nrows() * dst.ncols() * lhs.ncols();
    let par = par_for(flops);
    let mut dst = dst;
    match beta {
        None => faer_matmul(dst, Accum::Replace, lhs, rhs, alpha, par),
        Some(b) => {
            if b != T::one() {
                for j in 0..dst.ncols() {
                    for i in 0..dst.nrows() {
                        let x = dst.rb_mut().get_mut(i, j);
                        *x *= b;
                    }
                }
            }
            faer_matmul(dst, Accum::Add, lhs, rhs, alpha, par)
        }
    }
}

/// Row-major GEMM: `out[m, n] = op(a) · op(b)` with `op(a)` `[m, k]` and `op(b)` `[k, n]`.
///
/// `a` is stored `[m, k]`, or `[k, m]` when `trans_a`; `b` is stored `[k, n]`, or `[n, k]`
/// when `trans_b`. `out` is overwritten. Runs on the current rayon pool when large.
///
/// # Errors
/// [`ShapeError`] when a slice length does not match the dimensions (nothing written).
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Real>(
    out: &mut [T],
    a: &[T],
    trans_a: bool,
    b: &[T],
    trans_b: bool,
    m: usize,
    k: usize,
    n: usize,
) -> Result<(), ShapeError> {
    check_len("matmul", "a", a.len(), m * k)?;
    check_len("matmul", "b", b.len(), k * n)?;
    check_len("matmul", "out", out.len(), m * n)?;
    let av = if trans_a {
        view(a, k, m).transpose()
    } else {
        view(a, m, k)
    };
    let bv = if trans_b {
        view(b, n, k).transpose()
    } else {
        view(b, k, n)
    };
    gemm(view_mut(out, m, n), None, av, bv, T::one());
    Ok(())
}

/// Thin Q factor of a Householder QR (faer, no pivoting): for a row-major `a` `[r, c]` with
/// `r ≥ c`, returns the row-major `[r, c]` matrix Q with orthonormal columns such that
/// `a = Q R`, R upper triangular (`torch.linalg.qr(a).Q` up to the signs of columns).
///
/// Rank-deficient input is fine: Q is a product of Householder reflectors, so it stays
/// orthonormal (columns past the numerical rank complete the basis). Non-finite input gives
/// non-finite output; callers must check.
///
/// # Errors
/// [`ShapeError`] when `a.len() != r * c` or `r < c`.
pub fn thin_qr_q<T: Real>(a: &[T], r: usize, c: usize) -> Result<Vec<T>, ShapeError> {
    check_len("thin_qr_q", "a", a.len(), r * c)?;
    if r < c {
        return Err(ShapeError {
            op: "thin_qr_q",
            operand: "a (needs rows >= cols)",
            expected: c * c,
            got: r * c,
        });
    }
    let size = c;
    if size == 0 {
        return Ok(Vec::new());
    }
    let par = par_for(r * c * c);
    // faer prefers column-major storage.
    let mut qr = Mat::<T>::from_fn(r, c, |i, j| a[i * c + j]);
    let bs = recommended_block_size::<T>(r, c);
    let mut coeff = Mat::<T>::zeros(bs, size);
    {
        let mut buf = MemBuffer::new(qr_in_place_scratch::<T>(r, c, bs, par, Default::default()));
        qr_in_place(
            qr.as_mut(),
            coeff.as_mut(),
            par,
            MemStack::new(&mut buf),
            Default::default(),
        );
    }
    // The Householder basis is the unit lower-trapezoidal part of `qr`.
    for j in 0..c {
        for i in 0..=j.min(r - 1) {
            *qr.as_mut().get_mut(i, j) = if i == j { T::one() } else { T::zero() };
        }
    }
    let mut q = Mat::<T>::identity(r, size);
    {
        let mut buf = MemBuffer::new(
            apply_block_householder_sequence_on_the_left_in_place_scratch::<T>(r, bs, size),
        );
        apply_block_householder_sequence_on_the_left_in_place_with_conj(
            qr.as_ref(),
            coeff.as_ref(),
            Conj::No,
            q.as_mut(),
            par,
            MemStack::new(&mut buf),
        );
    }
    let mut out = vec![T::zero(); r * c];
    for i in 0..r {
        for j in 0..c {
            out[i * c + j] = *q.as_ref().get(i, j);
        }
    }
    Ok(out)
}
