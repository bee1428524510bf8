//! Helpers of the offload-tier tests on the CPU engine (`tests/tiers.rs`, `tests/tiers_nvme.rs`):
//! a tiny GPT-2 config for each optimizer whose state the tiers move, the pipeline, a CPU engine
//! and one training step.
#![allow(dead_code)] // each test file uses its own subset
use engine::{CpuEngine, EngineError, EngineOptions, Rng};
use ir::config::*;
use passes::{PassError, PassManager, PassOptions};
use schedule::{Budgets, Plan};

pub const VOCAB: usize = 256;
pub const MIB: u64 = 1 << 20;

/// The optimizers whose moments the tiers move: AdamW, SOAP, Lion (an optimizer defined by
/// its update rule, whose `elementwise_update` reads its state as a list operand) and
/// KL-Shampoo (whose momentum moves; its QR refreshes never touch it) and Shampoo (its first
/// moment and grafting second moment move; its inverse-root refreshes touch neither), and
/// blocked SOAP (each block's moments move).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Opt {
    AdamW,
    Soap,
    Lion,
    KlShampoo,
    Shampoo,
    SoapBlocked,
}

pub fn config(opt: Opt, budgets: Budgets) -> Config {
    let optimizer = match opt {
        Opt::Lion => OptimizerConfig::Elementwise(ElementwiseConfig {
            name: "lion".into(),
            hyper: vec![
                ("lr".into(), 3e-4),
                ("beta1".into(), 0.9),
                ("beta2".into(), 0.99),
                ("weight_decay".into(), 0.3),
            ],
        }),
        Opt::KlShampoo => OptimizerConfig::KlShampoo(ir::config::KlShampooConfig {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.98,
            shampoo_beta: 0.98,
            eps: 1e-8,
            weight_decay: 0.01,
            precondition_frequency: 2,
            init_factor: 1e-4,
            max_clamp_value: 4000.0,
            // As SOAP's: QR refreshes run on the 128-wide sides while the momentum is offloaded.
            max_precond_dim: 256,
            normalize_grads: false,
        }),
        Opt::Shampoo => OptimizerConfig::Shampoo(ir::config::ShampooConfig {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            epsilon: 1e-8,
            weight_decay: 0.01,
            // Blocks of 128: the 512-wide sides are cut in four.
            max_preconditioner_dim: 128,
            precondition_frequency: 2,
            use_bias_correction: true,
            grafting: true,
            grafting_beta2: 0.999,
            grafting_epsilon: 1e-10,
        }),
        Opt::AdamW => OptimizerConfig::Adamw(AdamWConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }),
        Opt::Soap | Opt::SoapBlocked => OptimizerConfig::Soap(SoapConfig {
            lr: 3e-3,
            beta1: 0.95,
            beta2: 0.95,
            shampoo_beta: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            precondition_frequency: 2,
            // Every weight has a factor on at least one side (the 512-wide sides get none):
            // refresh swaps re-project offloaded moments.
            max_precond_dim: 256,
            correct_bias: true,
            normalize_grads: false,
            // Blocked: the 512-wide sides are cut into 128-wide blocks, each its own SOAP
            // parameter (`block_copy` / `block_write` around its ops).
            block_size: (opt == Opt::SoapBlocked).then_some(128),
        }),
    };
    Config {
        name: "tiers".into(),
        // ~0.4M parameters: the moments are a few MiB, above the budgets' 1 MiB granularity.
        model: ModelConfig {
            family: Family::Gpt2,
            vocab_size: VOCAB,
            context: 32,
            d_model: 128,
            n_layers: 2,
            n_heads: 4,
            mlp_hidden: 512,
            norm_eps: 1e-5,
            init_std: 0.02,
            rope_theta: 10000.0,
        },
        optimizer,
        data: DataConfig {
            corpus: CorpusConfig::Builtin,
            tokenizer: TokenizerKind::Bytes,
            batch_size: 2,
            seq_len: 32,
            val_fraction: 0.1,
        },
        train: TrainConfig {
            steps: 8,
            warmup_steps: 0,
            min_lr_ratio: 0.1,
            grad_clip: Some(1.0),
            eval_interval: 0,
            eval_batches: 1,
            seed: 3,
            rematerialize: Default::default(),
            max_skipped_steps: Some(10),
            refresh_swap: Default::default(),
            grad_accum: 1,
        },
        target: TargetConfig::Cpu {
            threads: Some(2),
            staleness: 0,
            calibration: None,
            eigensolver: Default::default(),
            budgets,
        },
    }
}

pub fn compile(config: Config) -> Result<Plan, Box<PassError>> {
    let mut m = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pass manager");
    let (cx, _) = pm.run(&mut m, None, &mut std::io::sink())?;
    Ok(cx.plan.expect("plan"))
}

pub fn engine(plan: Plan) -> CpuEngine<f32> {
    let opts = EngineOptions {
        threads: Some(2),
        synchronous_refresh: true,
        ..EngineOptions::default()
    };
    CpuEngine::<f32>::new(plan, opts).expect("engine")
}

pub fn batch(plan: &Plan) -> (Vec<i32>, Vec<i32>) {
    let n = plan.data.batch_size * plan.data.seq_len;
    let mut rng = Rng::new(29);
    let x: Vec<i32> = (0..n)
        .map(|_| (rng.next_u64() % VOCAB as u64) as i32)
        .collect();
    let y = x.iter().map(|&t| (t * 7 + 3) % VOCAB as i32).collect();
    (x, y)
}

/// One training step; the loss.
pub fn step(e: &mut CpuEngine<f32>, x: &[i32], y: &[i32], t: u64) -> Result<f64, EngineError> {
    e.load_batch(x, y)?;
    let loss = e.forward()?;
    e.backward()?;
    e.optimizer_step(t, 1.0)?;
    e.run_host_tasks(t)?;
    Ok(loss)
}

/// A device budget `short` bytes below what the untiered plan needs, rounded up to MiB.
pub fn budget_below(opt: Opt, short: u64) -> u64 {
    let need = compile(config(opt, Budgets::default()))
        .expect("untiered")
        .memory
        .device_bytes() as u64;
    (need - short).div_ceil(MIB) * MIB
}

pub fn nvme_file(dir: &std::path::Path) -> std::path::PathBuf {
    let files: Vec<_> = std::fs::read_dir(dir)
        .expect("dir")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(files.len(), 1, "one NVMe file: {files:?}");
    files[0].clone()
}
