//! The `rematerialize` pass (`train { rematerialize = off | selective | layers }`): small GPT-2
//! and LLaMA models compiled under each policy and trained on the CPU engine on one fixed
//! batch, AdamW and SOAP, for the CPU target (fp32) and the CUDA target's bf16 plan (the CPU
//! engine rounds the bf16 buffers as the GPU does):
//! - recomputation reruns the same ops on the same inputs, so every loss and every final
//!   parameter is bit-identical to the plan that keeps its activations;
//! - the activations arena shrinks: `selective` < `off`, `layers` < `selective`;
//! - the copies are in the backward program (`…remat` buffers), the plan records the policy, and
//!   the model FLOPs (MFU's numerator) do not count them.
use engine::{CpuEngine, EngineOptions, Rng};
use ir::config::*;
use ir::Rematerialize;
use passes::{PassManager, PassOptions};

const VOCAB: usize = 40;

fn config(family: Family, target: TargetConfig, soap: bool, remat: Rematerialize) -> Config {
    let optimizer = match soap {
        false => OptimizerConfig::Adamw(AdamWConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }),
        true => OptimizerConfig::Soap(SoapConfig {
            lr: 3e-3,
            beta1: 0.95,
            beta2: 0.95,
            shampoo_beta: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            precondition_frequency: 3,
            max_precond_dim: 64,
            correct_bias: true,
            normalize_grads: false,
            block_size: None,
        }),
    };
    Config {
        name: "remat".into(),
        // Activations dominate: a long batch of a narrow model with a wide MLP, a small vocab.
        model: ModelConfig {
            family,
            vocab_size: VOCAB,
            context: 16,
            d_model: 16,
            n_layers: 3,
            n_heads: 2,
            mlp_hidden: 48,
            norm_eps: 1e-5,
            init_std: 0.02,
            rope_theta: 10000.0,
        },
        optimizer,
        data: DataConfig {
            corpus: CorpusConfig::Builtin,
            tokenizer: TokenizerKind::Bytes,
            batch_size: 4,
            seq_len: 16,
            val_fraction: 0.1,
        },
        train: TrainConfig {
            steps: 8,
            warmup_steps: 0,
            min_lr_ratio: 0.1,
            grad_clip: Some(1.0),
            eval_interval: 0,
            eval_batches: 1,
            seed: 9,
            rematerialize: remat,
            max_skipped_steps: Some(10),
            refresh_swap: Default::default(),
            grad_accum: 1,
        },
        target,
    }
}

fn cpu() -> TargetConfig {
    TargetConfig::Cpu {
        threads: Some(2),
        staleness: 0,
        calibration: None,
        eigensolver: Default::default(),
        budgets: Default::default(),
    }
}

fn cuda_bf16() -> TargetConfig {
    TargetConfig::Cuda {
        device: 0,
        staleness: 0,
        precision: schedule::Precision::Bf16,
        calibration: None,
        eigensolver: Default::default(),
        attention: Default::default(),
        refresh_placement: Default::default(),
        weight_casts: Default::default(),
        budgets: Default::default(),
    }
}

fn compile(config: Config) -> schedule::Plan {
    let mut m = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pass manager");
    let (cx, _) = pm
        .run(&mut m, None, &mut std::io::sink())
        .expect("pipeline");
    cx.plan.expect("plan")
}

/// Losses of `steps` steps on one fixed batch and the final parameters (synchronous refreshes).
fn train(plan: schedule::Plan, steps: u64) -> (Vec<f64>, Vec<(String, Vec<f64>)>) {
    let n = plan.data.batch_size * plan.data.seq_len;
    let opts = EngineOptions {
        threads: Some(2),
        synchronous_refresh: true,
        ..EngineOptions::default()
    };
    let mut e = CpuEngine::<f32>::new(plan, opts).expect("engine");
    let mut rng = Rng::new(23);
    let x: Vec<i32> = (0..n)
        .map(|_| (rng.next_u64() % VOCAB as u64) as i32)
        .collect();
    let y: Vec<i32> = x.iter().map(|&t| (t * 7 + 3) % VOCAB as i32).collect();
    let mut losses = Vec::new();
    for t in 1..=steps {
        e.load_batch(&x, &y).expect("batch");
        losses.push(e.forward().expect("forward"));
        e.backward().expect("backward");
        e.optimizer_step(t, 1.0).expect("optimizer");
        e.run_host_tasks(t).expect("host tasks");
    }
    (losses, e.params())
}

