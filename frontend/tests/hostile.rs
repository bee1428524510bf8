//! Hostile input: every numeric key above (and below) its range gets one located error naming
//! the range; binary files, plans, JSON, huge files and garbage get one error or a capped list,
//! and the rendered report stays small.

mod common;

use frontend::diagnostics::MAX_SHOWN_ERRORS;
use frontend::{parse_spec, parse_spec_bytes, SpecErrors, MAX_SPEC_BYTES};
use ir::limits::{Limit, SPEC_KEYS};

/// A valid spec in which every numeric key is allowed (llama for `rope_theta`, soap for the
/// SOAP keys, a cpu target for `threads`; `with_entry` switches to kl_shampoo and shampoo for
/// their own keys).
const BASE: &str = "\
model llama {
  vocab = 50257
  context = 64
  d_model = 64
  layers = 2
  heads = 4
}
optimizer soap {
  lr = 1e-3
}
data {
  batch_size = 8
  seq_len = 64
}
train {
  steps = 10
}
target cpu {
}
";

/// `BASE` with `key = value` as the first entry of `block` (replacing the key's own line);
/// returns the spec and the 1-based line:column of the value.
fn with_entry(block: &str, key: &str, value: &str) -> (String, usize, usize) {
    let mut base = BASE.to_string();
    if key == "device" || key == "gpu_memory" {
        base = base.replace("target cpu {", "target cuda {");
    }
    if key == "init_factor" || key == "max_clamp_value" {
        base = base.replace("optimizer soap {", "optimizer kl_shampoo {");
    }
    if matches!(
        key,
        "epsilon" | "max_preconditioner_dim" | "grafting_beta2" | "grafting_epsilon"
    ) {
        base = base.replace("optimizer soap {", "optimizer shampoo {");
    }
    let mut lines: Vec<String> = base
        .lines()
        .filter(|l| !l.trim_start().starts_with(&format!("{key} =")))
        .map(String::from)
        .collect();
    let header = lines
        .iter()
        .position(|l| l.starts_with(block))
        .expect("the block is in BASE");
    let entry = format!("  {key} = {value}");
    lines.insert(header + 1, entry);
    (lines.join("\n") + "\n", header + 2, 3 + key.len() + 3)
}

fn limit_max(l: &Limit) -> u64 {
    match l {
        Limit::Int(r) | Limit::Size(r) => r.max,
        Limit::Float(_) => 0,
    }
}

fn errors_of(src: &str) -> SpecErrors {
    match parse_spec("hostile.asteria", src, &common::tests_dir()) {
        Ok(c) => panic!("expected errors, got {c:?}"),
        Err(e) => e,
    }
}

/// One error at `line:col` whose message names the allowed range.
#[track_caller]
fn assert_range_error(src: &str, line: usize, col: usize, range: &str) {
    let e = errors_of(src);
    let items = e.items();
    assert_eq!(items.len(), 1, "{items:#?}\n{src}");
    let (l, c, m) = &items[0];
    assert_eq!((*l, *c), (line, col), "{m}");
    assert!(
        m.contains(&format!("is outside the allowed range {range}")),
        "{m}"
    );
}

#[test]
fn base_spec_is_valid() {
    common::parse(BASE).expect("BASE parses");
}

#[test]
fn every_numeric_key_above_its_range_is_a_located_error_naming_the_range() {
    for (block, key, limit) in SPEC_KEYS {
        let (value, range) = match limit {
            Limit::Int(r) => ((u128::from(r.max) + 1).to_string(), r.to_string()),
            Limit::Float(r) if r.max_closed => (format!("{:e}", r.max * 2.0), r.to_string()),
            Limit::Float(r) => (format!("{:e}", r.max), r.to_string()),
            Limit::Size(_) => (format!("{}B", limit_max(limit) + 1), limit.to_string()),
        };
        let value = if *key == "betas" {
            format!("(0.9, {value})")
        } else {
            value
        };
        let (src, line, mut col) = with_entry(block, key, &value);
        if *key == "betas" {
            col += "(0.9, ".len();
        }
        assert_range_error(&src, line, col, &range);
    }
}

