//! Spec diagnostics: one [`SpecError`] per problem, gathered into a [`SpecErrors`] that carries
//! the source text, so that miette can underline every span with the file name and line:column.

use std::fmt;

use miette::{
    Diagnostic, LabeledSpan, MietteError, MietteSpanContents, SourceCode, SourceSpan, SpanContents,
};

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
        // An error about the file as a whole (it cannot be read) points at no text.
        if self.label.is_empty() && self.span.is_empty() && self.notes.is_empty() {
            return None;
        }
        let primary = LabeledSpan::new_primary_with_span(Some(self.label.clone()), self.span);
        let notes = self
            .notes
            .iter()
            .map(|(span, label)| LabeledSpan::new_with_span(Some(label.clone()), *span));
        Some(Box::new(std::iter::once(primary).chain(notes)))
    }
}

/// At most this many errors of a file are shown; the rest are counted in a last entry
/// ("… and 950 more errors").
pub const MAX_SHOWN_ERRORS: usize = 50;
/// Messages, labels and hints are cut to this many bytes (they quote words of the input).
const MAX_TEXT: usize = 300;
/// Underlines are cut to this many bytes.
const MAX_SPAN: usize = 80;

/// Every error found in one spec file, with the file's name and text.
///
/// As a [`Diagnostic`] it renders a one-line summary followed by each error as `related`, each
/// with its span underlined in the source. Output stays small on any input: at most
/// [`MAX_SHOWN_ERRORS`] errors, messages and underlines cut to a few hundred bytes, and a span
/// on a very long line shows only a window of that line.
#[derive(Debug)]
pub struct SpecErrors {
    src: SpecSource,
    errors: Vec<SpecError>,
    total: usize,
    stopped: bool,
}

impl SpecErrors {
    /// Wraps `errors` (in source order after sorting) found in `source`, named `name`; keeps
    /// the first [`MAX_SHOWN_ERRORS`] and a last entry counting the others.
    pub fn new(name: &str, source: String, errors: Vec<SpecError>) -> Self {
        let end = source.len();
        SpecErrors::with_overrides(name, source, errors, end)
    }

    /// [`SpecErrors::new`] for `text` = a spec followed, from byte `overrides`, by lines
    /// `--set ARG` (command-line overrides): an error whose span starts there is shown on its
    /// argument, named `command line`, and its message starts with "`--set ARG`: ".
    pub fn with_overrides(
        name: &str,
        source: String,
        mut errors: Vec<SpecError>,
        overrides: usize,
    ) -> Self {
        for e in &mut errors {
            if e.span.start >= overrides {
                if let Some(line) = override_line(&source, overrides, e.span.start) {
                    e.message = format!("`{}`: {}", line.text, e.message);
                }
            }
        }
        errors.sort_by_key(|e| (e.span.start, e.span.end));
        // The parser's "stopped after N syntax errors" goes last, wherever it points.
        let stop = errors
            .iter()
            .position(|e| e.code == STOPPED)
            .map(|i| errors.remove(i));
        let total = errors.len();
        if total > MAX_SHOWN_ERRORS || stop.is_some() {
            let hidden = total.saturating_sub(MAX_SHOWN_ERRORS);
            errors.truncate(MAX_SHOWN_ERRORS);
            let at = stop.as_ref().map_or_else(
                || errors.last().map_or(Span::new(0, 0), |e| e.span),
                |s| s.span,
            );
            let mut message = match hidden {
                0 => String::new(),
                1 => "… and 1 more error".to_string(),
                n => format!("… and {n} more errors"),
            };
            if let Some(s) = &stop {
                if !message.is_empty() {
                    message.push_str("; ");
                }
                message.push_str(&s.message);
            }
            errors.push(
                SpecError::new(STOPPED, at, message, "errors stop here").with_help(
                    "is this the right file? a spec is a short text file such as \
                     examples/tiny.asteria",
                ),
            );
        }
        for e in &mut errors {
            clip_error(e, &source, overrides);
        }
        SpecErrors {
            src: SpecSource {
                name: name.to_string(),
                text: source,
                overrides,
            },
            errors,
            total,
            stopped: stop.is_some(),
        }
    }

    /// The errors shown, in source order (at most [`MAX_SHOWN_ERRORS`], then one counting the
    /// rest).
    pub fn errors(&self) -> &[SpecError] {
        &self.errors
    }

    /// How many errors were found (when parsing stopped early: found before it stopped).
    pub fn total(&self) -> usize {
        self.total
    }

    /// The file's name, as given to the parser.
    pub fn name(&self) -> &str {
        &self.src.name
    }

