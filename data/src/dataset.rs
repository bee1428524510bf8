//! Train/validation split ([`Dataset`]) and seeded batch sampling ([`BatchSampler`]).
//!
//! Batches follow llm.c / nanoGPT: a batch is `batch` windows of `seq_len + 1` consecutive
//! tokens; `inputs` holds the first `seq_len` tokens of each window and `targets` the last
//! `seq_len` (inputs shifted left by one), both row-major `[batch, seq_len]` i32.

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;

use crate::{DataError, TokenStream};

/// A token stream split into a training part and a validation part.
///
/// From one stream ([`Dataset::new`], [`Dataset::split`]): `train()` is `tokens[..n - v]` and
/// `val()` is `tokens[n - v..]` with `v = round(n × val_fraction)`: contiguous, disjoint,
/// together the whole corpus. From two ([`Dataset::from_splits`]): llm.c's separate train and
/// validation shards.
#[derive(Debug, Clone)]
pub struct Dataset {
    train: TokenStream,
    val: TokenStream,
}

impl Dataset {
    /// Splits `tokens` (u16 ids, e.g. from [`crate::load_corpus_tokens`]) into train and
    /// validation; `val_fraction` of the tokens (rounded) go to validation.
    ///
    /// # Errors
    /// [`DataError::InvalidValFraction`] unless `0 < val_fraction < 1`;
    /// [`DataError::SplitTooShort`] if either split has fewer than `seq_len + 1` tokens
    /// (one window); [`DataError::EmptyBatch`] if `seq_len == 0`.
    pub fn new(tokens: Vec<u16>, val_fraction: f64, seq_len: usize) -> Result<Self, DataError> {
        Dataset::split(TokenStream::from(tokens), val_fraction, seq_len)
    }

    /// [`Dataset::new`] for any token stream (memory-mapped shards included): the last
    /// `round(n × val_fraction)` tokens are the validation split.
    ///
    /// # Errors
    /// As [`Dataset::new`].
    pub fn split(
        tokens: TokenStream,
        val_fraction: f64,
        seq_len: usize,
    ) -> Result<Self, DataError> {
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(DataError::InvalidValFraction { val_fraction });
        }
        let n = tokens.len();
        let val_len = ((n as f64) * val_fraction).round() as usize;
        let split = n.saturating_sub(val_len);
        Dataset::from_splits(tokens.slice(0..split), tokens.slice(split..n), seq_len)
    }

    /// A dataset whose training and validation splits are given (llm.c's `*train*.bin` and
    /// `*val*.bin` shards).
    ///
    /// # Errors
    /// [`DataError::SplitTooShort`] if either split has fewer than `seq_len + 1` tokens;
    /// [`DataError::EmptyBatch`] if `seq_len == 0`.
    pub fn from_splits(
        train: TokenStream,
        val: TokenStream,
        seq_len: usize,
    ) -> Result<Self, DataError> {
        if seq_len == 0 {
            return Err(DataError::EmptyBatch { batch: 1, seq_len });
        }
        let dataset = Dataset { train, val };
        dataset.check_split("train", dataset.train.len(), seq_len)?;
        dataset.check_split("validation", dataset.val.len(), seq_len)?;
        Ok(dataset)
    }

    fn check_split(
        &self,
        split: &'static str,
        tokens: usize,
        seq_len: usize,
    ) -> Result<(), DataError> {
        let needed = seq_len.saturating_add(1);
        if tokens < needed {
            return Err(DataError::SplitTooShort {
                split,
                tokens,
                needed,
                corpus_tokens: self.len(),
            });
        }
        Ok(())
    }

    /// Checks that each split holds at least one batch of `batch × seq_len` tokens (+1 for
    /// the last target): a smaller split would repeat its windows within every batch.
    ///
    /// # Errors
    /// [`DataError::SmallerThanBatch`] naming the split, its size and the batch size.
    pub fn check_batch(&self, batch: usize, seq_len: usize) -> Result<(), DataError> {
        let needed = batch.saturating_mul(seq_len).saturating_add(1);
        for (split, tokens, hint) in [
            ("train", self.train.len(), ""),
            ("validation", self.val.len(), ", or a larger `val_fraction`"),
        ] {
            if tokens < needed {
                return Err(DataError::SmallerThanBatch {
                    split,
                    tokens,
                    batch,
                    seq_len,
                    corpus_tokens: self.len(),
                    hint,
                });
            }
        }
        Ok(())
    }

    /// The training split (head of the corpus, or the train shards), u16 token ids.
    pub fn train(&self) -> &TokenStream {
        &self.train
    }

    /// The validation split (tail of the corpus, or the validation shards), u16 token ids.
    pub fn val(&self) -> &TokenStream {
        &self.val
    }

    /// Total number of tokens (train + validation).
    pub fn len(&self) -> usize {
        self.train.len() + self.val.len()
    }

    /// True if the dataset holds no tokens (never the case for a constructed `Dataset`).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of non-overlapping `seq_len + 1`-token windows [`BatchSampler::val_batch`] cycles
    /// through: `(val().len() - 1) / seq_len` (consecutive windows share one boundary token,
    /// the last target of one being the first input of the next). 0 if `seq_len == 0`.
    pub fn val_windows(&self, seq_len: usize) -> usize {
        if seq_len == 0 {
            return 0;
        }
        self.val.len().saturating_sub(1) / seq_len
    }
}

