//! How far two correct fp32 implementations of a SOAP run may drift apart: the CPU engine in
//! float32 against the same engine in float64, same seed, data and schedule, 20 steps of
//! `examples/tiny-soap.asteria` with max_precond_dim 64 (the spec the CUDA train-match check
//! uses). Run by hand (`--ignored --nocapture`); the numbers justify the tolerance of the
//! GPU-vs-CPU SOAP match (BENCHMARKS.md).
use engine::{train_with, CpuEngine, EngineOptions, TrainOptions};
use passes::{PassManager, PassOptions};
use std::path::PathBuf;

#[test]
#[ignore]
fn soap_fp32_vs_fp64_drift_over_20_steps() {
    let spec = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny-soap.asteria");
    let mut config = frontend::load_spec(&spec).expect("spec");
    if let ir::config::OptimizerConfig::Soap(s) = &mut config.optimizer {
        s.max_precond_dim = 64;
    }
    config.train.eval_interval = 0;
    let mut m = ir::Module::new(config);
    let (cx, _) = PassManager::new(PassOptions::default())
        .expect("pm")
        .run(&mut m, None, &mut std::io::sink())
        .expect("pipeline");
    let plan = cx.plan.expect("plan");
    let opts = TrainOptions {
        steps: Some(20),
        quiet: true,
        cache_dir: Some(std::env::temp_dir().join("asteria-token-cache")),
        ..Default::default()
    };
    let mut e32: CpuEngine<f32> =
        CpuEngine::new(plan.clone(), EngineOptions::default()).expect("f32");
    let mut e64: CpuEngine<f64> = CpuEngine::new(plan, EngineOptions::default()).expect("f64");
    let a = train_with(&mut e32, &opts).expect("f32 run");
    let b = train_with(&mut e64, &opts).expect("f64 run");
    for (i, (x, y)) in a.train_losses.iter().zip(&b.train_losses).enumerate() {
        eprintln!(
            "step {:>2}: f32 {x:.7} f64 {y:.7} rel {:.2e}",
            i + 1,
            ((x - y) / y).abs()
        );
    }
}
