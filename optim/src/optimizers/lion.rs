//! Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2;
//! defaults of `lucidrains/lion-pytorch`): with `c = β₁·m + (1 − β₁)·g`,
//! `p ← p·(1 − lr·wd) − lr·sign(c)` and `m ← β₂·m + (1 − β₂)·g`. One state tensor, the
//! momentum `m`; the update's magnitude is `lr` in every coordinate, so its `lr` is 3–10×
//! smaller than AdamW's and its weight decay as much larger.
use super::{Definition, Key, KeyKind, StateTensor};
use schedule::{limits, BufferClass};

/// Lion.
pub const LION: Definition = Definition {
    name: "lion",
    summary: "Lion (Chen et al. 2023): sign of an interpolated momentum, one state tensor",
    keys: &[
        Key {
            name: "lr",
            kind: KeyKind::Float(1e-4),
            range: limits::LR,
        },
        Key {
            name: "betas",
            kind: KeyKind::Pair(["beta1", "beta2"], (0.9, 0.99)),
            range: limits::BETA,
        },
        Key {
            name: "weight_decay",
            kind: KeyKind::Float(0.0),
            range: limits::WEIGHT_DECAY,
        },
    ],
    state: &[StateTensor {
        var: "m",
        suffix: "exp_avg",
        class: BufferClass::ExpAvg,
    }],
    outputs: &["m", "p"],
    rule: "(list (+ (* $beta2 m) (* (- 1 $beta2) g)) \
           (- (* p decay) (* lr (sign (+ (* $beta1 m) (* (- 1 $beta1) g))))))",
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optimizers::{reference, reference::rel, step_scalars};

    /// Lion against a float64 re-implementation of Algorithm 2: the simplified rule run in
    /// f64, 25 steps with a warmup-like lr schedule, ≤ 1e-6 relative. (The rule's constants are
    /// f32 values: β₁ = 0.9 is 0.89999998, and `1 − β₁` is folded in f32.)
    #[test]
    fn lion_follows_its_reference_algorithm() {
        let (beta1, beta2, wd) = (0.9, 0.99, 0.1);
        let (rule, prog) = reference::simplified(&LION, wd);
        let n = 513;
        let mut uniform = reference::uniform(7);
        let mut p: Vec<f64> = (0..n).map(|_| uniform()).collect();
        let mut m = vec![0.0f64; n];
        let (mut p64, mut m64) = (p.clone(), m.clone());
        for t in 1..=25u64 {
            let lr_t = 1e-4 * (t as f64 / 25.0);
            let mut grad: Vec<f64> = (0..n).map(|_| uniform()).collect();
            for i in 0..n {
                let c = beta1 * m64[i] + (1.0 - beta1) * grad[i];
                let sign = if c > 0.0 {
                    1.0
                } else if c < 0.0 {
                    -1.0
                } else {
                    0.0
                };
                p64[i] = p64[i] * (1.0 - lr_t * wd) - lr_t * sign;
                m64[i] = beta2 * m64[i] + (1.0 - beta2) * grad[i];
            }
            let scalars: Vec<f64> = step_scalars(&rule, lr_t, t);
            let mut refs: Vec<&mut [f64]> = vec![&mut p, &mut grad, &mut m];
            prog.run(&mut refs, &scalars).expect("run");
        }
        assert!(rel(&p, &p64) <= 1e-6, "p {}", rel(&p, &p64));
        assert!(rel(&m, &m64) <= 1e-6, "m {}", rel(&m, &m64));
    }
}
