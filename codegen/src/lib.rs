//! Lowering: IR [`Module`] → execution [`Plan`]. Every value becomes a named buffer (shape,
//! dtype, class, init); each instruction of the forward, backward and optimizer sections becomes
//! the plan op of the same name over those buffers; refresh instructions become host tasks;
//! the config's data, train and target sections become the plan's; the memory plan is the
//! unshared one (every buffer in its own place, `schedule::MemoryPlan::unshared`) until the
//! `memory-planning` pass replaces it. The plan is verified
//! before it is returned, so a compiler bug cannot produce a plan the engine would reject.
#![deny(missing_docs)]

use ir::config::{CorpusConfig, Family, TargetConfig, TokenizerKind};
use ir::{BufferClass, Init, InputRole, Module, Op, Section, ValueId};
use schedule::{
    Buffer, BufferId, Corpus, DataPlan, HostTask, MemoryPlan, ModelFamily, ModelPlan, Op as P,
    ParamRef, Plan, PlanError, TargetPlan, Tokenizer, TrainPlan, PLAN_FORMAT, PLAN_VERSION,
};
use thiserror::Error;

/// Lowering failure (a module that did not pass through the pipeline, or a compiler bug).
#[derive(Debug, Error)]
pub enum LowerError {
    /// The module lacks something the plan needs.
    #[error("cannot lower: {0}")]
    Missing(String),
    /// An instruction cannot appear where it is.
    #[error("cannot lower `{op}` in the {section} section")]
    Misplaced {
        /// Op name.
        op: &'static str,
        /// Section keyword.
        section: &'static str,
    },
    /// The produced plan failed verification (a compiler bug).
    #[error("lowered plan failed verification (compiler bug): {0}")]
    Verify(#[from] PlanError),
}

/// The buffer class of every value (indexed by value index): `state` values carry theirs,
/// inputs are `input`, gradients marked by `grad_of` are `gradient`, `[1]` results of the loss and
/// of clipping are `scalar`, everything else is `activation`.
pub fn classify_values(module: &Module) -> Vec<BufferClass> {
    let mut classes = vec![BufferClass::Activation; module.num_values()];
    for i in module.insts() {
        let inst = module.inst(i);
        match &inst.op {
            Op::State { class, .. } => classes[inst.results[0].index()] = *class,
            Op::Input { .. } => classes[inst.results[0].index()] = BufferClass::Input,
            Op::GradOf => classes[inst.args[1].index()] = BufferClass::Gradient,
            Op::Loss => classes[inst.args[0].index()] = BufferClass::Scalar,
            Op::ClipGradNorm { .. } => {
                for r in &inst.results {
                    classes[r.index()] = BufferClass::Scalar;
                }
            }
            _ => {}
        }
    }
    classes
}

/// Lowers a fully expanded module (after `expand-optimizer`) to a verified plan.
pub fn lower(module: &Module) -> Result<Plan, LowerError> {
    let classes = classify_values(module);
    let mut ids: Vec<Option<BufferId>> = vec![None; module.num_values()];
    let mut buffers = Vec::new();
    let mut inits = vec![Init::Zeros; module.num_values()];
    for i in module.insts() {
        if let Op::State { init, .. } = module.inst(i).op {
            inits[module.inst(i).results[0].index()] = init;
        }
    }
    // Buffers in definition order (deterministic init order for the engine's RNG).
    for i in module.insts() {
        for &r in &module.inst(i).results {
            let v = module.value(r);
            ids[r.index()] = Some(BufferId(buffers.len() as u32));
            buffers.push(Buffer {
                name: v.name.clone(),
                shape: v.ty.shape.clone(),
                dtype: v.ty.dtype,
                class: classes[r.index()],
                init: inits[r.index()],
            });
        }
    }
    let b = |v: ValueId| {
        ids[v.index()].ok_or_else(|| {
            LowerError::Missing(format!("value {} has no buffer", module.display_value(v)))
        })
    };
    let (mut tokens, mut targets, mut loss) = (None, None, None);
    let mut params = Vec::new();
    let (mut forward, mut backward, mut optimizer, mut host_tasks) =
        (vec![], vec![], vec![], vec![]);
    for i in module.insts() {
        let inst = module.inst(i);
        let a = &inst.args;
        let arg = |k: usize| b(a[k]);
        let res = |k: usize| b(inst.results[k]);
        let misplaced = || LowerError::Misplaced {
            op: inst.op.name(),
            section: inst.section.keyword(),
        };
        let op = match &inst.op {
            Op::State { .. } => continue,
            Op::Input {
                role: InputRole::Tokens,
            } => {
                tokens = Some(res(0)?);
                continue;
            }
            Op::Input {
                role: InputRole::Targets,
            } => {
                targets = Some(res(0)?);
                continue;
            }
            Op::Loss => {
                loss = Some(arg(0)?);
                continue;
            }
            Op::GradOf => {
                params.push(ParamRef {
                    param: arg(0)?,
                    grad: arg(1)?,
                });
                continue;
            }
            Op::EigenbasisRefresh {
                side,
                frequency,
                offset,
                staleness,
                placement,
                method,
                root,
            } => {
                if inst.section != Section::Refresh {
                    return Err(misplaced());
                }
                // A `qr` refresh names only the momentum (its shape); the plan's task carries
                // it in both moment fields and the method says neither is an operand.
                // An `inverse_root` refresh has no moment: the root stands in for both.
                let (exp_avg, exp_avg_sq) = match method {
                    schedule::RefreshMethod::Soap => (arg(2)?, arg(3)?),
                    schedule::RefreshMethod::Qr => (arg(2)?, arg(2)?),
                    schedule::RefreshMethod::InverseRoot => (arg(1)?, arg(1)?),
                };
                host_tasks.push(HostTask::EigenbasisRefresh {
                    factor: arg(0)?,
                    basis: arg(1)?,
                    side: *side,
                    exp_avg,
                    exp_avg_sq,
                    frequency: *frequency,
                    offset: *offset,
                    staleness: *staleness,
                    placement: *placement,
                    method: *method,
                    root: *root,
                });
                continue;
            }
            Op::Embedding => P::Embedding {
                table: arg(0)?,
                ids: arg(1)?,
                out: res(0)?,
            },
            Op::EmbeddingBackward => P::EmbeddingBackward {
                dout: arg(0)?,
                ids: arg(1)?,
                dtable: res(0)?,
            },
            Op::AddPositional { seq_len } => P::AddPositional {
                x: arg(0)?,
                pos: arg(1)?,
                out: res(0)?,
                seq_len: *seq_len,
            },
            Op::AddPositionalBackward { seq_len } => P::AddPositionalBackward {
                dout: arg(0)?,
                dpos: res(0)?,
                seq_len: *seq_len,
            },
            Op::LayerNorm { eps } => P::LayerNorm {
                x: arg(0)?,
                weight: arg(1)?,
                bias: a.get(2).map(|&v| b(v)).transpose()?,
                out: res(0)?,
                eps: *eps,
            },
            Op::LayerNormBackward { eps, bias } => P::LayerNormBackward {
                dout: arg(0)?,
                x: arg(1)?,
                weight: arg(2)?,
                dx: res(0)?,
                dweight: res(1)?,
                dbias: if *bias { Some(res(2)?) } else { None },
                eps: *eps,
            },
            Op::RmsNorm { eps } => P::RmsNorm {
                x: arg(0)?,
                weight: arg(1)?,
                out: res(0)?,
                eps: *eps,
            },
            Op::RmsNormBackward { eps } => P::RmsNormBackward {
                dout: arg(0)?,
                x: arg(1)?,
                weight: arg(2)?,
                dx: res(0)?,
                dweight: res(1)?,
                eps: *eps,
            },
            Op::MatMul { trans_a, trans_b } => P::MatMul {
                a: arg(0)?,
                b: arg(1)?,
                out: res(0)?,
                trans_a: *trans_a,
                trans_b: *trans_b,
                accumulate: false,
                micro_accumulate: None,
            },
            Op::MatMulBias { trans_a, trans_b } => P::MatMulBias {
                a: arg(0)?,
                b: arg(1)?,
                bias: arg(2)?,
                out: res(0)?,
                trans_a: *trans_a,
                trans_b: *trans_b,
            },
            Op::BiasAdd => P::BiasAdd {
                x: arg(0)?,
                bias: arg(1)?,
                out: res(0)?,
            },
            Op::SumRows => P::SumRows {
                x: arg(0)?,
                out: res(0)?,
            },
            Op::SumRowsCast => P::SumRowsCast {
                x: arg(0)?,
                out: res(0)?,
                out_bf16: res(1)?,
            },
            Op::Add => P::Add {
                a: arg(0)?,
                b: arg(1)?,
                out: res(0)?,
            },
            Op::Cast => P::Cast {
                x: arg(0)?,
                out: res(0)?,
            },
            Op::Gelu => P::Gelu {
                x: arg(0)?,
                out: res(0)?,
            },
            Op::GeluBackward => P::GeluBackward {
                dout: arg(0)?,
                x: arg(1)?,
                dx: res(0)?,
            },
            Op::SwiGlu => P::SwiGlu {
                x: arg(0)?,
                out: res(0)?,
            },
            Op::SwiGluBackward => P::SwiGluBackward {
                dout: arg(0)?,
                x: arg(1)?,
                dx: res(0)?,
            },
            Op::Rope {
                seq_len,
                head_dim,
                rotated_cols,
                theta,
            } => P::Rope {
                x: arg(0)?,
                out: res(0)?,
                seq_len: *seq_len,
                head_dim: *head_dim,
                rotated_cols: *rotated_cols,
                theta: *theta,
            },
            Op::RopeBackward {
                seq_len,
                head_dim,
                rotated_cols,
                theta,
            } => P::RopeBackward {
                dout: arg(0)?,
                dx: res(0)?,
                seq_len: *seq_len,
                head_dim: *head_dim,
                rotated_cols: *rotated_cols,
                theta: *theta,
            },
            Op::Attention {
                batch,
                seq_len,
                n_heads,
            } => P::Attention {
                qkv: arg(0)?,
                out: res(0)?,
                lse: inst.results.get(1).map(|&v| b(v)).transpose()?,
                batch: *batch,
                seq_len: *seq_len,
                n_heads: *n_heads,
            },
            Op::AttentionBackward {
                batch,
                seq_len,
                n_heads,
            } => P::AttentionBackward {
                dout: arg(0)?,
                qkv: arg(1)?,
                fwd_out: a.get(2).map(|&v| b(v)).transpose()?,
                lse: a.get(3).map(|&v| b(v)).transpose()?,
                dqkv: res(0)?,
                batch: *batch,
                seq_len: *seq_len,
                n_heads: *n_heads,
            },
            Op::CrossEntropy => P::CrossEntropy {
                logits: arg(0)?,
                targets: arg(1)?,
                loss: res(0)?,
            },
            Op::CrossEntropyBackward => P::CrossEntropyBackward {
                logits: arg(0)?,
                targets: arg(1)?,
                dlogits: res(0)?,
            },
            Op::ClipGradNorm { max_norm } => P::ClipGradNorm {
                grads: a.iter().map(|&v| b(v)).collect::<Result<_, _>>()?,
                norm: res(0)?,
                scale: if inst.results.len() > 1 {
                    Some(res(1)?)
                } else {
                    None
                },
                max_norm: *max_norm,
                partials: None,
            },
            Op::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => P::AdamW {
                param: arg(0)?,
                grad: arg(1)?,
                exp_avg: arg(2)?,
                exp_avg_sq: arg(3)?,
                grad_scale: if a.len() > 4 { Some(arg(4)?) } else { None },
                lr: *lr,
                beta1: *beta1,
                beta2: *beta2,
                eps: *eps,
                weight_decay: *weight_decay,
                on_host: false,
            },
            Op::SoapUpdate { hyper, left, right } => {
                let mut rest = a[4..].iter();
                let basis_left = if *left {
                    rest.next().map(|&v| b(v)).transpose()?
                } else {
                    None
                };
                let basis_right = if *right {
                    rest.next().map(|&v| b(v)).transpose()?
                } else {
                    None
                };
                P::SoapUpdate {
                    param: arg(0)?,
                    grad: arg(1)?,
                    exp_avg: arg(2)?,
                    exp_avg_sq: arg(3)?,
                    basis_left,
                    basis_right,
                    hyper: *hyper,
                }
            }
            Op::KlShampooUpdate { hyper, left, right } => {
                let mut rest = a[5..].iter();
                let mut side =
                    |present: bool| -> Result<(Option<BufferId>, Option<BufferId>), LowerError> {
                        if !present {
                            return Ok((None, None));
                        }
                        let f = rest.next().map(|&v| b(v)).transpose()?;
                        let q = rest.next().map(|&v| b(v)).transpose()?;
                        Ok((f, q))
                    };
                let (factor_left, basis_left) = side(*left)?;
                let (factor_right, basis_right) = side(*right)?;
                P::KlShampooUpdate {
                    param: arg(0)?,
                    grad: arg(1)?,
                    exp_avg: arg(2)?,
                    factor_left,
                    factor_right,
                    basis_left,
                    basis_right,
                    eig_left: arg(3)?,
                    eig_right: arg(4)?,
                    hyper: *hyper,
                }
            }
            Op::BlockCopy { row, col } => P::BlockCopy {
                src: arg(0)?,
                dst: res(0)?,
                row: *row,
                col: *col,
            },
            Op::BlockWrite { row, col } => P::BlockWrite {
                dst: arg(0)?,
                src: arg(1)?,
                row: *row,
                col: *col,
            },
            Op::ShampooUpdate { hyper } => {
                let head = if hyper.grafting { 4 } else { 3 };
                let pairs = a[head.min(a.len())..]
                    .chunks(2)
                    .map(|p| match p {
                        [f, r] => Ok((b(*f)?, b(*r)?)),
                        _ => Err(LowerError::Missing("a factor without its root".into())),
                    })
                    .collect::<Result<Vec<_>, LowerError>>()?;
                P::ShampooUpdate {
                    param: arg(0)?,
                    grad: arg(1)?,
                    exp_avg: arg(2)?,
                    graft_sq: if hyper.grafting { Some(arg(3)?) } else { None },
                    factors: pairs.iter().map(|p| p.0).collect(),
                    roots: pairs.iter().map(|p| p.1).collect(),
                    hyper: *hyper,
                }
            }
            Op::KlScale { eps } => P::KlScale {
                x: arg(0)?,
                out: res(0)?,
                eig_left: arg(1)?,
                eig_right: arg(2)?,
                eps: *eps,
            },
            Op::KlFactorUpdate {
                shampoo_beta,
                init_factor,
                max_clamp_value,
                left,
                right,
            } => {
                let mut rest = a[3..].iter();
                let mut side =
                    |present: bool| -> Result<(Option<BufferId>, Option<BufferId>), LowerError> {
                        if !present {
                            return Ok((None, None));
                        }
                        let f = rest.next().map(|&v| b(v)).transpose()?;
                        let q = rest.next().map(|&v| b(v)).transpose()?;
                        Ok((f, q))
                    };
                let (factor_left, basis_left) = side(*left)?;
                let (factor_right, basis_right) = side(*right)?;
                P::KlFactorUpdate {
                    grad: arg(0)?,
                    factor_left,
                    factor_right,
                    basis_left,
                    basis_right,
                    eig_left: arg(1)?,
                    eig_right: arg(2)?,
                    shampoo_beta: *shampoo_beta,
                    init_factor: *init_factor,
                    max_clamp_value: *max_clamp_value,
                }
            }
            Op::ShampooFactorUpdate {
                beta2,
                use_bias_correction,
                max_preconditioner_dim,
            } => P::ShampooFactorUpdate {
                grad: arg(0)?,
                factors: a[1..].iter().map(|&v| b(v)).collect::<Result<_, _>>()?,
                beta2: *beta2,
                use_bias_correction: *use_bias_correction,
                max_preconditioner_dim: *max_preconditioner_dim,
            },
            Op::ShampooPrecondition {
                max_preconditioner_dim,
            } => P::ShampooPrecondition {
                x: arg(0)?,
                out: res(0)?,
                roots: a[1..].iter().map(|&v| b(v)).collect::<Result<_, _>>()?,
                max_preconditioner_dim: *max_preconditioner_dim,
            },
            Op::Graft {
                max_preconditioner_dim,
            } => P::Graft {
                x: arg(0)?,
                graft: arg(1)?,
                out: res(0)?,
                max_preconditioner_dim: *max_preconditioner_dim,
            },
            Op::SoapFactorUpdate {
                shampoo_beta,
                left,
                right,
            } => {
                let mut rest = a[1..].iter();
                let factor_left = if *left {
                    rest.next().map(|&v| b(v)).transpose()?
                } else {
                    None
                };
                let factor_right = if *right {
                    rest.next().map(|&v| b(v)).transpose()?
                } else {
                    None
                };
                P::SoapFactorUpdate {
                    grad: arg(0)?,
                    factor_left,
                    factor_right,
                    shampoo_beta: *shampoo_beta,
                }
            }
            Op::ElementwiseUpdate { rule } => P::ElementwiseUpdate {
                param: arg(0)?,
                grad: arg(1)?,
                state: a[2..].iter().map(|&v| b(v)).collect::<Result<_, _>>()?,
                results: inst
                    .results
                    .iter()
                    .map(|&v| b(v))
                    .collect::<Result<_, _>>()?,
                rule: rule.clone(),
            },
            Op::Project { back, left, right } => {
                let mut rest = a[1..].iter();
                let mut side = |on: bool| match on {
                    true => rest.next().map(|&v| b(v)).transpose(),
                    false => Ok(None),
                };
                let basis_left = side(*left)?;
                let basis_right = side(*right)?;
                P::Project {
                    x: arg(0)?,
                    out: res(0)?,
                    basis_left,
                    basis_right,
                    back: *back,
                }
            }
        };
        match inst.section {
            Section::Forward => forward.push(op),
            Section::Backward => backward.push(op),
            Section::Optimizer => optimizer.push(op),
            Section::State | Section::Refresh => return Err(misplaced()),
        }
    }
    let c = &module.config;
    let missing = |what: &str| LowerError::Missing(format!("the module has no {what}"));
    // One place per buffer; the `memory-planning` pass replaces it with the shared layout.
    let memory = MemoryPlan::unshared(&buffers);
    let plan = Plan {
        format: PLAN_FORMAT.to_string(),
        version: PLAN_VERSION,
        name: c.name.clone(),
        buffers,
        params,
        loss: loss.ok_or_else(|| missing("`loss`"))?,
        forward,
        backward,
        optimizer,
        host_tasks,
        data: DataPlan {
            corpus: match &c.data.corpus {
                CorpusConfig::Builtin => Corpus::Builtin,
                CorpusConfig::Files { paths } => Corpus::Files {
                    paths: paths.clone(),
                },
                CorpusConfig::Shards { train, val } => Corpus::Shards {
                    train: train.clone(),
                    val: val.clone(),
                },
            },
            tokenizer: match c.data.tokenizer {
                TokenizerKind::Gpt2 => Tokenizer::Gpt2,
                TokenizerKind::Bytes => Tokenizer::Bytes,
            },
            batch_size: c.data.batch_size,
            seq_len: c.data.seq_len,
            val_fraction: c.data.val_fraction,
            tokens: tokens.ok_or_else(|| missing("token input"))?,
            targets: targets.ok_or_else(|| missing("target input"))?,
        },
        train: TrainPlan {
            steps: c.train.steps,
            warmup_steps: c.train.warmup_steps,
            min_lr_ratio: c.train.min_lr_ratio,
            eval_interval: c.train.eval_interval,
            eval_batches: c.train.eval_batches,
            seed: c.train.seed,
            rematerialize: c.train.rematerialize,
            max_skipped_steps: c.train.max_skipped_steps,
            refresh_swap: c.train.refresh_swap,
            // Set by the `accumulate-gradients` pass with the ops that implement it.
            grad_accum: 1,
        },
        target: match &c.target {
            TargetConfig::Cpu {
                threads,
                staleness,
                eigensolver,
                ..
            } => TargetPlan::Cpu {
                threads: *threads,
                staleness: *staleness,
                eigensolver: *eigensolver,
            },
            TargetConfig::Cuda {
                device,
                staleness,
                precision,
                eigensolver,
                attention,
                refresh_placement,
                ..
            } => TargetPlan::Cuda {
                device: *device,
                staleness: *staleness,
                precision: *precision,
                eigensolver: *eigensolver,
                attention: *attention,
                refresh_placement: *refresh_placement,
                weight_casts: if c.weight_casts_once() {
                    schedule::WeightCasts::Once
                } else {
                    schedule::WeightCasts::Twice
                },
            },
        },
        memory,
        model: Some(ModelPlan {
            family: match c.model.family {
                Family::Gpt2 => ModelFamily::Gpt2,
                Family::Llama => ModelFamily::Llama,
            },
            vocab_size: c.model.vocab_size,
            context: c.model.context,
            d_model: c.model.d_model,
            n_layers: c.model.n_layers,
            n_heads: c.model.n_heads,
            mlp_hidden: c.model.mlp_hidden,
            norm_eps: c.model.norm_eps,
            rope_theta: c.model.rope_theta,
        }),
    };
    plan.verify()?;
    Ok(plan)
}
