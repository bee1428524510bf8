//! Shampoo (`optim::shampoo_step`) against a float64 re-implementation written from
//! `docs/shampoo.md` (Distributed Shampoo, facebookresearch/optimizers `f6066066`) in the
//! plainest form: nested-vector matrices, each block cut out of the parameter by its explicit
//! row and column ranges, triple-loop products, the inverse root as `Σ λ'^(−1/r) q qᵀ`. 25 steps
//! on awkward shapes (a matrix split into uneven blocks, a small matrix merged into one vector
//! block, a `[1, n]` row), with the reference defaults and with Adam grafting, β₂ < 1, decoupled
//! weight decay and a refresh period of 3; ≤ 1e-6 relative on the parameter.
use optim::{
    merge_small_dims, refresh_apply, refresh_compute_inverse_root, shampoo_blocks, shampoo_step,
    shampoo_update, AdamGrafting, FaerEigensolver, HostEigensolver, ShampooParams, ShampooState,
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

/// One reference step on the merged `[vm, vn]` view `w`. `plan`: the schedule of a plan's
/// `inverse_root` refreshes instead of the reference's (roots computed at the end of step 1,
/// then of every step t with (t − 1) mod frequency = 0, from the factors up to that step,
/// and used from the next step on; the Adam step alone at t = 1 with grafting).
fn ref_step(
    blocks: &mut [RefBlock],
    hp: &ShampooParams,
    lr: f64,
    step: u64,
    w: &mut M,
    g: &M,
    plan: bool,
) {
    let start = hp
        .start_preconditioning_step
        .unwrap_or(hp.precondition_frequency);
    let f = hp.precondition_frequency;
    let refresh = if plan {
        step == 1 || (step - 1) % f == 0
    } else {
        (step % f == 0 && step > start) || step == start
    };
    let graft_only = if plan { step == 1 } else { step < start } && hp.grafting.is_some();
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
        if refresh && !plan {
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
        if refresh && plan {
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

/// Uniform draws in [−0.5, 0.5) from a fixed xorshift seed.
fn uniform(mut seed: u64) -> impl FnMut() -> f64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 11) as f64 / (1u64 << 53) as f64) - 0.5
    }
}

