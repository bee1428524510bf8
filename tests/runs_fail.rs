//! Runs that go wrong lose nothing and say so (through the `asteria` binary, on the CPU):
//! * a diverging run stops with an error and a non-zero exit after exactly `max_skipped_steps`
//!   consecutive steps skipped for a non-finite gradient norm; its metrics file keeps every
//!   step up to the last skipped one; `max_skipped_steps = none` runs to the end instead;
//! * a write error on the `--metrics` file stops the run, naming the file;
//! * SOAP whose gradients are clipped to underflow (all-zero Kronecker factors) runs to the end:
//!   zero factors are skipped refreshes, not refresh failures.
//!
//! The divergence is real: AdamW with `lr = 10` and `weight_decay = 10` multiplies the 2-D
//! weights by 1 − lr·wd = −99 every step, so activations overflow to a NaN gradient norm within
//! a few steps (measured: step 8 of a 1-layer, d 32 byte-level GPT-2).
mod cli_common;

use cli_common::{asteria, flat as stderr};
use std::path::{Path, PathBuf};

/// A tiny byte-level GPT-2 spec (runs in well under a second) with `optimizer` and `train`
/// entries, written into `dir`.
fn spec(dir: &Path, name: &str, optimizer: &str, train: &str) -> PathBuf {
    let text = format!(
        "model gpt2 {{\n  vocab = 256\n  context = 16\n  d_model = 32\n  layers = 1\n  heads = 2\n}}\n\
         {optimizer}\n\
         data {{\n  tokenizer = bytes\n  batch_size = 4\n  seq_len = 16\n}}\n\
         train {{\n  {train}\n}}\n\
         target cpu {{ threads = 1 }}\n"
    );
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write spec");
    path
}

const DIVERGING: &str = "optimizer adamw {\n  lr = 10\n  weight_decay = 10\n}";

/// The per-step records of a metrics file: `(step, grad_norm)` (`None` = null: skipped).
fn step_records(path: &Path) -> Vec<(u64, Option<f64>)> {
    std::fs::read_to_string(path)
        .expect("metrics file")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json line"))
        .filter(|v| v.get("loss").is_some())
        .map(|v| (v["step"].as_u64().expect("step"), v["grad_norm"].as_f64()))
        .collect()
}

#[test]
fn a_diverging_run_stops_after_max_skipped_steps_consecutive_skips() {
    let dir = tempfile::tempdir().expect("tempdir");
    let limit = 3usize;
    let path = spec(
        dir.path(),
        "diverge.asteria",
        DIVERGING,
        &format!("steps = 60\n  max_skipped_steps = {limit}"),
    );
    let metrics = dir.path().join("m.jsonl");
    let o = asteria(&[
        "train",
        path.to_str().expect("utf8"),
        "--metrics",
        metrics.to_str().expect("utf8"),
        "--quiet",
    ]);
    let err = stderr(&o);
    assert!(!o.status.success(), "a diverged run must fail: {err}");
    assert_eq!(o.status.code(), Some(1), "{err}");
    let steps = step_records(&metrics);
    let last = steps.last().expect("steps ran").0;
    assert!(last < 60, "the run stopped early: {steps:?}");
    // Exactly `limit` skipped steps, consecutive, at the end; every step before was taken.
    let skipped: Vec<u64> = steps
        .iter()
        .filter(|s| s.1.is_none())
        .map(|s| s.0)
        .collect();
    assert_eq!(skipped.len(), limit, "{steps:?}");
    assert_eq!(
        skipped,
        ((last + 1 - limit as u64)..=last).collect::<Vec<_>>()
    );
    assert!(steps[..steps.len() - limit]
        .iter()
        .all(|s| s.1.is_some_and(f64::is_finite)));
    // The message names the step, the count, the last finite loss and what to do.
    for want in [
        // (miette may wrap "non-finite" at its hyphen)
        format!("training stopped at step {last}: {limit} consecutive steps were skipped for a"),
        format!("gradient norm (max_skipped_steps = {limit})"),
        "last finite training loss".to_string(),
        "lower the optimizer's `lr`".to_string(),
        "`grad_clip`".to_string(),
    ] {
        assert!(err.contains(&want), "expected `{want}` in:\n{err}");
    }
    assert!(!err.contains("val loss NaN"), "{err}");
}

