//! KL-Shampoo's per-step work as a composition (Lin et al. 2025, the reference `KLOpt`;
//! `docs/kl-shampoo.md`; `crate::kl_shampoo_update` is the same composition in one op): for a
//! 2-D parameter `[m, n]` with bases `Q_L`, `Q_R` (a side over `max_precond_dim` has none: the
//! identity) and eigenvalue estimates `D_L` `[m]`, `D_R` `[n]`,
//!
//! ```text
//! m, M' = momentum(G, m)                  m ← β₁m + (1−β₁)G; result M' = m    element-wise
//! X  = project(M')                        Q_Lᵀ M' Q_R                           plan op `project`
//! Y  = kl_scale(X, D_L, D_R)              X ⊘ (√(D_L D_Rᵀ) + ε)                 broadcast
//! U  = project_back(Y)                    Q_L Y Q_Rᵀ                            plan op `project`
//! p  = step(p, U)                         (p − lr·U)·(1 − lr·wd)                element-wise
//! kl_factor_update(G, D, S, Q)            S_L, S_R, D_L, D_R from the old Q, D  matrix work
//! ```
//!
//! At step 1 (the reference's initialising call) nothing moves but the factors and the
//! estimates (`kl_factor_update` initialises them; the rules select the old values through
//! `warm`). The bases are refreshed by `eigenbasis_refresh` host tasks with method `qr`, off the
//! critical path. `expand-optimizer` writes this composition; `fuse` (rule `kl-shampoo-update`)
//! replaces it by the hand-written `kl_shampoo_update` op when the rules are exactly [`rules`]
//! of the hyperparameters they carry (bit-identical on the CPU engine). `normalize_grads`
//! divides by the update's RMS, a reduction the rule language does not express: with it
//! `expand-optimizer` writes `kl_shampoo_update` directly.
use crate::update::{Const, RuleError};
use schedule::{ElementwiseRule, KlShampooHyper, StepScalar};

/// The `optimizer` name of the composed rules (a kernel name suffix).
pub const NAME: &str = "kl_shampoo";

/// The two element-wise steps of KL-Shampoo for `h` (which must not ask for
/// `normalize_grads`): `(momentum, step)`. `momentum` reads `g` (the gradient) and the state
/// `m` (`exp_avg`), writes `m` and the result `mom` (the new momentum, the projection's input);
/// `step` reads `p` and `g` (the update `U`) and writes `p`. Neither changes anything at t = 1
/// (`warm`). Both carry `h` in their `hyper` (for `fuse`'s `kl-shampoo-update`).
///
/// # Errors
/// [`RuleError::Outputs`] for `normalize_grads` (not expressible as an element-wise rule).
pub fn rules(h: &KlShampooHyper) -> Result<(ElementwiseRule, ElementwiseRule), RuleError> {
    if h.normalize_grads {
        return Err(RuleError::Outputs(
            "KL-Shampoo's normalize_grads divides by the update's RMS, a reduction".into(),
        ));
    }
    let c = |x: f64| Const::new(x as f32).to_string();
    let hyper = vec![
        ("beta1".to_string(), h.beta1),
        ("shampoo_beta".to_string(), h.shampoo_beta),
        ("eps".to_string(), h.eps),
        ("weight_decay".to_string(), h.weight_decay),
        ("init_factor".to_string(), h.init_factor),
        ("max_clamp_value".to_string(), h.max_clamp_value),
    ];
    let m_new = format!("(+ (* m {}) (* g {}))", c(h.beta1), c(1.0 - h.beta1));
    let kept = format!("(select_lt 0.5 warm {m_new} m)");
    let momentum = ElementwiseRule {
        optimizer: NAME.to_string(),
        lr: h.lr,
        state: vec!["m".into()],
        outputs: vec!["m".into(), "mom".into()],
        scalars: vec![StepScalar::Warm],
        expr: format!("(list {kept} {kept})"),
        results: vec!["mom".into()],
        hyper: hyper.clone(),
    };
    let step = ElementwiseRule {
        optimizer: NAME.to_string(),
        lr: h.lr,
        state: vec![],
        outputs: vec!["p".into()],
        scalars: vec![
            StepScalar::Warm,
            StepScalar::Lr,
            StepScalar::Decay {
                weight_decay: h.weight_decay,
            },
        ],
        expr: "(list (select_lt 0.5 warm (* (- p (* lr g)) decay) p))".into(),
        results: vec![],
        hyper,
    };
    for r in [&momentum, &step] {
        crate::update::Program::new(&super::update_rule(r)?)?;
    }
    Ok((momentum, step))
}

