//! Blocked SOAP (`optimizer soap { max_preconditioner_dim = 16 }`) through the real plan path against
//! `soap.py` applied independently to each block.
//!
//! The plan is compiled by the full pass pipeline from a one-layer GPT-2 config (vocab 256,
//! context 37, d_model 20, 2 heads, mlp_hidden 40, no gradient clipping) and run by the CPU
//! engine in float64 with synchronous refreshes; each step sets every gradient buffer to a
//! deterministic random gradient, runs the optimizer program (lr multiplier varying with the
//! step) and the host refresh tasks. Parameter shapes and the blocks the test expects
//! (each side longer than `BLOCK` and at most `max_precond_dim` cut into pieces of `BLOCK`, the
//! remainder last, as Distributed Shampoo's `multi_dim_split`; a side over `max_precond_dim`
//! kept whole, unrotated as `soap.py` leaves it): at `max_precond_dim = 10000` `wpe` [37, 20] →
//! rows 16, 16, 5 × columns 16, 4 (6 blocks); `wte` [256, 20] → 16 × (16, 4) (32 blocks);
//! `c_attn` [20, 60] → (16, 4) × (16, 16, 16, 12); `c_fc` [20, 40], `mlp.c_proj` [40, 20] and
//! `attn.c_proj` [20, 20] alike (62 blocks in all); at `max_precond_dim = 40` `wte`'s 256 rows
//! and `c_attn`'s 60 columns stay whole: `wte` → [256, 16] and [256, 4], `c_attn` → [16, 60]
//! and [4, 60] (26 blocks in all).
//! 1-D parameters (biases and norm weights of 20, 40, 60) are not blocked, whatever their
//! length (asteria blocks 2-D parameters only): each is one `soap.py` parameter. The plan's
//! per-block moments (`{param}.b{k}.exp_avg`) are checked to have exactly the test's block
//! shapes, in row-major block order.
//!
//! The reference is `optim/tests/common/soap_py.rs` (the float64 transcription of nikhilvyas/SOAP
//! `soap.py` that `optim/tests/soap_reference.rs` checks the library against: Jacobi `eigh` at
//! the first step, which only initialises, then one power iteration + Gram–Schmidt QR every
//! `precondition_frequency` steps with `exp_avg_sq` re-ordered by the estimated eigenvalues,
//! bias correction, decoupled weight decay on every parameter, sides over `max_precond_dim`
//! unrotated, 1-D parameters unrotated), one independent state per block, on the block cut
//! out of the parameter and its gradient and written back after the step.
//!
//! Two configurations, 25 steps each: (a) the defaults (betas 0.95, shampoo_beta 0.95, weight
//! decay 0.01, bias correction) with `precondition_frequency = 4` and every block side
//! rotated; (b) `max_precond_dim = 40` (`wte`'s 256-long and `c_attn`'s 60-long sides whole
//! and unrotated, every other side cut and rotated), `normalize_grads` (by each block's RMS), no bias correction, betas
//! (0.9, 0.99), shampoo_beta 0.9, `precondition_frequency = 3`. Bound: every parameter within
//! 1e-6 relative (max |Δ| / max |reference|) after every step. Eigenvector sign and order:
//! as in `soap_reference.rs`, the step-1 gradient of every block is zero past row (column)
//! min(rows, cols) of the block on a rotated side, so each step-1 factor's null space is
//! spanned by coordinate vectors and its eigenbasis is unique up to order and sign, to which
//! SOAP is invariant while the moments are zero.
//!
//! The check can fail: the same plan without `block_size` (one factor pair per parameter)
//! must end more than 1e-3 relative away from the blocked run on the blocked parameters.
use engine::{CpuEngine, EngineOptions, Rng};
use ir::config::*;
use passes::{PassManager, PassOptions};
use schedule::Plan;

#[path = "../optim/tests/common/soap_py.rs"]
mod soap_py;

use soap_py::{Group, RefState, M};

