//! Export of a checkpoint's weights for other tools (`asteria export CKPT --format hf -o DIR`).
//!
//! # Hugging Face `transformers` layout
//! [`export_hf`] writes `config.json` and `model.safetensors` (F32, metadata `format = pt`)
//! that `transformers` loads with `AutoModelForCausalLM.from_pretrained(DIR)`:
//! - GPT-2 → `GPT2LMHeadModel`: names `transformer.wte.weight`, `transformer.h.{i}.attn.c_attn.weight`,
//!   ...; the four projection weights of each block are transposed (asteria keeps `nn.Linear`'s
//!   `[out, in]`, GPT-2's `Conv1D` stores `[in, out]`); the LM head is tied to `wte` (not written);
//!   `activation_function = gelu_new` (the tanh GELU asteria computes).
//! - LLaMA → `LlamaForCausalLM`: asteria's fused `c_attn [3C, C]` is split by rows into
//!   `q_proj`, `k_proj`, `v_proj` (`[C, C]` each; RoPE in both is rotate-half over each head's
//!   `head_dim` columns, so no permutation), its SwiGLU `c_fc [2F, C]` into `gate_proj`
//!   (rows `0..F`) and `up_proj` (rows `F..2F`); `num_key_value_heads = num_attention_heads`,
//!   no biases, untied `lm_head`.
//!
//! Every parameter of the checkpoint is written exactly once; a missing tensor, a shape that
//! does not match the plan's architecture, or a parameter the mapping does not know is an
//! error before anything is written. The files are written as `*.tmp` and renamed.
//!
//! Reference: `transformers/models/gpt2/modeling_gpt2.py` and
//! `transformers/models/llama/modeling_llama.py` (module names and weight layouts).
use crate::checkpoint::Checkpoint;
use crate::EngineError;
use schedule::{BufferClass, ModelFamily, ModelPlan, Tokenizer};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What [`export_hf`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Exported {
    /// `DIR/config.json`.
    pub config: PathBuf,
    /// `DIR/model.safetensors`.
    pub weights: PathBuf,
    /// The `transformers` architecture (`GPT2LMHeadModel` or `LlamaForCausalLM`).
    pub architecture: &'static str,
    /// Tensors written.
    pub tensors: usize,
    /// Parameters written (elements).
    pub parameters: usize,
}

fn err(what: impl std::fmt::Display) -> EngineError {
    EngineError::Checkpoint(what.to_string())
}

/// A row-major `[rows, cols]` matrix transposed to `[cols, rows]`.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

/// The checkpoint's parameters by name, each taken at most once.
struct Params<'a> {
    ckpt: &'a Checkpoint,
    shapes: BTreeMap<String, Vec<usize>>,
    taken: BTreeSet<String>,
}

impl<'a> Params<'a> {
    fn new(ckpt: &'a Checkpoint, plan: &schedule::Plan) -> Self {
        // The plan's parameters, not every buffer of their class: a parameter moved off the
        // device has step-local staging copies of that class too (`prefetch-insertion`).
        let shapes = plan
            .params
            .iter()
            .map(|p| plan.buffer(p.param))
            .filter(|b| b.class == BufferClass::Parameter)
            .map(|b| (b.name.clone(), b.shape.clone()))
            .collect();
        Params {
            ckpt,
            shapes,
            taken: BTreeSet::new(),
        }
    }

    /// Parameter `name`, checked to have `shape`.
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<&'a [f32], EngineError> {
        let got = self.shapes.get(name).ok_or_else(|| {
            err(format!(
                "{}: the plan has no parameter `{name}` (shape {shape:?}) that the export needs",
                self.ckpt.dir.display()
            ))
        })?;
        if got.as_slice() != shape {
            return Err(err(format!(
                "{}: parameter `{name}` has shape {got:?}, the architecture needs {shape:?}",
                self.ckpt.dir.display()
            )));
        }
        let v = self.ckpt.tensors.get(name).ok_or_else(|| {
            err(format!(
                "{}: state.safetensors has no tensor `{name}`",
                self.ckpt.dir.display()
            ))
        })?;
        if v.len() != shape.iter().product::<usize>() {
            return Err(err(format!(
                "{}: tensor `{name}` holds {} values, its shape {shape:?} needs {}",
                self.ckpt.dir.display(),
                v.len(),
                shape.iter().product::<usize>()
            )));
        }
        self.taken.insert(name.to_string());
        Ok(v)
    }

    /// Every parameter was exported.
    fn all_taken(&self) -> Result<(), EngineError> {
        match self.shapes.keys().find(|n| !self.taken.contains(*n)) {
            Some(n) => Err(err(format!(
                "{}: parameter `{n}` has no place in the exported architecture",
                self.ckpt.dir.display()
            ))),
            None => Ok(()),
        }
    }
}

