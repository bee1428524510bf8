//! A tiny hand-built module that uses every op variant, shared by the integration tests.
#![allow(dead_code)]
use ir::config::{
    AdamWConfig, Config, CorpusConfig, DataConfig, Family, ModelConfig, OptimizerConfig,
    TargetConfig, TokenizerKind, TrainConfig,
};
use ir::{BufferClass, Init, InputRole, Module, Op, Section, SoapHyper, TensorType, ValueId};

/// N = batch 2 × seq_len 4 = 8 tokens, C = 16, V = 32, 2 heads.
pub fn config() -> Config {
    Config {
        name: "tiny".into(),
        model: ModelConfig {
            family: Family::Gpt2,
            vocab_size: 32,
            context: 8,
            d_model: 16,
            n_layers: 1,
            n_heads: 2,
            mlp_hidden: 64,
            norm_eps: 1e-5,
            init_std: 0.02,
            rope_theta: 10000.0,
        },
        optimizer: OptimizerConfig::Adamw(AdamWConfig {
            lr: 6e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }),
        data: DataConfig {
            corpus: CorpusConfig::Files {
                paths: vec!["a; b.txt".into()],
            },
            tokenizer: TokenizerKind::Bytes,
            batch_size: 2,
            seq_len: 4,
            val_fraction: 0.1,
        },
        train: TrainConfig {
            steps: 10,
            warmup_steps: 2,
            min_lr_ratio: 0.1,
            grad_clip: Some(1.0),
            eval_interval: 5,
            eval_batches: 2,
            seed: 1337,
            rematerialize: Default::default(),
            max_skipped_steps: Some(10),
            refresh_swap: Default::default(),
            grad_accum: 1,
        },
        target: TargetConfig::Cpu {
            threads: None,
            staleness: 0,
            calibration: None,
            eigensolver: ir::Eigensolver::Faer,
            budgets: Default::default(),
        },
    }
}

/// Builder shorthand.
pub struct B {
    pub m: Module,
}

impl B {
    pub fn state(
        &mut self,
        name: &str,
        class: BufferClass,
        init: Init,
        shape: &[usize],
    ) -> ValueId {
        self.m.push1(
            Section::State,
            Op::State { class, init },
            &[],
            name,
            TensorType::f32(shape),
        )
    }
    pub fn param(&mut self, name: &str, shape: &[usize]) -> ValueId {
        self.state(
            name,
            BufferClass::Parameter,
            Init::Normal { std: 0.02 },
            shape,
        )
    }
    pub fn f(
        &mut self,
        s: Section,
        op: Op,
        args: &[ValueId],
        name: &str,
        shape: &[usize],
    ) -> ValueId {
        self.m.push1(s, op, args, name, TensorType::f32(shape))
    }
    pub fn v(&self, name: &str) -> ValueId {
        self.m.value_by_name(name).unwrap()
    }
}

fn hyper() -> SoapHyper {
    SoapHyper {
        lr: 3e-3,
        beta1: 0.95,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
        correct_bias: true,
        normalize_grads: false,
    }
}

