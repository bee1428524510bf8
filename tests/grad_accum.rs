//! Gradient accumulation (`train { grad_accum = N }`, the `accumulate-gradients` pass) on the
//! CPU engine: N micro-batches of B sequences train like one batch of N·B (the same rows in the
//! same order: the sampler draws rows one after another), the plan's accumulators persist while
//! the micro-batch gradients are step-local, poisoning the shared arena changes no bit, and a
//! resumed run replays its data position (N batches a step).
use engine::{train_with, CpuEngine, EngineOptions, TrainOptions, TrainSummary};
use passes::{PassManager, PassOptions};
use schedule::{BufferClass, Op, Plan, Residency};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `spec` with `batch_size` and `grad_accum` set, compiled by the whole pipeline.
fn compile(spec: &str, batch: usize, grad_accum: u64) -> Plan {
    compile_with(spec, |c| {
        c.data.batch_size = batch;
        c.train.grad_accum = grad_accum;
    })
}

/// `spec` changed by `edit` (and without evaluations), compiled by the whole pipeline.
fn compile_with(spec: &str, edit: impl FnOnce(&mut ir::config::Config)) -> Plan {
    let path = root().join(spec);
    let mut config =
        frontend::load_spec(&path).unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
    config.train.eval_interval = 0;
    config.train.eval_batches = 1;
    edit(&mut config);
    let mut module = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pass manager");
    let (cx, _) = pm
        .run(&mut module, None, &mut std::io::sink())
        .expect("pipeline");
    let plan = cx.plan.expect("plan");
    plan.verify().expect("the plan verifies");
    plan
}

fn run(
    plan: &Plan,
    steps: u64,
    poison: bool,
    cache: &Path,
) -> (TrainSummary, Vec<(String, Vec<f64>)>) {
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
    (s, e.params())
}

/// One step of `plan` from its initial state: the global gradient norm (before clipping) and
/// the tokens per step of the metrics (`tokens_per_s · step_ms`).
fn first_step(plan: &Plan, cache: &Path) -> (f64, f64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let metrics = dir.path().join("m.jsonl");
    let opts = TrainOptions {
        steps: Some(1),
        cache_dir: Some(cache.to_path_buf()),
        quiet: true,
        metrics_path: Some(metrics.clone()),
        ..TrainOptions::default()
    };
    let mut e = CpuEngine::<f32>::new(plan.clone(), opts.engine.clone()).expect("engine");
    train_with(&mut e, &opts).expect("training runs");
    let norm = e.stats().last_grad_norm.expect("the plan clips: a norm");
    let text = std::fs::read_to_string(&metrics).expect("metrics");
    let line: serde_json::Value = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v.get("loss").is_some())
        .expect("a step record");
    let tokens = line["tokens_per_s"].as_f64().expect("tokens_per_s")
        * line["step_ms"].as_f64().expect("step_ms")
        / 1e3;
    (norm, tokens)
}

/// Largest |a − b| / max(|a|, |b|, floor) over two runs' parameters.
fn max_param_rel(a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)], floor: f64) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    for ((na, x), (nb, y)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs() / p.abs().max(q.abs()).max(floor));
        }
    }
    worst
}

