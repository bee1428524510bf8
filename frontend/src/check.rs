//! Semantic checking machinery: the keys of a block (unknown, duplicate, not valid here), and
//! typed getters that read an entry as an integer or a float in its range ([`ir::limits`]), a
//! boolean or a name, recording a diagnostic and falling back to a default on any error, so that every problem of
//! a file is reported in one run. The per-block rules are in [`crate::lower`].

use std::collections::HashMap;

use ir::limits::{self, FloatRange, IntRange};

use crate::ast::{Block, Entry, Span, Value, ValueKind};
use crate::diagnostics::{did_you_mean, suggest, SpecError};

/// Collects diagnostics while a spec is checked.
#[derive(Default)]
pub struct Checker {
    /// Every error found so far.
    pub errors: Vec<SpecError>,
    /// Notes for the user that are not errors (files a corpus directory skipped).
    pub notes: Vec<String>,
}

/// The entries of one block, by key, after the unknown / duplicate key checks.
pub struct Fields<'a> {
    /// How the block is named in messages, e.g. `model gpt2`.
    pub what: String,
    /// The block header's span (missing keys point here).
    pub header: Span,
    /// Whether the block had syntax errors (then missing keys are not reported).
    pub broken: bool,
    entries: HashMap<&'a str, &'a Entry>,
}

impl<'a> Fields<'a> {
    /// The entry for `key`, if set.
    pub fn get(&self, key: &str) -> Option<&'a Entry> {
        self.entries.get(key).copied()
    }
}

impl Checker {
    /// Records `e`.
    pub fn push(&mut self, e: SpecError) {
        self.errors.push(e);
    }

