//! Spec diagnostics: one [`SpecError`] per problem, gathered into a [`SpecErrors`] that carries
//! the source text, so that miette can underline every span with the file name and line:column.

use std::fmt;

use miette::{Diagnostic, LabeledSpan, NamedSource, SourceCode};

use crate::ast::Span;

/// One syntax or semantic error in a spec file.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct SpecError {
    /// Stable machine-readable code, e.g. `spec::unknown-key`.
    pub code: &'static str,
    /// One-line message.
    pub message: String,
    /// The primary span (underlined).
    pub span: Span,
    /// Text printed under the primary span.
    pub label: String,
    /// Secondary spans with their labels (e.g. "first set here").
    pub notes: Vec<(Span, String)>,
    /// A hint, e.g. "did you mean `lr`?".
    pub help: Option<String>,
}

impl SpecError {
    /// A new error with `code`, `message`, and the primary `span` labelled `label`.
    pub fn new(
        code: &'static str,
        span: Span,
        message: impl Into<String>,
        label: impl Into<String>,
    ) -> Self {
        SpecError {
            code,
            message: message.into(),
            span,
            label: label.into(),
            notes: Vec::new(),
            help: None,
        }
    }

    /// Adds a hint.
    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    /// Adds a hint when there is one.
    pub fn with_help_opt(mut self, help: Option<String>) -> Self {
        self.help = help;
        self
    }

    /// Adds a secondary labelled span.
    pub fn with_note(mut self, span: Span, label: impl Into<String>) -> Self {
        self.notes.push((span, label.into()));
        self
    }
}

impl Diagnostic for SpecError {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        Some(Box::new(self.code))
    }

    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.help
            .as_ref()
            .map(|h| Box::new(h) as Box<dyn fmt::Display + 'a>)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        let primary = LabeledSpan::new_primary_with_span(Some(self.label.clone()), self.span);
        let notes = self
            .notes
            .iter()
            .map(|(span, label)| LabeledSpan::new_with_span(Some(label.clone()), *span));
        Some(Box::new(std::iter::once(primary).chain(notes)))
    }
}

/// Every error found in one spec file, with the file's name and text.
///
/// As a [`Diagnostic`] it renders a one-line summary followed by each error as `related`, each
/// with its span underlined in the source.
#[derive(Debug)]
pub struct SpecErrors {
    src: NamedSource<String>,
    errors: Vec<SpecError>,
}

impl SpecErrors {
    /// Wraps `errors` (in source order after sorting) found in `source`, named `name`.
    pub fn new(name: &str, source: String, mut errors: Vec<SpecError>) -> Self {
        errors.sort_by_key(|e| (e.span.start, e.span.end));
        SpecErrors {
            src: NamedSource::new(name, source),
            errors,
        }
    }

    /// The errors, in source order.
    pub fn errors(&self) -> &[SpecError] {
        &self.errors
    }

    /// The file's name, as given to the parser.
    pub fn name(&self) -> &str {
        self.src.name()
    }

    /// The source text the spans point into (after lossy decoding for non-UTF-8 files).
    pub fn source_text(&self) -> &str {
        self.src.inner()
    }

    /// `(line, column, message)` of each error, 1-based, column counted in characters.
    pub fn items(&self) -> Vec<(usize, usize, String)> {
        self.errors
            .iter()
            .map(|e| {
                let (line, col) = line_col(self.source_text(), e.span.start);
                (line, col, e.message.clone())
            })
            .collect()
    }
}

/// 1-based line and column (in characters) of byte `offset` in `src` (clamped to its length).
pub fn line_col(src: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(src.len());
    while !src.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &src[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let col = before[line_start..].chars().count() + 1;
    (line, col)
}

impl fmt::Display for SpecErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.errors.len();
        let plural = if n == 1 { "" } else { "s" };
        write!(f, "{} has {n} error{plural}", self.src.name())
    }
}

impl std::error::Error for SpecErrors {}

impl Diagnostic for SpecErrors {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        Some(Box::new("spec::invalid"))
    }

    fn source_code(&self) -> Option<&dyn SourceCode> {
        Some(&self.src)
    }

    fn related<'a>(&'a self) -> Option<Box<dyn Iterator<Item = &'a dyn Diagnostic> + 'a>> {
        Some(Box::new(self.errors.iter().map(|e| e as &dyn Diagnostic)))
    }
}

/// Names that users coming from nanoGPT / PyTorch reach for, and the key asteria uses.
const ALIASES: &[(&str, &str)] = &[
    ("learning_rate", "lr"),
    ("n_layer", "layers"),
    ("n_layers", "layers"),
    ("num_layers", "layers"),
    ("n_head", "heads"),
    ("n_heads", "heads"),
    ("num_heads", "heads"),
    ("n_embd", "d_model"),
    ("hidden_size", "d_model"),
    ("vocab_size", "vocab"),
    ("block_size", "context"),
    ("context_length", "context"),
    ("max_seq_len", "context"),
    ("warmup_steps", "warmup"),
    ("max_steps", "steps"),
    ("max_iters", "steps"),
    ("beta1", "betas"),
    ("beta2", "betas"),
    ("batch", "batch_size"),
    ("training", "train"),
    ("optim", "optimizer"),
    ("device", "target"),
];

/// The candidate closest to `word` (an alias, or within a small edit distance), if any.
pub fn suggest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let lower = word.to_ascii_lowercase();
    if let Some(c) = candidates.iter().find(|c| **c == lower) {
        return Some(c);
    }
    for (alias, target) in ALIASES {
        if *alias == lower {
            if let Some(c) = candidates.iter().find(|c| *c == target) {
                return Some(c);
            }
        }
    }
    let mut best: Option<(&'a str, usize)> = None;
    for c in candidates {
        let d = strsim::damerau_levenshtein(&lower, c);
        let limit = (c.len().max(lower.len()) / 3).max(1);
        if d <= limit && best.is_none_or(|(_, bd)| d < bd) {
            best = Some((c, d));
        }
    }
    best.map(|(c, _)| c)
}

/// "did you mean `X`?" for the closest candidate, or the list of candidates.
pub fn did_you_mean(word: &str, candidates: &[&str]) -> String {
    match suggest(word, candidates) {
        Some(c) => format!("did you mean `{c}`?"),
        None => format!("expected one of: {}", list(candidates)),
    }
}

/// `a`, `b`, `c` as a comma-separated list of backquoted names.
pub fn list(candidates: &[&str]) -> String {
    candidates
        .iter()
        .map(|c| format!("`{c}`"))
        .collect::<Vec<_>>()
        .join(", ")
}
