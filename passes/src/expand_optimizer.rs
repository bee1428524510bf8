//! `expand-optimizer`: per parameter (from the `grad_of` markers), creates the optimizer state
//! tensors and the update ops: a global `clip_grad_norm`, then AdamW or SOAP.
//!
//! SOAP (Vyas et al. 2024, reference `soap.py`) for a 2-D parameter `[m, n]`: Adam moments
//! `[m, n]` kept in the eigenbasis, Kronecker factors `L [m, m]`, `R [n, n]` and their
//! eigenbases `Q_L`, `Q_R` for each side whose size is ≤ `max_precond_dim` (a larger side, e.g.
//! the vocabulary side of an embedding, stays unrotated); each step the composition of
//! `optim::optimizers::soap` (`project` the gradient into the eigenbases, an
//! `elementwise_update` of the moments whose result is the update direction there, `project`
//! it back, an `elementwise_update` of the parameter; on a CPU target `fuse` makes the four one
//! `soap_update`, a CUDA target runs them as written, and with `normalize_grads` this pass
//! writes `soap_update` itself), then
//! `soap_factor_update`, and one `eigenbasis_refresh` host task per factor.
//! 1-D parameters get no factors (Adam in the identity basis, as the reference with
//! `precondition_1d = False`). AdamW applies weight decay to 2-D parameters only (nanoGPT);
//! SOAP applies it to all parameters, as the reference does.
//!
//! KL-Shampoo (Lin et al. 2025, reference `KLOpt`) for a 2-D parameter `[m, n]`: the momentum
//! `[m, n]` (unrotated), the eigenvalue estimates `D_L [m]`, `D_R [n]`, and for each side ≤
//! `max_precond_dim` a Kronecker factor and its basis; each step the composition of
//! `optim::optimizers::kl_shampoo` (the momentum rule, `project`, `kl_scale`, `project` back,
//! the step rule, `kl_factor_update`; `fuse` makes it one `kl_shampoo_update`, and with
//! `normalize_grads` this pass writes `kl_shampoo_update` itself), and one
//! `eigenbasis_refresh` host task with `method = qr` per factor. The reference does not support
//! 1-D parameters (they go to an auxiliary Adam in its users' code): here they get AdamW with
//! the block's lr, `betas`, ε and no weight decay.
//!
//! Shampoo (Gupta et al. 2018; Distributed Shampoo's semantics, `docs/shampoo.md`) for any
//! parameter: the parameter is cut into blocks (`schedule::blocking`: `merge_small_dims`, then
//! at most `max_preconditioner_dim` rows and columns per block); every side of every block gets
//! a Kronecker factor and an inverse root, refreshed by an `eigenbasis_refresh` with `method =
//! inverse_root` (exponent 4 for a matrix block's sides, 2 for a vector block's); the first
//! moment and, with grafting, the Adam grafting second moment have the parameter's shape. Each
//! step is the composition of `optim::optimizers::shampoo` (`shampoo_factor_update`, the
//! moments `elementwise_update`, `shampoo_precondition`, `graft`, the step
//! `elementwise_update`), which `fuse` makes one `shampoo_update`; with β₁ = 0 this pass writes
//! `shampoo_update` itself. Weight decay applies to every parameter, as the reference's.
//!
//! An optimizer defined by its element-wise rule (`optim::optimizers`: Lion, ...) gets the
//! state its definition lists and one `elementwise_update` per parameter carrying the rule, its
//! hyperparameters folded in as constants (weight decay 0 for parameters of fewer than two
//! dimensions, as AdamW).
use crate::{Pass, PassContext, PassError};
use ir::config::{ElementwiseConfig, OptimizerConfig, ShampooConfig};
use ir::{BufferClass, Init, Module, Op, Section, SoapHyper, TensorType, ValueId};
use optim::optimizers;

/// The `expand-optimizer` pass.
pub struct ExpandOptimizer;

