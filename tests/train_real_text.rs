//! Real text, end to end: `asteria train` on the built-in Moby-Dick with the real GPT-2 BPE,
//! through the CLI, on the README's runs: AdamW (`examples/tiny.asteria`), KL-Shampoo
//! (`examples/tiny-kl-shampoo.asteria`) and Shampoo (`examples/tiny-shampoo.asteria`, both at
//! staleness 0 and 5) for all 400 steps, SOAP (`examples/tiny-soap.asteria`, staleness 0 and 5)
//! for the first 200 — the example specs unchanged (SOAP's cut short with `--steps 200`), so
//! the learning-rate schedule, data order and evaluations (every 100 steps) are exactly the
//! README runs'.
//!
//! Checks, each in its own test:
//! * AdamW and SOAP learn: the validation loss starts at ≈ ln(50257) ≈ 10.8, falls at every
//!   evaluation, and ends below 6.3 (AdamW) and 5.8 (SOAP) at step 200. Both thresholds are
//!   well below the cross-entropy of the best context-free predictor (the training split's
//!   token frequencies: 6.74 on the validation split, computed and checked here), so passing
//!   needs a model that learned to use the context, not just token frequencies.
//! * SOAP is ahead of AdamW at step 200 by ≥ 0.25 nats (the README's claim); KL-Shampoo and
//!   Shampoo at step 400, the step issue 19 names, at staleness 0 and 5, by ≥ 0.25 nats, their
//!   two runs within 0.05 of each other.
//! * Delayed host updates (`host_updates = delayed`, AdamW at lr 6e-4 for 200 steps) end within
//!   0.15 nats of the synchronous run at the same lr.
//! * Bounded staleness (`staleness = 5`: eigenbasis refreshes computed in the background on
//!   snapshots and swapped in up to 5 steps late) ends within 0.02 nats of the synchronous run;
//!   its metrics show swaps that really were late, never later than the bound, and almost no
//!   waits; the synchronous run never swaps late nor waits.
//!
//! Why 200 steps suffice (measured on 2 cores): at step 200 AdamW is at 6.09 and SOAP at 5.60
//! (the README's step-200 numbers), so each threshold has ~0.2 nats of margin, and SOAP's lead
//! is 0.49. Staleness 5 vs 0 differ by 0.005 at step 200 (the synchronous run with another seed
//! differs by 0.014), and 200 steps make ~400 refresh swaps, so "waits are rare" (≤ 1 in 20
//! swaps) is a real bound. Earlier the trajectories are on the steep part of SOAP's curve
//! (stale vs synchronous differ by 0.1–0.3 nats at steps 50–100), which is why the comparison
//! is not made there. One `asteria train` keeps ~1 core busy; the runs are started by the
//! tests that need them and go two at a time on CI's 2 cores: a 400-step KL-Shampoo or
//! Shampoo run takes ~4 CPU-minutes, the 200-step SOAP runs ~3, AdamW's 400 steps ~3: ~15
//! minutes of the suite.
//!
//! The seven runs are started by the first test that needs them and shared through statics
//! (one `cargo test` process runs every test); a harness that runs every test in its own
//! process (nextest) repeats the shared runs.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};

/// Steps the SOAP and rule-defined runs take of the examples' 400-step schedule (the schedule
/// does not depend on `--steps`, so a run's step-200 loss is the same in a longer run).
const STEPS: u64 = 200;
/// Steps of the AdamW, KL-Shampoo and Shampoo runs: the whole schedule, the step issue 19 asks
/// the comparison at. AdamW's run serves both: its loss at `STEPS` for SOAP, at `LONG_STEPS` for
/// KL-Shampoo and Shampoo.
const LONG_STEPS: u64 = 400;
/// Validation-loss ceilings at step `STEPS` (measured: AdamW 6.08, SOAP 5.60; AdamW 5.79 at
/// step `LONG_STEPS`).
const ADAMW_BELOW: f64 = 6.3;
const SOAP_BELOW: f64 = 5.8;
/// How far SOAP must be ahead of AdamW at step `STEPS` (measured: 0.49).
const SOAP_LEAD: f64 = 0.25;
/// |staleness 5 − staleness 0| at step `STEPS` (measured: 0.005).
const STALENESS_TOLERANCE: f64 = 0.02;
/// How far KL-Shampoo must be ahead of AdamW at step `LONG_STEPS`, at staleness 0 and 5
/// (measured on 2 cores: 5.201 at S = 0 against AdamW's 5.79; at step 200 it was 5.468
/// and 5.456 against 6.09).
const KL_LEAD: f64 = 0.25;
/// |staleness 5 − staleness 0| of KL-Shampoo at step `LONG_STEPS` (measured on the H200, fp32:
/// 0.039–0.041 over four calls; 0.012 at step 200).
const KL_STALENESS_TOLERANCE: f64 = 0.05;
/// How far Shampoo must be ahead of AdamW at step `LONG_STEPS`, at staleness 0 and 5
/// (measured on 2 cores: 5.251 at S = 0 against AdamW's 5.79; at step 200 5.502 and 5.524
/// against 6.09).
const SHAMPOO_LEAD: f64 = 0.25;
/// |staleness 5 − staleness 0| of Shampoo at step `LONG_STEPS` (measured on the H200, fp32:
/// 0.004–0.014; 0.022 at step 200).
const SHAMPOO_STALENESS_TOLERANCE: f64 = 0.05;