    /// The source text the spans point into (after lossy decoding for non-UTF-8 files).
    pub fn source_text(&self) -> &str {
        &self.src.text
    }

    /// `(line, column, message)` of each error, 1-based, column counted in characters; an
    /// error in a `--set` argument has line 0 and its column in `--set ARG`.
    pub fn items(&self) -> Vec<(usize, usize, String)> {
        self.errors
            .iter()
            .map(|e| {
                let (line, col) =
                    match override_line(self.source_text(), self.src.overrides, e.span.start) {
                        Some(l) => {
                            let upto = l.text.get(..e.span.start - l.start).unwrap_or(l.text);
                            (0, upto.chars().count() + 1)
                        }
                        None => line_col(self.source_text(), e.span.start),
                    };
                (line, col, e.message.clone())
            })
            .collect()
    }

    /// Whether `e` (one of [`SpecErrors::errors`]) is about a `--set` argument.
    pub fn is_override(&self, e: &SpecError) -> bool {
        e.span.start >= self.src.overrides && self.src.overrides < self.src.text.len()
    }
}

/// Code of the parser's "stopped after N syntax errors" and of the entry counting hidden
/// errors.
pub(crate) const STOPPED: &str = "spec::too-many-errors";

/// Cuts `e`'s texts to [`MAX_TEXT`] bytes and its spans to [`MAX_SPAN`] bytes; a note whose
/// snippet would be long (more than [`MAX_CONTEXT`] bytes from the primary span, or across a
/// line longer than [`MAX_LINE`]) becomes a line of the hint (`first set here: line 3, column
/// 5`) instead of a label, so each error's snippet stays small.
fn clip_error(e: &mut SpecError, source: &str, overrides: usize) {
    clip_text(&mut e.message);
    clip_text(&mut e.label);
    if let Some(h) = &mut e.help {
        clip_text(h);
    }
    e.span = clip_span(e.span, source);
    let primary = e.span;
    let mut far = Vec::new();
    e.notes.retain_mut(|(span, label)| {
        *span = clip_span(*span, source);
        clip_text(label);
        // A note on a `--set` argument names the argument (its span is past the spec's text).
        if let Some(line) = override_line(source, overrides, span.start) {
            far.push(format!("{label}: `{}` on the command line", line.text));
            return false;
        }
        let near = near(source, primary, *span);
        if !near {
            let (line, col) = line_col(source, span.start);
            far.push(format!("{label}: line {line}, column {col}"));
        }
        near
    });
    if !far.is_empty() {
        let mut help = e.help.take().map(|h| h + "\n").unwrap_or_default();
        help.push_str(&far.join("\n"));
        e.help = Some(help);
    }
}

/// Lines longer than this are shown as windows (see [`SpecSource`]).
const MAX_LINE: usize = 1024;

/// Whether the snippet showing both `a` and `b` is small: at most [`MAX_CONTEXT`] bytes from
/// the start of the first's line to the end of the second's, with no line over [`MAX_LINE`].
fn near(source: &str, a: Span, b: Span) -> bool {
    let (lo, hi) = (a.start.min(b.start), a.end.max(b.end).min(source.len()));
    if hi - lo > MAX_CONTEXT || !source.is_char_boundary(lo) || !source.is_char_boundary(hi) {
        return false;
    }
    let brk = |c: char| c == '\n' || c == '\r';
    let start = source[..lo].rfind(brk).map_or(0, |k| k + 1);
    let end = source[hi..].find(brk).map_or(source.len(), |k| hi + k);
    end - start <= MAX_CONTEXT
        && source[start..end].lines().count() <= MAX_CONTEXT_LINES
        && source[start..end].split(brk).all(|l| l.len() <= MAX_LINE)
}

/// A note more than this many lines from its error (counting both) is a line of the hint:
/// the snippet would show every line between them (a `--set` argument's error and the spec
/// key it conflicts with are a whole spec apart).
const MAX_CONTEXT_LINES: usize = 8;

fn clip_text(s: &mut String) {
    if s.len() > MAX_TEXT {
        let mut end = MAX_TEXT;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
}

fn clip_span(span: Span, source: &str) -> Span {
    if span.end - span.start <= MAX_SPAN {
        return span;
    }
    let mut end = (span.start + MAX_SPAN).min(source.len());
    while !source.is_char_boundary(end) {
        end -= 1;
    }
    Span::new(span.start, end.max(span.start))
}

/// The spec text as miette reads it. A span whose context (the lines miette shows around it)
/// spans more than [`MAX_CONTEXT`] bytes is shown as a window of its own line instead, so a
/// huge one-line file does not print itself once per error.
#[derive(Debug)]
struct SpecSource {
    name: String,
    text: String,
    /// Where the `--set` lines start (the text's length when there are none).
    overrides: usize,
}

/// One `--set ARG` line of a spec's text (see [`SpecErrors::with_overrides`]).
struct OverrideLine<'a> {
    /// Its first byte.
    start: usize,
    /// Which override it is (0-based).
    index: usize,
    /// `--set ARG`, without the line break.
    text: &'a str,
}

