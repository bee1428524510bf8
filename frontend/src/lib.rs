//! asteria's spec language: a `*.asteria` file describes the model, optimizer, data, training
//! loop and target of one run; this crate parses it (nom + `nom_locate`) into a syntax tree with
//! spans ([`ast`]), checks it, and produces the validated [`ir::config::Config`].
//!
//! Every syntax and semantic error becomes a miette diagnostic with the file name, line:column
//! and the span underlined, and all errors of a file are reported at once ([`SpecErrors`]).
//! No input makes the parser panic.
//!
//! ```text
//! model gpt2 { vocab = 50257  context = 64  d_model = 64  layers = 2  heads = 4 }
//! optimizer soap { lr = 3e-3 }
//! data { batch_size = 8  seq_len = 64 }
//! train { steps = 500 }
//! ```
//! The grammar is in [`parser`]; the keys, types and defaults of each block are documented in
//! `examples/*.asteria` and enforced by `src/lower/` (one file per block family); the range of
//! every numeric key is defined once in `schedule::limits` (re-exported as [`ir::limits`]) and
//! listed in the README's "Spec keys" table.
//!
//! Any input is handled in linear time with bounded output: binary data, JSON (a compiled plan
//! given as a spec) and files over [`MAX_SPEC_BYTES`] are one error each, parsing stops after
//! [`parser::MAX_SYNTAX_ERRORS`], and at most [`diagnostics::MAX_SHOWN_ERRORS`] errors are shown.
//!
//! Entry points: [`parse_spec`] (text), [`parse_spec_bytes`] (bytes, UTF-8 checked),
//! [`load_spec`] (a file); [`check_spec`] and [`load_spec_with`] also apply command-line
//! overrides (`--set block.key=value`) and return the compiler's notes. Render a
//! [`SpecErrors`] with any miette report handler.
#![deny(missing_docs)]

pub mod ast;
mod check;
pub mod diagnostics;
mod files;
mod lex;
mod lower;
mod overrides;
pub mod parser;

use std::path::Path;

use ir::config::Config;

use crate::ast::Span;
pub use crate::diagnostics::{SpecError, SpecErrors};

/// The largest spec accepted, in bytes (1 MiB; real specs are a few KiB).
pub const MAX_SPEC_BYTES: usize = 1 << 20;
/// A file with more invalid UTF-8 sequences than this (or any NUL byte) is not a text spec.
const MAX_INVALID_UTF8: usize = 8;

/// A checked spec: the run configuration, and notes for the user that are not errors (the
/// files a corpus directory or pattern skipped because they are not UTF-8 text).
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    /// The validated run configuration.
    pub config: Config,
    /// One line each, to print before compiling.
    pub notes: Vec<String>,
}

/// Parses and checks the spec text `source`, named `name` in diagnostics (usually the file
/// name); relative corpus paths are resolved against `base_dir`. `Config::name` is the stem of
/// `name` (`tiny.asteria` → `tiny`).
///
/// # Errors
/// Every syntax and semantic error of the file, at once (at most
/// [`diagnostics::MAX_SHOWN_ERRORS`] shown); a single error for text that is no spec at all
/// (JSON, such as a plan; more than [`MAX_SPEC_BYTES`]).
pub fn parse_spec(name: &str, source: &str, base_dir: &Path) -> Result<Config, SpecErrors> {
    check_spec(name, source, base_dir, &[]).map(|c| c.config)
}

