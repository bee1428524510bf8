//! Shampoo (`optim::shampoo_step`) against a float64 re-implementation written from
//! `docs/shampoo.md` (Distributed Shampoo, facebookresearch/optimizers `f6066066`) in the
//! plainest form: nested-vector matrices, each block cut out of the parameter by its explicit
//! row and column ranges, triple-loop products, the inverse root as `Σ λ'^(−1/r) q qᵀ`. 25 steps
//! on awkward shapes (a matrix split into uneven blocks, a small matrix merged into one vector
//! block, a `[1, n]` row), with the reference defaults and with Adam grafting, β₂ < 1, decoupled
//! weight decay and a refresh period of 3; ≤ 1e-6 relative on the parameter.
use optim::{
    merge_small_dims, shampoo_blocks, shampoo_step, AdamGrafting, FaerEigensolver, HostEigensolver,
    ShampooParams, ShampooState,
};

type M = Vec<Vec<f64>>;

fn mul(a: &M, b: &M) -> M {
    let (r, k, c) = (a.len(), b.len(), b[0].len());
    (0..r)
        .map(|i| {
            (0..c)
                .map(|j| (0..k).map(|l| a[i][l] * b[l][j]).sum())
                .collect()
        })
        .collect()
}
fn t(a: &M) -> M {
    (0..a[0].len())
        .map(|j| (0..a.len()).map(|i| a[i][j]).collect())
        .collect()
}
fn frob(a: &M) -> f64 {
    a.iter().flatten().map(|x| x * x).sum::<f64>().sqrt()
}

/// `(F/bc + εI)^(−1/r)` with the reference's shift of the spectrum up to ε.
fn inv_root(f: &M, bc: f64, eps: f64, r: f64) -> M {
    let d = f.len();
    let mut a = vec![0.0; d * d];
    for i in 0..d {
        for j in 0..d {
            a[i * d + j] = f[i][j] / bc + if i == j { eps } else { 0.0 };
        }
    }
    let e = FaerEigensolver.eigh_f64(&a, d).expect("eigh");
    let min = e.values.iter().copied().fold(f64::INFINITY, f64::min);
    let shift = if min < eps { eps - min } else { 0.0 };
    let mut out = vec![vec![0.0; d]; d];
    for (k, lam) in e.values.iter().enumerate() {
        let w = (lam + shift).powf(-1.0 / r);
        for i in 0..d {
            for j in 0..d {
                out[i][j] += w * e.vectors[i * d + k] * e.vectors[j * d + k];
            }
        }
    }
    out
}

struct RefBlock {
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    vector: bool,
    f: Vec<M>,
    finv: Vec<M>,
    m: M,
    v: M,
}

/// One reference step on the merged `[vm, vn]` view `w`.
fn ref_step(blocks: &mut [RefBlock], hp: &ShampooParams, lr: f64, step: u64, w: &mut M, g: &M) {
    let start = hp
        .start_preconditioning_step
        .unwrap_or(hp.precondition_frequency);
    let refresh = (step % hp.precondition_frequency == 0 && step > start) || step == start;
    let graft_only = step < start && hp.grafting.is_some();
    let tt = step as i32;
    for b in blocks.iter_mut() {
        let gb: M = b
            .rows
            .clone()
            .map(|i| g[i][b.cols.clone()].to_vec())
            .collect();
        let cs: Vec<M> = if b.vector {
            let col: M = gb[0].iter().map(|&x| vec![x]).collect();
            vec![mul(&col, &t(&col))]
        } else {
            vec![mul(&gb, &t(&gb)), mul(&t(&gb), &gb)]
        };
        for (f, c) in b.f.iter_mut().zip(&cs) {
            for i in 0..f.len() {
                for j in 0..f.len() {
                    f[i][j] = if hp.beta2 < 1.0 {
                        hp.beta2 * f[i][j] + (1.0 - hp.beta2) * c[i][j]
                    } else {
                        f[i][j] + c[i][j]
                    };
                }
            }
        }
        if let Some(gr) = hp.grafting {
            for (vr, gr_) in b.v.iter_mut().zip(&gb) {
                for (v, x) in vr.iter_mut().zip(gr_) {
                    *v = gr.beta2 * *v + (1.0 - gr.beta2) * x * x;
                }
            }
        }
        if refresh {
            let bc2 = if hp.beta2 < 1.0 {
                1.0 - hp.beta2.powi(tt)
            } else {
                1.0
            };
            let r = 2.0 * b.f.len() as f64;
            b.finv =
                b.f.iter()
                    .map(|f| inv_root(f, bc2, hp.epsilon, r))
                    .collect();
        }
        let bc1 = 1.0 - hp.beta1.powi(tt);
        for (mr, gr_) in b.m.iter_mut().zip(&gb) {
            for (m, x) in mr.iter_mut().zip(gr_) {
                *m = hp.beta1 * *m + (1.0 - hp.beta1) * x;
            }
        }
        let gbar: M =
            b.m.iter()
                .map(|r| r.iter().map(|m| m / bc1).collect())
                .collect();
        let pg: Option<M> = hp.grafting.map(|gr| {
            let gbc = 1.0 - gr.beta2.powi(tt);
            gbar.iter()
                .zip(&b.v)
                .map(|(xr, vr)| {
                    xr.iter()
                        .zip(vr)
                        .map(|(x, v)| x / ((v / gbc).sqrt() + gr.epsilon))
                        .collect()
                })
                .collect()
        });
        let mut p: M = if graft_only {
            pg.clone().expect("grafting")
        } else if b.vector {
            let col: M = gbar[0].iter().map(|&x| vec![x]).collect();
            t(&mul(&b.finv[0], &col))
        } else {
            mul(&mul(&b.finv[0], &gbar), &b.finv[1])
        };
        if let (Some(pg), false) = (&pg, graft_only) {
            let s = frob(pg) / (frob(&p) + 1e-16);
            p.iter_mut().flatten().for_each(|x| *x *= s);
        }
        for (bi, i) in b.rows.clone().enumerate() {
            for (bj, j) in b.cols.clone().enumerate() {
                w[i][j] -= lr * (p[bi][bj] + hp.weight_decay * w[i][j]);
            }
        }
    }
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    num / b.iter().map(|y| y.abs()).fold(1e-300, f64::max)
}