/// The forward section only (state, inputs, ops, loss): verifies on its own.
pub fn tiny_forward() -> B {
    use Section::Forward as F;
    let mut b = B {
        m: Module::new(config()),
    };
    let (n, c, v) = (8, 16, 32);
    let wte = b.param("wte", &[v, c]);
    let wpe = b.state(
        "wpe",
        BufferClass::Parameter,
        Init::Normal { std: 0.01 },
        &[8, c],
    );
    let lnw = b.state("ln.w", BufferClass::Parameter, Init::Ones, &[c]);
    let lnb = b.state("ln.b", BufferClass::Parameter, Init::Zeros, &[c]);
    let rmsw = b.state("rms.w", BufferClass::Parameter, Init::Ones, &[c]);
    let qkvw = b.param("qkv.w", &[3 * c, c]);
    let projw = b.param("proj.w", &[c, c]);
    let fcw = b.param("fc.w", &[64, c]);
    let fcb = b.state("fc.b", BufferClass::Parameter, Init::Zeros, &[64]);
    let upw = b.param("up.w", &[32, c]);
    for (name, class) in [
        ("misc.grad", BufferClass::Gradient),
        ("misc.act", BufferClass::Activation),
        ("misc.input", BufferClass::Input),
        ("misc.scalar", BufferClass::Scalar),
    ] {
        b.state(name, class, Init::Zeros, &[1]);
    }
    let tokens = b.m.push1(
        Section::State,
        Op::Input {
            role: InputRole::Tokens,
        },
        &[],
        "tokens",
        TensorType::i32([n]),
    );
    let targets = b.m.push1(
        Section::State,
        Op::Input {
            role: InputRole::Targets,
        },
        &[],
        "targets",
        TensorType::i32([n]),
    );
    let nt = Op::MatMul {
        trans_a: false,
        trans_b: true,
    };
    let x0 = b.f(F, Op::Embedding, &[wte, tokens], "x0", &[n, c]);
    let x = b.f(
        F,
        Op::AddPositional { seq_len: 4 },
        &[x0, wpe],
        "x",
        &[n, c],
    );
    let h = b.f(F, Op::LayerNorm { eps: 1e-5 }, &[x, lnw, lnb], "h", &[n, c]);
    b.f(
        F,
        Op::LayerNorm { eps: 1e-5 },
        &[x, lnw],
        "h.nobias",
        &[n, c],
    );
    let r = b.f(F, Op::RmsNorm { eps: 1e-6 }, &[x, rmsw], "r", &[n, c]);
    let qkv = b.f(F, nt.clone(), &[h, qkvw], "qkv", &[n, 3 * c]);
    let rope = Op::Rope {
        seq_len: 4,
        head_dim: 8,
        rotated_cols: 32,
        theta: 10000.0,
    };
    let qkvr = b.f(F, rope, &[qkv], "qkv.rope", &[n, 3 * c]);
    let att = b.f(
        F,
        Op::Attention {
            batch: 2,
            seq_len: 4,
            n_heads: 2,
        },
        &[qkvr],
        "att",
        &[n, c],
    );
    let proj = b.f(F, nt.clone(), &[att, projw], "proj", &[n, c]);
    let res = b.f(F, Op::Add, &[x, proj], "res", &[n, c]);
    let fc = b.f(F, nt.clone(), &[res, fcw], "fc", &[n, 64]);
    let fcb_out = b.f(F, Op::BiasAdd, &[fc, fcb], "fc.bias", &[n, 64]);
    let g = b.f(F, Op::Gelu, &[fcb_out], "gelu", &[n, 64]);
    let down = b.f(
        F,
        Op::MatMul {
            trans_a: false,
            trans_b: false,
        },
        &[g, fcw],
        "down",
        &[n, c],
    );
    let up = b.f(F, nt.clone(), &[r, upw], "up", &[n, 32]);
    let sw = b.f(F, Op::SwiGlu, &[up], "swiglu", &[n, c]);
    let res2 = b.f(F, Op::Add, &[res, down], "res2", &[n, c]);
    let res3 = b.f(F, Op::Add, &[res2, sw], "res3", &[n, c]);
    let logits = b.f(F, nt, &[res3, wte], "logits", &[n, v]);
    let loss = b.f(F, Op::CrossEntropy, &[logits, targets], "loss", &[1]);
    b.m.push0(F, Op::Loss, &[loss]);
    b
}

