//! End-to-end tests of the `asteria` binary: compile, explain, print flags, plan rejection.
mod cli_common;

use cli_common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

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
    // qkv is bf16 (only the tensor-core attention reads it), so its bias is cast too.
    assert!(out.contains("%h0.qkv: bf16[16384, 2304] = mat_mul_bias %h0.ln_1, %h0.attn.c_attn.weight.bf16, %h0.attn.c_attn.bias.bf16"));
    assert!(out.contains("%h0.attn.c_attn.bias.bf16: bf16[2304] = cast %h0.attn.c_attn.bias"));
    assert!(
        out.contains("%h0.attn.c_attn.weight.bf16: bf16[2304, 768] = cast %h0.attn.c_attn.weight")
    );
    assert!(out.contains(
        "; bf16-cast: %h0.attn.c_attn.weight.bf16 = cast %h0.attn.c_attn.weight (forward)"
    ));
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
    // SOAP's step as expand-optimizer writes it: the composition `fuse` makes one op.
    assert!(out.contains("= project %") && out.contains("elementwise_update %"));
    assert!(!out.contains("soap_update") && out.contains("eigenbasis_refresh"));
    let o = asteria(&[
        "compile",
        "examples/tiny-soap.asteria",
        "--print-after",
        "fuse",
    ]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    assert!(out.contains("soap_update %") && !out.contains("= project %"));
    assert!(
        out.contains("; soap-update: 28 composed SOAP steps"),
        "{out}"
    );
    // Before a pass that works on the plan, the plan as it stands (not the IR).
    let o = asteria(&[
        "compile",
        "examples/tiny.asteria",
        "--print-before",
        "memory-planning",
    ]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    assert!(out.contains("; plan before memory-planning"), "{out}");
    assert!(
        out.contains("optimizer[0] ") && !out.contains("; IR before"),
        "{out}"
    );
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

/// `explain` on a tiered spec (`examples/tiny-tiers.asteria`: a 5 MiB working set, 1 MiB of
/// host tier, the rest of the moments on NVMe) shows the bytes and tensors in each tier with
/// their predicted copy time, and the device budget against the need.
#[test]
fn explain_shows_bytes_per_tier_and_predicted_copies_of_a_tiered_spec() {
    let o = asteria(&["explain", "examples/tiny-tiers.asteria"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let line = |prefix: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line:\n{out}"))
            .to_string()
    };
    let host = line("host ");
    let nvme = line("nvme ");
    for (l, what) in [(&host, "host"), (&nvme, "nvme")] {
        assert!(
            l.contains("offloaded by tier-placement") && l.contains("ms per step"),
            "{what}: {l}"
        );
    }
    assert!(
        host.contains("1.00 MiB") && host.contains("4 tensors"),
        "{host}"
    );
    assert!(nvme.contains("6 tensors"), "{nvme}");
    assert!(line("copies ").contains("predicted in all"), "{out}");
    assert!(line("device budget").contains("5.00 MiB"), "{out}");
    assert!(out.contains("staging"), "{out}");
}

/// `--print-after prefetch-insertion` (and `copy-hoisting`) lists every copy with its tiers,
/// its stream and the op that waits for it (a copy in) or that it follows (a copy out); each
/// waiting op comes after its copy in, each followed op before its copy out.
#[test]
fn print_after_prefetch_insertion_lists_copies_with_streams_and_waits() {
    for pass in ["prefetch-insertion", "copy-hoisting"] {
        let o = asteria(&[
            "compile",
            "examples/tiny-tiers.asteria",
            "--print-after",
            pass,
            "-o",
            std::env::temp_dir()
                .join(format!("asteria-cli-copies-{}.json", std::process::id()))
                .to_str()
                .expect("utf-8"),
        ]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{err}");
        let index = |pos: &str| -> usize {
            pos.trim_start_matches(|c: char| c.is_ascii_alphabetic())
                .trim_matches(|c| c == '[' || c == ']')
                .parse()
                .unwrap_or_else(|_| panic!("{pos}"))
        };
        let (mut ins, mut outs) = (0, 0);
        let copies = out.lines().filter(|l| {
            // The listing's lines (`copy_in  %src [tier] -> ...`), not the program's.
            l.starts_with(";   ") && (l.contains(" copy_in  %") || l.contains(" copy_out %"))
        });
        for l in copies {
            let words: Vec<&str> = l.split_whitespace().collect();
            let at = index(words[1]);
            if l.contains(" copy_in ") {
                ins += 1;
                assert!(
                    l.contains("copy-in stream;") && l.contains("waits for it"),
                    "{l}"
                );
                let waiter = l.split("stream; ").nth(1).expect("waiter");
                let w = index(waiter.split_whitespace().next().expect("position"));
                assert!(w > at, "{l}");
                assert!(l.contains("[host] ->") || l.contains("[nvme] ->"), "{l}");
            } else {
                outs += 1;
                assert!(l.contains("copy-out stream; after "), "{l}");
                let after = l.split("; after ").nth(1).expect("after");
                let w = index(after.split_whitespace().next().expect("position"));
                assert!(w < at, "{l}");
                assert!(l.contains("[device] ->"), "{l}");
            }
        }
        assert_eq!((ins, outs), (10, 10), "{pass}: {out}");
        assert!(
            out.contains(&format!(
                "; copies after {pass}: 10 copy_in on the copy-in stream, 10 copy_out"
            )),
            "{out}"
        );
    }
}

/// `explain` on a CUDA spec names its device floor (everything tier-placement may move
/// offloaded): a budget just above it compiles, one well below it fails naming a need at
/// least that of the floor's neighbourhood.
#[test]
fn explain_names_the_device_floor_that_tier_placement_meets() {
    let o = asteria(&["explain", "examples/gpt2-124m.asteria"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("floor"))
        .unwrap_or_else(|| panic!("no floor line: {out}"));
    // `floor  NMiB  (X.XX GiB: ...`: N is a budget to pass as printed.
    let mib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.strip_suffix("MiB"))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    let gib = line
        .split('(')
        .nth(1)
        .and_then(|r| r.split(':').next())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(gib.ends_with("GiB"), "{line}");
    let with = |m: u64| {
        asteria(&[
            "compile",
            "examples/gpt2-124m.asteria",
            "--set",
            &format!("target.gpu_memory={m}MiB"),
        ])
    };
    let o = with(mib);
    assert!(o.status.success(), "{:?}", text(&o));
    let o = with(mib * 4 / 5);
    let err = flat(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains(&format!("still leaves {gib}")), "{err}");
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

/// A plan compiled from a spec with a relative corpus path records it absolute: `run`
/// finds the corpus from any working directory.
#[test]
fn a_compiled_plan_runs_from_another_working_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plan = dir.path().join("plan.json");
    let o = asteria(&[
        "compile",
        "examples/tiny.asteria",
        "--set",
        "data.corpus=../README.md",
        "--set",
        "data.seq_len=16",
        "-o",
        plan.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
    let path = json["data"]["corpus"]["paths"][0].as_str().expect("a path");
    assert!(Path::new(path).is_absolute(), "{path}");
    let o = Command::new(env!("CARGO_BIN_EXE_asteria"))
        .args([
            "run",
            plan.to_str().expect("utf8"),
            "--steps",
            "1",
            "--quiet",
        ])
        .current_dir(dir.path())
        .env("RUST_LOG", "warn")
        .output()
        .expect("asteria runs");
    assert!(o.status.success(), "{:?}", text(&o));
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

/// A calibration file is checked before a pass predicts with it: a measured one compiles; the
/// same file with a negative training rate, no host cores or descending sizes is one error
/// naming the field and the range; `calibrate --sizes 0` is refused by the CLI.
#[test]
fn calibration_files_are_validated_before_they_are_used() {
    let o = asteria(&["calibrate", "--sizes", "0"]);
    assert_eq!(o.status.code(), Some(2), "{:?}", text(&o));
    assert!(flat(&o).contains("1..=16384"), "{}", flat(&o));
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("good.json");
    let o = asteria(&[
        "calibrate",
        "--sizes",
        "16,32",
        "--reps",
        "1",
        "-o",
        good.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let desc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&good).expect("read")).expect("json");
    let spec = tiny_with(
        dir.path(),
        "t.asteria",
        "\ntarget cpu {",
        "\ntarget cpu {\n  calibration = \"c.json\"",
    );
    let compile = || asteria(&["compile", spec.to_str().expect("utf8")]);
    std::fs::write(dir.path().join("c.json"), desc.to_string()).expect("write");
    assert!(compile().status.success(), "{:?}", text(&compile()));
    for (field, value, says) in [
        (
            "train_tflops",
            serde_json::json!(-1.0),
            "train_tflops = -1: a positive, finite rate",
        ),
        ("host_cores", serde_json::json!(0), "host_cores = 0"),
        (
            "host_qr_ms",
            serde_json::json!([[32, 1.0], [16, 1.0]]),
            "host_qr_ms: sizes must ascend (32 then 16)",
        ),
    ] {
        let mut bad = desc.clone();
        bad[field] = value;
        std::fs::write(dir.path().join("c.json"), bad.to_string()).expect("write");
        let o = compile();
        assert_eq!(o.status.code(), Some(1), "{field}: {:?}", text(&o));
        let err = flat(&o);
        assert!(
            err.contains(says) && err.contains("c.json"),
            "{field}: {err}"
        );
    }
}

// --- Hostile input (issue 15): each gets one clear message, fast, and never a panic. ---

/// `examples/tiny.asteria` with `from` replaced by `to`, written into `dir` as `name`.
fn tiny_with(dir: &Path, name: &str, from: &str, to: &str) -> PathBuf {
    let src = std::fs::read_to_string(root().join("examples/tiny.asteria")).expect("tiny");
    assert_eq!(
        src.matches(from).count(),
        1,
        "`{from}` once in tiny.asteria"
    );
    let path = dir.join(name);
    std::fs::write(&path, src.replacen(from, to, 1)).expect("write spec");
    path
}

#[test]
fn a_plan_given_to_train_is_one_error_saying_how_to_run_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (plan, _) = compiled_plan(dir.path());
    let o = asteria(&["train", plan.to_str().expect("utf8"), "--quiet"]);
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    let err = flat(&o);
    assert!(err.contains("has 1 error"), "{err}");
    assert!(
        err.contains("is a compiled asteria plan, not a spec"),
        "{err}"
    );
    assert!(err.contains("asteria run"), "{err}");
    // And the other way round: a spec given to `run`.
    let o = asteria(&["run", "examples/tiny.asteria", "--quiet"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(flat(&o).contains("asteria train"), "{}", flat(&o));
}

#[test]
fn a_binary_file_given_as_a_spec_is_one_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("random.bin");
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let bytes: Vec<u8> = (0..5 << 20)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 32) as u8
        })
        .collect();
    std::fs::write(&path, bytes).expect("write");
    let o = asteria(&["compile", path.to_str().expect("utf8")]);
    assert_eq!(o.status.code(), Some(1));
    let err = flat(&o);
    assert!(
        err.contains("has 1 error") && err.contains("is not a text spec"),
        "{err}"
    );
    assert!(o.stderr.len() < 2000, "{} bytes of errors", o.stderr.len());
}

/// Runs `asteria args` with stdout and stderr pipes whose read ends are closed at once, so
/// every write fails with EPIPE; returns the exit code (101 = a panic).
fn exit_code_with_closed_pipes(args: &[&str]) -> Option<i32> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_asteria"))
        .args(args)
        .current_dir(root())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("asteria starts");
    drop(child.stdout.take());
    drop(child.stderr.take());
    child.wait().expect("asteria exits").code()
}

#[test]
fn a_closed_pipe_is_not_a_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (plan, _) = compiled_plan(dir.path());
    // An error report on a closed stderr: still exit status 1.
    assert_eq!(
        exit_code_with_closed_pipes(&["train", plan.to_str().expect("utf8")]),
        Some(1)
    );
    // Dumps and reports on a closed stdout (`asteria compile ... | head -1`): success.
    for args in [
        &["compile", "examples/tiny.asteria", "--print-after-all"][..],
        &["explain", "examples/tiny.asteria"],
        &["calibrate", "--sizes", "16", "--reps", "1"],
    ] {
        assert_eq!(exit_code_with_closed_pipes(args), Some(0), "{args:?}");
    }
}

#[test]
fn zero_steps_is_a_cli_error_not_a_nan_summary() {
    let o = asteria(&["train", "examples/tiny.asteria", "--steps", "0"]);
    assert_eq!(o.status.code(), Some(2));
    let err = flat(&o);
    assert!(err.contains("0 is not in 1..=1000000000"), "{err}");
    assert!(!err.contains("NaN"), "{err}");
}

/// A learning rate far too high: the run finishes (its checkpoints and metrics are the user's),
/// and says that the loss rose instead of falling; a sane run says nothing of the kind.
#[test]
fn a_diverging_run_says_so() {
    let o = asteria(&[
        "train",
        "examples/tiny.asteria",
        "--steps",
        "12",
        "--set",
        "optimizer.lr=10",
    ]);
    assert!(o.status.success(), "{}", flat(&o));
    let err = flat(&o);
    assert!(
        err.contains("the training loss rose from") && err.contains("the run is diverging"),
        "{err}"
    );
    let o = asteria(&["train", "examples/tiny.asteria", "--steps", "12"]);
    assert!(o.status.success(), "{}", flat(&o));
    assert!(!flat(&o).contains("diverg"), "{}", flat(&o));
}

#[test]
fn a_corpus_smaller_than_one_batch_names_both_sizes() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("small.txt"), "word ".repeat(3000)).expect("corpus");
    let spec = tiny_with(
        dir.path(),
        "small.asteria",
        "corpus = builtin",
        "corpus = \"small.txt\"",
    );
    let cache = dir.path().join("cache");
    let o = asteria(&[
        "train",
        spec.to_str().expect("utf8"),
        "--steps",
        "1",
        "--quiet",
        "--cache-dir",
        cache.to_str().expect("utf8"),
    ]);
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    let err = flat(&o);
    assert!(
        err.contains("the validation split has 300 tokens, fewer than one batch of 16 × 64 tokens"),
        "{err}"
    );
    assert!(err.contains("both splits together: 3001 tokens"), "{err}");
}

