//! A float64 transcription of the reference `soap.py` (nikhilvyas/SOAP) for one parameter,
//! written with plain loops, a Jacobi eigensolver and modified Gram–Schmidt QR, following
//! `SOAP.step` / `update_preconditioner` / `get_orthogonal_matrix(_QR)` / `project(_back)`
//! literally (including projecting exp_avg back to the original space and forward again on
//! every step). Shared by `optim/tests/soap_reference.rs` (against the library) and
//! `tests/soap_blocked_reference.rs` (blocked SOAP through the plan, applied per block), each
//! including this file with `#[path]`.
// Plain index loops on purpose: the reference is a literal transcription of soap.py.
#![allow(dead_code, clippy::needless_range_loop, clippy::manual_is_multiple_of)]

pub type M = Vec<Vec<f64>>;

pub fn zeros(r: usize, c: usize) -> M {
    vec![vec![0.0; c]; r]
}

pub fn from_flat(x: &[f64], r: usize, c: usize) -> M {
    (0..r).map(|i| x[i * c..(i + 1) * c].to_vec()).collect()
}

pub fn flat(x: &M) -> Vec<f64> {
    x.iter().flatten().copied().collect()
}

pub fn mm(a: &M, b: &M) -> M {
    let (r, k, c) = (a.len(), b.len(), b[0].len());
    let mut out = zeros(r, c);
    for i in 0..r {
        for j in 0..c {
            out[i][j] = (0..k).map(|l| a[i][l] * b[l][j]).sum();
        }
    }
    out
}

pub fn tr(a: &M) -> M {
    let (r, c) = (a.len(), a[0].len());
    (0..c).map(|j| (0..r).map(|i| a[i][j]).collect()).collect()
}

/// torch.tensordot(x, q, dims=[[0], [0]]) (`project`) or dims=[[0], [1]] (`project_back`)
/// for a 2-D x `[a, b]` and q `[a, a]`: result `[b, a]`; an empty q (`[]`) permutes
/// (transposes) instead.
pub fn tensordot0(x: &M, q: Option<&M>, back: bool) -> M {
    let (a, b) = (x.len(), x[0].len());
    let mut out = zeros(b, a);
    for bi in 0..b {
        for j in 0..a {
            out[bi][j] = match q {
                None => x[j][bi],
                Some(q) => (0..a)
                    .map(|i| x[i][bi] * if back { q[j][i] } else { q[i][j] })
                    .sum(),
            };
        }
    }
    out
}

/// Cyclic Jacobi eigendecomposition: (values ascending, V with eigenvectors as columns).
pub fn jacobi_eigh(a: &M) -> (Vec<f64>, M) {
    let n = a.len();
    let mut a = a.clone();
    let mut v = zeros(n, n);
    for (i, row) in v.iter_mut().enumerate() {
        row[i] = 1.0;
    }
    for _sweep in 0..100 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i][j] * a[i][j])
            .sum();
        let total: f64 = a.iter().flatten().map(|x| x * x).sum();
        if off <= 1e-34 * total || off == 0.0 {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                if a[p][q] == 0.0 {
                    continue;
                }
                let theta = (a[q][q] - a[p][p]) / (2.0 * a[p][q]);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (akp, akq) = (a[k][p], a[k][q]);
                    a[k][p] = c * akp - s * akq;
                    a[k][q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p][k], a[q][k]);
                    a[p][k] = c * apk - s * aqk;
                    a[q][k] = s * apk + c * aqk;
                }
                for row in v.iter_mut() {
                    let (vkp, vkq) = (row[p], row[q]);
                    row[p] = c * vkp - s * vkq;
                    row[q] = s * vkp + c * vkq;
                }
            }
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| a[i][i].total_cmp(&a[j][j]));
    let values = order.iter().map(|&i| a[i][i]).collect();
    let vecs = (0..n)
        .map(|r| order.iter().map(|&c| v[r][c]).collect())
        .collect();
    (values, vecs)
}