/// Two micro-batches of 8 sequences against one batch of 16: the same losses (and, with
/// `params_tol`, parameters) up to the order of additions (the mean of two means of 512 tokens
/// against one mean of 1024; gradients summed in another order). SOAP's parameters are not
/// compared: the Kronecker factors of the first steps are nearly degenerate, and factors
/// apart in the last bits get different (equally correct) eigenbases, which move single
/// coordinates by O(lr) (as in the CPU↔GPU train-match, `cuda::train_match`).
fn check_matches_one_batch(spec: &str, steps: u64, tol: f64, params_tol: Option<f64>) {
    let cache = tempfile::tempdir().expect("tempdir");
    let one = compile(spec, 16, 1);
    let two = compile(spec, 8, 2);
    let (a, pa) = run(&one, steps, false, cache.path());
    let (b, pb) = run(&two, steps, false, cache.path());
    assert_eq!(a.train_losses.len(), b.train_losses.len());
    for (i, (x, y)) in a.train_losses.iter().zip(&b.train_losses).enumerate() {
        let rel = (x - y).abs() / x.abs();
        assert!(
            rel < tol,
            "{spec}: step {} loss {x} (one batch of 16) against {y} (2 x 8): {rel:.2e}",
            i + 1
        );
    }
    // The averaged gradient itself (not only the scale-invariant updates): the first step's
    // global norm, before clipping, is the one-batch plan's; and the metrics count every
    // micro-batch's tokens.
    let (na, ta) = first_step(&one, cache.path());
    let (nb, tb) = first_step(&two, cache.path());
    assert!(
        (na - nb).abs() / na < tol,
        "{spec}: gradient norm {na} (one batch) against {nb} (2 x 8)"
    );
    let t = (one.data.batch_size * one.data.seq_len) as f64;
    assert!(
        (ta - t).abs() < 1e-6 * t && (tb - t).abs() < 1e-6 * t,
        "{spec}: tokens/step {ta}, {tb}"
    );
    // Relative to the init scale (std 0.02): Adam moves coordinates whose gradient is near
    // zero by ±lr on rounding noise, which a relative measure of tiny values would magnify.
    let rel = max_param_rel(&pa, &pb, 0.02);
    if let Some(ptol) = params_tol {
        assert!(rel < ptol, "{spec}: parameters apart by {rel:.2e}");
    }
    // Not a no-op: the accumulated run is not the one-batch plan.
    assert!(two.backward.len() > one.backward.len());
    eprintln!(
        "{spec}: {steps} steps, losses {:?} against {:?}; parameters within {rel:.1e}",
        a.train_losses, b.train_losses
    );
}

#[test]
fn two_micro_batches_train_like_one_batch_adamw() {
    check_matches_one_batch("examples/tiny.asteria", 5, 1e-5, Some(1e-4));
}

#[test]
fn two_micro_batches_train_like_one_batch_soap() {
    check_matches_one_batch("examples/tiny-soap.asteria", 5, 1e-5, None);
}

#[test]
fn two_micro_batches_train_like_one_batch_llama_soap() {
    check_matches_one_batch("examples/tiny-llama-soap.asteria", 4, 1e-5, None);
}

