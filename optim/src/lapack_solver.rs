//! LAPACK eigensolver (`ssyevd`/`dsyevd`, divide and conquer) through the system OpenBLAS.
//! Compiled with cargo feature `lapack`.
extern crate openblas_src;

use crate::eigh::{check_input, check_output, EigenError, Eigh, HostEigensolver};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Serializes every LAPACK call of the process. OpenBLAS's pthread build is not safe for
/// concurrent calls from several caller threads while its (process-global) thread count is
/// changed: two concurrent `?syevd` calls (e.g. two refresh workers, or parallel tests)
/// intermittently returned non-finite eigenvectors here. Each call already uses all of
/// OpenBLAS's threads, so serializing loses little.
static LAPACK_LOCK: Mutex<()> = Mutex::new(());

extern "C" {
    fn openblas_set_num_threads(num_threads: std::os::raw::c_int);
}

/// Thread count last given to OpenBLAS (0 = never set).
static OPENBLAS_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Sets OpenBLAS's (process-global) thread count to the current rayon pool's size, if it
/// changed since the last call.
fn sync_openblas_threads() {
    let want = rayon::current_num_threads().max(1);
    if OPENBLAS_THREADS.swap(want, Ordering::Relaxed) != want {
        let n = std::os::raw::c_int::try_from(want).unwrap_or(std::os::raw::c_int::MAX);
        // SAFETY: plain FFI setter of OpenBLAS, no pointers involved.
        unsafe { openblas_set_num_threads(n) };
    }
}

/// LAPACK `?syevd` (jobz = 'V') from the system OpenBLAS. OpenBLAS's thread count is set
/// to `rayon::current_num_threads()` before each call (a process-global setting).
#[derive(Clone, Copy, Debug, Default)]
pub struct LapackEigensolver;

macro_rules! syevd_impl {
    ($fn_name:ident, $t:ty, $syevd:path) => {
        fn $fn_name(a: &[$t], n: usize) -> Result<Eigh<$t>, EigenError> {
            const SOLVER: &str = "lapack";
            check_input(a, n)?;
            if n == 0 {
                return Ok(Eigh {
                    n,
                    values: Vec::new(),
                    vectors: Vec::new(),
                });
            }
            let ni = i32::try_from(n).map_err(|_| EigenError::BadShape { n, got: a.len() })?;
            sync_openblas_threads();
            // Symmetric: the row-major slice is also the column-major matrix; uplo 'L'.
            let mut mat = a.to_vec();
            let mut w = vec![0.0 as $t; n];
            let mut info = 0i32;
            let mut work_q = [0.0 as $t; 1];
            let mut iwork_q = [0i32; 1];
            // SAFETY: workspace query; all slices are valid for the sizes passed.
            unsafe {
                $syevd(
                    b'V',
                    b'L',
                    ni,
                    &mut mat,
                    ni,
                    &mut w,
                    &mut work_q,
                    -1,
                    &mut iwork_q,
                    -1,
                    &mut info,
                );
            }
            if info != 0 {
                return Err(EigenError::IllegalArgument {
                    solver: SOLVER,
                    arg: -(info as i64),
                });
            }
            let lwork = (work_q[0] as usize).max(1);
            let liwork = (iwork_q[0] as usize).max(1);
            let mut work = vec![0.0 as $t; lwork];
            let mut iwork = vec![0i32; liwork];
            // SAFETY: `mat` is n×n (lda = n), `w` n, work/iwork sized by the query above.
            unsafe {
                $syevd(
                    b'V',
                    b'L',
                    ni,
                    &mut mat,
                    ni,
                    &mut w,
                    &mut work,
                    lwork as i32,
                    &mut iwork,
                    liwork as i32,
                    &mut info,
                );
            }
            if info < 0 {
                return Err(EigenError::IllegalArgument {
                    solver: SOLVER,
                    arg: -(info as i64),
                });
            }
            if info > 0 {
                return Err(EigenError::NoConvergence {
                    solver: SOLVER,
                    info: info as i64,
                });
            }
            // Column-major eigenvectors → row-major with the same columns.
            let mut vectors = vec![0.0 as $t; n * n];
            for j in 0..n {
                for i in 0..n {
                    vectors[i * n + j] = mat[j * n + i];
                }
            }
            let e = Eigh {
                n,
                values: w,
                vectors,
            };
            check_output(&e, SOLVER)?;
            Ok(e)
        }
    };
}

syevd_impl!(eigh_f32_impl, f32, lapack::ssyevd);
syevd_impl!(eigh_f64_impl, f64, lapack::dsyevd);

impl HostEigensolver for LapackEigensolver {
    fn name(&self) -> &'static str {
        "lapack"
    }
    fn eigh_f32(&self, a: &[f32], n: usize) -> Result<Eigh<f32>, EigenError> {
        // A poisoned lock only means another call panicked; LAPACK holds no state of ours.
        let _guard = LAPACK_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        eigh_f32_impl(a, n)
    }
    fn eigh_f64(&self, a: &[f64], n: usize) -> Result<Eigh<f64>, EigenError> {
        let _guard = LAPACK_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        eigh_f64_impl(a, n)
    }
}
