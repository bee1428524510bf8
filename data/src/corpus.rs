//! Corpus sources and [`load_corpus_tokens`]: read text, tokenize (in parallel), cache tokens.

use std::borrow::Cow;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use sha2::{Digest, Sha256};

use crate::{read_tokens, write_tokens, DataError, Tokenizer, BUILTIN_CORPUS};

/// Where the training text comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CorpusSource {
    /// The embedded Moby-Dick text, [`BUILTIN_CORPUS`] (1.2 MB, ~0.3M GPT-2 tokens).
    Builtin,
    /// UTF-8 text files, concatenated in the given order with a document separator
    /// ([`Tokenizer::document_separator`]) between consecutive files.
    Files(Vec<PathBuf>),
}

impl fmt::Display for CorpusSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CorpusSource::Builtin => f.write_str("builtin Moby-Dick"),
            CorpusSource::Files(files) => write!(f, "{} file(s)", files.len()),
        }
    }
}

/// Bumped whenever tokenization or the separator convention changes, to invalidate caches.
const CACHE_FORMAT: &[u8] = b"asteria-data token cache v1\0";

/// Target chunk size for parallel BPE encoding, in bytes.
const CHUNK_BYTES: usize = 1 << 18;

/// Reads and tokenizes a corpus, returning one u16 token stream.
///
/// Files are concatenated in order with [`Tokenizer::document_separator`] between them (GPT-2
/// `<|endoftext|>` = 50256, or `b'\n'` for Bytes); each file is encoded independently, so no BPE
/// merge crosses a file boundary. Encoding runs on all available cores; chunks are split only
/// where the GPT-2 pre-tokenizer would split anyway, so the result equals a sequential
/// [`Tokenizer::encode`] of each file.
///
/// With `cache_dir = Some(dir)` the tokens are cached in `dir` (created if missing) as an llm.c
/// token file named `<tokenizer>-<sha256 prefix>.u16cache`, keyed by the SHA-256 of the
/// tokenizer name and every file's bytes: a second call with the same content is a file read.
/// A corrupt cache file is logged, ignored and rewritten; failing to write the cache is logged
/// and does not fail the load. Logs (tracing, info): token count, cache hit/miss, elapsed time.
///
/// # Errors
/// [`DataError::NoCorpusFiles`] for an empty file list; [`DataError::Io`] for a missing or
/// unreadable file; [`DataError::NotUtf8`] for a file that is not UTF-8 (both name the path);
/// [`DataError::Tokenizer`] if encoding fails.
pub fn load_corpus_tokens(
    source: &CorpusSource,
    tokenizer: Tokenizer,
    cache_dir: Option<&Path>,
) -> Result<Vec<u16>, DataError> {
    let start = Instant::now();
    let docs = read_documents(source)?;
    let text_bytes: usize = docs.iter().map(|d| d.len()).sum();

    let cache_path = cache_dir.map(|dir| {
        let key = cache_key(&docs, tokenizer);
        dir.join(format!("{}-{}.u16cache", tokenizer.name(), &key[..32]))
    });
    if let Some(path) = &cache_path {
        if path.exists() {
            match read_tokens(path) {
                Ok(tokens) => {
                    tracing::info!(
                        corpus = %source,
                        tokenizer = tokenizer.name(),
                        tokens = tokens.len(),
                        cache = %path.display(),
                        elapsed_ms = start.elapsed().as_millis() as u64,
                        "corpus tokens loaded (cache hit)"
                    );
                    return Ok(tokens);
                }
                Err(err) => tracing::warn!(%err, "ignoring unusable token cache; re-tokenizing"),
            }
        }
    }

    let tokens = tokenize_documents(&docs, tokenizer)?;
    tracing::info!(
        corpus = %source,
        tokenizer = tokenizer.name(),
        text_bytes,
        tokens = tokens.len(),
        cache = cache_path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "off".into()),
        elapsed_ms = start.elapsed().as_millis() as u64,
        "corpus tokenized (cache miss)"
    );
    if let (Some(dir), Some(path)) = (cache_dir, &cache_path) {
        if let Err(err) = store_cache(dir, path, &tokens) {
            tracing::warn!(%err, "could not write token cache; continuing without it");
        }
    }
    Ok(tokens)
}

fn read_documents(source: &CorpusSource) -> Result<Vec<Cow<'static, str>>, DataError> {
    match source {
        CorpusSource::Builtin => Ok(vec![Cow::Borrowed(BUILTIN_CORPUS)]),
        CorpusSource::Files(files) if files.is_empty() => Err(DataError::NoCorpusFiles),
        CorpusSource::Files(files) => files
            .iter()
            .map(|path| {
                let bytes = std::fs::read(path).map_err(|source| DataError::Io {
                    path: path.clone(),
                    action: "reading corpus file",
                    source,
                })?;
                String::from_utf8(bytes)
                    .map(Cow::Owned)
                    .map_err(|e| DataError::NotUtf8 {
                        path: path.clone(),
                        valid_up_to: e.utf8_error().valid_up_to(),
                    })
            })
            .collect(),
    }
}

