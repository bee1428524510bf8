//! A hand-built GPT-2-style plan (token + position embeddings, pre-LN blocks with causal
//! attention and a GELU MLP, final LayerNorm, weight-tied head, mean cross-entropy) with its
//! backward program and an AdamW or SOAP optimizer program, written directly in plan ops —
//! the engine's tests do not depend on the compiler.
use schedule::*;

/// Model, batch and optimizer choice of a test plan.
#[derive(Clone, Copy, Debug)]
pub struct Gpt {
    pub vocab: usize,
    pub ctx: usize,
    pub d: usize,
    pub layers: usize,
    pub heads: usize,
    pub batch: usize,
    pub seq: usize,
    pub soap: bool,
    pub max_precond_dim: usize,
    pub lr: f64,
    pub threads: Option<usize>,
}

impl Gpt {
    /// A small model on a byte vocabulary.
    pub fn tiny(soap: bool) -> Self {
        Gpt {
            vocab: 37,
            ctx: 12,
            d: 16,
            layers: 1,
            heads: 2,
            batch: 3,
            seq: 8,
            soap,
            max_precond_dim: 20,
            lr: 3e-3,
            threads: Some(2),
        }
    }
}

struct B {
    bufs: Vec<Buffer>,
    params: Vec<ParamRef>,
    fwd: Vec<Op>,
    bwd: Vec<Op>,
}

impl B {
    fn buf(&mut self, name: &str, shape: &[usize], class: BufferClass, init: Init) -> BufferId {
        self.bufs.push(Buffer {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype: DType::F32,
            class,
            init,
        });
        BufferId(self.bufs.len() as u32 - 1)
    }
    fn act(&mut self, name: &str, shape: &[usize]) -> BufferId {
        self.buf(name, shape, BufferClass::Activation, Init::Zeros)
    }
    /// A parameter and its gradient buffer.
    fn param(&mut self, name: &str, shape: &[usize], init: Init) -> (BufferId, BufferId) {
        let p = self.buf(name, shape, BufferClass::Parameter, init);
        let g = self.buf(
            &format!("grad.{name}"),
            shape,
            BufferClass::Gradient,
            Init::Zeros,
        );
        self.params.push(ParamRef { param: p, grad: g });
        (p, g)
    }
    fn mm(&self, a: BufferId, b: BufferId, out: BufferId, ta: bool, tb: bool, acc: bool) -> Op {
        Op::MatMul {
            a,
            b,
            out,
            trans_a: ta,
            trans_b: tb,
            accumulate: acc,
            micro_accumulate: None,
        }
    }
}