/// The `--set` line holding byte `at` of `text`, whose override lines start at `overrides`.
fn override_line(text: &str, overrides: usize, at: usize) -> Option<OverrideLine<'_>> {
    if at < overrides || overrides >= text.len() || !text.is_char_boundary(at.min(text.len())) {
        return None;
    }
    let at = at.min(text.len() - 1);
    let start = text[overrides..at]
        .rfind('\n')
        .map_or(overrides, |k| overrides + k + 1);
    let end = text[start..].find('\n').map_or(text.len(), |k| start + k);
    Some(OverrideLine {
        start,
        index: text[overrides..start].matches('\n').count(),
        text: &text[start..end],
    })
}

/// Context up to this many bytes is shown whole.
const MAX_CONTEXT: usize = 4096;
/// Bytes shown on each side of a span on a long line.
const WINDOW: usize = 60;

impl SourceCode for SpecSource {
    fn read_span<'a>(
        &'a self,
        span: &SourceSpan,
        before: usize,
        after: usize,
    ) -> Result<Box<dyn SpanContents<'a> + 'a>, MietteError> {
        let text = self.text.as_str();
        if let Some(line) = override_line(text, self.overrides, span.offset()) {
            // A `--set` argument: its own one-line snippet, numbered by its position among
            // the arguments.
            return Ok(Box::new(MietteSpanContents::new_named(
                "command line".to_string(),
                line.text.as_bytes(),
                SourceSpan::new(line.start.into(), line.text.len()),
                line.index,
                0,
                1,
            )));
        }
        let floor = |mut k: usize| {
            k = k.min(text.len());
            while !text.is_char_boundary(k) {
                k -= 1;
            }
            k
        };
        let start = floor(span.offset());
        let end = floor(span.offset().saturating_add(span.len())).max(start);
        let brk = |c: char| c == '\n' || c == '\r';
        // The first byte of the line `n` lines before `start`'s, and the end of the line `n`
        // lines after `end`'s.
        let mut lo = start;
        for _ in 0..=before {
            lo = text[..lo].rfind(brk).unwrap_or(0);
        }
        let mut hi = end;
        for _ in 0..=after {
            hi = text[hi..].find(brk).map_or(text.len(), |k| hi + k + 1);
        }
        let name = self.name.clone();
        if hi - lo <= MAX_CONTEXT {
            let inner = text.read_span(span, before, after)?;
            return Ok(Box::new(MietteSpanContents::new_named(
                name,
                inner.data(),
                *inner.span(),
                inner.line(),
                inner.column(),
                inner.line_count(),
            )));
        }
        // A window of the first line around the span's start (labels further on, e.g. a
        // note at the end of the file, are left out).
        let line_start = text[..start].rfind(brk).map_or(0, |k| k + 1);
        let line_end = text[start..].find(brk).map_or(text.len(), |k| start + k);
        let mut ws = start.saturating_sub(WINDOW).max(line_start);
        while !text.is_char_boundary(ws) {
            ws -= 1;
        }
        let mut we = (end.min(start + MAX_SPAN) + WINDOW)
            .min(line_end)
            .max(start);
        while !text.is_char_boundary(we) {
            we += 1;
        }
        let line = text[..line_start]
            .char_indices()
            .filter(|&(k, c)| c == '\n' || (c == '\r' && !text[k + 1..].starts_with('\n')))
            .count();
        Ok(Box::new(MietteSpanContents::new_named(
            name,
            &text.as_bytes()[ws..we],
            SourceSpan::new(ws.into(), we - ws),
            line,
            ws - line_start,
            1,
        )))
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
        let n = self.total;
        let plural = if n == 1 { "" } else { "s" };
        let more = if self.stopped { "more than " } else { "" };
        write!(f, "{} has {more}{n} error{plural}", self.src.name)
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
    // Blocked SOAP's key before it took Distributed Shampoo's name.
    ("block_size", "max_preconditioner_dim"),
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

/// The candidate closest to `word` (an alias, or within a small edit distance), if any. Words
/// longer than 64 bytes get no suggestion (the edit distance is quadratic).
pub fn suggest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    if word.len() > 64 {
        return None;
    }
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