#[test]
fn max_skipped_steps_none_never_stops() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = spec(
        dir.path(),
        "diverge-none.asteria",
        DIVERGING,
        "steps = 30\n  max_skipped_steps = none",
    );
    let metrics = dir.path().join("m.jsonl");
    let o = asteria(&[
        "train",
        path.to_str().expect("utf8"),
        "--metrics",
        metrics.to_str().expect("utf8"),
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("max_skipped_steps none"), "{err}");
    let steps = step_records(&metrics);
    assert_eq!(steps.len(), 30);
    let skipped = steps.iter().filter(|s| s.1.is_none()).count();
    assert!(
        skipped > 10,
        "the run diverged and kept skipping: {steps:?}"
    );
    assert!(err.contains(&format!("skipped steps {skipped}")), "{err}");
}

#[test]
fn a_metrics_write_error_stops_the_run_naming_the_file() {
    // /dev/full opens, then every write fails with ENOSPC.
    if !Path::new("/dev/full").exists() {
        eprintln!("no /dev/full: skipped");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = spec(
        dir.path(),
        "ok.asteria",
        "optimizer adamw {\n  lr = 1e-3\n}",
        "steps = 5",
    );
    let o = asteria(&[
        "train",
        path.to_str().expect("utf8"),
        "--metrics",
        "/dev/full",
        "--quiet",
    ]);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("writing the metrics file /dev/full failed"),
        "{err}"
    );
}

#[test]
fn soap_with_vanishing_gradients_skips_zero_factor_refreshes_without_failing() {
    // grad_clip = 1e-30 scales every gradient to ~1e-33, whose products underflow to 0 in f32:
    // the Kronecker factors stay exactly zero. Refreshes every 2 steps over 20 steps make 9 QR
    // refreshes per factor; before zero factors were skipped, the third one stopped the run
    // (`--max-refresh-failures` 3).
    let dir = tempfile::tempdir().expect("tempdir");
    let path = spec(
        dir.path(),
        "frozen.asteria",
        "optimizer soap {\n  lr = 3e-3\n  precondition_frequency = 2\n}",
        "steps = 20\n  grad_clip = 1e-30",
    );
    let o = asteria(&["train", path.to_str().expect("utf8")]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let summary = err.split("steps 20 |").nth(1).expect("summary line");
    assert!(
        summary.contains("refresh failures 0 (zero-factor skips"),
        "{summary}"
    );
    let skips: u64 = summary
        .split("zero-factor skips ")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .and_then(|s| s.trim().parse().ok())
        .expect("zero-factor skips count");
    assert!(skips >= 9, "{summary}");
    assert!(err.contains("skipped steps 0"), "{summary}");
}

/// A plan whose element-wise update rule is broken (an unknown name, text that does not parse)
/// is refused when the engine is set up, before any step, with the op and the reason; the same
/// plan with its rule intact runs.
#[test]
fn a_plan_with_a_broken_update_rule_is_refused_before_anything_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = spec(
        dir.path(),
        "lion.asteria",
        "optimizer lion {\n  lr = 1e-3\n}",
        "steps = 2",
    );
    let plan = dir.path().join("lion.plan.json");
    let o = asteria(&[
        "compile",
        path.to_str().expect("utf8"),
        "-o",
        plan.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&plan).expect("plan");
    assert!(
        text.contains("\"elementwise_update\""),
        "no rule op in the plan"
    );
    let o = asteria(&["run", plan.to_str().expect("utf8")]);
    assert!(o.status.success(), "{}", stderr(&o));
    for (broken, why) in [
        (
            "(sign (+ (* m 0.9) (* g 0.100000024)))",
            "(sign (+ (* m 0.9) (* q 0.100000024)))",
        ),
        ("(list ", "(list (( "),
    ] {
        assert!(text.contains(broken), "the plan's rule changed: {broken}");
        let bad = dir.path().join("bad.plan.json");
        std::fs::write(&bad, text.replacen(broken, why, 1)).expect("write");
        let o = asteria(&["run", bad.to_str().expect("utf8")]);
        let err = stderr(&o);
        assert!(!o.status.success(), "a broken rule ran: {err}");
        assert!(
            err.contains("elementwise_update") && err.contains("lion"),
            "{err}"
        );
        assert!(!err.contains("step 1/"), "it ran a step first: {err}");
    }
}
