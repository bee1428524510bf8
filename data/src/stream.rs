//! Token streams: token sequences held in memory or memory-mapped from llm.c shards, seen as
//! one concatenated stream ([`TokenStream`]); [`TokenShard`] and [`load_shards`] read llm.c /
//! nanoGPT `.bin` shards without loading them into memory.

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use memmap2::Mmap;

use crate::token_file::check_header;
use crate::{DataError, TOKEN_FILE_HEADER_BYTES};

/// One llm.c token file (the layout of [`crate::write_tokens`]: a 256 × i32 header with magic
/// 20240520, version 1 and the token count N, then N × u16 little-endian token ids), opened
/// read-only and memory-mapped: its tokens are read from the page cache as batches need them,
/// so a shard of any size costs no heap memory.
///
/// The file must not be truncated or rewritten while it is open (as with llm.c, a shard that
/// shrinks under a mapping makes reads fault).
pub struct TokenShard {
    path: PathBuf,
    tokens: ShardTokens,
}

enum ShardTokens {
    /// The mapping; the tokens are `map[1024..]` viewed as `[u16]` (little-endian hosts).
    Mapped(Mmap),
    /// Decoded copy, where the mapping cannot be viewed in place (big-endian hosts).
    Decoded(Vec<u16>),
}

impl TokenShard {
    /// Opens `path`, checks its header against its size and maps it.
    ///
    /// # Errors
    /// [`DataError::Io`] if it cannot be opened, read or mapped; [`DataError::BadMagic`],
    /// [`DataError::BadVersion`] or [`DataError::TokenFileSize`] (truncated, trailing bytes,
    /// shorter than the header, negative count) for a malformed shard; all name the file.
    pub fn open(path: &Path) -> Result<TokenShard, DataError> {
        let io = |action: &'static str| {
            move |source| DataError::Io {
                path: path.to_path_buf(),
                action,
                source,
            }
        };
        let mut file = File::open(path).map_err(io("opening token shard"))?;
        let size = file
            .metadata()
            .map_err(io("reading token shard metadata"))?
            .len();
        let mut head = Vec::with_capacity(TOKEN_FILE_HEADER_BYTES);
        (&mut file)
            .take(TOKEN_FILE_HEADER_BYTES as u64)
            .read_to_end(&mut head)
            .map_err(io("reading token shard header"))?;
        let count = check_header(path, &head, size)?;
        // SAFETY: the mapping is read-only and private to this process; the only hazard is the
        // file shrinking while mapped (reads past its new end fault), which the type's
        // documentation rules out, as llm.c's loader does.
        let map = unsafe { Mmap::map(&file) }.map_err(io("memory-mapping token shard"))?;
        // The file may have changed between the size check and the mapping.
        check_header(path, &map[..TOKEN_FILE_HEADER_BYTES], map.len() as u64)?;
        let shard = TokenShard {
            path: path.to_path_buf(),
            tokens: ShardTokens::Mapped(map),
        };
        if shard.view().is_some_and(|t| t.len() == count) {
            return Ok(shard);
        }
        let ShardTokens::Mapped(map) = &shard.tokens else {
            unreachable!("constructed mapped above")
        };
        let decoded = map[TOKEN_FILE_HEADER_BYTES..]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        Ok(TokenShard {
            path: shard.path,
            tokens: ShardTokens::Decoded(decoded),
        })
    }

    /// The mapped tokens viewed in place: little-endian hosts, aligned mapping.
    fn view(&self) -> Option<&[u16]> {
        match &self.tokens {
            ShardTokens::Decoded(v) => Some(v),
            ShardTokens::Mapped(map) if cfg!(target_endian = "little") => {
                // SAFETY: every bit pattern is a valid u16; `align_to` only yields the aligned
                // middle part, and the mapping's start is page-aligned, so the 1024-byte header
                // leaves the tokens aligned (checked: the prefix and suffix are empty).
                let (pre, tokens, post) =
                    unsafe { map[TOKEN_FILE_HEADER_BYTES..].align_to::<u16>() };
                (pre.is_empty() && post.is_empty()).then_some(tokens)
            }
            ShardTokens::Mapped(_) => None,
        }
    }

    /// The shard's token ids, in file order.
    pub fn tokens(&self) -> &[u16] {
        self.view().unwrap_or(&[])
    }

    /// The file this shard was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of tokens (the header's count).
    pub fn len(&self) -> usize {
        self.tokens().len()
    }

    /// Whether the shard holds no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Debug for TokenShard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenShard")
            .field("path", &self.path)
            .field("tokens", &self.len())
            .finish()
    }
}

