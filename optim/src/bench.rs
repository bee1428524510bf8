//! Eigensolver micro-benchmark (exposed as `asteria bench eigh`): median wall time of one
//! f32 eigendecomposition with eigenvectors on a pool of a given number of threads.
use crate::HostEigensolver;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Instant;

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The rayon pool could not be built.
    #[error("building a rayon pool of {threads} threads: {source}")]
    Pool {
        /// Requested threads.
        threads: usize,
        /// rayon's error.
        #[source]
        source: rayon::ThreadPoolBuildError,
    },
    /// The solver failed on the benchmark matrix.
    #[error(transparent)]
    Eigen(#[from] crate::EigenError),
}

/// A random symmetric positive definite row-major `[n, n]` f32 matrix, `X Xᵀ / n + I` with
/// X uniform in [−1, 1) (seeded, deterministic).
pub fn random_spd_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let x: Vec<f64> = (0..n * n).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut a = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (0..n).map(|k| x[i * n + k] * x[j * n + k]).sum::<f64>() / n as f64;
            let v = (s + if i == j { 1.0 } else { 0.0 }) as f32;
            a[i * n + j] = v;
            a[j * n + i] = v;
        }
    }
    a
}

/// Median wall time in **milliseconds** of `reps` (≥ 1) f32 eigendecompositions (values and
/// vectors) of one random SPD `[n, n]` matrix, run inside a fresh rayon pool of `threads`
/// threads (faer uses the pool; the LAPACK solver sets OpenBLAS to the same count). One
/// untimed warm-up run precedes the timed ones.
///
/// # Errors
/// [`BenchError`] when the pool cannot be built or the solver fails.
pub fn eigh_median_ms(
    solver: &dyn HostEigensolver,
    n: usize,
    threads: usize,
    reps: usize,
) -> Result<f64, BenchError> {
    let threads = threads.max(1);
    let a = random_spd_f32(n, 0x5eed);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|source| BenchError::Pool { threads, source })?;
    pool.install(|| {
        solver.eigh_f32(&a, n)?;
        let mut times = Vec::with_capacity(reps.max(1));
        for _ in 0..reps.max(1) {
            let start = Instant::now();
            let e = solver.eigh_f32(&a, n)?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
            std::hint::black_box(e);
        }
        times.sort_by(f64::total_cmp);
        let mid = times.len() / 2;
        Ok(if times.len() % 2 == 1 {
            times[mid]
        } else {
            0.5 * (times[mid - 1] + times[mid])
        })
    })
}
