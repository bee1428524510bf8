//! Dataset split and batch sampler tests.

use data::{BatchSampler, DataError, Dataset};

/// Tokens 0..n: a token's value is its position, so windows can be located exactly.
fn ramp(n: usize) -> Vec<u16> {
    (0..n).map(|i| i as u16).collect()
}

#[test]
fn split_is_disjoint_and_sized() {
    let ds = Dataset::new(ramp(10_000), 0.1, 64).unwrap();
    assert_eq!(ds.len(), 10_000);
    assert_eq!(ds.val().len(), 1000);
    assert_eq!(ds.train().len(), 9000);
    assert_eq!(ds.train().get(8999), Some(8999));
    assert_eq!(
        ds.val().get(0),
        Some(9000),
        "validation is the tail, right after train"
    );
}

#[test]
fn split_rounds_val_fraction() {
    let ds = Dataset::new(ramp(1001), 0.25, 8).unwrap();
    assert_eq!(ds.val().len(), 250); // 250.25 rounds to 250
    assert_eq!(ds.train().len() + ds.val().len(), 1001);
}

#[test]
fn too_short_splits_rejected() {
    // 1000 tokens, 1% validation = 10 tokens < seq_len + 1 = 17.
    let err = Dataset::new(ramp(1000), 0.01, 16).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::SplitTooShort {
                split: "validation",
                tokens: 10,
                needed: 17,
                ..
            }
        ),
        "{err}"
    );
    let err = Dataset::new(ramp(1000), 0.99, 16).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::SplitTooShort {
                split: "train",
                tokens: 10,
                ..
            }
        ),
        "{err}"
    );
    assert!(Dataset::new(ramp(34), 0.5, 16).is_ok()); // exactly 17 + 17
}

#[test]
fn bad_val_fraction_rejected() {
    for f in [0.0, 1.0, -0.1, f64::NAN] {
        assert!(
            matches!(
                Dataset::new(ramp(1000), f, 4),
                Err(DataError::InvalidValFraction { .. })
            ),
            "{f}"
        );
    }
}

#[test]
fn train_batches_are_shifted_windows_inside_train() {
    let (batch, seq_len) = (8, 32);
    let ds = Dataset::new(ramp(5000), 0.2, seq_len).unwrap();
    let train_len = ds.train().len();
    let mut sampler = BatchSampler::new(ds, 7);
    let mut x = vec![0i32; batch * seq_len];
    let mut y = vec![0i32; batch * seq_len];
    let mut starts = std::collections::HashSet::new();
    for _ in 0..200 {
        sampler
            .next_train_batch(batch, seq_len, &mut x, &mut y)
            .unwrap();
        for b in 0..batch {
            let row = &x[b * seq_len..(b + 1) * seq_len];
            let trow = &y[b * seq_len..(b + 1) * seq_len];
            let start = row[0] as usize;
            starts.insert(start);
            // Consecutive corpus tokens, targets shifted by one, last target inside train.
            for t in 0..seq_len {
                assert_eq!(row[t] as usize, start + t);
                assert_eq!(trow[t] as usize, start + t + 1);
            }
            assert!(
                start + seq_len < train_len,
                "window {start}..={} leaves train",
                start + seq_len
            );
        }
    }
    assert!(
        starts.len() > 1000,
        "starts should be spread out, got {}",
        starts.len()
    );
}

#[test]
fn same_seed_same_batches() {
    let (batch, seq_len) = (4, 16);
    let ds = Dataset::new(ramp(3000), 0.1, seq_len).unwrap();
    let mut a = BatchSampler::new(ds.clone(), 1234);
    let mut b = BatchSampler::new(ds.clone(), 1234);
    let mut c = BatchSampler::new(ds, 1235);
    let n = batch * seq_len;
    let (mut xa, mut ya, mut xb, mut yb, mut xc, mut yc) = (
        vec![0; n],
        vec![0; n],
        vec![0; n],
        vec![0; n],
        vec![0; n],
        vec![0; n],
    );
    let mut differs = false;
    for _ in 0..20 {
        a.next_train_batch(batch, seq_len, &mut xa, &mut ya)
            .unwrap();
        b.next_train_batch(batch, seq_len, &mut xb, &mut yb)
            .unwrap();
        c.next_train_batch(batch, seq_len, &mut xc, &mut yc)
            .unwrap();
        assert_eq!((&xa, &ya), (&xb, &yb));
        differs |= xa != xc;
    }
    assert!(differs, "a different seed should give different batches");
}

