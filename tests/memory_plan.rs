//! The memory plan, end to end on the CPU engine: training the example specs with the engine's
//! poisoning mode (`EngineOptions::poison_transients`: every buffer of the shared
//! `activations` arena is overwritten with NaN / `i32::MIN` outside its live range and whenever
//! a buffer planned onto its bytes is written) gives bit-identical losses, validation losses
//! and parameters to normal training. If the planner's live ranges or offsets were wrong —
//! a buffer read after its range, read before written, or overwritten while live — the NaNs
//! would reach the results.
use engine::{train_with, CpuEngine, EngineOptions, TrainOptions, TrainSummary};
use passes::{PassManager, PassOptions};
use schedule::{ArenaKind, Plan};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The spec compiled by the whole pipeline (memory planned).
fn compile(spec: &Path) -> Plan {
    let config = frontend::load_spec(spec).unwrap_or_else(|e| panic!("{}: {e:?}", spec.display()));
    let mut module = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pass manager");
    let (cx, _) = pm
        .run(&mut module, None, &mut std::io::sink())
        .expect("pipeline");
    cx.plan.expect("plan")
}

/// What a run left: its summary, every parameter's bits by name, and the engine.
type Trained = (TrainSummary, Vec<(String, Vec<u64>)>, CpuEngine<f32>);

/// Trains `plan` for `steps` steps on the CPU (validation before, every `eval_interval` steps
/// and at the end).
fn train(plan: &Plan, steps: u64, poison: bool, cache: &Path) -> Trained {
    let opts = TrainOptions {
        steps: Some(steps),
        cache_dir: Some(cache.to_path_buf()),
        quiet: true,
        engine: EngineOptions {
            poison_transients: poison,
            ..EngineOptions::default()
        },
        ..TrainOptions::default()
    };
    let mut e = CpuEngine::<f32>::new(plan.clone(), opts.engine.clone()).expect("engine");
    let s = train_with(&mut e, &opts).expect("training runs");
    let params = e
        .params()
        .into_iter()
        .map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    (s, params, e)
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Poisoned and normal training of `spec` agree bit for bit.
fn check(spec: &str, steps: u64, eval_interval: u64) {
    let mut plan = compile(&root().join(spec));
    plan.train.eval_interval = eval_interval;
    plan.train.eval_batches = 2;
    let shared: Vec<usize> = (0..plan.buffers.len())
        .filter(|&i| plan.memory.is_shared(schedule::BufferId(i as u32)))
        .collect();
    assert!(
        !shared.is_empty() && plan.memory.arena_bytes(ArenaKind::Activations) > 0,
        "{spec}: the memory plan shares nothing"
    );
    let cache = tempfile::tempdir().expect("tempdir");
    let (a, pa, normal) = train(&plan, steps, false, cache.path());
    let (b, pb, poisoned) = train(&plan, steps, true, cache.path());
    assert_eq!(a.train_losses.len() as u64, steps);
    assert!(a.train_losses.iter().all(|l| l.is_finite()), "{spec}: {a}");
    assert_eq!(
        bits(&a.train_losses),
        bits(&b.train_losses),
        "{spec}: poisoned training losses differ: {:?} vs {:?}",
        a.train_losses,
        b.train_losses
    );
    let val = |s: &TrainSummary| -> Vec<(u64, u64)> {
        s.val_losses.iter().map(|v| (v.0, v.1.to_bits())).collect()
    };
    assert!(a.val_losses.len() >= 2, "{spec}: evaluations ran");
    assert_eq!(
        val(&a),
        val(&b),
        "{spec}: validation losses differ: {:?} vs {:?}",
        a.val_losses,
        b.val_losses
    );
    assert_eq!(
        (a.skipped_steps, a.refresh_failures, a.refresh_swaps),
        (b.skipped_steps, b.refresh_failures, b.refresh_swaps)
    );
    assert_eq!(b.skipped_steps, 0, "{spec}: a poisoned gradient norm");
    assert_eq!(pa.len(), pb.len());
    for ((n, x), (_, y)) in pa.iter().zip(&pb) {
        assert!(
            x == y,
            "{spec}: parameter `{n}` differs after poisoned training"
        );
    }
    // The poison is really there: shared buffers whose live range ended hold NaN in the
    // poisoned engine (the largest one, the logits, dies early in the backward program), and
    // finite values in the normal one.
    let nan = shared.iter().any(|&i| {
        let name = &plan.buffers[i].name;
        poisoned
            .buffer(name)
            .expect("buffer")
            .iter()
            .all(|x| x.is_nan())
    });
    assert!(nan, "{spec}: no shared buffer was poisoned");
    for &i in &shared {
        let name = &plan.buffers[i].name;
        assert!(
            normal
                .buffer(name)
                .expect("buffer")
                .iter()
                .all(|x| x.is_finite()),
            "{spec}: `{name}` is not finite in normal training"
        );
    }
    eprintln!(
        "{spec}: {steps} steps bit-identical with {} of {} buffers poisoned outside their live ranges; losses {:?}",
        shared.len(),
        plan.buffers.len(),
        a.train_losses
    );
}

#[test]
fn poisoned_training_is_bit_identical_adamw() {
    check("examples/tiny.asteria", 4, 2);
}

#[test]
fn poisoned_training_is_bit_identical_soap() {
    // The first eigendecomposition at the end of step 1, then SOAP updates in the eigenbasis.
    check("examples/tiny-soap.asteria", 3, 3);
}

#[test]
fn poisoned_training_is_bit_identical_llama_soap() {
    check("examples/tiny-llama-soap.asteria", 3, 3);
}
