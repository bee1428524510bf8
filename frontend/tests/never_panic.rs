//! The frontend never panics: random bytes, token soup and mutations of a valid spec all come
//! back as `Ok` or as diagnostics that render.

mod common;

use proptest::prelude::*;

const TINY: &str = include_str!("../../examples/tiny-soap.asteria");

/// Parses `bytes` and renders any diagnostics (rendering must not panic either).
fn check(bytes: &[u8]) {
    match frontend::parse_spec_bytes("fuzz.asteria", bytes, &common::tests_dir()) {
        Ok(c) => assert!(!c.name.is_empty()),
        Err(e) => {
            assert!(!e.errors().is_empty(), "an error report must hold an error");
            let text = e.source_text();
            for err in e.errors() {
                assert!(err.span.start <= err.span.end && err.span.end <= text.len());
                assert!(
                    text.is_char_boundary(err.span.start) && text.is_char_boundary(err.span.end)
                );
            }
            assert!(!common::render(&e).is_empty());
        }
    }
}

fn token() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("model".to_string()),
        Just("optimizer".to_string()),
        Just("data".to_string()),
        Just("train".to_string()),
        Just("target".to_string()),
        Just("gpt2".to_string()),
        Just("soap".to_string()),
        Just("{".to_string()),
        Just("}".to_string()),
        Just("=".to_string()),
        Just("(".to_string()),
        Just(")".to_string()),
        Just("[".to_string()),
        Just("]".to_string()),
        Just(",".to_string()),
        Just("\"".to_string()),
        Just("#".to_string()),
        Just("\\".to_string()),
        Just("\n".to_string()),
        Just("\r\n".to_string()),
        Just(" ".to_string()),
        Just("none".to_string()),
        Just("vocab".to_string()),
        Just("seq_len".to_string()),
        Just("betas".to_string()),
        Just("corpus".to_string()),
        Just("-".to_string()),
        Just("é∑🦀".to_string()),
        "[a-z_]{1,8}",
        "[0-9_.eE+-]{1,10}",
        any::<char>().prop_map(|c| c.to_string()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    #[test]
    fn random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        check(&bytes);
    }

    #[test]
    fn random_strings(s in "\\PC{0,300}") {
        check(s.as_bytes());
    }

    #[test]
    fn token_soup(tokens in proptest::collection::vec(token(), 0..120)) {
        check(tokens.concat().as_bytes());
    }

    #[test]
    fn mutated_example(
        edits in proptest::collection::vec((0..TINY.len(), 0usize..12, token()), 1..6),
    ) {
        let mut bytes = TINY.as_bytes().to_vec();
        for (at, del, insert) in edits {
            let at = at.min(bytes.len());
            let end = (at + del).min(bytes.len());
            bytes.splice(at..end, insert.into_bytes());
        }
        check(&bytes);
    }

    /// `--set` arguments made of tokens (and any characters) never panic, and their errors
    /// lie inside the text and render.
    #[test]
    fn random_overrides(
        args in proptest::collection::vec(
            (
                prop_oneof![
                    Just("train".to_string()),
                    Just("data".to_string()),
                    Just("target".to_string()),
                    "\\PC{0,8}",
                ],
                proptest::collection::vec(token(), 0..8),
            ),
            1..4,
        ),
    ) {
        let sets: Vec<String> = args
            .into_iter()
            .map(|(block, tokens)| format!("{block}.{}", tokens.concat()))
            .collect();
        match frontend::check_spec("fuzz.asteria", TINY, &common::tests_dir(), &sets) {
            Ok(c) => assert!(!c.config.name.is_empty()),
            Err(e) => {
                let text = e.source_text();
                for err in e.errors() {
                    assert!(err.span.start <= err.span.end && err.span.end <= text.len());
                }
                let _ = e.items();
                assert!(!common::render(&e).is_empty());
            }
        }
    }
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let src = format!(
        "train {{ steps = {}1{} }}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    check(src.as_bytes());
    let e = common::parse(&src).expect_err("too deep");
    assert!(e
        .items()
        .iter()
        .any(|(_, _, m)| m.contains("nested deeper than 32")));
}

#[test]
fn long_lines_and_many_errors() {
    let src = "@".repeat(50_000) + &"\nx = 1".repeat(2_000);
    check(src.as_bytes());
}