/// Where the tokens of a part of a stream live.
#[derive(Debug)]
enum Source {
    Memory(Vec<u16>),
    Shard(TokenShard),
}

impl Source {
    fn tokens(&self) -> &[u16] {
        match self {
            Source::Memory(v) => v,
            Source::Shard(s) => s.tokens(),
        }
    }
}

/// A contiguous range of one source.
#[derive(Clone, Debug)]
struct Part {
    source: Arc<Source>,
    range: Range<usize>,
}

impl Part {
    fn tokens(&self) -> &[u16] {
        &self.source.tokens()[self.range.clone()]
    }
}

/// A sequence of u16 token ids made of one or more parts (an in-memory vector, memory-mapped
/// shards) concatenated in order. Cloning shares the parts; [`TokenStream::slice`] takes a
/// sub-range without copying.
#[derive(Clone, Debug, Default)]
pub struct TokenStream {
    parts: Vec<Part>,
    /// `ends[i]` = tokens in parts `0..=i` (strictly increasing: no part is empty).
    ends: Vec<usize>,
}

impl From<Vec<u16>> for TokenStream {
    fn from(tokens: Vec<u16>) -> Self {
        TokenStream::from_sources(vec![Source::Memory(tokens)])
    }
}

impl TokenStream {
    fn from_sources(sources: Vec<Source>) -> Self {
        let mut stream = TokenStream::default();
        for source in sources {
            let len = source.tokens().len();
            stream.push(Part {
                source: Arc::new(source),
                range: 0..len,
            });
        }
        stream
    }

    fn push(&mut self, part: Part) {
        if part.range.is_empty() {
            return;
        }
        let end = self.len() + part.range.len();
        self.parts.push(part);
        self.ends.push(end);
    }

    /// The shards, concatenated in the given order (empty shards contribute nothing).
    pub fn from_shards(shards: Vec<TokenShard>) -> Self {
        TokenStream::from_sources(shards.into_iter().map(Source::Shard).collect())
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.ends.last().copied().unwrap_or(0)
    }

    /// Whether the stream holds no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The index of the part holding token `i` (`i < len()`).
    fn part_of(&self, i: usize) -> usize {
        self.ends.partition_point(|&end| end <= i)
    }

    fn part_start(&self, p: usize) -> usize {
        if p == 0 {
            0
        } else {
            self.ends[p - 1]
        }
    }