fn activations_arena(plan: &schedule::Plan) -> usize {
    plan.memory.arena_bytes(schedule::ArenaKind::Activations)
}

fn remat_buffers(plan: &schedule::Plan) -> usize {
    plan.buffers
        .iter()
        .filter(|b| b.name.ends_with(".remat"))
        .count()
}

#[test]
fn recomputation_trains_bit_identically_in_less_activation_memory() {
    for family in [Family::Gpt2, Family::Llama] {
        for (target, tname) in [(cpu(), "cpu"), (cuda_bf16(), "cuda bf16")] {
            for soap in [false, true] {
                let what = format!("{family:?}, {tname}, soap {soap}");
                let plans = [
                    Rematerialize::Off,
                    Rematerialize::Selective,
                    Rematerialize::Layers,
                ]
                .map(|r| compile(config(family, target.clone(), soap, r)));
                let arenas = plans.each_ref().map(activations_arena);
                assert!(
                    arenas[1] < arenas[0] && arenas[2] < arenas[1],
                    "{what}: activations arena off / selective / layers = {arenas:?}"
                );
                assert_eq!(remat_buffers(&plans[0]), 0, "{what}");
                assert!(
                    remat_buffers(&plans[1]) > 0
                        && remat_buffers(&plans[2]) > remat_buffers(&plans[1]),
                    "{what}"
                );
                for (p, r) in plans.iter().zip([
                    Rematerialize::Off,
                    Rematerialize::Selective,
                    Rematerialize::Layers,
                ]) {
                    assert_eq!(
                        p.train.rematerialize, r,
                        "{what}: the plan records the policy"
                    );
                    assert_eq!(
                        p.model_flops_per_step(),
                        plans[0].model_flops_per_step(),
                        "{what}: recomputation is not model FLOPs"
                    );
                }
                // Under `layers` the attention and the GEMMs are rerun in the backward.
                assert!(
                    plans[2].backward.iter().any(|o| o.name() == "attention"),
                    "{what}"
                );
                let runs = plans.map(|p| train(p, 6));
                let (l0, p0) = &runs[0];
                assert!(l0[5] < l0[0], "{what}: the loss falls: {l0:?}");
                for (r, (l, p)) in runs.iter().enumerate().skip(1) {
                    assert_eq!(l, l0, "{what}: losses of policy {r}");
                    assert_eq!(p, p0, "{what}: final parameters of policy {r}");
                }
            }
        }
    }
}

#[test]
fn the_policy_is_a_spec_key_with_a_located_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = |value: &str| {
        format!(
            "model gpt2 {{\n  vocab = 256\n  context = 16\n  d_model = 16\n  layers = 1\n  heads = 2\n}}\n\
             optimizer adamw {{ lr = 1e-3 }}\n\
             data {{\n  corpus = builtin\n  tokenizer = bytes\n  batch_size = 2\n  seq_len = 16\n  val_fraction = 0.1\n}}\n\
             train {{\n  steps = 2\n  rematerialize = {value}\n}}\n"
        )
    };
    let path = dir.path().join("r.asteria");
    std::fs::write(&path, spec("layers")).expect("write");
    let cfg = frontend::load_spec(&path).expect("a valid spec");
    assert_eq!(cfg.train.rematerialize, Rematerialize::Layers);
    std::fs::write(&path, spec("everything")).expect("write");
    let err = frontend::load_spec(&path).expect_err("an unknown policy");
    let e = &err.errors()[0];
    let text = spec("everything");
    assert_eq!(
        &text[e.span.start..e.span.end],
        "everything",
        "the error points at the value: {e:?}"
    );
    let all = format!("{} {} {:?}", e.message, e.label, e.help);
    assert!(
        ["off", "selective", "layers"]
            .iter()
            .all(|v| all.contains(v)),
        "the error lists the allowed values: {all}"
    );
}
