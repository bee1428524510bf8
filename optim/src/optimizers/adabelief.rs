//! AdaBelief (Zhuang et al. 2020, "AdaBelief Optimizer: Adapting Stepsizes by the Belief in
//! Observed Gradients", Algorithm 2; defaults and decoupled weight decay of
//! `juntang-zhuang/Adabelief-Optimizer`'s `AdaBelief(weight_decouple=True, rectify=False)`):
//! Adam whose second moment tracks the gradient's deviation from its momentum instead of its
//! square. With `m' = β₁·m + (1 − β₁)·g` and `s' = β₂·s + (1 − β₂)·(g − m')² + ε`,
//! `p ← p·(1 − lr·wd) − lr/(1 − β₁ᵗ) · m' / (√s' / √(1 − β₂ᵗ) + ε)`. Two state tensors, the
//! momentum `m` and the "belief" `s` (`exp_avg_var`); ε is added to `s` at every step as the
//! reference does in place.
use super::{Definition, Key, KeyKind, StateTensor};
use schedule::{limits, BufferClass};

/// AdaBelief.
pub const ADABELIEF: Definition = Definition {
    name: "adabelief",
    summary: "AdaBelief (Zhuang et al. 2020): Adam with the variance of g around its momentum",
    keys: &[
        Key {
            name: "lr",
            kind: KeyKind::Float(1e-3),
            range: limits::LR,
        },
        Key {
            name: "betas",
            kind: KeyKind::Pair(["beta1", "beta2"], (0.9, 0.999)),
            range: limits::BETA,
        },
        Key {
            name: "eps",
            kind: KeyKind::Float(1e-16),
            range: limits::EPS,
        },
        Key {
            name: "weight_decay",
            kind: KeyKind::Float(0.0),
            range: limits::WEIGHT_DECAY,
        },
    ],
    state: &[
        StateTensor {
            var: "m",
            suffix: "exp_avg",
            class: BufferClass::ExpAvg,
        },
        StateTensor {
            var: "s",
            suffix: "exp_avg_var",
            class: BufferClass::ExpAvgSq,
        },
    ],
    outputs: &["m", "s", "p"],
    rule: "(list (+ (* $beta1 m) (* (- 1 $beta1) g)) \
           (+ (+ (* $beta2 s) (* (* (- 1 $beta2) (- g (+ (* $beta1 m) (* (- 1 $beta1) g)))) \
                                 (- g (+ (* $beta1 m) (* (- 1 $beta1) g))))) $eps) \
           (- (* p decay) \
              (* step_size (/ (+ (* $beta1 m) (* (- 1 $beta1) g)) \
                              (+ (/ (sqrt (+ (+ (* $beta2 s) \
                                                (* (* (- 1 $beta2) (- g (+ (* $beta1 m) (* (- 1 $beta1) g)))) \
                                                   (- g (+ (* $beta1 m) (* (- 1 $beta1) g))))) $eps)) \
                                    bc2_sqrt) $eps)))))",
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizers::{reference, reference::rel, step_scalars};

    /// AdaBelief against a float64 re-implementation of the reference's step (Algorithm 2 with
    /// decoupled weight decay and ε added to `s` in place): the simplified rule run in f64, 25
    /// steps with a warmup-like lr schedule, ≤ 1e-6 relative, on an awkward length. The rule's
    /// constants are f32 values (β₂ = 0.999 is 0.99900001), folded in f32 by `simplify`; `egg`
    /// must find the shared momentum and deviation (fewer nodes after than before).
    #[test]
    fn adabelief_follows_its_reference_algorithm() {
        let (beta1, beta2, eps, wd) = (0.9f32 as f64, 0.999f32 as f64, 1e-16f32 as f64, 0.1);
        let (rule, prog) = reference::simplified(&ADABELIEF, wd);
        let n = 517;
        let mut uniform = reference::uniform(11);
        let mut p: Vec<f64> = (0..n).map(|_| uniform()).collect();
        let (mut m, mut s) = (vec![0.0f64; n], vec![0.0f64; n]);
        let (mut p64, mut m64, mut s64) = (p.clone(), m.clone(), s.clone());
        for t in 1..=25u64 {
            let lr_t = 1e-3 * (t as f64 / 25.0);
            let mut grad: Vec<f64> = (0..n).map(|_| uniform()).collect();
            let bc1 = 1.0 - beta1.powi(t as i32);
            let bc2 = 1.0 - beta2.powi(t as i32);
            for i in 0..n {
                m64[i] = beta1 * m64[i] + (1.0 - beta1) * grad[i];
                let d = grad[i] - m64[i];
                s64[i] = beta2 * s64[i] + (1.0 - beta2) * d * d + eps;
                let denom = s64[i].sqrt() / bc2.sqrt() + eps;
                p64[i] = p64[i] * (1.0 - lr_t * wd) - lr_t / bc1 * m64[i] / denom;
            }
            let scalars: Vec<f64> = step_scalars(&rule, lr_t, t);
            let mut refs: Vec<&mut [f64]> = vec![&mut p, &mut grad, &mut m, &mut s];
            prog.run(&mut refs, &scalars).expect("run");
        }
        assert!(rel(&p, &p64) <= 1e-6, "p {}", rel(&p, &p64));
        assert!(rel(&m, &m64) <= 1e-6, "m {}", rel(&m, &m64));
        assert!(rel(&s, &s64) <= 1e-6, "s {}", rel(&s, &s64));
    }
}
