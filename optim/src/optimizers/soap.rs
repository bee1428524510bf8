//! SOAP's per-step work as a composition (Vyas et al. 2024; `soap.py` `SOAP.step`): for a 2-D
//! parameter `[m, n]` with eigenbases `Q_L` `[m, m]` / `Q_R` `[n, n]` (a side over
//! `max_precond_dim` has none and is not rotated),
//!
//! ```text
//! G' = project(G)                          = Q_Lᵀ G Q_R         plan op `project`
//! m, v, U = moments(G', m, v)                                   elementwise_update (result U)
//! N = project_back(U)                      = Q_L U Q_Rᵀ         plan op `project { back }`
//! p = step(p, N)                                                elementwise_update
//! ```
//!
//! with the two element-wise steps written here once as update rules ([`rules`]):
//! `m ← β₁m + (1−β₁)G'`, `v ← β₂v + (1−β₂)G'²`, `U = m / (√v + ε)`, then
//! `p ← p − s·N` and `p ← p − lr·wd·p` with `s = lr·√(1−β₂ᵏ)/(1−β₁ᵏ)`, k = t − 1 (plain `lr`
//! without bias correction); nothing changes at t = 1 (`warm` = 0), where `soap.py` only
//! accumulates the factors. The factor accumulation (`soap_factor_update`) and the eigenbasis
//! refreshes (`eigenbasis_refresh`, method `soap`) are ops of their own either way.
//!
//! `expand-optimizer` writes this composition; on a CPU target `fuse` (rule `soap-update`)
//! replaces it by the hand-written `soap_update` op when the rules are exactly [`rules`] of the
//! hyperparameters they carry: the same f32 operations in the same order (the CPU engine's
//! results are bit-identical; `--skip-rule soap-update` runs the composition). A CUDA target
//! runs the composition (`project`'s GEMMs and the rules' generated kernels: faster on the
//! H200 than the hand-written op, BENCHMARKS.md) unless `--apply-rule soap-update`. `normalize_grads` divides by the
//! RMS of `N`, a reduction the rule language does not express: with it `expand-optimizer`
//! writes `soap_update` directly.
use crate::update::{Const, RuleError};
use schedule::{ElementwiseRule, SoapHyper, StepScalar};

/// The `optimizer` name of the composed rules (a kernel name suffix).
pub const NAME: &str = "soap";

/// The two element-wise steps of SOAP for `h` (which must not ask for `normalize_grads`):
/// `(moments, step)`. `moments` reads `g` (the projected gradient) and the state `m`
/// (`exp_avg`), `v` (`exp_avg_sq`), writes them and the result `u` (the update direction in
/// the eigenbasis); `step` reads `p` and `g` (the projected-back direction) and writes `p`.
/// Both carry `h` in their `hyper` (for `fuse`'s `soap-update`).
///
/// # Errors
/// [`RuleError::Outputs`] for `normalize_grads` (not expressible as an element-wise rule).
pub fn rules(h: &SoapHyper) -> Result<(ElementwiseRule, ElementwiseRule), RuleError> {
    if h.normalize_grads {
        return Err(RuleError::Outputs(
            "SOAP's normalize_grads divides by the update's RMS, a reduction".into(),
        ));
    }
    // Each constant rounded once from f64, as `optim::soap_update` rounds them.
    let c = |x: f64| Const::new(x as f32).to_string();
    let (b1, w1) = (c(h.beta1), c(1.0 - h.beta1));
    let (b2, w2) = (c(h.beta2), c(1.0 - h.beta2));
    let eps = c(h.eps);
    let m_new = format!("(+ (* m {b1}) (* g {w1}))");
    let v_new = format!("(+ (* v {b2}) (* (* g g) {w2}))");
    let moments_expr = format!(
        "(list (select_lt 0.5 warm {m_new} m) (select_lt 0.5 warm {v_new} v) \
         (/ {m_new} (+ (sqrt {v_new}) {eps})))"
    );
    let hyper = vec![
        ("beta1".to_string(), h.beta1),
        ("beta2".to_string(), h.beta2),
        ("eps".to_string(), h.eps),
        ("weight_decay".to_string(), h.weight_decay),
        (
            "correct_bias".to_string(),
            f64::from(u8::from(h.correct_bias)),
        ),
    ];
    let moments = ElementwiseRule {
        optimizer: NAME.to_string(),
        lr: h.lr,
        state: vec!["m".into(), "v".into()],
        outputs: vec!["m".into(), "v".into(), "u".into()],
        scalars: vec![StepScalar::Warm],
        expr: moments_expr,
        results: vec!["u".into()],
        hyper: hyper.clone(),
    };
    let (step, step_scalar) = match h.correct_bias {
        true => (
            "soap_step",
            StepScalar::SoapStep {
                beta1: h.beta1,
                beta2: h.beta2,
            },
        ),
        false => ("lr", StepScalar::Lr),
    };
    let stepped = format!("(+ p (* (neg {step}) g))");
    let mut scalars = vec![StepScalar::Warm, step_scalar];
    let new_p = match h.weight_decay > 0.0 {
        true => {
            scalars.push(StepScalar::NegLrWd {
                weight_decay: h.weight_decay,
            });
            format!("(+ {stepped} (* neg_lr_wd {stepped}))")
        }
        false => stepped,
    };
    let step = ElementwiseRule {
        optimizer: NAME.to_string(),
        lr: h.lr,
        state: vec![],
        outputs: vec!["p".into()],
        scalars,
        expr: format!("(list (select_lt 0.5 warm {new_p} p))"),
        results: vec![],
        hyper,
    };
    for r in [&moments, &step] {
        crate::update::Program::new(&super::update_rule(r)?)?;
    }
    Ok((moments, step))
}