/// Hex SHA-256 of the cache format, tokenizer name and every document (length-prefixed).
fn cache_key(docs: &[Cow<'static, str>], tokenizer: Tokenizer) -> String {
    let mut h = Sha256::new();
    h.update(CACHE_FORMAT);
    h.update(tokenizer.name().as_bytes());
    h.update((docs.len() as u64).to_le_bytes());
    for doc in docs {
        h.update((doc.len() as u64).to_le_bytes());
        h.update(doc.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn store_cache(dir: &Path, path: &Path, tokens: &[u16]) -> Result<(), DataError> {
    std::fs::create_dir_all(dir).map_err(|source| DataError::Io {
        path: dir.to_path_buf(),
        action: "creating token cache directory",
        source,
    })?;
    // Write under a unique temporary name, then rename: readers never see a partial file.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    write_tokens(&tmp, tokens)?;
    std::fs::rename(&tmp, path).map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        DataError::Io {
            path: path.to_path_buf(),
            action: "renaming token cache into place",
            source,
        }
    })
}

/// Encodes every document (chunked, on all cores) and joins them with the separator.
fn tokenize_documents(
    docs: &[Cow<'static, str>],
    tokenizer: Tokenizer,
) -> Result<Vec<u16>, DataError> {
    let chunks: Vec<(usize, &str)> = docs
        .iter()
        .enumerate()
        .flat_map(|(d, doc)| split_for_bpe(doc, CHUNK_BYTES).map(move |c| (d, c)))
        .collect();
    let encoded = encode_parallel(&chunks, tokenizer)?;

    let total: usize = encoded.iter().map(Vec::len).sum::<usize>() + docs.len();
    let sep = to_u16(tokenizer.document_separator())?;
    let mut out = Vec::with_capacity(total);
    for (i, ((doc, _), ids)) in chunks.iter().zip(&encoded).enumerate() {
        if i > 0 && chunks[i - 1].0 != *doc {
            out.push(sep);
        }
        for &id in ids {
            out.push(to_u16(id)?);
        }
    }
    Ok(out)
}

fn to_u16(id: u32) -> Result<u16, DataError> {
    u16::try_from(id).map_err(|_| DataError::TokenOutOfRange {
        token: id,
        limit: u32::from(u16::MAX) + 1,
        context: "u16 token storage",
    })
}

fn encode_parallel(
    chunks: &[(usize, &str)],
    tokenizer: Tokenizer,
) -> Result<Vec<Vec<u32>>, DataError> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(chunks.len().max(1));
    let next = AtomicUsize::new(0);
    // One slot per chunk, filled by whichever worker encodes it.
    type Slot = Option<Result<Vec<u32>, DataError>>;
    let results: Mutex<Vec<Slot>> = Mutex::new((0..chunks.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((_, text)) = chunks.get(i) else {
                    break;
                };
                let r = tokenizer.encode(text);
                if let Ok(mut slots) = results.lock() {
                    slots[i] = Some(r);
                }
            });
        }
    });
    let slots = results.into_inner().map_err(|_| DataError::Tokenizer {
        tokenizer: tokenizer.name(),
        reason: "an encoder thread panicked".into(),
    })?;
    slots
        .into_iter()
        .map(|slot| {
            slot.unwrap_or_else(|| {
                Err(DataError::Tokenizer {
                    tokenizer: tokenizer.name(),
                    reason: "an encoder thread did not finish its chunk".into(),
                })
            })
        })
        .collect()
}

/// Splits `text` into pieces of roughly `target` bytes at positions where GPT-2's pre-tokenizer
/// regex always starts a new piece, so encoding the pieces separately gives the same ids as
/// encoding the whole text.
///
/// A split is placed just before a `'\n'` whose neighbours on both sides are non-whitespace
/// characters: no regex alternative of r50k_base matches across a non-whitespace → `'\n'`
/// transition (letters, numbers, punctuation and contractions exclude `\s`), and a lone `'\n'`
/// followed by non-whitespace is its own piece whether or not text precedes it. Text without
/// such positions stays in one piece.
fn split_for_bpe(text: &str, target: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let cut = find_safe_cut(rest, target).unwrap_or(rest.len());
        let (head, tail) = rest.split_at(cut);
        rest = tail;
        Some(head)
    })
}

fn find_safe_cut(text: &str, target: usize) -> Option<usize> {
    if text.len() <= target * 2 {
        return None;
    }
    let bytes = text.as_bytes();
    // '\n' is ASCII, so every match index is a char boundary.
    bytes[target..]
        .iter()
        .position(|&b| b == b'\n')
        .and_then(|off| {
            let mut p = target + off;
            loop {
                let before = text[..p].chars().next_back();
                let after = text[p + 1..].chars().next();
                let ok = |c: Option<char>| c.is_some_and(|c| !c.is_whitespace());
                if ok(before) && ok(after) {
                    return Some(p);
                }
                p += 1 + bytes[p + 1..].iter().position(|&b| b == b'\n')?;
            }
        })
}