#[test]
fn accumulation_ops_and_residency() {
    let one = compile("examples/tiny.asteria", 8, 1);
    assert!(
        !one.backward
            .iter()
            .any(|op| matches!(op, Op::GradAccumulate { .. })),
        "grad_accum = 1 adds nothing"
    );
    let plan = compile("examples/tiny.asteria", 8, 3);
    let residency = plan.residency();
    let (mut added, mut in_gemm) = (0, 0);
    for (i, op) in plan.backward.iter().enumerate() {
        if let Op::MatMul {
            out,
            micro_accumulate: Some(scale),
            accumulate,
            ..
        } = op
        {
            // A weight's only GEMM accumulates itself.
            in_gemm += 1;
            assert_eq!(*scale, 1.0 / 3.0);
            assert!(!accumulate);
            assert!(plan.params.iter().any(|p| p.grad == *out));
            assert!(matches!(residency[out.index()], Residency::Persistent(_)));
            continue;
        }
        let Op::GradAccumulate {
            micro,
            total,
            scale,
        } = op
        else {
            continue;
        };
        added += 1;
        assert_eq!(*scale, 1.0 / 3.0);
        assert!(
            plan.params.iter().any(|p| p.grad == *total),
            "total is a parameter's gradient"
        );
        assert_eq!(
            plan.buffer(*micro).name,
            format!("{}.micro", plan.buffer(*total).name)
        );
        assert_eq!(plan.buffer(*micro).class, BufferClass::Gradient);
        assert!(
            matches!(residency[total.index()], Residency::Persistent(_)),
            "the total lives across micro-batches"
        );
        // The micro-batch gradient dies at its accumulation, right after its last write.
        let pos = plan.step_position_of("backward", i);
        match residency[micro.index()] {
            Residency::Transient(r) => assert_eq!(r.last, pos),
            Residency::Persistent(why) => panic!("micro gradient persists: {why:?}"),
        }
        // Nothing after it in the backward touches the micro-batch gradient.
        assert!(plan.backward[i + 1..]
            .iter()
            .all(|o| o.operands().iter().all(|&(_, id)| id != *micro)));
    }
    assert_eq!(added + in_gemm, plan.params.len());
    assert!(
        added > 0 && in_gemm > 0,
        "both forms: {added} added, {in_gemm} in a GEMM"
    );
    // The optimizer program reads the totals only.
    for op in &plan.optimizer {
        for (_, id) in op.operands() {
            assert!(!plan.buffer(id).name.ends_with(".micro"), "{}", op.name());
        }
    }
    // Model FLOPs count every micro-batch.
    let flops1 = compile("examples/tiny.asteria", 8, 1).model_flops_per_step();
    assert!((plan.model_flops_per_step() / flops1 - 3.0).abs() < 1e-12);
    // A hand-edited plan whose accumulation does not average its micro-batches is refused.
    let mut bad = plan.clone();
    if let Some(Op::GradAccumulate { scale, .. }) = bad
        .backward
        .iter_mut()
        .find(|o| matches!(o, Op::GradAccumulate { .. }))
    {
        *scale = 0.5;
    }
    let e = bad.verify().expect_err("scale 1/2 with grad_accum 3");
    assert!(e.to_string().contains("1 / grad_accum"), "{e}");
    let mut bad = plan.clone();
    bad.train.grad_accum = 1;
    assert!(bad.verify().is_err(), "accumulation in a one-batch plan");
    // A plan that says it accumulates but would overwrite a gradient on every micro-batch.
    let mut bad = compile("examples/tiny.asteria", 8, 1);
    bad.train.grad_accum = 3;
    let e = bad.verify().expect_err("grad_accum 3 without accumulation");
    assert!(
        e.to_string().contains("not accumulated exactly once"),
        "{e}"
    );
    let mut bad = plan.clone();
    if let Some(Op::MatMul {
        micro_accumulate, ..
    }) = bad.backward.iter_mut().find(|o| {
        matches!(
            o,
            Op::MatMul {
                micro_accumulate: Some(_),
                ..
            }
        )
    }) {
        *micro_accumulate = None;
    }
    let e = bad.verify().expect_err("one weight not accumulated");
    assert!(
        e.to_string().contains("not accumulated exactly once"),
        "{e}"
    );
    // An accumulation whose micro-batch buffer is its total, or is never written before it.
    let first_add = |p: &Plan| {
        p.backward
            .iter()
            .position(|o| matches!(o, Op::GradAccumulate { .. }))
            .expect("a grad_accumulate")
    };
    let mut bad = plan.clone();
    let i = first_add(&bad);
    if let Op::GradAccumulate { micro, total, .. } = &mut bad.backward[i] {
        *micro = *total;
    }
    let e = bad.verify().expect_err("micro == total");
    assert!(e.to_string().contains("both the micro-batch"), "{e}");
    let mut bad = plan.clone();
    let i = first_add(&bad);
    let op = bad.backward.remove(i);
    bad.backward.insert(0, op);
    let e = bad.verify().expect_err("micro never written before");
    assert!(
        e.to_string().contains("no earlier backward op writes"),
        "{e}"
    );
    // A micro-accumulating GEMM that reads its own output (β = 1 would alias).
    let mut bad = plan.clone();
    if let Some(Op::MatMul { a, out, .. }) = bad.backward.iter_mut().find(|o| {
        matches!(
            o,
            Op::MatMul {
                micro_accumulate: Some(_),
                ..
            }
        )
    }) {
        *a = *out;
    }
    assert!(bad.verify().is_err(), "a GEMM reading its own total");
    // Tier copies in the backward would run once per micro-batch.
    let mut bad = plan.clone();
    let g = bad.params[0].grad;
    bad.backward.push(Op::CopyOut { src: g, dst: g });
    let e = bad
        .verify()
        .expect_err("a copy in the backward of an accumulating plan");
    assert!(e.to_string().contains("optimizer program"), "{e}");
}

