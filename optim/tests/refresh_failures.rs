//! Eigenbasis refresh under bad numbers: non-finite factors, failing eigensolvers, all-zero
//! and rank-deficient factors. Failures must leave all state bitwise untouched; successes
//! must give finite orthonormal bases.
mod common;

use common::{bits, cast, gradient, orthonormality_error, LibParam, Rng};
use optim::{
    eigenbasis_refresh, soap_factor_update, thin_qr_q, EigenError, Eigh, FaerEigensolver,
    HostEigensolver, Real, RefreshError, RefreshOutcome, SoapParams,
};

const FREQ: u64 = 10;

fn trained<T: Real>(m: usize, n: usize, steps: u64) -> LibParam<T> {
    let mut p = LibParam::<T>::new(cast(&Rng(1).vec(m * n)), m, n, 100, false);
    for t in 1..=steps {
        p.step(
            &FaerEigensolver,
            t,
            3e-3,
            &SoapParams::default(),
            FREQ,
            0.95,
            &cast::<T>(&gradient(1, t, m, n, true, true)),
        );
    }
    p
}

/// Runs a refresh of side 0 on `p` with `factor`, asserting it fails and changes nothing.
fn assert_refused<T: Real>(
    p: &mut LibParam<T>,
    solver: &dyn HostEigensolver,
    t: u64,
    factor: &[T],
) -> RefreshError {
    let before = p.clone();
    let basis = p.basis_left.as_mut().expect("left");
    let r = eigenbasis_refresh(
        solver,
        t,
        FREQ,
        0,
        factor,
        basis,
        &mut p.exp_avg,
        &mut p.exp_avg_sq,
        p.m,
        p.n,
    );
    let err = r.expect_err("refresh should fail");
    assert!(err.is_numerical(), "{err}");
    assert_eq!(
        bits(p.basis_left.as_ref().expect("left")),
        bits(before.basis_left.as_ref().expect("left"))
    );
    assert_eq!(bits(&p.exp_avg), bits(&before.exp_avg));
    assert_eq!(bits(&p.exp_avg_sq), bits(&before.exp_avg_sq));
    assert!(p
        .basis_left
        .as_ref()
        .expect("left")
        .iter()
        .all(|x| x.is_finite()));
    err
}

fn check_nonfinite<T: Real>() {
    let (m, n) = (6, 4);
    let mut p = trained::<T>(m, n, 12);
    // NaN / Inf injected into the factor directly, at init (t = 1) and at a QR step (t = 21).
    for bad in [T::nan(), T::infinity(), T::neg_infinity()] {
        let mut f = p.factor_left.clone().expect("left");
        f[2 * m + 3] = bad;
        for t in [1, 21] {
            let err = assert_refused(&mut p, &FaerEigensolver, t, &f);
            assert!(
                matches!(
                    err,
                    RefreshError::NonFiniteFactor {
                        side: 0,
                        dim: 6,
                        count: 1
                    }
                ),
                "{err:?}"
            );
        }
    }
    // An Inf in a gradient reaches the factor through soap_factor_update.
    let mut g: Vec<T> = cast(&gradient(2, 13, m, n, true, true));
    g[5] = T::infinity();
    let mut fl = p.factor_left.clone().expect("left");
    let mut fr = p.factor_right.clone().expect("right");
    soap_factor_update(&g, Some(&mut fl), Some(&mut fr), m, n, 0.95).expect("shapes");
    assert!(fl.iter().any(|x| !x.is_finite()));
    let err = assert_refused(&mut p, &FaerEigensolver, 21, &fl);
    assert!(matches!(err, RefreshError::NonFiniteFactor { .. }));
    // A non-refresh step does not even look at the factor.
    let basis = p.basis_left.as_mut().expect("left");
    let r = eigenbasis_refresh(
        &FaerEigensolver,
        15,
        FREQ,
        0,
        &fl,
        basis,
        &mut p.exp_avg,
        &mut p.exp_avg_sq,
        m,
        n,
    );
    assert_eq!(r, Ok(RefreshOutcome::Skipped));
}

#[test]
fn nonfinite_factor_keeps_previous_basis_f32() {
    check_nonfinite::<f32>();
}

#[test]
fn nonfinite_factor_keeps_previous_basis_f64() {
    check_nonfinite::<f64>();
}

/// A solver that fails, or returns garbage.
struct BadSolver {
    nan: bool,
}

impl BadSolver {
    fn run<T: Real>(&self, n: usize) -> Result<Eigh<T>, EigenError> {
        if self.nan {
            Ok(Eigh {
                n,
                values: vec![T::one(); n],
                vectors: vec![T::nan(); n * n],
            })
        } else {
            Err(EigenError::NoConvergence {
                solver: "bad",
                info: 3,
            })
        }
    }
}