#[test]
fn seeded_stream_is_pinned() {
    // Guards reproducibility across runs, machines and dependency updates: the window starts
    // of the first batch for seed 42 (Pcg64 + rand 0.9 `random_range`).
    let ds = Dataset::new(ramp(60_000), 0.1, 64).unwrap();
    let mut s = BatchSampler::new(ds, 42);
    let (mut x, mut y) = (vec![0; 4 * 64], vec![0; 4 * 64]);
    s.next_train_batch(4, 64, &mut x, &mut y).unwrap();
    let starts: Vec<i32> = (0..4).map(|b| x[b * 64]).collect();
    assert_eq!(
        starts,
        [34342, 9340, 32560, 47739],
        "seeded batch stream changed"
    );
}

#[test]
fn val_batches_sequential_disjoint_deterministic_wrapping() {
    let (batch, seq_len) = (3, 10);
    // 1000 tokens, 10% val = 100 tokens at 900..1000 -> (100 - 1) / 10 = 9 windows.
    let ds = Dataset::new(ramp(1000), 0.1, seq_len).unwrap();
    assert_eq!(ds.val_windows(seq_len), 9);
    let mut s = BatchSampler::new(ds, 0);
    let (mut x, mut y) = (vec![0; batch * seq_len], vec![0; batch * seq_len]);

    let mut seen = Vec::new();
    for index in 0..3 {
        s.val_batch(index, batch, seq_len, &mut x, &mut y).unwrap();
        for b in 0..batch {
            let row = &x[b * seq_len..(b + 1) * seq_len];
            let trow = &y[b * seq_len..(b + 1) * seq_len];
            let w = index * batch + b;
            assert_eq!(
                row[0],
                900 + (w * seq_len) as i32,
                "window {w} starts after window {}",
                w.wrapping_sub(1)
            );
            assert!(row.iter().zip(trow).all(|(a, t)| t - a == 1));
            assert!(*trow.last().unwrap() < 1000);
            seen.extend_from_slice(row);
        }
    }
    // Inputs of the 9 windows cover 900..990 exactly once.
    seen.sort();
    assert_eq!(seen, (900..990).collect::<Vec<i32>>());

    // Deterministic, independent of training draws, and wraps after 9 windows.
    let first = {
        s.val_batch(0, batch, seq_len, &mut x, &mut y).unwrap();
        x.clone()
    };
    s.next_train_batch(batch, seq_len, &mut x, &mut y).unwrap();
    s.val_batch(3, batch, seq_len, &mut x, &mut y).unwrap();
    assert_eq!(
        x, first,
        "batch 3 = windows 9..12 = windows 0..3 after wrapping"
    );
}

#[test]
fn wrong_buffer_sizes_and_long_seq_rejected() {
    let ds = Dataset::new(ramp(1000), 0.1, 16).unwrap();
    let mut s = BatchSampler::new(ds, 0);
    let mut x = vec![0; 2 * 16];
    let mut y = vec![0; 2 * 16 - 1];
    let err = s.next_train_batch(2, 16, &mut x, &mut y).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::BufferSize {
                buffer: "targets",
                expected: 32,
                actual: 31
            }
        ),
        "{err}"
    );
    assert!(matches!(
        s.val_batch(0, 0, 16, &mut x, &mut y),
        Err(DataError::EmptyBatch { .. })
    ));
    let (mut x, mut y) = (vec![0; 200], vec![0; 200]);
    let err = s.val_batch(0, 1, 200, &mut x, &mut y).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::SplitTooShort {
                split: "validation",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_split_smaller_than_one_batch_is_named_with_the_batch_size() {
    // 10_000 tokens, 10% validation: 1000 validation tokens < 16 × 64 + 1.
    let ds = Dataset::new(ramp(10_000), 0.1, 64).unwrap();
    let err = ds.check_batch(16, 64).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::SmallerThanBatch {
                split: "validation",
                tokens: 1000,
                batch: 16,
                seq_len: 64,
                corpus_tokens: 10_000,
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("fewer than one batch of 16 × 64 tokens"),
        "{msg}"
    );
    assert!(msg.contains("val_fraction"), "{msg}");
    // The training split is checked too, and one batch plus the last target is enough.
    let err = ds.check_batch(200, 64).unwrap_err();
    assert!(matches!(
        err,
        DataError::SmallerThanBatch { split: "train", .. }
    ));
    ds.check_batch(15, 64).unwrap();
    ds.check_batch(1, 999).unwrap();
    assert!(ds.check_batch(1, 1000).is_err());
}
