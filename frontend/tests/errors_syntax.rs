//! Syntax errors (and error recovery): each test breaks one thing in an otherwise valid spec
//! and checks the exact line:column, a fragment of the message, and the hint where there is
//! one; the last tests check that all errors of a file are reported at once.

mod common;

use common::{assert_error, edit, errors, parse, VALID};

#[test]
fn valid_base_parses() {
    assert!(parse(VALID).is_ok());
}

#[test]
fn unterminated_string() {
    let src = edit(
        "  seq_len = 64\n",
        "  seq_len = 64\n  corpus = \"data.txt\n",
    );
    assert_error(
        &src,
        14,
        12,
        "unterminated string",
        Some("close the string"),
    );
}

#[test]
fn unterminated_list_recovers_at_next_entry() {
    let src = edit(
        "  batch_size = 8\n",
        "  corpus = [\"a.txt\", \"b.txt\"\n  batch_size = 8\n",
    );
    assert_error(
        &src,
        12,
        12,
        "unterminated list: `[` is never closed",
        Some("add `]`"),
    );
}

#[test]
fn unterminated_block_before_next_block() {
    let src = edit("  lr = 1e-3\n}\n", "  lr = 1e-3\n");
    assert_error(
        &src,
        8,
        17,
        "unterminated block: `optimizer adamw` is never closed",
        Some("add `}`"),
    );
}

#[test]
fn unterminated_block_at_end_of_file() {
    let src = VALID.trim_end().trim_end_matches('}');
    assert_error(
        src,
        15,
        7,
        "unterminated block: `train` is never closed",
        None,
    );
}

#[test]
fn garbage_character_in_block() {
    let src = edit("  layers = 2", "  @layers = 2");
    let errs = errors(&src);
    assert_eq!(
        errs.len(),
        1,
        "a broken block reports no missing keys: {errs:#?}"
    );
    assert_eq!((errs[0].0, errs[0].1), (5, 3), "{errs:#?}");
    assert_eq!(errs[0].2, "expected a key or `}`, found `@`");
    let src = edit("  layers = 2", "  layers = 2 $");
    assert_error(&src, 5, 14, "expected a key or `}`, found `$`", None);
}

#[test]
fn garbage_at_top_level() {
    let src = format!("%%% oops\n{VALID}");
    assert_error(
        &src,
        1,
        1,
        "expected a block, found `%`",
        Some("a spec is a list of blocks"),
    );
}

#[test]
fn missing_equals() {
    let src = edit("lr = 1e-3", "lr 1e-3");
    assert_error(&src, 9, 6, "expected `=` after `lr`, found `1e`", None);
    let src = edit("lr = 1e-3", "lr: 1e-3");
    assert_error(
        &src,
        9,
        5,
        "expected `=` after `lr`, found `:`",
        Some("write `lr = ...`"),
    );
}

#[test]
fn missing_value() {
    let src = edit("lr = 1e-3", "lr =");
    assert_error(&src, 9, 6, "missing value for `lr`", None);
}

#[test]
fn invalid_number() {
    let src = edit("context = 64", "context = 64k");
    assert_error(
        &src,
        3,
        13,
        "invalid number `64k`",
        Some("numbers look like"),
    );
}

#[test]
fn empty_file() {
    assert_error(
        "",
        1,
        1,
        "the spec file is empty",
        Some("examples/tiny.asteria"),
    );
    assert_error(
        "\n  # just a comment\n\n",
        1,
        1,
        "the spec file is empty",
        None,
    );
}

#[test]
fn non_utf8_input_reports_byte_offset() {
    let mut bytes = VALID.as_bytes().to_vec();
    bytes.splice(22..22, [0xff, 0xfe]);
    let dir = common::tests_dir();
    let e = frontend::parse_spec_bytes("bin.asteria", &bytes, &dir).expect_err("not UTF-8");
    let items = e.items();
    assert_eq!(items.len(), 1, "{items:#?}");
    assert_eq!((items[0].0, items[0].1), (2, 10));
    assert_eq!(
        items[0].2,
        "invalid UTF-8 at byte offset 22 (line 2, column 10)"
    );
}

#[test]
fn entry_outside_block() {
    let src = format!("seed = 3\n{VALID}");
    assert_error(&src, 1, 1, "`seed` is set outside of any block", None);
}

#[test]
fn unmatched_closing_brace() {
    let src = format!("{VALID}}}\n");
    assert_error(&src, 18, 1, "unmatched `}`", None);
}

#[test]
fn single_quoted_string() {
    let src = edit("  seq_len = 64\n", "  seq_len = 64\n  corpus = 'a.txt'\n");
    assert_error(
        &src,
        14,
        12,
        "expected a value, found `'`",
        Some("double quotes"),
    );
}

#[test]
fn bad_escape_in_string() {
    let src = edit(
        "  seq_len = 64\n",
        "  seq_len = 64\n  corpus = \"a\\q.txt\"\n",
    );
    assert_error(&src, 14, 14, "unknown escape `\\q` in string", None);
}

#[test]
fn integer_too_large() {
    let src = edit(
        "steps = 10",
        "steps = 99999999999999999999999999999999999999999",
    );
    assert_error(
        &src,
        16,
        11,
        "integer literal `99999999999999999999999999999999999999999` is too large",
        None,
    );
    let src = edit("steps = 10", "steps = 99999999999999999999999");
    assert_error(
        &src,
        16,
        11,
        "`steps` = 99999999999999999999999 is outside the allowed range 1..=1_000_000_000",
        None,
    );
}

#[test]
fn three_different_errors_are_all_reported() {
    let src = edit("  layers = 2", "  layrs = 2")
        .replace("lr = 1e-3", "lr = \"fast\"")
        .replace("  steps = 10\n}\n", "  steps = 10\n");
    let errs = errors(&src);
    let got: Vec<(usize, usize)> = errs.iter().map(|e| (e.0, e.1)).collect();
    // `layrs`: unknown key (5:3) + the missing `layers` it stood for (1:1); lr: wrong type
    // (9:8); train: never closed (15:7).
    assert_eq!(got, vec![(1, 1), (5, 3), (9, 8), (15, 7)], "{errs:#?}");
    assert!(errs[1].2.contains("unknown key `layrs`"));
    assert_eq!(errs[1].3.as_deref(), Some("did you mean `layers`?"));
    assert!(errs[2]
        .2
        .contains("expected a number for `lr`, found a string"));
    assert!(errs[3].2.contains("unterminated block: `train`"));
}

#[test]
fn errors_in_separate_blocks_all_reported_after_syntax_errors() {
    let src = "\
model gpt2 {
  vocab = 50257 context = 64 d_model = 64 layers = 2 heads = 4
  init_std = @
}
optimizer soap { lr = -1 }
data { batch_size = 8 seq_len = 64 val_fraction = 2 }
train { steps = 10 seed = \"x\" }
";
    let got: Vec<(usize, usize)> = errors(src).iter().map(|e| (e.0, e.1)).collect();
    assert_eq!(got, vec![(3, 14), (5, 23), (6, 51), (7, 27)]);
}