/// [`parse_spec`] with command-line `overrides`, each `block.key=value` (`train.seed=7`,
/// `optimizer.lr=3e-4`, `data.corpus="books/*.md"`), applied in order (a later one wins) to
/// the parsed spec before it is checked: an overridden key is checked like the spec's own
/// (unknown keys, types, ranges, cross-block rules) and an error about it points at its
/// `--set` argument (shown as `command line`, the message naming the argument). An override
/// replaces the key's entry in its block or adds it; a missing `target` block is added as
/// `target cpu { }`. The value is spec syntax; one that does not parse but cannot be a number,
/// tuple or list is a string (a shell strips the quotes of `data.corpus="a b.txt"`). Relative
/// paths are resolved against `base_dir`, as in the spec.
///
/// # Errors
/// As [`parse_spec`], plus malformed arguments (no `=`, no `block.key`, an unknown block, a
/// block the spec lacks).
pub fn check_spec(
    name: &str,
    source: &str,
    base_dir: &Path,
    overrides: &[String],
) -> Result<Checked, SpecErrors> {
    if let Some(e) = not_a_spec(name, source) {
        return Err(SpecErrors::new(name, source.to_string(), vec![e]));
    }
    let (mut spec, mut errors) = parser::parse(source);
    if spec.blocks.is_empty() && errors.is_empty() {
        errors.push(
            SpecError::new(
                "spec::empty",
                Span::new(0, 0),
                "the spec file is empty",
                "nothing here",
            )
            .with_help(
                "a spec has `model`, `optimizer`, `data` and `train` blocks \
                 (and optionally `target`); see examples/tiny.asteria",
            ),
        );
    }
    let stopped = errors.iter().any(|e| e.code == diagnostics::STOPPED);
    if !errors.is_empty() && (spec.blocks.is_empty() || stopped) {
        return Err(SpecErrors::new(name, source.to_string(), errors));
    }
    let (text, start) = overrides::with_overrides(source, overrides);
    overrides::apply(&mut spec, &text, start, overrides, &mut errors);
    let mut checker = check::Checker {
        errors,
        notes: Vec::new(),
    };
    let config = lower::lower(&spec, &run_name(name), base_dir, &mut checker);
    match config {
        Some(config) if checker.errors.is_empty() => Ok(Checked {
            config,
            notes: checker.notes,
        }),
        _ => Err(SpecErrors::with_overrides(
            name,
            text,
            checker.errors,
            start,
        )),
    }
}

/// Like [`parse_spec`] for raw bytes: binary data (a NUL byte, or more than a few invalid
/// UTF-8 sequences) is one "not a text spec" error; otherwise each invalid sequence is
/// reported with its byte offset, line and column.
///
/// # Errors
/// Binary data, invalid UTF-8, or every syntax and semantic error of the file.
pub fn parse_spec_bytes(name: &str, bytes: &[u8], base_dir: &Path) -> Result<Config, SpecErrors> {
    check_spec_bytes(name, bytes, base_dir, &[]).map(|c| c.config)
}

/// [`parse_spec_bytes`] with command-line overrides, as [`check_spec`].
fn check_spec_bytes(
    name: &str,
    bytes: &[u8],
    base_dir: &Path,
    overrides: &[String],
) -> Result<Checked, SpecErrors> {
    if let Some(e) = not_text(name, bytes) {
        return Err(SpecErrors::new(name, String::new(), vec![e]));
    }
    if bytes.len() > MAX_SPEC_BYTES {
        return Err(SpecErrors::new(name, String::new(), vec![too_large(name)]));
    }
    match std::str::from_utf8(bytes) {
        Ok(source) => check_spec(name, source, base_dir, overrides),
        Err(_) => {
            let (text, errors) = decode_lossy(bytes);
            Err(SpecErrors::new(name, text, errors))
        }
    }
}

/// Reads the spec file at `path` (at most [`MAX_SPEC_BYTES`] of it) and parses it with
/// [`parse_spec_bytes`]; corpus paths are resolved against the file's folder and the
/// diagnostics name the file as given.
///
/// # Errors
/// The file cannot be read, is empty, binary, too large or not UTF-8, or has syntax or semantic
/// errors.
pub fn load_spec(path: &Path) -> Result<Config, SpecErrors> {
    load_spec_with(path, &[]).map(|c| c.config)
}