    /// Indexes `block`'s entries; reports unknown keys (with a suggestion among `allowed`),
    /// keys in `foreign` (valid elsewhere: `(key, hint)`) and duplicate keys.
    pub fn fields<'a>(
        &mut self,
        block: &'a Block,
        what: &str,
        allowed: &[&str],
        foreign: &[(&str, &str)],
    ) -> Fields<'a> {
        let mut entries: HashMap<&'a str, &'a Entry> = HashMap::new();
        for e in &block.entries {
            let key = e.key.name.as_str();
            if !allowed.contains(&key) {
                let err = match foreign.iter().find(|(k, _)| *k == key) {
                    Some((_, hint)) => SpecError::new(
                        "spec::key-not-valid-here",
                        e.key.span,
                        format!("`{key}` is not valid for `{what}`"),
                        "not valid here",
                    )
                    .with_help(*hint),
                    None => SpecError::new(
                        "spec::unknown-key",
                        e.key.span,
                        format!("unknown key `{key}` in `{what}`"),
                        "unknown key",
                    )
                    .with_help(did_you_mean(key, allowed)),
                };
                self.push(err);
                continue;
            }
            if let Some(first) = entries.get(key) {
                self.push(
                    SpecError::new(
                        "spec::duplicate-key",
                        e.key.span,
                        format!("duplicate key `{key}` in `{what}`"),
                        "set again here",
                    )
                    .with_note(first.key.span, "first set here")
                    .with_help("remove one of the two entries"),
                );
                continue;
            }
            entries.insert(key, e);
        }
        Fields {
            what: what.to_string(),
            header: block.header,
            broken: block.broken,
            entries,
        }
    }

    /// Reports that required `key` is missing from `f` (unless the block is broken).
    pub fn missing(&mut self, f: &Fields, key: &str, example: &str) {
        if f.broken {
            return;
        }
        self.push(
            SpecError::new(
                "spec::missing-key",
                f.header,
                format!("missing required key `{key}` in `{}`", f.what),
                format!("`{key}` is not set in this block"),
            )
            .with_help(format!("add `{key} = {example}`")),
        );
    }

    /// A type mismatch: `key` wants `expected` but `v` is something else.
    pub fn wrong_type(&mut self, key: &str, v: &Value, expected: &str) {
        self.wrong_type_in(&format!("`{key}`"), v, expected);
    }

    /// [`Checker::wrong_type`] with the setting named by `what` (already quoted).
    fn wrong_type_in(&mut self, what: &str, v: &Value, expected: &str) {
        let mut e = SpecError::new(
            "spec::wrong-type",
            v.span,
            format!("expected {expected} for {what}, found {}", v.describe()),
            format!("expected {expected}"),
        );
        match &v.kind {
            ValueKind::Str(s) if s.trim().parse::<f64>().is_ok() => {
                e = e.with_help(format!("remove the quotes: `{}`", s.trim()));
            }
            ValueKind::Float(x) if expected.contains("integer") && x.fract() == 0.0 => {
                e = e.with_help(format!(
                    "write it as an integer: `{}`",
                    x.abs().min(1e30) as u128
                ));
            }
            _ => {}
        }
        self.push(e);
    }

    /// Reads `v` as an integer in `range` that fits `T`.
    pub fn uint_value<T: TryFrom<i128>>(
        &mut self,
        key: &str,
        v: &Value,
        range: IntRange,
    ) -> Option<T> {
        let ValueKind::Int(n) = v.kind else {
            self.wrong_type(key, v, "an integer");
            return None;
        };
        if !range.contains(n) {
            let label = if n < 0 {
                "negative"
            } else if n < i128::from(range.min) {
                "too small"
            } else {
                "too large"
            };
            self.push(out_of_range(&format!("`{key}`"), n, v.span, range, label));
            return None;
        }
        match T::try_from(n) {
            Ok(x) => Some(x),
            Err(_) => {
                self.push(out_of_range(
                    &format!("`{key}`"),
                    n,
                    v.span,
                    range,
                    "too large",
                ));
                None
            }
        }
    }

    /// Reads `v` as a size with a unit (`24GiB`) in `range` (bytes). A plain integer is refused
    /// with a hint to add the unit (a bare `24` is too easily meant as GiB).
    pub fn size_value(&mut self, key: &str, v: &Value, range: IntRange) -> Option<u64> {
        let n = match v.kind {
            ValueKind::Size(n) => n,
            ValueKind::Int(n) => {
                let mut e = SpecError::new(
                    "spec::wrong-type",
                    v.span,
                    format!(
                        "expected a size with a unit for `{key}`, found {}",
                        v.describe()
                    ),
                    "expected a size such as `24GiB`",
                );
                e = e.with_help(format!("write the unit: `{n}GiB`, `{n}MiB` or `{n}B`"));
                self.push(e);
                return None;
            }
            _ => {
                self.wrong_type(key, v, "a size such as `24GiB`");
                return None;
            }
        };
        if n > u128::from(u64::MAX) || !range.contains_u64(n as u64) {
            self.push(SpecError::new(
                "spec::out-of-range",
                v.span,
                format!(
                    "`{key}` = {} is outside the allowed range {}",
                    limits::human_size(n),
                    limits::Limit::Size(range)
                ),
                if n < u128::from(range.min) {
                    "too small"
                } else {
                    "too large"
                },
            ));
            return None;
        }
        Some(n as u64)
    }

    /// Required integer `key` in `range`.
    pub fn uint_req<T: TryFrom<i128>>(
        &mut self,
        f: &Fields,
        key: &str,
        range: IntRange,
    ) -> Option<T> {
        match f.get(key) {
            Some(e) => self.uint_value(key, &e.value, range),
            None => {
                self.missing(f, key, example(key));
                None
            }
        }
    }

    /// Optional integer `key` in `range`, `default` when absent or invalid.
    pub fn uint_or<T: TryFrom<i128>>(
        &mut self,
        f: &Fields,
        key: &str,
        range: IntRange,
        default: T,
    ) -> T {
        f.get(key)
            .and_then(|e| self.uint_value(key, &e.value, range))
            .unwrap_or(default)
    }

    /// Reads `v` (integer or float) as the float `key` in `range`.
    pub fn float_value(&mut self, key: &str, v: &Value, range: FloatRange) -> Option<f64> {
        self.float_in(&format!("`{key}`"), v, range)
    }

    /// [`Checker::float_value`] with the setting named by `what` (already quoted).
    pub fn float_in(&mut self, what: &str, v: &Value, range: FloatRange) -> Option<f64> {
        let x = match v.kind {
            ValueKind::Float(x) => x,
            ValueKind::Int(n) => n as f64,
            _ => {
                self.wrong_type_in(what, v, "a number");
                return None;
            }
        };
        if !range.contains(x) {
            let label = if x > range.max || (x == range.max && !range.max_closed) {
                "too large"
            } else {
                "too small"
            };
            self.push(out_of_range(what, x, v.span, range, label));
            return None;
        }
        Some(x)
    }

    /// Optional float `key` in `range`, `default` when absent or invalid.
    pub fn float_or(&mut self, f: &Fields, key: &str, range: FloatRange, default: f64) -> f64 {
        f.get(key)
            .and_then(|e| self.float_value(key, &e.value, range))
            .unwrap_or(default)
    }

    /// Optional boolean `key`, `default` when absent or invalid.
    pub fn bool_or(&mut self, f: &Fields, key: &str, default: bool) -> bool {
        let Some(e) = f.get(key) else {
            return default;
        };
        match e.value.kind {
            ValueKind::Bool(b) => b,
            _ => {
                self.wrong_type(key, &e.value, "`true` or `false`");
                default
            }
        }
    }

    /// Reads `v` as one of the names in `choices`; `what` names the category ("tokenizer").
    pub fn name_value<'c>(
        &mut self,
        key: &str,
        v: &Value,
        what: &str,
        choices: &[&'c str],
    ) -> Option<&'c str> {
        match &v.kind {
            ValueKind::Ident(name) => match choices.iter().find(|c| **c == name.as_str()) {
                Some(c) => Some(c),
                None => {
                    self.push(unknown_name(what, name, v.span, choices));
                    None
                }
            },
            ValueKind::Str(s) if choices.contains(&s.as_str()) => {
                self.push(
                    SpecError::new(
                        "spec::wrong-type",
                        v.span,
                        format!("expected a {what} name for `{key}`, found a string"),
                        "a string, not a name",
                    )
                    .with_help(format!("write it without quotes: `{s}`")),
                );
                None
            }
            _ => {
                self.wrong_type(key, v, &format!("a {what} name"));
                None
            }
        }
    }
}

