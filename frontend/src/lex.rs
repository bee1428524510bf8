//! Token-level parsers (nom over `nom_locate` spans): whitespace and `#` comments, identifiers,
//! numbers, strings and values (with tuples and lists). Errors are [`PErr`]s that carry a finished
//! [`SpecError`] and where the block parser should resume.

use nom::branch::alt;
use nom::bytes::complete::{tag, take_till, take_while};
use nom::character::complete::{char, digit1, multispace1, one_of, satisfy, space0};
use nom::combinator::{opt, recognize};
use nom::error::{ErrorKind, ParseError};
use nom::multi::many0_count;
use nom::{IResult, Input as _, Parser};
use nom_locate::LocatedSpan;

use crate::ast::{Ident, Span, Value, ValueKind};
use crate::diagnostics::SpecError;

/// Parser input: the source with its byte offset.
pub type Input<'a> = LocatedSpan<&'a str>;

/// Tuples and lists nested deeper than this are rejected (keeps recursion bounded).
const MAX_DEPTH: usize = 32;

/// A parse error: the diagnostic, and the byte offset to resume at (`None`: skip the line).
#[derive(Debug)]
pub struct PErr {
    /// The diagnostic (boxed: parse results stay small).
    pub error: Box<SpecError>,
    /// Where to resume parsing entries.
    pub resume: Option<usize>,
}

impl PErr {
    /// An error to resume after by skipping the line.
    pub fn at(error: SpecError) -> Self {
        PErr {
            error: Box::new(error),
            resume: None,
        }
    }
}

impl<'a> ParseError<Input<'a>> for PErr {
    fn from_error_kind(input: Input<'a>, _kind: ErrorKind) -> Self {
        let at = input.location_offset();
        PErr::at(SpecError::new(
            "spec::syntax",
            token_span(&input),
            format!("unexpected {}", found(&input)),
            "unexpected here",
        ))
        .resume_at(at)
    }

    fn append(_input: Input<'a>, _kind: ErrorKind, other: Self) -> Self {
        other
    }
}

impl PErr {
    /// Resume parsing at byte offset `at`.
    pub fn resume_at(mut self, at: usize) -> Self {
        self.resume = Some(at);
        self
    }
}

/// Result of a token parser.
pub type PResult<'a, T> = IResult<Input<'a>, T, PErr>;

/// Byte offset of `i` in the source.
pub fn off(i: &Input) -> usize {
    i.location_offset()
}

/// `i` advanced by `n` bytes (`n` must be on a char boundary).
pub fn advance<'a>(i: &Input<'a>, n: usize) -> Input<'a> {
    i.take_from(n.min(i.fragment().len()))
}

/// Skips whitespace (newlines included) and `#` comments.
pub fn ws(i: Input) -> Input {
    let comment = recognize((char('#'), take_till(|c| c == '\n')));
    match many0_count(alt((multispace1::<_, PErr>, comment))).parse(i) {
        Ok((rest, _)) => rest,
        Err(_) => i,
    }
}

/// Skips spaces and tabs only.
pub fn ws_inline(i: Input) -> Input {
    match space0::<_, PErr>(i) {
        Ok((rest, _)) => rest,
        Err(_) => i,
    }
}

/// Whether `c` may start an identifier.
pub fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// An identifier `[A-Za-z_][A-Za-z0-9_]*`.
pub fn ident(i: Input) -> PResult<Ident> {
    let (rest, s) = recognize((satisfy(is_ident_start), take_while(is_word))).parse(i)?;
    let span = Span::new(off(&s), off(&rest));
    Ok((
        rest,
        Ident {
            name: s.fragment().to_string(),
            span,
        },
    ))
}

/// How the token at `i` is named in "found ..." messages.
pub fn found(i: &Input) -> String {
    let s = i.fragment();
    match s.chars().next() {
        None => "end of file".into(),
        Some('\n') | Some('\r') => "end of line".into(),
        Some(c) if is_word(c) => format!("`{}`", &s[..word_len(s)]),
        Some(c) if c.is_control() => format!("character U+{:04X}", c as u32),
        Some(c) => format!("`{c}`"),
    }
}

fn word_len(s: &str) -> usize {
    s.find(|c: char| !is_word(c)).unwrap_or(s.len())
}

/// The span of the token at `i`: a word, or one character (empty at end of file).
pub fn token_span(i: &Input) -> Span {
    let s = i.fragment();
    let start = off(i);
    let len = match s.chars().next() {
        None => 0,
        Some(c) if is_word(c) => word_len(s),
        Some(c) => c.len_utf8(),
    };
    Span::new(start, start + len)
}

/// Whether `i` is at the end of a line (or file, or before a comment / `}` / `;`).
pub fn at_line_end(i: &Input) -> bool {
    matches!(
        i.fragment().chars().next(),
        None | Some('\n') | Some('\r') | Some('#') | Some('}') | Some(';')
    )
}