#[test]
fn every_numeric_key_below_its_range_is_a_located_error_naming_the_range() {
    for (block, key, limit) in SPEC_KEYS {
        let (value, range) = match limit {
            Limit::Int(r) if r.min == 0 => ("-1".to_string(), r.to_string()),
            Limit::Int(r) => ((r.min - 1).to_string(), r.to_string()),
            Limit::Float(r) if r.min_closed => (format!("{}", r.min - 1.0), r.to_string()),
            Limit::Float(r) => (format!("{}", r.min), r.to_string()),
            Limit::Size(r) => (format!("{}B", r.min - 1), limit.to_string()),
        };
        let value = if *key == "betas" {
            format!("({value}, 0.95)")
        } else {
            value
        };
        let (src, line, mut col) = with_entry(block, key, &value);
        if *key == "betas" {
            col += 1;
        }
        assert_range_error(&src, line, col, &range);
    }
}

#[test]
fn the_issues_absurd_numbers_are_refused() {
    for (block, key, value, range) in [
        (
            "optimizer",
            "precondition_frequency",
            "1000000000000",
            "1..=100_000",
        ),
        ("model", "layers", "100000000", "1..=1024"),
        ("model", "d_model", "4294967296", "1..=65_536"),
        ("model", "vocab", "9223372036854775807", "1..=1_048_576"),
        ("data", "batch_size", "1_000_000_000", "1..=65_536"),
        ("target", "threads", "1000000", "1..=1024"),
        ("target", "memory", "0GiB", "1MiB..=16TiB"),
        ("target", "host_memory", "1e9TiB", "1MiB..=16TiB"),
    ] {
        let (src, line, col) = with_entry(block, key, value);
        assert_range_error(&src, line, col, range);
    }
}