/// |delayed − synchronous| host updates of AdamW at lr 6e-4 at step `STEPS` (measured on 2
/// cores: 6.621 against 6.547, 0.074; 0.027 at step 100). At the example's lr 2e-3 the delay
/// costs more (6.82 against 6.57 at step 100): each step moves the small model's weights by a
/// larger fraction, and a one-update-old gradient is further off.
const DELAYED_TOLERANCE: f64 = 0.15;
/// Validation-loss ceiling at step `STEPS` of both lr-6e-4 AdamW runs (measured 6.55 and 6.62):
/// below the context-free 6.74.
const LOW_LR_BELOW: f64 = 6.7;

/// Per-step and per-evaluation metrics of one run.
struct Run {
    val: Vec<(u64, f64)>,
    steps: Vec<serde_json::Value>,
}

#[derive(Clone, Copy, Debug)]
enum Which {
    AdamW,
    Soap,
    SoapStale5,
    KlShampoo,
    KlShampooStale5,
    Shampoo,
    ShampooStale5,
    /// AdamW at its default learning rate 6e-4 (the example's is 2e-3).
    AdamWLowLr,
    /// The same with `host_updates = delayed`: its updates on the host, each step's gradient
    /// one update late after the warm-up.
    AdamWLowLrDelayed,
}

impl Which {
    /// The steps this run takes (and its last evaluation).
    fn steps(self) -> u64 {
        match self {
            Which::Soap | Which::SoapStale5 | Which::AdamWLowLr | Which::AdamWLowLrDelayed => STEPS,
            _ => LONG_STEPS,
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Which::AdamW => "adamw",
            Which::Soap => "soap-s0",
            Which::SoapStale5 => "soap-s5",
            Which::KlShampoo => "kl-shampoo-s0",
            Which::KlShampooStale5 => "kl-shampoo-s5",
            Which::Shampoo => "shampoo-s0",
            Which::ShampooStale5 => "shampoo-s5",
            Which::AdamWLowLr => "adamw-lr6e-4",
            Which::AdamWLowLrDelayed => "adamw-lr6e-4-delayed",
        }
    }
}

enum State {
    Running { child: Child, dir: PathBuf },
    Done(Result<Arc<Run>, String>),
}

static RUNS: [Mutex<Option<State>>; 9] = [const { Mutex::new(None) }; 9];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The built-in corpus in GPT-2 tokens, through the token cache `asteria train` uses by
/// default. Loaded once before the first run starts, so that the runs (started together) read
/// the cache instead of all writing it at once.
fn tokens() -> &'static [u16] {
    static TOKENS: OnceLock<Vec<u16>> = OnceLock::new();
    TOKENS.get_or_init(|| {
        data::load_corpus_tokens(
            &data::CorpusSource::Builtin,
            data::Tokenizer::Gpt2,
            Some(&std::env::temp_dir().join("asteria-token-cache")),
        )
        .expect("tokens")
    })
}