/// "`d_model` = 100000 is outside the allowed range 1..=65_536", at the value, labelled `label`
/// ("too large"); the wording of [`ir::limits`]' plan-verifier errors.
fn out_of_range(
    what: &str,
    x: impl std::fmt::Display,
    span: Span,
    range: impl std::fmt::Display,
    label: &str,
) -> SpecError {
    SpecError::new(
        "spec::out-of-range",
        span,
        format!("{what} = {x} is outside the allowed range {range}"),
        label,
    )
}

/// "unknown tokenizer `gtp2`" with a suggestion among `choices`.
pub fn unknown_name(what: &str, name: &str, span: Span, choices: &[&str]) -> SpecError {
    let help = match suggest(name, choices) {
        Some(c) => format!("did you mean `{c}`?"),
        None => format!("supported: {}", crate::diagnostics::list(choices)),
    };
    SpecError::new(
        "spec::unknown-name",
        span,
        format!("unknown {what} `{name}`"),
        format!("unknown {what}"),
    )
    .with_help(help)
}

/// An example value for a required key, shown in "add `key = ...`" hints.
fn example(key: &str) -> &'static str {
    match key {
        "vocab" => "50257",
        "context" | "seq_len" => "1024",
        "d_model" => "768",
        "layers" | "heads" => "12",
        "batch_size" => "16",
        "steps" => "1000",
        _ => "...",
    }
}
