//! Kernels generated from update rules (`RuleKernel`) against the rule interpreter
//! (`optim::update::Program` at f32), bit for bit: AdamW as a rule and every optimizer of
//! `optim::optimizers`, on awkward lengths (empty, the scalar tail alone, vector + tail, the
//! parallel chunked path), with random values mixed with exact zeros (both signs),
//! subnormals and large magnitudes, over several steps.
use hostkernels::{KernelError, Operand, RuleKernel};
use optim::optimizers::{step_scalars, update_rule, DEFINITIONS};
use optim::update::{adamw_rule, simplify, Program, UpdateRule};

struct Gen(u64);
impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) as f32
    }
    /// Mostly N-ish values, with zeros of both signs, subnormals and large values mixed in.
    fn value(&mut self, positive: bool) -> f32 {
        let x = match self.next() % 16 {
            0 => 0.0,
            1 => -0.0,
            2 => 1e-40,
            3 => 3e4,
            _ => self.unit() - 0.5,
        };
        if positive {
            x.abs() + 1e-6
        } else {
            x
        }
    }
}

/// AdamW as a rule, and every definition at weight decay 0.1 and at 0; each with its step-3
/// scalars and whether each tensor must stay positive (second moments).
fn rules() -> Vec<(String, UpdateRule, Vec<f32>, Vec<bool>)> {
    let t = 3;
    let adamw_scalars = vec![
        (1.0 - 3e-4 * 0.1) as f32,
        (3e-4 / (1.0 - 0.9f64.powi(t))) as f32,
        (1.0 - 0.95f64.powi(t)).sqrt() as f32,
    ];
    let mut v = vec![(
        "adamw".to_string(),
        adamw_rule(0.9, 0.95, 1e-8, 0.1),
        adamw_scalars,
        vec![false, false, false, true],
    )];
    for d in DEFINITIONS {
        for wd in [0.1, 0.0] {
            let rule = d.plan_rule(&[("weight_decay".into(), wd)]).expect("rule");
            let scalars = step_scalars(&rule, 3e-4, 3);
            let mut positive = vec![false, false];
            positive.extend(
                d.state
                    .iter()
                    .map(|s| s.class == schedule::BufferClass::ExpAvgSq),
            );
            let r = update_rule(&rule).expect("update rule");
            v.push((format!("{} wd {wd}", d.name), r, scalars, positive));
        }
    }
    v.into_iter()
        .map(|(n, r, s, p)| {
            let (expr, _) = simplify(&r.expr);
            (n, UpdateRule { expr, ..r }, s, p)
        })
        .collect()
}

#[test]
fn generated_host_kernels_are_the_interpreter_bit_for_bit() {
    let mut g = Gen(11);
    for (name, rule, scalars, positive) in rules() {
        let kernel = RuleKernel::compile(&rule).unwrap_or_else(|e| panic!("{name}: {e}"));
        let prog = Program::new(&rule).expect("program");
        for n in [0usize, 1, 3, 4, 5, 17, 1037, (1 << 18) + 7] {
            let mut a: Vec<Vec<f32>> = positive
                .iter()
                .map(|&p| (0..n).map(|_| g.value(p)).collect())
                .collect();
            let mut b = a.clone();
            for step in 0..3 {
                // `g` (tensor 1) read-only, as the engines pass it.
                let mut ra: Vec<Operand<'_>> = a
                    .iter_mut()
                    .enumerate()
                    .map(|(i, v)| match i {
                        1 => Operand::Read(v.as_slice()),
                        _ => Operand::Write(v.as_mut_slice()),
                    })
                    .collect();
                kernel.run(&mut ra, &scalars).expect("kernel");
                let mut rb: Vec<&mut [f32]> = b.iter_mut().map(|v| v.as_mut_slice()).collect();
                prog.run(&mut rb, &scalars).expect("interpreter");
                for (t, (x, y)) in a.iter().zip(&b).enumerate() {
                    for (i, (p, q)) in x.iter().zip(y).enumerate() {
                        assert!(
                            p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()),
                            "{name} n={n} step {step}: tensor {} [{i}]: {p:e} vs {q:e}",
                            rule.tensors[t]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn mismatched_operands_are_errors_and_modify_nothing() {
    let (_, rule, scalars, _) = rules().remove(0);
    let kernel = RuleKernel::compile(&rule).expect("kernel");
    let mut a = vec![vec![1.0f32; 8], vec![1.0; 8], vec![1.0; 8], vec![1.0; 7]];
    let mut r: Vec<Operand<'_>> = a.iter_mut().map(|v| Operand::Write(v)).collect();
    assert!(matches!(
        kernel.run(&mut r, &scalars),
        Err(KernelError::Rule(_))
    ));
    let mut r: Vec<Operand<'_>> = a.iter_mut().take(3).map(|v| Operand::Write(v)).collect();
    assert!(matches!(
        kernel.run(&mut r, &scalars),
        Err(KernelError::Rule(_))
    ));
    a[3].push(1.0);
    // `p` (written by AdamW) passed read-only.
    let mut r: Vec<Operand<'_>> = a
        .iter_mut()
        .enumerate()
        .map(|(i, v)| {
            if i == 0 {
                Operand::Read(v)
            } else {
                Operand::Write(v)
            }
        })
        .collect();
    assert!(matches!(
        kernel.run(&mut r, &scalars),
        Err(KernelError::Rule(_))
    ));
    assert!(a.iter().all(|v| v.iter().all(|&x| x == 1.0)));
    let mut bad = rule.clone();
    bad.scalars.pop();
    assert!(matches!(
        RuleKernel::compile(&bad),
        Err(KernelError::Rule(_))
    ));
}
