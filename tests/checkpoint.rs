//! Checkpoints on the CPU engine (`engine::checkpoint`, `asteria train --checkpoint-dir /
//! --resume`): a run stopped at step k and resumed from its checkpoint gives losses and
//! parameters bit-identical to the uninterrupted run (AdamW, SOAP with S = 0 and S = 5: the
//! refreshes in flight are recorded and replayed); a stop request
//! (what SIGINT / SIGTERM set) finishes the step, checkpoints and stops with a message; only the
//! newest K checkpoints are kept; a half-written checkpoint (a crash mid-write) is ignored and
//! the previous one loads; a byte-flipped, truncated or other-model checkpoint is refused with a
//! clear error before anything runs. Tiny GPT-2 on the built-in corpus.
use engine::{train_with, CpuEngine, EngineError, TrainOptions, TrainSummary};
use passes::{PassManager, PassOptions};
use schedule::Plan;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

fn spec(optimizer: &str, d_model: usize) -> String {
    format!(
        "model gpt2 {{ vocab = 256 context = 32 d_model = {d_model} layers = 2 heads = 4 mlp_hidden = 128 }}
{optimizer}
data {{ corpus = builtin tokenizer = bytes batch_size = 4 seq_len = 32 val_fraction = 0.1 }}
train {{ steps = 12 warmup = 2 eval_interval = 4 eval_batches = 2 }}
target cpu {{ threads = 2 staleness = 0 }}
"
    )
}

const ADAMW: &str = "optimizer adamw { lr = 3e-3 }";
const SOAP: &str = "optimizer soap { lr = 3e-3 precondition_frequency = 3 }";

fn compile(src: &str) -> Plan {
    let config = frontend::parse_spec("ckpt", src, &std::env::temp_dir()).expect("spec");
    let mut m = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pass manager");
    let (cx, _) = pm
        .run(&mut m, None, &mut std::io::sink())
        .expect("pipeline");
    cx.plan.expect("plan")
}

/// Runs `plan` for `steps` steps with `opts`; the summary and every parameter's bits.
fn run(
    plan: &Plan,
    steps: u64,
    opts: TrainOptions,
) -> Result<(TrainSummary, Vec<(String, Vec<u64>)>), EngineError> {
    let opts = TrainOptions {
        steps: Some(steps),
        quiet: true,
        ..opts
    };
    let mut e = CpuEngine::<f32>::new(plan.clone(), opts.engine.clone()).expect("engine");
    let s = train_with(&mut e, &opts)?;
    let params = e
        .params()
        .into_iter()
        .map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    Ok((s, params))
}

fn dirs(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root)
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    v.sort();
    v
}