const BLOCK: usize = 16;
const STEPS: u64 = 25;
const BASE_LR: f64 = 3e-3;
const TOL: f64 = 1e-6;

fn config(soap: SoapConfig) -> Config {
    Config {
        name: "soap-blocked-reference".into(),
        model: ModelConfig {
            family: Family::Gpt2,
            vocab_size: 256,
            context: 37,
            d_model: 20,
            n_layers: 1,
            n_heads: 2,
            mlp_hidden: 40,
            norm_eps: 1e-5,
            init_std: 0.02,
            rope_theta: 10000.0,
        },
        optimizer: OptimizerConfig::Soap(soap),
        data: DataConfig {
            corpus: CorpusConfig::Builtin,
            tokenizer: TokenizerKind::Bytes,
            batch_size: 1,
            seq_len: 37,
            val_fraction: 0.1,
        },
        train: TrainConfig {
            steps: STEPS,
            warmup_steps: 0,
            min_lr_ratio: 0.1,
            grad_clip: None,
            eval_interval: 0,
            eval_batches: 1,
            seed: 11,
            rematerialize: Default::default(),
            max_skipped_steps: Some(10),
            refresh_swap: Default::default(),
            grad_accum: 1,
        },
        target: TargetConfig::Cpu {
            threads: Some(2),
            staleness: 0,
            calibration: None,
            eigensolver: Default::default(),
            budgets: Default::default(),
        },
    }
}

fn compile(config: Config) -> Plan {
    let mut m = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pass manager");
    let (cx, _) = pm
        .run(&mut m, None, &mut std::io::sink())
        .expect("pipeline");
    cx.plan.expect("plan")
}

/// `(start, len)` of the pieces of a side of length `n`: `BLOCK` each, the remainder last, if
/// the side is cut (longer than `BLOCK`, at most `max_precond_dim`); else the whole side.
fn chunks(n: usize, max_precond_dim: usize) -> Vec<(usize, usize)> {
    let b = if n > BLOCK && n <= max_precond_dim {
        BLOCK
    } else {
        n
    };
    (0..n.div_ceil(b))
        .map(|i| (i * b, b.min(n - i * b)))
        .collect()
}

/// One reference parameter: its `[m, n]` view (`[1, n]` for 1-D) and its `soap.py` states,
/// one per block `(row, col, rows, cols)`.
struct RefParam {
    name: String,
    grad: String,
    m: usize,
    n: usize,
    one_d: bool,
    blocks: Vec<(usize, usize, usize, usize, RefState)>,
}

impl RefParam {
    /// Whether the reference preconditions the left / right side of a `[r, c]` block.
    fn rotated(&self, r: usize, c: usize, max_precond_dim: usize) -> (bool, bool) {
        if self.one_d {
            (false, false)
        } else {
            (r <= max_precond_dim, c <= max_precond_dim)
        }
    }
}

fn cut(w: &[f64], n: usize, (r0, c0, r, c): (usize, usize, usize, usize)) -> M {
    (0..r)
        .map(|i| w[(r0 + i) * n + c0..(r0 + i) * n + c0 + c].to_vec())
        .collect()
}

/// Deterministic gradient of parameter `k` at step `t`; at t = 1 zero past row (column)
/// min(rows, cols) of every block on each rotated side (module doc).
fn gradient(p: &RefParam, k: usize, t: u64, max_precond_dim: usize) -> Vec<f64> {
    let mut rng = Rng::new(1_000 * t + k as u64);
    let mut g: Vec<f64> = (0..p.m * p.n).map(|_| rng.normal()).collect();
    if t == 1 {
        for &(r0, c0, r, c, _) in &p.blocks {
            let (left, right) = p.rotated(r, c, max_precond_dim);
            let keep = r.min(c);
            for i in 0..r {
                for j in 0..c {
                    if (left && i >= keep) || (right && j >= keep) {
                        g[(r0 + i) * p.n + c0 + j] = 0.0;
                    }
                }
            }
        }
    }
    g
}

