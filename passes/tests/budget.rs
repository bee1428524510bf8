//! Sizes the passes cannot hold: a spec whose tensors exceed the 16 TiB ceiling is a compile
//! error naming the largest tensors, a config outside the spec ranges (an IR text module skips
//! the frontend) is refused by `expand-model`, and a huge refresh period allocates nothing.
use ir::config::{Config, OptimizerConfig};
use passes::{PassError, PassManager, PassOptions};
use std::path::PathBuf;

fn example(name: &str) -> Config {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name);
    frontend::load_spec(&path).unwrap_or_else(|e| panic!("{name}: {e:?}"))
}

fn compile(config: Config) -> Result<(), PassError> {
    let mut pm = PassManager::new(PassOptions::default())?;
    let mut m = ir::Module::new(config);
    pm.run(&mut m, None, &mut std::io::sink()).map(|_| ())
}

#[test]
fn tensors_over_the_ceiling_are_a_compile_error_naming_the_largest() {
    // In range key by key; logits alone are [2^16 · 1024, 2^20] f32 = 256 TiB.
    let mut c = example("tiny.asteria");
    c.model.vocab_size = 1 << 20;
    c.model.context = 1024;
    c.data.batch_size = 1 << 16;
    c.data.seq_len = 1024;
    match compile(c) {
        Err(e @ PassError::TooLarge { pass, .. }) => {
            assert_eq!(pass, "expand-model");
            let msg = e.to_string();
            assert!(msg.contains("16 TiB"), "{msg}");
            assert!(
                msg.contains("%logits f32[67108864, 1048576] (256.00 TiB)"),
                "{msg}"
            );
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
}

#[test]
fn kronecker_factors_count_against_the_ceiling() {
    // A small model whose SOAP factors are huge: with max_precond_dim 2^20 the untied wte and
    // lm_head [2^20, 64] each get a left factor and basis of 2^40 elements (4 TiB): 16 TiB.
    let mut c = example("tiny-llama-soap.asteria");
    c.model.vocab_size = 1 << 20;
    if let OptimizerConfig::Soap(s) = &mut c.optimizer {
        s.max_precond_dim = 1 << 20;
    }
    match compile(c) {
        Err(e @ PassError::TooLarge { pass, .. }) => {
            assert_eq!(pass, "expand-optimizer", "{e}");
            assert!(
                e.to_string().contains("f32[1048576, 1048576] (4.00 TiB)"),
                "{e}"
            );
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
}

#[test]
fn a_config_outside_the_spec_ranges_is_refused_before_any_arithmetic() {
    let mut c = example("tiny.asteria");
    c.data.batch_size = usize::MAX / 2;
    match compile(c) {
        Err(PassError::Invalid { pass, message }) => {
            assert_eq!(pass, "expand-model");
            assert!(message.contains("batch_size"), "{message}");
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn a_huge_refresh_period_with_staleness_allocates_nothing() {
    // The scheduler once kept one slot per step of the period: 10^12 steps was an 8 TB
    // allocation (an abort).
    let mut c = example("tiny-soap.asteria");
    if let OptimizerConfig::Soap(s) = &mut c.optimizer {
        s.precondition_frequency = 1_000_000_000_000;
    }
    if let ir::config::TargetConfig::Cpu { staleness, .. } = &mut c.target {
        *staleness = 5;
    }
    // Up to the scheduler: the plan verifier refuses the period itself (1..=100_000).
    let mut pm = PassManager::new(PassOptions::default()).expect("pm");
    let mut m = ir::Module::new(c);
    pm.run(&mut m, Some("precond-scheduling"), &mut std::io::sink())
        .expect("schedules");
}