#[test]
fn poisoned_accumulation_is_bit_identical() {
    let cache = tempfile::tempdir().expect("tempdir");
    for spec in ["examples/tiny.asteria", "examples/tiny-soap.asteria"] {
        let plan = compile(spec, 4, 3);
        let (a, pa) = run(&plan, 3, false, cache.path());
        let (b, pb) = run(&plan, 3, true, cache.path());
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.train_losses), bits(&b.train_losses), "{spec}");
        assert!(a.train_losses.iter().all(|l| l.is_finite()));
        for ((n, x), (_, y)) in pa.iter().zip(&pb) {
            assert_eq!(bits(x), bits(y), "{spec}: `{n}` differs when poisoned");
        }
    }
}

#[test]
fn resumed_accumulating_run_replays_its_data_position() {
    let cache = tempfile::tempdir().expect("tempdir");
    let ck = tempfile::tempdir().expect("tempdir");
    let plan = compile("examples/tiny.asteria", 4, 2);
    let (full, pfull) = run(&plan, 4, false, cache.path());
    let base = TrainOptions {
        cache_dir: Some(cache.path().to_path_buf()),
        quiet: true,
        ..TrainOptions::default()
    };
    let mut e = CpuEngine::<f32>::new(plan.clone(), EngineOptions::default()).expect("engine");
    train_with(
        &mut e,
        &TrainOptions {
            steps: Some(2),
            checkpoint_dir: Some(ck.path().to_path_buf()),
            ..base.clone()
        },
    )
    .expect("first half");
    let mut e = CpuEngine::<f32>::new(plan.clone(), EngineOptions::default()).expect("engine");
    let second = train_with(
        &mut e,
        &TrainOptions {
            steps: Some(4),
            resume: Some(ck.path().to_path_buf()),
            ..base
        },
    )
    .expect("resumed half");
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&full.train_losses[2..]), bits(&second.train_losses));
    for ((n, x), (_, y)) in pfull.iter().zip(&e.params()) {
        assert_eq!(bits(x), bits(y), "`{n}` differs after resuming");
    }
}