impl HostEigensolver for BadSolver {
    fn name(&self) -> &'static str {
        "bad"
    }
    fn eigh_f32(&self, _a: &[f32], n: usize) -> Result<Eigh<f32>, EigenError> {
        self.run(n)
    }
    fn eigh_f64(&self, _a: &[f64], n: usize) -> Result<Eigh<f64>, EigenError> {
        self.run(n)
    }
}

#[test]
fn failing_eigensolver_keeps_previous_basis() {
    let mut p = trained::<f32>(5, 3, 3);
    let f = p.factor_left.clone().expect("left");
    let err = assert_refused(&mut p, &BadSolver { nan: false }, 1, &f);
    assert!(
        matches!(err, RefreshError::Eigensolver { solver: "bad", .. }),
        "{err:?}"
    );
    let err = assert_refused(&mut p, &BadSolver { nan: true }, 1, &f);
    assert!(matches!(err, RefreshError::BadBasis { .. }), "{err:?}");
}

#[test]
fn caller_bugs_are_not_numerical() {
    let mut p = trained::<f64>(4, 3, 1);
    let f = p.factor_left.clone().expect("left");
    let basis = p.basis_left.as_mut().expect("left");
    let r = eigenbasis_refresh(
        &FaerEigensolver,
        1,
        FREQ,
        2,
        &f,
        basis,
        &mut p.exp_avg,
        &mut p.exp_avg_sq,
        4,
        3,
    );
    assert!(matches!(r, Err(RefreshError::InvalidSide { side: 2 })));
    let r = eigenbasis_refresh(
        &FaerEigensolver,
        1,
        FREQ,
        1,
        &f,
        basis,
        &mut p.exp_avg,
        &mut p.exp_avg_sq,
        4,
        3,
    );
    let err = r.expect_err("shape");
    assert!(matches!(err, RefreshError::Shape(_)) && !err.is_numerical());
}

/// Init and QR refresh on `factor` (side 0 of a `[d, 3]` parameter with nonzero moments):
/// either success with a finite orthonormal basis and finite moments, or a reported failure
/// with nothing changed. Never NaN.
fn check_degenerate<T: Real>(factor: &[T], d: usize, tol: f64) {
    let n = 3;
    let mut p = LibParam::<T>::new(vec![T::zero(); d * n], d, n, 100, false);
    p.exp_avg = cast(&Rng(4).vec(d * n));
    p.exp_avg_sq = Rng(5).vec(d * n).iter().map(|x| T::of(x.abs())).collect();
    for t in [1u64, 11, 21] {
        let before = p.clone();
        let basis = p.basis_left.as_mut().expect("left");
        match eigenbasis_refresh(
            &FaerEigensolver,
            t,
            FREQ,
            0,
            factor,
            basis,
            &mut p.exp_avg,
            &mut p.exp_avg_sq,
            d,
            n,
        ) {
            Ok(RefreshOutcome::ZeroFactor) => {
                // Only an exactly-zero factor at a QR refresh, and then nothing changes.
                assert!(t > 1 && factor.iter().all(|x| *x == T::zero()), "t={t}");
                assert_eq!(
                    bits(p.basis_left.as_ref().expect("left")),
                    bits(before.basis_left.as_ref().expect("left"))
                );
                assert_eq!(bits(&p.exp_avg), bits(&before.exp_avg));
                assert_eq!(bits(&p.exp_avg_sq), bits(&before.exp_avg_sq));
            }
            Ok(outcome) => {
                assert_eq!(
                    outcome,
                    if t == 1 {
                        RefreshOutcome::Initialized
                    } else {
                        RefreshOutcome::Refreshed
                    }
                );
                let q = p.basis_left.as_ref().expect("left");
                let e = orthonormality_error(q, d);
                assert!(e < tol, "t={t}: basis not orthonormal ({e:e})");
                assert!(p.exp_avg.iter().chain(&p.exp_avg_sq).all(|x| x.is_finite()));
            }
            Err(err) => {
                eprintln!("degenerate refresh t={t} reported: {err}");
                assert!(err.is_numerical());
                assert_eq!(
                    bits(p.basis_left.as_ref().expect("left")),
                    bits(before.basis_left.as_ref().expect("left"))
                );
            }
        }
        assert!(
            p.basis_left
                .as_ref()
                .expect("left")
                .iter()
                .all(|x| x.is_finite()),
            "NaN basis at t={t}"
        );
    }
}

