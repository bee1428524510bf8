//! `asteria train --trace FILE.json`: the run's timeline as a Chrome / Perfetto trace. The test
//! trains tiny-soap with staleness 2 (refreshes in the background on the host pool) and checks
//! the file against the trace-event schema Perfetto reads (a JSON array of events with `ph`,
//! `pid`, `tid`, `ts`; begin and end events nested per thread) and that it holds what a user
//! looks for: every step with its phases, the plan's ops, each background refresh on a pool
//! thread (not the main thread), finished before its swap.
use serde_json::Value;
use std::collections::HashMap;
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

/// A slice: name, thread, begin and end (µs).
#[derive(Debug, Clone)]
struct Slice {
    name: String,
    tid: i64,
    begin: f64,
    end: f64,
}

/// The slices of a trace file, after checking its schema: every event an object with a string
/// `ph`, integer `pid` and `tid`; duration events (`B`/`E`) with a numeric `ts`, each `E`
/// closing the innermost open `B` of its thread with the same name, nothing left open.
fn slices(text: &str) -> (Vec<Slice>, i64) {
    let events: Vec<Value> = serde_json::from_str(text).expect("the trace is a JSON array");
    assert!(!events.is_empty());
    let mut open: HashMap<i64, Vec<(String, f64)>> = HashMap::new();
    let mut out = Vec::new();
    let mut main_tid = None;
    for e in &events {
        let ph = e["ph"].as_str().expect("ph");
        e["pid"].as_i64().expect("pid");
        let tid = e["tid"].as_i64().expect("tid");
        let name = e["name"].as_str().expect("name").to_string();
        if ph == "M" && name == "thread_name" && e["args"]["name"] == "main" {
            main_tid = Some(tid);
        }
        match ph {
            "B" => {
                let ts = e["ts"].as_f64().expect("ts");
                open.entry(tid).or_default().push((name, ts));
            }
            "E" => {
                let ts = e["ts"].as_f64().expect("ts");
                let (b_name, b_ts) = open
                    .get_mut(&tid)
                    .and_then(|s| s.pop())
                    .unwrap_or_else(|| panic!("`E` of `{name}` on thread {tid} with nothing open"));
                assert_eq!(b_name, name, "thread {tid}: slices not nested");
                assert!(ts >= b_ts, "`{name}` ends before it begins");
                out.push(Slice {
                    name,
                    tid,
                    begin: b_ts,
                    end: ts,
                });
            }
            "i" | "M" | "X" => {}
            other => panic!("unexpected event phase `{other}`"),
        }
    }
    for (tid, stack) in &open {
        assert!(stack.is_empty(), "thread {tid}: {stack:?} never end");
    }
    (out, main_tid.expect("the main thread is named"))
}

#[test]
fn a_traced_run_shows_steps_ops_and_background_refreshes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("run.json");
    let o = asteria(&[
        "train",
        "examples/tiny-soap.asteria",
        "--steps",
        "12",
        "--quiet",
        "--set",
        "target.staleness=2",
        "--trace",
        file.to_str().expect("utf-8 path"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (all, main) = slices(&std::fs::read_to_string(&file).expect("trace written"));
    let named = |prefix: &str| -> Vec<&Slice> {
        all.iter()
            .filter(|s| s.name == prefix || s.name.starts_with(&format!("{prefix} ")))
            .collect()
    };
    // Twelve steps on the main thread, each holding its phases.
    let steps = named("step");
    assert_eq!(steps.len(), 12);
    for phase in [
        "forward",
        "backward",
        "optimizer",
        "host tasks",
        "synchronize",
    ] {
        let p = named(phase);
        assert_eq!(p.len(), 12, "{phase}");
        for (s, step) in p.iter().zip(&steps) {
            assert_eq!(s.tid, main);
            assert!(
                step.begin <= s.begin && s.end <= step.end,
                "{phase} outside its step"
            );
        }
    }
    // The plan's ops, named after them.
    let ops = named("op");
    for op in [
        "op embedding",
        "op attention",
        "op cross_entropy",
        "op soap_update",
    ] {
        assert!(ops.iter().any(|s| s.name == op), "no `{op}` slice");
    }
    // Background refreshes: one per launch, on pool threads, each finished before its swap.
    let launches = named("refresh launch");
    assert!(!launches.is_empty(), "no background refresh launched");
    let background: Vec<&Slice> = all
        .iter()
        .filter(|s| {
            s.name.starts_with("refresh ")
                && ![
                    "refresh launch",
                    "refresh wait",
                    "refresh swap",
                    "refresh (synchronous)",
                ]
                .iter()
                .any(|p| s.name.starts_with(p))
        })
        .collect();
    assert_eq!(background.len(), launches.len());
    assert!(
        background.iter().all(|s| s.tid != main),
        "a background refresh ran on the main thread"
    );
    for swap in named("refresh swap") {
        let factor = swap.name.trim_start_matches("refresh swap ");
        assert!(
            background
                .iter()
                .any(|b| b.name == format!("refresh {factor}") && b.end <= swap.end),
            "`{}` has no finished computation before it",
            swap.name
        );
    }
}

#[test]
fn a_trace_file_that_cannot_be_created_is_a_clear_error() {
    let o = asteria(&[
        "train",
        "examples/tiny.asteria",
        "--steps",
        "1",
        "--quiet",
        "--trace",
        "/nonexistent-dir/run.json",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("cannot create the trace file /nonexistent-dir/run.json"),
        "{err}"
    );
}