/// The shapes and settings both tests run: uneven matrix blocks with grafting, β₂ < 1, weight
/// decay and a refresh period of 3; the same with the reference defaults; a small matrix merged
/// into one vector block; a `[1, n]` row in vector blocks; a matrix of vector blocks.
fn cases() -> [(&'static [usize], ShampooParams); 5] {
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
    [
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
    ]
}

fn ref_blocks(shape: &[usize], b: usize) -> Vec<RefBlock> {
    let (_, blocks) = shampoo_blocks(shape, b);
    blocks
        .iter()
        .map(|b| {
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
        .collect()
}

#[test]
fn shampoo_matches_a_float64_reimplementation_of_the_reference() {
    let mut normal = uniform(0x2545_f491);
    for (shape, hp) in cases() {
        let mut st = ShampooState::<f64>::new(shape, hp.max_preconditioner_dim);
        let (vm, vn) = st.view;
        let mut rb = ref_blocks(shape, hp.max_preconditioner_dim);
        let mut p: Vec<f64> = (0..vm * vn).map(|_| normal()).collect();
        let mut w: M = p.chunks(vn).map(|r| r.to_vec()).collect();
        let p0 = p.clone();
        for step in 1..=25u64 {
            let lr = 1e-2 * (1.0 + step as f64 / 25.0);
            let g: Vec<f64> = (0..vm * vn).map(|_| normal()).collect();
            shampoo_step(&mut st, &hp, lr, &mut p, &g, &FaerEigensolver).expect("step");
            let gm: M = g.chunks(vn).map(|r| r.to_vec()).collect();
            ref_step(&mut rb, &hp, lr, step, &mut w, &gm, false);
        }
        let want: Vec<f64> = w.iter().flatten().copied().collect();
        let e = rel(&p, &want);
        assert!(e <= 1e-6, "{shape:?} {hp:?}: relative error {e:e}");
        assert!(p.iter().all(|x| x.is_finite()));
        assert!(rel(&p, &p0) > 1e-3, "{shape:?}: the parameter barely moved");
        assert_eq!(st.step, 25);
    }
}

/// The plan path (`shampoo_update` each step, then the due `inverse_root` refreshes at the
/// step's end through `refresh_compute_inverse_root` and `refresh_apply`, as the engines run
/// them at staleness 0) against the float64 re-implementation under the plan's schedule.
#[test]
fn plan_path_matches_the_float64_reimplementation_at_its_schedule() {
    let mut normal = uniform(0x9e37_79b9);
    for (shape, hp) in cases() {
        // The plan refreshes at the end of step 1, from one gradient: rank-deficient factors
        // whose ε = 1e-12 roots (~1e3) amplify eigensolver round-off past 1e-6 (as the
        // reference test's defaults case, docs/shampoo.md §7.4).
        let hp = ShampooParams {
            epsilon: hp.epsilon.max(1e-6),
            ..hp
        };
        let ((vm, vn), blocks) = shampoo_blocks(shape, hp.max_preconditioner_dim);
        let mut rb = ref_blocks(shape, hp.max_preconditioner_dim);
        let sides: Vec<(u8, usize, u32)> = blocks
            .iter()
            .flat_map(|b| {
                let s = b.sides();
                let r = 2 * s.len() as u32;
                s.into_iter().enumerate().map(move |(k, d)| (k as u8, d, r))
            })
            .collect();
        let mut factors: Vec<Vec<f64>> = sides.iter().map(|s| vec![0.0; s.1 * s.1]).collect();
        let mut roots: Vec<Vec<f64>> = sides
            .iter()
            .map(|&(_, d, _)| {
                (0..d * d)
                    .map(|i| f64::from(u8::from(i % (d + 1) == 0)))
                    .collect()
            })
            .collect();
        let n = vm * vn;
        let (mut ea, mut v) = (vec![0.0; n], vec![0.0; n]);
        let mut p: Vec<f64> = (0..n).map(|_| normal()).collect();
        let mut w: M = p.chunks(vn).map(|r| r.to_vec()).collect();
        let f = hp.precondition_frequency;
        for step in 1..=25u64 {
            let lr = 1e-2 * (1.0 + step as f64 / 25.0);
            let g: Vec<f64> = (0..n).map(|_| normal()).collect();
            let mut fs: Vec<&mut [f64]> = factors.iter_mut().map(|x| x.as_mut_slice()).collect();
            let rs: Vec<&[f64]> = roots.iter().map(|x| x.as_slice()).collect();
            let graft = hp.grafting.map(|_| v.as_mut_slice());
            shampoo_update(
                step, &hp, lr, &mut p, &g, &mut ea, graft, shape, &mut fs, &rs,
            )
            .expect("update");
            for (k, &(side, d, exponent)) in sides.iter().enumerate() {
                let root = schedule::InverseRoot {
                    exponent,
                    epsilon: hp.epsilon,
                };
                let r = refresh_compute_inverse_root(
                    &FaerEigensolver,
                    step,
                    f,
                    side,
                    &factors[k],
                    d,
                    root,
                )
                .expect("refresh");
                if let Some(r) = r {
                    refresh_apply(&r, &mut roots[k], &mut [], &mut [], d, d).expect("apply");
                }
            }
            let gm: M = g.chunks(vn).map(|r| r.to_vec()).collect();
            ref_step(&mut rb, &hp, lr, step, &mut w, &gm, true);
        }
        let want: Vec<f64> = w.iter().flatten().copied().collect();
        let e = rel(&p, &want);
        assert!(e <= 1e-6, "{shape:?} {hp:?}: relative error {e:e}");
    }
}

/// A non-finite factor is refused (the root keeps its value) and counted as numerical.
#[test]
fn a_non_finite_factor_keeps_the_root() {
    let mut f = vec![1.0f32, 0.0, 0.0, 1.0];
    f[1] = f32::NAN;
    let root = schedule::InverseRoot {
        exponent: 4,
        epsilon: 1e-12,
    };
    let e = refresh_compute_inverse_root(&FaerEigensolver, 1, 10, 0, &f, 2, root).unwrap_err();
    assert!(e.is_numerical(), "{e}");
    assert!(e.to_string().contains("non-finite"), "{e}");
    assert_eq!(
        refresh_compute_inverse_root(&FaerEigensolver, 5, 10, 0, &f, 2, root).unwrap(),
        None
    );
}
