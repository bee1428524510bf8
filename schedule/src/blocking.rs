//! Distributed Shampoo's blocking of a parameter (facebookresearch/optimizers
//! `merge_small_dims` then `multi_dim_split`; `docs/shampoo.md` §2): the parameter is viewed,
//! row-major and without a copy, under a merged shape, and cut into blocks of at most
//! `max_preconditioner_dim` per dimension, each with its own Kronecker factors. The plan
//! records the block size (`ShampooHyper::max_preconditioner_dim`); this module is the one
//! definition of what it means, used by the compiler (the state it creates), the plan verifier
//! (the factor shapes) and both engines.

/// `merge_small_dims(shape, B)` of the reference with its default target dimensionality 1:
/// drops unit dimensions and merges neighbours (from the last one) while their product is at
/// most `b`. A shape with a zero dimension is `[0]`; an all-unit shape is `[1]`.
pub fn merge_small_dims(shape: &[usize], b: usize) -> Vec<usize> {
    if shape.contains(&0) {
        return vec![0];
    }
    let sq: Vec<usize> = shape.iter().rev().copied().filter(|&d| d != 1).collect();
    if sq.is_empty() {
        return vec![1];
    }
    let mut merged = vec![sq[0]];
    for (i, &d) in sq.iter().enumerate().skip(1) {
        let last = *merged.last().expect("non-empty");
        if merged.len() + (sq.len() - i) > 1 && last.saturating_mul(d) <= b {
            *merged.last_mut().expect("non-empty") = last * d;
        } else {
            merged.push(d);
        }
    }
    merged.reverse();
    merged
}

/// One block of a parameter: rows `r0..r0 + rows` and columns `c0..c0 + cols` of the merged
/// shape viewed as a matrix (a merged vector of length `N` is the `[1, N]` matrix and its
/// blocks have `rows == 1`, `vector == true`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// First row.
    pub r0: usize,
    /// Rows.
    pub rows: usize,
    /// First column.
    pub c0: usize,
    /// Columns.
    pub cols: usize,
    /// A 1-D block (one factor, exponent 1/2).
    pub vector: bool,
}

impl Block {
    /// The block's factor sides: `[rows, cols]` for a matrix, `[cols]` for a vector.
    pub fn sides(&self) -> Vec<usize> {
        if self.vector {
            vec![self.cols]
        } else {
            vec![self.rows, self.cols]
        }
    }
}

fn chunks(n: usize, b: usize) -> Vec<(usize, usize)> {
    (0..n.div_ceil(b))
        .map(|i| (i * b, b.min(n - i * b)))
        .collect()
}

/// The blocks of a parameter of `shape` (one or two dimensions) under block size `b`:
/// `merge_small_dims` then `multi_dim_split`, in the reference's order (row chunks slowest).
/// Returns the merged shape's matrix view `[rows, cols]` and the blocks.
pub fn blocks(shape: &[usize], b: usize) -> ((usize, usize), Vec<Block>) {
    let merged = merge_small_dims(shape, b.max(1));
    let b = b.max(1);
    match merged[..] {
        [m, n] => {
            let mut out = Vec::new();
            for (r0, rows) in chunks(m, b) {
                for (c0, cols) in chunks(n, b) {
                    out.push(Block {
                        r0,
                        rows,
                        c0,
                        cols,
                        vector: false,
                    });
                }
            }
            ((m, n), out)
        }
        _ => {
            let n: usize = merged.iter().product();
            let out = chunks(n, b)
                .into_iter()
                .map(|(c0, cols)| Block {
                    r0: 0,
                    rows: 1,
                    c0,
                    cols,
                    vector: true,
                })
                .collect();
            ((1, n), out)
        }
    }
}