#[test]
fn a_batch_larger_than_host_memory_is_refused_before_allocating() {
    // 65536 × 64 tokens: the logits and their gradient alone are 2 × 843 GB.
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = tiny_with(
        dir.path(),
        "huge.asteria",
        "batch_size = 16 ",
        "batch_size = 65536 ",
    );
    let o = asteria(&["train", spec.to_str().expect("utf8"), "--steps", "1"]);
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    let err = flat(&o);
    assert!(err.contains("for its buffers but host memory has"), "{err}");
    assert!(err.contains("`logits` [4194304, 50257]"), "{err}");
}

#[test]
fn absurd_spec_numbers_are_located_errors_with_the_range() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (from, to, expect) in [
        (
            "lr = 2e-3",
            "lr = 2e-3 precondition_frequency = 1000000000000",
            "`precondition_frequency` is not valid for `optimizer adamw`",
        ),
        (
            "layers = 2 ",
            "layers = 100000000 ",
            "`layers` = 100000000 is outside the allowed range 1..=1024",
        ),
        (
            "d_model = 64 ",
            "d_model = 1099511627776 ",
            "`d_model` = 1099511627776 is outside the allowed range 1..=65_536",
        ),
        (
            "  # threads = 2 ",
            "  threads = 100000 ",
            "`threads` = 100000 is outside the allowed range 1..=1024",
        ),
    ] {
        let spec = tiny_with(dir.path(), "bad.asteria", from, to);
        let o = asteria(&["compile", spec.to_str().expect("utf8")]);
        assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
        let err = flat(&o);
        assert!(err.contains(expect), "{err}");
        assert!(err.contains("bad.asteria:"), "located: {err}");
    }
    let spec = dir.path().join("soap.asteria");
    let src = std::fs::read_to_string(root().join("examples/tiny-soap.asteria")).expect("spec");
    std::fs::write(
        &spec,
        src.replace(
            "precondition_frequency = 10 ",
            "precondition_frequency = 1000000000000 ",
        ),
    )
    .expect("write");
    let o = asteria(&["compile", spec.to_str().expect("utf8")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        flat(&o).contains(
            "`precondition_frequency` = 1000000000000 is outside the allowed range 1..=100_000"
        ),
        "{}",
        flat(&o)
    );
}

