//! The float trait the optimizer math is generic over ([`Real`]: f32 or f64).
use crate::eigh::{EigenError, Eigh, HostEigensolver};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// A real float the optimizer math runs in: `f32` (training) or `f64` (tests, references).
///
/// It is a faer field (for GEMM, QR and eigendecompositions) and a `num_traits::Float`
/// (for elementwise math). Sealed: only `f32` and `f64` implement it, because the
/// eigensolvers ([`HostEigensolver`]) have one entry point per precision.
pub trait Real:
    faer::traits::RealField
    + num_traits::Float
    + Copy
    + Default
    + Send
    + Sync
    + std::fmt::Debug
    + std::fmt::Display
    + 'static
    + sealed::Sealed
{
    /// `"f32"` or `"f64"`.
    const NAME: &'static str;

    /// Converts from f64 (hyperparameters are f64 in the plan), rounding to nearest.
    fn of(x: f64) -> Self;

    /// Widens to f64.
    fn f64(self) -> f64;

    /// Calls the eigensolver entry point of this precision: `solver.eigh_f32` or
    /// `solver.eigh_f64`. `a` is a symmetric row-major `[n, n]` matrix.
    fn eigh_with(
        solver: &dyn HostEigensolver,
        a: &[Self],
        n: usize,
    ) -> Result<Eigh<Self>, EigenError>;
}

impl Real for f32 {
    const NAME: &'static str = "f32";
    #[inline]
    fn of(x: f64) -> Self {
        x as f32
    }
    #[inline]
    fn f64(self) -> f64 {
        self as f64
    }
    fn eigh_with(
        solver: &dyn HostEigensolver,
        a: &[Self],
        n: usize,
    ) -> Result<Eigh<Self>, EigenError> {
        solver.eigh_f32(a, n)
    }
}

impl Real for f64 {
    const NAME: &'static str = "f64";
    #[inline]
    fn of(x: f64) -> Self {
        x
    }
    #[inline]
    fn f64(self) -> f64 {
        self
    }
    fn eigh_with(
        solver: &dyn HostEigensolver,
        a: &[Self],
        n: usize,
    ) -> Result<Eigh<Self>, EigenError> {
        solver.eigh_f64(a, n)
    }
}
