//! `asteria export CKPT --format hf`: a trained GPT-2 and a trained LLaMA checkpoint, exported
//! and loaded by Hugging Face `transformers` (PyTorch, CPU, float32; `tests/hf/logits.py`),
//! give asteria's logits on a batch of real text (Moby-Dick through the GPT-2 tokenizer).
//!
//! Needs a Python with `torch` and `transformers`: `ASTERIA_PYTHON` names it, else
//! `target/pyenv` (where `bash scripts/test` installs them), else `python3`. Without them the
//! test fails and says how to install them.
use std::path::Path;
use std::process::Command;

fn asteria(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_asteria"))
        .args(args)
        .output()
        .expect("run asteria");
    assert!(
        out.status.success(),
        "asteria {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ASTERIA_PYTHON`, else the environment `bash scripts/test` installs (`target/pyenv`), else
/// `python3`.
fn python() -> String {
    if let Ok(p) = std::env::var("ASTERIA_PYTHON") {
        return p;
    }
    let pyenv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/pyenv/bin/python");
    if pyenv.exists() {
        return pyenv.to_string_lossy().into_owned();
    }
    "python3".into()
}

/// Trains `spec` for a few steps with a checkpoint, exports it, runs both asteria's CPU engine
/// and transformers on `B × T` real tokens and compares every logit.
fn export_matches_transformers(name: &str, spec: &str, architecture: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec_path = dir.path().join(format!("{name}.asteria"));
    std::fs::write(&spec_path, spec).expect("write spec");
    let ck = dir.path().join("ck");
    let hf = dir.path().join("hf");
    asteria(&[
        "train",
        spec_path.to_str().expect("utf-8 path"),
        "--checkpoint-dir",
        ck.to_str().expect("utf-8 path"),
        "-q",
    ]);
    asteria(&[
        "export",
        ck.to_str().expect("utf-8 path"),
        "--format",
        "hf",
        "-o",
        hf.to_str().expect("utf-8 path"),
    ]);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("config.json")).expect("config.json"))
            .expect("config.json is JSON");
    assert_eq!(config["architectures"][0], architecture);

    let ckpt = engine::checkpoint::load(&ck).expect("checkpoint");
    let mut eng = engine::sample::cpu_engine(&ckpt).expect("engine");
    let plan = ckpt.plan.as_ref().expect("plan");
    let (b, t) = (plan.data.batch_size, plan.data.seq_len);
    // B windows of real text, from different places of the book.
    let ids = data::Tokenizer::Gpt2
        .encode(&data::BUILTIN_CORPUS[20_000..60_000])
        .expect("encode");
    let tokens: Vec<i32> = (0..b)
        .flat_map(|r| ids[r * 997..r * 997 + t].iter().map(|&x| x as i32))
        .collect();
    let ours = engine::sample::forward_logits(&mut eng, &tokens).expect("logits");

    let tok_path = dir.path().join("tokens.i32");
    let out_path = dir.path().join("logits.f32");
    let bytes: Vec<u8> = tokens.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&tok_path, bytes).expect("write tokens");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/hf/logits.py");
    let py = python();
    let out = Command::new(&py)
        .arg(&script)
        .args([&hf, &tok_path, &out_path])
        .args([b.to_string(), t.to_string()])
        .output()
        .unwrap_or_else(|e| panic!("running {py}: {e}; run the tests with `bash scripts/test`, which installs torch and transformers"));
    assert!(
        out.status.success(),
        "{py} tests/hf/logits.py failed (torch and transformers missing? `bash scripts/test` installs them into target/pyenv):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{}", String::from_utf8_lossy(&out.stdout).trim());
    let theirs: Vec<f32> = std::fs::read(&out_path)
        .expect("logits")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(theirs.len(), ours.len(), "logits [B, T, V] sizes");
    let scale = ours.iter().fold(0f64, |m, &x| m.max(x.abs()));
    let worst = ours
        .iter()
        .zip(&theirs)
        .fold(0f64, |m, (&a, &b)| m.max((a - b as f64).abs()));
    let vocab = ours.len() / (b * t);
    let agree = ours
        .chunks(vocab)
        .zip(theirs.chunks(vocab))
        .filter(|(a, b)| {
            let am = (0..vocab).max_by(|&i, &j| a[i].total_cmp(&a[j]));
            let bm = (0..vocab).max_by(|&i, &j| b[i].total_cmp(&b[j]));
            am == bm
        })
        .count();
    eprintln!(
        "{name}: {} logits, max |asteria - transformers| {worst:.2e} (largest logit {scale:.2}), argmax agrees at {agree}/{} positions",
        ours.len(),
        b * t
    );
    // f32 on both sides, different summation orders: a few ulps of the logits' scale. A wrong
    // layout (an untransposed Conv1D, swapped gate/up, another RoPE layout) is off by O(1).
    assert!(
        worst <= 1e-4 * scale.max(1.0),
        "{name}: logits differ by {worst} (scale {scale})"
    );
    assert!(
        agree * 100 >= b * t * 99,
        "{name}: argmax agrees at {agree}/{}",
        b * t
    );
}

#[test]
fn gpt2_export_loads_in_transformers_with_the_same_logits() {
    export_matches_transformers(
        "gpt2",
        "model gpt2 { vocab = 50257 context = 64 d_model = 64 layers = 2 heads = 4 mlp_hidden = 192 }
optimizer adamw { lr = 3e-3 }
data { corpus = builtin tokenizer = gpt2 batch_size = 4 seq_len = 48 val_fraction = 0.1 }
train { steps = 6 warmup = 2 }
target cpu { threads = 2 }
",
        "GPT2LMHeadModel",
    );
}

#[test]
fn llama_export_loads_in_transformers_with_the_same_logits() {
    // Non-default RoPE base and RMSNorm epsilon: the config must carry them.
    export_matches_transformers(
        "llama",
        "model llama { vocab = 50304 context = 64 d_model = 64 layers = 2 heads = 4 mlp_hidden = 160 rope_theta = 500000 norm_eps = 1e-6 }
optimizer soap { lr = 3e-3 precondition_frequency = 2 }
data { corpus = builtin tokenizer = gpt2 batch_size = 4 seq_len = 48 val_fraction = 0.1 }
train { steps = 6 warmup = 2 }
target cpu { threads = 2 }
",
        "LlamaForCausalLM",
    );
}
