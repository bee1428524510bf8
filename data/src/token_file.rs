//! Token files in the llm.c / nanoGPT `.bin` layout.
//!
//! Layout (all little-endian): a header of 256 × i32 — `[0]` magic 20240520, `[1]` version 1,
//! `[2]` token count N, `[3..256]` zero — followed by N × u16 token ids. Total size
//! 1024 + 2N bytes. This is the format of llm.c's `dev/data/*.bin` shards
//! (`write_datafile` in `dev/data/data_common.py`), so files are interchangeable with llm.c.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;

use crate::DataError;

/// Magic number in header word 0 (llm.c's token-file magic).
pub const TOKEN_FILE_MAGIC: i32 = 20240520;
/// Header word 1: version 1 means u16 tokens.
pub const TOKEN_FILE_VERSION: i32 = 1;
/// Header size in bytes (256 × i32).
pub const TOKEN_FILE_HEADER_BYTES: usize = 256 * 4;

/// Writes `tokens` to `path` in the llm.c layout, replacing any existing file.
///
/// Output size: 1024 + 2 × `tokens.len()` bytes. The write is not atomic; callers that need
/// atomicity write to a temporary name and rename (as the corpus cache does).
///
/// # Errors
/// [`DataError::TooManyTokens`] above `i32::MAX` tokens; [`DataError::Io`] on any I/O failure.
pub fn write_tokens(path: &Path, tokens: &[u16]) -> Result<(), DataError> {
    let count = i32::try_from(tokens.len()).map_err(|_| DataError::TooManyTokens {
        path: path.to_path_buf(),
        count: tokens.len(),
        max: i32::MAX as usize,
    })?;
    let io_err = |source| DataError::Io {
        path: path.to_path_buf(),
        action: "writing token file",
        source,
    };
    let mut header = [0i32; 256];
    header[0] = TOKEN_FILE_MAGIC;
    header[1] = TOKEN_FILE_VERSION;
    header[2] = count;
    let mut bytes = Vec::with_capacity(TOKEN_FILE_HEADER_BYTES + 2 * tokens.len());
    for word in header {
        bytes.extend_from_slice(&word.to_le_bytes());
    }
    for &t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    let mut out = BufWriter::new(File::create(path).map_err(io_err)?);
    out.write_all(&bytes).map_err(io_err)?;
    out.flush().map_err(io_err)?;
    out.into_inner()
        .map_err(|e| io_err(e.into_error()))?
        .sync_all()
        .map_err(io_err)
}

/// Reads a token file written by [`write_tokens`] (or by llm.c) and returns its u16 tokens.
///
/// # Errors
/// - [`DataError::Io`] if the file cannot be opened or read;
/// - [`DataError::TokenFileSize`] if it is shorter than the 1024-byte header, is truncated,
///   has trailing bytes, or the header's count is negative;
/// - [`DataError::BadMagic`] / [`DataError::BadVersion`] for a foreign header.
pub fn read_tokens(path: &Path) -> Result<Vec<u16>, DataError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            action: "reading token file",
            source,
        })?;
    check_header(path, &bytes, bytes.len() as u64)?;
    Ok(bytes[TOKEN_FILE_HEADER_BYTES..]
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect())
}

/// Checks the llm.c header at the start of `head` (the file's first bytes: all of them, or at
/// least [`TOKEN_FILE_HEADER_BYTES`]) against the file's size `actual_bytes`; returns the token
/// count. Errors as [`read_tokens`] (without I/O).
pub(crate) fn check_header(
    path: &Path,
    head: &[u8],
    actual_bytes: u64,
) -> Result<usize, DataError> {
    let word = |i: usize| {
        let mut w = [0u8; 4];
        w.copy_from_slice(&head[4 * i..4 * i + 4]);
        i32::from_le_bytes(w)
    };
    if actual_bytes < TOKEN_FILE_HEADER_BYTES as u64 || head.len() < TOKEN_FILE_HEADER_BYTES {
        // Too short for a header; report what the header claims if the first words exist.
        let header_tokens = if head.len() >= 12 {
            i64::from(word(2))
        } else {
            0
        };
        return Err(DataError::TokenFileSize {
            path: path.to_path_buf(),
            header_tokens,
            expected_bytes: expected_bytes(header_tokens),
            actual_bytes,
            reason: "shorter than the 1024-byte header",
        });
    }
    let magic = word(0);
    if magic != TOKEN_FILE_MAGIC {
        return Err(DataError::BadMagic {
            path: path.to_path_buf(),
            found: magic,
            expected: TOKEN_FILE_MAGIC,
        });
    }
    let version = word(1);
    if version != TOKEN_FILE_VERSION {
        return Err(DataError::BadVersion {
            path: path.to_path_buf(),
            found: version,
            expected: TOKEN_FILE_VERSION,
        });
    }
    let header_tokens = i64::from(word(2));
    let expected = expected_bytes(header_tokens);
    let reason = if header_tokens < 0 {
        Some("negative token count")
    } else if actual_bytes < expected {
        Some("truncated")
    } else if actual_bytes > expected {
        Some("trailing bytes after the last token")
    } else {
        None
    };
    if let Some(reason) = reason {
        return Err(DataError::TokenFileSize {
            path: path.to_path_buf(),
            header_tokens,
            expected_bytes: expected,
            actual_bytes,
            reason,
        });
    }
    Ok(header_tokens as usize)
}

fn expected_bytes(header_tokens: i64) -> u64 {
    TOKEN_FILE_HEADER_BYTES as u64 + 2 * header_tokens.max(0) as u64
}
