//! Structural properties of the SOAP update: permutation equivariance of the eigenbasis,
//! the first-step skip, no current-gradient leakage into the projection, and unrotated
//! dimensions over `max_precond_dim`.
mod common;

use common::{bits, cast, gradient, rel_err, LibParam, Rng};
use optim::{precond_dims, soap_update, FaerEigensolver, SoapParams};

const FREQ: u64 = 10;
const BETA_S: f64 = 0.95;
const LR: f64 = 3e-3;

/// A 2-D parameter after `steps` full engine steps.
fn trained(m: usize, n: usize, max_dim: usize, steps: u64, seed: u64) -> LibParam<f64> {
    let mut p = LibParam::<f64>::new(Rng(seed).vec(m * n), m, n, max_dim, false);
    let (l, r) = (p.factor_left.is_some(), p.factor_right.is_some());
    for t in 1..=steps {
        p.step(
            &FaerEigensolver,
            t,
            LR,
            &SoapParams::default(),
            FREQ,
            BETA_S,
            &gradient(seed, t, m, n, l, r),
        );
    }
    p
}

#[test]
fn permuting_basis_and_moments_together_leaves_update_unchanged() {
    let (m, n) = (6, 4);
    let hp = SoapParams {
        normalize_grads: true,
        ..SoapParams::default()
    };
    let p = trained(m, n, 100, 13, 7);
    let perm_l = [3usize, 0, 5, 1, 4, 2];
    let perm_r = [2usize, 3, 1, 0];
    let mut q = p.clone();
    let (bl, br) = (
        p.basis_left.clone().expect("left"),
        p.basis_right.clone().expect("right"),
    );
    // Column j of the permuted basis is column perm[j] of the original; moments follow
    // (rows for the left side, columns for the right side).
    q.basis_left = Some(
        (0..m * m)
            .map(|k| bl[(k / m) * m + perm_l[k % m]])
            .collect(),
    );
    q.basis_right = Some(
        (0..n * n)
            .map(|k| br[(k / n) * n + perm_r[k % n]])
            .collect(),
    );
    let remap = |x: &[f64]| -> Vec<f64> {
        (0..m * n)
            .map(|k| x[perm_l[k / n] * n + perm_r[k % n]])
            .collect()
    };
    q.exp_avg = remap(&p.exp_avg);
    q.exp_avg_sq = remap(&p.exp_avg_sq);
    let g = gradient(99, 14, m, n, true, true);
    let mut a = p.clone();
    a.update(14, LR, &hp, &g);
    q.update(14, LR, &hp, &g);
    let err = rel_err(&q.param, &a.param);
    assert!(err < 1e-13, "permuted update differs: {err:e}");
    // And the moments are the same moments, permuted.
    assert!(rel_err(&q.exp_avg_sq, &remap(&a.exp_avg_sq)) < 1e-13);
    // Sanity: the step did move the parameter.
    assert!(rel_err(&a.param, &p.param) > 1e-4);
}

#[test]
fn first_step_makes_no_update() {
    let hp = SoapParams {
        weight_decay: 0.1,
        ..SoapParams::default()
    };
    for (m, n, one_d) in [(5usize, 3usize, false), (1, 7, true)] {
        let mut p = LibParam::<f32>::new(cast(&Rng(1).vec(m * n)), m, n, 100, one_d);
        let before = p.clone();
        let g: Vec<f32> = cast(&Rng(2).vec(m * n));
        p.update(1, LR, &hp, &g);
        assert_eq!(
            bits(&p.param),
            bits(&before.param),
            "param changed at t = 1"
        );
        assert_eq!(bits(&p.exp_avg), bits(&before.exp_avg));
        assert_eq!(bits(&p.exp_avg_sq), bits(&before.exp_avg_sq));
        // The factor update and basis init of step 1 still run.
        p.after_update(&FaerEigensolver, 1, FREQ, BETA_S, &g);
        assert_eq!(bits(&p.param), bits(&before.param));
        if !one_d {
            assert!(p
                .factor_left
                .as_ref()
                .expect("left")
                .iter()
                .any(|&x| x != 0.0));
            assert_ne!(
                p.basis_left, before.basis_left,
                "basis not initialised at t = 1"
            );
        }
    }
}