fn state(m: &mut Module, class: BufferClass, name: String, ty: TensorType) -> ValueId {
    m.push1(
        Section::State,
        Op::State {
            class,
            init: Init::Zeros,
        },
        &[],
        &name,
        ty,
    )
}

/// The Kronecker factor and basis (`{param}.L`, `{param}.QL`; `.R`, `.QR`) of each side of a
/// `[rows, cols]` parameter no longer than `max_dim` (SOAP and KL-Shampoo alike); counts the
/// sides with and without them.
fn factor_sides(
    m: &mut Module,
    pname: &str,
    dims: [usize; 2],
    max_dim: usize,
    (n_factors, n_unrotated): (&mut usize, &mut usize),
) -> [Option<(ValueId, ValueId)>; 2] {
    let mut sides = [None, None];
    for (side, d) in dims.into_iter().enumerate() {
        if d > max_dim {
            *n_unrotated += 1;
            continue;
        }
        let which = if side == 0 { "L" } else { "R" };
        let sq = TensorType::f32([d, d]);
        let f = state(
            m,
            BufferClass::KroneckerFactor,
            format!("{pname}.{which}"),
            sq.clone(),
        );
        let q = state(m, BufferClass::Eigenbasis, format!("{pname}.Q{which}"), sq);
        sides[side] = Some((f, q));
        *n_factors += 1;
    }
    sides
}