#[test]
fn more_threads_than_four_per_core_are_refused_by_the_engine() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if 4 * cores >= 1000 {
        return; // this machine may run 1000 threads
    }
    // In the spec's range (a plan may run on a bigger machine), but on this one each step
    // would take minutes.
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = tiny_with(
        dir.path(),
        "t.asteria",
        "  # threads = 2 ",
        "  threads = 1000 ",
    );
    let o = asteria(&["train", spec.to_str().expect("utf8"), "--steps", "1"]);
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    assert!(flat(&o).contains("asks for 1000 threads"), "{}", flat(&o));
}

#[test]
fn tampered_plan_hyperparameters_are_refused_before_running() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, json) = compiled_plan(dir.path());
    let soap = json["optimizer"]
        .as_array()
        .expect("optimizer ops")
        .iter()
        .position(|o| o["op"] == "soap_update")
        .expect("a soap_update");
    for (name, path, value, expect) in [
        (
            "lr",
            "lr",
            serde_json::json!(-1.0),
            "lr = -1 is outside the allowed range (0, 10]",
        ),
        (
            "beta1",
            "beta1",
            serde_json::json!(1.5),
            "beta1 = 1.5 is outside the allowed range [0, 1)",
        ),
        (
            "eps",
            "eps",
            serde_json::json!(0.0),
            "eps = 0 is outside the allowed range (0, 1]",
        ),
    ] {
        let mut v = json.clone();
        v["optimizer"][soap]["hyper"][path] = value;
        run_rejects(dir.path(), &format!("{name}.json"), &v.to_string(), expect);
    }
    let mut v = json.clone();
    v["train"]["eval_batches"] = serde_json::json!(0);
    run_rejects(
        dir.path(),
        "eval_batches.json",
        &v.to_string(),
        "train.eval_batches = 0 is outside the allowed range 1..=100_000",
    );
    let mut v = json.clone();
    v["target"]["threads"] = serde_json::json!(0);
    run_rejects(
        dir.path(),
        "threads.json",
        &v.to_string(),
        "target.threads = 0 is outside the allowed range 1..=1024",
    );
    let mut v = json;
    v["host_tasks"][0]["frequency"] = serde_json::json!(1_000_000_000_000u64);
    run_rejects(
        dir.path(),
        "frequency.json",
        &v.to_string(),
        "frequency = 1000000000000 is outside the allowed range 1..=100_000",
    );
}

