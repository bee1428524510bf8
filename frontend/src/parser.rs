//! The block-level parser with error recovery: a bad entry is reported and skipped (to the end
//! of its line, or to the `}` that closes its block), a block that is never closed ends where the
//! next block header starts, so one run reports every syntax error of a file.
//!
//! Grammar (EBNF; whitespace and `#` comments may appear between any two tokens):
//! ```text
//! spec   = { block } ;
//! block  = ident [ ident ] "{" { entry [ ";" ] } "}" ;
//! entry  = ident "=" value ;
//! value  = number | string | "true" | "false" | "none" | ident | tuple | list ;
//! tuple  = "(" [ value { "," value } [ "," ] ] ")" ;
//! list   = "[" [ value { "," value } [ "," ] ] "]" ;
//! number = [ "+" | "-" ] digit { digit | "_" } [ "." digit { digit | "_" } ]
//!          [ ( "e" | "E" ) [ "+" | "-" ] digit { digit } ] ;
//! string = '"' { char | "\" ( '"' | "\" | "n" | "t" ) } '"' ;   (* one line *)
//! ident  = ( letter | "_" ) { letter | digit | "_" } ;
//! ```

use crate::ast::{Block, Entry, Span, Spec};
use crate::diagnostics::SpecError;
use crate::lex::{
    advance, at_line_end, found, ident, is_ident_start, off, token_span, value, ws, ws_inline,
    Input, PErr,
};

/// The block keywords, for suggestions in syntax errors.
const BLOCK_HINT: &str = "a spec is a list of blocks such as `model gpt2 { ... }`, \
                          `optimizer soap { ... }`, `data { ... }`, `train { ... }`";

/// Parsing stops after this many syntax errors (the input is probably not a spec).
pub const MAX_SYNTAX_ERRORS: usize = 1000;

/// Parses `src` into a syntax tree, recovering from errors; returns the tree and every error
/// (parsing stops after [`MAX_SYNTAX_ERRORS`], with an error saying where). Linear time.
pub fn parse(src: &str) -> (Spec, Vec<SpecError>) {
    let mut errors = Vec::new();
    let mut blocks = Vec::new();
    let mut i = Input::new(src);
    if src.starts_with('\u{feff}') {
        i = advance(&i, '\u{feff}'.len_utf8());
    }
    loop {
        i = ws(i);
        let Some(c) = i.fragment().chars().next() else {
            break;
        };
        if errors.len() >= MAX_SYNTAX_ERRORS {
            errors.push(stopped(&i));
            break;
        }
        if is_ident_start(c) {
            i = block(i, &mut blocks, &mut errors);
        } else if c == '}' {
            errors.push(SpecError::new(
                "spec::syntax",
                token_span(&i),
                "unmatched `}`",
                "no block is open here",
            ));
            i = advance(&i, 1);
        } else {
            errors.push(
                SpecError::new(
                    "spec::syntax",
                    token_span(&i),
                    format!("expected a block, found {}", found(&i)),
                    "expected a block keyword here",
                )
                .with_help(BLOCK_HINT),
            );
            i = sync(i);
        }
    }
    (Spec { blocks }, errors)
}

/// Parses one block starting at an identifier; returns the input after it.
fn block<'a>(i: Input<'a>, blocks: &mut Vec<Block>, errors: &mut Vec<SpecError>) -> Input<'a> {
    let Ok((rest, kind)) = ident(i) else {
        return sync(i);
    };
    let mut j = ws(rest);
    if j.fragment().starts_with('=') {
        errors.push(
            SpecError::new(
                "spec::entry-outside-block",
                kind.span,
                format!("`{}` is set outside of any block", kind.name),
                "not inside a block",
            )
            .with_help(BLOCK_HINT),
        );
        return sync(j);
    }
    let mut name = None;
    if let Ok((mut rest, mut n)) = ident(j) {
        // `kl-shampoo`: names are identifiers, so a hyphenated word is one located error with
        // the spelling to use, and the block is read as that name (no cascade of errors).
        let start = n.span;
        let mut hyphenated = false;
        while rest.fragment().starts_with('-') && rest.fragment()[1..].starts_with(is_ident_start) {
            let Ok((r, part)) = ident(advance(&rest, 1)) else {
                break;
            };
            n.name = format!("{}_{}", n.name, part.name);
            n.span = start.to(part.span);
            rest = r;
            hyphenated = true;
        }
        if hyphenated {
            errors.push(
                SpecError::new(
                    "spec::syntax",
                    n.span,
                    format!(
                        "`{}` is not a name: names use `_`, not `-`",
                        n.name.replace('_', "-")
                    ),
                    "hyphen in a name",
                )
                .with_help(format!("write `{}`", n.name)),
            );
        }
        name = Some(n);
        j = ws(rest);
    }
    let header = match &name {
        Some(n) => kind.span.to(n.span),
        None => kind.span,
    };
    let mut blk = Block {
        kind,
        name,
        entries: Vec::new(),
        header,
        broken: false,
    };
    if !j.fragment().starts_with('{') {
        errors.push(SpecError::new(
            "spec::syntax",
            token_span(&j),
            format!(
                "expected `{{` after `{}`, found {}",
                blk.kind.name,
                found(&j)
            ),
            "expected `{` here",
        ));
        blk.broken = true;
        // Resume after a `{` later on the same line, else skip the block's body.
        let line = &j.fragment()[..j.fragment().find('\n').unwrap_or(j.fragment().len())];
        match line.find('{') {
            Some(k) => j = advance(&j, k),
            None => {
                blocks.push(blk);
                return skip_body(j);
            }
        }
    }
    let open = Span::new(off(&j), off(&j) + 1);
    j = advance(&j, 1);
    loop {
        j = ws(j);
        let Some(c) = j.fragment().chars().next() else {
            errors.push(unterminated_block(&blk, open, &j));
            blk.broken = true;
            break;
        };
        if errors.len() >= MAX_SYNTAX_ERRORS {
            blk.broken = true;
            break;
        }
        if c == '}' {
            j = advance(&j, 1);
            break;
        }
        if c == ';' {
            j = advance(&j, 1);
            continue;
        }
        if is_ident_start(c) && looks_like_header(j) {
            errors.push(unterminated_block(&blk, open, &j));
            blk.broken = true;
            break;
        }
        match entry(j) {
            Ok((rest, e)) => {
                blk.entries.push(e);
                j = rest;
            }
            Err(nom::Err::Error(e) | nom::Err::Failure(e)) => {
                errors.push(*e.error);
                blk.broken = true;
                j = match e.resume {
                    Some(at) if at > off(&j) => advance(&j, at - off(&j)),
                    _ => sync(j),
                };
            }
            Err(nom::Err::Incomplete(_)) => {
                blk.broken = true;
                j = sync(j);
            }
        }
    }
    blocks.push(blk);
    j
}

