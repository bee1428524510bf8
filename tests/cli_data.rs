//! End-to-end tests of the `asteria` binary's data inputs: text folders and glob patterns, and
//! llm.c token shards (training, resuming, refusing malformed ones).
mod cli_common;

use cli_common::*;
use std::path::{Path, PathBuf};

/// A tiny bytes-tokenizer GPT-2 spec (vocab 256, batch 2 × 32, one thread) with `data` lines
/// `data`, written into `dir` as `name`.
fn data_spec(dir: &Path, name: &str, data: &str) -> PathBuf {
    let spec = dir.join(name);
    std::fs::write(
        &spec,
        format!(
            "model gpt2 {{ vocab = 256 context = 32 d_model = 32 layers = 1 heads = 2 }}
optimizer adamw {{ lr = 1e-3 }}
data {{ {data} batch_size = 2 seq_len = 32 }}
train {{ steps = 4 eval_interval = 2 eval_batches = 2 }}
target cpu {{ threads = 1 }}
"
        ),
    )
    .expect("write spec");
    spec
}

#[test]
fn a_folder_or_glob_corpus_takes_every_utf8_text_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let texts = dir.path().join("texts");
    std::fs::create_dir(&texts).expect("mkdir");
    let book = &data::BUILTIN_CORPUS[..20_000];
    std::fs::write(texts.join("chapter.md"), book).expect("write");
    std::fs::write(
        texts.join("notes.rst"),
        &data::BUILTIN_CORPUS[20_000..30_000],
    )
    .expect("write");
    std::fs::write(texts.join("cover.jpg"), [0xffu8, 0xd8, 0xff, 0xe0, 0, 16]).expect("write");
    let spec = data_spec(
        dir.path(),
        "folder.asteria",
        "corpus = \"texts\" tokenizer = bytes",
    );
    let s = spec.to_str().expect("utf8");
    let cache = dir.path().join("cache");
    let c = cache.to_str().expect("utf8");

    let plan = dir.path().join("plan.json");
    let o = asteria(&["compile", s, "-o", plan.to_str().expect("utf8")]);
    assert!(o.status.success(), "{:?}", text(&o));
    let err = flat(&o);
    assert!(
        err.contains("note: corpus directory `texts`: skipped 1 file that is not UTF-8 text")
            && err.contains("cover.jpg (a NUL byte at offset 4)"),
        "{err}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
    let paths: Vec<String> = json["data"]["corpus"]["paths"]
        .as_array()
        .expect("paths")
        .iter()
        .map(|p| p.as_str().expect("str").to_string())
        .collect();
    let p = |f: &str| texts.join(f).display().to_string();
    assert_eq!(paths, [p("chapter.md"), p("notes.rst")]);

    // Both files are trained on (30 000 bytes = tokens; a separator between the files).
    let o = asteria(&["train", s, "--cache-dir", c]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(
        flat(&o).contains("corpus 27001 train / 3000 val tokens"),
        "{}",
        flat(&o)
    );

    // A glob pattern (given on the command line: the shell strips its quotes).
    let o = asteria(&[
        "train",
        s,
        "--cache-dir",
        c,
        "--quiet",
        "--set",
        "data.corpus=texts/*.md",
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let plan = plan_json(dir.path(), s, &["--set", "data.corpus=texts/*.md"]);
    assert_eq!(
        plan["data"]["corpus"]["paths"],
        serde_json::json!([p("chapter.md")])
    );
    // Nothing textual left is an error naming the files.
    let o = asteria(&["compile", s, "--set", "data.corpus=texts/*.jpg"]);
    assert_eq!(o.status.code(), Some(1));
    let err = flat(&o);
    assert!(
        err.contains("corpus pattern `texts/*.jpg` holds no UTF-8 text file"),
        "{err}"
    );
    assert!(err.contains("cover.jpg"), "{err}");
}

/// Shards in llm.c's layout, written with the data crate's writer: train shards of
/// `train_tokens` split in two, and one validation shard; token ids are Moby-Dick's bytes.
fn write_shards(dir: &Path, train_tokens: usize, val_tokens: usize) -> PathBuf {
    let shards = dir.join("shards");
    std::fs::create_dir_all(&shards).expect("mkdir");
    let bytes: Vec<u16> = data::BUILTIN_CORPUS
        .bytes()
        .take(train_tokens + val_tokens)
        .map(u16::from)
        .collect();
    let half = train_tokens / 2;
    data::write_tokens(
        &shards.join("tiny_train_000002.bin"),
        &bytes[half..train_tokens],
    )
    .expect("shard");
    data::write_tokens(&shards.join("tiny_train_000001.bin"), &bytes[..half]).expect("shard");
    data::write_tokens(&shards.join("tiny_val_000000.bin"), &bytes[train_tokens..]).expect("shard");
    shards
}

/// The losses of the metrics file `path`: `(step, loss)` of every training step.
fn losses(path: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(path)
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json line"))
        .filter_map(|v| Some((v["step"].as_u64()?, v.get("loss")?.as_f64()?)))
        .collect()
}

const SHARDS: &str = "train = \"shards/*train*.bin\" val = \"shards/*val*.bin\"";

/// A corpus prepared as llm.c shards trains on the CPU engine without tokenizing; the data
/// position survives a checkpoint (a resumed run repeats the uninterrupted run's losses).
#[test]
fn llm_c_token_shards_train_on_the_cpu_engine_and_resume() {
    let dir = tempfile::tempdir().expect("tempdir");
    let shards = write_shards(dir.path(), 20_000, 3_000);
    let spec = data_spec(dir.path(), "shards.asteria", SHARDS);
    let s = spec.to_str().expect("utf8");
    let plan = plan_json(dir.path(), s, &[]);
    let p = |f: &str| shards.join(f).display().to_string();
    assert_eq!(
        plan["data"]["corpus"],
        serde_json::json!({
            "kind": "shards",
            "train": [p("tiny_train_000001.bin"), p("tiny_train_000002.bin")],
            "val": [p("tiny_val_000000.bin")],
        })
    );
    assert_eq!(plan["data"]["tokenizer"], "gpt2");

    let (ck, full, resumed) = (
        dir.path().join("ck"),
        dir.path().join("full.jsonl"),
        dir.path().join("resumed.jsonl"),
    );
    let o = asteria(&[
        "train",
        s,
        "--metrics",
        full.to_str().expect("utf8"),
        "--checkpoint-dir",
        ck.to_str().expect("utf8"),
        "--checkpoint-every",
        "2",
        "--checkpoint-keep",
        "5",
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let err = flat(&o);
    assert!(
        err.contains("corpus 20000 train / 3000 val tokens"),
        "{err}"
    );
    assert!(err.contains("step 4/4 | train loss"), "{err}");
    let full = losses(&full);
    assert_eq!(full.len(), 4);
    assert!(full.iter().all(|(_, l)| l.is_finite()), "{full:?}");

    let step2 = ck.join("step-000000002");
    let o = asteria(&[
        "train",
        s,
        "--quiet",
        "--resume",
        step2.to_str().expect("utf8"),
        "--metrics",
        resumed.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    assert_eq!(
        losses(&resumed),
        full[2..],
        "steps 3 and 4 after resuming at step 2"
    );

    // The shards imply GPT-2 token ids: the bytes tokenizer is refused, on the argument.
    let o = asteria(&["compile", s, "--set", "data.tokenizer=bytes"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        flat(&o)
            .contains("token shards hold GPT-2 token ids; `tokenizer = bytes` cannot read them"),
        "{}",
        flat(&o)
    );
}

/// Truncated shards, foreign headers and token ids past the model's vocabulary are refused
/// before the first step, naming the file and the reason.
#[test]
fn malformed_shards_are_refused_before_training_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let shards = write_shards(dir.path(), 20_000, 3_000);
    let spec = data_spec(dir.path(), "shards.asteria", SHARDS);
    let s = spec.to_str().expect("utf8");
    let good = std::fs::read(shards.join("tiny_train_000002.bin")).expect("read");
    let bad = shards.join("tiny_train_000002.bin");
    let mut magic = good.clone();
    magic[0..4].copy_from_slice(&20240521i32.to_le_bytes());
    let mut big = good.clone();
    big[1024 + 2 * 77..1024 + 2 * 78].copy_from_slice(&300u16.to_le_bytes());
    for (bytes, expect) in [
        (
            good[..good.len() - 1].to_vec(),
            "is 21023 bytes but its header promises 10000 tokens (21024 bytes): truncated",
        ),
        (magic, "has magic 20240521, expected 20240520"),
        (
            big,
            "holds token id 300 at token 77, but the model's vocab is 256 (ids must be < vocab): \
             set `vocab = 301` or more",
        ),
    ] {
        std::fs::write(&bad, &bytes).expect("write");
        let metrics = dir.path().join("m.jsonl");
        let o = asteria(&["train", s, "--metrics", metrics.to_str().expect("utf8")]);
        assert_eq!(o.status.code(), Some(1), "{expect}: {:?}", text(&o));
        let err = flat(&o);
        assert!(err.contains(&bad.display().to_string()), "{err}");
        assert!(err.contains(expect), "{expect}: {err}");
        assert!(
            !err.contains("training steps"),
            "refused before training: {err}"
        );
        assert!(!metrics.exists(), "nothing ran");
    }
    // A vocabulary large enough for the id trains.
    let o = asteria(&[
        "train",
        s,
        "--quiet",
        "--set",
        "model.vocab=512",
        "--set",
        "train.steps=1",
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
}
