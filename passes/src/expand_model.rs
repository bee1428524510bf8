//! `expand-model`: turns the model and data sections of the config into the forward graph —
//! parameters (with their GPT-2 / LLaMA initialisation), per-step inputs, the transformer blocks
//! and the mean cross-entropy loss.
//!
//! GPT-2 (Radford et al. 2019; nanoGPT / llm.c layout): learned positions, pre-LayerNorm
//! blocks with biases, fused qkv, GELU (tanh) MLP, final LayerNorm, LM head tied to the token
//! embedding; init N(0, 0.02²) with residual projections scaled by 1/√(2L).
//! LLaMA / OLMo (Touvron et al. 2023): RMSNorm, RoPE on q and k, SwiGLU MLP, no biases,
//! untied LM head.
use crate::{Pass, PassContext, PassError};
use ir::config::{Family, ModelConfig};
use ir::limits;
use ir::{BufferClass, Init, InputRole, Module, Op, Section, TensorType, ValueId};

/// The `expand-model` pass.
pub struct ExpandModel;

struct Builder<'m> {
    m: &'m mut Module,
    n: usize,
}

impl Builder<'_> {
    fn param(&mut self, name: &str, shape: &[usize], init: Init) -> ValueId {
        self.m.push1(
            Section::State,
            Op::State {
                class: BufferClass::Parameter,
                init,
            },
            &[],
            name,
            TensorType::f32(shape),
        )
    }
    fn fwd(&mut self, op: Op, args: &[ValueId], name: &str, shape: &[usize]) -> ValueId {
        self.m
            .push1(Section::Forward, op, args, name, TensorType::f32(shape))
    }
    /// `y = x Wᵀ (+ b)` for W `[out, in]`.
    fn linear(
        &mut self,
        x: ValueId,
        w: ValueId,
        b: Option<ValueId>,
        name: &str,
        out: usize,
    ) -> ValueId {
        let n = self.n;
        let mm = Op::MatMul {
            trans_a: false,
            trans_b: true,
        };
        match b {
            Some(b) => {
                let y = self.fwd(mm, &[x, w], &format!("{name}.xw"), &[n, out]);
                self.fwd(Op::BiasAdd, &[y, b], name, &[n, out])
            }
            None => self.fwd(mm, &[x, w], name, &[n, out]),
        }
    }
}

impl Pass for ExpandModel {
    fn name(&self) -> &'static str {
        "expand-model"
    }

    fn run(&mut self, module: &mut Module, _cx: &mut PassContext) -> Result<String, PassError> {
        if module.insts().next().is_some() {
            return Err(PassError::Invalid {
                pass: "expand-model",
                message: "module is not empty".into(),
            });
        }
        let cfg: ModelConfig = module.config.model.clone();
        let (batch, t) = (module.config.data.batch_size, module.config.data.seq_len);
        check(&cfg, batch, t)?;
        let n = batch * t;
        let (v, c, f, l) = (cfg.vocab_size, cfg.d_model, cfg.mlp_hidden, cfg.n_layers);
        let std = cfg.init_std;
        let proj_std = std / ((2 * l) as f64).sqrt();
        let normal = |s: f64| Init::Normal { std: s };
        let gpt2 = cfg.family == Family::Gpt2;
        let mut b = Builder { m: module, n };

        let wte = b.param("wte", &[v, c], normal(std));
        let wpe = gpt2.then(|| b.param("wpe", &[cfg.context, c], normal(std)));
        struct Layer {
            ln1: (ValueId, Option<ValueId>),
            qkv: (ValueId, Option<ValueId>),
            proj: (ValueId, Option<ValueId>),
            ln2: (ValueId, Option<ValueId>),
            fc: (ValueId, Option<ValueId>),
            fc_proj: (ValueId, Option<ValueId>),
        }
        let fc_out = if gpt2 { f } else { 2 * f };
        let mut layers = Vec::with_capacity(l);
        for i in 0..l {
            let p = layer_prefix(i);
            let pair = |b: &mut Builder, name: &str, shape: &[usize], init: Init, bias: usize| {
                let w = b.param(&format!("{p}.{name}.weight"), shape, init);
                let bb = gpt2.then(|| b.param(&format!("{p}.{name}.bias"), &[bias], Init::Zeros));
                (w, bb)
            };
            let ln1 = pair(&mut b, "ln_1", &[c], Init::Ones, c);
            let qkv = pair(&mut b, "attn.c_attn", &[3 * c, c], normal(std), 3 * c);
            let proj = pair(&mut b, "attn.c_proj", &[c, c], normal(proj_std), c);
            let ln2 = pair(&mut b, "ln_2", &[c], Init::Ones, c);
            let fc = pair(&mut b, "mlp.c_fc", &[fc_out, c], normal(std), fc_out);
            let fc_proj = pair(&mut b, "mlp.c_proj", &[c, f], normal(proj_std), c);
            layers.push(Layer {
                ln1,
                qkv,
                proj,
                ln2,
                fc,
                fc_proj,
            });
        }
        let lnf_w = b.param("ln_f.weight", &[c], Init::Ones);
        let lnf_b = gpt2.then(|| b.param("ln_f.bias", &[c], Init::Zeros));
        let lm_head = (!gpt2).then(|| b.param("lm_head.weight", &[v, c], normal(std)));
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

        let eps = cfg.norm_eps;
        let norm =
            |b: &mut Builder, x: ValueId, (w, bias): (ValueId, Option<ValueId>), name: &str| {
                if gpt2 {
                    let mut args = vec![x, w];
                    args.extend(bias);
                    b.fwd(Op::LayerNorm { eps }, &args, name, &[n, c])
                } else {
                    b.fwd(Op::RmsNorm { eps }, &[x, w], name, &[n, c])
                }
            };
        let mut x = b.fwd(Op::Embedding, &[wte, tokens], "tok_emb", &[n, c]);
        if let Some(wpe) = wpe {
            x = b.fwd(Op::AddPositional { seq_len: t }, &[x, wpe], "emb", &[n, c]);
        }
        for (i, ly) in layers.iter().enumerate() {
            let p = layer_prefix(i);
            let h = norm(&mut b, x, ly.ln1, &format!("{p}.ln_1"));
            let mut qkv = b.linear(h, ly.qkv.0, ly.qkv.1, &format!("{p}.qkv"), 3 * c);
            if !gpt2 {
                let rope = Op::Rope {
                    seq_len: t,
                    head_dim: c / cfg.n_heads,
                    rotated_cols: 2 * c,
                    theta: cfg.rope_theta,
                };
                qkv = b.fwd(rope, &[qkv], &format!("{p}.qkv.rope"), &[n, 3 * c]);
            }
            let att = b.fwd(
                Op::Attention {
                    batch,
                    seq_len: t,
                    n_heads: cfg.n_heads,
                },
                &[qkv],
                &format!("{p}.attn"),
                &[n, c],
            );
            let o = b.linear(att, ly.proj.0, ly.proj.1, &format!("{p}.attn_proj"), c);
            x = b.fwd(Op::Add, &[x, o], &format!("{p}.res_1"), &[n, c]);
            let h2 = norm(&mut b, x, ly.ln2, &format!("{p}.ln_2"));
            let u = b.linear(h2, ly.fc.0, ly.fc.1, &format!("{p}.fc"), fc_out);
            let a = if gpt2 {
                b.fwd(Op::Gelu, &[u], &format!("{p}.gelu"), &[n, f])
            } else {
                b.fwd(Op::SwiGlu, &[u], &format!("{p}.swiglu"), &[n, f])
            };
            let d = b.linear(a, ly.fc_proj.0, ly.fc_proj.1, &format!("{p}.mlp_proj"), c);
            x = b.fwd(Op::Add, &[x, d], &format!("{p}.res_2"), &[n, c]);
        }
        let h = norm(&mut b, x, (lnf_w, lnf_b), "ln_f");
        let head = lm_head.unwrap_or(wte);
        let logits = b.linear(h, head, None, "logits", v);
        let loss = b.m.push1(
            Section::Forward,
            Op::CrossEntropy,
            &[logits, targets],
            "loss",
            TensorType::f32([1]),
        );
        b.m.push0(Section::Forward, Op::Loss, &[loss]);
        let params = b.m.section(Section::State).count() - 2;
        Ok(format!(
            "{} family, {params} parameter tensors, {} forward ops",
            if gpt2 { "gpt2" } else { "llama" },
            b.m.section(Section::Forward).count()
        ))
    }
}

