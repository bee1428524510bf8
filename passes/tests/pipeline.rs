//! The whole pipeline on every example spec: each pass's output verifies, the IR printed after
//! every pass parses back and prints identically, and the plan verifies.
use passes::{PassManager, PassOptions};
use std::path::PathBuf;

fn examples() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("examples/ exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "asteria"))
        .collect();
    v.sort();
    assert!(v.len() >= 4, "expected the four example specs, found {v:?}");
    v
}

#[test]
fn every_example_compiles_and_round_trips_after_every_pass() {
    // Each example as written, with `rematerialize = layers` (recomputed `.remat` values in
    // the backward section), and with `grad_accum = 2` (the plan's accumulation ops).
    let specs = examples()
        .into_iter()
        .flat_map(|s| [(s.clone(), false, 1), (s.clone(), true, 1), (s, false, 2)]);
    for (spec, remat, grad_accum) in specs {
        let mut config =
            frontend::load_spec(&spec).unwrap_or_else(|e| panic!("{}: {e:?}", spec.display()));
        if remat {
            config.train.rematerialize = ir::Rematerialize::Layers;
        }
        config.train.grad_accum = grad_accum;
        let mut module = ir::Module::new(config);
        for pass in PassManager::pass_names() {
            if pass == "lower" {
                break;
            }
            let mut pm = PassManager::new(PassOptions {
                verify_each: true,
                ..Default::default()
            })
            .expect("pm");
            let mut fresh = ir::Module::new(module.config.clone());
            let (_cx, _) = pm
                .run(&mut fresh, Some(pass), &mut std::io::sink())
                .expect("pipeline runs");
            let text = fresh.to_string();
            let parsed = ir::parse_module(&text)
                .unwrap_or_else(|e| panic!("{} after {pass}: {e}", spec.display()));
            assert_eq!(
                parsed.to_string(),
                text,
                "{} after {pass}: print → parse → print differs",
                spec.display()
            );
            ir::verify(&parsed).unwrap_or_else(|e| {
                panic!(
                    "{} after {pass}: parsed module fails verify: {e:?}",
                    spec.display()
                )
            });
            module = fresh;
        }
        let mut pm = PassManager::new(PassOptions::default()).expect("pm");
        let mut m = ir::Module::new(module.config.clone());
        let (cx, timings) = pm
            .run(&mut m, None, &mut std::io::sink())
            .expect("pipeline runs");
        assert_eq!(timings.len(), 15);
        assert_eq!(timings[3].pass, "simplify");
        assert_eq!(timings[4].pass, "fuse");
        assert_eq!(timings[5].pass, "rematerialize");
        assert_eq!(timings[9].pass, "accumulate-gradients");
        assert_eq!(timings[12].pass, "copy-hoisting");
        assert_eq!(timings[13].pass, "memory-planning");
        assert_eq!(timings[14].pass, "copy-out-overlap");
        let plan = cx.plan.expect("plan");
        plan.verify().expect("plan verifies");
        let back = schedule::Plan::from_json(&plan.to_json()).expect("plan JSON round trips");
        assert_eq!(back, plan);
        let accumulating = plan.backward.iter().any(|op| {
            matches!(
                op,
                schedule::Op::GradAccumulate { .. }
                    | schedule::Op::MatMul {
                        micro_accumulate: Some(_),
                        ..
                    }
            )
        });
        assert_eq!(accumulating, grad_accum > 1, "{}", spec.display());
    }
}

#[test]
fn print_after_all_prints_all_five_passes() {
    let spec = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny-soap.asteria");
    let config = frontend::load_spec(&spec).expect("spec");
    let mut m = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions {
        print_after_all: true,
        ..Default::default()
    })
    .expect("pm");
    let mut out = Vec::new();
    pm.run(&mut m, None, &mut out).expect("pipeline runs");
    let text = String::from_utf8(out).expect("utf8");
    for header in [
        "; IR after expand-model",
        "; IR after autodiff",
        "; IR after expand-optimizer",
        "; IR after fuse",
        "; fuse report",
        "; IR after rematerialize",
        "; IR after liveness",
        "; plan after lower",
        "; memory plan after memory-planning",
    ] {
        assert!(
            text.contains(header),
            "missing `{header}` in --print-after-all output"
        );
    }
    assert!(text.contains("; liveness: bytes per class"));
}

