//! `optimizer <adamw|soap> { ... }`: AdamW (nanoGPT defaults) and SOAP (reference `soap.py`
//! defaults, `shampoo_beta` defaulting to beta2).

use ir::config::{AdamWConfig, OptimizerConfig, SoapConfig};

use super::{block_name, missing_name};
use crate::ast::{Block, Value, ValueKind};
use crate::check::{unknown_name, Checker, Fields};
use crate::diagnostics::SpecError;
use ir::limits;

const OPTIMIZERS: &[&str] = &["adamw", "soap"];
const ADAMW_KEYS: &[&str] = &["lr", "betas", "eps", "weight_decay"];
const SOAP_KEYS: &[&str] = &[
    "lr",
    "betas",
    "shampoo_beta",
    "eps",
    "weight_decay",
    "precondition_frequency",
    "max_precond_dim",
    "correct_bias",
    "normalize_grads",
];

/// `optimizer <adamw|soap> { ... }`.
pub(crate) fn optimizer(c: &mut Checker, b: &Block) -> Option<OptimizerConfig> {
    let kind = match &b.name {
        None => {
            c.push(missing_name(
                b,
                "optimizer",
                "optimizer adamw { ... }` or `optimizer soap { ... }",
            ));
            None
        }
        Some(n) if OPTIMIZERS.contains(&n.name.as_str()) => Some(n.name.as_str()),
        Some(n) => {
            c.push(unknown_name("optimizer", &n.name, n.span, OPTIMIZERS));
            None
        }
    };
    let soap_only: Vec<(&str, &str)> = SOAP_KEYS
        .iter()
        .filter(|k| !ADAMW_KEYS.contains(k))
        .map(|k| {
            (
                *k,
                "this is a SOAP hyperparameter; it applies to `optimizer soap` only",
            )
        })
        .collect();
    let (allowed, foreign): (&[&str], &[(&str, &str)]) = match kind {
        Some("adamw") => (ADAMW_KEYS, &soap_only),
        _ => (SOAP_KEYS, &[]),
    };
    let f = c.fields(b, &block_name(b), allowed, foreign);
    if kind == Some("adamw") {
        let lr = c.float_or(&f, "lr", limits::LR, 6e-4);
        let (beta1, beta2) = betas(c, &f, (0.9, 0.95));
        return Some(OptimizerConfig::Adamw(AdamWConfig {
            lr,
            beta1,
            beta2,
            eps: c.float_or(&f, "eps", limits::EPS, 1e-8),
            weight_decay: c.float_or(&f, "weight_decay", limits::WEIGHT_DECAY, 0.1),
        }));
    }
    let lr = c.float_or(&f, "lr", limits::LR, 3e-3);
    let (beta1, beta2) = betas(c, &f, (0.95, 0.95));
    let config = SoapConfig {
        lr,
        beta1,
        beta2,
        shampoo_beta: c.float_or(&f, "shampoo_beta", limits::BETA, beta2),
        eps: c.float_or(&f, "eps", limits::EPS, 1e-8),
        weight_decay: c.float_or(&f, "weight_decay", limits::WEIGHT_DECAY, 0.01),
        precondition_frequency: c.uint_or(
            &f,
            "precondition_frequency",
            limits::PRECONDITION_FREQUENCY,
            10,
        ),
        max_precond_dim: c.uint_or(&f, "max_precond_dim", limits::MAX_PRECOND_DIM, 10000),
        correct_bias: c.bool_or(&f, "correct_bias", true),
        normalize_grads: c.bool_or(&f, "normalize_grads", false),
    };
    kind.map(|_| OptimizerConfig::Soap(config))
}

/// `betas = (β₁, β₂)`, each in [`limits::BETA`].
fn betas(c: &mut Checker, f: &Fields, default: (f64, f64)) -> (f64, f64) {
    let Some(e) = f.get("betas") else {
        return default;
    };
    match &e.value.kind {
        ValueKind::Tuple(items) if items.len() == 2 => {
            let b1 = c.float_in("beta1 (the first of `betas`)", &items[0], limits::BETA);
            let b2 = c.float_in("beta2 (the second of `betas`)", &items[1], limits::BETA);
            (b1.unwrap_or(default.0), b2.unwrap_or(default.1))
        }
        ValueKind::Tuple(items) => {
            c.push(pair_error(&e.value, format!("a tuple of {}", items.len())));
            default
        }
        ValueKind::List(_) => {
            c.push(
                pair_error(&e.value, "a list".into())
                    .with_help("use parentheses: `betas = (0.9, 0.95)`"),
            );
            default
        }
        _ => {
            c.wrong_type("betas", &e.value, "a pair `(beta1, beta2)`");
            default
        }
    }
}

fn pair_error(v: &Value, found: String) -> SpecError {
    SpecError::new(
        "spec::wrong-type",
        v.span,
        format!("`betas` must be a pair `(beta1, beta2)`, found {found}"),
        "expected two numbers",
    )
}