fn check(cfg: &ModelConfig, batch: usize, seq_len: usize) -> Result<(), PassError> {
    let bad = |m: String| {
        Err(PassError::Invalid {
            pass: "expand-model",
            message: m,
        })
    };
    // Sizes in their spec ranges (a module parsed from IR text skips the frontend): then every
    // product below (tokens `batch · seq_len`, `3 · d_model`, `2 · mlp_hidden`) fits 64 bits.
    for (key, x, range) in [
        ("vocab", cfg.vocab_size, limits::VOCAB),
        ("context", cfg.context, limits::CONTEXT),
        ("d_model", cfg.d_model, limits::D_MODEL),
        ("layers", cfg.n_layers, limits::LAYERS),
        ("heads", cfg.n_heads, limits::HEADS),
        ("mlp_hidden", cfg.mlp_hidden, limits::MLP_HIDDEN),
        ("batch_size", batch, limits::BATCH_SIZE),
        ("seq_len", seq_len, limits::SEQ_LEN),
    ] {
        if !range.contains_u64(x as u64) {
            return bad(format!("{key} = {x} is outside the allowed range {range}"));
        }
    }
    if cfg.n_heads == 0 || cfg.d_model % cfg.n_heads != 0 {
        return bad(format!(
            "heads ({}) must divide d_model ({})",
            cfg.n_heads, cfg.d_model
        ));
    }
    if cfg.family == Family::Llama && (cfg.d_model / cfg.n_heads) % 2 != 0 {
        return bad("RoPE needs an even head dimension".into());
    }
    if seq_len > cfg.context {
        return bad(format!(
            "seq_len {seq_len} exceeds the model context {}",
            cfg.context
        ));
    }
    Ok(())
}

/// The name prefix of transformer layer `i`'s values and parameters: `h<i>` (`%h3.ln_1`,
/// `%h3.attn.c_attn.weight`), as in GPT-2's checkpoints.
pub fn layer_prefix(i: usize) -> String {
    format!("h{i}")
}

/// The layer whose prefix ([`layer_prefix`]) starts `name` followed by a `.`, if any:
/// `h3.ln_1` → 3, `h3.attn.c_attn.weight.bf16` → 3, `ln_f` / `hx.y` / `h3` → none.
pub fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix('h')?;
    let (digits, tail) = rest.split_once('.')?;
    if digits.is_empty() || tail.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}
