//! `data { ... }` sources: corpus folders and glob patterns (every UTF-8 text file, sorted,
//! others skipped with a note), and llm.c token shards (`train` / `val`, paths or patterns).

mod common;

use std::path::Path;

use common::{assert_error, edit, errors, VALID};
use frontend::check_spec;
use ir::config::{CorpusConfig, TokenizerKind};

/// A folder with text in three formats, a binary file, a Latin-1 file, a hidden file and a
/// nested folder.
fn corpus_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("b-notes.md"), "# Notes\nsome markdown\n").expect("write");
    std::fs::write(d.join("a.txt"), "plain text\n").expect("write");
    std::fs::write(d.join("c.rst"), "Title\n=====\n").expect("write");
    std::fs::write(d.join("image.png"), [0x89u8, b'P', b'N', b'G', 0, 0, 0, 13]).expect("write");
    std::fs::write(d.join("latin1.txt"), b"na\xefve\n").expect("write");
    std::fs::write(d.join(".hidden.txt"), "not read\n").expect("write");
    std::fs::create_dir(d.join("sub")).expect("mkdir");
    std::fs::write(d.join("sub/z.md"), "nested\n").expect("write");
    dir
}

/// `VALID` with `line` added to its `data` block, checked with `base` as the spec's folder.
fn check_data(line: &str, base: &Path) -> Result<frontend::Checked, frontend::SpecErrors> {
    let src = edit("  seq_len = 64\n", &format!("  seq_len = 64\n  {line}\n"));
    check_spec("test.asteria", &src, base, &[])
}

#[test]
fn a_corpus_folder_takes_every_utf8_text_file_sorted_and_notes_the_others() {
    let dir = corpus_dir();
    let d = dir.path();
    // Relative to the spec's folder: the temp dir's parent.
    let name = d.file_name().expect("name").to_string_lossy().into_owned();
    let c =
        check_data(&format!("corpus = \"{name}\""), d.parent().expect("parent")).expect("valid");
    let p = |f: &str| d.join(f).display().to_string();
    assert_eq!(
        c.config.data.corpus,
        CorpusConfig::Files {
            paths: vec![p("a.txt"), p("b-notes.md"), p("c.rst"), p("sub/z.md")]
        }
    );
    assert_eq!(c.notes.len(), 1, "{:?}", c.notes);
    let note = &c.notes[0];
    assert!(
        note.contains("skipped 2 files that are not UTF-8 text"),
        "{note}"
    );
    assert!(
        note.contains("image.png (a NUL byte at offset 4)"),
        "{note}"
    );
    assert!(
        note.contains("latin1.txt (invalid UTF-8 at offset 2)"),
        "{note}"
    );
}

#[test]
fn a_corpus_glob_pattern_takes_its_text_matches_sorted() {
    let dir = corpus_dir();
    let d = dir.path();
    let c = check_data("corpus = \"*.md\"", d).expect("valid");
    assert_eq!(
        c.config.data.corpus,
        CorpusConfig::Files {
            paths: vec![d.join("b-notes.md").display().to_string()]
        }
    );
    assert!(c.notes.is_empty());
    // `**` descends; a pattern mixed with plain paths in a list keeps the list's order.
    let c = check_data("corpus = [\"**/*.md\", \"a.txt\"]", d).expect("valid");
    let p = |f: &str| d.join(f).display().to_string();
    assert_eq!(
        c.config.data.corpus,
        CorpusConfig::Files {
            paths: vec![p("b-notes.md"), p("sub/z.md"), p("a.txt")]
        }
    );
    // Matches that are not text are skipped with a note; none left is an error.
    let c = check_data("corpus = \"*.*\"", d).expect("valid");
    assert_eq!(c.notes.len(), 1, "{:?}", c.notes);
    assert!(c.notes[0].starts_with("corpus pattern `*.*`: skipped 2 files"));
    let e = check_data("corpus = \"*.png\"", d).expect_err("no text");
    assert!(
        e.items()[0]
            .2
            .contains("corpus pattern `*.png` holds no UTF-8 text file"),
        "{:?}",
        e.items()
    );
}

#[test]
fn corpus_patterns_that_match_nothing_or_are_malformed() {
    assert_error(
        &edit(
            "  seq_len = 64\n",
            "  seq_len = 64\n  corpus = \"fixtures/*.md\"\n",
        ),
        14,
        12,
        "the corpus pattern `fixtures/*.md` matches no file",
        Some("relative paths are resolved from the spec file's folder"),
    );
    assert_error(
        &edit(
            "  seq_len = 64\n",
            "  seq_len = 64\n  corpus = \"fixtures/[a.txt\"\n",
        ),
        14,
        12,
        "malformed glob pattern `fixtures/[a.txt`",
        None,
    );
}

