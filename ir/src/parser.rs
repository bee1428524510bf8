//! Parser of the text format written by the printer (`printer.rs`): reads a dump back into a
//! [`Module`] built with [`Module::new`] and [`Module::push`], so names are kept. Line-based,
//! with `nom` for the tokens; `;` starts a comment (outside the config JSON), and whitespace
//! within a line is free. Errors carry a 1-based line and column (in characters) and never
//! panic, whatever the input.
use crate::config::Config;
use crate::module::{Module, ValueId};
use crate::op::Section;
use crate::printer::is_bare_name;
use crate::types::TensorType;
use nom::bytes::complete::take_while1;
use std::collections::HashMap;
use thiserror::Error;

mod build;
mod cursor;
use cursor::{word, Cursor, Res};

/// A syntax or name-resolution error in IR text.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{line}:{column}: {message}")]
pub struct ParseError {
    /// 1-based line.
    pub line: usize,
    /// 1-based column, in characters.
    pub column: usize,
    /// What is wrong (unknown op with a suggestion, unknown value, bad type, ...).
    pub message: String,
}

/// Parser state across lines.
struct Parser<'a> {
    text: &'a str,
    name: Option<(String, usize, usize)>,
    module: Option<Module>,
    section: Option<Section>,
    defs: HashMap<&'a str, (ValueId, usize)>,
}

/// Parses IR text (as printed by `Display for Module`) into a module. The text must start with
/// `module <name>` and `config <json>` lines (comments and blank lines aside); sections follow in
/// execution order, each at most once, and values are defined before they are used. The result
/// is not verified: call [`crate::verify`].
///
/// Errors: the first syntax or name error, with its line and column.
pub fn parse_module(text: &str) -> Result<Module, ParseError> {
    let mut p = Parser {
        text,
        name: None,
        module: None,
        section: None,
        defs: HashMap::new(),
    };
    let mut last = 1;
    for (i, line) in text.lines().enumerate() {
        last = i + 1;
        let mut c = Cursor {
            line: i + 1,
            text: line,
            rest: line,
        };
        if !c.at_end() {
            p.line(&mut c)?;
        }
    }
    let at_end = ParseError {
        line: last,
        column: 1,
        message: String::new(),
    };
    match p.module {
        Some(m) => Ok(m),
        None if p.name.is_none() => Err(ParseError {
            message: "missing `module <name>` line".into(),
            ..at_end
        }),
        None => Err(ParseError {
            message: "missing `config {...}` line".into(),
            ..at_end
        }),
    }
}

impl std::str::FromStr for Module {
    type Err = ParseError;
    /// Same as [`parse_module`].
    fn from_str(s: &str) -> Result<Module, ParseError> {
        parse_module(s)
    }
}

impl<'a> Parser<'a> {
    fn line(&mut self, c: &mut Cursor<'a>) -> Res<()> {
        let start = c.rest;
        let first = c.token(word);
        match first {
            Some("module") if c.rest.starts_with([' ', '\t', '"']) || c.at_end() => {
                return self.module_line(c, start)
            }
            Some("config") if c.rest.starts_with([' ', '\t', '{']) || c.at_end() => {
                return self.config_line(c, start)
            }
            Some(w) if c.eat(':') => return self.section_line(c, w, start),
            _ => {}
        }
        c.rest = start;
        self.inst_line(c)
    }

    fn module_line(&mut self, c: &mut Cursor<'a>, start: &'a str) -> Res<()> {
        if self.name.is_some() {
            return Err(c.err_at(start, "duplicate `module` line"));
        }
        c.ws();
        let name = if c.rest.starts_with('"') {
            let mut it = serde_json::Deserializer::from_str(c.rest).into_iter::<String>();
            match it.next() {
                Some(Ok(s)) => {
                    c.rest = c.rest.get(it.byte_offset()..).unwrap_or("");
                    s
                }
                _ => return Err(c.err("bad quoted module name")),
            }
        } else {
            let n = c.token(|i| take_while1(is_bare_char)(i));
            n.ok_or_else(|| c.err(format!("expected the module name, found {}", c.found())))?
                .to_string()
        };
        c.end()?;
        self.name = Some((name, c.line, c.col(start)));
        Ok(())
    }

    fn config_line(&mut self, c: &mut Cursor<'a>, start: &'a str) -> Res<()> {
        let Some((name, line, column)) = self.name.clone() else {
            return Err(c.err_at(start, "expected `module <name>` before `config`"));
        };
        if self.module.is_some() {
            return Err(c.err_at(start, "duplicate `config` line"));
        }
        c.ws();
        let json = c.rest;
        let mut it = serde_json::Deserializer::from_str(json).into_iter::<Config>();
        let config = match it.next() {
            Some(Ok(cfg)) => cfg,
            Some(Err(e)) => {
                let column = c.col(json) + e.column().saturating_sub(1);
                return Err(ParseError {
                    line: c.line,
                    column,
                    message: format!("bad config: {e}"),
                });
            }
            None => return Err(c.err("expected the config as JSON after `config`")),
        };
        c.rest = json.get(it.byte_offset()..).unwrap_or("");
        c.end()?;
        if config.name != name {
            let message = format!(
                "module name `{name}` does not match the config's name `{}`",
                config.name
            );
            return Err(ParseError {
                line,
                column,
                message,
            });
        }
        self.module = Some(Module::new(config));
        Ok(())
    }

