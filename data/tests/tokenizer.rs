//! Tokenizer tests: known GPT-2 ids, byte tokens, BPE round trips on Moby-Dick.

use data::{DataError, Tokenizer, BUILTIN_CORPUS, GPT2_EOT};

#[test]
fn gpt2_hello_world_ids() {
    assert_eq!(
        Tokenizer::Gpt2.encode("Hello world").unwrap(),
        vec![15496, 995]
    );
    assert_eq!(Tokenizer::Gpt2.vocab_size(), 50257);
}

#[test]
fn bytes_are_utf8_bytes() {
    let ids = Tokenizer::Bytes.encode("Hé!").unwrap();
    assert_eq!(ids, vec![72, 0xC3, 0xA9, 33]);
    assert_eq!(Tokenizer::Bytes.vocab_size(), 256);
    assert_eq!(Tokenizer::Bytes.decode(&ids).unwrap(), "Hé!");
}

#[test]
fn endoftext_in_text_is_ordinary() {
    let ids = Tokenizer::Gpt2.encode("a<|endoftext|>b").unwrap();
    assert!(!ids.contains(&GPT2_EOT), "{ids:?}");
    assert_eq!(Tokenizer::Gpt2.decode(&ids).unwrap(), "a<|endoftext|>b");
}

#[test]
fn gpt2_roundtrip_moby_dick_excerpt() {
    // Chapter 1 opening: em-dashes and curly apostrophes exercise multi-byte BPE tokens.
    let excerpt: String = BUILTIN_CORPUS.chars().take(5000).collect();
    assert!(excerpt.contains('—') && excerpt.contains('’'));
    let ids = Tokenizer::Gpt2.encode(&excerpt).unwrap();
    assert!(
        ids.len() < excerpt.len() / 3,
        "BPE should compress: {} ids",
        ids.len()
    );
    assert!(ids.iter().all(|&t| t < 50257));
    assert_eq!(Tokenizer::Gpt2.decode(&ids).unwrap(), excerpt);
}

#[test]
fn gpt2_roundtrip_whole_builtin_corpus() {
    let ids = Tokenizer::Gpt2.encode(BUILTIN_CORPUS).unwrap();
    assert_eq!(Tokenizer::Gpt2.decode(&ids).unwrap(), BUILTIN_CORPUS);
}

#[test]
fn decode_rejects_out_of_range_ids() {
    assert!(matches!(
        Tokenizer::Gpt2.decode(&[50257]),
        Err(DataError::TokenOutOfRange { token: 50257, .. })
    ));
    assert!(matches!(
        Tokenizer::Bytes.decode(&[300]),
        Err(DataError::TokenOutOfRange { token: 300, .. })
    ));
}

#[test]
fn decode_lossy_tolerates_split_characters() {
    // '—' (U+2014) is 3 UTF-8 bytes; dropping the last byte leaves invalid UTF-8.
    let ids = Tokenizer::Bytes.encode("a—").unwrap();
    assert!(Tokenizer::Bytes.decode(&ids[..3]).is_err());
    assert_eq!(
        Tokenizer::Bytes.decode_lossy(&ids[..3]).unwrap(),
        "a\u{FFFD}"
    );
}

#[test]
fn names_parse_back() {
    for t in [Tokenizer::Gpt2, Tokenizer::Bytes] {
        assert_eq!(t.name().parse::<Tokenizer>().unwrap(), t);
    }
    let err = "gpt3".parse::<Tokenizer>().unwrap_err();
    assert!(err.to_string().contains("gpt3"), "{err}");
}
