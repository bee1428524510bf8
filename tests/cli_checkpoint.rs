//! `asteria train --checkpoint-dir` / `--resume` / `sample` end to end: SIGINT checkpoints and
//! exits non-zero, a bad checkpoint folder stops the run before its first step, a resume says
//! what it loaded, `kill -9` during a write keeps the previous checkpoint, and `sample`
//! continues a prompt from one.
mod cli_common;

use cli_common::*;
use std::path::Path;
use std::process::Command;

/// `asteria train --checkpoint-dir` / `--resume`, and SIGINT: the run finishes its step,
/// writes a checkpoint, says where and exits non-zero; resuming from it continues the run.
#[test]
fn train_checkpoints_on_sigint_and_resumes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = bytes_spec(
        dir.path(),
        "d_model = 64 layers = 2 heads = 4",
        "steps = 1000000 eval_interval = 0",
    );
    let ck = dir.path().join("ck");
    let (spec_s, ck_s) = (spec.to_str().expect("utf8"), ck.to_str().expect("utf8"));
    let child = Command::new(env!("CARGO_BIN_EXE_asteria"))
        .args(["train", spec_s, "--quiet", "--checkpoint-dir", ck_s])
        .current_dir(root())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    // Let it train a few steps, then Ctrl-C.
    std::thread::sleep(std::time::Duration::from_secs(4));
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let o = child.wait_with_output().expect("wait");
    let (_, err) = text(&o);
    assert!(
        !o.status.success(),
        "an interrupted run exits non-zero: {err}"
    );
    assert!(
        err.contains("interrupted") && err.contains("--resume"),
        "{err}"
    );
    let latest = engine::checkpoint::latest(&ck).expect("a checkpoint was written");
    let step = engine::checkpoint::load(&latest)
        .expect("it loads")
        .meta
        .step;
    assert!(step >= 1, "{latest:?}");
    // Resume for two more steps.
    let more = (step + 2).to_string();
    let o = asteria(&[
        "train", spec_s, "--quiet", "--resume", ck_s, "--steps", &more,
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    // A resume past the run's end is refused with a hint.
    let o = asteria(&["train", spec_s, "--quiet", "--resume", ck_s, "--steps", "1"]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("raise --steps"), "{:?}", text(&o));
}

/// A `--checkpoint-dir` that cannot hold checkpoints (a file, a folder that cannot be
/// created) stops the run before its first step, not at its first checkpoint; a run says
/// which checkpoints it wrote, and a resume says which one it loaded and names a newer
/// `step-N` directory it skipped because it is not a complete checkpoint.
#[test]
fn checkpoint_dir_is_checked_before_training_and_resumes_say_what_they_load() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = bytes_spec(
        dir.path(),
        "d_model = 32 layers = 1 heads = 2",
        "steps = 4 eval_interval = 0",
    );
    let spec_s = spec.to_str().expect("utf8");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "not a directory").expect("write");
    let metrics = dir.path().join("m.jsonl");
    for bad in [file.clone(), file.join("below")] {
        let o = asteria(&[
            "train",
            spec_s,
            "--checkpoint-dir",
            bad.to_str().expect("utf8"),
            "--metrics",
            metrics.to_str().expect("utf8"),
        ]);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{err}");
        assert!(err.contains("--checkpoint-dir"), "{err}");
        assert!(
            !err.contains("first step done"),
            "failed after training: {err}"
        );
        let steps = std::fs::read_to_string(&metrics).unwrap_or_default();
        assert!(!steps.contains("\"loss\""), "a step ran: {steps}");
    }
    let ck = dir.path().join("ck");
    let ck_s = ck.to_str().expect("utf8");
    let o = asteria(&[
        "train",
        spec_s,
        "--checkpoint-dir",
        ck_s,
        "--checkpoint-every",
        "2",
    ]);
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for step in ["step-000000002", "step-000000004"] {
        assert!(
            err.contains(&format!("checkpoint {}", ck.join(step).display())),
            "{err}"
        );
    }
    // The newest loses its meta.json: the resume takes step 2 and says so.
    std::fs::remove_file(ck.join("step-000000004").join("meta.json")).expect("rm");
    let resumed_metrics = dir.path().join("resumed.jsonl");
    let o = asteria(&[
        "train",
        spec_s,
        "--resume",
        ck_s,
        "--steps",
        "5",
        "--metrics",
        resumed_metrics.to_str().expect("utf8"),
    ]);
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    // The resumed run's `wall_s` continues from the checkpoint's, not from 0.
    let at = engine::checkpoint::load(&ck.join("step-000000002"))
        .expect("loads")
        .meta
        .wall_s
        .expect("the checkpoint records the run's seconds");
    let walls: Vec<f64> = std::fs::read_to_string(&resumed_metrics)
        .expect("metrics")
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["wall_s"].as_f64())
        .collect();
    assert!(
        !walls.is_empty() && walls.iter().all(|&w| w >= at),
        "{at} {walls:?}"
    );
    assert!(
        err.contains(&format!(
            "resumed from {} (after step 2",
            ck.join("step-000000002").display()
        )),
        "{err}"
    );
    assert!(
        err.contains("step-000000004 is newer but not a complete checkpoint"),
        "{err}"
    );
}