/// The state, per-step ops and inverse-root refreshes of parameter `p` (gradient `g`):
/// `{param}.exp_avg`, `{param}.graft_sq` (with grafting), and per block `b` of
/// `schedule::blocking::blocks(shape, max_preconditioner_dim)` the factor and inverse root
/// of each side (`{param}.L{b}` / `{param}.PL{b}`, `.R{b}` / `.PR{b}`; no index for a single
/// block). The step is the composition of `optim::optimizers::shampoo`: `shampoo_factor_update`,
/// the moments `elementwise_update` (results `{param}.gbar` and, with grafting,
/// `{param}.graft_dir`), `shampoo_precondition`, `graft` (with grafting) and the step
/// `elementwise_update`; `fuse` makes them one `shampoo_update`. With β₁ = 0 (no first moment,
/// which the hand-written op still takes) this pass writes `shampoo_update` itself. Returns the
/// number of blocks.
///
/// # Errors
/// An unbuildable rule (a bug).
fn shampoo(
    m: &mut Module,
    c: &ShampooConfig,
    p: ValueId,
    g: ValueId,
    pname: &str,
    ty: &TensorType,
) -> Result<usize, PassError> {
    let (_, blocks) = schedule::blocking::blocks(&ty.shape, c.max_preconditioner_dim);
    let exp_avg = state(
        m,
        BufferClass::ExpAvg,
        format!("{pname}.exp_avg"),
        ty.clone(),
    );
    let graft_sq = c.grafting.then(|| {
        state(
            m,
            BufferClass::ExpAvgSq,
            format!("{pname}.graft_sq"),
            ty.clone(),
        )
    });
    let (mut factors, mut roots, mut refreshes) = (Vec::new(), Vec::new(), Vec::new());
    for (bi, b) in blocks.iter().enumerate() {
        let sides = b.sides();
        let exponent = 2 * sides.len() as u32;
        let index = if blocks.len() > 1 {
            bi.to_string()
        } else {
            String::new()
        };
        for (side, d) in sides.into_iter().enumerate() {
            let which = if side == 0 { "L" } else { "R" };
            let sq = TensorType::f32([d, d]);
            let f = state(
                m,
                BufferClass::KroneckerFactor,
                format!("{pname}.{which}{index}"),
                sq.clone(),
            );
            let r = state(
                m,
                BufferClass::InverseRoot,
                format!("{pname}.P{which}{index}"),
                sq,
            );
            factors.push(f);
            roots.push(r);
            refreshes.push((side as u8, f, r, exponent));
        }
    }
    let hyper = ir::ShampooHyper {
        lr: c.lr,
        beta1: c.beta1,
        beta2: c.beta2,
        epsilon: c.epsilon,
        weight_decay: c.weight_decay,
        use_bias_correction: c.use_bias_correction,
        max_preconditioner_dim: c.max_preconditioner_dim as u64,
        grafting: c.grafting,
        grafting_beta2: c.grafting_beta2,
        grafting_epsilon: c.grafting_epsilon,
    };
    if hyper.beta1 == 0.0 {
        let mut args = vec![p, g, exp_avg];
        args.extend(graft_sq);
        args.extend(factors.iter().zip(&roots).flat_map(|(&f, &r)| [f, r]));
        m.push0(Section::Optimizer, Op::ShampooUpdate { hyper }, &args);
    } else {
        let (moments, step) =
            optim::optimizers::shampoo::rules(&hyper).map_err(|e| PassError::Invalid {
                pass: "expand-optimizer",
                message: format!("Shampoo's update rules for {pname}: {e}"),
            })?;
        let moments = moments.ok_or_else(|| PassError::Invalid {
            pass: "expand-optimizer",
            message: format!("internal: Shampoo with β₁ ≠ 0 has no moments rule ({pname})"),
        })?;
        let b = hyper.max_preconditioner_dim;
        let mut args = vec![g];
        args.extend(&factors);
        let op = Op::ShampooFactorUpdate {
            beta2: hyper.beta2,
            use_bias_correction: hyper.use_bias_correction,
            max_preconditioner_dim: b,
        };
        m.push0(Section::Optimizer, op, &args);
        let f32_ty = TensorType::f32(ty.shape.clone());
        let mut args = vec![p, g, exp_avg];
        args.extend(graft_sq);
        let mut results = vec![(format!("{pname}.gbar"), f32_ty.clone())];
        if hyper.grafting {
            results.push((format!("{pname}.graft_dir"), f32_ty.clone()));
        }
        let op = Op::ElementwiseUpdate { rule: moments };
        let (_, out) = m.push(Section::Optimizer, op, &args, results);
        let mut args = vec![out[0]];
        args.extend(&roots);
        let op = Op::ShampooPrecondition {
            max_preconditioner_dim: b,
        };
        let pre = m.push1(
            Section::Optimizer,
            op,
            &args,
            &format!("{pname}.precond"),
            f32_ty.clone(),
        );
        let dir = match out.get(1) {
            Some(&pg) => m.push1(
                Section::Optimizer,
                Op::Graft {
                    max_preconditioner_dim: b,
                },
                &[pre, pg],
                &format!("{pname}.dir"),
                f32_ty,
            ),
            None => pre,
        };
        m.push0(
            Section::Optimizer,
            Op::ElementwiseUpdate { rule: step },
            &[p, dir],
        );
    }
    for (side, f, r, exponent) in refreshes {
        let op = Op::EigenbasisRefresh {
            side,
            frequency: c.precondition_frequency,
            offset: 0,
            staleness: 0,
            placement: ir::Placement::Host,
            method: ir::RefreshMethod::InverseRoot,
            root: Some(ir::InverseRoot {
                exponent,
                epsilon: c.epsilon,
            }),
        };
        m.push0(Section::Refresh, op, &[f, r]);
    }
    Ok(blocks.len())
}