/// Writes empty files `names` into `dir`.
fn touch(dir: &Path, names: &[&str]) {
    for n in names {
        std::fs::write(dir.join(n), b"").expect("write");
    }
}

#[test]
fn shard_patterns_expand_sorted_and_imply_gpt2_tokens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    touch(
        d,
        &[
            "fw_train_000002.bin",
            "fw_train_000001.bin",
            "fw_val_000000.bin",
            "readme.txt",
        ],
    );
    // vocab 256 is accepted: the shards' ids are checked against it when they are loaded.
    let src = VALID.replace("vocab = 50257", "vocab = 256").replace(
        "  seq_len = 64\n",
        "  seq_len = 64\n  train = \"fw_*train*.bin\"\n  val = \"fw_*val*.bin\"\n",
    );
    let c = check_spec("test.asteria", &src, d, &[]).expect("valid");
    let p = |f: &str| d.join(f).display().to_string();
    assert_eq!(
        c.config.data.corpus,
        CorpusConfig::Shards {
            train: vec![p("fw_train_000001.bin"), p("fw_train_000002.bin")],
            val: vec![p("fw_val_000000.bin")],
        }
    );
    assert_eq!(c.config.data.tokenizer, TokenizerKind::Gpt2);
    // `val` is optional (the tail `val_fraction` is held out), and a list mixes files and
    // patterns.
    let src = VALID.replace(
        "  seq_len = 64\n",
        "  seq_len = 64\n  train = [\"fw_train_000002.bin\", \"*val*\"]\n  val_fraction = 0.2\n",
    );
    let c = check_spec("test.asteria", &src, d, &[]).expect("valid");
    assert_eq!(
        c.config.data.corpus,
        CorpusConfig::Shards {
            train: vec![p("fw_train_000002.bin"), p("fw_val_000000.bin")],
            val: vec![],
        }
    );
    assert_eq!(c.config.data.val_fraction, 0.2);
}

#[test]
fn shard_keys_are_checked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    touch(d, &["a_train.bin", "a_val.bin"]);
    let check = |lines: &str| {
        let src = edit("  seq_len = 64\n", &format!("  seq_len = 64\n{lines}"));
        match check_spec("test.asteria", &src, d, &[]) {
            Ok(_) => panic!("expected errors for {lines}"),
            Err(e) => e
                .items()
                .into_iter()
                .zip(e.errors())
                .map(|((l, c, m), err)| (l, c, m, err.help.clone().unwrap_or_default()))
                .collect::<Vec<_>>(),
        }
    };
    let one = |lines: &str, line: usize, col: usize, msg: &str, help: &str| {
        let errs = check(lines);
        assert_eq!(errs.len(), 1, "{errs:#?}");
        let (l, c, m, h) = &errs[0];
        assert_eq!((*l, *c), (line, col), "{m}");
        assert!(m.contains(msg), "{m}");
        assert!(h.contains(help), "{h}");
    };
    one(
        "  train = \"*train*.bin\"\n  tokenizer = bytes\n",
        15,
        15,
        "token shards hold GPT-2 token ids; `tokenizer = bytes` cannot read them",
        "remove `tokenizer`",
    );
    one(
        "  val = \"*val*.bin\"\n",
        14,
        3,
        "`val` shards need `train` shards",
        "add `train",
    );
    one(
        "  corpus = builtin\n  train = \"*train*.bin\"\n",
        14,
        3,
        "`corpus` and `train` cannot both be set",
        "keep one",
    );
    one(
        "  train = \"*train*.bin\"\n  val = \"*val*.bin\"\n  val_fraction = 0.1\n",
        16,
        3,
        "`val_fraction` does not apply when `val` shards are given",
        "remove `val_fraction`",
    );
    one(
        "  train = \"*test*.bin\"\n",
        14,
        11,
        "the shard pattern `*test*.bin` matches no file",
        "relative paths",
    );
    one(
        "  train = \".\"\n",
        14,
        11,
        "`train` names the directory `.`, not token shards",
        "name the shards with a pattern, e.g. `train = \"./*train*.bin\"`",
    );
    one("  train = []\n", 14, 11, "`train` lists no shard", "");
    one(
        "  train = 3\n",
        14,
        11,
        "expected a shard path or pattern string",
        "",
    );
    // Several at once, each located.
    let errs = errors(&VALID.replace(
        "  seq_len = 64\n",
        "  seq_len = 64\n  train = \"no/*.bin\"\n  val = \"nope.bin\"\n",
    ));
    assert_eq!(errs.len(), 2, "{errs:#?}");
    assert!(
        errs[1].2.contains("shard file not found: `nope.bin`"),
        "{errs:#?}"
    );
}
