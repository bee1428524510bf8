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
    for spec in examples() {
        let config =
            frontend::load_spec(&spec).unwrap_or_else(|e| panic!("{}: {e:?}", spec.display()));
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
        assert_eq!(timings.len(), 7);
        assert_eq!(timings[6].pass, "memory-planning");
        let plan = cx.plan.expect("plan");
        plan.verify().expect("plan verifies");
        let back = schedule::Plan::from_json(&plan.to_json()).expect("plan JSON round trips");
        assert_eq!(back, plan);
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
/// each tested pass). Run by hand: `cargo test --release -p asteria-passes --test pipeline --
/// --ignored regenerate`.
#[test]
#[ignore]
fn regenerate_filetest_inputs() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("filetests");
    let config = frontend::load_spec(&dir.join("small.asteria")).expect("spec");
    for (file, before, pass) in [
        ("autodiff-gpt2.ir", "expand-model", "autodiff"),
        ("expand-optimizer-soap.ir", "autodiff", "expand-optimizer"),
        ("liveness-soap.ir", "expand-optimizer", "liveness"),
        (
            "precond-scheduling-soap.ir",
            "liveness",
            "precond-scheduling",
        ),
    ] {
        let mut m = ir::Module::new(config.clone());
        let mut pm = PassManager::new(PassOptions::default()).expect("pm");
        pm.run(&mut m, Some(before), &mut std::io::sink())
            .expect("pipeline");
        std::fs::write(dir.join(file), format!("; test: {pass}\n{m}")).expect("write");
    }
}
