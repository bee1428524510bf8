//! The line cursor of the parser: `nom` token parsers over one line, positions as 1-based
//! line:column (in characters), and the small grammar pieces (values, types, attributes).
use super::build::RawAttr;
use super::ParseError;
use crate::types::TensorType;
use nom::bytes::complete::take_while1;
use nom::character::complete::space0;
use nom::IResult;
use schedule::DType;

pub(super) type Res<T> = Result<T, ParseError>;

pub(super) fn word(i: &str) -> IResult<&str, &str, ()> {
    take_while1(|c: char| c.is_ascii_alphanumeric() || c == '_')(i)
}

pub(super) fn value_name(i: &str) -> IResult<&str, &str, ()> {
    take_while1(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.')(i)
}

/// A position within one line of the input.
pub(super) struct Cursor<'a> {
    pub(super) line: usize,
    pub(super) text: &'a str,
    pub(super) rest: &'a str,
}

impl<'a> Cursor<'a> {
    /// 1-based column of `at`, a suffix of this line.
    pub(super) fn col(&self, at: &str) -> usize {
        let off = self.text.len().saturating_sub(at.len());
        self.text.get(..off).map_or(1, |p| p.chars().count() + 1)
    }
    /// An error at `at` (a suffix of this line).
    pub(crate) fn err_at(&self, at: &str, message: impl Into<String>) -> ParseError {
        ParseError {
            line: self.line,
            column: self.col(at),
            message: message.into(),
        }
    }
    pub(super) fn err(&self, message: impl Into<String>) -> ParseError {
        self.err_at(self.rest, message)
    }
    pub(super) fn ws(&mut self) {
        if let Ok((r, _)) = space0::<_, ()>(self.rest) {
            self.rest = r;
        }
    }
    /// Skips whitespace; whether only a comment (or nothing) is left.
    pub(super) fn at_end(&mut self) -> bool {
        self.ws();
        self.rest.is_empty() || self.rest.starts_with(';')
    }
    /// Skips whitespace and consumes `c` if it is next.
    pub(super) fn eat(&mut self, c: char) -> bool {
        self.ws();
        match self.rest.strip_prefix(c) {
            Some(r) => {
                self.rest = r;
                true
            }
            None => false,
        }
    }
    pub(super) fn expect(&mut self, c: char, context: &str) -> Res<()> {
        match self.eat(c) {
            true => Ok(()),
            false => Err(self.err(format!("expected `{c}` {context}, found {}", self.found()))),
        }
    }
    /// What is next, for messages.
    pub(super) fn found(&self) -> String {
        match self.rest.chars().next() {
            None => "end of line".into(),
            Some(_) => format!("`{}`", self.rest.chars().take(12).collect::<String>()),
        }
    }
    /// Skips whitespace and takes a token made by `p`; returns it with its position.
    pub(super) fn token(&mut self, p: fn(&str) -> IResult<&str, &str, ()>) -> Option<&'a str> {
        self.ws();
        let (r, t) = p(self.rest).ok()?;
        self.rest = r;
        Some(t)
    }
    pub(super) fn word(&mut self, what: &str) -> Res<&'a str> {
        self.token(word)
            .ok_or_else(|| self.err(format!("expected {what}, found {}", self.found())))
    }
    pub(super) fn end(&mut self) -> Res<()> {
        match self.at_end() {
            true => Ok(()),
            false => Err(self.err(format!(
                "unexpected {} at the end of the line",
                self.found()
            ))),
        }
    }
    /// `%name`, returning the name and the text at the `%` (for error positions).
    pub(super) fn value(&mut self) -> Res<(&'a str, &'a str)> {
        self.ws();
        let at = self.rest;
        match at.strip_prefix('%').map(value_name) {
            Some(Ok((r, name))) => {
                self.rest = r;
                Ok((name, at))
            }
            _ => Err(self.err(format!("expected a value `%name`, found {}", self.found()))),
        }
    }
    /// `f32[d0, d1, ...]` / `i32[...]` / `bf16[...]`.
    pub(super) fn ty(&mut self) -> Res<TensorType> {
        self.ws();
        let at = self.rest;
        let dtype = match self.token(word) {
            Some("f32") => DType::F32,
            Some("i32") => DType::I32,
            Some("bf16") => DType::Bf16,
            _ => {
                return Err(self.err_at(
                    at,
                    format!(
                        "expected a type `f32[...]`, `i32[...]` or `bf16[...]`, found {}",
                        self.found_at(at)
                    ),
                ))
            }
        };
        self.expect('[', "after the element type")?;
        let mut shape = Vec::new();
        if !self.eat(']') {
            loop {
                self.ws();
                let at = self.rest;
                let dim = self.token(word).and_then(|d| d.parse::<usize>().ok());
                shape.push(dim.ok_or_else(|| {
                    self.err_at(at, format!("bad dimension {}", self.found_at(at)))
                })?);
                if self.eat(']') {
                    break;
                }
                self.expect(',', "or `]` in the shape")?;
            }
        }
        Ok(TensorType { dtype, shape })
    }
    pub(super) fn found_at(&self, at: &str) -> String {
        Cursor {
            line: self.line,
            text: self.text,
            rest: at,
        }
        .found()
    }
    /// `{name = value, ...}`; empty when there is no `{`.
    pub(super) fn attrs(&mut self) -> Res<Vec<RawAttr<'a>>> {
        let mut out: Vec<RawAttr<'a>> = Vec::new();
        if !self.eat('{') {
            return Ok(out);
        }
        if self.eat('}') {
            return Ok(out);
        }
        loop {
            self.ws();
            let at = self.rest;
            let name = self.word("an attribute name")?;
            if out.iter().any(|a| a.name == name) {
                return Err(self.err_at(at, format!("duplicate attribute `{name}`")));
            }
            self.expect('=', &format!("after attribute `{name}`"))?;
            self.ws();
            let vat = self.rest;
            let value = if self.eat('"') {
                // A quoted string: everything up to the next `"` (no escapes).
                let Some(end) = self.rest.find('"') else {
                    return Err(self.err_at(vat, format!("unterminated string for `{name}`")));
                };
                let value = &self.rest[..end];
                self.rest = &self.rest[end + 1..];
                value
            } else {
                self.token(|i| {
                    take_while1(|c: char| {
                        c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '+' | '-')
                    })(i)
                })
                .ok_or_else(|| {
                    self.err(format!(
                        "expected a value for attribute `{name}`, found {}",
                        self.found()
                    ))
                })?
            };
            out.push(RawAttr {
                name,
                value,
                name_at: at,
                value_at: vat,
            });
            if self.eat('}') {
                return Ok(out);
            }
            self.expect(',', "or `}` between attributes")?;
        }
    }
}

impl<'a> Cursor<'a> {
    /// `(std = 0.02)` after `normal`.
    pub(super) fn attrs_paren(&mut self) -> Res<Vec<RawAttr<'a>>> {
        self.expect('(', "after `normal`")?;
        self.ws();
        let name_at = self.rest;
        let name = self.word("`std`")?;
        self.expect('=', &format!("after `{name}`"))?;
        self.ws();
        let at = self.rest;
        let v = self
            .token(|i| {
                take_while1(|c: char| {
                    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '+' | '-')
                })(i)
            })
            .ok_or_else(|| self.err(format!("expected a number, found {}", self.found())))?;
        self.expect(')', "after the standard deviation")?;
        Ok(vec![RawAttr {
            name,
            value: v,
            name_at,
            value_at: at,
        }])
    }
}
