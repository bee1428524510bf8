//! `optimizer <name> { ... }`: AdamW (nanoGPT defaults), SOAP (reference `soap.py` defaults,
//! `shampoo_beta` defaulting to beta2), KL-Shampoo (reference `KLOpt` defaults, `shampoo_beta`
//! defaulting to beta2), Shampoo (Distributed Shampoo's defaults), and every optimizer defined by an element-wise rule in
//! `optim::optimizers` (its keys, defaults and ranges come from its definition).

use ir::config::{
    AdamWConfig, ElementwiseConfig, KlShampooConfig, OptimizerConfig, ShampooConfig, SoapConfig,
};
use optim::optimizers::{self, KeyKind};

use super::{block_name, missing_name};
use crate::ast::{Block, Value, ValueKind};
use crate::check::{unknown_name, Checker, Fields};
use crate::diagnostics::SpecError;
use ir::limits;

/// The built-in optimizers (their own plan ops); the rule-defined ones follow.
const BUILT_IN: &[&str] = &["adamw", "soap", "kl_shampoo", "shampoo"];

/// Every optimizer name a spec may use.
fn optimizer_names() -> Vec<&'static str> {
    BUILT_IN
        .iter()
        .copied()
        .chain(optimizers::DEFINITIONS.iter().map(|d| d.name))
        .collect()
}
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
    "max_preconditioner_dim",
];

const KL_SHAMPOO_KEYS: &[&str] = &[
    "lr",
    "betas",
    "shampoo_beta",
    "eps",
    "weight_decay",
    "precondition_frequency",
    "init_factor",
    "max_clamp_value",
    "max_precond_dim",
    "normalize_grads",
];

const SHAMPOO_KEYS: &[&str] = &[
    "lr",
    "betas",
    "epsilon",
    "weight_decay",
    "max_preconditioner_dim",
    "precondition_frequency",
    "use_bias_correction",
    "grafting",
    "grafting_beta2",
    "grafting_epsilon",
];

/// `optimizer shampoo { ... }`: every key has Distributed Shampoo's default (no grafting,
/// `precondition_frequency = 1`); `grafting = adam` turns on Adam grafting with
/// `AdamPreconditionerConfig`'s defaults.
fn shampoo(c: &mut Checker, b: &Block) -> OptimizerConfig {
    let f = c.fields(b, &block_name(b), SHAMPOO_KEYS, &[]);
    let lr = c.float_or(&f, "lr", limits::LR, 1e-2);
    let (beta1, beta2) = pair(
        c,
        &f,
        "betas",
        ["beta1", "beta2"],
        [limits::BETA, limits::SHAMPOO_BETA2],
        (0.9, 1.0),
    );
    let grafting = f
        .get("grafting")
        .and_then(|e| c.name_value("grafting", &e.value, "grafting", &["adam", "none"]))
        == Some("adam");
    OptimizerConfig::Shampoo(ShampooConfig {
        lr,
        beta1,
        beta2,
        epsilon: c.float_or(&f, "epsilon", limits::EPS, 1e-12),
        weight_decay: c.float_or(&f, "weight_decay", limits::WEIGHT_DECAY, 0.0),
        max_preconditioner_dim: c.uint_or(
            &f,
            "max_preconditioner_dim",
            limits::MAX_PRECONDITIONER_DIM,
            1024,
        ),
        precondition_frequency: c.uint_or(
            &f,
            "precondition_frequency",
            limits::PRECONDITION_FREQUENCY,
            1,
        ),
        use_bias_correction: c.bool_or(&f, "use_bias_correction", true),
        grafting,
        grafting_beta2: c.float_or(&f, "grafting_beta2", limits::BETA, 0.999),
        grafting_epsilon: c.float_or(&f, "grafting_epsilon", limits::EPS, 1e-10),
    })
}

/// `optimizer kl_shampoo { ... }`: every key has the reference's default.
fn kl_shampoo(c: &mut Checker, b: &Block) -> OptimizerConfig {
    let f = c.fields(b, &block_name(b), KL_SHAMPOO_KEYS, &[]);
    let lr = c.float_or(&f, "lr", limits::LR, 1e-4);
    let (beta1, beta2) = betas(c, &f, (0.9, 0.98));
    OptimizerConfig::KlShampoo(KlShampooConfig {
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
        init_factor: c.float_or(&f, "init_factor", limits::INIT_FACTOR, 0.1),
        max_clamp_value: c.float_or(&f, "max_clamp_value", limits::MAX_CLAMP_VALUE, 4000.0),
        max_precond_dim: c.uint_or(&f, "max_precond_dim", limits::MAX_PRECOND_DIM, 10000),
        normalize_grads: c.bool_or(&f, "normalize_grads", false),
    })
}

