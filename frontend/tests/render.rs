//! Rendered diagnostics (miette's graphical handler, no colors), snapshot-tested with insta.
//! Update with `INSTA_UPDATE=always cargo test --release -p asteria-frontend --test render`.

mod common;

use std::path::Path;

use frontend::{parse_spec, parse_spec_bytes, SpecErrors};

/// Parses `src` with the relative base folder `tests` (the test's working directory is the
/// crate root), so that paths in the snapshots do not depend on the checkout's location.
fn rendered(name: &str, src: &str) -> String {
    match parse_spec(name, src, Path::new("tests")) {
        Ok(c) => panic!("expected errors, got {c:?}"),
        Err(e) => common::render(&e),
    }
}

#[test]
fn three_errors() {
    let src = "\
# three mistakes
model gpt2 {
  vocab = 50257
  context = 64
  d_model = 64
  layers = 2
  heads = 4
  mlp_hiden = 256
}
optimizer soap {
  lr = 3e-3
  betas = (0.95, 1.5)
}
data {
  corpus = \"moby.txt\"
  batch_size = 8
  seq_len = 64
}
train { steps = 100 }
";
    insta::assert_snapshot!("three_errors", rendered("three.asteria", src));
}

#[test]
fn syntax_errors_with_recovery() {
    let src = "\
model llama {
  vocab = [50257
  context = 64
  d_model = 64 layers = 2 heads = 4
  rope_theta = \"10000
optimizer adamw { lr = 6e-4 }
data { batch_size = 8 seq_len = 128 }
train { steps: 10 }
";
    insta::assert_snapshot!("syntax_errors", rendered("syntax.asteria", src));
}

#[test]
fn duplicates_and_cross_block_checks() {
    let src = "\
model gpt2 { vocab = 50257 context = 64 d_model = 64 layers = 2 heads = 6 }
optimizer adamw { lr = 1e-3 lr = 2e-3 }
data { tokenizer = bytes batch_size = 8 seq_len = 64 }
train { steps = 10 warmup = 20 }
target cuda { threads = 4 }
";
    insta::assert_snapshot!("semantic_errors", rendered("semantic.asteria", src));
}

#[test]
fn not_utf8() {
    let mut bytes = b"model gpt2 {\n  vocab = 50257 # na\xefve\n}\n".to_vec();
    bytes.extend_from_slice(b"train { steps = \xff\xfe }\n");
    let e: SpecErrors =
        parse_spec_bytes("latin1.asteria", &bytes, Path::new("tests")).expect_err("not UTF-8");
    insta::assert_snapshot!("not_utf8", common::render(&e));
}

#[test]
fn empty() {
    insta::assert_snapshot!("empty", rendered("empty.asteria", ""));
}