#[test]
fn merging_and_blocking_follow_the_reference() {
    assert_eq!(merge_small_dims(&[5, 7], 1024), [35]);
    assert_eq!(merge_small_dims(&[40, 30], 1024), [40, 30]);
    assert_eq!(merge_small_dims(&[1, 9], 4), [9]);
    assert_eq!(merge_small_dims(&[32, 3, 64, 64], 8192), [96, 4096]);
    assert_eq!(merge_small_dims(&[3, 0], 8), [0]);
    let ((m, n), b) = shampoo_blocks(&[40, 24], 16);
    assert_eq!((m, n), (40, 24));
    let cut: Vec<(usize, usize, usize, usize)> =
        b.iter().map(|b| (b.r0, b.rows, b.c0, b.cols)).collect();
    assert_eq!(
        cut,
        [
            (0, 16, 0, 16),
            (0, 16, 16, 8),
            (16, 16, 0, 16),
            (16, 16, 16, 8),
            (32, 8, 0, 16),
            (32, 8, 16, 8)
        ]
    );
    let (_, b) = shampoo_blocks(&[1, 9], 4);
    assert!(b.iter().all(|b| b.vector));
    assert_eq!(b.iter().map(|b| b.cols).collect::<Vec<_>>(), [4, 4, 1]);
}

#[test]
fn shampoo_matches_a_float64_reimplementation_of_the_reference() {
    let mut seed = 0x2545_f491_u64;
    let mut normal = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 11) as f64 / (1u64 << 53) as f64) - 0.5
    };
    let grafted = ShampooParams {
        beta2: 0.95,
        weight_decay: 0.01,
        max_preconditioner_dim: 16,
        precondition_frequency: 3,
        grafting: Some(AdamGrafting {
            beta2: 0.999,
            epsilon: 1e-10,
        }),
        ..ShampooParams::default()
    };
    let defaults = ShampooParams {
        // The default 1e-12 makes the rank-deficient early factors' roots ~1e3 and amplifies
        // eigensolver round-off past what a 1e-6 comparison can take (docs/shampoo.md §7.4).
        epsilon: 1e-6,
        max_preconditioner_dim: 16,
        ..ShampooParams::default()
    };
    let cases: [(&[usize], ShampooParams); 5] = [
        (&[40, 24], grafted),
        (&[40, 24], defaults),
        (
            &[5, 7],
            ShampooParams {
                max_preconditioner_dim: 1024,
                ..grafted
            },
        ),
        (
            &[1, 9],
            ShampooParams {
                max_preconditioner_dim: 4,
                ..grafted
            },
        ),
        (
            &[6, 3],
            ShampooParams {
                max_preconditioner_dim: 4,
                ..defaults
            },
        ),
    ];
    for (shape, hp) in cases {
        let mut st = ShampooState::<f64>::new(shape, hp.max_preconditioner_dim);
        let (vm, vn) = st.view;
        let mut rb: Vec<RefBlock> = st
            .blocks
            .iter()
            .map(|b| {
                let b = b.block;
                let sides = b.sides();
                let eye = |d: usize| -> M {
                    (0..d)
                        .map(|i| (0..d).map(|j| f64::from(u8::from(i == j))).collect())
                        .collect()
                };
                RefBlock {
                    rows: b.r0..b.r0 + b.rows,
                    cols: b.c0..b.c0 + b.cols,
                    vector: b.vector,
                    f: sides.iter().map(|&d| vec![vec![0.0; d]; d]).collect(),
                    finv: sides.iter().map(|&d| eye(d)).collect(),
                    m: vec![vec![0.0; b.cols]; b.rows],
                    v: vec![vec![0.0; b.cols]; b.rows],
                }
            })
            .collect();
        let mut p: Vec<f64> = (0..vm * vn).map(|_| normal()).collect();
        let mut w: M = p.chunks(vn).map(|r| r.to_vec()).collect();
        let p0 = p.clone();
        for step in 1..=25u64 {
            let lr = 1e-2 * (1.0 + step as f64 / 25.0);
            let g: Vec<f64> = (0..vm * vn).map(|_| normal()).collect();
            shampoo_step(&mut st, &hp, lr, &mut p, &g, &FaerEigensolver).expect("step");
            let gm: M = g.chunks(vn).map(|r| r.to_vec()).collect();
            ref_step(&mut rb, &hp, lr, step, &mut w, &gm);
        }
        let want: Vec<f64> = w.iter().flatten().copied().collect();
        let e = rel(&p, &want);
        assert!(e <= 1e-6, "{shape:?} {hp:?}: relative error {e:e}");
        assert!(p.iter().all(|x| x.is_finite()));
        assert!(rel(&p, &p0) > 1e-3, "{shape:?}: the parameter barely moved");
        assert_eq!(st.step, 25);
    }
}