/// KL-Shampoo's step of one 2-D parameter as the composition of
/// `optim::optimizers::kl_shampoo` (the momentum rule with its result `{param}.mom`, `project`
/// into the bases, `kl_scale`, `project` back, the step rule, `kl_factor_update`); `fuse` makes
/// it one `kl_shampoo_update`. `args` are that op's: `[param, grad, exp_avg, eig_left,
/// eig_right]` then `(factor, basis)` of each side that has them.
///
/// # Errors
/// An unbuildable rule (a bug).
fn kl_shampoo(
    module: &mut Module,
    hyper: &ir::KlShampooHyper,
    (left, right): (bool, bool),
    args: &[ValueId],
    pname: &str,
    ty: &TensorType,
) -> Result<(), PassError> {
    let (momentum, step) =
        optim::optimizers::kl_shampoo::rules(hyper).map_err(|e| PassError::Invalid {
            pass: "expand-optimizer",
            message: format!("KL-Shampoo's update rules for {pname}: {e}"),
        })?;
    let [p, g, exp_avg, eig_left, eig_right] = args[..5] else {
        return Err(PassError::Invalid {
            pass: "expand-optimizer",
            message: format!("internal: KL-Shampoo operands of {pname}"),
        });
    };
    let bases: Vec<ValueId> = args[5..]
        .chunks(2)
        .filter_map(|fq| fq.get(1).copied())
        .collect();
    let f32_ty = TensorType::f32(ty.shape.clone());
    let mom = module.push1(
        Section::Optimizer,
        Op::ElementwiseUpdate { rule: momentum },
        &[p, g, exp_avg],
        &format!("{pname}.mom"),
        f32_ty.clone(),
    );
    let rotate = |module: &mut Module, x: ValueId, back: bool, name: String| match left || right {
        true => {
            let mut a = vec![x];
            a.extend(&bases);
            let op = Op::Project { back, left, right };
            module.push1(Section::Optimizer, op, &a, &name, f32_ty.clone())
        }
        false => x,
    };
    let x = rotate(module, mom, false, format!("{pname}.mom_eig"));
    let y = module.push1(
        Section::Optimizer,
        Op::KlScale { eps: hyper.eps },
        &[x, eig_left, eig_right],
        &format!("{pname}.dir_eig"),
        f32_ty.clone(),
    );
    let u = rotate(module, y, true, format!("{pname}.dir"));
    module.push0(
        Section::Optimizer,
        Op::ElementwiseUpdate { rule: step },
        &[p, u],
    );
    let mut fargs = vec![g, eig_left, eig_right];
    fargs.extend(&args[5..]);
    let op = Op::KlFactorUpdate {
        shampoo_beta: hyper.shampoo_beta,
        init_factor: hyper.init_factor,
        max_clamp_value: hyper.max_clamp_value,
        left,
        right,
    };
    module.push0(Section::Optimizer, op, &fargs);
    Ok(())
}

