//! AdamW against a plainly-written PyTorch `_single_tensor_adamw` (float64).
mod common;

use common::{cast, rel_err, Rng};
use optim::{adamw_update, AdamWParams};

#[test]
fn adamw_matches_pytorch_formula() {
    let hp = AdamWParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let n = 33;
    let mut p = Rng(1).vec(n);
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    let (mut rp, mut rm, mut rv) = (p.clone(), m.clone(), v.clone());
    let mut p32: Vec<f32> = cast(&p);
    let (mut m32, mut v32) = (vec![0.0f32; n], vec![0.0f32; n]);
    for t in 1..=6u64 {
        let g = Rng(10 + t).vec(n);
        adamw_update(t, &hp, &mut p, &g, &mut m, &mut v).expect("shapes");
        adamw_update(t, &hp, &mut p32, &cast::<f32>(&g), &mut m32, &mut v32).expect("shapes");
        for i in 0..n {
            rp[i] *= 1.0 - hp.lr * hp.weight_decay;
            rm[i] = hp.beta1 * rm[i] + (1.0 - hp.beta1) * g[i];
            rv[i] = hp.beta2 * rv[i] + (1.0 - hp.beta2) * g[i] * g[i];
            let bc1 = 1.0 - hp.beta1.powi(t as i32);
            let bc2 = 1.0 - hp.beta2.powi(t as i32);
            rp[i] -= hp.lr / bc1 * rm[i] / (rv[i].sqrt() / bc2.sqrt() + hp.eps);
        }
    }
    assert!(rel_err(&p, &rp) < 1e-14);
    assert!(rel_err(&m, &rm) < 1e-14 && rel_err(&v, &rv) < 1e-14);
    let p32_64: Vec<f64> = p32.iter().map(|&x| x as f64).collect();
    assert!(rel_err(&p32_64, &rp) < 1e-6);
    // The first step moves every coordinate by about lr (Adam's sign-like first step).
    assert!(rel_err(&p, &Rng(1).vec(n)) > 1e-4);
}

#[test]
fn adamw_shape_mismatch_is_an_error() {
    let hp = AdamWParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let mut p = vec![0.0f32; 3];
    let r = adamw_update(1, &hp, &mut p, &[1.0; 3], &mut [0.0; 2], &mut [0.0; 3]);
    assert!(r.is_err());
}
