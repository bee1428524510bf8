//! llm.c token-file tests: byte layout, round trip, and rejection of damaged files.

use std::path::Path;

use data::{read_tokens, write_tokens, DataError, TOKEN_FILE_HEADER_BYTES};

fn write_raw(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

fn sample_tokens() -> Vec<u16> {
    (0..1000u32).map(|i| (i * 7919 % 65536) as u16).collect()
}

#[test]
fn roundtrip_and_layout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.bin");
    let tokens = sample_tokens();
    write_tokens(&path, &tokens).unwrap();

    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len(), TOKEN_FILE_HEADER_BYTES + 2 * tokens.len());
    let word = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!((word(0), word(1), word(2)), (20240520, 1, 1000));
    assert!((3..256).all(|i| word(i) == 0));
    assert_eq!(u16::from_le_bytes([bytes[1026], bytes[1027]]), tokens[1]);

    assert_eq!(read_tokens(&path).unwrap(), tokens);
}

#[test]
fn empty_file_roundtrip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.bin");
    write_tokens(&path, &[]).unwrap();
    assert_eq!(read_tokens(&path).unwrap(), Vec::<u16>::new());
}

#[test]
fn wrong_magic_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.bin");
    write_tokens(&path, &sample_tokens()).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[0] ^= 0xFF;
    write_raw(&path, &bytes);
    let err = read_tokens(&path).unwrap_err();
    assert!(matches!(err, DataError::BadMagic { .. }), "{err}");
    assert!(err.to_string().contains("m.bin"), "{err}");
}

#[test]
fn wrong_version_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.bin");
    write_tokens(&path, &sample_tokens()).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[4..8].copy_from_slice(&2i32.to_le_bytes());
    write_raw(&path, &bytes);
    let err = read_tokens(&path).unwrap_err();
    assert!(
        matches!(err, DataError::BadVersion { found: 2, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("v.bin"), "{err}");
}

#[test]
fn truncated_file_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trunc.bin");
    write_tokens(&path, &sample_tokens()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    write_raw(&path, &bytes[..bytes.len() - 3]);
    let err = read_tokens(&path).unwrap_err();
    match &err {
        DataError::TokenFileSize {
            header_tokens,
            expected_bytes,
            actual_bytes,
            reason,
            ..
        } => {
            assert_eq!(*header_tokens, 1000);
            assert_eq!(*expected_bytes, 3024);
            assert_eq!(*actual_bytes, 3021);
            assert_eq!(*reason, "truncated");
        }
        other => panic!("unexpected {other}"),
    }
    assert!(err.to_string().contains("trunc.bin"), "{err}");
}

#[test]
fn truncated_header_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hdr.bin");
    write_tokens(&path, &sample_tokens()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    write_raw(&path, &bytes[..100]);
    let err = read_tokens(&path).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TokenFileSize {
                actual_bytes: 100,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn count_mismatch_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("count.bin");
    write_tokens(&path, &sample_tokens()).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    // Header claims fewer tokens than the file holds.
    bytes[8..12].copy_from_slice(&999i32.to_le_bytes());
    write_raw(&path, &bytes);
    let err = read_tokens(&path).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TokenFileSize {
                header_tokens: 999,
                ..
            }
        ),
        "{err}"
    );
    // Negative count.
    bytes[8..12].copy_from_slice(&(-5i32).to_le_bytes());
    write_raw(&path, &bytes);
    let err = read_tokens(&path).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TokenFileSize {
                reason: "negative token count",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn missing_file_names_path() {
    let err = read_tokens(Path::new("/nonexistent/asteria/tokens.bin")).unwrap_err();
    assert!(matches!(err, DataError::Io { .. }));
    assert!(
        err.to_string().contains("/nonexistent/asteria/tokens.bin"),
        "{err}"
    );
}