/// Draws training batches at random (seeded, reproducible) and validation batches in order.
///
/// The generator is PCG-64 (`rand_pcg::Pcg64`), whose stream is fixed by the seed on every
/// platform and rand version, so the same seed gives the same batches across runs and machines.
#[derive(Debug, Clone)]
pub struct BatchSampler {
    dataset: Dataset,
    rng: Pcg64,
    /// A window that crosses a boundary between two parts of a stream (two shards) is copied
    /// here.
    scratch: Vec<u16>,
}

impl BatchSampler {
    /// A sampler over `dataset` whose training batches are determined by `seed`.
    pub fn new(dataset: Dataset, seed: u64) -> Self {
        BatchSampler {
            dataset,
            rng: Pcg64::seed_from_u64(seed),
            scratch: Vec::new(),
        }
    }

    /// The dataset being sampled.
    pub fn dataset(&self) -> &Dataset {
        &self.dataset
    }

    /// Fills `inputs` and `targets` (each `batch × seq_len` i32, row-major `[batch, seq_len]`)
    /// with `batch` windows drawn uniformly at random from the training split.
    ///
    /// Each window starts at a uniform offset in `0..=train().len() - seq_len - 1`, so it lies
    /// entirely inside the training split (it may span two shards: shards are concatenated
    /// like the documents of a text corpus); the draws depend only on the seed and the number
    /// of windows drawn before, so replaying `n` batches restores the data position; `targets[b, t] = inputs[b, t + 1]` for
    /// `t < seq_len - 1`, and `targets[b, seq_len - 1]` is the token after the input window.
    ///
    /// # Errors
    /// [`DataError::EmptyBatch`], [`DataError::BufferSize`], or [`DataError::SplitTooShort`]
    /// if `seq_len` is longer than the dataset was built for.
    pub fn next_train_batch(
        &mut self,
        batch: usize,
        seq_len: usize,
        inputs: &mut [i32],
        targets: &mut [i32],
    ) -> Result<(), DataError> {
        check_buffers(batch, seq_len, inputs, targets)?;
        let train_len = self.dataset.train.len();
        self.dataset.check_split("train", train_len, seq_len)?;
        let max_start = train_len - seq_len - 1;
        for b in 0..batch {
            let start = self.rng.random_range(0..=max_start);
            let window = self
                .dataset
                .train
                .window(start, seq_len + 1, &mut self.scratch);
            fill_row(window, seq_len, b, inputs, targets);
        }
        Ok(())
    }

    /// Fills `inputs` and `targets` (each `batch × seq_len` i32) with validation batch number
    /// `index`: windows `index × batch .. (index + 1) × batch` of the validation split, window
    /// `w` starting at token `(w mod val_windows(seq_len)) × seq_len`.
    ///
    /// Deterministic and independent of the seed and of training progress, so validation loss
    /// is comparable across runs; windows do not overlap (apart from the shared boundary
    /// token) and wrap around once `index × batch` passes the end of the split.
    ///
    /// # Errors
    /// [`DataError::EmptyBatch`], [`DataError::BufferSize`], or [`DataError::SplitTooShort`]
    /// if `seq_len` is longer than the dataset was built for.
    pub fn val_batch(
        &self,
        index: usize,
        batch: usize,
        seq_len: usize,
        inputs: &mut [i32],
        targets: &mut [i32],
    ) -> Result<(), DataError> {
        check_buffers(batch, seq_len, inputs, targets)?;
        let val = self.dataset.val();
        self.dataset.check_split("validation", val.len(), seq_len)?;
        let windows = self.dataset.val_windows(seq_len);
        let mut scratch = Vec::new();
        for b in 0..batch {
            let w = index.wrapping_mul(batch).wrapping_add(b) % windows;
            let window = val.window(w * seq_len, seq_len + 1, &mut scratch);
            fill_row(window, seq_len, b, inputs, targets);
        }
        Ok(())
    }
}

fn check_buffers(
    batch: usize,
    seq_len: usize,
    inputs: &[i32],
    targets: &[i32],
) -> Result<(), DataError> {
    if batch == 0 || seq_len == 0 {
        return Err(DataError::EmptyBatch { batch, seq_len });
    }
    let expected = batch.saturating_mul(seq_len);
    for (buffer, actual) in [("inputs", inputs.len()), ("targets", targets.len())] {
        if actual != expected {
            return Err(DataError::BufferSize {
                buffer,
                expected,
                actual,
            });
        }
    }
    Ok(())
}

/// Writes one `seq_len + 1`-token window into row `b` of `inputs` and `targets`.
fn fill_row(window: &[u16], seq_len: usize, b: usize, inputs: &mut [i32], targets: &mut [i32]) {
    let row = b * seq_len..(b + 1) * seq_len;
    for ((x, y), pair) in inputs[row.clone()]
        .iter_mut()
        .zip(&mut targets[row])
        .zip(window.windows(2))
    {
        *x = i32::from(pair[0]);
        *y = i32::from(pair[1]);
    }
}
