//! `--set block.key=value` overrides from the command line, applied to the syntax tree before
//! it is checked, so an overridden key goes through exactly the checks of a key written in the
//! spec (type, range, cross-block rules) and lands in the plan like one.
//!
//! The arguments are appended to the spec's text as lines `--set ARG` after its end (see
//! [`with_overrides`]); their values are parsed there with the spec's own value parser, so every
//! span points into that text and a diagnostic about an override shows the `--set` argument
//! (named `command line`) instead of a spec line.

use crate::ast::{Block, Entry, Ident, Span, Spec, Value, ValueKind};
use crate::diagnostics::{did_you_mean, SpecError};
use crate::lex::{advance, found, off, token_span, value, ws_inline, Input};
use crate::lower::BLOCKS;

/// How each override line starts in the combined text.
pub const PREFIX: &str = "--set ";

/// The spec's text followed by one line `--set ARG` per override (line breaks inside an
/// argument replaced by spaces), and the byte offset where the first of those lines starts.
pub fn with_overrides(source: &str, overrides: &[String]) -> (String, usize) {
    let mut text = source.to_string();
    if overrides.is_empty() {
        return (text, source.len());
    }
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    let start = text.len();
    for arg in overrides {
        text.push_str(PREFIX);
        text.push_str(&arg.replace(['\n', '\r'], " "));
        text.push('\n');
    }
    (text, start)
}

/// Applies `overrides` (as laid out by [`with_overrides`] in `text` from `start`) to `spec`:
/// each replaces the first entry of its key in its block, or adds the entry. A missing
/// `target` block is added as `target cpu { }` (the default target); other missing blocks, and
/// malformed arguments, are errors on the argument.
pub fn apply(
    spec: &mut Spec,
    text: &str,
    start: usize,
    overrides: &[String],
    errors: &mut Vec<SpecError>,
) {
    let mut line = start;
    for arg in overrides {
        let at = line + PREFIX.len();
        let shown = arg.replace(['\n', '\r'], " ");
        line = at + shown.len() + 1;
        if arg.contains(['\n', '\r']) {
            errors.push(bad(at, &shown, "a `--set` argument is one line"));
            continue;
        }
        match parse_one(text, at, &shown) {
            Ok((block, key, value)) => set(spec, block, key, value, errors),
            Err(e) => errors.push(*e),
        }
    }
}

/// A malformed argument (`message`), spanning the argument at `at`.
fn bad(at: usize, arg: &str, message: &str) -> SpecError {
    SpecError::new(
        "spec::bad-override",
        Span::new(at, at + arg.len()),
        message.to_string(),
        "expected `block.key=value`",
    )
    .with_help(
        "write `--set block.key=value`, e.g. `--set train.seed=7` or `--set optimizer.lr=3e-4`",
    )
}

/// Splits `arg` (at byte `at` of `text`) into its block, key and parsed value.
fn parse_one(text: &str, at: usize, arg: &str) -> Result<(Ident, Ident, Value), Box<SpecError>> {
    let Some(eq) = arg.find('=') else {
        return Err(Box::new(bad(
            at,
            arg,
            "expected `block.key=value`, found no `=`",
        )));
    };
    let lhs = &arg[..eq];
    let lead = lhs.len() - lhs.trim_start().len();
    let Some((b, k)) = lhs.trim().split_once('.') else {
        return Err(Box::new(bad(at, arg, "expected `block.key` before `=`")));
    };
    let word = |s: &str| {
        s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    if !word(b) || !word(k) {
        return Err(Box::new(bad(
            at,
            arg,
            "expected `block.key` before `=` (names of letters, digits and `_`)",
        )));
    }
    let b_at = at + lead;
    let k_at = b_at + b.len() + 1;
    let block = Ident {
        name: b.to_string(),
        span: Span::new(b_at, b_at + b.len()),
    };
    let key = Ident {
        name: k.to_string(),
        span: Span::new(k_at, k_at + k.len()),
    };
    if !BLOCKS.contains(&b) {
        return Err(Box::new(
            SpecError::new(
                "spec::unknown-block",
                block.span,
                format!("unknown block `{b}`"),
                "unknown block",
            )
            .with_help(did_you_mean(b, BLOCKS)),
        ));
    }
    let eq_at = at + eq;
    let v = ws_inline(advance(&Input::new(text), eq_at + 1));
    if v.fragment().is_empty() || v.fragment().starts_with('\n') {
        return Err(Box::new(
            SpecError::new(
                "spec::missing-value",
                Span::new(eq_at, eq_at + 1),
                format!("missing value for `{b}.{k}`"),
                "expected a value after `=`",
            )
            .with_help(format!("write `--set {b}.{k}=VALUE`")),
        ));
    }
    // The value text, up to the end of the argument's line (trailing spaces left out).
    let rest = v.fragment();
    let raw = rest[..rest.find('\n').unwrap_or(rest.len())].trim_end();
    let raw_span = Span::new(off(&v), off(&v) + raw.len());
    // A shell strips the quotes of `--set data.corpus="books/*.md"`: a value that does not
    // parse as a whole but cannot be a number, tuple or list is taken as a string.
    let as_string = || Value {
        kind: ValueKind::Str(raw.to_string()),
        span: raw_span,
    };
    let structured =
        raw.starts_with(|c: char| c.is_ascii_digit() || matches!(c, '+' | '-' | '"' | '(' | '['));
    match value(v, 0) {
        Ok((after, parsed)) => {
            let after = ws_inline(after);
            if after.fragment().is_empty() || after.fragment().starts_with('\n') {
                Ok((block, key, parsed))
            } else if !structured {
                Ok((block, key, as_string()))
            } else {
                Err(Box::new(SpecError::new(
                    "spec::syntax",
                    token_span(&after),
                    format!("unexpected {} after the value", found(&after)),
                    "unexpected here",
                )))
            }
        }
        Err(_) if !structured => Ok((block, key, as_string())),
        Err(nom::Err::Error(e) | nom::Err::Failure(e)) => Err(e.error),
        Err(nom::Err::Incomplete(_)) => Err(Box::new(bad(at, arg, "incomplete value"))),
    }
}

/// Sets `block.key = value` in `spec`.
fn set(spec: &mut Spec, block: Ident, key: Ident, value: Value, errors: &mut Vec<SpecError>) {
    let found = spec.blocks.iter().position(|b| b.kind.name == block.name);
    let b = match found {
        Some(i) => &mut spec.blocks[i],
        None if block.name == "target" => {
            spec.blocks.push(Block {
                kind: block.clone(),
                name: Some(Ident {
                    name: "cpu".into(),
                    span: block.span,
                }),
                entries: Vec::new(),
                header: block.span,
                broken: false,
            });
            spec.blocks.last_mut().expect("just pushed")
        }
        None => {
            errors.push(
                SpecError::new(
                    "spec::override-no-block",
                    block.span,
                    format!("the spec has no `{}` block", block.name),
                    "no such block in the spec",
                )
                .with_help(format!("add a `{}` block to the spec", block.name)),
            );
            return;
        }
    };
    let entry = Entry { key, value };
    match b.entries.iter_mut().find(|e| e.key.name == entry.key.name) {
        Some(e) => *e = entry,
        None => b.entries.push(entry),
    }
}