/// Starts `which` in the background unless it was started already.
fn start(which: Which) {
    tokens();
    let mut slot = RUNS[which as usize].lock().expect("run slot");
    if slot.is_some() {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "real-text-{}-{}",
        std::process::id(),
        which.tag()
    ));
    std::fs::create_dir_all(&dir).expect("run folder");
    let spec = match which {
        Which::AdamW | Which::AdamWLowLr | Which::AdamWLowLrDelayed => {
            root().join("examples/tiny.asteria")
        }
        Which::Soap => root().join("examples/tiny-soap.asteria"),
        Which::KlShampoo => root().join("examples/tiny-kl-shampoo.asteria"),
        Which::Shampoo => root().join("examples/tiny-shampoo.asteria"),
        Which::SoapStale5 | Which::KlShampooStale5 | Which::ShampooStale5 => {
            let name = match which {
                Which::SoapStale5 => "tiny-soap",
                Which::ShampooStale5 => "tiny-shampoo",
                _ => "tiny-kl-shampoo",
            };
            let text = std::fs::read_to_string(root().join(format!("examples/{name}.asteria")))
                .expect("spec");
            assert!(text.contains("staleness = 0"), "the example spec changed");
            let spec = dir.join(format!("{name}-s5.asteria"));
            std::fs::write(&spec, text.replacen("staleness = 0", "staleness = 5", 1))
                .expect("write spec");
            spec
        }
    };
    let log = |name: &str| std::fs::File::create(dir.join(name)).expect("log file");
    let child = Command::new(env!("CARGO_BIN_EXE_asteria"))
        .arg("train")
        .arg(&spec)
        .args([
            "--quiet",
            "--steps",
            &which.steps().to_string(),
            "--metrics",
        ])
        .arg(dir.join("metrics.jsonl"))
        .args(match which {
            Which::AdamWLowLr => &["--set", "optimizer.lr=6e-4"][..],
            Which::AdamWLowLrDelayed => &[
                "--set",
                "optimizer.lr=6e-4",
                "--set",
                "target.host_updates=delayed",
            ][..],
            _ => &[],
        })
        .current_dir(root())
        .stdout(Stdio::from(log("stdout")))
        .stderr(Stdio::from(log("stderr")))
        .spawn()
        .expect("asteria runs");
    *slot = Some(State::Running { child, dir });
}

fn parse(which: Which, dir: &Path) -> Result<Run, String> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).map_err(|e| e.to_string())?;
    let (mut val, mut steps) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
        if let Some(l) = v.get("val_loss") {
            match (v["step"].as_u64(), l.as_f64()) {
                (Some(step), Some(loss)) => val.push((step, loss)),
                _ => return Err(format!("bad evaluation line {line}")),
            }
        } else {
            steps.push(v);
        }
    }
    eprintln!("{}: validation curve {val:?}", which.tag());
    Ok(Run { val, steps })
}

/// Waits for `which` (starting it if needed) and returns its metrics.
fn run(which: Which) -> Arc<Run> {
    start(which);
    let result = {
        let mut slot = RUNS[which as usize].lock().expect("run slot");
        if let Some(State::Running { child, dir }) = slot.as_mut() {
            let status = child.wait().expect("asteria exits");
            let result = if status.success() {
                parse(which, dir).map(Arc::new)
            } else {
                Err(format!(
                    "{status}: {}",
                    std::fs::read_to_string(dir.join("stderr")).unwrap_or_default()
                ))
            };
            let _ = std::fs::remove_dir_all(&*dir);
            *slot = Some(State::Done(result));
        }
        match slot.as_ref() {
            Some(State::Done(r)) => r.clone(),
            _ => unreachable!("started above"),
        }
    };
    result.unwrap_or_else(|e| panic!("{}: {e}", which.tag()))
}

/// Cross-entropy (nats) of the validation split under the training split's token frequencies
/// (add-0.1 smoothing over the 50257 ids): the best loss without context.
fn unigram_val_loss() -> f64 {
    let ds = data::Dataset::new(tokens().to_vec(), 0.1, 64).expect("split");
    let mut counts = vec![0f64; data::GPT2_VOCAB_SIZE];
    for t in ds.train().iter() {
        counts[t as usize] += 1.0;
    }
    let total = ds.train().len() as f64 + 0.1 * data::GPT2_VOCAB_SIZE as f64;
    let nll: f64 = ds
        .val()
        .iter()
        .map(|t| -((counts[t as usize] + 0.1) / total).ln())
        .sum();
    nll / ds.val().len() as f64
}

/// The validation loss of `r` at `step` (an evaluation step of the examples: every 100).
fn val_at(r: &Run, step: u64) -> f64 {
    r.val
        .iter()
        .find(|v| v.0 == step)
        .unwrap_or_else(|| panic!("no evaluation at step {step}: {:?}", r.val))
        .1
}

/// Starts at ≈ ln(50257), falls at every evaluation (every 100 steps), ends at its last step
/// ([`Which::steps`]) below `below`; returns the final validation loss.
fn check_learns(which: Which, below: f64) -> f64 {
    let r = run(which);
    let tag = which.tag();
    let steps: Vec<u64> = r.val.iter().map(|v| v.0).collect();
    let expected: Vec<u64> = (0..=which.steps()).step_by(100).collect();
    assert_eq!(steps, expected, "{tag}: evaluation steps");
    let (first, last) = (r.val[0].1, r.val[r.val.len() - 1].1);
    assert!(
        (first - 10.8).abs() < 0.3,
        "{tag}: initial val loss {first} is not ≈ ln(50257)"
    );
    assert!(
        r.val.windows(2).all(|w| w[1].1 < w[0].1),
        "{tag}: validation loss does not fall at every evaluation: {:?}",
        r.val
    );
    assert!(
        last < below,
        "{tag}: val loss {last} at step {} is not below {below}",
        which.steps()
    );
    last
}