/// SOAP's state, update, factor accumulation and refreshes of one parameter (or one block of
/// a blocked parameter: then `p`, `g` are `block_copy` values and `pname` the block's name).
fn soap_param(
    module: &mut Module,
    c: &ir::config::SoapConfig,
    [p, g, exp_avg, exp_avg_sq]: [ValueId; 4],
    pname: &str,
    ty: &TensorType,
    (n_factors, n_unrotated): (&mut usize, &mut usize),
) -> Result<(), PassError> {
    let hyper = SoapHyper {
        lr: c.lr,
        beta1: c.beta1,
        beta2: c.beta2,
        eps: c.eps,
        weight_decay: c.weight_decay,
        correct_bias: c.correct_bias,
        normalize_grads: c.normalize_grads,
    };
    // One entry per side: (factor, basis) when that side is preconditioned.
    let mut sides: [Option<(ValueId, ValueId)>; 2] = [None, None];
    if let [rows, cols] = ty.shape[..] {
        sides = factor_sides(
            module,
            pname,
            [rows, cols],
            c.max_precond_dim,
            (n_factors, n_unrotated),
        );
    }
    let (left, right) = (sides[0].is_some(), sides[1].is_some());
    let bases: Vec<ValueId> = sides.iter().flatten().map(|s| s.1).collect();
    let composed = match hyper.normalize_grads {
        false => Some(
            optim::optimizers::soap::rules(&hyper).map_err(|e| PassError::Invalid {
                pass: "expand-optimizer",
                message: format!("SOAP's update rules for {pname}: {e}"),
            })?,
        ),
        true => None,
    };
    match composed {
        // The composition (`optim::optimizers::soap`): rotate the gradient, the moments rule,
        // rotate back, the step rule. `fuse` makes it one `soap_update` on a CPU target.
        Some((moments, step)) => {
            let f32_ty = TensorType::f32(ty.shape.clone());
            let rotate = |module: &mut Module, x: ValueId, back: bool, name: String| {
                let mut args = vec![x];
                args.extend(&bases);
                let op = Op::Project { back, left, right };
                module.push1(Section::Optimizer, op, &args, &name, f32_ty.clone())
            };
            let rotated = left || right;
            let g_eig = match rotated {
                true => rotate(module, g, false, format!("{pname}.grad_eig")),
                false => g,
            };
            let u = module.push1(
                Section::Optimizer,
                Op::ElementwiseUpdate { rule: moments },
                &[p, g_eig, exp_avg, exp_avg_sq],
                &format!("{pname}.dir_eig"),
                f32_ty.clone(),
            );
            let dir = match rotated {
                true => rotate(module, u, true, format!("{pname}.dir")),
                false => u,
            };
            module.push0(
                Section::Optimizer,
                Op::ElementwiseUpdate { rule: step },
                &[p, dir],
            );
        }
        // `normalize_grads` (a reduction over the update): the hand-written op.
        None => {
            let mut args = vec![p, g, exp_avg, exp_avg_sq];
            args.extend(&bases);
            module.push0(
                Section::Optimizer,
                Op::SoapUpdate { hyper, left, right },
                &args,
            );
        }
    }
    if left || right {
        let mut args = vec![g];
        args.extend(sides.iter().flatten().map(|s| s.0));
        module.push0(
            Section::Optimizer,
            Op::SoapFactorUpdate {
                shampoo_beta: c.shampoo_beta,
                left,
                right,
            },
            &args,
        );
    }
    for (side, s) in sides.iter().enumerate() {
        if let Some((f, q)) = s {
            // Native schedule; `precond-scheduling` decides placement,
            // staggering and staleness.
            let op = Op::EigenbasisRefresh {
                side: side as u8,
                frequency: c.precondition_frequency,
                offset: 0,
                staleness: 0,
                placement: ir::Placement::Host,
                method: ir::RefreshMethod::Soap,
                root: None,
            };
            module.push0(Section::Refresh, op, &[*f, *q, exp_avg, exp_avg_sq]);
        }
    }
    Ok(())
}

/// Blocked SOAP (`max_preconditioner_dim`, the IR's `block_size`): a side of a 2-D parameter
/// longer than `block_size` and at most `max_precond_dim` is cut into pieces of `block_size`
/// (the remainder last; Distributed Shampoo's `multi_dim_split`, `schedule::blocking`, without
/// merging); a side longer than `max_precond_dim` stays whole and unrotated, as `soap.py`
/// leaves it (LLaMA's vocabulary side at `max_precond_dim = 10000`: rotating a side whose
/// gradient rows are mostly zero, the embedding's unseen tokens, spreads the projections'
/// rounding over every row, and LLaMA 1.44B diverged so at blocks of 2048). Each block is a SOAP
/// parameter of its own (`soap.py` on the block): per step `block_copy` cuts the block out of
/// the parameter and of its gradient, the block's SOAP ops run on those copies, and
/// `block_write` puts the updated block back. Returns the number of blocks, or `None` when no
/// side is cut.
fn blocked_soap(
    module: &mut Module,
    c: &ir::config::SoapConfig,
    (p, g): (ValueId, ValueId),
    pname: &str,
    ty: &TensorType,
    counters: (&mut usize, &mut usize),
) -> Result<Option<usize>, PassError> {
    let Some(b) = c.block_size else {
        return Ok(None);
    };
    let [rows, cols] = ty.shape[..] else {
        return Ok(None);
    };
    let cut = |n: usize| n > b && n <= c.max_precond_dim;
    if !cut(rows) && !cut(cols) {
        return Ok(None);
    }
    let (n_factors, n_unrotated) = counters;
    let chunks = |n: usize| {
        let b = if cut(n) { b } else { n };
        (0..n.div_ceil(b)).map(move |i| (i * b, b.min(n - i * b)))
    };
    let mut count = 0;
    for (r0, r) in chunks(rows) {
        for (c0, k) in chunks(cols) {
            let bty = TensorType::f32([r, k]);
            let name = format!("{pname}.b{count}");
            let op = || Op::BlockCopy { row: r0, col: c0 };
            let gb = module.push1(
                Section::Optimizer,
                op(),
                &[g],
                &format!("{name}.grad"),
                bty.clone(),
            );
            let pb = module.push1(Section::Optimizer, op(), &[p], &name, bty.clone());
            let exp_avg = state(
                module,
                BufferClass::ExpAvg,
                format!("{name}.exp_avg"),
                bty.clone(),
            );
            let exp_avg_sq = state(
                module,
                BufferClass::ExpAvgSq,
                format!("{name}.exp_avg_sq"),
                bty.clone(),
            );
            soap_param(
                module,
                c,
                [pb, gb, exp_avg, exp_avg_sq],
                &name,
                &bty,
                (&mut *n_factors, &mut *n_unrotated),
            )?;
            module.push0(
                Section::Optimizer,
                Op::BlockWrite { row: r0, col: c0 },
                &[p, pb],
            );
            count += 1;
        }
    }
    Ok(Some(count))
}