/// Every op variant: forward, backward (shape-correct, not a faithful gradient), optimizer and
/// refresh sections.
pub fn tiny() -> Module {
    use Section::{Backward as Bw, Optimizer as O};
    let mut b = tiny_forward();
    let (n, c) = (8, 16);
    let v = |b: &B, s: &str| b.v(s);
    let (wte, wpe, lnw, lnb, rmsw) = (
        v(&b, "wte"),
        v(&b, "wpe"),
        v(&b, "ln.w"),
        v(&b, "ln.b"),
        v(&b, "rms.w"),
    );
    let (qkvw, projw, fcb, tokens, targets) = (
        v(&b, "qkv.w"),
        v(&b, "proj.w"),
        v(&b, "fc.b"),
        v(&b, "tokens"),
        v(&b, "targets"),
    );
    let (x, up, fcb_out, qkvr, att, res3, logits) = (
        v(&b, "x"),
        v(&b, "up"),
        v(&b, "fc.bias"),
        v(&b, "qkv.rope"),
        v(&b, "att"),
        v(&b, "res3"),
        v(&b, "logits"),
    );
    let h = v(&b, "h");
    let mm = |ta, tb| Op::MatMul {
        trans_a: ta,
        trans_b: tb,
    };
    let dlogits = b.f(
        Bw,
        Op::CrossEntropyBackward,
        &[logits, targets],
        "d.logits",
        &[n, 32],
    );
    let dres3 = b.f(Bw, mm(false, false), &[dlogits, wte], "d.res3", &[n, c]);
    let dwte_head = b.f(
        Bw,
        mm(true, false),
        &[dlogits, res3],
        "d.wte.head",
        &[32, c],
    );
    b.f(Bw, mm(true, true), &[dwte_head, dlogits], "d.tt", &[c, n]);
    b.f(Bw, Op::SwiGluBackward, &[dres3, up], "d.up", &[n, 32]);
    let ddown = b.f(
        Bw,
        mm(false, true),
        &[dres3, v(&b, "fc.w")],
        "d.gelu",
        &[n, 64],
    );
    let dfc = b.f(Bw, Op::GeluBackward, &[ddown, fcb_out], "d.fc", &[n, 64]);
    let dfcb = b.f(Bw, Op::SumRows, &[dfc], "grad.fc.b", &[64]);
    let dqkvr = b.f(
        Bw,
        Op::AttentionBackward {
            batch: 2,
            seq_len: 4,
            n_heads: 2,
        },
        &[dres3, qkvr],
        "d.qkv.rope",
        &[n, 48],
    );
    let rope = Op::RopeBackward {
        seq_len: 4,
        head_dim: 8,
        rotated_cols: 32,
        theta: 10000.0,
    };
    let dqkv = b.f(Bw, rope, &[dqkvr], "d.qkv", &[n, 48]);
    let dqkvw = b.f(Bw, mm(true, false), &[dqkv, h], "grad.qkv.w", &[48, c]);
    let dprojw = b.f(Bw, mm(true, false), &[dres3, att], "grad.proj.w", &[c, c]);
    let f32t = |s: &[usize]| TensorType::f32(s);
    let (_, r) = b.m.push(
        Bw,
        Op::LayerNormBackward {
            eps: 1e-5,
            bias: true,
        },
        &[dres3, x, lnw],
        vec![
            ("d.x".into(), f32t(&[n, c])),
            ("grad.ln.w".into(), f32t(&[c])),
            ("grad.ln.b".into(), f32t(&[c])),
        ],
    );
    let (dx, dlnw, dlnb) = (r[0], r[1], r[2]);
    b.m.push(
        Bw,
        Op::LayerNormBackward {
            eps: 1e-5,
            bias: false,
        },
        &[dres3, x, lnw],
        vec![
            ("d.x.nobias".into(), f32t(&[n, c])),
            ("d.ln.w.nobias".into(), f32t(&[c])),
        ],
    );
    let (_, r) = b.m.push(
        Bw,
        Op::RmsNormBackward { eps: 1e-6 },
        &[dres3, x, rmsw],
        vec![
            ("d.x.rms".into(), f32t(&[n, c])),
            ("grad.rms.w".into(), f32t(&[c])),
        ],
    );
    let drmsw = r[1];
    let dwpe = b.f(
        Bw,
        Op::AddPositionalBackward { seq_len: 4 },
        &[dx, wpe],
        "grad.wpe",
        &[8, c],
    );
    let dwte_emb = b.f(
        Bw,
        Op::EmbeddingBackward,
        &[dx, tokens, wte],
        "d.wte.emb",
        &[32, c],
    );
    let dwte = b.f(Bw, Op::Add, &[dwte_head, dwte_emb], "grad.wte", &[32, c]);
    let pairs = [
        (wte, dwte),
        (wpe, dwpe),
        (lnw, dlnw),
        (lnb, dlnb),
        (rmsw, drmsw),
        (fcb, dfcb),
        (qkvw, dqkvw),
        (projw, dprojw),
    ];
    for (p, g) in pairs {
        b.m.push0(Bw, Op::GradOf, &[p, g]);
    }

    let grads: Vec<ValueId> = pairs.iter().map(|p| p.1).collect();
    b.f(
        O,
        Op::ClipGradNorm {
            max_norm: Some(1.0),
        },
        &grads,
        "grad_norm",
        &[1],
    );
    b.f(
        O,
        Op::ClipGradNorm { max_norm: None },
        &[dlnw],
        "grad_norm.ln",
        &[1],
    );
    let moments = |b: &mut B, p: ValueId| {
        let name = b.m.value(p).name.clone();
        let shape = b.m.value(p).ty.shape.clone();
        let m = b.state(
            &format!("{name}.exp_avg"),
            BufferClass::ExpAvg,
            Init::Zeros,
            &shape,
        );
        let v = b.state(
            &format!("{name}.exp_avg_sq"),
            BufferClass::ExpAvgSq,
            Init::Zeros,
            &shape,
        );
        (m, v)
    };
    let adam = Op::AdamW {
        lr: 6e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    for (p, g) in [(wpe, dwpe), (rmsw, drmsw), (lnb, dlnb), (fcb, dfcb)] {
        let (m, v) = moments(&mut b, p);
        b.m.push0(O, adam.clone(), &[p, g, m, v]);
    }
    let mut refresh = Vec::new();
    // (param, grad, d0, d1, left, right): both sides, left only, right only, 1-D.
    for (p, g, d0, d1, left, right) in [
        (qkvw, dqkvw, 48, 16, true, true),
        (wte, dwte, 32, 16, true, false),
        (projw, dprojw, 16, 16, false, true),
        (lnw, dlnw, 0, 0, false, false),
    ] {
        let (m, v) = moments(&mut b, p);
        let name = b.m.value(p).name.clone();
        let mut bases = Vec::new();
        let mut factors = Vec::new();
        for (side, on, d) in [(0u8, left, d0), (1u8, right, d1)] {
            if on {
                let which = if side == 0 { "L" } else { "R" };
                let f = b.state(
                    &format!("{name}.{which}"),
                    BufferClass::KroneckerFactor,
                    Init::Zeros,
                    &[d, d],
                );
                let q = b.state(
                    &format!("{name}.Q{which}"),
                    BufferClass::Eigenbasis,
                    Init::Zeros,
                    &[d, d],
                );
                factors.push(f);
                bases.push(q);
                refresh.push((side, f, q, m, v));
            }
        }
        let mut args = vec![p, g, m, v];
        args.extend(&bases);
        b.m.push0(
            O,
            Op::SoapUpdate {
                hyper: hyper(),
                left,
                right,
            },
            &args,
        );
        if left && right {
            // The same step composed (`optim::optimizers::soap`): rotate, moments rule with a
            // result, rotate back, step rule.
            let shape = b.m.value(p).ty.shape.clone();
            let rotate = |b: &mut B, x: ValueId, back: bool, name: &str| {
                let mut args = vec![x];
                args.extend(&bases);
                let op = Op::Project {
                    back,
                    left: true,
                    right: true,
                };
                b.f(O, op, &args, name, &shape)
            };
            let rule = |outputs: &[&str], results: &[&str], state: &[&str], expr: &str| {
                schedule::ElementwiseRule {
                    optimizer: "soap".into(),
                    lr: 3e-3,
                    state: state.iter().map(|s| s.to_string()).collect(),
                    outputs: outputs.iter().map(|s| s.to_string()).collect(),
                    scalars: vec![
                        schedule::StepScalar::Warm,
                        schedule::StepScalar::SoapStep {
                            beta1: 0.95,
                            beta2: 0.95,
                        },
                    ],
                    expr: expr.into(),
                    results: results.iter().map(|s| s.to_string()).collect(),
                    hyper: vec![("beta1".into(), 0.95), ("eps".into(), 1e-8)],
                }
            };
            let g_eig = rotate(&mut b, g, false, &format!("{name}.grad_eig"));
            let moments = rule(
                &["m", "v", "u"],
                &["u"],
                &["m", "v"],
                "(list (select_lt 0.5 warm g m) (* g g) (/ m (+ (sqrt v) 0.00000001)))",
            );
            let u = b.f(
                O,
                Op::ElementwiseUpdate { rule: moments },
                &[p, g_eig, m, v],
                &format!("{name}.dir_eig"),
                &shape,
            );
            let dir = rotate(&mut b, u, true, &format!("{name}.dir"));
            let step = rule(&["p"], &[], &[], "(list (- p (* soap_step g)))");
            b.m.push0(O, Op::ElementwiseUpdate { rule: step }, &[p, dir]);
        }
        let mut args = vec![g];
        args.extend(&factors);
        b.m.push0(
            O,
            Op::SoapFactorUpdate {
                shampoo_beta: 0.95,
                left,
                right,
            },
            &args,
        );
    }
    // Shampoo on `wpe` [8, 16] in blocks of 8 (two 8×8 blocks, a factor and an inverse root
    // per side), with Adam grafting: the hand-written op and the composed step
    // (`optim::optimizers::shampoo`).
    {
        let shape = b.m.value(wpe).ty.shape.clone();
        let ea = b.state("wpe.sh.exp_avg", BufferClass::ExpAvg, Init::Zeros, &shape);
        let gs = b.state(
            "wpe.sh.graft_sq",
            BufferClass::ExpAvgSq,
            Init::Zeros,
            &shape,
        );
        let (mut factors, mut roots) = (Vec::new(), Vec::new());
        for k in 0..4 {
            factors.push(b.state(
                &format!("wpe.F{k}"),
                BufferClass::KroneckerFactor,
                Init::Zeros,
                &[8, 8],
            ));
            roots.push(b.state(
                &format!("wpe.P{k}"),
                BufferClass::InverseRoot,
                Init::Zeros,
                &[8, 8],
            ));
        }
        let hyper = ir::ShampooHyper {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 1.0,
            epsilon: 1e-12,
            weight_decay: 0.0,
            use_bias_correction: true,
            max_preconditioner_dim: 8,
            grafting: true,
            grafting_beta2: 0.999,
            grafting_epsilon: 1e-10,
        };
        let mut args = vec![wpe, dwpe, ea, gs];
        args.extend(factors.iter().zip(&roots).flat_map(|(&f, &r)| [f, r]));
        b.m.push0(O, Op::ShampooUpdate { hyper }, &args);
        let mut args = vec![dwpe];
        args.extend(&factors);
        let op = Op::ShampooFactorUpdate {
            beta2: 1.0,
            use_bias_correction: true,
            max_preconditioner_dim: 8,
        };
        b.m.push0(O, op, &args);
        let (moments, step) = optim::optimizers::shampoo::rules(&hyper).expect("rules");
        let ty = ir::TensorType::f32(shape.clone());
        let (_, out) = b.m.push(
            O,
            Op::ElementwiseUpdate {
                rule: moments.expect("moments"),
            },
            &[wpe, dwpe, ea, gs],
            vec![
                ("wpe.gbar".into(), ty.clone()),
                ("wpe.graft_dir".into(), ty),
            ],
        );
        let mut args = vec![out[0]];
        args.extend(&roots);
        let pre = b.f(
            O,
            Op::ShampooPrecondition {
                max_preconditioner_dim: 8,
            },
            &args,
            "wpe.precond",
            &shape,
        );
        let dir = b.f(
            O,
            Op::Graft {
                max_preconditioner_dim: 8,
            },
            &[pre, out[1]],
            "wpe.dir",
            &shape,
        );
        b.m.push0(O, Op::ElementwiseUpdate { rule: step }, &[wpe, dir]);
    }
    // KL-Shampoo on `proj.w` [16, 16], both sides preconditioned: the hand-written op and the
    // composed step (`optim::optimizers::kl_shampoo`).
    {
        let shape = b.m.value(projw).ty.shape.clone();
        let ea = b.state(
            "proj.w.kl.exp_avg",
            BufferClass::ExpAvg,
            Init::Zeros,
            &shape,
        );
        let dl = b.state(
            "proj.w.DL",
            BufferClass::EigenvalueEstimate,
            Init::Zeros,
            &[16],
        );
        let dr = b.state(
            "proj.w.DR",
            BufferClass::EigenvalueEstimate,
            Init::Zeros,
            &[16],
        );
        let mut sides = Vec::new();
        for which in ["L", "R"] {
            let f = b.state(
                &format!("proj.w.S{which}"),
                BufferClass::KroneckerFactor,
                Init::Zeros,
                &[16, 16],
            );
            let q = b.state(
                &format!("proj.w.K{which}"),
                BufferClass::Eigenbasis,
                Init::Zeros,
                &[16, 16],
            );
            sides.extend([f, q]);
        }
        let hyper = ir::KlShampooHyper {
            lr: 3e-3,
            beta1: 0.9,
            shampoo_beta: 0.98,
            eps: 1e-8,
            weight_decay: 0.01,
            init_factor: 0.1,
            max_clamp_value: 4000.0,
            normalize_grads: false,
        };
        let mut args = vec![projw, dprojw, ea, dl, dr];
        args.extend(&sides);
        b.m.push0(
            O,
            Op::KlShampooUpdate {
                hyper,
                left: true,
                right: true,
            },
            &args,
        );
        let (momentum, step) = optim::optimizers::kl_shampoo::rules(&hyper).expect("rules");
        let mom = b.f(
            O,
            Op::ElementwiseUpdate { rule: momentum },
            &[projw, dprojw, ea],
            "proj.w.mom",
            &shape,
        );
        let bases = [sides[1], sides[3]];
        let x = b.f(
            O,
            Op::Project {
                back: false,
                left: true,
                right: true,
            },
            &[mom, bases[0], bases[1]],
            "proj.w.mom_eig",
            &shape,
        );
        let y = b.f(
            O,
            Op::KlScale { eps: 1e-8 },
            &[x, dl, dr],
            "proj.w.dir_eig",
            &shape,
        );
        let u = b.f(
            O,
            Op::Project {
                back: true,
                left: true,
                right: true,
            },
            &[y, bases[0], bases[1]],
            "proj.w.kl_dir",
            &shape,
        );
        b.m.push0(O, Op::ElementwiseUpdate { rule: step }, &[projw, u]);
        let mut args = vec![dprojw, dl, dr];
        args.extend(&sides);
        let op = Op::KlFactorUpdate {
            shampoo_beta: 0.98,
            init_factor: 0.1,
            max_clamp_value: 4000.0,
            left: true,
            right: true,
        };
        b.m.push0(O, op, &args);
    }
    for (side, f, q, m, v) in refresh {
        b.m.push0(
            Section::Refresh,
            Op::EigenbasisRefresh {
                side,
                frequency: 10,
                offset: side as u64,
                staleness: 2,
                placement: if side == 0 {
                    ir::Placement::Host
                } else {
                    ir::Placement::GpuSide
                },
                method: ir::RefreshMethod::Soap,
                root: None,
            },
            &[f, q, m, v],
        );
    }
    b.m
}