    /// Token `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<u16> {
        if i >= self.len() {
            return None;
        }
        let p = self.part_of(i);
        Some(self.parts[p].tokens()[i - self.part_start(p)])
    }

    /// The tokens in order.
    pub fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        self.chunks().flat_map(|c| c.iter().copied())
    }

    /// The stream's contiguous pieces, in order (one per part; their concatenation is the
    /// stream).
    pub fn chunks(&self) -> impl Iterator<Item = &[u16]> + '_ {
        self.parts.iter().map(Part::tokens)
    }

    /// The tokens as one vector (copies them; for tests and small streams).
    pub fn to_vec(&self) -> Vec<u16> {
        self.iter().collect()
    }

    /// Tokens `range` of this stream (clamped to its length), sharing the parts.
    pub fn slice(&self, range: Range<usize>) -> TokenStream {
        let (lo, hi) = (range.start.min(self.len()), range.end.min(self.len()));
        let mut out = TokenStream::default();
        if lo >= hi {
            return out;
        }
        for p in self.part_of(lo)..self.parts.len() {
            let start = self.part_start(p);
            if start >= hi {
                break;
            }
            let part = &self.parts[p];
            let a = part.range.start + lo.saturating_sub(start);
            let b = part.range.start + (hi - start).min(part.range.len());
            out.push(Part {
                source: Arc::clone(&part.source),
                range: a..b,
            });
        }
        out
    }

    /// Tokens `start..start + len` (which must lie inside the stream): a slice of one part, or,
    /// when the window crosses a boundary between parts, a copy in `scratch`.
    pub(crate) fn window<'a>(
        &'a self,
        start: usize,
        len: usize,
        scratch: &'a mut Vec<u16>,
    ) -> &'a [u16] {
        let p = self.part_of(start);
        let off = start - self.part_start(p);
        let first = self.parts[p].tokens();
        if off + len <= first.len() {
            return &first[off..off + len];
        }
        scratch.clear();
        scratch.extend_from_slice(&first[off..]);
        for part in &self.parts[p + 1..] {
            let need = len - scratch.len();
            if need == 0 {
                break;
            }
            let t = part.tokens();
            scratch.extend_from_slice(&t[..need.min(t.len())]);
        }
        scratch
    }
}

/// Tokens per unit of work of the token-id scan (32 MiB of a shard).
const SCAN_CHUNK: usize = 1 << 24;

/// Opens the llm.c shards `paths` ([`TokenShard::open`]: header and size checked, memory-mapped)
/// and checks that every token id is below `vocab` (a scan of every shard on all cores, at
/// the speed of reading them), then concatenates them in the given order.
///
/// # Errors
/// The first malformed shard's error (in `paths` order), naming the file; or
/// [`DataError::ShardTokenOutOfRange`] naming the shard, the first id `>= vocab` in it and
/// its position.
pub fn load_shards(paths: &[PathBuf], vocab: usize) -> Result<TokenStream, DataError> {
    let start = Instant::now();
    let shards = paths
        .iter()
        .map(|p| TokenShard::open(p))
        .collect::<Result<Vec<_>, _>>()?;
    check_vocab(&shards, vocab)?;
    let stream = TokenStream::from_shards(shards);
    tracing::info!(
        shards = paths.len(),
        tokens = stream.len(),
        elapsed_ms = start.elapsed().as_millis() as u64,
        "token shards mapped and checked"
    );
    Ok(stream)
}

/// [`DataError::ShardTokenOutOfRange`] for the first (shard, position) whose id is `>= vocab`.
fn check_vocab(shards: &[TokenShard], vocab: usize) -> Result<(), DataError> {
    if vocab > usize::from(u16::MAX) {
        return Ok(());
    }
    let work: Vec<(usize, usize)> = shards
        .iter()
        .enumerate()
        .flat_map(|(s, shard)| (0..shard.len()).step_by(SCAN_CHUNK).map(move |at| (s, at)))
        .collect();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(work.len().max(1));
    let next = AtomicUsize::new(0);
    // The first offending (shard, position, token) found, in file order.
    let first: Mutex<Option<(usize, usize, u16)>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(s, at)) = work.get(i) else {
                    break;
                };
                let tokens = shards[s].tokens();
                let chunk = &tokens[at..(at + SCAN_CHUNK).min(tokens.len())];
                // `max` vectorises; the position is looked for only in a bad chunk.
                if chunk
                    .iter()
                    .copied()
                    .max()
                    .is_some_and(|m| usize::from(m) >= vocab)
                {
                    if let Some(k) = chunk.iter().position(|&t| usize::from(t) >= vocab) {
                        let found = (s, at + k, chunk[k]);
                        if let Ok(mut f) = first.lock() {
                            if f.is_none_or(|(fs, fp, _)| (s, at + k) < (fs, fp)) {
                                *f = Some(found);
                            }
                        }
                    }
                }
            });
        }
    });
    match first.into_inner().ok().flatten() {
        None => Ok(()),
        Some((s, position, token)) => Err(DataError::ShardTokenOutOfRange {
            path: shards[s].path.clone(),
            token,
            position,
            vocab,
        }),
    }
}
