//! `engine::nvme::NvmeStore`: bit-exact round trips at awkward sizes, and every failure mode
//! (truncated file, flipped byte, missing directory, absurd reservation, bad regions) reported
//! as the right `NvmeError` variant with a message that names the swap file.
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

use engine::nvme::{NvmeError, NvmeStore, NVME_BLOCK};

const B: u64 = NVME_BLOCK as u64;

/// A temp dir on a real disk (not tmpfs), so `O_DIRECT` is exercised where the machine allows.
fn disk_tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(std::env::temp_dir()).expect("tempdir")
}

/// Deterministic pseudo-random bytes (xorshift64*).
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A store opened with `O_DIRECT` when the filesystem allows it, or forced to buffered I/O.
fn make(dir: &Path, bytes: u64, direct: bool) -> NvmeStore {
    let store = if direct {
        NvmeStore::create(dir, "swap.bin", bytes)
    } else {
        NvmeStore::create_buffered(dir, "swap.bin", bytes)
    }
    .expect("create");
    if !direct {
        assert!(!store.stats().direct_io);
    }
    store
}

fn mentions_path(msg: &str, path: &Path) {
    assert!(
        msg.contains(&path.display().to_string()),
        "message does not name {}: {msg}",
        path.display()
    );
}

#[test]
fn round_trip_is_bit_exact_at_awkward_sizes() {
    round_trip(true);
}

#[test]
fn round_trip_is_bit_exact_with_buffered_io() {
    round_trip(false);
}

fn round_trip(try_direct: bool) {
    let dir = disk_tempdir();
    let sizes = [
        1,
        4095,
        NVME_BLOCK - 1,
        NVME_BLOCK + 7,
        3 * NVME_BLOCK + 12345,
    ];
    // Regions at block-aligned offsets, each with room for its size.
    let mut offsets = Vec::new();
    let mut next = 0u64;
    for &s in &sizes {
        offsets.push(next);
        next += (s as u64).div_ceil(B) * B;
    }
    let reserved = next;
    let store = make(dir.path(), reserved, try_direct);
    assert_eq!(store.reserved_bytes(), reserved);
    assert_eq!(store.path(), dir.path().join("swap.bin"));
    let on_disk = std::fs::metadata(store.path()).expect("metadata").len();
    assert!(
        on_disk >= reserved,
        "only {on_disk} of {reserved} bytes reserved"
    );
    let direct = store.stats().direct_io;
    println!(
        "temp dir {}: O_DIRECT {}",
        std::env::temp_dir().display(),
        if direct {
            "in use"
        } else if try_direct {
            "refused, buffered I/O"
        } else {
            "not tried (create_buffered)"
        }
    );

    let data: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| random_bytes(s, i as u64 + 1))
        .collect();
    for (off, d) in offsets.iter().zip(&data) {
        store.write(*off, d).expect("write");
    }
    // Read back in reverse order: nothing depends on the last write.
    for (off, d) in offsets.iter().zip(&data).rev() {
        let mut back = vec![0xAA; d.len()];
        store.read(*off, &mut back).expect("read");
        assert!(back == *d, "region at {off} ({} bytes) differs", d.len());
    }

    // Overwrite the multi-block region with new bytes, and a one-block region with a shorter
    // payload; neighbours are untouched.
    let new3 = random_bytes(sizes[4], 99);
    store.write(offsets[4], &new3).expect("overwrite");
    let mut back = vec![0; new3.len()];
    store
        .read(offsets[4], &mut back)
        .expect("read after overwrite");
    assert!(back == new3, "overwritten region differs");
    let short = random_bytes(100, 7);
    store.write(offsets[2], &short).expect("shorter overwrite");
    let mut back = vec![0; 100];
    store.read(offsets[2], &mut back).expect("read shorter");
    assert_eq!(back, short);
    for i in [0, 1, 3] {
        let mut back = vec![0; data[i].len()];
        store.read(offsets[i], &mut back).expect("neighbour");
        assert!(back == data[i], "neighbour region {i} changed");
    }
    // The old length of an overwritten block no longer reads.
    let mut wrong = vec![0; NVME_BLOCK - 1];
    let err = store.read(offsets[2], &mut wrong).unwrap_err();
    assert!(
        matches!(err, NvmeError::LengthMismatch { block: 2, written: 100, requested, .. }
            if requested == B - 1),
        "{err:?}"
    );

    // Empty calls are no-ops.
    store.write(0, &[]).expect("empty write");
    store.read(0, &mut []).expect("empty read");

    let stats = store.stats();
    let written: usize = sizes.iter().sum::<usize>() + new3.len() + short.len();
    assert_eq!(stats.bytes_written, written as u64);
    assert!(stats.bytes_read > 0 && stats.read_ms >= 0.0 && stats.write_ms > 0.0);
    assert_eq!(stats.direct_io, direct);

    let path = store.path().to_path_buf();
    drop(store);
    assert!(!path.exists(), "drop must remove the swap file");
}

#[test]
fn truncated_file_is_reported_with_the_block() {
    truncated(true);
    truncated(false);
}