/// A deterministic pseudo-random byte stream (xorshift), `n` bytes.
fn noise(n: usize, mut state: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

#[test]
fn a_binary_file_is_one_error_not_a_text_spec() {
    let bytes = noise(5 << 20, 0x9e37_79b9_7f4a_7c15);
    let e = parse_spec_bytes("random.bin", &bytes, &common::tests_dir()).expect_err("binary");
    assert_eq!(e.errors().len(), 1, "{:#?}", e.errors());
    assert_eq!(e.errors()[0].code, "spec::not-text");
    assert!(e.errors()[0].message.contains("is not a text spec"));
    assert!(common::render(&e).len() < 2000);
    // No NUL byte, but invalid UTF-8 throughout: still binary.
    let no_nul: Vec<u8> = bytes.iter().map(|&b| b.max(1)).collect();
    let e = parse_spec_bytes("random.bin", &no_nul, &common::tests_dir()).expect_err("binary");
    assert_eq!(e.errors().len(), 1);
    assert!(e.errors()[0].message.contains("invalid UTF-8 sequences"));
}

#[test]
fn a_few_invalid_bytes_in_text_are_each_located() {
    let mut bytes = BASE.as_bytes().to_vec();
    bytes.extend_from_slice(b"# caf\xe9\n");
    let e = parse_spec_bytes("latin1.asteria", &bytes, &common::tests_dir()).expect_err("utf8");
    assert_eq!(e.errors().len(), 1);
    assert_eq!(e.errors()[0].code, "spec::not-utf8");
}

#[test]
fn a_plan_given_as_a_spec_is_one_error_that_says_how_to_run_it() {
    let plan = "{\n  \"format\": \"asteria-plan\",\n  \"version\": 3,\n  \"buffers\": []\n}\n";
    let e = errors_of(plan);
    assert_eq!(e.errors().len(), 1, "{:#?}", e.errors());
    let err = &e.errors()[0];
    assert!(err
        .message
        .contains("is a compiled asteria plan, not a spec"));
    assert!(err
        .help
        .as_deref()
        .is_some_and(|h| h.contains("asteria run")));
    let e = errors_of("  [1, 2, 3]");
    assert_eq!(e.errors().len(), 1);
    assert!(e.errors()[0].message.contains("is JSON, not a spec"));
    assert_eq!(e.items()[0].1, 3);
}

#[test]
fn a_file_over_the_size_limit_is_one_error() {
    let big = "# a comment line\n".repeat(MAX_SPEC_BYTES / 17 + 1) + BASE;
    let e = errors_of(&big);
    assert_eq!(e.errors().len(), 1);
    assert!(e.errors()[0].message.contains("too large for a spec"));
}

/// Printable garbage: words, punctuation and newlines, `n` bytes.
fn garbage(n: usize, lines: bool) -> String {
    const ALPHABET: &[u8] = b"abc xyz={}()[],.0123\"#;@-";
    noise(n, 42)
        .into_iter()
        .map(|b| match b as usize % (ALPHABET.len() + 1) {
            k if k == ALPHABET.len() => {
                if lines {
                    '\n'
                } else {
                    ' '
                }
            }
            k => ALPHABET[k] as char,
        })
        .collect()
}

#[test]
fn garbage_text_reports_a_capped_list_and_a_count() {
    let src = garbage(MAX_SPEC_BYTES, true);
    let e = errors_of(&src);
    assert!(e.total() > MAX_SHOWN_ERRORS, "{}", e.total());
    assert_eq!(e.errors().len(), MAX_SHOWN_ERRORS + 1);
    let last = e.errors().last().expect("the count");
    assert_eq!(last.code, "spec::too-many-errors");
    assert!(
        last.message.contains("more errors") && last.message.contains("parsing stopped"),
        "{}",
        last.message
    );
    assert!(e.to_string().contains("has more than 1000 errors"), "{e}");
    assert!(common::render(&e).len() < 100_000);
}

#[test]
fn garbage_on_one_long_line_renders_windows_of_it() {
    // Recovery skips to the end of a line, so one line gives few errors; each must show a
    // window of the line, not the megabyte.
    let e = errors_of(&garbage(MAX_SPEC_BYTES, false));
    assert!(e.errors().len() > 1);
    let rendered = common::render(&e);
    assert!(rendered.len() < 20_000, "{} bytes", rendered.len());
}

#[test]
fn a_huge_identifier_gets_a_short_message() {
    let src = format!("model gpt2 {{ {} = 1 }}\n", "x".repeat(200_000));
    let e = errors_of(&src);
    for err in e.errors() {
        assert!(err.message.len() < 400, "{} bytes", err.message.len());
        assert!(err.span.end - err.span.start <= 80);
    }
    assert!(common::render(&e).len() < 20_000);
}

#[test]
fn a_note_at_the_far_end_of_a_long_line_does_not_print_the_line() {
    // "unterminated block" underlines the `{` and notes the end of the file.
    let src = format!("model gpt2 {{ vocab = 1 {}", "x = 1 ".repeat(100_000));
    let e = errors_of(&src);
    assert!(e
        .errors()
        .iter()
        .any(|err| err.code == "spec::unterminated"));
    // 51 entries (one per unknown `x`, capped) of a few hundred bytes each; the 600 KB line is
    // not among them.
    let rendered = common::render(&e);
    assert!(rendered.len() < 100_000, "{} bytes", rendered.len());
}

#[test]
fn a_note_far_from_its_error_becomes_a_line_of_the_hint() {
    // Sixty duplicates of a key set 20_000 lines earlier: each snippet would span the file.
    let src = format!(
        "model gpt2 {{\n  vocab = 1\n{}{}}}\n",
        "  # padding\n".repeat(20_000),
        "  vocab = 2\n".repeat(60)
    );
    let e = errors_of(&src);
    let dup = e
        .errors()
        .iter()
        .find(|err| err.code == "spec::duplicate-key")
        .expect("a duplicate");
    assert!(dup.notes.is_empty());
    assert!(
        dup.help
            .as_deref()
            .is_some_and(|h| h.contains("first set here: line 2, column 3")),
        "{:?}",
        dup.help
    );
    let rendered = common::render(&e);
    assert!(rendered.len() < 100_000, "{} bytes", rendered.len());
    // Near notes stay labels.
    let near = "model gpt2 {\n  vocab = 1\n  vocab = 2\n}\n";
    let e = errors_of(near);
    let dup = e
        .errors()
        .iter()
        .find(|err| err.code == "spec::duplicate-key")
        .expect("a duplicate");
    assert_eq!(dup.notes.len(), 1);
}

#[test]
fn budgets_need_units_and_the_right_target() {
    // A bare number: the error asks for a unit.
    let (src, line, col) = with_entry("target", "memory", "24");
    let e = errors_of(&src);
    let items = e.items();
    assert_eq!(items.len(), 1, "{items:#?}");
    assert_eq!((items[0].0, items[0].1), (line, col));
    assert!(items[0].2.contains("unit"), "{}", items[0].2);
    // An unknown unit is a bad number that lists the units.
    let (src, _, _) = with_entry("target", "memory", "24Gb");
    let text = format!("{:?}", errors_of(&src));
    assert!(text.contains("GiB") && text.contains("MB"), "{text}");
    // `gpu_memory` on a CPU target says which key the CPU engine reads.
    let src = BASE.replace("target cpu {", "target cpu {\n  gpu_memory = 8GiB");
    let text = format!("{:?}", errors_of(&src));
    assert!(text.contains("`memory`"), "{text}");
    // `nvme_memory` without a directory.
    let src = BASE.replace("target cpu {", "target cpu {\n  nvme_memory = 100GiB");
    let text = format!("{:?}", errors_of(&src));
    assert!(
        text.contains("needs `nvme`") || text.contains("no `nvme` directory"),
        "{text}"
    );
    // A valid set: sizes in bytes, the directory kept as written.
    let src = BASE.replace(
        "target cpu {",
        "target cpu {\n  memory = 1.5GiB\n  host_memory = 512MB\n  nvme = \"/tmp\"\n  nvme_memory = 2TiB",
    );
    let c = common::parse(&src).expect("valid budgets");
    let b = c.target.budgets();
    assert_eq!(b.device, Some(3 << 29));
    assert_eq!(b.host, Some(512_000_000));
    assert_eq!(b.nvme, Some(2 << 40));
    assert_eq!(b.nvme_dir.as_deref(), Some("/tmp"));
    // `none` is no budget (what `--set target.memory=none` writes to remove one).
    let src = BASE.replace(
        "target cpu {",
        "target cpu {\n  memory = none\n  host_memory = none\n  nvme = none\n  nvme_memory = none",
    );
    let c = common::parse(&src).expect("none budgets");
    assert!(c.target.budgets().is_empty(), "{:?}", c.target.budgets());
}

/// `max_skipped_steps` set with `grad_clip = none`: valid, with a note that it cannot act
/// (the skip test reads the clip's gradient norm); none without it or with a clip.
#[test]
fn max_skipped_steps_without_a_clip_is_noted() {
    let notes = |train: &str| {
        let src = BASE.replace("train {", &format!("train {{\n  {train}"));
        frontend::check_spec("hostile.asteria", &src, &common::tests_dir(), &[])
            .expect("valid")
            .notes
    };
    let n = notes("grad_clip = none\n  max_skipped_steps = 3");
    assert!(
        n.iter()
            .any(|x| x.contains("`max_skipped_steps = 3` has no effect")),
        "{n:?}"
    );
    assert!(notes("grad_clip = none").is_empty());
    assert!(notes("max_skipped_steps = 3").is_empty());
}

/// `optimizer kl-shampoo { }`: one located error that gives the spelling to use, and no
/// cascade (no "unknown optimizer `kl`", no "expected `{`").
#[test]
fn a_hyphenated_block_name_is_one_error_with_the_underscored_spelling() {
    let src = BASE.replace(
        "optimizer soap {\n  lr = 1e-3\n}",
        "optimizer kl-shampoo {\n}",
    );
    let e = errors_of(&src);
    let items = e.items();
    assert_eq!(items.len(), 1, "{items:#?}");
    let (l, c, m) = &items[0];
    assert_eq!((*l, *c), (8, 11), "{m}");
    assert!(m.contains("`kl-shampoo` is not a name"), "{m}");
    let help = e.errors()[0].help.clone().unwrap_or_default();
    assert!(help.contains("`kl_shampoo`"), "{help}");
    // A name with no hyphen is not touched.
    let ok = BASE.replace(
        "optimizer soap {\n  lr = 1e-3\n}",
        "optimizer kl_shampoo {\n}",
    );
    common::parse(&ok).expect("kl_shampoo parses");
}
