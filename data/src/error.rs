//! The one error type of the data crate, [`DataError`].

use std::path::PathBuf;

/// Everything that can go wrong while loading, tokenizing, caching or batching training data.
///
/// Variants that concern a file carry its `path`, so every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An I/O operation (`action`, e.g. "reading corpus file") on `path` failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// The file or directory the operation was applied to.
        path: PathBuf,
        /// What was being done, as a lower-case phrase ("reading corpus file").
        action: &'static str,
        /// The underlying OS error.
        #[source]
        source: std::io::Error,
    },

    /// A corpus file is not valid UTF-8; the first `valid_up_to` bytes are.
    #[error("corpus file {} is not valid UTF-8 (first invalid byte at offset {valid_up_to})", path.display())]
    NotUtf8 {
        /// The offending corpus file.
        path: PathBuf,
        /// Byte offset of the first invalid byte.
        valid_up_to: usize,
    },

    /// `CorpusSource::Files` was given an empty list.
    #[error("corpus source lists no files")]
    NoCorpusFiles,

    /// A token file does not start with the llm.c magic number 20240520.
    #[error("token file {} has magic {found}, expected {expected} (not an llm.c/asteria token file)", path.display())]
    BadMagic {
        /// The token file.
        path: PathBuf,
        /// The first i32 of the header.
        found: i32,
        /// The required magic number (20240520).
        expected: i32,
    },

    /// A token file has a header version other than 1 (u16 tokens).
    #[error(
        "token file {} has version {found}, expected {expected} (u16 GPT-2 tokens; llm.c's \
         version 2 holds u32 LLaMA 3 tokens, which asteria does not read)",
        path.display()
    )]
    BadVersion {
        /// The token file.
        path: PathBuf,
        /// The second i32 of the header.
        found: i32,
        /// The supported version (1).
        expected: i32,
    },

    /// A token file's size does not match the token count in its header (truncated, too short
    /// to hold the 1024-byte header, or with trailing bytes).
    #[error(
        "token file {} is {actual_bytes} bytes but its header promises {header_tokens} tokens ({expected_bytes} bytes): {reason}",
        path.display()
    )]
    TokenFileSize {
        /// The token file.
        path: PathBuf,
        /// Token count from the header (negative counts are reported as-is).
        header_tokens: i64,
        /// 1024 + 2 × `header_tokens`, in bytes.
        expected_bytes: u64,
        /// Size of the file on disk, in bytes.
        actual_bytes: u64,
        /// "truncated", "trailing bytes" or "negative token count".
        reason: &'static str,
    },

    /// A token shard holds a token id the model cannot embed (`token >= vocab`).
    #[error(
        "token shard {} holds token id {token} at token {position}, but the model's vocab is \
         {vocab} (ids must be < vocab): set `vocab = {}` or more, or use shards of the model's \
         tokenizer (GPT-2 BPE ids go up to 50256)",
        path.display(),
        *token as usize + 1
    )]
    ShardTokenOutOfRange {
        /// The shard.
        path: PathBuf,
        /// The first offending token id (in file order).
        token: u16,
        /// Its position among the shard's tokens (0-based).
        position: usize,
        /// The model's vocabulary size (rows of the token embedding).
        vocab: usize,
    },

    /// A shard pattern or list named no file.
    #[error("no token shards given for the {split} split")]
    NoShards {
        /// "train" or "validation".
        split: &'static str,
    },

    /// More tokens than the i32 header field can count were to be written.
    #[error("cannot write {count} tokens to {}: the llm.c header holds at most {max}", path.display())]
    TooManyTokens {
        /// The token file being written.
        path: PathBuf,
        /// Number of tokens requested.
        count: usize,
        /// `i32::MAX`.
        max: usize,
    },

    /// A token id does not fit the u16 token-file format or is outside the tokenizer's vocabulary.
    #[error("token id {token} is out of range (must be < {limit}) for {context}")]
    TokenOutOfRange {
        /// The offending id.
        token: u32,
        /// Exclusive upper bound.
        limit: u32,
        /// Where it happened ("u16 token storage", "gpt2 decode", ...).
        context: &'static str,
    },

    /// The GPT-2 BPE tables failed to load or the encoder/decoder failed.
    #[error("tokenizer {tokenizer}: {reason}")]
    Tokenizer {
        /// Tokenizer name ("gpt2" or "bytes").
        tokenizer: &'static str,
        /// What failed.
        reason: String,
    },

    /// An unknown tokenizer name was parsed.
    #[error("unknown tokenizer {name:?} (expected \"gpt2\" or \"bytes\")")]
    UnknownTokenizer {
        /// The name that was given.
        name: String,
    },

    /// `val_fraction` is not a finite number strictly between 0 and 1.
    #[error("val_fraction must be in (0, 1), got {val_fraction}")]
    InvalidValFraction {
        /// The rejected value.
        val_fraction: f64,
    },

    /// A train or validation split is too short for one window of `seq_len + 1` tokens.
    #[error(
        "{split} split has {tokens} tokens, needs at least seq_len + 1 = {needed} (both splits together: {corpus_tokens} tokens)"
    )]
    SplitTooShort {
        /// "train" or "validation".
        split: &'static str,
        /// Tokens in that split.
        tokens: usize,
        /// `seq_len + 1`.
        needed: usize,
        /// Tokens in the whole corpus.
        corpus_tokens: usize,
    },

    /// A train or validation split holds fewer tokens than one batch.
    #[error(
        "the {split} split has {tokens} tokens, fewer than one batch of {batch} × {seq_len} \
         tokens (+1 for the last target) (both splits together: {corpus_tokens} tokens); use a larger \
         corpus, a smaller `batch_size` or `seq_len`{hint}"
    )]
    SmallerThanBatch {
        /// "train" or "validation".
        split: &'static str,
        /// Tokens in that split.
        tokens: usize,
        /// Sequences per batch.
        batch: usize,
        /// Tokens per sequence.
        seq_len: usize,
        /// Tokens in the whole corpus.
        corpus_tokens: usize,
        /// `, or a larger val_fraction` for the validation split.
        hint: &'static str,
    },

    /// A batch was requested with a zero dimension.
    #[error("batch size and seq_len must be positive, got batch={batch}, seq_len={seq_len}")]
    EmptyBatch {
        /// Sequences per batch.
        batch: usize,
        /// Tokens per sequence.
        seq_len: usize,
    },

    /// An output buffer passed to a sampler has the wrong length.
    #[error("{buffer} buffer has {actual} elements, expected batch × seq_len = {expected}")]
    BufferSize {
        /// "inputs" or "targets".
        buffer: &'static str,
        /// `batch * seq_len`.
        expected: usize,
        /// Length of the slice that was passed.
        actual: usize,
    },
}