#[test]
fn unknown_pass_name_is_an_error() {
    let err = PassManager::new(PassOptions {
        print_after: vec!["autodif".into()],
        ..Default::default()
    });
    assert!(err.is_err());
}

/// Regenerates the file-test inputs in `passes/filetests/` from `small.asteria` (the IR before
/// each tested pass; the `fuse` inputs also on the CPU target and as a LLaMA, which has no
/// biases). Run by hand: `cargo test --release -p asteria-passes --test pipeline --
/// --ignored regenerate`. The hand-written `fuse-blocked-*.ir` are not regenerated.
#[test]
#[ignore]
fn regenerate_filetest_inputs() {
    use ir::config::{Family, TargetConfig};
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("filetests");
    let config = frontend::load_spec(&dir.join("small.asteria")).expect("spec");
    let mut cpu = config.clone();
    cpu.target = TargetConfig::Cpu {
        threads: None,
        staleness: config.target.staleness(),
        calibration: None,
        eigensolver: config.target.eigensolver(),
        budgets: Default::default(),
    };
    let mut llama = config.clone();
    llama.model.family = Family::Llama;
    let mut gpt2_selective = config.clone();
    gpt2_selective.train.rematerialize = ir::Rematerialize::Selective;
    let mut llama_layers = llama.clone();
    llama_layers.train.rematerialize = ir::Rematerialize::Layers;
    let gpt2 = "A one-block GPT-2 (SOAP) under CUDA precision = bf16: every mat_mul + bias_add \
                pair becomes a\n; mat_mul_bias, and the outputs only GEMMs read (layer norms, \
                gelu, attention, dlogits) become bf16.";
    let gpt2_cpu = "The same GPT-2 on the CPU target: bias epilogues (bit-identical there), no \
                    bf16 outputs.";
    let llama_bf16 = "The same as a LLaMA (no biases: nothing to fuse into a GEMM) under CUDA \
                      bf16: only the attention\n; output and dlogits become bf16 (RMSNorm and \
                      SwiGLU outputs have no bf16 producer).";
    for (file, cfg, before, pass, about) in [
        ("autodiff-gpt2.ir", &config, "expand-model", "autodiff", ""),
        (
            "expand-optimizer-soap.ir",
            &config,
            "autodiff",
            "expand-optimizer",
            "",
        ),
        (
            "fuse-gpt2-bf16.ir",
            &config,
            "expand-optimizer",
            "fuse",
            gpt2,
        ),
        (
            "fuse-gpt2-cpu.ir",
            &cpu,
            "expand-optimizer",
            "fuse",
            gpt2_cpu,
        ),
        (
            "fuse-llama-bf16.ir",
            &llama,
            "expand-optimizer",
            "fuse",
            llama_bf16,
        ),
        (
            "rematerialize-gpt2-selective.ir",
            &gpt2_selective,
            "fuse",
            "rematerialize",
            "The GPT-2 under bf16 with `rematerialize = selective`: the layer norms and GELU \
             are rerun\n; in the backward (`.remat`) from the inputs their backward keeps anyway.",
        ),
        (
            "rematerialize-llama-layers.ir",
            &llama_layers,
            "fuse",
            "rematerialize",
            "The LLaMA under bf16 with `rematerialize = layers`: the block's forward (GEMMs and \
             attention\n; included) is rerun before its backward; only the residual stream is kept.",
        ),
        ("liveness-soap.ir", &config, "fuse", "liveness", ""),
        (
            "precond-scheduling-soap.ir",
            &config,
            "liveness",
            "precond-scheduling",
            "",
        ),
    ] {
        let mut m = ir::Module::new(cfg.clone());
        let mut pm = PassManager::new(PassOptions::default()).expect("pm");
        pm.run(&mut m, Some(before), &mut std::io::sink())
            .expect("pipeline");
        let about = match about {
            "" => String::new(),
            a => format!("; {a}\n"),
        };
        std::fs::write(dir.join(file), format!("; test: {pass}\n{about}{m}")).expect("write");
    }
}