/// [`load_spec`] with command-line `overrides` (`block.key=value`, see [`check_spec`]); also
/// returns the compiler's notes.
///
/// # Errors
/// As [`load_spec`] and [`check_spec`].
pub fn load_spec_with(path: &Path, overrides: &[String]) -> Result<Checked, SpecErrors> {
    use std::io::Read;
    let name = path.display().to_string();
    let base_dir = path.parent().unwrap_or_else(|| Path::new(""));
    let mut bytes = Vec::new();
    let read = std::fs::File::open(path).and_then(|f| {
        f.take(MAX_SPEC_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map(|_| ())
    });
    match read {
        Ok(()) => check_spec_bytes(&name, &bytes, base_dir, overrides),
        Err(e) => {
            let err = SpecError::new(
                "spec::unreadable",
                Span::new(0, 0),
                format!("cannot read spec file `{name}`: {e}"),
                "",
            );
            Err(SpecErrors::new(&name, String::new(), vec![err]))
        }
    }
}

/// The "not a text spec" error for binary `bytes` (a NUL byte, or more than
/// [`MAX_INVALID_UTF8`] invalid UTF-8 sequences), if they are.
fn not_text(name: &str, bytes: &[u8]) -> Option<SpecError> {
    let why = if let Some(at) = bytes.iter().position(|&b| b == 0) {
        format!("it holds a NUL byte at byte offset {at}")
    } else {
        let (mut invalid, mut first, mut offset) = (0usize, 0usize, 0usize);
        for chunk in bytes.utf8_chunks() {
            offset += chunk.valid().len();
            if !chunk.invalid().is_empty() {
                if invalid == 0 {
                    first = offset;
                }
                invalid += 1;
            }
            offset += chunk.invalid().len();
        }
        if invalid <= MAX_INVALID_UTF8 {
            return None;
        }
        format!("it holds {invalid} invalid UTF-8 sequences, the first at byte offset {first}")
    };
    Some(
        SpecError::new(
            "spec::not-text",
            Span::new(0, 0),
            format!("`{name}` is not a text spec: {why}"),
            "binary data",
        )
        .with_help(
            "a spec is a UTF-8 text file such as examples/tiny.asteria; \
             a compiled plan runs with `asteria run PLAN.json`",
        ),
    )
}

/// The one error for text that is no spec at all: JSON (a compiled plan, or other JSON), or
/// more than [`MAX_SPEC_BYTES`].
fn not_a_spec(name: &str, source: &str) -> Option<SpecError> {
    let body = source.trim_start_matches(|c: char| c.is_whitespace() || c == '\u{feff}');
    let at = source.len() - body.len();
    if body.starts_with(['{', '[']) {
        let span = Span::new(at, at + 1);
        let plan = body.starts_with('{') && source.contains(&format!("\"{}\"", ir::PLAN_FORMAT));
        return Some(if plan {
            SpecError::new(
                "spec::is-a-plan",
                span,
                format!("`{name}` is a compiled asteria plan, not a spec"),
                "a plan (JSON)",
            )
            .with_help(format!("run it with `asteria run {name}`"))
        } else {
            SpecError::new(
                "spec::is-json",
                span,
                format!("`{name}` is JSON, not a spec"),
                "JSON",
            )
            .with_help(
                "a spec is a list of blocks such as `model gpt2 { ... }`; \
                 see examples/tiny.asteria",
            )
        });
    }
    (source.len() > MAX_SPEC_BYTES).then(|| too_large(name))
}

/// "`name` is too large for a spec".
fn too_large(name: &str) -> SpecError {
    SpecError::new(
        "spec::too-large",
        Span::new(0, 0),
        format!("`{name}` is too large for a spec: more than {MAX_SPEC_BYTES} bytes (specs are a few KiB)"),
        "too large",
    )
    .with_help("is this the right file? see examples/tiny.asteria")
}

/// The run name for a spec named `name`: its file stem.
fn run_name(name: &str) -> String {
    Path::new(name)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| name.to_string())
}

/// Decodes `bytes` replacing each invalid sequence with U+FFFD; one error per run of adjacent
/// invalid sequences, spanning its replacement characters and giving the original byte offset.
fn decode_lossy(bytes: &[u8]) -> (String, Vec<SpecError>) {
    let mut text = String::with_capacity(bytes.len());
    let mut errors = Vec::new();
    // The pending run of invalid bytes: (offset in `bytes`, offset in `text`, the bytes).
    let mut run: Option<(usize, usize, Vec<u8>)> = None;
    let mut byte_offset = 0;
    for chunk in bytes.utf8_chunks() {
        if !chunk.valid().is_empty() {
            if let Some(r) = run.take() {
                errors.push(not_utf8(&text, r));
            }
            text.push_str(chunk.valid());
            byte_offset += chunk.valid().len();
        }
        let bad = chunk.invalid();
        if !bad.is_empty() {
            let r = run.get_or_insert_with(|| (byte_offset, text.len(), Vec::new()));
            r.2.extend_from_slice(bad);
            text.push(char::REPLACEMENT_CHARACTER);
            byte_offset += bad.len();
        }
    }
    if let Some(r) = run.take() {
        errors.push(not_utf8(&text, r));
    }
    (text, errors)
}

/// The error for one run of invalid bytes (see [`decode_lossy`]).
fn not_utf8(text: &str, (byte_offset, start, bad): (usize, usize, Vec<u8>)) -> SpecError {
    let (line, col) = diagnostics::line_col(text, start);
    let hex: Vec<String> = bad.iter().map(|b| format!("{b:#04x}")).collect();
    let plural = if bad.len() == 1 { "" } else { "s" };
    SpecError::new(
        "spec::not-utf8",
        Span::new(start, text.len()),
        format!("invalid UTF-8 at byte offset {byte_offset} (line {line}, column {col})"),
        format!("invalid byte{plural} {}", hex.join(" ")),
    )
    .with_help("spec files must be UTF-8 text")
}