/// Builds the plan.
pub fn plan(g: &Gpt) -> Plan {
    let (n, c, v) = (g.batch * g.seq, g.d, g.vocab);
    let mut b = B {
        bufs: vec![],
        params: vec![],
        fwd: vec![],
        bwd: vec![],
    };
    let i32buf = |b: &mut B, name: &str| {
        b.bufs.push(Buffer {
            name: name.into(),
            shape: vec![n],
            dtype: DType::I32,
            class: BufferClass::Input,
            init: Init::Zeros,
        });
        BufferId(b.bufs.len() as u32 - 1)
    };
    let tokens = i32buf(&mut b, "tokens");
    let targets = i32buf(&mut b, "targets");
    let std = Init::Normal { std: 0.02 };
    let (wte, gwte) = b.param("wte", &[v, c], std);
    let (wpe, gwpe) = b.param("wpe", &[g.ctx, c], std);
    let emb = b.act("emb", &[n, c]);
    let mut x = b.act("x0", &[n, c]);
    b.fwd.push(Op::Embedding {
        table: wte,
        ids: tokens,
        out: emb,
    });
    b.fwd.push(Op::AddPositional {
        x: emb,
        pos: wpe,
        out: x,
        seq_len: g.seq,
    });
    struct Layer {
        x_in: BufferId,
        ln1: BufferId,
        ln1w: (BufferId, BufferId),
        ln1b: BufferId,
        qkv: BufferId,
        qkvb: BufferId,
        attw: (BufferId, BufferId),
        attb: BufferId,
        att: BufferId,
        projw: (BufferId, BufferId),
        projb: BufferId,
        x1: BufferId,
        ln2: BufferId,
        ln2w: (BufferId, BufferId),
        ln2b: BufferId,
        fcb: BufferId,
        fcw: (BufferId, BufferId),
        fcbias: BufferId,
        h: BufferId,
        mpw: (BufferId, BufferId),
        mpb: BufferId,
    }
    let mut layers = vec![];
    for l in 0..g.layers {
        let p = |s: &str| format!("h{l}.{s}");
        let ln1w = b.param(&p("ln1.weight"), &[c], Init::Ones);
        let ln1b = b.param(&p("ln1.bias"), &[c], Init::Zeros).0;
        let attw = b.param(&p("attn.qkv.weight"), &[3 * c, c], std);
        let attb = b.param(&p("attn.qkv.bias"), &[3 * c], Init::Zeros).0;
        let projw = b.param(&p("attn.proj.weight"), &[c, c], std);
        let projb = b.param(&p("attn.proj.bias"), &[c], Init::Zeros).0;
        let ln2w = b.param(&p("ln2.weight"), &[c], Init::Ones);
        let ln2b = b.param(&p("ln2.bias"), &[c], Init::Zeros).0;
        let fcw = b.param(&p("mlp.fc.weight"), &[4 * c, c], std);
        let fcbias = b.param(&p("mlp.fc.bias"), &[4 * c], Init::Zeros).0;
        let mpw = b.param(&p("mlp.proj.weight"), &[c, 4 * c], std);
        let mpb = b.param(&p("mlp.proj.bias"), &[c], Init::Zeros).0;
        let ln1 = b.act(&p("ln1"), &[n, c]);
        let qkv = b.act(&p("qkv"), &[n, 3 * c]);
        let qkvb = b.act(&p("qkvb"), &[n, 3 * c]);
        let att = b.act(&p("att"), &[n, c]);
        let proj = b.act(&p("proj"), &[n, c]);
        let projo = b.act(&p("projb"), &[n, c]);
        let x1 = b.act(&p("x1"), &[n, c]);
        let ln2 = b.act(&p("ln2"), &[n, c]);
        let fc = b.act(&p("fc"), &[n, 4 * c]);
        let fcb = b.act(&p("fcb"), &[n, 4 * c]);
        let h = b.act(&p("gelu"), &[n, 4 * c]);
        let mp = b.act(&p("mp"), &[n, c]);
        let mpo = b.act(&p("mpb"), &[n, c]);
        let x2 = b.act(&p("x2"), &[n, c]);
        b.fwd.extend([
            Op::LayerNorm {
                x,
                weight: ln1w.0,
                bias: Some(ln1b),
                out: ln1,
                eps: 1e-5,
            },
            b.mm(ln1, attw.0, qkv, false, true, false),
            Op::BiasAdd {
                x: qkv,
                bias: attb,
                out: qkvb,
            },
            Op::Attention {
                qkv: qkvb,
                out: att,
                lse: None,
                batch: g.batch,
                seq_len: g.seq,
                n_heads: g.heads,
            },
            b.mm(att, projw.0, proj, false, true, false),
            Op::BiasAdd {
                x: proj,
                bias: projb,
                out: projo,
            },
            Op::Add {
                a: x,
                b: projo,
                out: x1,
            },
            Op::LayerNorm {
                x: x1,
                weight: ln2w.0,
                bias: Some(ln2b),
                out: ln2,
                eps: 1e-5,
            },
            b.mm(ln2, fcw.0, fc, false, true, false),
            Op::BiasAdd {
                x: fc,
                bias: fcbias,
                out: fcb,
            },
            Op::Gelu { x: fcb, out: h },
            b.mm(h, mpw.0, mp, false, true, false),
            Op::BiasAdd {
                x: mp,
                bias: mpb,
                out: mpo,
            },
            Op::Add {
                a: x1,
                b: mpo,
                out: x2,
            },
        ]);
        layers.push(Layer {
            x_in: x,
            ln1,
            ln1w,
            ln1b,
            qkv,
            qkvb,
            attw,
            attb,
            att,
            projw,
            projb,
            x1,
            ln2,
            ln2w,
            ln2b,
            fcb,
            fcw,
            fcbias,
            h,
            mpw,
            mpb,
        });
        x = x2;
    }
    let (lnfw, glnfw) = b.param("lnf.weight", &[c], Init::Ones);
    let (lnfb, glnfb) = b.param("lnf.bias", &[c], Init::Zeros);
    let lnf = b.act("lnf", &[n, c]);
    let logits = b.act("logits", &[n, v]);
    let loss = b.buf("loss", &[1], BufferClass::Scalar, Init::Zeros);
    b.fwd.extend([
        Op::LayerNorm {
            x,
            weight: lnfw,
            bias: Some(lnfb),
            out: lnf,
            eps: 1e-5,
        },
        b.mm(lnf, wte, logits, false, true, false),
        Op::CrossEntropy {
            logits,
            targets,
            loss,
        },
    ]);
    // Backward.
    let grad_of = |b: &B, p: BufferId| {
        b.params
            .iter()
            .find(|r| r.param == p)
            .map(|r| r.grad)
            .expect("param")
    };
    let dlogits = b.act("d.logits", &[n, v]);
    let dlnf = b.act("d.lnf", &[n, c]);
    let mut dx = b.act("d.xL", &[n, c]);
    b.bwd.extend([
        Op::CrossEntropyBackward {
            logits,
            targets,
            dlogits,
        },
        b.mm(dlogits, wte, dlnf, false, false, false),
        Op::LayerNormBackward {
            dout: dlnf,
            x,
            weight: lnfw,
            dx,
            dweight: glnfw,
            dbias: Some(glnfb),
            eps: 1e-5,
        },
    ]);
    for (l, ly) in layers.iter().enumerate().rev() {
        let p = |s: &str| format!("d.h{l}.{s}");
        let dh = b.act(&p("gelu"), &[n, 4 * c]);
        let dfcb = b.act(&p("fcb"), &[n, 4 * c]);
        let dln2 = b.act(&p("ln2"), &[n, c]);
        let dx1p = b.act(&p("x1.part"), &[n, c]);
        let dx1 = b.act(&p("x1"), &[n, c]);
        let datt = b.act(&p("att"), &[n, c]);
        let dqkv = b.act(&p("qkv"), &[n, 3 * c]);
        let dln1 = b.act(&p("ln1"), &[n, c]);
        let dxp = b.act(&p("x.part"), &[n, c]);
        let dxin = b.act(&p("x"), &[n, c]);
        let gr = |b: &B, id| grad_of(b, id);
        b.bwd.extend([
            Op::SumRows {
                x: dx,
                out: gr(&b, ly.mpb),
            },
            b.mm(dx, ly.h, ly.mpw.1, true, false, false),
            b.mm(dx, ly.mpw.0, dh, false, false, false),
            Op::GeluBackward {
                dout: dh,
                x: ly.fcb,
                dx: dfcb,
            },
            Op::SumRows {
                x: dfcb,
                out: gr(&b, ly.fcbias),
            },
            b.mm(dfcb, ly.ln2, ly.fcw.1, true, false, false),
            b.mm(dfcb, ly.fcw.0, dln2, false, false, false),
            Op::LayerNormBackward {
                dout: dln2,
                x: ly.x1,
                weight: ly.ln2w.0,
                dx: dx1p,
                dweight: ly.ln2w.1,
                dbias: Some(gr(&b, ly.ln2b)),
                eps: 1e-5,
            },
            Op::Add {
                a: dx,
                b: dx1p,
                out: dx1,
            },
            Op::SumRows {
                x: dx1,
                out: gr(&b, ly.projb),
            },
            b.mm(dx1, ly.att, ly.projw.1, true, false, false),
            b.mm(dx1, ly.projw.0, datt, false, false, false),
            Op::AttentionBackward {
                dout: datt,
                qkv: ly.qkvb,
                fwd_out: None,
                lse: None,
                dqkv,
                batch: g.batch,
                seq_len: g.seq,
                n_heads: g.heads,
            },
            Op::SumRows {
                x: dqkv,
                out: gr(&b, ly.attb),
            },
            b.mm(dqkv, ly.ln1, ly.attw.1, true, false, false),
            b.mm(dqkv, ly.attw.0, dln1, false, false, false),
            Op::LayerNormBackward {
                dout: dln1,
                x: ly.x_in,
                weight: ly.ln1w.0,
                dx: dxp,
                dweight: ly.ln1w.1,
                dbias: Some(gr(&b, ly.ln1b)),
                eps: 1e-5,
            },
            Op::Add {
                a: dx1,
                b: dxp,
                out: dxin,
            },
        ]);
        let _ = ly.qkv;
        dx = dxin;
    }
    b.bwd.extend([
        Op::AddPositionalBackward {
            dout: dx,
            dpos: gwpe,
            seq_len: g.seq,
        },
        Op::EmbeddingBackward {
            dout: dx,
            ids: tokens,
            dtable: gwte,
        },
        // Weight-tied head: its gradient accumulates onto the embedding gradient.
        b.mm(dlogits, lnf, gwte, true, false, true),
    ]);
    let B {
        mut bufs,
        params,
        fwd,
        bwd,
    } = b;
    let (optimizer, host_tasks) = optimizer(g, &mut bufs, &params);
    // One place per buffer (the engines' tests do not run the compiler's memory planner).
    let memory = MemoryPlan::unshared(&bufs);
    Plan {
        format: PLAN_FORMAT.into(),
        version: PLAN_VERSION,
        name: "test-gpt".into(),
        buffers: bufs,
        params,
        loss,
        forward: fwd,
        backward: bwd,
        optimizer,
        host_tasks,
        data: DataPlan {
            corpus: Corpus::Builtin,
            tokenizer: if g.vocab == 256 {
                Tokenizer::Bytes
            } else {
                Tokenizer::Gpt2
            },
            batch_size: g.batch,
            seq_len: g.seq,
            val_fraction: 0.1,
            tokens,
            targets,
        },
        train: TrainPlan {
            steps: 10,
            warmup_steps: 2,
            min_lr_ratio: 0.1,
            eval_interval: 5,
            eval_batches: 2,
            seed: 1234,
            rematerialize: Default::default(),
            max_skipped_steps: Some(10),
            refresh_swap: Default::default(),
            grad_accum: 1,
        },
        target: TargetPlan::Cpu {
            threads: g.threads,
            staleness: 0,
            eigensolver: schedule::Eigensolver::Faer,
        },
        memory,
        model: None,
    }
}