/// With stderr a pipe (a log file, CI) the run still says what it does: a line at start with
/// the tokens per step, and one per evaluation with the step, train and validation loss and
/// tokens/s; `--quiet` silences them.
#[test]
fn train_reports_progress_lines_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = bytes_spec(
        dir.path(),
        "d_model = 32 layers = 1 heads = 2",
        "steps = 6 eval_interval = 3 eval_batches = 2",
    );
    let s = spec.to_str().expect("utf8");
    let o = asteria(&["train", s]);
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("64 tokens/step"), "{err}");
    assert!(err.contains("step 0/6 | val loss"), "{err}");
    for step in ["step 3/6 | train loss", "step 6/6 | train loss"] {
        let line = err
            .lines()
            .find(|l| l.starts_with(step))
            .unwrap_or_else(|| panic!("{step}: {err}"));
        assert!(
            line.contains("val loss") && line.contains("tok/s"),
            "{line}"
        );
    }
    let o = asteria(&["train", s, "--quiet"]);
    let (_, err) = text(&o);
    assert!(o.status.success());
    assert!(!err.contains("val loss"), "--quiet: {err}");
}

// --- `--set` overrides (text folders, patterns and llm.c shards: tests/cli_data.rs). ---

/// The `lr` of the plan's first AdamW op.
fn adamw_lr(plan: &serde_json::Value) -> f64 {
    plan["optimizer"]
        .as_array()
        .expect("optimizer program")
        .iter()
        .find(|op| op["op"] == "adam_w")
        .and_then(|op| op["lr"].as_f64())
        .expect("an adam_w op with an lr")
}