/// Q of a QR by modified Gram–Schmidt, applied twice for orthogonality.
pub fn mgs_q(a: &M) -> M {
    let (r, c) = (a.len(), a[0].len());
    let mut cols: Vec<Vec<f64>> = (0..c).map(|j| (0..r).map(|i| a[i][j]).collect()).collect();
    for j in 0..c {
        for _pass in 0..2 {
            for k in 0..j {
                let dot: f64 = (0..r).map(|i| cols[k][i] * cols[j][i]).sum();
                for i in 0..r {
                    cols[j][i] -= dot * cols[k][i];
                }
            }
        }
        let norm = cols[j].iter().map(|x| x * x).sum::<f64>().sqrt();
        for x in cols[j].iter_mut() {
            *x /= norm;
        }
    }
    (0..r)
        .map(|i| (0..c).map(|j| cols[j][i]).collect())
        .collect()
}

pub struct Group {
    pub lr: f64,
    pub betas: (f64, f64),
    pub shampoo_beta: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub precondition_frequency: usize,
    pub max_precond_dim: usize,
    pub normalize_grads: bool,
    pub correct_bias: bool,
}

/// `state` of one parameter in `soap.py` (tensors 2-D `[m, n]`; a 1-D param is `[1, n]`
/// with `one_d`, whose `GG` is `[[]]` and whose projections are the identity).
pub struct RefState {
    one_d: bool,
    step: usize,
    exp_avg: M,
    exp_avg_sq: M,
    gg: Vec<Option<M>>,
    q: Option<Vec<Option<M>>>,
}

impl RefState {
    /// The state before the first step of a `[m, n]` parameter (`one_d`: `m = 1`, a 1-D
    /// parameter).
    pub fn new(one_d: bool, m: usize, n: usize) -> Self {
        RefState {
            one_d,
            step: 0,
            exp_avg: zeros(m, n),
            exp_avg_sq: zeros(m, n),
            gg: Vec::new(),
            q: None,
        }
    }

    pub fn project(&self, g: &M) -> M {
        if self.one_d {
            return g.clone();
        }
        let mut g = g.clone();
        for mat in self.q.as_ref().expect("Q") {
            g = tensordot0(&g, mat.as_ref(), false);
        }
        g
    }

    pub fn project_back(&self, g: &M) -> M {
        if self.one_d {
            return g.clone();
        }
        let mut g = g.clone();
        for mat in self.q.as_ref().expect("Q") {
            g = tensordot0(&g, mat.as_ref(), true);
        }
        g
    }

    pub fn get_orthogonal_matrix(&self) -> Vec<Option<M>> {
        self.gg
            .iter()
            .map(|m| {
                m.as_ref().map(|m| {
                    let mut shifted = m.clone();
                    for (i, row) in shifted.iter_mut().enumerate() {
                        row[i] += 1e-30;
                    }
                    let (_, q) = jacobi_eigh(&shifted);
                    q.iter()
                        .map(|row| row.iter().rev().copied().collect())
                        .collect() // torch.flip(Q, [1])
                })
            })
            .collect()
    }

    pub fn get_orthogonal_matrix_qr(&mut self) -> Vec<Option<M>> {
        let orth = self.q.clone().expect("Q");
        let mut exp_avg_sq = self.exp_avg_sq.clone();
        let mut fin = Vec::new();
        for (ind, (m, o)) in self.gg.iter().zip(orth.iter()).enumerate() {
            let (Some(m), Some(o)) = (m, o) else {
                fin.push(None);
                continue;
            };
            let omo = mm(&mm(&tr(o), m), o);
            let est: Vec<f64> = (0..o.len()).map(|i| omo[i][i]).collect();
            let mut sort_idx: Vec<usize> = (0..est.len()).collect();
            sort_idx.sort_by(|&a, &b| est[b].total_cmp(&est[a]));
            exp_avg_sq = if ind == 0 {
                sort_idx.iter().map(|&i| exp_avg_sq[i].clone()).collect()
            } else {
                exp_avg_sq
                    .iter()
                    .map(|row| sort_idx.iter().map(|&j| row[j]).collect())
                    .collect()
            };
            let o_sorted: M = o
                .iter()
                .map(|row| sort_idx.iter().map(|&j| row[j]).collect())
                .collect();
            let power_iter = mm(m, &o_sorted);
            fin.push(Some(mgs_q(&power_iter)));
        }
        self.exp_avg_sq = exp_avg_sq;
        fin
    }

