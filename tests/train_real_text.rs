//! Real text, end to end: `asteria train` on the built-in Moby-Dick (GPT-2 BPE) must bring the
//! validation loss from ≈ ln(50257) ≈ 10.8 nats to below 6.0, with AdamW and with SOAP.
//! These are the README's headline numbers; each run takes a few minutes on 2 cores.
use std::path::PathBuf;
use std::process::Command;

fn train(spec: &str) -> Vec<(u64, f64)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = tempfile::tempdir().expect("tempdir");
    let metrics = dir.path().join("metrics.jsonl");
    let o = Command::new(env!("CARGO_BIN_EXE_asteria"))
        .args(["train", spec, "--quiet", "--metrics"])
        .arg(&metrics)
        .current_dir(&root)
        .output()
        .expect("asteria runs");
    assert!(
        o.status.success(),
        "{spec}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = std::fs::read_to_string(&metrics).expect("metrics written");
    let mut val = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json");
        if let Some(l) = v.get("val_loss") {
            val.push((v["step"].as_u64().expect("step"), l.as_f64().expect("loss")));
        }
    }
    eprintln!("{spec}: validation curve {val:?}");
    val
}

fn check(spec: &str) {
    let val = train(spec);
    let (first, last) = (
        val.first().expect("eval at step 0"),
        val.last().expect("final eval"),
    );
    assert_eq!(first.0, 0);
    assert!(
        (first.1 - 10.8).abs() < 0.3,
        "{spec}: initial val loss {} is not ≈ ln(50257)",
        first.1
    );
    assert!(
        last.1 < 6.0,
        "{spec}: final val loss {} (step {}) is not below 6.0",
        last.1,
        last.0
    );
}

#[test]
fn tiny_adamw_learns_moby_dick() {
    check("examples/tiny.asteria");
}

#[test]
fn tiny_soap_learns_moby_dick() {
    check("examples/tiny-soap.asteria");
}