/// The state and `elementwise_update` of parameter `p` (gradient `g`) under an optimizer
/// defined by its rule: one zero-initialised state tensor per entry of the definition, named
/// `{param}.{suffix}`; weight decay only for parameters of two or more dimensions.
fn elementwise(
    m: &mut Module,
    c: &ElementwiseConfig,
    p: ValueId,
    g: ValueId,
    pname: &str,
    ty: &TensorType,
) -> Result<(), PassError> {
    let invalid = |message: String| PassError::Invalid {
        pass: "expand-optimizer",
        message,
    };
    let def = optimizers::find(&c.name)
        .ok_or_else(|| invalid(format!("no optimizer named `{}`", c.name)))?;
    let mut hyper = c.hyper.clone();
    if ty.shape.len() < 2 {
        for (k, x) in hyper.iter_mut() {
            if k == "weight_decay" {
                *x = 0.0;
            }
        }
    }
    let rule = def
        .plan_rule(&hyper)
        .map_err(|e| invalid(format!("the `{}` rule: {e}", c.name)))?;
    let mut args = vec![p, g];
    for s in def.state {
        let name = format!("{pname}.{}", s.suffix);
        args.push(state(m, s.class, name, ty.clone()));
    }
    m.push0(Section::Optimizer, Op::ElementwiseUpdate { rule }, &args);
    Ok(())
}

