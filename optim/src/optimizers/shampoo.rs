//! Shampoo's per-step work as a composition (Distributed Shampoo's semantics,
//! `docs/shampoo.md`; `crate::shampoo_update` is the same composition in one op): for a
//! parameter cut into the blocks of `schedule::blocking::blocks(shape, max_preconditioner_dim)`,
//! with the Kronecker factors `F` and inverse roots `R` of every side of every block,
//!
//! ```text
//! shampoo_factor_update(G, F...)        F_k ← a·F_k + c·C_k per block       matrix work
//! Ḡ, Pg = moments(G, M, V)              M, V updated; Ḡ = M/(1−β₁ᵗ), Pg = Ḡ/(√(V/(1−γ₂ᵗ))+γ_ε)
//! P  = shampoo_precondition(Ḡ, R...)    R_1ᵀ Ḡ_b R_2 per block                matrix work
//! D  = graft(P, Pg)                     P_b·‖Pg_b‖/(‖P_b‖+1e-16); Pg at t = 1  (grafting only)
//! W  = step(W, D)                       W − lr·(D + wd·W)                    element-wise
//! ```
//!
//! The two element-wise steps are written here once as update rules ([`rules`]); the matrix
//! work is the plan ops `shampoo_factor_update`, `shampoo_precondition` and `graft`, and the
//! inverse roots are refreshed by `eigenbasis_refresh` host tasks with method `inverse_root`
//! (off the critical path, as SOAP's eigenbases). `expand-optimizer` writes this composition;
//! `fuse` (rule `shampoo-update`) replaces it by the hand-written `shampoo_update` op when the
//! rules are exactly [`rules`] of the hyperparameters they carry (the CPU engine's results are
//! bit-identical either way; the CUDA engine runs only the fused op).
use crate::update::{Const, RuleError};
use schedule::{ElementwiseRule, ShampooHyper, StepScalar};

/// The `optimizer` name of the composed rules (a kernel name suffix).
pub const NAME: &str = "shampoo";

/// The two element-wise steps of Shampoo for `h`: `(moments, step)`.
///
/// `moments` (`None` when β₁ = 0 and there is no grafting: then `Ḡ = G` and nothing is kept)
/// reads `g` (the gradient) and the state `m` (`exp_avg`, when β₁ ≠ 0) and `v` (`graft_sq`,
/// with grafting); writes them and the results `gbar` (`Ḡ`, when β₁ ≠ 0) and `pg` (the Adam
/// grafting step, with grafting). `step` reads `p` and `g` (the grafted direction) and writes
/// `p`. Both carry `h` in their `hyper` (for `fuse`'s `shampoo-update`). Every constant is
/// rounded once from f64, and every operation is the one `crate::shampoo_update` performs, in
/// its order.
///
/// # Errors
/// [`RuleError`] if a generated rule does not build (a bug).
pub fn rules(h: &ShampooHyper) -> Result<(Option<ElementwiseRule>, ElementwiseRule), RuleError> {
    let c = |x: f64| Const::new(x as f32).to_string();
    let hyper = vec![
        ("beta1".to_string(), h.beta1),
        ("beta2".to_string(), h.beta2),
        ("epsilon".to_string(), h.epsilon),
        ("weight_decay".to_string(), h.weight_decay),
        (
            "use_bias_correction".to_string(),
            f64::from(u8::from(h.use_bias_correction)),
        ),
        (
            "max_preconditioner_dim".to_string(),
            h.max_preconditioner_dim as f64,
        ),
        ("grafting".to_string(), f64::from(u8::from(h.grafting))),
        ("grafting_beta2".to_string(), h.grafting_beta2),
        ("grafting_epsilon".to_string(), h.grafting_epsilon),
    ];
    let (mut state, mut outputs, mut results, mut items, mut scalars) =
        (vec![], vec![], vec![], vec![], vec![]);
    // Ḡ: the bias-corrected first moment, or the gradient itself.
    let gbar = match h.beta1 != 0.0 {
        true => {
            let m_new = format!("(+ (* m {}) (* g {}))", c(h.beta1), c(1.0 - h.beta1));
            state.push("m");
            outputs.push("m");
            items.push(m_new.clone());
            let gbar = match h.use_bias_correction {
                true => {
                    scalars.push(StepScalar::Bc1 { beta1: h.beta1 });
                    format!("(/ {m_new} bc1)")
                }
                false => m_new,
            };
            results.push("gbar");
            outputs.push("gbar");
            items.push(gbar.clone());
            gbar
        }
        false => "g".to_string(),
    };
    if h.grafting {
        let v_new = format!(
            "(+ (* v {}) (* (* g {}) g))",
            c(h.grafting_beta2),
            c(1.0 - h.grafting_beta2)
        );
        scalars.push(StepScalar::Bc2 {
            beta2: h.grafting_beta2,
        });
        state.push("v");
        // The rule's outputs: the state first (in its order), then the results.
        outputs.insert(usize::from(h.beta1 != 0.0), "v");
        items.insert(usize::from(h.beta1 != 0.0), v_new.clone());
        results.push("pg");
        outputs.push("pg");
        items.push(format!(
            "(/ {gbar} (+ (sqrt (/ {v_new} bc2)) {}))",
            c(h.grafting_epsilon)
        ));
    }
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let moments = (!state.is_empty()).then(|| ElementwiseRule {
        optimizer: NAME.to_string(),
        lr: h.lr,
        state: strings(&state),
        outputs: strings(&outputs),
        scalars: scalars.clone(),
        expr: format!("(list {})", items.join(" ")),
        results: strings(&results),
        hyper: hyper.clone(),
    });
    let step = ElementwiseRule {
        optimizer: NAME.to_string(),
        lr: h.lr,
        state: vec![],
        outputs: vec!["p".into()],
        scalars: vec![StepScalar::Lr],
        expr: format!("(list (- p (* lr (+ g (* {} p)))))", c(h.weight_decay)),
        results: vec![],
        hyper,
    };
    for r in moments.iter().chain([&step]) {
        crate::update::Program::new(&super::update_rule(r)?)?;
    }
    Ok((moments, step))
}

