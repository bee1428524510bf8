//! `engine::train` end to end on the built-in corpus (byte tokenizer): data loading with a
//! token cache, validation before/during/after training, JSONL metrics, the summary.
mod common;

use common::gpt::{plan, Gpt};
use engine::{train, TrainOptions};
use schedule::Tokenizer;

#[test]
fn trains_on_the_builtin_corpus_and_writes_metrics() {
    let g = Gpt {
        vocab: 256,
        ctx: 16,
        d: 16,
        layers: 1,
        heads: 2,
        batch: 4,
        seq: 16,
        soap: true,
        max_precond_dim: 64,
        lr: 1e-2,
        threads: Some(2),
    };
    let mut p = plan(&g);
    assert_eq!(p.data.tokenizer, Tokenizer::Bytes);
    p.train.steps = 12;
    p.train.eval_interval = 5;
    let dir = tempfile::tempdir().expect("tempdir");
    let metrics = dir.path().join("out/metrics.jsonl");
    let opts = TrainOptions {
        cache_dir: Some(dir.path().join("cache")),
        metrics_path: Some(metrics.clone()),
        quiet: true,
        ..TrainOptions::default()
    };
    let s = train(&p, &opts).expect("training runs");
    assert_eq!(s.steps, 12);
    assert_eq!(s.train_losses.len(), 12);
    let steps: Vec<u64> = s.val_losses.iter().map(|v| v.0).collect();
    assert_eq!(steps, vec![0, 5, 10, 12]);
    let v0 = s.val_losses[0].1;
    assert!(
        (v0 - 256f64.ln()).abs() < 0.1,
        "initial val loss {v0} should be ≈ ln 256"
    );
    assert!(s.final_val_loss().expect("val") < v0, "{s}");
    assert_eq!((s.skipped_steps, s.refresh_failures), (0, 0));
    assert!(s.median_step_ms > 0.0 && s.tokens_per_s > 0.0);
    let text = std::fs::read_to_string(&metrics).expect("metrics written");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(lines.len(), 12 + 4);
    let step1 = lines
        .iter()
        .find(|l| l["step"] == 1 && l.get("loss").is_some())
        .expect("step 1");
    for key in [
        "loss",
        "lr",
        "grad_norm",
        "step_ms",
        "tokens_per_s",
        "wall_s",
    ] {
        assert!(step1[key].is_number(), "{key} missing in {step1}");
    }
    // Wall time since the start grows step by step; the first step's is the summary's.
    let walls: Vec<f64> = lines
        .iter()
        .filter(|l| l.get("loss").is_some())
        .filter_map(|l| l.get("wall_s").and_then(|w| w.as_f64()))
        .collect();
    assert_eq!(walls.len(), 12);
    // Evaluation records carry their wall time too; no energy on the CPU engine.
    assert!(lines
        .iter()
        .filter(|l| l.get("val_loss").is_some())
        .all(|l| l["wall_s"].is_number() && l["energy_j"].is_null()));
    assert!(walls.windows(2).all(|w| w[1] > w[0]), "{walls:?}");
    assert!(s.first_step_s > 0.0 && (s.first_step_s - walls[0]).abs() < 0.05);
    assert!(lines
        .iter()
        .any(|l| l["step"] == 0 && l["val_loss"].is_number()));
    // A second run reuses the token cache and, with the same seed, reproduces the losses.
    let again = train(
        &p,
        &TrainOptions {
            metrics_path: None,
            ..opts
        },
    )
    .expect("second run");
    assert_eq!(again.train_losses, s.train_losses);
    assert!(format!("{s}").contains("steps 12"));
}