/// Whether `i` starts a new `key =` entry (used to detect unterminated tuples and lists).
pub fn at_entry_start(i: Input) -> bool {
    match ident(i) {
        Ok((rest, _)) => {
            let rest = ws_inline(rest);
            rest.fragment().starts_with('=')
        }
        Err(_) => false,
    }
}

/// Units of size literals (`24GiB`): decimal (`KB` = 10³ bytes) and binary (`KiB` = 2¹⁰).
pub const SIZE_UNITS: &[(&str, u64)] = &[
    ("B", 1),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
];

/// A number: `[+-]digits[_digits][.digits][(e|E)[+-]digits]`; integers become `Int`; a number
/// directly followed by a unit of [`SIZE_UNITS`] is a `Size` in bytes.
fn number(i: Input) -> PResult<Value> {
    let digits =
        |i| recognize((digit1, take_while(|c: char| c.is_ascii_digit() || c == '_'))).parse(i);
    let (rest, text) = recognize((
        opt(one_of("+-")),
        digits,
        opt((char('.'), digits)),
        opt((one_of("eE"), opt(one_of("+-")), digit1)),
    ))
    .parse(i)?;
    let start = off(&i);
    let tail = rest.fragment();
    if let Some((unit, mult)) = SIZE_UNITS
        .iter()
        .filter(|(u, _)| {
            tail.starts_with(u) && !tail[u.len()..].starts_with(|c: char| is_word(c) || c == '.')
        })
        .max_by_key(|(u, _)| u.len())
    {
        let rest = advance(&rest, unit.len());
        let span = Span::new(start, off(&rest));
        let clean: String = text.fragment().chars().filter(|c| *c != '_').collect();
        let bytes = clean.parse::<f64>().ok().map(|x| x * *mult as f64);
        return match bytes {
            Some(b) if b.is_finite() && b >= 0.0 && b < 2f64.powi(100) => Ok((
                rest,
                Value {
                    kind: ValueKind::Size(b as u128),
                    span,
                },
            )),
            _ => Err(nom::Err::Failure(PErr::at(SpecError::new(
                "spec::bad-number",
                span,
                format!("size `{}{unit}` is out of range", text.fragment()),
                "not a size",
            )))),
        };
    }
    if tail.starts_with(|c: char| is_word(c) || c == '.') {
        let bad = tail
            .find(|c: char| !(is_word(c) || c == '.'))
            .unwrap_or(tail.len());
        let span = Span::new(start, off(&rest) + bad);
        return Err(nom::Err::Failure(PErr::at(
            SpecError::new(
                "spec::bad-number",
                span,
                format!("invalid number `{}{}`", text.fragment(), &tail[..bad]),
                "not a number",
            )
            .with_help(
                "numbers look like `64`, `50_257`, `0.95` or `3e-4`; sizes like `24GiB` or \
                 `512MB` (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)",
            ),
        )));
    }
    let span = Span::new(start, off(&rest));
    let clean: String = text.fragment().chars().filter(|c| *c != '_').collect();
    let is_float = clean.contains(['.', 'e', 'E']);
    let kind = if is_float {
        match clean.parse::<f64>() {
            Ok(f) if f.is_finite() => ValueKind::Float(f),
            _ => {
                return Err(nom::Err::Failure(PErr::at(SpecError::new(
                    "spec::bad-number",
                    span,
                    format!("float literal `{}` is out of range", text.fragment()),
                    "not a finite f64",
                ))))
            }
        }
    } else {
        match clean.parse::<i128>() {
            Ok(n) => ValueKind::Int(n),
            Err(_) => {
                return Err(nom::Err::Failure(PErr::at(SpecError::new(
                    "spec::bad-number",
                    span,
                    format!("integer literal `{}` is too large", text.fragment()),
                    "too large",
                ))))
            }
        }
    };
    Ok((rest, Value { kind, span }))
}

/// A double-quoted, single-line string with `\"`, `\\`, `\n`, `\t` escapes.
fn string(i: Input) -> PResult<Value> {
    let (body, _) = tag("\"").parse(i)?;
    let start = off(&i);
    let s = body.fragment();
    let mut out = String::new();
    let mut chars = s.char_indices();
    while let Some((k, c)) = chars.next() {
        match c {
            '"' => {
                let rest = advance(&body, k + 1);
                let kind = ValueKind::Str(out);
                return Ok((
                    rest,
                    Value {
                        kind,
                        span: Span::new(start, off(&rest)),
                    },
                ));
            }
            '\n' | '\r' => break,
            '\\' => match chars.next() {
                Some((_, '"')) => out.push('"'),
                Some((_, '\\')) => out.push('\\'),
                Some((_, 'n')) => out.push('\n'),
                Some((_, 't')) => out.push('\t'),
                Some((j, e)) if e != '\n' && e != '\r' => {
                    let at = off(&body) + k;
                    let span = Span::new(at, off(&body) + j + e.len_utf8());
                    return Err(nom::Err::Failure(PErr::at(
                        SpecError::new(
                            "spec::bad-escape",
                            span,
                            format!("unknown escape `\\{e}` in string"),
                            "unknown escape",
                        )
                        .with_help("valid escapes are `\\\"`, `\\\\`, `\\n` and `\\t`"),
                    )));
                }
                _ => break,
            },
            c => out.push(c),
        }
    }
    let line_end = s.find(['\n', '\r']).unwrap_or(s.len());
    let end = off(&body) + line_end;
    Err(nom::Err::Failure(
        PErr::at(
            SpecError::new(
                "spec::unterminated-string",
                Span::new(start, end),
                "unterminated string",
                "this string is never closed",
            )
            .with_help("close the string with `\"` on the same line"),
        )
        .resume_at(end),
    ))
}