/// The [`ShampooHyper`] a composed rule carries in its `hyper` (with `lr` from the rule),
/// `None` when a key is missing.
pub fn hyper_of(rule: &ElementwiseRule) -> Option<ShampooHyper> {
    let get = |k: &str| rule.hyper.iter().find(|h| h.0 == k).map(|h| h.1);
    Some(ShampooHyper {
        lr: rule.lr,
        beta1: get("beta1")?,
        beta2: get("beta2")?,
        epsilon: get("epsilon")?,
        weight_decay: get("weight_decay")?,
        use_bias_correction: get("use_bias_correction")? != 0.0,
        max_preconditioner_dim: get("max_preconditioner_dim")? as u64,
        grafting: get("grafting")? != 0.0,
        grafting_beta2: get("grafting_beta2")?,
        grafting_epsilon: get("grafting_epsilon")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizers::{step_scalars, update_rule};
    use crate::update::{simplify, Program, UpdateRule};
    use crate::{AdamGrafting, ShampooParams};

    fn hyper(beta1: f64, beta2: f64, wd: f64, bias: bool, grafting: bool, b: u64) -> ShampooHyper {
        ShampooHyper {
            lr: 3e-3,
            beta1,
            beta2,
            epsilon: 1e-8,
            weight_decay: wd,
            use_bias_correction: bias,
            max_preconditioner_dim: b,
            grafting,
            grafting_beta2: 0.95,
            grafting_epsilon: 1e-8,
        }
    }

    /// The composition (factor update, moments rule, preconditioning, grafting, step rule),
    /// its rules run through the interpreter after `simplify`, is bit-identical in f32 to
    /// `shampoo_update` on random inputs of awkward shapes (several blocks, a vector, blocks
    /// of unequal size), over several steps from t = 1 on, across β₁ = 0, β₂ = 1 and < 1,
    /// with and without bias correction, grafting and weight decay.
    #[test]
    fn composition_is_bit_identical_to_shampoo_update() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 / (1u64 << 53) as f64) as f32 * 2.0 - 1.0
        };
        let cases: [(&[usize], ShampooHyper); 5] = [
            (&[7, 13], hyper(0.9, 1.0, 0.01, true, true, 5)),
            (&[13, 5], hyper(0.95, 0.99, 0.0, true, false, 8)),
            (&[19], hyper(0.9, 0.95, 0.1, false, true, 8)),
            (&[6, 9], hyper(0.0, 1.0, 0.0, true, true, 64)),
            (&[4, 3], hyper(0.0, 0.9, 0.01, true, false, 2)),
        ];
        for (shape, h) in cases {
            let (mr, sr) = rules(&h).expect("rules");
            let program = |r: &ElementwiseRule| {
                let u = update_rule(r).expect("test inputs are valid");
                let (expr, _) = simplify(&u.expr);
                Program::new(&UpdateRule { expr, ..u }).expect("test inputs are valid")
            };
            let (mp, sp) = (mr.as_ref().map(program), program(&sr));
            let b = h.max_preconditioner_dim as usize;
            let hp = ShampooParams {
                beta1: h.beta1,
                beta2: h.beta2,
                epsilon: h.epsilon,
                weight_decay: h.weight_decay,
                max_preconditioner_dim: b,
                use_bias_correction: h.use_bias_correction,
                grafting: h.grafting.then_some(AdamGrafting {
                    beta2: h.grafting_beta2,
                    epsilon: h.grafting_epsilon,
                }),
                ..ShampooParams::default()
            };
            let (_, blocks) = crate::shampoo_blocks(shape, b);
            let sides: Vec<usize> = blocks.iter().flat_map(|bl| bl.sides()).collect();
            let n: usize = shape.iter().product();
            let mut p: Vec<f32> = (0..n).map(|_| rnd()).collect();
            let (mut ea, mut gs) = (vec![0f32; n], vec![0f32; n]);
            let mut fs: Vec<Vec<f32>> = sides.iter().map(|d| vec![0f32; d * d]).collect();
            let roots: Vec<Vec<f32>> = sides
                .iter()
                .map(|d| (0..d * d).map(|_| rnd()).collect())
                .collect();
            let (mut p2, mut ea2, mut gs2, mut fs2) =
                (p.clone(), ea.clone(), gs.clone(), fs.clone());
            let rr: Vec<&[f32]> = roots.iter().map(|r| r.as_slice()).collect();
            for t in 1..=4u64 {
                let g: Vec<f32> = (0..n).map(|_| rnd()).collect();
                let lr_t = h.lr * 0.5;
                let mut fm: Vec<&mut [f32]> = fs.iter_mut().map(|f| f.as_mut_slice()).collect();
                let graft_sq = h.grafting.then_some(gs.as_mut_slice());
                crate::shampoo_update(
                    t, &hp, lr_t, &mut p, &g, &mut ea, graft_sq, shape, &mut fm, &rr,
                )
                .expect("test inputs are valid");
                // The composition.
                let mut fm2: Vec<&mut [f32]> = fs2.iter_mut().map(|f| f.as_mut_slice()).collect();
                crate::shampoo_factor_update(
                    t,
                    (h.beta2, h.use_bias_correction),
                    (shape, b),
                    &g,
                    &mut fm2,
                )
                .expect("test inputs are valid");
                let (mut gbar, mut pg) = (g.clone(), vec![f32::NAN; n]);
                if let (Some(mp), Some(mr)) = (&mp, &mr) {
                    let (mut pp, mut gg) = (p2.clone(), g.clone());
                    let mut tensors: Vec<&mut [f32]> = vec![&mut pp, &mut gg];
                    if h.beta1 != 0.0 {
                        tensors.push(&mut ea2);
                    }
                    if h.grafting {
                        tensors.push(&mut gs2);
                    }
                    if h.beta1 != 0.0 {
                        tensors.push(&mut gbar);
                    }
                    if h.grafting {
                        tensors.push(&mut pg);
                    }
                    mp.run(&mut tensors, &step_scalars::<f32>(mr, lr_t, t))
                        .expect("test inputs are valid");
                }
                let mut dir = crate::shampoo_precondition((shape, b), &gbar, &rr)
                    .expect("test inputs are valid");
                if h.grafting {
                    dir = crate::graft(t, (shape, b), &dir, &pg).expect("test inputs are valid");
                }
                sp.run(&mut [&mut p2, &mut dir], &step_scalars::<f32>(&sr, lr_t, t))
                    .expect("test inputs are valid");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&p), bits(&p2), "param, {shape:?} t={t}");
                assert_eq!(bits(&ea), bits(&ea2), "exp_avg, {shape:?} t={t}");
                assert_eq!(bits(&gs), bits(&gs2), "graft_sq, {shape:?} t={t}");
                for (f, f2) in fs.iter().zip(&fs2) {
                    assert_eq!(bits(f), bits(f2), "factor, {shape:?} t={t}");
                }
            }
        }
    }

    #[test]
    fn hyper_round_trips_and_beta1_zero_without_grafting_has_no_moments() {
        let h = hyper(0.9, 1.0, 0.01, true, true, 1024);
        let (mr, sr) = rules(&h).expect("test inputs are valid");
        assert_eq!(hyper_of(&mr.expect("moments")), Some(h));
        assert_eq!(hyper_of(&sr), Some(h));
        let (mr, _) =
            rules(&hyper(0.0, 1.0, 0.0, true, false, 1024)).expect("test inputs are valid");
        assert!(mr.is_none());
    }
}
