//! Helpers shared by the frontend's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use frontend::{parse_spec, SpecErrors};
use ir::config::Config;
use miette::{GraphicalReportHandler, GraphicalTheme};

/// The crate's `tests/` folder (corpus paths in test specs are relative to it).
pub fn tests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests")
}

/// Parses `src` as `test.asteria` with `tests/` as the base folder.
pub fn parse(src: &str) -> Result<Config, SpecErrors> {
    parse_spec("test.asteria", src, &tests_dir())
}

/// The errors of `src` as `(line, column, message, help)`; panics if it parses.
pub fn errors(src: &str) -> Vec<(usize, usize, String, Option<String>)> {
    match parse(src) {
        Ok(c) => panic!("expected errors, got a config: {c:?}"),
        Err(e) => e
            .items()
            .into_iter()
            .zip(e.errors())
            .map(|((l, c, m), err)| (l, c, m, err.help.clone()))
            .collect(),
    }
}

/// The single error of `src`; panics if there are none or several.
pub fn one_error(src: &str) -> (usize, usize, String, Option<String>) {
    let mut errs = errors(src);
    assert_eq!(errs.len(), 1, "expected exactly one error, got {errs:#?}");
    errs.remove(0)
}

/// Asserts that `src` has exactly one error, at `line:col`, whose message contains `msg` and
/// whose help contains `help` (when given).
#[track_caller]
pub fn assert_error(src: &str, line: usize, col: usize, msg: &str, help: Option<&str>) {
    let (l, c, m, h) = one_error(src);
    assert_eq!((l, c), (line, col), "wrong position for `{m}`");
    assert!(m.contains(msg), "message `{m}` lacks `{msg}`");
    if let Some(help) = help {
        let h = h.unwrap_or_default();
        assert!(
            h.contains(help),
            "help `{h}` lacks `{help}` (message `{m}`)"
        );
    }
}

/// Renders `e` as miette's graphical report, without colors, 100 columns wide.
pub fn render(e: &SpecErrors) -> String {
    let mut out = String::new();
    let handler = GraphicalReportHandler::new_themed(GraphicalTheme::unicode_nocolor())
        .with_width(100)
        .with_links(false);
    match handler.render_report(&mut out, e) {
        Ok(()) => out,
        Err(err) => format!("render failed: {err}"),
    }
}

/// `VALID` with `from` replaced by `to` (which must occur exactly once).
pub fn edit(from: &str, to: &str) -> String {
    assert_eq!(
        VALID.matches(from).count(),
        1,
        "`{from}` must occur once in VALID"
    );
    VALID.replacen(from, to, 1)
}

/// A valid spec; tests splice a broken line into it.
pub const VALID: &str = "\
model gpt2 {
  vocab = 50257
  context = 64
  d_model = 64
  layers = 2
  heads = 4
}
optimizer adamw {
  lr = 1e-3
}
data {
  batch_size = 8
  seq_len = 64
}
train {
  steps = 10
}
";
