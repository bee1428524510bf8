//! Helpers of the `asteria` binary's end-to-end tests (`tests/cli.rs`, `tests/cli_data.rs`,
//! `tests/runs_fail.rs`).
#![allow(dead_code)] // each test file uses its own subset
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs the `asteria` binary with `args` from the repository root (`RUST_LOG=warn`).
pub fn asteria(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_asteria"))
        .args(args)
        .current_dir(root())
        .env("RUST_LOG", "warn")
        .output()
        .expect("asteria runs")
}

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A run's (stdout, stderr), lossily decoded.
pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// stderr with miette's wrapping and margins collapsed to single spaces.
pub fn flat(o: &Output) -> String {
    text(o)
        .1
        .replace('│', " ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The plan `asteria compile SPEC -o plan.json EXTRA...` writes, parsed.
pub fn plan_json(dir: &Path, spec: &str, extra: &[&str]) -> serde_json::Value {
    let plan = dir.join("plan.json");
    let mut args = vec!["compile", spec, "-o", plan.to_str().expect("utf8")];
    args.extend_from_slice(extra);
    let o = asteria(&args);
    assert!(o.status.success(), "{:?}", text(&o));
    serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json")
}

/// A tiny AdamW GPT-2 spec on the built-in corpus with the bytes tokenizer (batch 2 × 32, one
/// thread), its model shape and train keys given, written into `dir`.
pub fn bytes_spec(dir: &Path, model: &str, train: &str) -> PathBuf {
    let spec = dir.join("tiny-bytes.asteria");
    std::fs::write(
        &spec,
        format!(
            "model gpt2 {{ vocab = 256 context = 32 {model} }}
optimizer adamw {{ lr = 1e-3 }}
data {{ corpus = builtin tokenizer = bytes batch_size = 2 seq_len = 32 val_fraction = 0.1 }}
train {{ {train} }}
target cpu {{ threads = 1 }}
"
        ),
    )
    .expect("write spec");
    spec
}
