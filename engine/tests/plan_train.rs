//! The interpreter on a hand-built one-block GPT plan: whole-model gradients against finite
//! differences (f64), loss reduction with AdamW and SOAP (f32), determinism, skipped steps,
//! refresh failure handling, tampered plans, and the timing of the tiny GPT-2-vocabulary model.
mod common;

use common::gpt::{plan, Gpt};
use common::rand_ids;
use engine::{CpuEngine, EngineError, EngineOptions, Rng};
use optim::{EigenError, Eigh, HostEigensolver};
use schedule::{BufferId, Op, PlanError};
use std::sync::Arc;

/// A fixed batch whose targets are a deterministic function of the tokens (learnable).
fn batch(g: &Gpt, seed: u64) -> (Vec<i32>, Vec<i32>) {
    let mut rng = Rng::new(seed);
    let x = rand_ids(&mut rng, g.batch * g.seq, g.vocab);
    let y = x.iter().map(|&t| (t * 7 + 3) % g.vocab as i32).collect();
    (x, y)
}

#[test]
fn whole_model_gradients_match_finite_differences() {
    let g = Gpt {
        layers: 2,
        ..Gpt::tiny(false)
    };
    let p = plan(&g);
    let mut e = CpuEngine::<f64>::new(p.clone(), EngineOptions::default()).expect("valid plan");
    // Non-trivial norm weights and biases so every path carries gradient.
    let mut rng = Rng::new(5);
    for (name, v) in e.params() {
        let jitter: Vec<f64> = v.iter().map(|x| x + 0.1 * rng.normal()).collect();
        e.set_buffer(&name, &jitter).expect("set");
    }
    let (x, y) = batch(&g, 1);
    e.load_batch(&x, &y).expect("batch");
    e.forward().expect("forward");
    e.backward().expect("backward");
    let h = 1e-5;
    let mut worst: f64 = 0.0;
    for r in &p.params {
        let name = p.buffers[r.param.index()].name.clone();
        let gname = p.buffers[r.grad.index()].name.clone();
        let grad = e.buffer(&gname).expect("grad");
        let base = e.buffer(&name).expect("param");
        let scale = grad.iter().fold(1e-30f64, |a, v| a.max(v.abs()));
        for k in 0..5 {
            let i = (rng.next_u64() as usize) % base.len();
            let mut probe = base.clone();
            probe[i] = base[i] + h;
            e.set_buffer(&name, &probe).expect("set");
            let lp = e.forward().expect("forward");
            probe[i] = base[i] - h;
            e.set_buffer(&name, &probe).expect("set");
            let lm = e.forward().expect("forward");
            e.set_buffer(&name, &base).expect("restore");
            let num = (lp - lm) / (2.0 * h);
            let err = (num - grad[i]).abs() / scale.max(num.abs());
            worst = worst.max(err);
            assert!(
                err < 1e-6,
                "{name}[{i}] (probe {k}): analytic {} numeric {num} rel err {err:e}",
                grad[i]
            );
        }
    }
    eprintln!("whole-model worst relative gradient error {worst:e}");
}

fn train_fixed_batch(soap: bool, steps: u64) -> (f64, f64, CpuEngine<f32>) {
    let g = Gpt {
        lr: 1e-2,
        ..Gpt::tiny(soap)
    };
    let mut e = CpuEngine::<f32>::new(plan(&g), EngineOptions::default()).expect("valid plan");
    let (x, y) = batch(&g, 2);
    let mut first = f64::NAN;
    let mut last = f64::NAN;
    for t in 1..=steps {
        e.load_batch(&x, &y).expect("batch");
        let loss = e.forward().expect("forward");
        if t == 1 {
            first = loss;
        }
        last = loss;
        e.backward().expect("backward");
        assert!(
            e.optimizer_step(t, 1.0).expect("optimizer"),
            "step {t} skipped"
        );
        e.run_host_tasks(t).expect("host tasks");
    }
    (first, last, e)
}

#[test]
fn adamw_plan_reduces_the_loss() {
    let (first, last, e) = train_fixed_batch(false, 40);
    assert!(
        (first - (37f64).ln()).abs() < 0.1,
        "initial loss {first} should be ≈ ln(vocab)"
    );
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    assert!(e.stats().last_grad_norm.is_some_and(f64::is_finite));
}

#[test]
fn soap_plan_reduces_the_loss_and_refreshes_bases() {
    let (first, last, e) = train_fixed_batch(true, 40);
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    assert!(e.plan().host_tasks.len() >= 8);
    assert!(
        e.stats().refreshes > 0 && e.stats().total_refresh_failures() == 0,
        "{:?}",
        e.stats()
    );
    // An eigenbasis is orthogonal after the refreshes: QᵀQ = I.
    let q = e.buffer("h0.attn.proj.weight.basis_left").expect("basis");
    let d = 16;
    for i in 0..d {
        for j in 0..d {
            let dot: f64 = (0..d).map(|k| q[k * d + i] * q[k * d + j]).sum();
            assert!(
                (dot - if i == j { 1.0 } else { 0.0 }).abs() < 1e-4,
                "QᵀQ[{i},{j}] = {dot}"
            );
        }
    }
}

