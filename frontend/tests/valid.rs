//! Valid specs: defaults, the syntax's liberties (separators, comments, CRLF, BOM), corpus
//! lists and folders, and the `load_spec` entry point.

mod common;

use std::path::Path;

use common::{parse, tests_dir};
use frontend::{load_spec, parse_spec};
use ir::config::{
    AdamWConfig, CorpusConfig, OptimizerConfig, TargetConfig, TokenizerKind, TrainConfig,
};

const MODEL: &str = "model gpt2 { vocab = 50257 context = 64 d_model = 64 layers = 2 heads = 4 }\n";
const REST: &str = "data { batch_size = 8 seq_len = 64 }\ntrain { steps = 10 }\n";

fn spec(optimizer: &str, extra: &str) -> String {
    format!("{MODEL}{optimizer}\n{REST}{extra}")
}

/// Every optimizer defined by its update rule takes an empty block: each hyperparameter at its
/// definition's default, pairs expanded.
#[test]
fn rule_defined_optimizers_take_their_defaults() {
    for d in optim::optimizers::DEFINITIONS {
        let c = parse(&spec(&format!("optimizer {} {{ }}", d.name), "")).expect("valid");
        let want = ir::config::ElementwiseConfig {
            name: d.name.to_string(),
            hyper: d.defaults(),
        };
        assert_eq!(
            c.optimizer,
            OptimizerConfig::Elementwise(want),
            "{}",
            d.name
        );
    }
    let c = parse(&spec(
        "optimizer lion { lr = 3e-4 betas = (0.95, 0.98) weight_decay = 1 }",
        "",
    ))
    .expect("valid");
    let OptimizerConfig::Elementwise(e) = c.optimizer else {
        panic!("not lion: {:?}", c.optimizer)
    };
    let want: Vec<(String, f64)> = [
        ("lr", 3e-4),
        ("beta1", 0.95),
        ("beta2", 0.98),
        ("weight_decay", 1.0),
    ]
    .iter()
    .map(|(k, x)| (k.to_string(), *x))
    .collect();
    assert_eq!(e.hyper, want);
}

