//! The run options are part of the plan: spec keys lowered into `TargetPlan`, printed at the
//! start of every run, overridable by CLI flags that rewrite the plan, checked by the plan
//! verifier.
use std::path::PathBuf;
use std::process::{Command, Output};

fn asteria(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_asteria"))
        .args(args)
        .current_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."))
        .env("RUST_LOG", "warn")
        .output()
        .expect("asteria runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `tiny-soap.asteria` with its `target` block replaced by `target`, written to a temp dir.
fn spec_with_target(dir: &std::path::Path, target: &str) -> PathBuf {
    let src = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny-soap.asteria"),
    )
    .expect("example");
    let cut = src.find("target cpu {").expect("target block");
    let path = dir.join("spec.asteria");
    std::fs::write(&path, format!("{}{target}\n", &src[..cut])).expect("write");
    path
}

#[test]
fn a_run_prints_the_options_it_uses_and_cli_overrides_are_recorded() {
    let o = asteria(&["train", "examples/tiny.asteria", "--steps", "1", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let first = stderr(&o).lines().next().unwrap_or_default().to_string();
    assert_eq!(
        first,
        "target cpu: threads all, staleness 0, eigensolver faer; train: rematerialize off, max_skipped_steps 10, refresh_swap finished, grad_accum 1"
    );
    // An unknown value names the allowed ones; a measurement switch for the GPU is refused on
    // a CPU plan instead of being ignored.
    let o = asteria(&["train", "examples/tiny.asteria", "--eigensolver", "lapak"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("faer, lapack"), "{}", stderr(&o));
    let o = asteria(&[
        "train",
        "examples/tiny.asteria",
        "--steps",
        "1",
        "--profile",
        "events",
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("targets the CPU engine"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn cuda_options_reach_the_plan_and_the_verifier_holds_placements_to_them() {
    let dir = std::env::temp_dir().join(format!("asteria-options-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let spec = spec_with_target(
        &dir,
        "target cuda {\n  staleness = 2\n  attention = gemm\n  refresh_placement = gpu\n}",
    );
    let plan = dir.join("plan.json");
    let o = asteria(&[
        "compile",
        spec.to_str().expect("utf8"),
        "-o",
        plan.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
    let target = &json["target"];
    assert_eq!(target["kind"], "cuda");
    assert_eq!(target["attention"], "gemm");
    assert_eq!(target["refresh_placement"], "gpu");
    assert_eq!(target["precision"], "bf16");
    assert_eq!(target["eigensolver"], "faer");
    let tasks = json["host_tasks"].as_array().expect("tasks").clone();
    assert!(!tasks.is_empty());
    assert!(tasks.iter().all(|t| t["placement"] == "gpu_side"));
    // A refresh placed against the recorded policy is refused before anything runs.
    json["host_tasks"][0]["placement"] = serde_json::json!("host");
    std::fs::write(&plan, json.to_string()).expect("write");
    let o = asteria(&["run", plan.to_str().expect("utf8"), "--steps", "1"]);
    assert!(!o.status.success());
    let err = stderr(&o).split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        err.contains("contradicts the target's refresh_placement = gpu"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