#[test]
fn an_interrupted_run_resumes_bit_identically() {
    for (name, opt, staleness) in [
        ("adamw", ADAMW, 0),
        ("adamw host_updates = delayed", ADAMW, 0),
        ("soap S=0", SOAP, 0),
        ("soap S=5", SOAP, 5),
    ] {
        let mut src = spec(opt, 64).replace("staleness = 0", &format!("staleness = {staleness}"));
        if name.contains("delayed") {
            // The device copies (one update behind the masters) are in the checkpoint.
            src = src.replace("staleness = 0", "staleness = 0 host_updates = delayed");
        }
        if staleness > 0 {
            // S > 0 replays bit for bit when every refresh is installed at its bound.
            src = src.replace("train {", "train {\n  refresh_swap = deadline");
        }
        let plan = compile(&src);
        let tmp = tempfile::tempdir().expect("tempdir");
        let cache = Some(tmp.path().join("cache"));
        let base = TrainOptions {
            cache_dir: cache.clone(),
            ..TrainOptions::default()
        };
        let (full, p_full) = run(&plan, 12, base.clone()).expect("uninterrupted");
        // Stopped after step 5 (checkpoints every 2 steps: 2, 4, and 5 at the end).
        let ck = tmp.path().join("ck");
        let stop = Arc::new(AtomicBool::new(false));
        let opts = TrainOptions {
            checkpoint_dir: Some(ck.clone()),
            checkpoint_every: Some(2),
            checkpoint_keep: 2,
            interrupt: Some(Arc::clone(&stop)),
            ..base.clone()
        };
        let mut e = CpuEngine::<f32>::new(plan.clone(), opts.engine.clone()).expect("engine");
        // The first part ends after step 5 with its final checkpoint.
        let metrics = tmp.path().join("m.jsonl");
        let five = TrainOptions {
            steps: Some(5),
            quiet: true,
            metrics_path: Some(metrics.clone()),
            ..opts.clone()
        };
        let first = train_with(&mut e, &five).expect("first part");
        if staleness > 0 {
            // Refreshes every 3 steps with S = 5: those launched since step 2 are in flight at
            // the checkpoint of step 5 and are recorded there, not drained.
            let ckpt = engine::checkpoint::load(&ck).expect("checkpoint 5");
            assert!(
                !ckpt.in_flight.is_empty()
                    && ckpt.in_flight.iter().all(|r| (2..=5).contains(&r.launched)),
                "{name}: in flight at step 5: {:?}",
                ckpt.meta.in_flight
            );
        }
        assert_eq!(
            first.train_losses,
            full.train_losses[..5],
            "{name}: first part"
        );
        assert_eq!(
            dirs(&ck),
            ["step-000000004", "step-000000005"],
            "{name}: newest 2 kept"
        );
        // Resume (from the directory: its newest) up to step 12.
        let (rest, p_rest) = run(
            &plan,
            12,
            TrainOptions {
                resume: Some(ck.clone()),
                checkpoint_dir: None,
                interrupt: None,
                metrics_path: Some(metrics.clone()),
                ..opts.clone()
            },
        )
        .expect("resumed");
        // The resumed run appended its steps to the first part's metrics: 1..=12 in order.
        let steps: Vec<u64> = std::fs::read_to_string(&metrics)
            .expect("metrics")
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"))
            .filter(|v| v.get("loss").is_some())
            .filter_map(|v| v["step"].as_u64())
            .collect();
        assert_eq!(
            steps,
            (1..=12).collect::<Vec<_>>(),
            "{name}: metrics appended on resume"
        );
        assert_eq!(
            rest.train_losses,
            full.train_losses[5..],
            "{name}: resumed losses"
        );
        assert_eq!(p_rest, p_full, "{name}: final parameters");
        assert_eq!(
            rest.val_losses,
            full.val_losses
                .iter()
                .copied()
                .filter(|v| v.0 > 5)
                .collect::<Vec<_>>(),
            "{name}: validation after the resume"
        );
        // A stop request: the step finishes, a checkpoint is written, the run says where.
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let ck2 = tmp.path().join("ck2");
        let err = run(
            &plan,
            12,
            TrainOptions {
                checkpoint_dir: Some(ck2.clone()),
                interrupt: Some(Arc::clone(&stop)),
                ..base.clone()
            },
        )
        .expect_err("interrupted");
        let msg = err.to_string();
        assert!(
            matches!(err, EngineError::Interrupted(_)) && msg.contains("after step 1"),
            "{msg}"
        );
        assert!(msg.contains("step-000000001"), "{msg}");
        assert_eq!(dirs(&ck2), ["step-000000001"]);
    }
}

