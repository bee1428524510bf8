//! `asteria plot`: loss against steps, wall time and GPU energy. A CPU run's metrics carry
//! `wall_s` in every record and null energy; a GPU run's (the records below are shaped like
//! them) carry `energy_j`, the training steps' joules so far.
use std::process::{Command, Output};

fn asteria(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_asteria"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("asteria runs")
}

/// stderr with miette's line wrapping undone.
fn err_text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr)
        .replace('│', " ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn plot_against_steps_wall_time_and_energy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = |name: &str| dir.path().join(name).to_str().expect("utf-8").to_string();
    let spec = p("run.asteria");
    std::fs::write(
        &spec,
        "model gpt2 { vocab = 256 context = 32 d_model = 32 layers = 1 heads = 2 }
optimizer adamw { lr = 3e-3 }
data { corpus = builtin tokenizer = bytes batch_size = 4 seq_len = 32 val_fraction = 0.1 }
train { steps = 6 eval_interval = 3 eval_batches = 2 }
target cpu { threads = 2 }
",
    )
    .expect("spec");
    let m = p("cpu.jsonl");
    ok(&asteria(&["train", &spec, "--metrics", &m, "-q"]));
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&m)
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    // 6 steps and 3 evaluations (steps 0, 3, 6), each with its wall time; no energy on the CPU.
    assert_eq!(records.len(), 9);
    assert!(records
        .iter()
        .all(|r| r["wall_s"].as_f64().is_some_and(|w| w > 0.0)));
    assert!(records.iter().all(|r| r["energy_j"].is_null()));

    for (x, label) in [("step", ">\nstep\n<"), ("wall_s", ">\nwall time (s)\n<")] {
        let svg = p(&format!("{x}.svg"));
        ok(&asteria(&["plot", &m, "-o", &svg, "--x", x]));
        let text = std::fs::read_to_string(&svg).expect("svg");
        assert!(text.contains(label), "{x}: no axis label {label}");
        assert!(
            text.contains("cpu val"),
            "{x}: the validation markers' legend"
        );
    }
    let o = asteria(&["plot", &m, "-o", &p("e.svg"), "--x", "energy_j"]);
    let err = err_text(&o);
    assert!(
        !o.status.success() && err.contains("energy is measured on NVIDIA GPUs"),
        "{err}"
    );
    let o = asteria(&["plot", &m, "-o", &p("e.svg"), "--x", "tokens"]);
    let err = err_text(&o);
    assert!(
        !o.status.success() && err.contains("`step`, `wall_s` or `energy_j`"),
        "{err}"
    );

    // Two GPU-shaped runs against energy: the same loss for fewer joules is further left.
    let gpu = |name: &str, j_per_step: f64| {
        let path = p(name);
        let mut lines = vec![serde_json::json!({"step": 0, "val_loss": 5.5, "energy_j": null})];
        for s in 1..=4u64 {
            lines.push(serde_json::json!({
                "step": s, "loss": 5.5 - 0.3 * s as f64, "step_j": j_per_step,
                "energy_j": j_per_step * s as f64, "wall_s": 0.1 * s as f64,
            }));
        }
        lines.push(serde_json::json!({"step": 4, "val_loss": 4.4, "energy_j": 4.0 * j_per_step}));
        let text: Vec<String> = lines.iter().map(|v| v.to_string()).collect();
        std::fs::write(&path, text.join("\n")).expect("write");
        path
    };
    let (a, b) = (gpu("soap.jsonl", 30.0), gpu("adamw.jsonl", 20.0));
    let svg = p("energy.svg");
    ok(&asteria(&[
        "plot",
        &format!("SOAP={a}"),
        &format!("AdamW={b}"),
        "-o",
        &svg,
        "--x",
        "energy_j",
    ]));
    let text = std::fs::read_to_string(&svg).expect("svg");
    assert!(
        text.contains(">\nGPU energy (J)\n<")
            && text.contains("SOAP train")
            && text.contains("AdamW val")
    );
}