/// A `(a, b)` tuple or `[a, b]` list; trailing commas and newlines allowed inside.
fn sequence(i: Input, depth: usize) -> PResult<Value> {
    let (open, close, what) = if i.fragment().starts_with('(') {
        ('(', ')', "tuple")
    } else {
        ('[', ']', "list")
    };
    let (mut j, _) = char(open).parse(i)?;
    let start = off(&i);
    let open_span = Span::new(start, start + 1);
    if depth >= MAX_DEPTH {
        return Err(nom::Err::Failure(PErr::at(SpecError::new(
            "spec::too-deep",
            open_span,
            format!("values nested deeper than {MAX_DEPTH} levels"),
            "too deep",
        ))));
    }
    let unterminated = |at: &Input| {
        let resume = off(at);
        nom::Err::Failure(
            PErr::at(
                SpecError::new(
                    "spec::unterminated",
                    open_span,
                    format!("unterminated {what}: `{open}` is never closed"),
                    format!("this `{open}` has no matching `{close}`"),
                )
                .with_note(
                    token_span(at),
                    format!("expected `,` or `{close}` before this"),
                )
                .with_help(format!("add `{close}` after the last element")),
            )
            .resume_at(resume),
        )
    };
    let mut items = Vec::new();
    loop {
        j = ws(j);
        if let Ok((rest, _)) = char::<_, PErr>(close).parse(j) {
            let kind = if close == ')' {
                ValueKind::Tuple(items)
            } else {
                ValueKind::List(items)
            };
            return Ok((
                rest,
                Value {
                    kind,
                    span: Span::new(start, off(&rest)),
                },
            ));
        }
        if j.fragment().is_empty() || j.fragment().starts_with('}') || at_entry_start(j) {
            return Err(unterminated(&j));
        }
        let (rest, v) = value(j, depth + 1)?;
        items.push(v);
        j = ws(rest);
        if let Ok((rest, _)) = char::<_, PErr>(',').parse(j) {
            j = rest;
        } else if !j.fragment().starts_with(close) {
            if j.fragment().is_empty() || j.fragment().starts_with('}') || at_entry_start(j) {
                return Err(unterminated(&j));
            }
            return Err(nom::Err::Failure(PErr::at(SpecError::new(
                "spec::syntax",
                token_span(&j),
                format!("expected `,` or `{close}` in {what}, found {}", found(&j)),
                "unexpected here",
            ))));
        }
    }
}

/// A value: number, string, `true`/`false`, `none`, identifier, tuple or list.
pub fn value(i: Input, depth: usize) -> PResult<Value> {
    match i.fragment().chars().next() {
        Some('"') => string(i),
        Some('(') | Some('[') => sequence(i, depth),
        Some(c) if c.is_ascii_digit() || c == '+' || c == '-' => number(i).map_err(|e| match e {
            nom::Err::Error(_) => nom::Err::Failure(PErr::at(SpecError::new(
                "spec::bad-number",
                token_span(&i),
                format!("expected a number after `{c}`"),
                "not a number",
            ))),
            other => other,
        }),
        Some(c) if is_ident_start(c) => {
            let (rest, id) = ident(i)?;
            let kind = match id.name.as_str() {
                "true" => ValueKind::Bool(true),
                "false" => ValueKind::Bool(false),
                "none" => ValueKind::None,
                _ => ValueKind::Ident(id.name),
            };
            Ok((
                rest,
                Value {
                    kind,
                    span: id.span,
                },
            ))
        }
        _ => {
            let mut err = SpecError::new(
                "spec::syntax",
                token_span(&i),
                format!("expected a value, found {}", found(&i)),
                "expected a value here",
            );
            if i.fragment().starts_with('\'') {
                err = err.with_help("strings use double quotes: \"...\"");
            } else if i.fragment().starts_with('.') {
                err = err.with_help("write a leading zero: `0.5`");
            }
            Err(nom::Err::Failure(PErr::at(err)))
        }
    }
}