#[test]
fn damaged_or_foreign_checkpoints_are_refused_and_half_written_ones_ignored() {
    let plan = compile(&spec(ADAMW, 64));
    let tmp = tempfile::tempdir().expect("tempdir");
    let base = TrainOptions {
        cache_dir: Some(tmp.path().join("cache")),
        ..TrainOptions::default()
    };
    let ck = tmp.path().join("ck");
    run(
        &plan,
        4,
        TrainOptions {
            checkpoint_dir: Some(ck.clone()),
            ..base.clone()
        },
    )
    .expect("checkpointed run");
    let good = ck.join("step-000000004");
    let resume = |dir: &Path, plan: &Plan| {
        run(
            plan,
            6,
            TrainOptions {
                resume: Some(dir.to_path_buf()),
                ..base.clone()
            },
        )
    };
    // A crash mid-write leaves a temp directory: ignored, the complete checkpoint loads.
    let half = ck.join("step-000000009.tmp-4242");
    std::fs::create_dir(&half).expect("mkdir");
    std::fs::write(half.join("state.safetensors"), b"partial").expect("write");
    assert_eq!(engine::checkpoint::latest(&ck).expect("latest"), good);
    resume(&ck, &plan).expect("resumes from the complete checkpoint");

    let copy = |to: &str| -> PathBuf {
        let d = tmp.path().join(to);
        std::fs::create_dir_all(&d).expect("mkdir");
        for f in ["state.safetensors", "meta.json"] {
            std::fs::copy(good.join(f), d.join(f)).expect("copy");
        }
        d
    };
    let expect_refused = |dir: &Path, plan: &Plan, what: &str| {
        let e = resume(dir, plan).expect_err(what).to_string();
        assert!(e.contains(what), "expected `{what}` in: {e}");
    };
    // One flipped byte in the last tensor's data.
    let flipped = copy("flipped");
    let f = flipped.join("state.safetensors");
    let mut bytes = std::fs::read(&f).expect("read");
    let n = bytes.len();
    bytes[n - 3] ^= 0x40;
    std::fs::write(&f, &bytes).expect("write");
    expect_refused(&flipped, &plan, "fails its checksum");
    // Truncated.
    let cut = copy("truncated");
    let f = cut.join("state.safetensors");
    let bytes = std::fs::read(&f).expect("read");
    std::fs::write(&f, &bytes[..bytes.len() / 2]).expect("write");
    expect_refused(&cut, &plan, "corrupt or truncated");
    // A changed data position in meta.json (still valid JSON).
    let edited = copy("edited");
    let m = edited.join("meta.json");
    let text = std::fs::read_to_string(&m).expect("read");
    assert!(text.contains("\"batches\": 4"), "{text}");
    std::fs::write(&m, text.replace("\"batches\": 4", "\"batches\": 3")).expect("write");
    expect_refused(&edited, &plan, "meta.json: fails its checksum");
    // Not a checkpoint's metadata.
    let junk = copy("junk");
    std::fs::write(junk.join("meta.json"), b"{\"hello\": 1}").expect("write");
    expect_refused(&junk, &plan, "not a checkpoint's metadata");
    // Another model (d_model 32), another optimizer (SOAP): refused, naming a tensor.
    expect_refused(
        &good,
        &compile(&spec(ADAMW, 32)),
        "another model or optimizer",
    );
    expect_refused(
        &good,
        &compile(&spec(SOAP, 64)),
        "another model or optimizer",
    );
    // The same optimizer with other betas: refused, naming them; another lr resumes.
    expect_refused(
        &good,
        &compile(&spec(
            "optimizer adamw { lr = 3e-3 betas = (0.8, 0.95) }",
            64,
        )),
        "other optimizer hyperparameters (`adam_w`: beta1 0.9, beta2 0.95, eps 1e-8, weight_decay 0.1 there, beta1 0.8",
    );
    resume(&good, &compile(&spec("optimizer adamw { lr = 1e-3 }", 64)))
        .expect("another lr resumes");
    // Another batch shape (batch_size 4 -> 2): the data position would differ.
    expect_refused(
        &good,
        &compile(&spec(ADAMW, 64).replace("batch_size = 4", "batch_size = 2")),
        "drawing batches of 4 x 32 tokens, this plan draws 2 x 32",
    );
    // A checkpoint at or past the run's last step.
    let e = run(
        &plan,
        4,
        TrainOptions {
            resume: Some(good.clone()),
            ..base.clone()
        },
    )
    .expect_err("nothing left to run")
    .to_string();
    assert!(e.contains("raise --steps"), "{e}");
    // An empty directory.
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    expect_refused(&empty, &plan, "holds no checkpoint");
}