#[test]
fn initialisation_is_deterministic_per_seed() {
    let p = plan(&Gpt::tiny(false));
    let a = CpuEngine::<f32>::new(p.clone(), EngineOptions::default())
        .expect("plan")
        .params();
    let b = CpuEngine::<f32>::new(p.clone(), EngineOptions::default())
        .expect("plan")
        .params();
    let c = CpuEngine::<f32>::new(
        p,
        EngineOptions {
            seed: Some(99),
            ..EngineOptions::default()
        },
    )
    .expect("plan")
    .params();
    assert_eq!(a, b);
    assert_ne!(a[0].1, c[0].1);
    assert!(a
        .iter()
        .any(|(n, v)| n == "h0.ln1.weight" && v.iter().all(|&x| x == 1.0)));
}

#[test]
fn non_finite_gradient_norm_skips_the_update() {
    let g = Gpt::tiny(false);
    let mut e = CpuEngine::<f32>::new(plan(&g), EngineOptions::default()).expect("plan");
    let (x, y) = batch(&g, 3);
    let mut w = e.buffer("h0.mlp.fc.weight").expect("w");
    w[5] = f64::NAN;
    e.set_buffer("h0.mlp.fc.weight", &w).expect("set");
    e.load_batch(&x, &y).expect("batch");
    assert!(e.forward().expect("forward").is_nan());
    e.backward().expect("backward");
    let before = e.params();
    assert!(!e.optimizer_step(1, 1.0).expect("optimizer"));
    assert_eq!(e.stats().skipped_steps, 1);
    let after = e.params();
    for ((n, a), (_, b)) in before.iter().zip(&after) {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{n} changed"
        );
    }
}

/// An eigensolver that always fails.
struct Broken;
impl HostEigensolver for Broken {
    fn name(&self) -> &'static str {
        "broken"
    }
    fn eigh_f32(&self, _: &[f32], _: usize) -> Result<Eigh<f32>, EigenError> {
        Err(EigenError::NoConvergence {
            solver: "broken",
            info: 1,
        })
    }
    fn eigh_f64(&self, _: &[f64], _: usize) -> Result<Eigh<f64>, EigenError> {
        Err(EigenError::NoConvergence {
            solver: "broken",
            info: 1,
        })
    }
}

#[test]
fn failed_refreshes_keep_the_basis_and_stop_after_the_limit() {
    let g = Gpt::tiny(true);
    let opts = EngineOptions {
        eigensolver: Some(Arc::new(Broken)),
        max_consecutive_refresh_failures: 2,
        ..EngineOptions::default()
    };
    let mut e = CpuEngine::<f32>::new(plan(&g), opts).expect("plan");
    let tasks = e.plan().host_tasks.len();
    let basis = e.buffer("h0.attn.proj.weight.basis_left").expect("basis");
    let report = e.run_host_tasks(1).expect("first failure is survivable");
    assert_eq!((report.refreshed, report.failed), (0, tasks));
    assert_eq!(
        e.buffer("h0.attn.proj.weight.basis_left").expect("basis"),
        basis
    );
    assert_eq!(e.stats().total_refresh_failures(), tasks as u64);
    let err = e
        .run_host_tasks(1)
        .expect_err("second failure in a row hits the limit");
    assert!(
        matches!(
            err,
            EngineError::RefreshFailures {
                task: 0,
                failures: 2,
                limit: 2,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn tampered_plans_are_rejected() {
    let good = plan(&Gpt::tiny(false));
    let mut p = good.clone();
    if let Op::Embedding { out, .. } = &mut p.forward[0] {
        *out = BufferId(10_000);
    }
    let err = CpuEngine::<f32>::new(p, EngineOptions::default())
        .err()
        .expect("rejected");
    assert!(
        matches!(err, EngineError::Plan(PlanError::BufferOutOfRange { .. })),
        "{err}"
    );
    let mut p = good.clone();
    let w = p
        .buffers
        .iter()
        .position(|b| b.name == "h0.qkv")
        .expect("activation");
    p.buffers[w].shape = vec![5, 16];
    let err = CpuEngine::<f32>::new(p, EngineOptions::default())
        .err()
        .expect("rejected");
    assert!(
        matches!(err, EngineError::Plan(PlanError::Operand { .. })),
        "{err}"
    );
    // Verified but aliased: an op writing its own input is refused at run time, not executed.
    let mut p = good;
    if let Op::Gelu { x, out } = &mut p.forward[12] {
        *out = *x;
    } else {
        panic!("forward[12] should be gelu");
    }
    let mut e = CpuEngine::<f32>::new(p, EngineOptions::default()).expect("verifies");
    let err = e.forward().expect_err("aliased");
    assert!(matches!(err, EngineError::Aliased { .. }), "{err}");
}

#[test]
fn bad_token_ids_are_errors_and_batches_are_length_checked() {
    let g = Gpt::tiny(false);
    let mut e = CpuEngine::<f32>::new(plan(&g), EngineOptions::default()).expect("plan");
    let (mut x, y) = batch(&g, 4);
    x[3] = g.vocab as i32;
    e.load_batch(&x, &y).expect("lengths fine");
    let err = e.forward().expect_err("id out of range");
    assert!(
        matches!(err, EngineError::IndexOutOfRange { position: 3, .. }),
        "{err}"
    );
    assert!(matches!(
        e.load_batch(&x[1..], &y),
        Err(EngineError::Length { .. })
    ));
    assert!(matches!(
        e.set_buffer("nope", &[]),
        Err(EngineError::UnknownBuffer(_))
    ));
}
