//! End-to-end tests of the `asteria` binary: compile, explain, print flags, plan rejection.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn asteria(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_asteria"))
        .args(args)
        .current_dir(root())
        .env("RUST_LOG", "warn")
        .output()
        .expect("asteria runs")
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn compiled_plan(dir: &Path) -> (PathBuf, serde_json::Value) {
    let plan = dir.join("tiny.plan.json");
    let o = asteria(&[
        "compile",
        "examples/tiny-soap.asteria",
        "-o",
        plan.to_str().expect("utf8 path"),
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan written")).expect("json");
    (plan, json)
}

fn run_rejects(dir: &Path, name: &str, json: &str, expect: &str) {
    let path = dir.join(name);
    std::fs::write(&path, json).expect("write");
    let o = asteria(&[
        "run",
        path.to_str().expect("utf8"),
        "--steps",
        "1",
        "--quiet",
    ]);
    // miette wraps long lines and draws a margin: compare on collapsed whitespace.
    let err = text(&o)
        .1
        .replace('│', " ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(!o.status.success(), "{name}: a bad plan must fail");
    assert!(err.contains("rejected plan"), "{name}: {err}");
    assert!(
        err.contains(expect),
        "{name}: expected `{expect}` in:\n{err}"
    );
}

#[test]
fn truncated_malformed_and_tampered_plans_are_rejected_before_running() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (plan, json) = compiled_plan(dir.path());
    let full = std::fs::read_to_string(&plan).expect("read");
    run_rejects(
        dir.path(),
        "truncated.json",
        &full[..full.len() / 2],
        "not a valid asteria plan",
    );
    run_rejects(
        dir.path(),
        "garbage.json",
        "this is not json",
        "not a valid asteria plan",
    );

    let mut v = json.clone();
    v["version"] = serde_json::json!(99);
    run_rejects(dir.path(), "version.json", &v.to_string(), "version 99");

    let mut v = json.clone();
    let n = v["buffers"].as_array().expect("buffers").len();
    v["forward"][0]["out"] = serde_json::json!(n + 5);
    run_rejects(
        dir.path(),
        "out-of-range.json",
        &v.to_string(),
        "refers to buffer",
    );

    let mut v = json.clone();
    let out = v["forward"][0]["out"].as_u64().expect("id") as usize;
    v["buffers"][out]["shape"] = serde_json::json!([3, 5]);
    run_rejects(dir.path(), "shape.json", &v.to_string(), "must have shape");

    let mut v = json.clone();
    v["host_tasks"][0]["side"] = serde_json::json!(7);
    run_rejects(dir.path(), "side.json", &v.to_string(), "side 7");

    let mut v = json.clone();
    v["data"]["val_fraction"] = serde_json::json!(1.5);
    run_rejects(dir.path(), "val.json", &v.to_string(), "val_fraction");

    // Memory plan: a misaligned offset, a buffer past its arena, two persistent buffers on
    // the same bytes.
    let mut v = json.clone();
    let off = v["memory"]["slots"][0]["offset"].as_u64().expect("offset");
    v["memory"]["slots"][0]["offset"] = serde_json::json!(off + 8);
    run_rejects(
        dir.path(),
        "misaligned.json",
        &v.to_string(),
        "not a multiple of the 256-byte alignment",
    );
    let mut v = json.clone();
    v["memory"]["slots"][0]["offset"] = serde_json::json!(1u64 << 40);
    run_rejects(
        dir.path(),
        "outside.json",
        &v.to_string(),
        "does not fit in arena",
    );
    let mut v = json;
    let p0 = v["params"][0]["param"].as_u64().expect("param") as usize;
    let p1 = v["params"][1]["param"].as_u64().expect("param") as usize;
    v["memory"]["slots"][p1] = v["memory"]["slots"][p0].clone();
    run_rejects(
        dir.path(),
        "shared-params.json",
        &v.to_string(),
        "never share bytes",
    );
}

#[test]
fn print_after_all_prints_all_five_passes_and_time_passes_reports_each() {
    let o = asteria(&[
        "compile",
        "examples/tiny.asteria",
        "--print-after-all",
        "--time-passes",
        "--verify-each",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for p in [
        "expand-model",
        "autodiff",
        "expand-optimizer",
        "fuse",
        "liveness",
    ] {
        assert!(
            out.contains(&format!("; IR after {p}")),
            "missing dump after {p}"
        );
        assert!(err.contains(p), "--time-passes misses {p}");
    }
    assert!(out.contains("; plan after lower"));
    assert!(err.contains("lower"));
    assert!(out.contains("; memory plan after memory-planning"));
    assert!(err.contains("memory-planning") && err.contains("activations arena"));
}

#[test]
fn print_after_fuse_shows_the_fused_ops_of_gpt2_124m_and_skip_pass_keeps_them_apart() {
    let o = asteria(&[
        "compile",
        "examples/gpt2-124m.asteria",
        "--print-after",
        "fuse",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("; IR after fuse"));
    assert!(out.contains("%h0.qkv: f32[16384, 2304] = mat_mul_bias %h0.ln_1, %h0.attn.c_attn.weight, %h0.attn.c_attn.bias"));
    assert!(out.contains("%h0.gelu: bf16[16384, 3072] = gelu %h0.fc"));
    assert!(out.contains("%d.logits: bf16[16384, 50304] = cross_entropy_backward"));
    assert!(out.contains("%h0.attn.lse: f32[196608] = attention %h0.qkv"));
    assert!(out.contains("; bias-epilogue: %h11.mlp_proj = mat_mul_bias"));
    assert!(!out.contains(" = bias_add "));
    let o = asteria(&[
        "compile",
        "examples/gpt2-124m.asteria",
        "--skip-pass",
        "fuse",
        "--print-after",
        "fuse",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains(" = bias_add ") && !out.contains("mat_mul_bias") && !out.contains("bf16[")
    );
    let o = asteria(&["compile", "examples/tiny.asteria", "--skip-pass", "lower"]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("cannot be skipped"), "{}", text(&o).1);
}

#[test]
fn print_after_one_pass_and_unknown_pass() {
    let o = asteria(&[
        "compile",
        "examples/tiny-soap.asteria",
        "--print-after",
        "expand-optimizer",
    ]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    assert!(out.contains("; IR after expand-optimizer") && !out.contains("; IR after autodiff"));
    assert!(out.contains("soap_update") && out.contains("eigenbasis_refresh"));
    let o = asteria(&[
        "compile",
        "examples/tiny.asteria",
        "--print-after",
        "autodif",
    ]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("unknown pass `autodif`"));
}

#[test]
fn explain_reports_bytes_per_class_and_ops() {
    let o = asteria(&["explain", "examples/tiny-soap.asteria"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for w in [
        "parameter",
        "kronecker_factor",
        "eigenbasis",
        "exp_avg_sq",
        "activation",
        "memory per tier",
        "arena activations",
        "one place per buffer",
        "ops per step",
        "eigenbasis_refresh every 10 steps",
    ] {
        assert!(out.contains(w), "explain output lacks `{w}`:\n{out}");
    }
}

#[test]
fn bad_spec_fails_with_location_and_nonzero_exit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = dir.path().join("bad.asteria");
    let good = std::fs::read_to_string(root().join("examples/tiny.asteria")).expect("read");
    std::fs::write(&spec, good.replace("d_model = 64", "d_modle = 64")).expect("write");
    let o = asteria(&["compile", spec.to_str().expect("utf8")]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("bad.asteria"), "{err}");
    assert!(
        err.contains("d_model"),
        "expected a did-you-mean hint: {err}"
    );
}

#[test]
fn cuda_plan_is_refused_by_the_cpu_build_with_a_clear_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plan = dir.path().join("gpu.json");
    let o = asteria(&[
        "compile",
        "examples/gpt2-124m.asteria",
        "-o",
        plan.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let o = asteria(&[
        "run",
        plan.to_str().expect("utf8"),
        "--steps",
        "1",
        "--quiet",
    ]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("targets CUDA"), "{:?}", text(&o));
}

#[test]
fn run_executes_a_compiled_plan_and_writes_metrics() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (plan, _) = compiled_plan(dir.path());
    let metrics = dir.path().join("m.jsonl");
    let o = asteria(&[
        "run",
        plan.to_str().expect("utf8"),
        "--steps",
        "3",
        "--quiet",
        "--metrics",
        metrics.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    let steps: Vec<&serde_json::Value> = lines.iter().filter(|l| l.get("loss").is_some()).collect();
    assert_eq!(steps.len(), 3);
    for s in &steps {
        for k in ["step", "loss", "lr", "step_ms", "tokens_per_s"] {
            assert!(s.get(k).is_some(), "metrics line lacks `{k}`: {s}");
        }
        assert!(s["loss"].as_f64().expect("loss").is_finite());
    }
    assert!(
        lines.iter().any(|l| l.get("val_loss").is_some()),
        "no validation line"
    );
}

#[test]
fn calibrate_names_its_devices_and_needs_a_driver_for_cuda() {
    let out = asteria(&[
        "calibrate",
        "--device",
        "tpu",
        "--sizes",
        "16",
        "--reps",
        "1",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("`cpu`") && err.contains("`cuda`"), "{err}");
    if !cuda::driver_present() {
        let out = asteria(&[
            "calibrate",
            "--device",
            "cuda",
            "--sizes",
            "16",
            "--reps",
            "1",
        ]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("libcuda"), "{err}");
    }
}