/// max |a − b| / max |b|.
fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    num / b.iter().map(|y| y.abs()).fold(f64::MIN_POSITIVE, f64::max)
}

fn lr_multiplier(t: u64) -> f64 {
    1.0 + 0.5 * (t as f64 * 0.7).sin()
}

/// Runs the plan of `soap` (with `block_size` or without) for `STEPS` steps on the test's
/// gradients; with `reference`, checks every parameter against `soap.py` per block after every
/// step and returns the worst relative error. Returns it and the final parameters.
fn run(
    soap: &SoapConfig,
    reference: bool,
    expected_blocks: usize,
) -> (f64, Vec<(String, Vec<f64>)>) {
    let plan = compile(config(soap.clone()));
    let opts = EngineOptions {
        synchronous_refresh: true,
        ..EngineOptions::default()
    };
    let mut e = CpuEngine::<f64>::new(plan.clone(), opts).expect("engine");
    let mpd = soap.max_precond_dim;
    let mut params: Vec<RefParam> = plan
        .params
        .iter()
        .map(|r| {
            let b = &plan.buffers[r.param.index()];
            let (m, n, one_d) = match b.shape[..] {
                [n] => (1, n, true),
                [m, n] => (m, n, false),
                _ => panic!("{}: unexpected shape {:?}", b.name, b.shape),
            };
            let (rows, cols) = if one_d {
                (vec![(0, m)], vec![(0, n)])
            } else {
                (chunks(m, mpd), chunks(n, mpd))
            };
            let blocked = rows.len() * cols.len() > 1;
            let blocks = rows
                .iter()
                .flat_map(|&(r0, r)| cols.iter().map(move |&(c0, c)| (r0, c0, r, c)))
                .map(|(r0, c0, r, c)| (r0, c0, r, c, RefState::new(one_d, r, c)))
                .collect::<Vec<_>>();
            if blocked && soap.block_size.is_some() {
                // asteria's blocks: `{param}.b{k}.exp_avg`, same shapes, row-major order.
                let prefix = format!("{}.b", b.name);
                let planned: Vec<(usize, Vec<usize>)> = plan
                    .buffers
                    .iter()
                    .filter_map(|x| {
                        let k = x.name.strip_prefix(&prefix)?.strip_suffix(".exp_avg")?;
                        Some((k.parse().ok()?, x.shape.clone()))
                    })
                    .collect();
                let mut planned = planned;
                planned.sort();
                let expected: Vec<(usize, Vec<usize>)> = blocks
                    .iter()
                    .enumerate()
                    .map(|(k, &(_, _, r, c, _))| (k, vec![r, c]))
                    .collect();
                assert_eq!(planned, expected, "{}: the plan's blocks", b.name);
            }
            RefParam {
                name: b.name.clone(),
                grad: plan.buffers[r.grad.index()].name.clone(),
                m,
                n,
                one_d,
                blocks,
            }
        })
        .collect();
    assert!(
        params
            .iter()
            .any(|p| p.name == "wpe" && p.blocks.len() == 6),
        "wpe [37, 20] in 6 blocks"
    );
    let n_blocks: usize = params
        .iter()
        .filter(|p| p.blocks.len() > 1)
        .map(|p| p.blocks.len())
        .sum();
    assert_eq!(
        n_blocks, expected_blocks,
        "blocks of the blocked parameters"
    );
    let mut w_ref: Vec<Vec<f64>> = params
        .iter()
        .map(|p| e.buffer(&p.name).expect("param"))
        .collect();
    let w0 = w_ref.clone();
    let mut worst = 0.0f64;
    for t in 1..=STEPS {
        let mult = lr_multiplier(t);
        let group = Group {
            lr: soap.lr * mult,
            betas: (soap.beta1, soap.beta2),
            shampoo_beta: soap.shampoo_beta,
            eps: soap.eps,
            weight_decay: soap.weight_decay,
            precondition_frequency: soap.precondition_frequency as usize,
            max_precond_dim: mpd,
            normalize_grads: soap.normalize_grads,
            correct_bias: soap.correct_bias,
        };
        for (k, p) in params.iter_mut().enumerate() {
            let g = gradient(p, k, t, mpd);
            e.set_buffer(&p.grad, &g).expect("grad");
            if !reference {
                continue;
            }
            let w = &mut w_ref[k];
            for (r0, c0, r, c, st) in p.blocks.iter_mut() {
                let at = (*r0, *c0, *r, *c);
                let mut pb = cut(w, p.n, at);
                st.step(&mut pb, &cut(&g, p.n, at), &group);
                for (i, row) in pb.iter().enumerate() {
                    let o = (*r0 + i) * p.n + *c0;
                    w[o..o + *c].copy_from_slice(row);
                }
            }
        }
        assert!(e.optimizer_step(t, mult).expect("optimizer step"));
        e.run_host_tasks(t).expect("refreshes");
        if reference {
            for (p, w) in params.iter().zip(&w_ref) {
                let err = rel_err(&e.buffer(&p.name).expect("param"), w);
                assert!(
                    err <= TOL,
                    "step {t}: {} [{}, {}] in {} blocks: rel err {err:e}",
                    p.name,
                    p.m,
                    p.n,
                    p.blocks.len()
                );
                worst = worst.max(err);
            }
        }
    }
    let last: Vec<(String, Vec<f64>)> = params
        .iter()
        .map(|p| (p.name.clone(), e.buffer(&p.name).expect("param")))
        .collect();
    if reference {
        // The parameters really moved (the comparison is not vacuous).
        let moved = last
            .iter()
            .zip(&w0)
            .map(|((_, a), b)| rel_err(a, b))
            .fold(f64::INFINITY, f64::min);
        assert!(moved > 1e-3, "a parameter barely changed: {moved:e}");
    }
    (worst, last)
}