/// "parsing stopped at line L after N syntax errors", at `at`.
fn stopped(at: &Input) -> SpecError {
    SpecError::new(
        crate::diagnostics::STOPPED,
        Span::new(off(at), off(at)),
        format!(
            "parsing stopped at line {} after {MAX_SYNTAX_ERRORS} syntax errors",
            at.location_line()
        ),
        "parsing stopped here",
    )
}

fn unterminated_block(blk: &Block, open: Span, at: &Input) -> SpecError {
    let what = match &blk.name {
        Some(n) => format!("{} {}", blk.kind.name, n.name),
        None => blk.kind.name.clone(),
    };
    let here = if at.fragment().is_empty() {
        "the file ends here".to_string()
    } else {
        "the next block starts here".to_string()
    };
    SpecError::new(
        "spec::unterminated",
        open,
        format!("unterminated block: `{what}` is never closed"),
        "this `{` has no matching `}`",
    )
    .with_note(token_span(at), here)
    .with_help("add `}` after the block's last entry")
}

/// One `key = value` entry.
fn entry(i: Input) -> Result<(Input, Entry), nom::Err<PErr>> {
    if !i.fragment().starts_with(is_ident_start) {
        let err = SpecError::new(
            "spec::syntax",
            token_span(&i),
            format!("expected a key or `}}`, found {}", found(&i)),
            "expected `key = value` here",
        );
        return Err(nom::Err::Failure(PErr::at(err)));
    }
    let (rest, key) = ident(i)?;
    let j = ws_inline(rest);
    if !j.fragment().starts_with('=') {
        let mut err = SpecError::new(
            "spec::syntax",
            token_span(&j),
            format!("expected `=` after `{}`, found {}", key.name, found(&j)),
            "expected `=` here",
        );
        if j.fragment().starts_with(':') {
            err = err.with_help(format!("write `{} = ...`", key.name));
        }
        return Err(nom::Err::Failure(PErr::at(err)));
    }
    let eq = Span::new(off(&j), off(&j) + 1);
    let j = ws_inline(advance(&j, 1));
    if at_line_end(&j) {
        let err = SpecError::new(
            "spec::missing-value",
            eq,
            format!("missing value for `{}`", key.name),
            "expected a value after `=`",
        );
        return Err(nom::Err::Failure(PErr::at(err).resume_at(off(&j))));
    }
    let (rest, value) = value(j, 0)?;
    Ok((rest, Entry { key, value }))
}

/// Whether `i` starts a block header: `ident [ident] {` on one line.
fn looks_like_header(i: Input) -> bool {
    let Ok((rest, _)) = ident(i) else {
        return false;
    };
    let mut j = ws_inline(rest);
    if let Ok((rest, _)) = ident(j) {
        j = ws_inline(rest);
    }
    j.fragment().starts_with('{')
}

/// Skips to the start of the next line, or to a `}` on this line (not consumed).
fn sync(i: Input) -> Input {
    let s = i.fragment();
    let mut end = s.len();
    for (k, c) in s.char_indices() {
        if c == '}' || c == '#' {
            end = k;
            break;
        }
        if c == '\n' {
            end = k + 1;
            break;
        }
    }
    // A `#` starts a comment: skip it through the end of its line.
    let j = advance(&i, end);
    if j.fragment().starts_with('#') {
        let s = j.fragment();
        let nl = s.find('\n').map_or(s.len(), |k| k + 1);
        return advance(&j, nl);
    }
    j
}

/// Skips a block body whose `{` is missing: to just past the next `}`, or the end of file.
fn skip_body(i: Input) -> Input {
    let s = i.fragment();
    let mut in_comment = false;
    for (k, c) in s.char_indices() {
        match c {
            '\n' => in_comment = false,
            '#' => in_comment = true,
            '}' if !in_comment => return advance(&i, k + 1),
            _ => {}
        }
    }
    advance(&i, s.len())
}