    fn section_line(&mut self, c: &mut Cursor<'a>, w: &str, start: &'a str) -> Res<()> {
        let Some(s) = Section::ALL.into_iter().find(|s| s.keyword() == w) else {
            let all: Vec<&str> = Section::ALL.iter().map(|s| s.keyword()).collect();
            return Err(c.err_at(
                start,
                format!("unknown section `{w}:` (sections: {})", all.join(", ")),
            ));
        };
        if self.module.is_none() {
            return Err(c.err_at(
                start,
                "expected `module` and `config` lines before the first section",
            ));
        }
        if let Some(prev) = self.section.filter(|&prev| prev >= s) {
            return Err(c.err_at(start, format!(
                "section `{}:` after `{}:`; sections appear once each, in the order state, forward, backward, optimizer, refresh",
                s.keyword(), prev.keyword()
            )));
        }
        c.end()?;
        self.section = Some(s);
        Ok(())
    }

    fn inst_line(&mut self, c: &mut Cursor<'a>) -> Res<()> {
        let start = c.rest;
        let Some(section) = self.section else {
            let what = if self.module.is_none() {
                "`module` and `config` lines"
            } else {
                "a section header (`state:`, ...)"
            };
            return Err(c.err_at(
                start,
                format!("expected {what} before the first instruction"),
            ));
        };
        let mut results: Vec<(&'a str, &'a str, TensorType)> = Vec::new();
        c.ws();
        if c.rest.starts_with('%') {
            loop {
                let (name, at) = c.value()?;
                c.expect(':', &format!("and a type after `%{name}`"))?;
                let ty = c.ty()?;
                results.push((name, at, ty));
                if !c.eat(',') {
                    break;
                }
            }
            c.expect('=', "after the results")?;
        }
        c.ws();
        let op_at = c.rest;
        let op_name = c.word("an op name")?;
        let mut positional: Vec<(&'a str, &'a str)> = Vec::new();
        if matches!(op_name, "state" | "input") {
            loop {
                c.ws();
                let at = c.rest;
                let Some(w) = c.token(word) else { break };
                positional.push((w, at));
                if w == "normal" {
                    break;
                }
            }
        }
        let mut args = Vec::new();
        let positional_attrs = if positional.last().is_some_and(|p| p.0 == "normal") {
            c.attrs_paren()?
        } else {
            Vec::new()
        };
        c.ws();
        if c.rest.starts_with('%') {
            loop {
                let (name, at) = c.value()?;
                args.push(self.resolve(c, name, at)?);
                if !c.eat(',') {
                    break;
                }
            }
        }
        let attrs = c.attrs()?;
        c.end()?;
        let op = build::build_op(c, op_at, op_name, &positional, positional_attrs, attrs)?;
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (name, at, _) in &results {
            if let Some(&(_, line)) = self.defs.get(name) {
                return Err(c.err_at(
                    at,
                    format!("duplicate definition of `%{name}` (first defined on line {line})"),
                ));
            }
            if seen.insert(name, c.line).is_some() {
                return Err(c.err_at(
                    at,
                    format!("duplicate definition of `%{name}` on this line"),
                ));
            }
        }
        let module = self
            .module
            .as_mut()
            .ok_or_else(|| c.err_at(start, "missing `config` line"))?;
        let spec: Vec<(String, TensorType)> = results
            .iter()
            .map(|(n, _, t)| (n.to_string(), t.clone()))
            .collect();
        let (_, ids) = module.push(section, op, &args, spec);
        for ((name, at, _), id) in results.iter().zip(ids) {
            if module.value(id).name != *name {
                return Err(c.err_at(at, format!("value name `%{name}` is not canonical")));
            }
            self.defs.insert(name, (id, c.line));
        }
        Ok(())
    }

    fn resolve(&self, c: &Cursor<'a>, name: &str, at: &str) -> Res<ValueId> {
        if let Some(&(id, _)) = self.defs.get(name) {
            return Ok(id);
        }
        let needle = format!("%{name}:");
        let later = self.text.lines().enumerate().skip(c.line).find(|(_, l)| {
            let code = l.split(';').next().unwrap_or("");
            code.split('=')
                .next()
                .is_some_and(|lhs| lhs.replace(' ', "").contains(&needle))
        });
        Err(match later {
            Some((i, _)) => c.err_at(
                at,
                format!("`%{name}` is used before its definition on line {}", i + 1),
            ),
            None => c.err_at(at, format!("unknown value `%{name}`")),
        })
    }
}

fn is_bare_char(c: char) -> bool {
    is_bare_name(c.encode_utf8(&mut [0; 4]))
}