/// The [`SoapHyper`] a composed rule carries in its `hyper` (with `lr` from the rule and
/// `normalize_grads` false), `None` when a key is missing.
pub fn hyper_of(rule: &ElementwiseRule) -> Option<SoapHyper> {
    let get = |k: &str| rule.hyper.iter().find(|h| h.0 == k).map(|h| h.1);
    Some(SoapHyper {
        lr: rule.lr,
        beta1: get("beta1")?,
        beta2: get("beta2")?,
        eps: get("eps")?,
        weight_decay: get("weight_decay")?,
        correct_bias: get("correct_bias")? != 0.0,
        normalize_grads: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizers::{step_scalars, update_rule};
    use crate::update::{simplify, Program, UpdateRule};
    use crate::SoapParams;

    fn hyper(wd: f64, correct_bias: bool) -> SoapHyper {
        SoapHyper {
            lr: 3e-3,
            beta1: 0.95,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: wd,
            correct_bias,
            normalize_grads: false,
        }
    }

    /// The composition (project, moments rule, project back, step rule) run through the rule
    /// interpreter is bit-identical in f32 to `soap_update` on random inputs of awkward
    /// shapes, over several steps from t = 1 (no update) on, with and without weight decay,
    /// bias correction and either side's basis.
    #[test]
    fn composition_is_bit_identical_to_soap_update() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 / (1u64 << 53) as f64) as f32 * 2.0 - 1.0
        };
        for (m, n, left, right, wd, cb) in [
            (7, 13, true, true, 0.01, true),
            (13, 5, true, false, 0.0, true),
            (3, 17, false, true, 0.1, false),
            (1, 9, false, false, 0.01, true),
        ] {
            let h = hyper(wd, cb);
            let (mr, sr) = rules(&h).expect("rules");
            // As the plan runs them: after `simplify`.
            let program = |r: &ElementwiseRule| {
                let u = update_rule(r).expect("test inputs are valid");
                let (expr, _) = simplify(&u.expr);
                Program::new(&UpdateRule { expr, ..u }).expect("test inputs are valid")
            };
            let (mp, sp) = (program(&mr), program(&sr));
            let hp = SoapParams {
                beta1: h.beta1,
                beta2: h.beta2,
                eps: h.eps,
                weight_decay: h.weight_decay,
                correct_bias: h.correct_bias,
                normalize_grads: false,
            };
            let square = |d: usize, rnd: &mut dyn FnMut() -> f32| -> Vec<f32> {
                (0..d * d).map(|_| rnd()).collect()
            };
            let ql = left.then(|| square(m, &mut rnd));
            let qr = right.then(|| square(n, &mut rnd));
            let mut p: Vec<f32> = (0..m * n).map(|_| rnd()).collect();
            let (mut ea, mut eas) = (vec![0f32; m * n], vec![0f32; m * n]);
            let (mut p2, mut ea2, mut eas2) = (p.clone(), ea.clone(), eas.clone());
            for t in 1..=4u64 {
                let g: Vec<f32> = (0..m * n).map(|_| rnd()).collect();
                let lr_t = h.lr * 0.5;
                crate::soap_update(
                    t,
                    lr_t,
                    &hp,
                    &mut p,
                    &g,
                    &mut ea,
                    &mut eas,
                    ql.as_deref(),
                    qr.as_deref(),
                    m,
                    n,
                )
                .expect("test inputs are valid");
                let mut gp = crate::project(&g, ql.as_deref(), qr.as_deref(), m, n);
                let mut u = vec![f32::NAN; m * n];
                let mut pp = p2.clone();
                mp.run(
                    &mut [&mut pp, &mut gp, &mut ea2, &mut eas2, &mut u],
                    &step_scalars::<f32>(&mr, lr_t, t),
                )
                .expect("test inputs are valid");
                let mut nn = crate::project_back(&u, ql.as_deref(), qr.as_deref(), m, n);
                sp.run(&mut [&mut p2, &mut nn], &step_scalars::<f32>(&sr, lr_t, t))
                    .expect("test inputs are valid");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&p), bits(&p2), "param, {m}x{n} t={t}");
                assert_eq!(bits(&ea), bits(&ea2), "exp_avg, {m}x{n} t={t}");
                assert_eq!(bits(&eas), bits(&eas2), "exp_avg_sq, {m}x{n} t={t}");
            }
        }
    }

    #[test]
    fn normalize_grads_is_refused_and_hyper_round_trips() {
        let mut h = hyper(0.01, true);
        let (mr, sr) = rules(&h).expect("test inputs are valid");
        assert_eq!(hyper_of(&mr), Some(h));
        assert_eq!(hyper_of(&sr), Some(h));
        h.normalize_grads = true;
        assert!(rules(&h).is_err());
    }
}