/// Step t's update uses the basis from the end of step t − 1: it equals the explicit
/// formula with that basis whatever the gradient, and the gradient only enters the basis
/// afterwards (here t = 11, whose end runs a QR refresh).
#[test]
fn current_gradient_does_not_enter_its_own_projection() {
    let (m, n) = (5, 4);
    let hp = SoapParams::default();
    let p = trained(m, n, 100, 10, 11);
    let (ql, qr) = (
        p.basis_left.clone().expect("left"),
        p.basis_right.clone().expect("right"),
    );
    let t = 11u64;
    let mut after = Vec::new();
    for gseed in [21u64, 22] {
        let g = gradient(gseed, t, m, n, true, true);
        // Explicit formula with the previous basis (plain loops).
        let gp: Vec<f64> = (0..m * n)
            .map(|k| {
                let (a, b) = (k / n, k % n);
                let mut s = 0.0;
                for i in 0..m {
                    for j in 0..n {
                        s += ql[i * m + a] * g[i * n + j] * qr[j * n + b];
                    }
                }
                s
            })
            .collect();
        let kk = (t - 1) as i32;
        let pre: Vec<f64> = (0..m * n)
            .map(|k| {
                let ea = hp.beta1 * p.exp_avg[k] + (1.0 - hp.beta1) * gp[k];
                let eas = hp.beta2 * p.exp_avg_sq[k] + (1.0 - hp.beta2) * gp[k] * gp[k];
                ea / (eas.sqrt() + hp.eps)
            })
            .collect();
        let step = LR * (1.0 - hp.beta2.powi(kk)).sqrt() / (1.0 - hp.beta1.powi(kk));
        let expect: Vec<f64> = (0..m * n)
            .map(|k| {
                let (i, j) = (k / n, k % n);
                let mut u = 0.0;
                for a in 0..m {
                    for b in 0..n {
                        u += ql[i * m + a] * pre[a * n + b] * qr[j * n + b];
                    }
                }
                let w = p.param[k] - step * u;
                w - LR * hp.weight_decay * w
            })
            .collect();
        let mut q = p.clone();
        q.update(t, LR, &hp, &g);
        assert!(
            rel_err(&q.param, &expect) < 1e-12,
            "update does not use the previous basis"
        );
        assert_eq!(
            q.basis_left.as_deref(),
            Some(&ql[..]),
            "soap_update touched the basis"
        );
        q.after_update(&FaerEigensolver, t, FREQ, BETA_S, &g);
        after.push(q.basis_left.expect("left"));
    }
    // The gradient does reach the basis, after the update: different gradients, different bases.
    assert!(rel_err(&after[0], &after[1]) > 1e-6);
}

#[test]
fn dimension_over_max_precond_dim_is_never_rotated() {
    assert_eq!(precond_dims(4, 10, 8), [Some(4), None]);
    assert_eq!(precond_dims(10_001, 768, 10_000), [None, Some(768)]);
    assert_eq!(precond_dims(3, 3, 3), [Some(3), Some(3)]);
    // Gradients live in column 2 only; with no right rotation the other columns never move.
    let (m, n) = (4, 10);
    let hp = SoapParams {
        weight_decay: 0.0,
        ..SoapParams::default()
    };
    let w0 = Rng(5).vec(m * n);
    let mut p = LibParam::<f64>::new(w0.clone(), m, n, 8, false);
    assert!(p.factor_right.is_none() && p.basis_right.is_none());
    let mut rng = Rng(6);
    for t in 1..=15 {
        let mut g = vec![0.0; m * n];
        for i in 0..m {
            g[i * n + 2] = rng.uniform();
        }
        p.step(&FaerEigensolver, t, LR, &hp, FREQ, BETA_S, &g);
    }
    for i in 0..m {
        for j in 0..n {
            let k = i * n + j;
            if j == 2 {
                assert_ne!(p.param[k], w0[k]);
            } else {
                assert_eq!(p.param[k].to_bits(), w0[k].to_bits(), "column {j} moved");
            }
        }
    }
    // Passing an explicit identity right basis is the same as no basis.
    let mut a = p.clone();
    let mut b = p.clone();
    let g = gradient(8, 16, m, n, false, false);
    a.update(16, LR, &hp, &g);
    let eye: Vec<f64> = (0..n * n)
        .map(|k| if k / n == k % n { 1.0 } else { 0.0 })
        .collect();
    soap_update(
        16,
        LR,
        &hp,
        &mut b.param,
        &g,
        &mut b.exp_avg,
        &mut b.exp_avg_sq,
        b.basis_left.as_deref(),
        Some(&eye),
        m,
        n,
    )
    .expect("shapes");
    assert!(rel_err(&a.param, &b.param) < 1e-15);
}

#[test]
fn f32_tracks_f64() {
    let (m, n) = (8, 6);
    let hp = SoapParams::default();
    let w0 = Rng(3).vec(m * n);
    let mut p64 = LibParam::<f64>::new(w0.clone(), m, n, 100, false);
    let mut p32 = LibParam::<f32>::new(cast(&w0), m, n, 100, false);
    for t in 1..=12 {
        let g = gradient(3, t, m, n, true, true);
        p64.step(&FaerEigensolver, t, LR, &hp, FREQ, BETA_S, &g);
        p32.step(&FaerEigensolver, t, LR, &hp, FREQ, BETA_S, &cast::<f32>(&g));
    }
    let p32_as64: Vec<f64> = p32.param.iter().map(|&x| x as f64).collect();
    let err = rel_err(&p32_as64, &p64.param);
    assert!(err < 1e-4, "f32 vs f64: {err:e}");
}

#[test]
fn shape_errors_modify_nothing() {
    let mut p = vec![1.0f32; 6];
    let g = vec![1.0f32; 6];
    let (mut ea, mut eas) = (vec![0.0f32; 6], vec![0.0f32; 5]);
    let err = soap_update(
        2,
        LR,
        &SoapParams::default(),
        &mut p,
        &g,
        &mut ea,
        &mut eas,
        None,
        None,
        2,
        3,
    );
    assert_eq!(err.map_err(|e| e.operand), Err("exp_avg_sq"));
    assert!(p.iter().all(|&x| x == 1.0));
}