    pub fn update_preconditioner(&mut self, grad: &M, shampoo_beta: f64, freq: usize) {
        if self.q.is_some() {
            self.exp_avg = self.project_back(&self.exp_avg);
        }
        if !self.one_d {
            for idx in 0..2 {
                if let Some(gg) = self.gg[idx].as_mut() {
                    let outer = if idx == 0 {
                        mm(grad, &tr(grad))
                    } else {
                        mm(&tr(grad), grad)
                    };
                    let w = 1.0 - shampoo_beta; // torch lerp_(end, w)
                    for (row, orow) in gg.iter_mut().zip(&outer) {
                        for (x, &o) in row.iter_mut().zip(orow) {
                            *x = if w < 0.5 {
                                *x + w * (o - *x)
                            } else {
                                o - (o - *x) * (1.0 - w)
                            };
                        }
                    }
                }
            }
        }
        if self.q.is_none() {
            self.q = Some(self.get_orthogonal_matrix());
        }
        if self.step > 0 && self.step % freq == 0 {
            self.q = Some(self.get_orthogonal_matrix_qr());
        }
        if self.step > 0 {
            self.exp_avg = self.project(&self.exp_avg);
        }
    }

    /// `SOAP.step` for this parameter; `group.lr` is this step's lr.
    pub fn step(&mut self, p: &mut M, grad: &M, group: &Group) {
        if self.q.is_none() {
            // init_preconditioner
            let (m, n) = (grad.len(), grad[0].len());
            self.gg = if self.one_d {
                vec![None]
            } else {
                [m, n]
                    .iter()
                    .map(|&sh| (sh <= group.max_precond_dim).then(|| zeros(sh, sh)))
                    .collect()
            };
            self.update_preconditioner(grad, group.shampoo_beta, group.precondition_frequency);
            return;
        }
        let grad_projected = self.project(grad);
        let (beta1, beta2) = group.betas;
        self.step += 1;
        let (m, n) = (grad.len(), grad[0].len());
        let mut pre = zeros(m, n);
        for i in 0..m {
            for j in 0..n {
                let g = grad_projected[i][j];
                self.exp_avg[i][j] = self.exp_avg[i][j] * beta1 + g * (1.0 - beta1);
                self.exp_avg_sq[i][j] = self.exp_avg_sq[i][j] * beta2 + g * g * (1.0 - beta2);
                let denom = self.exp_avg_sq[i][j].sqrt() + group.eps;
                pre[i][j] = self.exp_avg[i][j] / denom;
            }
        }
        let mut step_size = group.lr;
        if group.correct_bias {
            let bc1 = 1.0 - beta1.powi(self.step as i32);
            let bc2 = 1.0 - beta2.powi(self.step as i32);
            step_size = step_size * bc2.sqrt() / bc1;
        }
        let mut norm_grad = self.project_back(&pre);
        if group.normalize_grads {
            let mean: f64 = norm_grad.iter().flatten().map(|x| x * x).sum::<f64>() / (m * n) as f64;
            let s = 1e-30 + mean.sqrt();
            norm_grad.iter_mut().flatten().for_each(|x| *x /= s);
        }
        for i in 0..m {
            for j in 0..n {
                p[i][j] += -step_size * norm_grad[i][j];
            }
        }
        if group.weight_decay > 0.0 {
            for row in p.iter_mut() {
                for x in row.iter_mut() {
                    *x += -group.lr * group.weight_decay * *x;
                }
            }
        }
        self.update_preconditioner(grad, group.shampoo_beta, group.precondition_frequency);
    }
}
