//! Bounded staleness on real text: `examples/tiny-soap.asteria` (SOAP, 400 steps on the built-in
//! Moby-Dick) trained with `staleness = 5` — eigenbasis refreshes computed in the background
//! on snapshots and swapped in up to 5 steps late — must end within 0.02 nats of the
//! synchronous (`staleness = 0`) validation loss. The metrics must show swaps that really were
//! late and almost no waits. Two runs of a few minutes each on 2 cores.
use std::path::{Path, PathBuf};
use std::process::Command;

/// Per-step and per-evaluation metrics of one run.
struct Run {
    val: Vec<(u64, f64)>,
    steps: Vec<serde_json::Value>,
}

fn train(spec: &Path, root: &Path, dir: &Path, tag: &str) -> Run {
    let metrics = dir.join(format!("{tag}.jsonl"));
    let o = Command::new(env!("CARGO_BIN_EXE_asteria"))
        .arg("train")
        .arg(spec)
        .args(["--quiet", "--metrics"])
        .arg(&metrics)
        .current_dir(root)
        .output()
        .expect("asteria runs");
    assert!(
        o.status.success(),
        "{tag}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = std::fs::read_to_string(&metrics).expect("metrics written");
    let (mut val, mut steps) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json");
        if let Some(l) = v.get("val_loss") {
            val.push((v["step"].as_u64().expect("step"), l.as_f64().expect("loss")));
        } else {
            steps.push(v);
        }
    }
    eprintln!("{tag}: validation curve {val:?}");
    Run { val, steps }
}

fn count(run: &Run, key: &str) -> u64 {
    run.steps.iter().map(|s| s[key].as_u64().expect(key)).sum()
}

#[test]
fn staleness_5_matches_synchronous_soap_on_moby_dick() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let original = root.join("examples/tiny-soap.asteria");
    let text = std::fs::read_to_string(&original).expect("spec");
    assert!(text.contains("staleness = 0"), "the example spec changed");
    let dir = tempfile::tempdir().expect("tempdir");
    let stale = dir.path().join("tiny-soap-s5.asteria");
    std::fs::write(&stale, text.replacen("staleness = 0", "staleness = 5", 1)).expect("write spec");

    let sync = train(&original, &root, dir.path(), "s0");
    let late = train(&stale, &root, dir.path(), "s5");
    let (v0, v5) = (
        sync.val.last().expect("final eval"),
        late.val.last().expect("final eval"),
    );
    assert_eq!((v0.0, v5.0), (400, 400));
    eprintln!(
        "final val loss: S = 0 {:.4}, S = 5 {:.4} (Δ {:+.4})",
        v0.1,
        v5.1,
        v5.1 - v0.1
    );
    assert!(
        (v5.1 - v0.1).abs() <= 0.02,
        "S = 5 {} vs S = 0 {}",
        v5.1,
        v0.1
    );

    // S = 0: every refresh is installed at the step that launched it.
    for s in &sync.steps {
        assert!(
            s["max_swap_staleness"].is_null() || s["max_swap_staleness"] == 0,
            "{s}"
        );
        assert_eq!(s["refresh_wait_ms"], 0.0, "{s}");
    }
    // S = 5: results arrive late (≥ 1 step: the swap point is the next step boundary), never
    // later than the bound, and the engine almost never has to wait for them.
    let staleness: Vec<u64> = late
        .steps
        .iter()
        .filter_map(|s| s["max_swap_staleness"].as_u64())
        .collect();
    assert!(
        staleness.iter().any(|&s| s > 0),
        "no late swap: {staleness:?}"
    );
    assert!(staleness.iter().all(|&s| s <= 5), "{staleness:?}");
    let (launched, swapped) = (
        count(&late, "refreshes_launched"),
        count(&late, "refreshes_swapped"),
    );
    assert!(
        swapped > 0 && swapped <= launched,
        "{swapped} of {launched}"
    );
    let waits = late
        .steps
        .iter()
        .filter(|s| s["refresh_wait_ms"].as_f64().expect("refresh_wait_ms") > 0.0)
        .count() as u64;
    eprintln!("S = 5: {launched} launched, {swapped} swapped, steps with a wait: {waits}");
    assert!(
        waits * 20 <= swapped,
        "waits are not rare: {waits} steps waited, {swapped} swaps"
    );
    for s in &late.steps {
        assert!(s["optimizer_ms"].as_f64().expect("optimizer_ms") >= 0.0);
    }
}