/// A checkpoint resumes under other run options: here a SOAP run checkpointed at S = 0 with
/// everything on the device continues with `staleness = 2` and a `memory` budget that moves
/// moments to the host tier. The first resumed step's loss (the forward on the restored
/// parameters) equals the uninterrupted run's, and the offloaded moments hold the
/// checkpoint's values.
#[test]
fn a_checkpoint_resumes_with_another_staleness_and_tier_budget() {
    let src = spec(SOAP, 64);
    let plan = compile(&src);
    let tmp = tempfile::tempdir().expect("tempdir");
    let base = TrainOptions {
        cache_dir: Some(tmp.path().join("cache")),
        ..TrainOptions::default()
    };
    let (full, _) = run(&plan, 6, base.clone()).expect("uninterrupted");
    let ck = tmp.path().join("ck");
    run(
        &plan,
        4,
        TrainOptions {
            checkpoint_dir: Some(ck.clone()),
            ..base.clone()
        },
    )
    .expect("checkpointed");
    let need = plan.memory.device_bytes() / 1024;
    let other = src.replace(
        "target cpu { threads = 2 staleness = 0 }",
        &format!(
            "target cpu {{ threads = 2 staleness = 2 memory = {}KiB }}",
            need - 64
        ),
    );
    let tiered = compile(&other);
    let offloaded: Vec<String> = tiered
        .buffers
        .iter()
        .enumerate()
        .filter(|(i, _)| {
            tiered
                .memory
                .tier(schedule::BufferId(*i as u32))
                .is_some_and(|k| !k.on_device())
        })
        .map(|(_, b)| b.name.clone())
        .collect();
    assert!(!offloaded.is_empty(), "the budget moves something");
    let ckpt = engine::checkpoint::load(&ck).expect("load");
    let mut e = CpuEngine::<f32>::new(tiered.clone(), Default::default()).expect("engine");
    engine::checkpoint::restore(&mut e, &ckpt).expect("restores into the tiered plan");
    for n in &offloaded {
        let got: Vec<f32> = e
            .buffer(n)
            .expect("read")
            .iter()
            .map(|&x| x as f32)
            .collect();
        assert_eq!(&got, &ckpt.tensors[n], "{n}");
    }
    let (rest, _) = run(
        &tiered,
        6,
        TrainOptions {
            resume: Some(ck.clone()),
            ..base.clone()
        },
    )
    .expect("resumed under other options");
    assert_eq!(rest.train_losses.len(), 2);
    assert_eq!(
        rest.train_losses[0], full.train_losses[4],
        "step 5's forward"
    );
}

/// A run resumed from an older checkpoint into the same directory keeps what it writes: the
/// oldest others are pruned, never the new one.
#[test]
fn a_resume_below_newer_checkpoints_keeps_its_own() {
    let plan = compile(&spec(ADAMW, 64));
    let tmp = tempfile::tempdir().expect("tempdir");
    let ck = tmp.path().join("ck");
    let opts = TrainOptions {
        cache_dir: Some(tmp.path().join("cache")),
        checkpoint_dir: Some(ck.clone()),
        checkpoint_every: Some(2),
        checkpoint_keep: 2,
        ..TrainOptions::default()
    };
    run(&plan, 6, opts.clone()).expect("first run");
    assert_eq!(dirs(&ck), ["step-000000004", "step-000000006"]);
    run(
        &plan,
        5,
        TrainOptions {
            resume: Some(ck.join("step-000000004")),
            ..opts
        },
    )
    .expect("resumed from the older one");
    assert_eq!(dirs(&ck), ["step-000000005", "step-000000006"]);
}

/// A checkpoint of a run with `host_updates` resumes into a plan without them and the other
/// way round: the device copies are derived state (left out of the state hash; a missing one
/// starts as its master). Resumed without, the run continues from the masters; resumed with
/// `delayed` after the warm-up, its first step reads the masters (the copy starts there).
#[test]
fn checkpoints_resume_across_host_updates() {
    let off = compile(&spec(ADAMW, 64));
    let delayed =
        compile(&spec(ADAMW, 64).replace("staleness = 0", "staleness = 0 host_updates = delayed"));
    let tmp = tempfile::tempdir().expect("tempdir");
    let base = TrainOptions {
        cache_dir: Some(tmp.path().join("cache")),
        ..TrainOptions::default()
    };
    let (full_off, _) = run(&off, 8, base.clone()).expect("uninterrupted, off");
    for (from, to, name) in [
        (&off, &delayed, "off -> delayed"),
        (&delayed, &off, "delayed -> off"),
    ] {
        let ck = tmp.path().join(name.replace(' ', ""));
        let opts = TrainOptions {
            checkpoint_dir: Some(ck.clone()),
            ..base.clone()
        };
        run(from, 4, opts).expect("first part");
        let (rest, _) = run(
            to,
            8,
            TrainOptions {
                resume: Some(ck.clone()),
                ..base.clone()
            },
        )
        .unwrap_or_else(|e| panic!("{name}: resumes: {e}"));
        assert_eq!(rest.train_losses.len(), 4, "{name}");
        if name == "off -> delayed" {
            assert_eq!(
                rest.train_losses[0], full_off.train_losses[4],
                "{name}: step 5 reads the masters of step 4"
            );
            assert_ne!(
                rest.train_losses[2], full_off.train_losses[6],
                "{name}: then delayed"
            );
        }
        assert!(rest.train_losses.iter().all(|l| l.is_finite()), "{name}");
    }
}