/// Offload tiers with accumulation: `examples/tiny-tiers.asteria` (moments in the host and
/// NVMe tiers) at `grad_accum = 2` trains bit for bit like the same plan without budgets, and
/// a budget that streams gradients to the host tier without accumulation streams none with
/// it (the totals live across micro-batches; `tier-placement` moves moments instead).
#[test]
fn accumulation_with_offload_tiers_is_bit_identical_and_keeps_gradients_on_the_device() {
    let cache = tempfile::tempdir().expect("tempdir");
    let tiered = compile_with("examples/tiny-tiers.asteria", |c| c.train.grad_accum = 2);
    let offloaded = tiered
        .memory
        .slots
        .iter()
        .filter(|s| !s.arena.on_device())
        .count();
    assert!(offloaded > 0, "the spec's budgets offload moments");
    let plain = compile_with("examples/tiny-tiers.asteria", |c| {
        c.train.grad_accum = 2;
        set_budgets(c, ir::Budgets::default());
    });
    let (a, pa) = run(&tiered, 4, false, cache.path());
    let (b, pb) = run(&plain, 4, false, cache.path());
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a.train_losses), bits(&b.train_losses));
    for ((n, x), (_, y)) in pa.iter().zip(&pb) {
        assert_eq!(
            bits(x),
            bits(y),
            "`{n}` differs between tiered and untiered"
        );
    }
    // The largest budget (in 64 KiB steps below the need) at which the one-batch plan
    // streams gradients (tests/tiers.rs) streams none with accumulation.
    let with_budget = |accum: u64, bytes: u64| {
        let path = root().join("examples/tiny-tiers.asteria");
        let mut config = frontend::load_spec(&path).expect("spec");
        config.train.grad_accum = accum;
        set_budgets(
            &mut config,
            ir::Budgets {
                device: Some(bytes),
                ..Default::default()
            },
        );
        let mut module = ir::Module::new(config);
        let mut pm = PassManager::new(PassOptions::default()).expect("pass manager");
        pm.run(&mut module, None, &mut std::io::sink())
            .ok()
            .and_then(|(cx, _)| cx.plan)
    };
    let need = compile_with("examples/tiny-tiers.asteria", |c| {
        set_budgets(c, ir::Budgets::default())
    })
    .memory
    .device_bytes() as u64;
    let streams = |p: &Plan| p.backward.iter().any(|o| matches!(o, Op::CopyOut { .. }));
    // Without accumulation some budget below the need streams gradients (tests/tiers.rs);
    // with it, no budget down to where nothing fits does (moments go to the host tier, then
    // the compile error names the largest consumers).
    let walk = |accum: u64| -> (usize, usize) {
        let (mut compiled, mut streaming) = (0, 0);
        let mut budget = need;
        while budget > need / 4 {
            budget -= 64 << 10;
            if let Some(p) = with_budget(accum, budget) {
                compiled += 1;
                if streams(&p) {
                    streaming += 1;
                    p.verify().expect("verifies");
                }
            }
        }
        (compiled, streaming)
    };
    let (_, streaming_one) = walk(1);
    assert!(
        streaming_one > 0,
        "some budget streams gradients without accumulation"
    );
    let (compiled, streaming) = walk(2);
    assert!(compiled > 0);
    assert_eq!(streaming, 0, "an accumulated gradient left the device");
    // A budget nothing meets says why gradients did not move.
    let path = root().join("examples/tiny-tiers.asteria");
    let mut config = frontend::load_spec(&path).expect("spec");
    config.train.grad_accum = 2;
    set_budgets(
        &mut config,
        ir::Budgets {
            device: Some(need / 8),
            ..Default::default()
        },
    );
    let mut module = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pass manager");
    let e = pm
        .run(&mut module, None, &mut std::io::sink())
        .err()
        .expect("an eighth of the need is too little");
    let e = e.to_string();
    assert!(
        e.contains("gradients and parameters stay on the device under grad_accum = 2"),
        "{e}"
    );
}

fn set_budgets(c: &mut ir::config::Config, b: ir::Budgets) {
    match &mut c.target {
        ir::config::TargetConfig::Cpu { budgets, .. }
        | ir::config::TargetConfig::Cuda { budgets, .. } => *budgets = b,
    }
}

/// A run resumed under another `grad_accum` continues from its checkpoint's data position:
/// 2 steps of 2 micro-batches, then 2 steps of 1, have drawn 6 batches.
#[test]
fn resuming_under_another_grad_accum_keeps_the_data_position() {
    let cache = tempfile::tempdir().expect("tempdir");
    let ck = tempfile::tempdir().expect("tempdir");
    let base = TrainOptions {
        cache_dir: Some(cache.path().to_path_buf()),
        quiet: true,
        checkpoint_dir: Some(ck.path().to_path_buf()),
        ..TrainOptions::default()
    };
    let two = compile("examples/tiny.asteria", 4, 2);
    let mut e = CpuEngine::<f32>::new(two, EngineOptions::default()).expect("engine");
    train_with(
        &mut e,
        &TrainOptions {
            steps: Some(2),
            ..base.clone()
        },
    )
    .expect("two steps of 2 micro-batches");
    assert_eq!(
        engine::checkpoint::load(ck.path())
            .expect("load")
            .meta
            .batches,
        4
    );
    let one = compile("examples/tiny.asteria", 4, 1);
    let mut e = CpuEngine::<f32>::new(one, EngineOptions::default()).expect("engine");
    train_with(
        &mut e,
        &TrainOptions {
            steps: Some(4),
            resume: Some(ck.path().to_path_buf()),
            ..base
        },
    )
    .expect("two more steps of 1");
    let meta = engine::checkpoint::load(ck.path()).expect("load").meta;
    assert_eq!((meta.step, meta.batches), (4, 6));
}