#[test]
fn set_overrides_are_checked_like_the_spec_and_recorded_in_the_plan() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = plan_json(dir.path(), "examples/tiny.asteria", &[]);
    assert_eq!(base["train"]["seed"], 1337);
    assert_eq!(adamw_lr(&base), 2e-3);
    let plan = plan_json(
        dir.path(),
        "examples/tiny.asteria",
        &[
            "--set",
            "train.seed=7",
            "--set",
            "optimizer.lr=1e-3",
            "--set",
            "train.steps=30",
            "--set",
            "data.batch_size=4",
        ],
    );
    assert_eq!(plan["train"]["seed"], 7);
    assert_eq!(plan["train"]["steps"], 30);
    assert_eq!(plan["data"]["batch_size"], 4);
    assert_eq!(adamw_lr(&plan), 1e-3);
    assert_eq!(plan["data"]["seq_len"], base["data"]["seq_len"]);

    // A bad key, an out-of-range value, a malformed argument: exit 1, the argument named and
    // shown as the command line, the range as the spec parser gives it.
    for (args, expect) in [
        (
            &["--set", "train.sed=7"][..],
            &["`--set train.sed=7`: unknown key `sed` in `train`", "did you mean `seed`?"][..],
        ),
        (
            &["--set", "train.seed=3", "--set", "data.batch_size=100000"],
            &["`--set data.batch_size=100000`: `batch_size` = 100000 is outside the allowed range 1..=65_536"],
        ),
        (
            &["--set", "optimizer.lr=-1"],
            &["`--set optimizer.lr=-1`: `lr` = -1 is outside the allowed range (0, 10]"],
        ),
        (
            &["--set", "train.seed"],
            &["`--set train.seed`: expected `block.key=value`, found no `=`"],
        ),
        (
            &["--set", "trian.seed=1"],
            &["unknown block `trian`", "did you mean `train`?"],
        ),
    ] {
        for cmd in ["compile", "explain", "train"] {
            let mut a = vec![cmd, "examples/tiny.asteria"];
            a.extend_from_slice(args);
            let o = asteria(&a);
            assert_eq!(o.status.code(), Some(1), "{a:?}: {:?}", text(&o));
            let err = flat(&o);
            assert!(err.contains("has 1 error"), "{a:?}: {err}");
            assert!(err.contains("[command line:"), "{a:?}: {err}");
            for e in expect {
                assert!(err.contains(e), "{a:?}: expected `{e}` in {err}");
            }
        }
    }
    // An argument that conflicts with a key of the spec: the argument's snippet, and the
    // spec's key as a line of the hint (not every spec line between the two).
    let o = asteria(&[
        "compile",
        "examples/tiny.asteria",
        "--set",
        "data.seq_len=128",
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("context set here: line 15"), "{err}");
    assert!(
        !err.contains("weight_decay"),
        "the spec's lines in between: {err}"
    );
}