impl Pass for ExpandOptimizer {
    fn name(&self) -> &'static str {
        "expand-optimizer"
    }

    fn run(&mut self, module: &mut Module, _cx: &mut PassContext) -> Result<String, PassError> {
        if module.section(Section::Optimizer).next().is_some() {
            return Err(PassError::Invalid {
                pass: "expand-optimizer",
                message: "module already has an optimizer section".into(),
            });
        }
        let pairs: Vec<(ValueId, ValueId)> = module
            .section(Section::Backward)
            .filter(|&i| module.inst(i).op == Op::GradOf)
            .map(|i| (module.inst(i).args[0], module.inst(i).args[1]))
            .collect();
        if pairs.is_empty() {
            return Err(PassError::Invalid {
                pass: "expand-optimizer",
                message: "no `grad_of` markers (run autodiff first)".into(),
            });
        }
        let grads: Vec<ValueId> = pairs.iter().map(|p| p.1).collect();
        let max_norm = module.config.train.grad_clip;
        module.push1(
            Section::Optimizer,
            Op::ClipGradNorm { max_norm },
            &grads,
            "grad_norm",
            TensorType::f32([1]),
        );
        let opt = module.config.optimizer.clone();
        let (mut n_factors, mut n_unrotated) = (0, 0);
        if let OptimizerConfig::Shampoo(c) = &opt {
            let counts: Vec<(usize, String)> = pairs
                .iter()
                .map(|&(p, _)| {
                    let v = module.value(p);
                    let (_, b) = schedule::blocking::blocks(&v.ty.shape, c.max_preconditioner_dim);
                    (b.len(), v.name.clone())
                })
                .collect();
            let total: usize = counts.iter().map(|c| c.0).sum();
            if total as u64 > ir::limits::SHAMPOO_BLOCKS {
                let (most, name) = counts.iter().max().cloned().unwrap_or_default();
                return Err(PassError::Invalid {
                    pass: "expand-optimizer",
                    message: format!(
                        "max_preconditioner_dim = {} cuts the model into {total} Shampoo blocks, \
                         more than {} ({name} alone has {most}); raise max_preconditioner_dim",
                        c.max_preconditioner_dim,
                        ir::limits::SHAMPOO_BLOCKS
                    ),
                });
            }
        }
        if let OptimizerConfig::Soap(ir::config::SoapConfig {
            block_size: Some(b),
            max_precond_dim,
            ..
        }) = &opt
        {
            let total: usize = pairs
                .iter()
                .map(|&(p, _)| match module.value(p).ty.shape[..] {
                    [r, k] => {
                        let pieces = |n: usize| {
                            if n > *b && n <= *max_precond_dim {
                                n.div_ceil(*b)
                            } else {
                                1
                            }
                        };
                        match pieces(r) * pieces(k) {
                            1 => 0,
                            n => n,
                        }
                    }
                    _ => 0,
                })
                .sum();
            if total as u64 > ir::limits::SHAMPOO_BLOCKS {
                return Err(PassError::Invalid {
                    pass: "expand-optimizer",
                    message: format!(
                        "max_preconditioner_dim = {b} cuts the model into {total} SOAP blocks, more \
                         than {}; raise max_preconditioner_dim",
                        ir::limits::SHAMPOO_BLOCKS
                    ),
                });
            }
        }
        let mut n_blocks = 0;
        for (p, g) in pairs {
            let pname = module.value(p).name.clone();
            let ty = module.value(p).ty.clone();
            if let OptimizerConfig::Shampoo(c) = &opt {
                n_blocks += shampoo(module, c, p, g, &pname, &ty)?;
                continue;
            }
            if let OptimizerConfig::Elementwise(c) = &opt {
                elementwise(module, c, p, g, &pname, &ty)?;
                continue;
            }
            if let (OptimizerConfig::KlShampoo(c), [rows, cols]) = (&opt, &ty.shape[..]) {
                let (rows, cols) = (*rows, *cols);
                let exp_avg = state(
                    module,
                    BufferClass::ExpAvg,
                    format!("{pname}.exp_avg"),
                    ty.clone(),
                );
                let mut args = vec![p, g, exp_avg];
                for (which, d) in [("L", rows), ("R", cols)] {
                    args.push(state(
                        module,
                        BufferClass::EigenvalueEstimate,
                        format!("{pname}.D{which}"),
                        TensorType::f32([d]),
                    ));
                }
                let sides = factor_sides(
                    module,
                    &pname,
                    [rows, cols],
                    c.max_precond_dim,
                    (&mut n_factors, &mut n_unrotated),
                );
                args.extend(sides.iter().flatten().flat_map(|&(f, q)| [f, q]));
                let hyper = ir::KlShampooHyper {
                    lr: c.lr,
                    beta1: c.beta1,
                    shampoo_beta: c.shampoo_beta,
                    eps: c.eps,
                    weight_decay: c.weight_decay,
                    init_factor: c.init_factor,
                    max_clamp_value: c.max_clamp_value,
                    normalize_grads: c.normalize_grads,
                };
                let (left, right) = (sides[0].is_some(), sides[1].is_some());
                match hyper.normalize_grads {
                    // `normalize_grads` (a reduction over the update): the hand-written op.
                    true => {
                        module.push0(
                            Section::Optimizer,
                            Op::KlShampooUpdate { hyper, left, right },
                            &args,
                        );
                    }
                    false => kl_shampoo(module, &hyper, (left, right), &args, &pname, &ty)?,
                }
                for (side, s) in sides.iter().enumerate() {
                    if let Some((f, q)) = s {
                        let op = Op::EigenbasisRefresh {
                            side: side as u8,
                            frequency: c.precondition_frequency,
                            offset: 0,
                            staleness: 0,
                            placement: ir::Placement::Host,
                            method: ir::RefreshMethod::Qr,
                            root: None,
                        };
                        module.push0(Section::Refresh, op, &[*f, *q, exp_avg]);
                    }
                }
                continue;
            }
            if let OptimizerConfig::Soap(c) = &opt {
                let counters = (&mut n_factors, &mut n_unrotated);
                if let Some(n) = blocked_soap(module, c, (p, g), &pname, &ty, counters)? {
                    n_blocks += n;
                    continue;
                }
            }
            let exp_avg = state(
                module,
                BufferClass::ExpAvg,
                format!("{pname}.exp_avg"),
                ty.clone(),
            );
            let exp_avg_sq = state(
                module,
                BufferClass::ExpAvgSq,
                format!("{pname}.exp_avg_sq"),
                ty.clone(),
            );
            match &opt {
                OptimizerConfig::Adamw(c) => {
                    let weight_decay = if ty.shape.len() >= 2 {
                        c.weight_decay
                    } else {
                        0.0
                    };
                    let op = Op::AdamW {
                        lr: c.lr,
                        beta1: c.beta1,
                        beta2: c.beta2,
                        eps: c.eps,
                        weight_decay,
                    };
                    module.push0(Section::Optimizer, op, &[p, g, exp_avg, exp_avg_sq]);
                }
                OptimizerConfig::Elementwise(_) | OptimizerConfig::Shampoo(_) => {
                    unreachable!("expanded above")
                }
                OptimizerConfig::KlShampoo(c) => {
                    // A 1-D parameter: AdamW (see the module docs).
                    let op = Op::AdamW {
                        lr: c.lr,
                        beta1: c.beta1,
                        beta2: c.beta2,
                        eps: c.eps,
                        weight_decay: 0.0,
                    };
                    module.push0(Section::Optimizer, op, &[p, g, exp_avg, exp_avg_sq]);
                }
                OptimizerConfig::Soap(c) => soap_param(
                    module,
                    c,
                    [p, g, exp_avg, exp_avg_sq],
                    &pname,
                    &ty,
                    (&mut n_factors, &mut n_unrotated),
                )?,
            }
        }
        Ok(match opt {
            OptimizerConfig::Adamw(_) => format!("adamw on {} parameters", grads.len()),
            OptimizerConfig::Elementwise(c) => {
                format!(
                    "{} on {} parameters (an element-wise rule)",
                    c.name,
                    grads.len()
                )
            }
            OptimizerConfig::KlShampoo(_) => format!(
                "kl_shampoo on {} parameters: {n_factors} Kronecker factors, {n_unrotated} sides \
                 with an eigenvalue estimate only, 1-D parameters by AdamW",
                grads.len()
            ),
            OptimizerConfig::Shampoo(_) => format!(
                "shampoo on {} parameters: {n_blocks} blocks, each side with a Kronecker factor \
                 and an inverse root",
                grads.len()
            ),
            OptimizerConfig::Soap(_) => format!(
                "soap on {} parameters: {n_factors} Kronecker factors, {n_unrotated} unrotated \
                 sides{}",
                grads.len(),
                if n_blocks > 0 {
                    format!(", {n_blocks} blocks of blocked parameters")
                } else {
                    String::new()
                }
            ),
        })
    }
}
