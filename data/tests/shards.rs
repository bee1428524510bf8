//! llm.c token shards: memory-mapped loading, concatenation, batches across shard boundaries,
//! and refusal of malformed shards (each error naming the file).

use std::path::{Path, PathBuf};

use data::{load_shards, write_tokens, BatchSampler, DataError, Dataset, TokenShard, TokenStream};

/// Writes `tokens` as an llm.c shard `dir/name` and returns its path.
fn shard(dir: &Path, name: &str, tokens: &[u16]) -> PathBuf {
    let path = dir.join(name);
    write_tokens(&path, tokens).unwrap();
    path
}

/// Tokens `from..to`: a token's value is its position in the whole stream.
fn ramp(from: usize, to: usize) -> Vec<u16> {
    (from..to).map(|i| i as u16).collect()
}

#[test]
fn shards_are_mapped_and_concatenated_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let paths = [
        shard(dir.path(), "a_train_000.bin", &ramp(0, 1000)),
        shard(dir.path(), "a_train_001.bin", &[]),
        shard(dir.path(), "a_train_002.bin", &ramp(1000, 2500)),
    ];
    let one = TokenShard::open(&paths[0]).unwrap();
    assert_eq!(one.len(), 1000);
    assert_eq!(one.tokens()[999], 999);
    assert_eq!(one.path(), paths[0]);

    let stream = load_shards(&paths, 50257).unwrap();
    assert_eq!(stream.len(), 2500);
    assert_eq!(stream.chunks().count(), 2, "the empty shard adds no part");
    assert_eq!(stream.to_vec(), ramp(0, 2500));
    assert_eq!(stream.get(1000), Some(1000));
    assert_eq!(stream.get(2500), None);
    // A slice across the boundary shares the parts.
    let s = stream.slice(990..1010);
    assert_eq!(s.chunks().count(), 2);
    assert_eq!(s.to_vec(), ramp(990, 1010));
    assert_eq!(stream.slice(2400..9999).to_vec(), ramp(2400, 2500));
    assert!(stream.slice(3000..4000).is_empty());
}

/// The same tokens as shards or in memory give the same batches for the same seed: the data
/// position (batches drawn) determines the sampler's state whatever the corpus is made of.
#[test]
fn sharded_and_in_memory_datasets_give_identical_batches() {
    let dir = tempfile::tempdir().unwrap();
    let all = ramp(0, 6000);
    let paths: Vec<PathBuf> = (0..6)
        .map(|i| {
            shard(
                dir.path(),
                &format!("s{i}.bin"),
                &all[i * 1000..(i + 1) * 1000],
            )
        })
        .collect();
    let (batch, seq_len) = (8, 37);
    let sharded = Dataset::split(load_shards(&paths, 65535).unwrap(), 0.1, seq_len).unwrap();
    let memory = Dataset::new(all.clone(), 0.1, seq_len).unwrap();
    assert_eq!(sharded.train().len(), memory.train().len());
    let mut a = BatchSampler::new(sharded, 99);
    let mut b = BatchSampler::new(memory, 99);
    let n = batch * seq_len;
    let (mut xa, mut ya, mut xb, mut yb) = (vec![0; n], vec![0; n], vec![0; n], vec![0; n]);
    let mut crossed = false;
    for _ in 0..300 {
        a.next_train_batch(batch, seq_len, &mut xa, &mut ya)
            .unwrap();
        b.next_train_batch(batch, seq_len, &mut xb, &mut yb)
            .unwrap();
        assert_eq!((&xa, &ya), (&xb, &yb));
        for row in 0..batch {
            let start = xa[row * seq_len] as usize;
            for t in 0..seq_len {
                assert_eq!(xa[row * seq_len + t] as usize, start + t);
                assert_eq!(ya[row * seq_len + t] as usize, start + t + 1);
            }
            crossed |= start / 1000 != (start + seq_len) / 1000;
        }
    }
    assert!(crossed, "some windows span two shards");
    for i in 0..5 {
        a.val_batch(i, batch, seq_len, &mut xa, &mut ya).unwrap();
        b.val_batch(i, batch, seq_len, &mut xb, &mut yb).unwrap();
        assert_eq!((&xa, &ya), (&xb, &yb));
    }
}

#[test]
fn separate_validation_shards() {
    let dir = tempfile::tempdir().unwrap();
    let train = load_shards(&[shard(dir.path(), "t.bin", &ramp(0, 500))], 1000).unwrap();
    let val = load_shards(&[shard(dir.path(), "v.bin", &ramp(500, 600))], 1000).unwrap();
    let ds = Dataset::from_splits(train, val, 16).unwrap();
    assert_eq!(
        (ds.train().len(), ds.val().len(), ds.len()),
        (500, 100, 600)
    );
    assert_eq!(ds.val().get(0), Some(500));
    let err = Dataset::from_splits(TokenStream::default(), ds.val().clone(), 16).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::SplitTooShort {
                split: "train",
                tokens: 0,
                ..
            }
        ),
        "{err}"
    );
}

/// Each malformed shard is refused with the file's name and the reason.
#[test]
fn malformed_shards_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let good = shard(dir.path(), "good.bin", &ramp(0, 100));
    let bytes = std::fs::read(&good).unwrap();
    let write = |name: &str, b: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let truncated = write("truncated.bin", &bytes[..bytes.len() - 10]);
    let trailing = write("trailing.bin", &[&bytes[..], &[0, 0]].concat());
    let mut m = bytes.clone();
    m[0] ^= 0x55;
    let magic = write("magic.bin", &m);
    let mut v = bytes.clone();
    v[4..8].copy_from_slice(&2i32.to_le_bytes());
    let version = write("version.bin", &v);
    let short = write("short.bin", &bytes[..100]);
    for (path, expect) in [
        (&truncated, "truncated"),
        (&trailing, "trailing bytes"),
        (&magic, "has magic"),
        (&version, "has version 2, expected 1"),
        (&short, "shorter than the 1024-byte header"),
    ] {
        let err = load_shards(&[good.clone(), path.clone()], 50257).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains(expect), "{msg}");
    }
    let err = load_shards(&[dir.path().join("missing.bin")], 50257).unwrap_err();
    assert!(matches!(err, DataError::Io { .. }), "{err}");
    assert!(err.to_string().contains("missing.bin"), "{err}");
}

#[test]
fn a_token_id_outside_the_vocab_is_refused_with_its_position() {
    let dir = tempfile::tempdir().unwrap();
    let mut tokens = ramp(0, 200).iter().map(|t| t % 256).collect::<Vec<_>>();
    tokens[150] = 300;
    tokens[170] = 50256;
    let ok = shard(dir.path(), "ok.bin", &ramp(0, 256));
    let bad = shard(dir.path(), "bad.bin", &tokens);
    let err = load_shards(&[ok.clone(), bad.clone()], 256).unwrap_err();
    match &err {
        DataError::ShardTokenOutOfRange {
            path,
            token,
            position,
            vocab,
        } => {
            assert_eq!((path, *token, *position, *vocab), (&bad, 300, 150, 256));
        }
        other => panic!("{other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("bad.bin") && msg.contains("token id 300"),
        "{msg}"
    );
    // The same shards fit a GPT-2 vocabulary.
    assert_eq!(load_shards(&[ok, bad], 50257).unwrap().len(), 456);
}