#[test]
fn tiny_adamw_learns_moby_dick() {
    start(Which::AdamW);
    let unigram = unigram_val_loss();
    eprintln!("context-free (unigram) validation loss: {unigram:.4}");
    assert!(
        ADAMW_BELOW < unigram - 0.3 && SOAP_BELOW < ADAMW_BELOW,
        "the thresholds must demand more than token frequencies ({unigram})"
    );
    check_learns(Which::AdamW, ADAMW_BELOW);
    let at = val_at(&run(Which::AdamW), STEPS);
    assert!(at < ADAMW_BELOW, "AdamW: val loss {at} at step {STEPS}");
}

#[test]
fn tiny_soap_learns_moby_dick_ahead_of_adamw() {
    start(Which::Soap);
    start(Which::AdamW);
    let soap = check_learns(Which::Soap, SOAP_BELOW);
    let adamw = val_at(&run(Which::AdamW), STEPS);
    assert!(
        soap < adamw - SOAP_LEAD,
        "SOAP {soap} is not {SOAP_LEAD} ahead of AdamW {adamw} at step {STEPS}"
    );
}

/// `sync` and `stale` (the same spec at staleness 0 and 5) learn and end at least `lead` ahead
/// of AdamW at step `LONG_STEPS`, within `tolerance` of each other, and the stale run's refreshes
/// really are swapped in late (never later than 5 steps).
fn ahead_of_adamw_at_staleness_0_and_5(
    name: &str,
    (sync, stale): (Which, Which),
    lead: f64,
    tolerance: f64,
) {
    start(sync);
    start(stale);
    start(Which::AdamW);
    let adamw = val_at(&run(Which::AdamW), LONG_STEPS);
    let s0 = check_learns(sync, adamw);
    let s5 = check_learns(stale, adamw);
    eprintln!("step {LONG_STEPS}: AdamW {adamw:.4}, {name} S = 0 {s0:.4}, S = 5 {s5:.4}");
    assert!(
        s0 < adamw - lead && s5 < adamw - lead,
        "{name} (S = 0 {s0}, S = 5 {s5}) is not {lead} ahead of AdamW {adamw}"
    );
    assert!(
        (s5 - s0).abs() <= tolerance,
        "{name}: S = 5 {s5} vs S = 0 {s0}"
    );
    let late = run(stale);
    let staleness: Vec<u64> = late
        .steps
        .iter()
        .filter_map(|s| s["max_swap_staleness"].as_u64())
        .collect();
    assert!(staleness.iter().any(|&s| s > 0), "{name}: no late swap");
    assert!(staleness.iter().all(|&s| s <= 5), "{name}: {staleness:?}");
}

/// KL-Shampoo (`examples/tiny-kl-shampoo.asteria`) learns and ends ahead of AdamW at step
/// `LONG_STEPS` (400, the step), both with synchronous basis refreshes and with `staleness = 5` (QR refreshes on
/// snapshots in the background, swapped in up to 5 steps late, which really happens), and the
/// two end within [`KL_STALENESS_TOLERANCE`] of each other.
#[test]
fn tiny_kl_shampoo_learns_moby_dick_ahead_of_adamw_at_staleness_0_and_5() {
    ahead_of_adamw_at_staleness_0_and_5(
        "KL-Shampoo",
        (Which::KlShampoo, Which::KlShampooStale5),
        KL_LEAD,
        KL_STALENESS_TOLERANCE,
    );
}

/// Shampoo (`examples/tiny-shampoo.asteria`: blocks of 256, Adam grafting) learns and ends
/// ahead of AdamW at step `LONG_STEPS`, both with synchronous inverse-root refreshes and with
/// `staleness = 5` (refreshes on snapshots on the host pool, swapped in up to 5 steps late,
/// which really happens), and the two end within [`SHAMPOO_STALENESS_TOLERANCE`].
#[test]
fn tiny_shampoo_learns_moby_dick_ahead_of_adamw_at_staleness_0_and_5() {
    ahead_of_adamw_at_staleness_0_and_5(
        "Shampoo",
        (Which::Shampoo, Which::ShampooStale5),
        SHAMPOO_LEAD,
        SHAMPOO_STALENESS_TOLERANCE,
    );
}