/// ClipGradNorm, then AdamW per parameter, or SOAP for 2-D parameters (AdamW for 1-D) with a
/// Kronecker factor and an eigenbasis refresh task per side up to `max_precond_dim`.
fn optimizer(g: &Gpt, bufs: &mut Vec<Buffer>, params: &[ParamRef]) -> (Vec<Op>, Vec<HostTask>) {
    let info: Vec<(String, Vec<usize>)> = params
        .iter()
        .map(|p| {
            (
                bufs[p.param.index()].name.clone(),
                bufs[p.param.index()].shape.clone(),
            )
        })
        .collect();
    let mut add = |name: String, shape: Vec<usize>, class: BufferClass| {
        bufs.push(Buffer {
            name,
            shape,
            dtype: DType::F32,
            class,
            init: Init::Zeros,
        });
        BufferId(bufs.len() as u32 - 1)
    };
    let norm = add("grad_norm".into(), vec![1], BufferClass::Scalar);
    let mut ops = vec![Op::ClipGradNorm {
        grads: params.iter().map(|p| p.grad).collect(),
        norm,
        scale: None,
        max_norm: Some(1.0),
        partials: None,
    }];
    let mut tasks = vec![];
    for (p, (name, shape)) in params.iter().zip(info) {
        let exp_avg = add(
            format!("{name}.exp_avg"),
            shape.clone(),
            BufferClass::ExpAvg,
        );
        let exp_avg_sq = add(
            format!("{name}.exp_avg_sq"),
            shape.clone(),
            BufferClass::ExpAvgSq,
        );
        let adamw = Op::AdamW {
            param: p.param,
            grad: p.grad,
            exp_avg,
            exp_avg_sq,
            grad_scale: None,
            lr: g.lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
            on_host: false,
        };
        match (g.soap, shape.as_slice()) {
            (true, &[m, n]) => {
                let mut side = |s: u8, d: usize| {
                    if d > g.max_precond_dim {
                        return (None, None);
                    }
                    let which = if s == 0 { "left" } else { "right" };
                    let f = add(
                        format!("{name}.factor_{which}"),
                        vec![d, d],
                        BufferClass::KroneckerFactor,
                    );
                    let q = add(
                        format!("{name}.basis_{which}"),
                        vec![d, d],
                        BufferClass::Eigenbasis,
                    );
                    tasks.push(HostTask::EigenbasisRefresh {
                        factor: f,
                        basis: q,
                        side: s,
                        exp_avg,
                        exp_avg_sq,
                        frequency: 3,
                        offset: (tasks.len() % 3) as u64,
                        staleness: 0,
                        placement: Placement::Host,
                        method: schedule::RefreshMethod::Soap,
                        root: None,
                    });
                    (Some(f), Some(q))
                };
                let (fl, ql) = side(0, m);
                let (fr, qr) = side(1, n);
                let hyper = SoapHyper {
                    lr: g.lr,
                    beta1: 0.95,
                    beta2: 0.95,
                    eps: 1e-8,
                    weight_decay: 0.0,
                    correct_bias: true,
                    normalize_grads: false,
                };
                ops.push(Op::SoapUpdate {
                    param: p.param,
                    grad: p.grad,
                    exp_avg,
                    exp_avg_sq,
                    basis_left: ql,
                    basis_right: qr,
                    hyper,
                });
                ops.push(Op::SoapFactorUpdate {
                    grad: p.grad,
                    factor_left: fl,
                    factor_right: fr,
                    shampoo_beta: 0.95,
                });
            }
            _ => ops.push(adamw),
        }
    }
    (ops, tasks)
}