fn degenerate_cases<T: Real>(tol: f64) {
    let d = 6;
    check_degenerate::<T>(&vec![T::zero(); d * d], d, tol);
    for rank in [1usize, 2, 5] {
        let mut rng = Rng(rank as u64);
        let vs: Vec<Vec<f64>> = (0..rank).map(|_| rng.vec(d)).collect();
        let f: Vec<T> = (0..d * d)
            .map(|k| T::of(vs.iter().map(|v| v[k / d] * v[k % d]).sum()))
            .collect();
        check_degenerate::<T>(&f, d, tol);
    }
    // Tiny (denormal-range) and huge entries.
    let f: Vec<T> = (0..d * d)
        .map(|k| {
            if k % (d + 1) == 0 {
                T::of(1e-36)
            } else {
                T::zero()
            }
        })
        .collect();
    check_degenerate::<T>(&f, d, tol);
}

#[test]
fn zero_and_rank_deficient_factors_give_orthonormal_bases_f32() {
    degenerate_cases::<f32>(1e-5);
}

#[test]
fn zero_and_rank_deficient_factors_give_orthonormal_bases_f64() {
    degenerate_cases::<f64>(1e-12);
}

#[test]
fn thin_qr_of_rank_deficient_matrices_is_orthonormal() {
    for d in [1usize, 4, 33] {
        let zero = vec![0.0f64; d * d];
        let q = thin_qr_q(&zero, d, d).expect("shape");
        assert!(orthonormality_error(&q, d) < 1e-12);
        let v = Rng(d as u64).vec(d);
        let rank1: Vec<f32> = (0..d * d).map(|k| (v[k / d] * v[k % d]) as f32).collect();
        let q = thin_qr_q(&rank1, d, d).expect("shape");
        assert!(orthonormality_error(&q, d) < 1e-5);
    }
}

/// A factor that is exactly zero because its gradient vanished (a frozen parameter, a clip to
/// underflow) is skipped at a QR refresh — previous basis and moments bitwise kept — and is
/// not an error, in the synchronous call and in the compute/apply halves; a NaN factor still
/// is one.
fn check_zero_factor_is_skipped<T: Real>() {
    let (m, n) = (6, 4);
    let mut p = trained::<T>(m, n, 12);
    let zero = vec![T::zero(); m * m];
    let before = p.clone();
    let basis = p.basis_left.as_mut().expect("left");
    let r = eigenbasis_refresh(
        &FaerEigensolver,
        21,
        FREQ,
        0,
        &zero,
        basis,
        &mut p.exp_avg,
        &mut p.exp_avg_sq,
        m,
        n,
    );
    assert_eq!(r, Ok(RefreshOutcome::ZeroFactor));
    assert_eq!(
        bits(p.basis_left.as_ref().expect("left")),
        bits(before.basis_left.as_ref().expect("left"))
    );
    assert_eq!(bits(&p.exp_avg), bits(&before.exp_avg));
    assert_eq!(bits(&p.exp_avg_sq), bits(&before.exp_avg_sq));
    // Negative zeros are zeros too.
    let neg = vec![-T::zero(); m * m];
    let q = p.basis_left.clone().expect("left");
    let res = optim::refresh_compute(&FaerEigensolver, 21, FREQ, 0, &neg, &q, m, n)
        .expect("not an error")
        .expect("a refresh step");
    assert_eq!(res.kind(), RefreshOutcome::ZeroFactor);
    let (mut q2, mut ea, mut eas) = (q.clone(), p.exp_avg.clone(), p.exp_avg_sq.clone());
    assert_eq!(
        optim::refresh_apply(&res, &mut q2, &mut ea, &mut eas, m, n),
        Ok(RefreshOutcome::ZeroFactor)
    );
    assert_eq!(bits(&q2), bits(&q));
    assert_eq!(bits(&ea), bits(&p.exp_avg));
    // At t = 1 a zero factor initialises the basis (eigenvectors of 1e-30·I), orthonormal.
    let mut q1 = vec![T::zero(); m * m];
    let r = eigenbasis_refresh(
        &FaerEigensolver,
        1,
        FREQ,
        0,
        &zero,
        &mut q1,
        &mut ea,
        &mut eas,
        m,
        n,
    );
    assert_eq!(r, Ok(RefreshOutcome::Initialized));
    assert!(orthonormality_error(&q1, m) < 1e-5);
    // A NaN among the zeros is still a failure.
    let mut bad = zero.clone();
    bad[7] = T::nan();
    let err = assert_refused(&mut p, &FaerEigensolver, 21, &bad);
    assert!(
        matches!(err, RefreshError::NonFiniteFactor { count: 1, .. }),
        "{err:?}"
    );
}

#[test]
fn zero_factor_is_skipped_not_failed_f32() {
    check_zero_factor_is_skipped::<f32>();
}

#[test]
fn zero_factor_is_skipped_not_failed_f64() {
    check_zero_factor_is_skipped::<f64>();
}