fn truncated(try_direct: bool) {
    let dir = disk_tempdir();
    let store = make(dir.path(), 4 * B, try_direct);
    let direct = store.stats().direct_io;
    let data = random_bytes(3 * NVME_BLOCK + 500, 3);
    store.write(0, &data).expect("write");
    let f = OpenOptions::new()
        .write(true)
        .open(store.path())
        .expect("open");
    f.set_len(B + 100).expect("truncate");

    let mut back = vec![0; data.len()];
    let err = store.read(0, &mut back).unwrap_err();
    match &err {
        NvmeError::Truncated {
            path,
            block,
            offset,
            wanted,
            got,
        } => {
            assert_eq!(path, store.path());
            assert_eq!((*block, *offset, *wanted, *got), (1, B, B, 100));
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("block 1") && msg.contains("truncated"),
        "{msg}"
    );
    mentions_path(&msg, store.path());
    // A short read at the (unaligned) end of the file is not a refusal of O_DIRECT.
    assert_eq!(store.stats().direct_io, direct);
    // Block 0 is still intact.
    let mut first = vec![0; NVME_BLOCK];
    store.read(0, &mut first).expect("block 0");
    assert!(first[..] == data[..NVME_BLOCK]);
}

#[test]
fn flipped_byte_is_reported_as_corrupt() {
    corrupt(true);
    corrupt(false);
}

fn corrupt(try_direct: bool) {
    let dir = disk_tempdir();
    let store = make(dir.path(), 3 * B, try_direct);
    let data = random_bytes(2 * NVME_BLOCK + 4000, 4);
    store.write(0, &data).expect("write");
    let pos = 2 * B + 1234;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(store.path())
        .expect("open");
    let mut byte = [0u8];
    f.read_exact_at(&mut byte, pos).expect("read byte");
    assert_eq!(byte[0], data[pos as usize]);
    f.write_all_at(&[byte[0] ^ 0x10], pos).expect("flip");
    f.sync_all().expect("sync");

    let mut back = vec![0; data.len()];
    let err = store.read(0, &mut back).unwrap_err();
    match &err {
        NvmeError::Corrupt {
            path,
            block,
            offset,
            expected,
            found,
        } => {
            assert_eq!(path, store.path());
            assert_eq!((*block, *offset), (2, 2 * B));
            assert_eq!(*expected, crc32fast_hash(&data[2 * NVME_BLOCK..]));
            assert_ne!(expected, found);
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("block 2") && msg.contains("corrupt"), "{msg}");
    mentions_path(&msg, store.path());
}

/// CRC32 (IEEE), bitwise, so the test does not depend on the crate the store uses.
fn crc32fast_hash(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn missing_directory_is_an_io_error_naming_the_path() {
    let dir = disk_tempdir();
    let missing = dir.path().join("no/such/dir");
    let err = NvmeStore::create(&missing, "swap.bin", B).unwrap_err();
    match &err {
        NvmeError::Io { path, source, .. } => {
            assert_eq!(path, &missing.join("swap.bin"));
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected Io, got {other:?}"),
    }
    mentions_path(&err.to_string(), &missing.join("swap.bin"));
}

#[test]
fn bad_file_name_is_refused() {
    let dir = disk_tempdir();
    for name in ["", "a/b", "/etc/passwd", ".."] {
        let err = NvmeStore::create(dir.path(), name, B).unwrap_err();
        assert!(matches!(err, NvmeError::Io { .. }), "{name}: {err:?}");
        assert!(err.to_string().contains("single path component"), "{err}");
    }
}

#[test]
fn absurd_reservation_says_the_tier_is_full() {
    let dir = disk_tempdir();
    for bytes in [1u64 << 62, u64::MAX] {
        let err = NvmeStore::create(dir.path(), "huge.bin", bytes).unwrap_err();
        assert!(matches!(err, NvmeError::Io { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("nvme_memory") && msg.contains("full") && msg.contains(&bytes.to_string()),
            "{msg}"
        );
        mentions_path(&msg, &dir.path().join("huge.bin"));
        assert!(
            !dir.path().join("huge.bin").exists(),
            "a failed create leaves no file"
        );
    }
}

#[test]
fn misaligned_and_out_of_range_regions_are_refused() {
    let dir = disk_tempdir();
    let reserved = 2 * B + 10;
    let store = NvmeStore::create(dir.path(), "swap.bin", reserved).expect("create");

    let err = store.write(4096, &[1, 2, 3]).unwrap_err();
    assert!(
        matches!(
            err,
            NvmeError::Range {
                offset: 4096,
                len: 3,
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("not a multiple of 1048576"), "{msg}");
    mentions_path(&msg, store.path());

    let err = store.write(2 * B, &[0; 11]).unwrap_err();
    assert!(
        matches!(err, NvmeError::Range { len: 11, reserved: r, .. } if r == reserved),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains(&format!("[0, {reserved})")), "{msg}");
    mentions_path(&msg, store.path());

    let err = store.write(u64::MAX - B + 1, &[0; NVME_BLOCK]).unwrap_err();
    assert!(matches!(err, NvmeError::Range { .. }), "{err:?}");
    let mut buf = [0u8; 1];
    let err = store.read(3 * B, &mut buf).unwrap_err();
    assert!(matches!(err, NvmeError::Range { .. }), "{err:?}");

    // The last, partial block fits exactly.
    let tail = random_bytes(10, 5);
    store.write(2 * B, &tail).expect("tail write");
    let mut back = [0u8; 10];
    store.read(2 * B, &mut back).expect("tail read");
    assert_eq!(back[..], tail[..]);

    // A block never written.
    let err = store.read(B, &mut buf).unwrap_err();
    assert!(
        matches!(err, NvmeError::Unwritten { block: 1, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("never written"));
}

#[test]
fn works_on_tmpfs() {
    // /dev/shm is tmpfs on Linux, which refuses O_DIRECT before Linux 6.6 (the store then
    // falls back to buffered I/O); skip where it is absent.
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        return;
    }
    let Ok(dir) = tempfile::tempdir_in(shm) else {
        return;
    };
    let store = NvmeStore::create(dir.path(), "swap.bin", 2 * B).expect("create");
    let data = random_bytes(NVME_BLOCK + 3, 6);
    store.write(0, &data).expect("write");
    let mut back = vec![0; data.len()];
    store.read(0, &mut back).expect("read");
    assert!(back == data);
    println!("/dev/shm: direct_io = {}", store.stats().direct_io);
}
