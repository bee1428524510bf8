//! Corpus loading tests: concatenation, parallel = sequential encoding, caching, bad files.

use std::path::{Path, PathBuf};

use data::{
    load_corpus_tokens, read_tokens, CorpusSource, DataError, Tokenizer, BUILTIN_CORPUS, GPT2_EOT,
};

fn to_u16(ids: Vec<u32>) -> Vec<u16> {
    ids.into_iter().map(|t| u16::try_from(t).unwrap()).collect()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn cache_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    v.sort();
    v
}

#[test]
fn builtin_parallel_equals_sequential_encode() {
    // The loader splits the text into chunks encoded on several threads; the result must equal
    // encoding the whole text at once.
    let tokens = load_corpus_tokens(&CorpusSource::Builtin, Tokenizer::Gpt2, None).unwrap();
    let expected = to_u16(Tokenizer::Gpt2.encode(BUILTIN_CORPUS).unwrap());
    assert_eq!(tokens.len(), expected.len());
    assert_eq!(tokens, expected);
}

#[test]
fn files_joined_with_separator() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(dir.path(), "a.txt", "Call me Ishmael.\n");
    let b = write(dir.path(), "b.txt", "Four score and seven years ago");
    let source = CorpusSource::Files(vec![a, b]);

    let gpt2 = load_corpus_tokens(&source, Tokenizer::Gpt2, None).unwrap();
    let mut expected = to_u16(Tokenizer::Gpt2.encode("Call me Ishmael.\n").unwrap());
    expected.push(GPT2_EOT as u16);
    expected.extend(to_u16(
        Tokenizer::Gpt2
            .encode("Four score and seven years ago")
            .unwrap(),
    ));
    assert_eq!(gpt2, expected);

    let bytes = load_corpus_tokens(&source, Tokenizer::Bytes, None).unwrap();
    let expected: Vec<u16> = "Call me Ishmael.\n\nFour score and seven years ago"
        .bytes()
        .map(u16::from)
        .collect();
    assert_eq!(bytes, expected);
}

#[test]
fn cache_hit_returns_identical_tokens() {
    let cache = tempfile::tempdir().unwrap();
    let first =
        load_corpus_tokens(&CorpusSource::Builtin, Tokenizer::Gpt2, Some(cache.path())).unwrap();
    let files = cache_files(cache.path());
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_str().unwrap().to_owned();
    assert!(
        name.starts_with("gpt2-") && name.ends_with(".u16cache"),
        "{name}"
    );
    assert_eq!(read_tokens(&files[0]).unwrap(), first);
    let modified = std::fs::metadata(&files[0]).unwrap().modified().unwrap();

    let second =
        load_corpus_tokens(&CorpusSource::Builtin, Tokenizer::Gpt2, Some(cache.path())).unwrap();
    assert_eq!(first, second);
    assert_eq!(cache_files(cache.path()), files, "a hit must not add files");
    assert_eq!(
        std::fs::metadata(&files[0]).unwrap().modified().unwrap(),
        modified,
        "a hit must not rewrite"
    );
}

#[test]
fn cache_key_depends_on_content_and_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let f = write(dir.path(), "f.txt", "one two three");
    let source = CorpusSource::Files(vec![f.clone()]);
    load_corpus_tokens(&source, Tokenizer::Gpt2, Some(&cache)).unwrap();
    load_corpus_tokens(&source, Tokenizer::Bytes, Some(&cache)).unwrap();
    assert_eq!(cache_files(&cache).len(), 2);

    std::fs::write(&f, "one two four").unwrap();
    let changed = load_corpus_tokens(&source, Tokenizer::Gpt2, Some(&cache)).unwrap();
    assert_eq!(
        changed,
        to_u16(Tokenizer::Gpt2.encode("one two four").unwrap())
    );
    assert_eq!(cache_files(&cache).len(), 3);
}

#[test]
fn corrupt_cache_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let f = write(
        dir.path(),
        "f.txt",
        "It was the best of times, it was the worst of times.",
    );
    let source = CorpusSource::Files(vec![f]);
    let cache = dir.path().join("cache");
    let good = load_corpus_tokens(&source, Tokenizer::Gpt2, Some(&cache)).unwrap();
    let path = cache_files(&cache).remove(0);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    assert!(read_tokens(&path).is_err());

    let again = load_corpus_tokens(&source, Tokenizer::Gpt2, Some(&cache)).unwrap();
    assert_eq!(again, good);
    assert_eq!(read_tokens(&path).unwrap(), good, "cache rewritten");
}

#[test]
fn missing_file_is_a_clear_error() {
    let source = CorpusSource::Files(vec![PathBuf::from("/nonexistent/corpus/book.txt")]);
    let err = load_corpus_tokens(&source, Tokenizer::Gpt2, None).unwrap_err();
    assert!(matches!(err, DataError::Io { .. }), "{err}");
    assert!(
        err.to_string().contains("/nonexistent/corpus/book.txt"),
        "{err}"
    );
}

#[test]
fn non_utf8_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("latin1.txt");
    std::fs::write(&p, b"Bruneti\xe8re").unwrap();
    let err = load_corpus_tokens(
        &CorpusSource::Files(vec![p.clone()]),
        Tokenizer::Bytes,
        None,
    )
    .unwrap_err();
    assert!(
        matches!(err, DataError::NotUtf8 { valid_up_to: 7, .. }),
        "{err}"
    );
    assert!(err.to_string().contains(&p.display().to_string()), "{err}");
}

#[test]
fn empty_file_list_is_an_error() {
    let err = load_corpus_tokens(&CorpusSource::Files(vec![]), Tokenizer::Gpt2, None).unwrap_err();
    assert!(matches!(err, DataError::NoCorpusFiles));
}