/// Validation-loss ceiling at step `STEPS` of the optimizers defined by their update rule
/// (`optim::optimizers`; measured: Lion 6.75). Below the initial 10.8 by 4 nats: they learn;
/// their quality against AdamW is a benchmark's question, not this test's.
const RULE_BELOW: f64 = 7.0;

/// Every optimizer defined by its element-wise rule (`optim::optimizers::DEFINITIONS`) has its
/// example `examples/tiny-<name>.asteria` (the tiny model of `tiny.asteria`), which learns: the
/// validation loss falls at every evaluation and ends below [`RULE_BELOW`]. A definition added
/// to the registry is trained here without touching this file.
#[test]
fn every_rule_defined_optimizer_learns_moby_dick() {
    tokens();
    for d in optim::optimizers::DEFINITIONS {
        let spec = root().join(format!("examples/tiny-{}.asteria", d.name));
        assert!(spec.exists(), "{}: no example {}", d.name, spec.display());
        let text = std::fs::read_to_string(&spec).expect("spec");
        assert!(
            text.contains(&format!("optimizer {} {{", d.name)),
            "{} does not use `optimizer {}`",
            spec.display(),
            d.name
        );
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "real-text-{}-{}",
            std::process::id(),
            d.name
        ));
        std::fs::create_dir_all(&dir).expect("run folder");
        let out = Command::new(env!("CARGO_BIN_EXE_asteria"))
            .arg("train")
            .arg(&spec)
            .args(["--quiet", "--steps", &STEPS.to_string(), "--metrics"])
            .arg(dir.join("metrics.jsonl"))
            .current_dir(root())
            .output()
            .expect("asteria runs");
        assert!(
            out.status.success(),
            "{}: {}",
            d.name,
            String::from_utf8_lossy(&out.stderr)
        );
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).expect("metrics");
        let val: Vec<(u64, f64)> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| Some((v["step"].as_u64()?, v.get("val_loss")?.as_f64()?)))
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        eprintln!("{}: validation curve {val:?}", d.name);
        let steps: Vec<u64> = val.iter().map(|v| v.0).collect();
        assert_eq!(steps, [0, 100, STEPS], "{}: evaluation steps", d.name);
        assert!(
            val.windows(2).all(|w| w[1].1 < w[0].1),
            "{}: validation loss does not fall at every evaluation: {val:?}",
            d.name
        );
        let last = val[val.len() - 1].1;
        assert!(
            last < RULE_BELOW,
            "{}: val loss {last} at step {STEPS} is not below {RULE_BELOW}",
            d.name
        );
    }
}

fn count(run: &Run, key: &str) -> u64 {
    run.steps.iter().map(|s| s[key].as_u64().expect(key)).sum()
}

#[test]
fn staleness_5_matches_synchronous_soap_on_moby_dick() {
    start(Which::Soap);
    start(Which::SoapStale5);
    let (sync, late) = (run(Which::Soap), run(Which::SoapStale5));
    let (v0, v5) = (
        sync.val.last().expect("final eval"),
        late.val.last().expect("final eval"),
    );
    assert_eq!((v0.0, v5.0), (STEPS, STEPS));
    assert_eq!(
        (sync.steps.len(), late.steps.len()),
        (STEPS as usize, STEPS as usize)
    );
    eprintln!(
        "val loss at step {STEPS}: S = 0 {:.4}, S = 5 {:.4} (Δ {:+.4})",
        v0.1,
        v5.1,
        v5.1 - v0.1
    );
    assert!(
        (v5.1 - v0.1).abs() <= STALENESS_TOLERANCE,
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
    assert!(count(&sync, "refreshes_swapped") > 0);
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

/// The quality check of `host_updates = delayed` (ZeRO-Offload's delayed parameter update):
/// AdamW at lr 6e-4 with its updates on the host, each step's gradient taken at the
/// parameters one update old after the warm-up, learns Moby-Dick and ends within
/// `DELAYED_TOLERANCE` of the synchronous run at step `STEPS`.
#[test]
fn delayed_host_updates_stay_close_to_synchronous_adamw_on_moby_dick() {
    start(Which::AdamWLowLr);
    start(Which::AdamWLowLrDelayed);
    let sync = check_learns(Which::AdamWLowLr, LOW_LR_BELOW);
    let delayed = check_learns(Which::AdamWLowLrDelayed, LOW_LR_BELOW);
    eprintln!("step {STEPS}: synchronous {sync:.4}, delayed host updates {delayed:.4}");
    assert!(
        (delayed - sync).abs() <= DELAYED_TOLERANCE,
        "delayed {delayed} vs synchronous {sync} at step {STEPS}"
    );
}