/// The [`KlShampooHyper`] a composed rule carries in its `hyper` (with `lr` from the rule and
/// `normalize_grads` false), `None` when a key is missing.
pub fn hyper_of(rule: &ElementwiseRule) -> Option<KlShampooHyper> {
    let get = |k: &str| rule.hyper.iter().find(|h| h.0 == k).map(|h| h.1);
    Some(KlShampooHyper {
        lr: rule.lr,
        beta1: get("beta1")?,
        shampoo_beta: get("shampoo_beta")?,
        eps: get("eps")?,
        weight_decay: get("weight_decay")?,
        init_factor: get("init_factor")?,
        max_clamp_value: get("max_clamp_value")?,
        normalize_grads: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizers::{step_scalars, update_rule};
    use crate::update::{simplify, Program, UpdateRule};
    use crate::{KlShampooParams, KlSide};

    fn hyper(wd: f64) -> KlShampooHyper {
        KlShampooHyper {
            lr: 3e-3,
            beta1: 0.9,
            shampoo_beta: 0.98,
            eps: 1e-8,
            weight_decay: wd,
            init_factor: 0.1,
            max_clamp_value: 4000.0,
            normalize_grads: false,
        }
    }

    /// The composition (momentum rule, project, kl_scale, project back, step rule, factor
    /// update), its rules run through the interpreter after `simplify`, is bit-identical in f32
    /// to `kl_shampoo_update` on random inputs of awkward shapes, over several steps from the
    /// initialising t = 1 on, with both, one or no side preconditioned, with and without
    /// weight decay.
    fn side<'a>(f: &'a mut [f32], q: &'a Option<Vec<f32>>, e: &'a mut [f32]) -> KlSide<'a, f32> {
        KlSide {
            factor: q.is_some().then_some(f),
            basis: q.as_deref(),
            eig: e,
        }
    }

    #[test]
    fn composition_is_bit_identical_to_kl_shampoo_update() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 / (1u64 << 53) as f64) as f32 * 2.0 - 1.0
        };
        for (m, n, left, right, wd) in [
            (7, 13, true, true, 0.01),
            (13, 5, true, false, 0.0),
            (3, 17, false, true, 0.1),
            (6, 4, false, false, 0.01),
        ] {
            let h = hyper(wd);
            let (mr, sr) = rules(&h).expect("rules");
            let program = |r: &ElementwiseRule| {
                let u = update_rule(r).expect("test inputs are valid");
                let (expr, _) = simplify(&u.expr);
                Program::new(&UpdateRule { expr, ..u }).expect("test inputs are valid")
            };
            let (mp, sp) = (program(&mr), program(&sr));
            let hp = KlShampooParams {
                beta1: h.beta1,
                shampoo_beta: h.shampoo_beta,
                eps: h.eps,
                weight_decay: h.weight_decay,
                init_factor: h.init_factor,
                max_clamp_value: h.max_clamp_value,
                ..KlShampooParams::default()
            };
            let square = |d: usize, rnd: &mut dyn FnMut() -> f32| -> Vec<f32> {
                (0..d * d).map(|_| rnd()).collect()
            };
            let ql = left.then(|| square(m, &mut rnd));
            let qr = right.then(|| square(n, &mut rnd));
            let mut p: Vec<f32> = (0..m * n).map(|_| rnd()).collect();
            let mut ea = vec![0f32; m * n];
            let (mut fl, mut fr) = (vec![0f32; m * m], vec![0f32; n * n]);
            let (mut el, mut er) = (vec![0f32; m], vec![0f32; n]);
            let (mut p2, mut ea2, mut fl2, mut fr2, mut el2, mut er2) = (
                p.clone(),
                ea.clone(),
                fl.clone(),
                fr.clone(),
                el.clone(),
                er.clone(),
            );
            for t in 1..=4u64 {
                let g: Vec<f32> = (0..m * n).map(|_| rnd()).collect();
                let lr_t = h.lr * 0.5;
                crate::kl_shampoo_update(
                    t,
                    &hp,
                    lr_t,
                    &mut p,
                    &g,
                    &mut ea,
                    side(&mut fl, &ql, &mut el),
                    side(&mut fr, &qr, &mut er),
                    m,
                    n,
                )
                .expect("test inputs are valid");
                // The composition.
                let (mut pp, mut gg, mut mom) = (p2.clone(), g.clone(), vec![f32::NAN; m * n]);
                mp.run(
                    &mut [&mut pp, &mut gg, &mut ea2, &mut mom],
                    &step_scalars::<f32>(&mr, lr_t, t),
                )
                .expect("test inputs are valid");
                let x = crate::project(&mom, ql.as_deref(), qr.as_deref(), m, n);
                let y = crate::kl_scale(t, h.eps, &x, (&el2, &er2), m, n)
                    .expect("test inputs are valid");
                let mut u = crate::project_back(&y, ql.as_deref(), qr.as_deref(), m, n);
                sp.run(&mut [&mut p2, &mut u], &step_scalars::<f32>(&sr, lr_t, t))
                    .expect("test inputs are valid");
                crate::kl_factor_update(
                    t,
                    &hp,
                    &g,
                    (side(&mut fl2, &ql, &mut el2), side(&mut fr2, &qr, &mut er2)),
                    m,
                    n,
                )
                .expect("test inputs are valid");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let at = format!("{m}x{n} left {left} right {right} t={t}");
                assert_eq!(bits(&p), bits(&p2), "param, {at}");
                assert_eq!(bits(&ea), bits(&ea2), "exp_avg, {at}");
                assert_eq!(bits(&fl), bits(&fl2), "factor_left, {at}");
                assert_eq!(bits(&fr), bits(&fr2), "factor_right, {at}");
                assert_eq!(bits(&el), bits(&el2), "eig_left, {at}");
                assert_eq!(bits(&er), bits(&er2), "eig_right, {at}");
            }
        }
    }

    #[test]
    fn normalize_grads_is_refused_and_hyper_round_trips() {
        let mut h = hyper(0.01);
        let (mr, sr) = rules(&h).expect("test inputs are valid");
        assert_eq!(hyper_of(&mr), Some(h));
        assert_eq!(hyper_of(&sr), Some(h));
        h.normalize_grads = true;
        assert!(rules(&h).is_err());
    }
}
