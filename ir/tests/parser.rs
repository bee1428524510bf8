//! Parser errors carry line:column and a useful message; the parser never panics, whatever the
//! input (proptest over random and mutated text).
mod common;

use ir::{parse_module, ParseError};
use proptest::prelude::*;

fn base() -> String {
    common::tiny().to_string()
}

/// 1-based (line, column) of the first occurrence of `needle` (plus `skip` characters).
fn pos(text: &str, needle: &str, skip: usize) -> (usize, usize) {
    for (i, line) in text.lines().enumerate() {
        if let Some(b) = line.find(needle) {
            return (i + 1, line[..b].chars().count() + 1 + skip);
        }
    }
    panic!("{needle:?} not in text");
}

/// Parses `text`, expecting an error at the position of `at` (+`skip`) whose message contains
/// `message`.
fn fails(text: &str, at: &str, skip: usize, message: &str) -> ParseError {
    let Err(e) = parse_module(text) else {
        panic!("should not parse (expected {message:?})")
    };
    assert!(
        e.message.contains(message),
        "{e} does not mention {message:?}"
    );
    assert_eq!((e.line, e.column), pos(text, at, skip), "{e}");
    assert!(e
        .to_string()
        .starts_with(&format!("{}:{}: ", e.line, e.column)));
    e
}

#[test]
fn unknown_op_suggests_the_closest() {
    let t = base().replace(
        "= layer_norm %x, %ln.w, %ln.b",
        "= layer_nrom %x, %ln.w, %ln.b",
    );
    fails(
        &t,
        "layer_nrom",
        0,
        "unknown op `layer_nrom`; did you mean `layer_norm`?",
    );
    let t = base().replace("loss %loss", "frobnicate %loss");
    fails(
        &t,
        "frobnicate",
        0,
        "unknown op `frobnicate` (expected one of: state, input, loss",
    );
}

#[test]
fn unknown_value() {
    let t = base().replace("= gelu %fc.bias", "= gelu %nope");
    fails(&t, "%nope", 0, "unknown value `%nope`");
}

#[test]
fn value_used_before_its_definition() {
    let t = base().replace("embedding %wte, %tokens", "embedding %wte, %res3");
    let (line, _) = pos(&t, "%res3: f32", 0);
    fails(
        &t,
        "%res3",
        0,
        &format!("`%res3` is used before its definition on line {line}"),
    );
}

#[test]
fn bad_types() {
    let t = base().replace("%x0: f32[8, 16]", "%x0: f64[8, 16]");
    fails(
        &t,
        "f64",
        0,
        "expected a type `f32[...]`, `i32[...]` or `bf16[...]`, found `f64[8, 16]",
    );
    let t = base().replace("%x0: f32[8, 16]", "%x0: f32[8, sixteen]");
    fails(&t, "sixteen", 0, "bad dimension `sixteen");
    let t = base().replace("%x0: f32[8, 16]", "%x0: f32[8, 99999999999999999999999]");
    fails(&t, "99999", 0, "bad dimension");
    let t = base().replace("%x0: f32[8, 16]", "%x0: f32[8 16]");
    fails(&t, "16] = embedding", 0, "expected `,` or `]` in the shape");
    let t = base().replace("%x0: f32[8, 16]", "%x0 f32[8, 16]");
    fails(
        &t,
        "f32[8, 16] = embedding",
        0,
        "expected `:` and a type after `%x0`",
    );
}

#[test]
fn attribute_errors() {
    let t = base().replace(
        "= rms_norm %x, %rms.w {eps = 1e-6}",
        "= rms_norm %x, %rms.w",
    );
    fails(
        &t,
        "rms_norm %x",
        0,
        "`rms_norm` is missing attribute `eps`",
    );
    let t = base().replace("{eps = 1e-6}", "{epsilon = 1e-6}");
    fails(
        &t,
        "epsilon",
        0,
        "`rms_norm` has no attribute `epsilon`; did you mean `eps`?",
    );
    let t = base().replace("{eps = 1e-6}", "{eps = 1e-6, flavour = 3}");
    fails(&t, "flavour", 0, "`rms_norm` has no attribute `flavour`");
    let t = base().replace("{eps = 1e-6}", "{eps = tiny}");
    fails(
        &t,
        "tiny}",
        0,
        "attribute `eps` of `rms_norm` expects a float, found `tiny`",
    );
    let t = base().replace("{eps = 1e-6}", "{eps = 1e-6, eps = 1e-6}");
    fails(&t, "eps = 1e-6}", 0, "duplicate attribute `eps`");
    let t = base().replace(
        "{batch = 2, seq_len = 4, n_heads = 2}",
        "{batch = 2, seq_len = -4, n_heads = 2}",
    );
    fails(
        &t,
        "-4",
        0,
        "attribute `seq_len` of `attention` expects a non-negative integer, found `-4`",
    );
    let t = base().replace("{max_norm = none}", "{max_norm = nothing}");
    fails(&t, "nothing", 0, "expects a float, found `nothing`");
    let t = base().replace("gelu %fc.bias", "gelu %fc.bias {eps = 1.0}");
    fails(&t, "eps = 1.0", 0, "`gelu` has no attribute `eps`");
}