#[test]
fn defaults() {
    let c = parse(&spec("optimizer adamw { }", "")).expect("valid");
    let adamw = AdamWConfig {
        lr: 6e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    assert_eq!(c.optimizer, OptimizerConfig::Adamw(adamw));
    let train = TrainConfig {
        steps: 10,
        warmup_steps: 0,
        min_lr_ratio: 0.1,
        grad_clip: Some(1.0),
        eval_interval: 0,
        eval_batches: 4,
        seed: 1337,
        rematerialize: Default::default(),
        max_skipped_steps: Some(10),
        refresh_swap: Default::default(),
        grad_accum: 1,
    };
    assert_eq!(c.train, train);
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
    assert_eq!(c.data.corpus, CorpusConfig::Builtin);
    assert_eq!(c.data.tokenizer, TokenizerKind::Gpt2);
    assert_eq!(c.data.val_fraction, 0.1);
    assert_eq!(c.model.mlp_hidden, 256, "gpt2 default is 4 * d_model");
    assert_eq!((c.model.norm_eps, c.model.init_std), (1e-5, 0.02));
    assert_eq!(c.name, "test");
}

#[test]
fn soap_shampoo_beta_defaults_to_beta2() {
    let c = parse(&spec("optimizer soap { betas = (0.9, 0.99) }", "")).expect("valid");
    let OptimizerConfig::Soap(s) = c.optimizer else {
        panic!("not soap")
    };
    assert_eq!((s.beta1, s.beta2, s.shampoo_beta), (0.9, 0.99, 0.99));
    assert_eq!(
        (s.lr, s.weight_decay, s.precondition_frequency),
        (3e-3, 0.01, 10)
    );
    assert_eq!(
        (s.max_precond_dim, s.correct_bias, s.normalize_grads),
        (10000, true, false)
    );
}

/// An empty `optimizer kl_shampoo { }` takes every default of the reference `KLOpt`
/// (`docs/kl-shampoo.md` §5), `shampoo_beta` following `betas`' second; a typo is located and
/// an out-of-range value names its range.
#[test]
fn kl_shampoo_takes_the_reference_defaults() {
    let c = parse(&spec("optimizer kl_shampoo { }", "")).expect("valid");
    let want = ir::config::KlShampooConfig {
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.98,
        shampoo_beta: 0.98,
        eps: 1e-8,
        weight_decay: 0.01,
        precondition_frequency: 10,
        init_factor: 0.1,
        max_clamp_value: 4000.0,
        max_precond_dim: 10000,
        normalize_grads: false,
    };
    assert_eq!(c.optimizer, OptimizerConfig::KlShampoo(want));
    let c = parse(&spec("optimizer kl_shampoo { betas = (0.95, 0.99) }", "")).expect("valid");
    let OptimizerConfig::KlShampoo(k) = c.optimizer else {
        panic!("not kl_shampoo")
    };
    assert_eq!((k.beta2, k.shampoo_beta), (0.99, 0.99));
    let e = parse(&spec("optimizer kl_shampoo { init_factr = 0.2 }", "")).expect_err("typo");
    let text = common::render(&e);
    assert!(text.contains("init_factor"), "{text}");
    let e = parse(&spec("optimizer kl_shampoo { max_clamp_value = 0.5 }", "")).expect_err("range");
    let text = common::render(&e);
    assert!(text.contains("[1, 1e9]"), "{text}");
}

/// An empty `optimizer shampoo { }` takes every default of Distributed Shampoo
/// (`docs/shampoo.md` §1: no grafting, frequency 1); `grafting = adam` takes
/// `AdamPreconditionerConfig`'s; β₂ = 1 is allowed (a running sum), above it is not; a typo is
/// located; a block size under 8 names its range.
#[test]
fn shampoo_takes_the_reference_defaults() {
    let c = parse(&spec("optimizer shampoo { }", "")).expect("valid");
    let want = ir::config::ShampooConfig {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 1.0,
        epsilon: 1e-12,
        weight_decay: 0.0,
        max_preconditioner_dim: 1024,
        precondition_frequency: 1,
        use_bias_correction: true,
        grafting: false,
        grafting_beta2: 0.999,
        grafting_epsilon: 1e-10,
    };
    assert_eq!(c.optimizer, OptimizerConfig::Shampoo(want));
    let c = parse(&spec(
        "optimizer shampoo { grafting = adam betas = (0.0, 0.99) }",
        "",
    ))
    .expect("valid");
    let OptimizerConfig::Shampoo(s) = c.optimizer else {
        panic!("not shampoo")
    };
    assert_eq!((s.grafting, s.beta1, s.beta2), (true, 0.0, 0.99));
    let e = parse(&spec("optimizer shampoo { betas = (0.9, 1.5) }", "")).expect_err("range");
    let text = common::render(&e);
    assert!(text.contains("(0, 1]"), "{text}");
    let e = parse(&spec("optimizer shampoo { grafting = sgd }", "")).expect_err("name");
    let text = common::render(&e);
    assert!(text.contains("adam"), "{text}");
    let e = parse(&spec(
        "optimizer shampoo { max_precondtioner_dim = 64 }",
        "",
    ))
    .expect_err("typo");
    let text = common::render(&e);
    assert!(text.contains("max_preconditioner_dim"), "{text}");
    let e = parse(&spec(
        "optimizer shampoo { max_preconditioner_dim = 4 }",
        "",
    ))
    .expect_err("range");
    let text = common::render(&e);
    assert!(text.contains("8..=1_048_576"), "{text}");
    let e = parse(&spec("optimizer soap { grafting = adam }", "")).expect_err("foreign key");
    assert!(common::render(&e).contains("grafting"));
}

/// `max_preconditioner_dim` turns on blocked SOAP (absent: `soap.py`'s behaviour); below 8 it
/// names its range; AdamW refuses it; the former key `block_size` is refused with its location.
#[test]
fn soap_block_size() {
    let c = parse(&spec(
        "optimizer soap { max_preconditioner_dim = 2048 }",
        "",
    ))
    .expect("valid");
    let OptimizerConfig::Soap(s) = c.optimizer else {
        panic!("not soap")
    };
    assert_eq!(s.block_size, Some(2048));
    let c = parse(&spec("optimizer soap { }", "")).expect("valid");
    let OptimizerConfig::Soap(s) = c.optimizer else {
        panic!("not soap")
    };
    assert_eq!(s.block_size, None);
    let e = parse(&spec("optimizer soap { max_preconditioner_dim = 4 }", "")).expect_err("range");
    assert!(common::render(&e).contains("8..=1_048_576"));
    let e =
        parse(&spec("optimizer adamw { max_preconditioner_dim = 64 }", "")).expect_err("soap key");
    assert!(common::render(&e).contains("SOAP"));
    let e = parse(&spec("optimizer soap { block_size = 2048 }", "")).expect_err("renamed key");
    let r = common::render(&e);
    assert!(r.contains("did you mean `max_preconditioner_dim`?"), "{r}");
}

#[test]
fn llama_default_mlp_hidden() {
    let src = spec("optimizer soap { }", "").replace("model gpt2", "model llama");
    let c = parse(&src).expect("valid");
    assert_eq!(
        c.model.mlp_hidden, 192,
        "ceil(8/3 * 64) = 171, rounded up to 192"
    );
    let src = src.replace("d_model = 64", "d_model = 768");
    assert_eq!(parse(&src).expect("valid").model.mlp_hidden, 2048);
}

#[test]
fn syntax_liberties() {
    let src = "\u{feff}# BOM, CRLF, `;`, trailing commas, signs, underscores\r\n\
        model gpt2 { vocab = 50_304; context = 64; d_model = 64; layers = 2; heads = 4 }\r\n\
        optimizer adamw {\r\n  lr = 1  # an integer where a float is expected\r\n\
          betas = (\r\n    0.9,\r\n    0.95,\r\n  )\r\n  eps = +1E-8\r\n}\r\n\
        data{batch_size=8 seq_len=64 corpus=[\"fixtures/hello.txt\",]}\r\n\
        train { steps = 1_000 grad_clip = none seed = 0 }\r\n\
        target cpu { threads = 2 staleness = 3 }";
    let c = parse(src).expect("valid");
    assert_eq!(c.model.vocab_size, 50304);
    let adamw = AdamWConfig {
        lr: 1.0,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    assert_eq!(c.optimizer, OptimizerConfig::Adamw(adamw));
    assert_eq!(
        (c.train.steps, c.train.grad_clip, c.train.seed),
        (1000, None, 0)
    );
    assert_eq!(
        c.target,
        TargetConfig::Cpu {
            threads: Some(2),
            staleness: 3,
            calibration: None,
            eigensolver: ir::Eigensolver::Faer,
            budgets: Default::default(),
        }
    );
}

#[test]
fn cuda_target_and_threads_none() {
    let c = parse(&spec(
        "optimizer adamw { }",
        "target cuda { device = 1 staleness = 4 }",
    ))
    .expect("valid");
    assert_eq!(
        c.target,
        TargetConfig::Cuda {
            device: 1,
            staleness: 4,
            calibration: None,
            precision: ir::Precision::Bf16,
            eigensolver: ir::Eigensolver::Faer,
            attention: ir::AttentionKernel::Auto,
            refresh_placement: ir::RefreshPlacement::Auto,
            weight_casts: ir::WeightCasts::Auto,
            budgets: Default::default(),
        }
    );
    let c = parse(&spec(
        "optimizer adamw { }",
        "target cuda { attention = gemm refresh_placement = host eigensolver = lapack precision = fp32 weight_casts = twice }",
    ))
    .expect("valid");
    assert_eq!(
        c.target,
        TargetConfig::Cuda {
            device: 0,
            staleness: 0,
            calibration: None,
            precision: ir::Precision::Fp32,
            eigensolver: ir::Eigensolver::Lapack,
            attention: ir::AttentionKernel::Gemm,
            refresh_placement: ir::RefreshPlacement::Host,
            weight_casts: ir::WeightCasts::Twice,
            budgets: Default::default(),
        }
    );
    let c = parse(&spec(
        "optimizer adamw { }",
        "target cpu { threads = none }",
    ))
    .expect("valid");
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
fn corpus_files_and_folders() {
    let data =
        "data { batch_size = 8 seq_len = 64 corpus = [\"fixtures/hello.txt\", \"fixtures/more\"] }";
    let src = format!("{MODEL}optimizer adamw {{ }}\n{data}\ntrain {{ steps = 10 }}\n");
    let c = parse(&src).expect("valid");
    let p = |rel: &str| tests_dir().join(rel).display().to_string();
    let paths = vec![p("fixtures/hello.txt"), p("fixtures/more/world.txt")];
    assert_eq!(c.data.corpus, CorpusConfig::Files { paths });
}

#[test]
fn run_name_is_the_file_stem() {
    let c = parse_spec(
        "runs/gpt2-small.asteria",
        &spec("optimizer adamw { }", ""),
        &tests_dir(),
    );
    assert_eq!(c.expect("valid").name, "gpt2-small");
}

#[test]
fn load_spec_reports_unreadable_file() {
    let e = load_spec(Path::new("no/such/spec.asteria")).expect_err("missing");
    let items = e.items();
    assert_eq!(items.len(), 1);
    assert!(
        items[0]
            .2
            .starts_with("cannot read spec file `no/such/spec.asteria`"),
        "{items:?}"
    );
}

#[test]
fn load_spec_resolves_corpus_from_the_spec_folder() {
    let dir = std::env::temp_dir().join(format!("asteria-frontend-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("text.txt"), "hello\n").expect("write corpus");
    let data = "data { batch_size = 8 seq_len = 64 corpus = \"text.txt\" }";
    let src = format!("{MODEL}optimizer adamw {{ }}\n{data}\ntrain {{ steps = 10 }}\n");
    std::fs::write(dir.join("run.asteria"), src).expect("write spec");
    let c = load_spec(&dir.join("run.asteria"));
    let expected = dir.join("text.txt").display().to_string();
    std::fs::remove_dir_all(&dir).ok();
    let c = c.expect("valid");
    assert_eq!(c.name, "run");
    assert_eq!(
        c.data.corpus,
        CorpusConfig::Files {
            paths: vec![expected]
        }
    );
}
