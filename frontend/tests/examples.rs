//! Every spec in `examples/` parses, and the small ones give the documented configuration.

mod common;

use std::path::Path;

use frontend::load_spec;
use ir::config::{
    AdamWConfig, CorpusConfig, DataConfig, Family, ModelConfig, OptimizerConfig, SoapConfig,
    TargetConfig, TokenizerKind, TrainConfig,
};

fn examples_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn load(name: &str) -> ir::config::Config {
    let path = examples_dir().join(name);
    match load_spec(&path) {
        Ok(c) => c,
        Err(e) => panic!("{name} does not parse:\n{}", common::render(&e)),
    }
}

#[test]
fn all_examples_parse() {
    let mut n = 0;
    for entry in std::fs::read_dir(examples_dir()).expect("examples/ exists") {
        let path = entry.expect("dir entry").path();
        if path.extension().is_some_and(|e| e == "asteria") {
            if let Err(e) = load_spec(&path) {
                panic!("{} does not parse:\n{}", path.display(), common::render(&e));
            }
            n += 1;
        }
    }
    assert!(n >= 4, "expected at least 4 example specs, found {n}");
}

fn tiny_model(family: Family, mlp_hidden: usize) -> ModelConfig {
    ModelConfig {
        family,
        vocab_size: 50257,
        context: 64,
        d_model: 64,
        n_layers: 2,
        n_heads: 4,
        mlp_hidden,
        norm_eps: 1e-5,
        init_std: 0.02,
        rope_theta: 10000.0,
    }
}

fn tiny_data() -> DataConfig {
    DataConfig {
        corpus: CorpusConfig::Builtin,
        tokenizer: TokenizerKind::Gpt2,
        batch_size: 16,
        seq_len: 64,
        val_fraction: 0.1,
    }
}

fn tiny_train() -> TrainConfig {
    TrainConfig {
        steps: 400,
        warmup_steps: 20,
        min_lr_ratio: 0.1,
        grad_clip: Some(1.0),
        eval_interval: 100,
        eval_batches: 8,
        seed: 1337,
        rematerialize: Default::default(),
        max_skipped_steps: Some(10),
        refresh_swap: Default::default(),
        grad_accum: 1,
    }
}

fn soap_defaults(lr: f64) -> SoapConfig {
    SoapConfig {
        lr,
        beta1: 0.95,
        beta2: 0.95,
        shampoo_beta: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
        precondition_frequency: 10,
        max_precond_dim: 10000,
        correct_bias: true,
        normalize_grads: false,
        block_size: None,
    }
}

#[test]
fn tiny() {
    let c = load("tiny.asteria");
    assert_eq!(c.name, "tiny");
    assert_eq!(c.model, tiny_model(Family::Gpt2, 256));
    let adamw = AdamWConfig {
        lr: 2e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    assert_eq!(c.optimizer, OptimizerConfig::Adamw(adamw));
    assert_eq!(c.data, tiny_data());
    assert_eq!(c.train, tiny_train());
    assert_eq!(
        c.target,
        TargetConfig::Cpu {
            threads: None,
            staleness: 0,
            calibration: None,
            eigensolver: ir::Eigensolver::Faer,
            budgets: Default::default(),
        }
    );
}

#[test]
fn tiny_soap() {
    let c = load("tiny-soap.asteria");
    assert_eq!(c.name, "tiny-soap");
    assert_eq!(c.model, tiny_model(Family::Gpt2, 256));
    assert_eq!(c.optimizer, OptimizerConfig::Soap(soap_defaults(3e-3)));
    assert_eq!(c.data, tiny_data());
    assert_eq!(c.train, tiny_train());
}

#[test]
fn tiny_kl_shampoo() {
    let c = load("tiny-kl-shampoo.asteria");
    assert_eq!(c.model, tiny_model(Family::Gpt2, 256));
    let OptimizerConfig::KlShampoo(k) = &c.optimizer else {
        panic!("not kl_shampoo: {:?}", c.optimizer)
    };
    assert_eq!((k.lr, k.beta1, k.shampoo_beta), (1e-2, 0.9, 0.98));
    assert_eq!(k.init_factor, 1e-4);
    assert_eq!((k.max_clamp_value, k.max_precond_dim), (4000.0, 10000));
    assert_eq!(c.data, tiny_data());
    assert_eq!(c.train, tiny_train());
}

#[test]
fn tiny_shampoo() {
    let c = load("tiny-shampoo.asteria");
    assert_eq!(c.model, tiny_model(Family::Gpt2, 256));
    let OptimizerConfig::Shampoo(s) = &c.optimizer else {
        panic!("not shampoo: {:?}", c.optimizer)
    };
    assert_eq!(
        (s.lr, s.beta1, s.beta2, s.epsilon),
        (1e-2, 0.95, 0.95, 1e-8)
    );
    assert_eq!(
        (s.max_preconditioner_dim, s.precondition_frequency),
        (256, 10)
    );
    assert!(s.grafting && s.use_bias_correction);
    assert_eq!(c.data, tiny_data());
    assert_eq!(c.train, tiny_train());
}

#[test]
fn tiny_llama_soap() {
    let c = load("tiny-llama-soap.asteria");
    assert_eq!(c.model, tiny_model(Family::Llama, 192));
    assert_eq!(c.optimizer, OptimizerConfig::Soap(soap_defaults(3e-3)));
    assert_eq!(
        c.target,
        TargetConfig::Cpu {
            threads: None,
            staleness: 0,
            calibration: None,
            eigensolver: ir::Eigensolver::Faer,
            budgets: Default::default(),
        }
    );
}

#[test]
fn gpt2_124m() {
    let c = load("gpt2-124m.asteria");
    assert_eq!(
        (c.model.d_model, c.model.n_layers, c.model.n_heads),
        (768, 12, 12)
    );
    assert_eq!((c.model.context, c.model.mlp_hidden), (1024, 3072));
    assert_eq!((c.data.batch_size, c.data.seq_len), (16, 1024));
    assert_eq!(c.train.steps, 300);
    assert_eq!(
        c.target,
        TargetConfig::Cuda {
            device: 0,
            staleness: 0,
            calibration: None,
            precision: ir::Precision::Bf16,
            eigensolver: ir::Eigensolver::Faer,
            attention: ir::AttentionKernel::Auto,
            refresh_placement: ir::RefreshPlacement::Auto,
            weight_casts: ir::WeightCasts::Auto,
            budgets: Default::default(),
        }
    );
}

/// The README's "Spec keys" table is `schedule::limits::markdown_table()`
/// (`ASTERIA_BLESS=1` rewrites it).
#[test]
fn readme_lists_every_key_with_its_range() {
    let path = examples_dir().join("../README.md");
    let readme = std::fs::read_to_string(&path).expect("README.md");
    let open = "<!-- spec-keys:";
    let close = "<!-- /spec-keys -->";
    let start = readme
        .find(open)
        .expect("the README has the spec-keys marker");
    let body = start + readme[start..].find('\n').expect("marker line") + 1;
    let end = readme
        .find(close)
        .expect("the README has the closing marker");
    let want = ir::limits::markdown_table();
    if std::env::var_os("ASTERIA_BLESS").is_some() {
        let text = format!("{}{want}{}", &readme[..body], &readme[end..]);
        std::fs::write(&path, text).expect("write README.md");
        return;
    }
    assert_eq!(
        &readme[body..end],
        want,
        "README.md's spec-keys table is stale: rerun with ASTERIA_BLESS=1"
    );
}