/// Runs blocked SOAP against the per-block reference, then the same config unblocked, and
/// checks that blocking changed the blocked parameters by far more than the tolerance.
/// `blocks`: the blocks of the blocked parameters the config must make.
fn check(soap: SoapConfig, label: &str, blocks: usize) {
    let (worst, blocked) = run(&soap, true, blocks);
    eprintln!("{label}: worst rel err over {STEPS} steps, every parameter: {worst:e}");
    let (_, unblocked) = run(
        &SoapConfig {
            block_size: None,
            ..soap
        },
        false,
        blocks,
    );
    let diff = blocked
        .iter()
        .zip(&unblocked)
        .filter(|((name, _), _)| name == "wpe" || name == "wte")
        .map(|((_, a), (_, b))| rel_err(a, b))
        .fold(f64::INFINITY, f64::min);
    eprintln!("{label}: blocked vs unblocked (wte, wpe), smaller of the two: {diff:e}");
    assert!(
        diff > 1e-3,
        "{label}: blocking made no difference: {diff:e}"
    );
}

fn soap_config() -> SoapConfig {
    SoapConfig {
        lr: BASE_LR,
        beta1: 0.95,
        beta2: 0.95,
        shampoo_beta: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
        precondition_frequency: 4,
        max_precond_dim: 10000,
        correct_bias: true,
        normalize_grads: false,
        block_size: Some(BLOCK),
    }
}

#[test]
fn blocked_soap_is_soap_py_per_block() {
    check(soap_config(), "defaults", 62);
}

#[test]
fn blocked_soap_is_soap_py_per_block_with_unrotated_sides_and_normalized_grads() {
    check(
        SoapConfig {
            beta1: 0.9,
            beta2: 0.99,
            shampoo_beta: 0.9,
            precondition_frequency: 3,
            max_precond_dim: 40,
            correct_bias: false,
            normalize_grads: true,
            ..soap_config()
        },
        "max_precond_dim 40, normalized",
        26,
    );
}
