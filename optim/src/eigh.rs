//! Symmetric eigensolvers behind SOAP's eigenbasis initialisation: the [`HostEigensolver`]
//! trait, the pure-Rust [`FaerEigensolver`] (default) and, with feature `lapack`,
//! `LapackEigensolver` (OpenBLAS `ssyevd`/`dsyevd`).
use crate::Real;
use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::evd::{self_adjoint_evd, self_adjoint_evd_scratch, ComputeEigenvectors};
use faer::{Mat, MatRef, Par};

/// Eigendecomposition of a symmetric `[n, n]` matrix `A = V diag(values) Vᵀ`.
#[derive(Clone, Debug, PartialEq)]
pub struct Eigh<T> {
    /// Matrix side `n`.
    pub n: usize,
    /// The `n` eigenvalues in **ascending** order (LAPACK / `torch.linalg.eigh` order).
    pub values: Vec<T>,
    /// Eigenvectors, row-major `[n, n]`: **column** `j` (`vectors[i * n + j]`, i = 0..n) is the
    /// unit eigenvector of `values[j]`. Signs are arbitrary (solver-dependent).
    pub vectors: Vec<T>,
}

/// Why an eigendecomposition failed. The caller keeps its previous basis.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EigenError {
    /// The input has NaN or ±Inf entries (checked before calling the solver).
    #[error("input matrix [{n}x{n}] has {count} non-finite entries")]
    NonFiniteInput {
        /// Matrix side.
        n: usize,
        /// Number of NaN/Inf entries.
        count: usize,
    },
    /// The slice length is not `n * n`.
    #[error("input has {got} elements, expected {n}x{n}")]
    BadShape {
        /// Matrix side.
        n: usize,
        /// Elements received.
        got: usize,
    },
    /// The iteration did not converge (faer `NoConvergence`, LAPACK `info > 0`).
    #[error("{solver}: eigensolver did not converge (info {info})")]
    NoConvergence {
        /// Solver name.
        solver: &'static str,
        /// LAPACK `info` (0 for faer).
        info: i64,
    },
    /// LAPACK rejected an argument (`info < 0`): a bug in the binding.
    #[error("{solver}: illegal argument {arg}")]
    IllegalArgument {
        /// Solver name.
        solver: &'static str,
        /// 1-based argument index (`-info`).
        arg: i64,
    },
    /// The solver returned NaN/Inf eigenvalues or eigenvectors.
    #[error("{solver}: non-finite eigenvalues or eigenvectors")]
    NonFiniteOutput {
        /// Solver name.
        solver: &'static str,
    },
    /// The solver is not compiled into this build.
    #[error("eigensolver `{name}` unavailable: {reason}")]
    Unavailable {
        /// Requested name.
        name: String,
        /// Why (unknown name, missing cargo feature), with the available names.
        reason: String,
    },
}

/// A dense symmetric eigensolver used on the host worker pool.
///
/// Both entry points take a symmetric row-major `[n, n]` matrix (only one triangle is read;
/// for symmetric input the storage order does not matter) and return all eigenvalues in
/// ascending order with eigenvectors (see [`Eigh`] for the layout). The faer solver uses the
/// threads of the current rayon pool (`rayon::current_num_threads()`; run it inside
/// `pool.install(..)` to choose the thread count), or one thread under
/// [`crate::with_sequential`]; LAPACK uses its own (OpenBLAS) threads. Implementations never panic on bad
/// numbers: non-finite input is an [`EigenError::NonFiniteInput`].
pub trait HostEigensolver: Send + Sync {
    /// Stable name, as accepted by [`solver_by_name`] (`"faer"`, `"lapack"`).
    fn name(&self) -> &'static str;
    /// f32 eigendecomposition (used in training).
    fn eigh_f32(&self, a: &[f32], n: usize) -> Result<Eigh<f32>, EigenError>;
    /// f64 eigendecomposition (used in tests and references).
    fn eigh_f64(&self, a: &[f64], n: usize) -> Result<Eigh<f64>, EigenError>;
}