#[test]
fn state_and_input_words() {
    let t = base().replace("state parameter ones", "state paramter ones");
    fails(
        &t,
        "paramter",
        0,
        "unknown buffer class `paramter`; did you mean `parameter`?",
    );
    let t = base().replace("state parameter ones", "state parameter uniform");
    fails(&t, "uniform", 0, "unknown init `uniform`");
    let t = base().replace("normal(std = 0.02)", "normal(sd = 0.02)");
    fails(
        &t,
        "sd = 0.02",
        0,
        "`normal` has no attribute `sd`; did you mean `std`?",
    );
    let t = base().replace("input tokens", "input token");
    fails(
        &t,
        "input token",
        6,
        "unknown input role `token`; did you mean `tokens`?",
    );
    let t = base().replace(
        "%ln.w: f32[16] = state parameter ones",
        "%ln.w: f32[16] = state parameter",
    );
    fails(
        &t,
        "%ln.w: f32[16] = state",
        17,
        "expected `state <class> <init>`",
    );
}

#[test]
fn duplicate_definition() {
    let t = base().replace("%h.nobias:", "%h:");
    let (first, _) = pos(&t, "%h: f32[8, 16] = layer_norm", 0);
    let e = fails(
        &t,
        "%h: f32[8, 16] = layer_norm %x, %ln.w {",
        0,
        "duplicate definition of `%h`",
    );
    assert!(
        e.message
            .contains(&format!("first defined on line {first}")),
        "{e}"
    );
}

#[test]
fn structure_errors() {
    let b = base();
    let forward_first = b
        .replacen("\nforward:\n", "\nSTATE_TMP\n", 1)
        .replacen("state:\n", "forward:\n", 1)
        .replace("STATE_TMP", "state:");
    fails(
        &forward_first,
        "state:",
        0,
        "section `state:` after `forward:`",
    );
    let t = b.replace("backward:\n", "backwards:\n");
    fails(&t, "backwards:", 0, "unknown section `backwards:`");
    let t = b.replace("state:\n", "");
    fails(&t, "%wte", 0, "expected a section header");
    let no_module: String = b
        .lines()
        .filter(|l| !l.starts_with("module"))
        .map(|l| format!("{l}\n"))
        .collect();
    fails(
        &no_module,
        "config",
        0,
        "expected `module <name>` before `config`",
    );
    let t = b.replacen("module tiny", "module small", 1);
    fails(
        &t,
        "module small",
        0,
        "module name `small` does not match the config's name `tiny`",
    );
    let t = b.replacen("config {\"name\"", "config {\"nmae\"", 1);
    let e = parse_module(&t).unwrap_err();
    assert_eq!(e.line, 3);
    assert!(e.message.starts_with("bad config:"), "{e}");
    let t = b.replace("loss %loss", "loss %loss %loss");
    fails(
        &t,
        "%loss %loss",
        6,
        "unexpected `%loss` at the end of the line",
    );
    assert_eq!(
        parse_module("").unwrap_err().message,
        "missing `module <name>` line"
    );
    assert_eq!(
        parse_module("; just a comment\nmodule x\n")
            .unwrap_err()
            .to_string(),
        "2:1: missing `config {...}` line"
    );
}

#[test]
fn error_columns_count_characters() {
    let t = base().replace("= gelu %fc.bias", "= gelu %fc.bias ; ünïcode comment\n  %é");
    let e = parse_module(&t).unwrap_err();
    assert_eq!((e.line, e.column), pos(&t, "%é", 0));
}

/// Applies `edits` (position, kind, byte) to `text`, staying on char boundaries.
fn mutate(text: &str, edits: &[(usize, u8, char)]) -> String {
    let mut s: Vec<char> = text.chars().collect();
    for &(at, kind, ch) in edits {
        if s.is_empty() {
            s.push(ch);
            continue;
        }
        let i = at % s.len();
        match kind % 5 {
            0 => {
                s.remove(i);
            }
            1 => s.insert(i, ch),
            2 => s[i] = ch,
            3 => s.truncate(i),
            _ => {
                // Duplicate a chunk (a line or a value name).
                let end = (i + 1 + at % 40).min(s.len());
                let chunk: Vec<char> = s[i..end].to_vec();
                s.splice(i..i, chunk);
            }
        }
    }
    s.into_iter().collect()
}

/// Whatever parses must print, verify and re-parse without panicking, and printing is stable.
fn check_no_panic(text: &str) {
    if let Ok(m) = parse_module(text) {
        let printed = m.to_string();
        let _ = m.verify();
        if let Err(errors) = m.verify() {
            let _ = m.display_with_errors(&errors);
        }
        let again = parse_module(&printed).expect("a printed module parses");
        assert_eq!(again.to_string(), printed);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_text_never_panics(text in "(?s).{0,300}") {
        check_no_panic(&text);
    }

    #[test]
    fn token_soup_never_panics(text in "[ \n\t%:=,;(){}\\[\\]a-z0-9_.\"-]{0,400}") {
        check_no_panic(&text);
        let with_header = format!("module tiny\nconfig {}\n{text}", serde_json::to_string(&common::config()).unwrap());
        check_no_panic(&with_header);
    }

    #[test]
    fn mutated_module_never_panics(
        edits in prop::collection::vec(
            (any::<usize>(), any::<u8>(), prop::sample::select(vec!['%', ':', '=', ',', '[', ']', '{', '}', '\n', ' ', ';', '0', '9', 'x', '.', '-', 'é', '"'])),
            1..6,
        )
    ) {
        check_no_panic(&mutate(&base(), &edits));
    }
}
