//! `model <gpt2|llama> { ... }`: sizes, defaults (`mlp_hidden`, `norm_eps`, `init_std`,
//! `rope_theta`) and the shape checks (heads divide d_model, even RoPE head size).

use ir::config::{Family, ModelConfig};

use super::{block_name, missing_name};
use crate::ast::Block;
use crate::check::{unknown_name, Checker, Fields};
use crate::diagnostics::SpecError;
use ir::limits;

const FAMILIES: &[&str] = &["gpt2", "llama"];
const MODEL_KEYS: &[&str] = &[
    "vocab",
    "context",
    "d_model",
    "layers",
    "heads",
    "mlp_hidden",
    "norm_eps",
    "init_std",
    "rope_theta",
];

/// `model <family> { ... }`.
pub(crate) fn model<'a>(c: &mut Checker, b: &'a Block) -> (ModelConfig, Fields<'a>) {
    let family = match &b.name {
        None => {
            c.push(missing_name(
                b,
                "model family",
                "model gpt2 { ... }` or `model llama { ... }",
            ));
            None
        }
        Some(n) => match n.name.as_str() {
            "gpt2" => Some(Family::Gpt2),
            "llama" => Some(Family::Llama),
            other => {
                c.push(unknown_name("model family", other, n.span, FAMILIES));
                None
            }
        },
    };
    let (allowed, foreign): (&[&str], &[(&str, &str)]) = if family == Some(Family::Gpt2) {
        (
            &MODEL_KEYS[..MODEL_KEYS.len() - 1],
            &[(
                "rope_theta",
                "`rope_theta` applies to `model llama` only; GPT-2 learns its position embeddings",
            )],
        )
    } else {
        (MODEL_KEYS, &[])
    };
    let f = c.fields(b, &block_name(b), allowed, foreign);
    let vocab = c.uint_req(&f, "vocab", limits::VOCAB);
    let context = c.uint_req(&f, "context", limits::CONTEXT);
    let d_model = c.uint_req::<usize>(&f, "d_model", limits::D_MODEL);
    let n_layers = c.uint_req(&f, "layers", limits::LAYERS);
    let n_heads = c.uint_req::<usize>(&f, "heads", limits::HEADS);
    let default_mlp = match (family, d_model) {
        (Some(Family::Llama), Some(d)) => d
            .saturating_mul(8)
            .div_ceil(3)
            .div_ceil(64)
            .saturating_mul(64),
        (_, Some(d)) => d.saturating_mul(4),
        (_, None) => 1,
    };
    let mlp_hidden = c.uint_or(&f, "mlp_hidden", limits::MLP_HIDDEN, default_mlp);
    if let (Some(d), Some(h), Some(he), Some(de)) =
        (d_model, n_heads, f.get("heads"), f.get("d_model"))
    {
        if d % h != 0 {
            let divisors: Vec<String> = (1..=d.min(4096))
                .filter(|k| d % k == 0)
                .take(12)
                .map(|k| k.to_string())
                .collect();
            c.push(
                SpecError::new(
                    "spec::heads-not-dividing",
                    he.value.span,
                    format!("`heads` ({h}) does not divide `d_model` ({d})"),
                    "does not divide d_model",
                )
                .with_note(de.value.span, "d_model set here")
                .with_help(format!(
                    "the head size is d_model / heads; pick heads among {}",
                    divisors.join(", ")
                )),
            );
        } else if family == Some(Family::Llama) && (d / h) % 2 != 0 {
            c.push(
                SpecError::new(
                    "spec::odd-head-size",
                    he.value.span,
                    format!(
                        "head size d_model / heads = {} must be even for RoPE",
                        d / h
                    ),
                    "gives an odd head size",
                )
                .with_note(de.value.span, "d_model set here"),
            );
        }
    }
    let config = ModelConfig {
        family: family.unwrap_or(Family::Gpt2),
        vocab_size: vocab.unwrap_or(1),
        context: context.unwrap_or(1),
        d_model: d_model.unwrap_or(1),
        n_layers: n_layers.unwrap_or(1),
        n_heads: n_heads.unwrap_or(1),
        mlp_hidden,
        norm_eps: c.float_or(&f, "norm_eps", limits::NORM_EPS, 1e-5),
        init_std: c.float_or(&f, "init_std", limits::INIT_STD, 0.02),
        rope_theta: c.float_or(&f, "rope_theta", limits::ROPE_THETA, 10000.0),
    };
    (config, f)
}