/// Checks shape and finiteness of an eigensolver input.
pub(crate) fn check_input<T: Real>(a: &[T], n: usize) -> Result<(), EigenError> {
    if a.len() != n * n {
        return Err(EigenError::BadShape { n, got: a.len() });
    }
    let count = a.iter().filter(|x| !x.is_finite()).count();
    if count > 0 {
        return Err(EigenError::NonFiniteInput { n, count });
    }
    Ok(())
}

/// Checks the solver output is finite.
pub(crate) fn check_output<T: Real>(e: &Eigh<T>, solver: &'static str) -> Result<(), EigenError> {
    if e.values
        .iter()
        .chain(e.vectors.iter())
        .all(|x| x.is_finite())
    {
        Ok(())
    } else {
        Err(EigenError::NonFiniteOutput { solver })
    }
}

/// faer's self-adjoint eigendecomposition (tridiagonalisation + divide and conquer), pure
/// Rust. The default solver. Parallel over the current rayon pool for `n ≥ 128` (outside
/// [`crate::with_sequential`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct FaerEigensolver;

impl FaerEigensolver {
    fn eigh<T: Real>(&self, a: &[T], n: usize) -> Result<Eigh<T>, EigenError> {
        check_input(a, n)?;
        if n == 0 {
            return Ok(Eigh {
                n,
                values: Vec::new(),
                vectors: Vec::new(),
            });
        }
        let par = if n >= 128 && !crate::linalg::sequential() {
            Par::rayon(0)
        } else {
            Par::Seq
        };
        // Symmetric: the row-major slice read column-major is the same matrix.
        let a = MatRef::from_column_major_slice(a, n, n);
        let mut s = Diag::<T>::zeros(n);
        let mut u = Mat::<T>::zeros(n, n);
        let mut buf = MemBuffer::new(self_adjoint_evd_scratch::<T>(
            n,
            ComputeEigenvectors::Yes,
            par,
            Default::default(),
        ));
        self_adjoint_evd(
            a,
            s.as_mut(),
            Some(u.as_mut()),
            par,
            MemStack::new(&mut buf),
            Default::default(),
        )
        .map_err(|_| EigenError::NoConvergence {
            solver: "faer",
            info: 0,
        })?;
        let values: Vec<T> = (0..n).map(|i| *s.as_ref().column_vector().get(i)).collect();
        let mut vectors = vec![T::zero(); n * n];
        for i in 0..n {
            for j in 0..n {
                vectors[i * n + j] = *u.as_ref().get(i, j);
            }
        }
        let e = Eigh { n, values, vectors };
        check_output(&e, "faer")?;
        Ok(e)
    }
}

impl HostEigensolver for FaerEigensolver {
    fn name(&self) -> &'static str {
        "faer"
    }
    fn eigh_f32(&self, a: &[f32], n: usize) -> Result<Eigh<f32>, EigenError> {
        self.eigh(a, n)
    }
    fn eigh_f64(&self, a: &[f64], n: usize) -> Result<Eigh<f64>, EigenError> {
        self.eigh(a, n)
    }
}

/// Names of the eigensolvers compiled into this build (`"faer"`, plus `"lapack"` with the
/// `lapack` feature).
pub fn solver_names() -> &'static [&'static str] {
    if cfg!(feature = "lapack") {
        &["faer", "lapack"]
    } else {
        &["faer"]
    }
}

/// The eigensolver called `name` (`"faer"` or `"lapack"`).
///
/// # Errors
/// [`EigenError::Unavailable`] for an unknown name, or `"lapack"` in a build without the
/// `lapack` cargo feature.
pub fn solver_by_name(name: &str) -> Result<Box<dyn HostEigensolver>, EigenError> {
    match name {
        "faer" => Ok(Box::new(FaerEigensolver)),
        #[cfg(feature = "lapack")]
        "lapack" => Ok(Box::new(crate::lapack_solver::LapackEigensolver)),
        #[cfg(not(feature = "lapack"))]
        "lapack" => Err(EigenError::Unavailable {
            name: name.to_string(),
            reason: "not compiled in: rebuild asteria-optim with `--features lapack`".to_string(),
        }),
        _ => Err(EigenError::Unavailable {
            name: name.to_string(),
            reason: format!("unknown solver; available: {}", solver_names().join(", ")),
        }),
    }
}