/// `(name, shape, values)` of every exported tensor and the `config.json` object.
type Layout = (Vec<(String, Vec<usize>, Vec<f32>)>, serde_json::Value);

fn gpt2(m: &ModelPlan, p: &mut Params<'_>, gpt2_tokens: bool) -> Result<Layout, EngineError> {
    let (v, c, f, t) = (m.vocab_size, m.d_model, m.mlp_hidden, m.context);
    let mut out = Vec::new();
    let mut put = |name: String, shape: Vec<usize>, data: Vec<f32>| out.push((name, shape, data));
    put(
        "transformer.wte.weight".into(),
        vec![v, c],
        p.take("wte", &[v, c])?.to_vec(),
    );
    put(
        "transformer.wpe.weight".into(),
        vec![t, c],
        p.take("wpe", &[t, c])?.to_vec(),
    );
    for l in 0..m.n_layers {
        let (a, h) = (format!("h{l}."), format!("transformer.h.{l}."));
        for ln in ["ln_1", "ln_2"] {
            for wb in ["weight", "bias"] {
                put(
                    format!("{h}{ln}.{wb}"),
                    vec![c],
                    p.take(&format!("{a}{ln}.{wb}"), &[c])?.to_vec(),
                );
            }
        }
        // Linear [out, in] → Conv1D [in, out].
        for (name, out_dim, in_dim) in [
            ("attn.c_attn", 3 * c, c),
            ("attn.c_proj", c, c),
            ("mlp.c_fc", f, c),
            ("mlp.c_proj", c, f),
        ] {
            let w = p.take(&format!("{a}{name}.weight"), &[out_dim, in_dim])?;
            put(
                format!("{h}{name}.weight"),
                vec![in_dim, out_dim],
                transpose(w, out_dim, in_dim),
            );
            put(
                format!("{h}{name}.bias"),
                vec![out_dim],
                p.take(&format!("{a}{name}.bias"), &[out_dim])?.to_vec(),
            );
        }
    }
    for wb in ["weight", "bias"] {
        put(
            format!("transformer.ln_f.{wb}"),
            vec![c],
            p.take(&format!("ln_f.{wb}"), &[c])?.to_vec(),
        );
    }
    let mut config = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": v,
        "n_positions": t,
        "n_embd": c,
        "n_layer": m.n_layers,
        "n_head": m.n_heads,
        "n_inner": f,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": m.norm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
    });
    if gpt2_tokens {
        config["bos_token_id"] = 50256.into();
        config["eos_token_id"] = 50256.into();
    }
    Ok((out, config))
}

fn llama(m: &ModelPlan, p: &mut Params<'_>, gpt2_tokens: bool) -> Result<Layout, EngineError> {
    let (v, c, f) = (m.vocab_size, m.d_model, m.mlp_hidden);
    let mut out = Vec::new();
    let mut put = |name: String, shape: Vec<usize>, data: Vec<f32>| out.push((name, shape, data));
    put(
        "model.embed_tokens.weight".into(),
        vec![v, c],
        p.take("wte", &[v, c])?.to_vec(),
    );
    for l in 0..m.n_layers {
        let (a, h) = (format!("h{l}."), format!("model.layers.{l}."));
        put(
            format!("{h}input_layernorm.weight"),
            vec![c],
            p.take(&format!("{a}ln_1.weight"), &[c])?.to_vec(),
        );
        let qkv = p.take(&format!("{a}attn.c_attn.weight"), &[3 * c, c])?;
        for (i, name) in ["q_proj", "k_proj", "v_proj"].into_iter().enumerate() {
            put(
                format!("{h}self_attn.{name}.weight"),
                vec![c, c],
                qkv[i * c * c..(i + 1) * c * c].to_vec(),
            );
        }
        put(
            format!("{h}self_attn.o_proj.weight"),
            vec![c, c],
            p.take(&format!("{a}attn.c_proj.weight"), &[c, c])?.to_vec(),
        );
        put(
            format!("{h}post_attention_layernorm.weight"),
            vec![c],
            p.take(&format!("{a}ln_2.weight"), &[c])?.to_vec(),
        );
        let fc = p.take(&format!("{a}mlp.c_fc.weight"), &[2 * f, c])?;
        put(
            format!("{h}mlp.gate_proj.weight"),
            vec![f, c],
            fc[..f * c].to_vec(),
        );
        put(
            format!("{h}mlp.up_proj.weight"),
            vec![f, c],
            fc[f * c..].to_vec(),
        );
        put(
            format!("{h}mlp.down_proj.weight"),
            vec![c, f],
            p.take(&format!("{a}mlp.c_proj.weight"), &[c, f])?.to_vec(),
        );
    }
    put(
        "model.norm.weight".into(),
        vec![c],
        p.take("ln_f.weight", &[c])?.to_vec(),
    );
    put(
        "lm_head.weight".into(),
        vec![v, c],
        p.take("lm_head.weight", &[v, c])?.to_vec(),
    );
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": v,
        "hidden_size": c,
        "intermediate_size": f,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads,
        "head_dim": c / m.n_heads.max(1),
        "max_position_embeddings": m.context,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": false,
        "torch_dtype": "float32",
    });
    if gpt2_tokens {
        config["bos_token_id"] = 50256.into();
        config["eos_token_id"] = 50256.into();
    }
    Ok((out, config))
}