/// `optimizer <name> { ... }`.
pub(crate) fn optimizer(c: &mut Checker, b: &Block) -> Option<OptimizerConfig> {
    let names = optimizer_names();
    let kind = match &b.name {
        None => {
            let names: Vec<String> = names
                .iter()
                .map(|n| format!("optimizer {n} {{ ... }}"))
                .collect();
            c.push(missing_name(b, "optimizer", &names.join("`, `")));
            None
        }
        Some(n) if names.contains(&n.name.as_str()) => Some(n.name.as_str()),
        Some(n) => {
            c.push(unknown_name("optimizer", &n.name, n.span, &names));
            None
        }
    };
    if let Some(def) = kind.and_then(optimizers::find) {
        return Some(elementwise(c, b, def));
    }
    if kind == Some("kl_shampoo") {
        return Some(kl_shampoo(c, b));
    }
    if kind == Some("shampoo") {
        return Some(shampoo(c, b));
    }
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
        block_size: f.get("max_preconditioner_dim").map(|_| {
            c.uint_or(
                &f,
                "max_preconditioner_dim",
                limits::MAX_PRECONDITIONER_DIM,
                2048,
            )
        }),
    };
    kind.map(|_| OptimizerConfig::Soap(config))
}

/// The block of an optimizer defined by its update rule: the definition's keys, each with its
/// default and range.
fn elementwise(c: &mut Checker, b: &Block, def: &optimizers::Definition) -> OptimizerConfig {
    let keys: Vec<&str> = def.keys.iter().map(|k| k.name).collect();
    let f = c.fields(b, &block_name(b), &keys, &[]);
    let mut hyper = Vec::new();
    for k in def.keys {
        match k.kind {
            KeyKind::Float(d) => {
                hyper.push((k.name.to_string(), c.float_or(&f, k.name, k.range, d)));
            }
            KeyKind::Pair(names, d) => {
                let (a, b) = pair(c, &f, k.name, names, [k.range; 2], d);
                hyper.push((names[0].to_string(), a));
                hyper.push((names[1].to_string(), b));
            }
        }
    }
    OptimizerConfig::Elementwise(ElementwiseConfig {
        name: def.name.to_string(),
        hyper,
    })
}

/// `betas = (β₁, β₂)`, each in [`limits::BETA`].
fn betas(c: &mut Checker, f: &Fields, default: (f64, f64)) -> (f64, f64) {
    pair(
        c,
        f,
        "betas",
        ["beta1", "beta2"],
        [limits::BETA; 2],
        default,
    )
}

/// `key = (a, b)`, each in `range`; `names` name the halves in errors.
fn pair(
    c: &mut Checker,
    f: &Fields,
    key: &str,
    names: [&str; 2],
    ranges: [ir::limits::FloatRange; 2],
    default: (f64, f64),
) -> (f64, f64) {
    let Some(e) = f.get(key) else {
        return default;
    };
    match &e.value.kind {
        ValueKind::Tuple(items) if items.len() == 2 => {
            let first = format!("{} (the first of `{key}`)", names[0]);
            let second = format!("{} (the second of `{key}`)", names[1]);
            let b1 = c.float_in(&first, &items[0], ranges[0]);
            let b2 = c.float_in(&second, &items[1], ranges[1]);
            (b1.unwrap_or(default.0), b2.unwrap_or(default.1))
        }
        ValueKind::Tuple(items) => {
            let found = format!("a tuple of {}", items.len());
            c.push(pair_error(&e.value, key, names, found));
            default
        }
        ValueKind::List(_) => {
            c.push(
                pair_error(&e.value, key, names, "a list".into()).with_help(format!(
                    "use parentheses: `{key} = ({}, {})`",
                    default.0, default.1
                )),
            );
            default
        }
        _ => {
            let want = format!("a pair `({}, {})`", names[0], names[1]);
            c.wrong_type(key, &e.value, &want);
            default
        }
    }
}

fn pair_error(v: &Value, key: &str, names: [&str; 2], found: String) -> SpecError {
    SpecError::new(
        "spec::wrong-type",
        v.span,
        format!(
            "`{key}` must be a pair `({}, {})`, found {found}",
            names[0], names[1]
        ),
        "expected two numbers",
    )
}
