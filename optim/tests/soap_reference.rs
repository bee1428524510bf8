//! SOAP against an independent float64 re-implementation of the reference `soap.py`
//! (nikhilvyas/SOAP): `common/soap_py.rs`, written with plain loops, a Jacobi eigensolver and
//! modified Gram–Schmidt QR, following `SOAP.step` / `update_preconditioner` /
//! `get_orthogonal_matrix(_QR)` / `project(_back)` literally (including projecting exp_avg
//! back to the original space and forward again on every step).

mod common;
#[path = "common/soap_py.rs"]
mod soap_py;

use common::{gradient, rel_err, LibParam, Rng};
use optim::SoapParams;
use soap_py::{flat, from_flat, Group, RefState};

/// Runs `steps` steps of reference and library (with every eigensolver compiled in) on one
/// parameter; returns the worst relative parameter error over all steps.
fn compare(
    m: usize,
    n: usize,
    one_d: bool,
    max_precond_dim: usize,
    hp: SoapParams,
    seed: u64,
) -> f64 {
    optim::solver_names()
        .iter()
        .map(|name| {
            compare_with(
                &*optim::solver_by_name(name).expect("solver"),
                m,
                n,
                one_d,
                max_precond_dim,
                hp,
                seed,
            )
        })
        .fold(0.0, f64::max)
}

fn compare_with(
    solver: &dyn optim::HostEigensolver,
    m: usize,
    n: usize,
    one_d: bool,
    max_precond_dim: usize,
    hp: SoapParams,
    seed: u64,
) -> f64 {
    let steps = 25u64;
    let freq = 10u64;
    let base_lr = 3e-3;
    let shampoo_beta = 0.9;
    let w0 = Rng(seed).vec(m * n);
    let mut lib = LibParam::<f64>::new(w0.clone(), m, n, max_precond_dim, one_d);
    let (rot_l, rot_r) = (lib.factor_left.is_some(), lib.factor_right.is_some());
    let mut p_ref = from_flat(&w0, m, n);
    let mut st = RefState::new(one_d, m, n);
    let mut worst = 0.0f64;
    for t in 1..=steps {
        let lr = base_lr * (1.0 + 0.5 * (t as f64 * 0.7).sin()); // a varying schedule
        let g = gradient(seed, t, m, n, rot_l, rot_r);
        let group = Group {
            lr,
            betas: (hp.beta1, hp.beta2),
            shampoo_beta,
            eps: hp.eps,
            weight_decay: hp.weight_decay,
            precondition_frequency: freq as usize,
            max_precond_dim,
            normalize_grads: hp.normalize_grads,
            correct_bias: hp.correct_bias,
        };
        st.step(&mut p_ref, &from_flat(&g, m, n), &group);
        lib.step(solver, t, lr, &hp, freq, shampoo_beta, &g);
        let err = rel_err(&lib.param, &flat(&p_ref));
        worst = worst.max(err);
    }
    eprintln!(
        "{} {m}x{n} one_d={one_d}: worst rel err {worst:e}",
        solver.name()
    );
    // The parameters really moved (the comparison is not vacuous).
    assert!(rel_err(&lib.param, &w0) > 1e-3, "parameters barely changed");
    worst
}

#[test]
fn soap_matches_reference_7x5() {
    let err = compare(7, 5, false, 10_000, SoapParams::default(), 1);
    assert!(err <= 1e-6, "7x5: rel err {err:e}");
}

#[test]
fn soap_matches_reference_6x3_normalized_no_bias_correction() {
    let hp = SoapParams {
        normalize_grads: true,
        correct_bias: false,
        beta1: 0.9,
        beta2: 0.99,
        ..SoapParams::default()
    };
    let err = compare(6, 3, false, 10_000, hp, 2);
    assert!(err <= 1e-6, "6x3: rel err {err:e}");
}

#[test]
fn soap_matches_reference_right_side_unrotated() {
    // n = 10 > max_precond_dim = 8: the right side has no factor and stays unrotated.
    let err = compare(4, 10, false, 8, SoapParams::default(), 3);
    assert!(err <= 1e-6, "4x10 (max 8): rel err {err:e}");
}

#[test]
fn soap_matches_reference_left_side_unrotated() {
    let err = compare(
        9,
        4,
        false,
        8,
        SoapParams {
            weight_decay: 0.0,
            ..SoapParams::default()
        },
        4,
    );
    assert!(err <= 1e-6, "9x4 (max 8): rel err {err:e}");
}

#[test]
fn soap_matches_reference_1d() {
    let err = compare(1, 9, true, 10_000, SoapParams::default(), 5);
    assert!(err <= 1e-6, "1-D: rel err {err:e}");
}