fn write_atomic(path: &Path, data: &[u8]) -> Result<(), EngineError> {
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension().and_then(|e| e.to_str()).unwrap_or("")
    ));
    let io = |e: std::io::Error| err(format!("{}: {e}", tmp.display()));
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(data).and_then(|_| f.sync_all()).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(|e| err(format!("{}: {e}", path.display())))
}

/// Writes the weights of `ckpt` into `dir` (created if missing) as a Hugging Face
/// `transformers` model: `config.json` and `model.safetensors` (see the module docs for the
/// names and layouts). Existing files of those names are replaced.
///
/// # Errors
/// [`EngineError::Checkpoint`] when the checkpoint has no plan or its plan does not record
/// the architecture (written by an older asteria), when a parameter is missing, has another
/// shape or has no place in the architecture, and on I/O errors (naming the path).
pub fn export_hf(ckpt: &Checkpoint, dir: &Path) -> Result<Exported, EngineError> {
    let plan = ckpt.plan.as_ref().ok_or_else(|| {
        err(format!(
            "{} has no plan.json (written before checkpoints stored their plan): its weights \
             have no architecture to export",
            ckpt.dir.display()
        ))
    })?;
    let model = plan.model.as_ref().ok_or_else(|| {
        err(format!(
            "{}: its plan does not record the model's architecture (written by an older \
             asteria); resume it for one step with this asteria to write one that does",
            ckpt.dir.display()
        ))
    })?;
    let gpt2_tokens = plan.data.tokenizer == Tokenizer::Gpt2;
    let mut params = Params::new(ckpt, plan);
    let (tensors, config) = match model.family {
        ModelFamily::Gpt2 => gpt2(model, &mut params, gpt2_tokens)?,
        ModelFamily::Llama => llama(model, &mut params, gpt2_tokens)?,
    };
    params.all_taken()?;
    let architecture = match model.family {
        ModelFamily::Gpt2 => "GPT2LMHeadModel",
        ModelFamily::Llama => "LlamaForCausalLM",
    };
    // transformers refuses a safetensors file without `format` in its metadata.
    let metadata = Some(std::collections::HashMap::from([(
        "format".to_string(),
        "pt".to_string(),
    )]));
    let st = crate::checkpoint::f32_safetensors(
        tensors
            .iter()
            .map(|(n, sh, v)| (n.clone(), sh.clone(), v.as_slice())),
        metadata,
    )?;
    std::fs::create_dir_all(dir).map_err(|e| err(format!("{}: {e}", dir.display())))?;
    let weights = dir.join("model.safetensors");
    let config_path = dir.join("config.json");
    write_atomic(&weights, &st)?;
    let config_bytes =
        serde_json::to_vec_pretty(&config).map_err(|e| err(format!("config.json: {e}")))?;
    write_atomic(&config_path, &config_bytes)?;
    Ok(Exported {
        config: config_path,
        weights,
        architecture,
        tensors: tensors.len(),
        parameters: tensors.iter().map(|t| t.2.len()).sum(),
    })
}

#[cfg(test)]
mod tests {
    use super::transpose;

    #[test]
    fn transpose_moves_rows_to_columns() {
        // [[1, 2, 3], [4, 5, 6]] → [[1, 4], [2, 5], [3, 6]]
        let t = transpose(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3);
        assert_eq!(t, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    }
}
