//! The spec file's syntax tree: blocks of `key = value` entries, every node with its byte span.
//!
//! The tree is what the parser produced, before any semantic check: keys may be unknown,
//! duplicated or of the wrong type. [`crate::parse_spec`] checks it and produces an
//! `ir::config::Config`.

use miette::SourceSpan;

/// A half-open byte range `start..end` into the spec's source text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Span {
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
}

impl Span {
    /// The span `start..end`.
    pub fn new(start: usize, end: usize) -> Self {
        Span { start, end }
    }

    /// The smallest span that covers `self` and `other`.
    pub fn to(self, other: Span) -> Span {
        Span::new(self.start.min(other.start), self.end.max(other.end))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }

    /// Whether the span covers no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<Span> for SourceSpan {
    fn from(s: Span) -> SourceSpan {
        SourceSpan::new(s.start.into(), s.len())
    }
}

/// An identifier (`[A-Za-z_][A-Za-z0-9_]*`) with its span.
#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    /// The text.
    pub name: String,
    /// Where it is.
    pub span: Span,
}

/// A literal value on the right of `=`.
#[derive(Clone, Debug, PartialEq)]
pub enum ValueKind {
    /// An integer literal (`50_257`, `-3`).
    Int(i128),
    /// A float literal (`3e-3`, `0.95`); always finite.
    Float(f64),
    /// A size with a unit (`24GiB`, `512MiB`, `1.5TB`, `4096B`), in bytes (rounded down).
    Size(u128),
    /// `true` / `false`.
    Bool(bool),
    /// `none`.
    None,
    /// A bare identifier (`gpt2`, `builtin`).
    Ident(String),
    /// A double-quoted string, escapes resolved.
    Str(String),
    /// `(a, b, ...)`.
    Tuple(Vec<Value>),
    /// `[a, b, ...]`.
    List(Vec<Value>),
}

/// A value with its span.
#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    /// What it is.
    pub kind: ValueKind,
    /// Where it is.
    pub span: Span,
}

impl Value {
    /// How the value's type is named in diagnostics ("an integer", "a string", ...).
    pub fn describe(&self) -> String {
        match &self.kind {
            ValueKind::Int(_) => "an integer".into(),
            ValueKind::Float(_) => "a float".into(),
            ValueKind::Size(_) => "a size".into(),
            ValueKind::Bool(_) => "a boolean".into(),
            ValueKind::None => "`none`".into(),
            ValueKind::Ident(name) => format!("the name `{name}`"),
            ValueKind::Str(_) => "a string".into(),
            ValueKind::Tuple(_) => "a tuple".into(),
            ValueKind::List(_) => "a list".into(),
        }
    }
}

/// One `key = value` entry of a block.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The key.
    pub key: Ident,
    /// The value.
    pub value: Value,
}

/// A block: `kind [name] { entries }`, e.g. `model gpt2 { ... }` or `data { ... }`.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    /// The block keyword (`model`, `optimizer`, `data`, `train`, `target`).
    pub kind: Ident,
    /// The optional name after the keyword (`gpt2`, `soap`, `cuda`).
    pub name: Option<Ident>,
    /// The entries, in source order (duplicates kept).
    pub entries: Vec<Entry>,
    /// The header, from the keyword to the name (or the keyword alone).
    pub header: Span,
    /// The block had a syntax error (entries may be missing): checks that would only repeat
    /// it, such as "missing required key", are skipped.
    pub broken: bool,
}

/// A whole spec file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Spec {
    /// The blocks, in source order (duplicates and unknown kinds kept).
    pub blocks: Vec<Block>,
}
