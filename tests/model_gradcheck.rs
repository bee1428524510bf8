//! Whole-model gradient checks: the compiled backward program of a small GPT-2 and a small
//! LLaMA (the real pipeline: expand-model → autodiff → lower, interpreted by the CPU engine in
//! float64) against central finite differences of the forward loss, on random parameters and
//! tokens of awkward sizes. Normwise relative error per parameter tensor ≤ 1e-6.
use engine::{CpuEngine, EngineOptions, Rng};
use ir::config::*;
use passes::{PassManager, PassOptions};

fn config(family: Family) -> Config {
    Config {
        name: format!("gradcheck-{family:?}"),
        model: ModelConfig {
            family,
            vocab_size: 13,
            context: 7,
            d_model: 8,
            n_layers: 2,
            n_heads: 2,
            mlp_hidden: 12,
            norm_eps: 1e-5,
            init_std: 0.02,
            rope_theta: 10000.0,
        },
        optimizer: OptimizerConfig::Adamw(AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }),
        data: DataConfig {
            corpus: CorpusConfig::Builtin,
            tokenizer: TokenizerKind::Bytes,
            batch_size: 2,
            seq_len: 5,
            val_fraction: 0.1,
        },
        train: TrainConfig {
            steps: 1,
            warmup_steps: 0,
            min_lr_ratio: 0.1,
            grad_clip: None,
            eval_interval: 0,
            eval_batches: 1,
            seed: 7,
            rematerialize: Default::default(),
            max_skipped_steps: Some(10),
            refresh_swap: Default::default(),
            grad_accum: 1,
        },
        target: TargetConfig::Cpu {
            threads: Some(1),
            staleness: 0,
            calibration: None,
            eigensolver: ir::Eigensolver::Faer,
            budgets: Default::default(),
        },
    }
}

fn check(family: Family) {
    let mut module = ir::Module::new(config(family));
    let mut pm = PassManager::new(PassOptions::default()).expect("pass manager");
    let (cx, _) = pm
        .run(&mut module, None, &mut std::io::sink())
        .expect("pipeline");
    let plan = cx.plan.expect("plan");
    let mut e: CpuEngine<f64> =
        CpuEngine::new(plan.clone(), EngineOptions::default()).expect("engine");
    let mut rng = Rng::new(0xC0FFEE);
    // Random (not initial) values everywhere, so norm weights ≠ 1 and biases ≠ 0 are exercised.
    for p in &plan.params {
        let b = plan.buffer(p.param);
        let v: Vec<f64> = (0..b.numel()).map(|_| 0.5 * rng.normal()).collect();
        e.set_buffer(&b.name, &v).expect("set param");
    }
    let n = 10;
    let tokens: Vec<i32> = (0..n).map(|_| (rng.next_u64() % 13) as i32).collect();
    let targets: Vec<i32> = (0..n).map(|_| (rng.next_u64() % 13) as i32).collect();
    e.load_batch(&tokens, &targets).expect("batch");
    e.forward().expect("forward");
    e.backward().expect("backward");
    let h = 1e-5;
    let mut worst = (0.0f64, String::new());
    for p in &plan.params {
        let name = plan.buffer(p.param).name.clone();
        let grad = e.buffer(&plan.buffer(p.grad).name).expect("grad");
        let base = e.buffer(&name).expect("param");
        // Up to 16 entries per tensor, spread over the tensor.
        let count = base.len().min(16);
        let (mut max_diff, mut max_grad) = (0.0f64, 0.0f64);
        for k in 0..count {
            let idx = if count == base.len() {
                k
            } else {
                (rng.next_u64() as usize) % base.len()
            };
            let mut v = base.clone();
            v[idx] = base[idx] + h;
            e.set_buffer(&name, &v).expect("set");
            let lp = e.forward().expect("forward");
            v[idx] = base[idx] - h;
            e.set_buffer(&name, &v).expect("set");
            let lm = e.forward().expect("forward");
            let fd = (lp - lm) / (2.0 * h);
            max_diff = max_diff.max((fd - grad[idx]).abs());
            max_grad = max_grad.max(grad[idx].abs()).max(fd.abs());
        }
        e.set_buffer(&name, &base).expect("restore");
        assert!(
            max_grad > 1e-9,
            "{family:?} {name}: gradient is identically zero on the sampled entries"
        );
        let rel = max_diff / max_grad;
        if rel > worst.0 {
            worst = (rel, name.clone());
        }
        assert!(
            rel <= 1e-6,
            "{family:?} {name}: finite-difference relative error {rel:e} > 1e-6"
        );
    }
    eprintln!(
        "{family:?}: worst relative error {:e} ({})",
        worst.0, worst.1
    );
}

#[test]
fn gpt2_gradients_match_finite_differences() {
    check(Family::Gpt2);
}

#[test]
fn llama_gradients_match_finite_differences() {
    check(Family::Llama);
}