/// `kill -9` while a checkpoint is being written (its `step-N.tmp-PID` directory exists, the
/// rename not yet done) leaves the previous checkpoint intact: `latest` skips the half-written
/// directory, the previous one loads with every tensor's CRC32 verified, and a run resumes
/// from it. The kill is aimed by watching the checkpoint directory; a write that finishes
/// between the sighting and the kill does not count, and the test tries again (at most 8
/// times) until one kill lands mid-write.
#[test]
fn kill_9_during_a_checkpoint_write_keeps_the_previous_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    // ~3.3M parameters: each checkpoint writes ~40 MB (weights and both Adam moments) and
    // fsyncs it, long enough for the kill to land inside the write.
    let spec = bytes_spec(
        dir.path(),
        "d_model = 256 layers = 4 heads = 4",
        "steps = 1000000 eval_interval = 0",
    );
    let spec_s = spec.to_str().expect("utf8");
    let names = |ck: &Path| -> Vec<String> {
        std::fs::read_dir(ck)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut landed = None;
    for attempt in 0..8 {
        let ck = dir.path().join(format!("ck{attempt}"));
        let ck_s = ck.to_str().expect("utf8");
        let mut child = Command::new(env!("CARGO_BIN_EXE_asteria"))
            .args([
                "train",
                spec_s,
                "--quiet",
                "--checkpoint-dir",
                ck_s,
                "--checkpoint-every",
                "1",
                "--checkpoint-keep",
                "2",
            ])
            .current_dir(root())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn");
        let give_up = std::time::Instant::now() + std::time::Duration::from_secs(120);
        loop {
            let n = names(&ck);
            let complete = n
                .iter()
                .any(|x| x.starts_with("step-") && !x.contains(".tmp"));
            if complete && n.iter().any(|x| x.contains(".tmp-")) {
                break;
            }
            if std::time::Instant::now() > give_up || child.try_wait().ok().flatten().is_some() {
                let _ = child.kill();
                panic!("no checkpoint write seen in {}: {n:?}", ck.display());
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        child.kill().expect("SIGKILL"); // std's kill is SIGKILL on Unix
        let status = child.wait().expect("wait");
        assert!(!status.success(), "a killed run does not exit 0");
        if names(&ck).iter().any(|x| x.contains(".tmp-")) {
            landed = Some(ck);
            break;
        }
    }
    let ck = landed.expect("in 8 attempts no kill landed inside a checkpoint write");
    let latest = engine::checkpoint::latest(&ck).expect("the previous checkpoint is found");
    assert!(
        latest
            .file_name()
            .is_some_and(|n| !n.to_string_lossy().contains(".tmp")),
        "latest() skips the half-written directory: {latest:?}"
    );
    let step = engine::checkpoint::load(&latest)
        .expect("the previous checkpoint loads, its CRCs intact")
        .meta
        .step;
    let (ck_s, more) = (ck.to_str().expect("utf8"), (step + 1).to_string());
    let o = asteria(&[
        "train", spec_s, "--quiet", "--resume", ck_s, "--steps", &more,
    ]);
    assert!(o.status.success(), "resume after kill -9: {:?}", text(&o));
}

/// `asteria sample`: a checkpoint's weights continue a prompt; the same seed gives the same
/// text, greedy decoding (temperature 0) ignores the seed, and what the model learned shows:
/// after training on the built-in corpus (English text) the greedy continuation is mostly
/// ASCII letters and spaces. Bad options and a missing checkpoint are refused clearly.
#[test]
fn sample_continues_a_prompt_from_a_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = bytes_spec(
        dir.path(),
        "d_model = 64 layers = 2 heads = 4",
        "steps = 150 eval_interval = 0",
    );
    let ck = dir.path().join("ck");
    let (spec_s, ck_s) = (spec.to_str().expect("utf8"), ck.to_str().expect("utf8"));
    let o = asteria(&["train", spec_s, "--quiet", "--checkpoint-dir", ck_s]);
    assert!(o.status.success(), "{:?}", text(&o));
    let sample = |extra: &[&str]| {
        let mut args = vec!["sample", ck_s, "--prompt", "The ", "--tokens", "24"];
        args.extend_from_slice(extra);
        let o = asteria(&args);
        assert!(o.status.success(), "{:?}", text(&o));
        text(&o).0
    };
    let a = sample(&["--seed", "3"]);
    assert!(a.starts_with("The "), "{a:?}");
    assert_eq!(a, sample(&["--seed", "3"]), "the same seed, the same text");
    let g1 = sample(&["--temperature", "0", "--seed", "1"]);
    let g2 = sample(&["--temperature", "0", "--seed", "2"]);
    assert_eq!(g1, g2, "greedy decoding does not depend on the seed");
    let generated = g1
        .trim_end_matches('\n')
        .strip_prefix("The ")
        .expect("prompt first");
    assert_eq!(generated.len(), 24, "24 byte tokens: {generated:?}");
    let plain = generated
        .chars()
        .filter(|c| c.is_ascii_alphabetic() || *c == ' ')
        .count();
    assert!(
        plain >= 16,
        "a trained model writes mostly letters: {generated:?}"
    );
    for (args, want) in [
        (vec!["--tokens", "0"], "outside the allowed range"),
        (vec!["--temperature", "500"], "outside the allowed range"),
    ] {
        let mut all = vec!["sample", ck_s, "--prompt", "The "];
        all.extend_from_slice(&args);
        let o = asteria(&all);
        assert!(!o.status.success());
        assert!(text(&o).1.contains(want), "{args:?}: {:?}", text(&o));
    }
    let o = asteria(&["sample", ck_s, "--prompt", ""]);
    assert!(
        !o.status.success() && text(&o).1.contains("--prompt is empty"),
        "{:?}",
        text(&o)
    );
    let missing = dir.path().join("nothing");
    let o = asteria(&["sample", missing.to_str().expect("utf8"), "--prompt", "x"]);
    let err = text(&o).1;
    assert!(
        !o.status.success() && err.contains("checkpoint") && err.contains("nothing"),
        "{err}"
    );
}

/// A run whose parameters left the working memory (`memory = 2MiB`: `tier-placement` moves
/// them to the host tier, each program copies them in through staging buffers of the
/// parameters' class) checkpoints and exports like any other: the Hugging Face export of its
/// checkpoint is byte-identical to that of the same spec with only moments and gradients
/// moved (the two runs are bit-identical).
#[test]
fn a_run_with_parameters_in_host_memory_exports_the_same_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = std::fs::read_to_string(root().join("examples/tiny-tiers.asteria"))
        .expect("tiny-tiers")
        .lines()
        .filter(|l| !l.trim_start().starts_with("nvme"))
        .map(|l| {
            if l.trim_start().starts_with("host_memory") {
                "  host_memory = 64MiB".to_string()
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut exported = Vec::new();
    for memory in ["5MiB", "2MiB"] {
        let spec = dir.path().join(format!("t{memory}.asteria"));
        let text: String = src
            .lines()
            .map(|l| {
                if l.trim_start().starts_with("memory =") {
                    format!("  memory = {memory}")
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n");
        std::fs::write(&spec, text).expect("spec");
        let plan = dir.path().join(format!("p{memory}.json"));
        let o = asteria(&[
            "compile",
            spec.to_str().expect("utf-8"),
            "-o",
            plan.to_str().expect("utf-8"),
        ]);
        assert!(o.status.success(), "{}", flat(&o));
        let p: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
        let forward_copies = p["forward"]
            .as_array()
            .expect("forward")
            .iter()
            .filter(|op| op["op"] == "copy_in")
            .count();
        assert_eq!(
            forward_copies > 0,
            memory == "2MiB",
            "{memory}: {forward_copies}"
        );
        let ck = dir.path().join(format!("ck{memory}"));
        let hf = dir.path().join(format!("hf{memory}"));
        let o = asteria(&[
            "train",
            spec.to_str().expect("utf-8"),
            "--steps",
            "3",
            "-q",
            "--checkpoint-dir",
            ck.to_str().expect("utf-8"),
        ]);
        assert!(o.status.success(), "{memory}: {}", flat(&o));
        let o = asteria(&[
            "export",
            ck.to_str().expect("utf-8"),
            "--format",
            "hf",
            "-o",
            hf.to_str().expect("utf-8"),
        ]);
        assert!(o.status.success(), "{memory}: {}", flat(&o));
        exported.push(std::fs::read(hf.join("model.safetensors")).expect("safetensors"));
    }
    assert!(exported[0] == exported[1], "the two exports differ");
}
