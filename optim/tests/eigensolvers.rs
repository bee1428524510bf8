//! Host eigensolvers: faer's decomposition is a valid one, names resolve, and (with
//! `--features lapack`) faer and LAPACK agree on random symmetric matrices.
mod common;

use common::{orthonormality_error, Rng};
use optim::{solver_by_name, EigenError, FaerEigensolver, HostEigensolver, Real};

/// Random symmetric (indefinite) row-major `[n, n]` matrix.
fn random_symmetric(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = Rng(seed);
    let mut a = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..=i {
            let v = rng.uniform();
            a[i * n + j] = v;
            a[j * n + i] = v;
        }
    }
    a
}

fn eigh<T: Real>(s: &dyn HostEigensolver, a: &[f64], n: usize) -> optim::Eigh<T> {
    let a: Vec<T> = a.iter().map(|&x| T::of(x)).collect();
    T::eigh_with(s, &a, n).expect("eigh")
}

/// max |A v_j − λ_j v_j| / ‖A‖_max, orthonormality and ascending order.
fn check_decomposition<T: Real>(a: &[f64], e: &optim::Eigh<T>, tol: f64) {
    let n = e.n;
    let scale = a.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-300);
    for j in 0..n {
        for i in 0..n {
            let av: f64 = (0..n)
                .map(|k| a[i * n + k] * e.vectors[k * n + j].f64())
                .sum();
            let r = (av - e.values[j].f64() * e.vectors[i * n + j].f64()).abs() / scale;
            assert!(r < tol, "residual {r:e} (n={n}, {})", T::NAME);
        }
    }
    assert!(orthonormality_error(&e.vectors, n) < tol);
    assert!(e.values.windows(2).all(|w| w[0] <= w[1]), "not ascending");
}

#[test]
fn faer_decomposition_is_valid() {
    for &n in &[1usize, 3, 50, 129] {
        let a = random_symmetric(n, n as u64);
        check_decomposition::<f64>(&a, &eigh::<f64>(&FaerEigensolver, &a, n), 1e-12);
        check_decomposition::<f32>(&a, &eigh::<f32>(&FaerEigensolver, &a, n), 1e-4);
    }
}

#[test]
fn nonfinite_input_is_an_error() {
    let mut a = random_symmetric(4, 1);
    a[5] = f64::NAN;
    assert_eq!(
        FaerEigensolver.eigh_f64(&a, 4),
        Err(EigenError::NonFiniteInput { n: 4, count: 1 })
    );
    assert!(matches!(
        FaerEigensolver.eigh_f64(&a, 3),
        Err(EigenError::BadShape { .. })
    ));
}

#[test]
fn solvers_by_name() {
    assert_eq!(solver_by_name("faer").expect("faer").name(), "faer");
    assert!(matches!(
        solver_by_name("cusolver"),
        Err(EigenError::Unavailable { .. })
    ));
    let lapack = solver_by_name("lapack");
    if cfg!(feature = "lapack") {
        assert_eq!(lapack.expect("lapack").name(), "lapack");
    } else {
        assert!(matches!(lapack, Err(EigenError::Unavailable { .. })));
    }
}

#[test]
fn bench_reports_a_positive_time() {
    let ms = optim::bench::eigh_median_ms(&FaerEigensolver, 24, 1, 3).expect("bench");
    assert!(ms.is_finite() && ms > 0.0);
}

/// faer vs LAPACK: eigenvalues within `1e-5 · max|λ|`; eigenvectors equal up to sign, within
/// the first-order perturbation bound `C · ε · ‖A‖ / gap_j`.
#[cfg(feature = "lapack")]
fn agree<T: Real>(n: usize, seed: u64) {
    let a = random_symmetric(n, seed);
    let f = eigh::<T>(&FaerEigensolver, &a, n);
    let l = eigh::<T>(&optim::LapackEigensolver, &a, n);
    check_decomposition::<T>(&a, &l, if T::NAME == "f32" { 1e-4 } else { 1e-12 });
    let lmax = l.values.iter().fold(0.0f64, |m, x| m.max(x.f64().abs()));
    for j in 0..n {
        let d = (f.values[j].f64() - l.values[j].f64()).abs();
        assert!(
            d <= 1e-5 * lmax,
            "{} n={n}: eigenvalue {j} differs by {d:e} (max {lmax:e})",
            T::NAME
        );
    }
    let eps = T::epsilon().f64();
    for j in 0..n {
        let gap = (0..n)
            .filter(|&k| k != j)
            .map(|k| (l.values[k].f64() - l.values[j].f64()).abs())
            .fold(f64::INFINITY, f64::min);
        let dot: f64 = (0..n)
            .map(|i| f.vectors[i * n + j].f64() * l.vectors[i * n + j].f64())
            .sum();
        let sign = dot.signum();
        let diff = (0..n)
            .map(|i| (f.vectors[i * n + j].f64() - sign * l.vectors[i * n + j].f64()).abs())
            .fold(0.0, f64::max);
        let bound = (1e3 * eps * lmax / gap).max(1e3 * eps);
        assert!(
            diff <= bound,
            "{} n={n}: eigenvector {j} differs by {diff:e} (bound {bound:e}, gap {gap:e})",
            T::NAME
        );
    }
}

#[cfg(feature = "lapack")]
#[test]
fn faer_and_lapack_agree_f64() {
    for &n in &[1usize, 3, 50, 129] {
        agree::<f64>(n, 100 + n as u64);
    }
}

#[cfg(feature = "lapack")]
#[test]
fn faer_and_lapack_agree_f32() {
    for &n in &[1usize, 3, 50, 129] {
        agree::<f32>(n, 200 + n as u64);
    }
}

#[cfg(feature = "lapack")]
#[test]
fn lapack_refresh_matches_faer_refresh() {
    // The SOAP init through either solver gives the same basis up to column signs.
    let n = 20;
    let a = random_symmetric(n, 9);
    let spd: Vec<f64> = (0..n * n)
        .map(|k| {
            (0..n)
                .map(|l| a[(k / n) * n + l] * a[(k % n) * n + l])
                .sum()
        })
        .collect();
    let mut bases = Vec::new();
    for s in [
        &FaerEigensolver as &dyn HostEigensolver,
        &optim::LapackEigensolver,
    ] {
        let mut q = vec![0.0; n * n];
        let (mut ea, mut eas) = (vec![0.0; n], vec![0.0; n]);
        optim::eigenbasis_refresh(s, 1, 10, 0, &spd, &mut q, &mut ea, &mut eas, n, 1)
            .expect("refresh");
        bases.push(q);
    }
    for j in 0..n {
        let dot: f64 = (0..n)
            .map(|i| bases[0][i * n + j] * bases[1][i * n + j])
            .sum();
        assert!(
            (dot.abs() - 1.0).abs() < 1e-8,
            "column {j}: |dot| = {}",
            dot.abs()
        );
    }
}
