//! Turns a parsed op name, its positional words (`state` / `input`) and its `{name = value}`
//! attributes into an [`Op`], with errors for unknown ops (and a "did you mean"), missing,
//! unknown or malformed attributes.
use super::{Cursor, ParseError};
use crate::op::{InputRole, Op};
use crate::printer::{class_keyword, role_keyword, CLASSES};
use schedule::{
    ElementwiseRule, Init, InverseRoot, KlShampooHyper, RefreshMethod, ShampooHyper, SoapHyper,
    StepScalar,
};
use std::str::FromStr;

/// Every op name of the text format.
const OP_NAMES: [&str; 45] = [
    "state",
    "input",
    "loss",
    "grad_of",
    "embedding",
    "embedding_backward",
    "add_positional",
    "add_positional_backward",
    "layer_norm",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_backward",
    "mat_mul",
    "mat_mul_bias",
    "bias_add",
    "sum_rows",
    "sum_rows_cast",
    "add",
    "cast",
    "gelu",
    "gelu_backward",
    "swi_glu",
    "swi_glu_backward",
    "rope",
    "rope_backward",
    "attention",
    "attention_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "clip_grad_norm",
    "adam_w",
    "soap_update",
    "soap_factor_update",
    "kl_shampoo_update",
    "shampoo_update",
    "shampoo_factor_update",
    "shampoo_precondition",
    "graft",
    "kl_scale",
    "kl_factor_update",
    "block_copy",
    "project",
    "block_write",
    "elementwise_update",
    "eigenbasis_refresh",
];

/// One `name = value` attribute as written.
pub(super) struct RawAttr<'a> {
    /// Attribute name.
    pub(super) name: &'a str,
    /// Its value, unparsed.
    pub(super) value: &'a str,
    /// The text at the name (error position).
    pub(super) name_at: &'a str,
    /// The text at the value (error position).
    pub(super) value_at: &'a str,
}

/// The attributes of one instruction, consumed by name.
struct Attrs<'c, 'a> {
    c: &'c Cursor<'a>,
    op_at: &'a str,
    op: &'a str,
    items: Vec<RawAttr<'a>>,
    used: Vec<bool>,
}

impl<'a> Attrs<'_, 'a> {
    fn raw(&mut self, name: &str) -> Result<(&'a str, &'a str), ParseError> {
        match self.items.iter().position(|a| a.name == name) {
            Some(i) => {
                self.used[i] = true;
                Ok((self.items[i].value, self.items[i].value_at))
            }
            None => {
                let typo = self
                    .items
                    .iter()
                    .zip(&self.used)
                    .find(|(a, &u)| !u && suggest(a.name, [name]).is_some());
                Err(match typo {
                    Some((a, _)) => self.c.err_at(
                        a.name_at,
                        format!(
                            "`{}` has no attribute `{}`; did you mean `{name}`?",
                            self.op, a.name
                        ),
                    ),
                    None => self.c.err_at(
                        self.op_at,
                        format!("`{}` is missing attribute `{name}`", self.op),
                    ),
                })
            }
        }
    }
    fn num<T: FromStr>(&mut self, name: &str, what: &str) -> Result<T, ParseError> {
        let (raw, at) = self.raw(name)?;
        raw.parse::<T>().map_err(|_| {
            self.c.err_at(
                at,
                format!(
                    "attribute `{name}` of `{}` expects {what}, found `{raw}`",
                    self.op
                ),
            )
        })
    }
    fn f(&mut self, name: &str) -> Result<f64, ParseError> {
        self.num(name, "a float")
    }
    fn u(&mut self, name: &str) -> Result<usize, ParseError> {
        self.num(name, "a non-negative integer")
    }
    fn b(&mut self, name: &str) -> Result<bool, ParseError> {
        self.num(name, "`true` or `false`")
    }
    /// An attribute that may be left out (`None`).
    fn maybe_raw(&mut self, name: &str) -> Option<&'a str> {
        let i = self.items.iter().position(|a| a.name == name)?;
        self.used[i] = true;
        Some(self.items[i].value)
    }
    fn opt_f(&mut self, name: &str) -> Result<Option<f64>, ParseError> {
        match self.raw(name)? {
            ("none", _) => Ok(None),
            _ => self.f(name).map(Some),
        }
    }
    /// Errors on the first attribute that the op does not have.
    fn finish(&self) -> Result<(), ParseError> {
        match self.items.iter().zip(&self.used).find(|(_, &u)| !u) {
            Some((a, _)) => Err(self.c.err_at(
                a.name_at,
                format!("`{}` has no attribute `{}`", self.op, a.name),
            )),
            None => Ok(()),
        }
    }
}

/// Levenshtein distance (for "did you mean").
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for j in 0..b.len() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != b[j]))
                .min(row[j] + 1)
                .min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The closest of `candidates` to `word`, if close enough to be a likely typo.
pub(crate) fn suggest<'s>(
    word: &str,
    candidates: impl IntoIterator<Item = &'s str>,
) -> Option<&'s str> {
    let limit = (word.chars().count() / 3).max(2);
    let prefix =
        |c: &str| word.len().min(c.len()) >= 3 && (word.starts_with(c) || c.starts_with(word));
    candidates
        .into_iter()
        .map(|c| (distance(word, c), c))
        .filter(|&(d, c)| d <= limit || prefix(c))
        .min_by_key(|(d, _)| *d)
        .map(|x| x.1)
}

fn unknown(c: &Cursor<'_>, at: &str, what: &str, word: &str, candidates: &[&str]) -> ParseError {
    let hint = match suggest(word, candidates.iter().copied()) {
        Some(s) => format!("; did you mean `{s}`?"),
        None => format!(" (expected one of: {})", candidates.join(", ")),
    };
    c.err_at(at, format!("unknown {what} `{word}`{hint}"))
}

/// Builds the op `name` at `op_at`; `positional` are the words after `state` / `input`,
/// `paren` the `(std = ...)` of `normal`, `items` the `{...}` attributes.
pub(super) fn build_op<'a>(
    c: &Cursor<'a>,
    op_at: &'a str,
    name: &'a str,
    positional: &[(&'a str, &'a str)],
    paren: Vec<RawAttr<'a>>,
    items: Vec<RawAttr<'a>>,
) -> Result<Op, ParseError> {
    if !OP_NAMES.contains(&name) {
        return Err(unknown(c, op_at, "op", name, &OP_NAMES));
    }
    let used = vec![false; items.len()];
    let mut a = Attrs {
        c,
        op_at,
        op: name,
        items,
        used,
    };
    let op = match name {
        "state" => {
            let classes: Vec<&str> = CLASSES.iter().map(|&k| class_keyword(k)).collect();
            let [(class, class_at), (init, init_at)] = positional else {
                let at = positional.get(2).map_or(op_at, |p| p.1);
                return Err(c.err_at(
                    at,
                    "expected `state <class> <init>`, e.g. `state parameter normal(std = 0.02)`",
                ));
            };
            let Some(class) = CLASSES
                .iter()
                .copied()
                .find(|&k| class_keyword(k) == *class)
            else {
                return Err(unknown(c, class_at, "buffer class", class, &classes));
            };
            let init = match *init {
                "zeros" => Init::Zeros,
                "ones" => Init::Ones,
                "normal" => {
                    let mut p = Attrs {
                        c,
                        op_at: init_at,
                        op: "normal",
                        used: vec![false; paren.len()],
                        items: paren,
                    };
                    let std = p.f("std")?;
                    p.finish()?;
                    Init::Normal { std }
                }
                other => {
                    return Err(unknown(
                        c,
                        init_at,
                        "init",
                        other,
                        &["zeros", "ones", "normal"],
                    ))
                }
            };
            Op::State { class, init }
        }
        "input" => {
            let roles = [InputRole::Tokens, InputRole::Targets];
            let [(role, at)] = positional else {
                let at = positional.get(1).map_or(op_at, |p| p.1);
                return Err(c.err_at(at, "expected `input tokens` or `input targets`"));
            };
            match roles.into_iter().find(|&r| role_keyword(r) == *role) {
                Some(role) => Op::Input { role },
                None => return Err(unknown(c, at, "input role", role, &["tokens", "targets"])),
            }
        }
        "loss" => Op::Loss,
        "grad_of" => Op::GradOf,
        "embedding" => Op::Embedding,
        "embedding_backward" => Op::EmbeddingBackward,
        "add_positional" => Op::AddPositional {
            seq_len: a.u("seq_len")?,
        },
        "add_positional_backward" => Op::AddPositionalBackward {
            seq_len: a.u("seq_len")?,
        },
        "layer_norm" => Op::LayerNorm { eps: a.f("eps")? },
        "layer_norm_backward" => Op::LayerNormBackward {
            eps: a.f("eps")?,
            bias: a.b("bias")?,
        },
        "rms_norm" => Op::RmsNorm { eps: a.f("eps")? },
        "rms_norm_backward" => Op::RmsNormBackward { eps: a.f("eps")? },
        "mat_mul" => Op::MatMul {
            trans_a: a.b("trans_a")?,
            trans_b: a.b("trans_b")?,
        },
        "mat_mul_bias" => Op::MatMulBias {
            trans_a: a.b("trans_a")?,
            trans_b: a.b("trans_b")?,
        },
        "bias_add" => Op::BiasAdd,
        "sum_rows" => Op::SumRows,
        "sum_rows_cast" => Op::SumRowsCast,
        "add" => Op::Add,
        "cast" => Op::Cast,
        "gelu" => Op::Gelu,
        "gelu_backward" => Op::GeluBackward,
        "swi_glu" => Op::SwiGlu,
        "swi_glu_backward" => Op::SwiGluBackward,
        "rope" | "rope_backward" => {
            let (seq_len, head_dim, rotated_cols) =
                (a.u("seq_len")?, a.u("head_dim")?, a.u("rotated_cols")?);
            let theta = a.f("theta")?;
            match name {
                "rope" => Op::Rope {
                    seq_len,
                    head_dim,
                    rotated_cols,
                    theta,
                },
                _ => Op::RopeBackward {
                    seq_len,
                    head_dim,
                    rotated_cols,
                    theta,
                },
            }
        }
        "attention" | "attention_backward" => {
            let (batch, seq_len, n_heads) = (a.u("batch")?, a.u("seq_len")?, a.u("n_heads")?);
            match name {
                "attention" => Op::Attention {
                    batch,
                    seq_len,
                    n_heads,
                },
                _ => Op::AttentionBackward {
                    batch,
                    seq_len,
                    n_heads,
                },
            }
        }
        "cross_entropy" => Op::CrossEntropy,
        "cross_entropy_backward" => Op::CrossEntropyBackward,
        "clip_grad_norm" => Op::ClipGradNorm {
            max_norm: a.opt_f("max_norm")?,
        },
        "adam_w" => Op::AdamW {
            lr: a.f("lr")?,
            beta1: a.f("beta1")?,
            beta2: a.f("beta2")?,
            eps: a.f("eps")?,
            weight_decay: a.f("weight_decay")?,
        },
        "soap_update" => {
            let hyper = SoapHyper {
                lr: a.f("lr")?,
                beta1: a.f("beta1")?,
                beta2: a.f("beta2")?,
                eps: a.f("eps")?,
                weight_decay: a.f("weight_decay")?,
                correct_bias: a.b("correct_bias")?,
                normalize_grads: a.b("normalize_grads")?,
            };
            Op::SoapUpdate {
                hyper,
                left: a.b("left")?,
                right: a.b("right")?,
            }
        }
        "kl_shampoo_update" => {
            let hyper = KlShampooHyper {
                lr: a.f("lr")?,
                beta1: a.f("beta1")?,
                shampoo_beta: a.f("shampoo_beta")?,
                eps: a.f("eps")?,
                weight_decay: a.f("weight_decay")?,
                init_factor: a.f("init_factor")?,
                max_clamp_value: a.f("max_clamp_value")?,
                normalize_grads: a.b("normalize_grads")?,
            };
            Op::KlShampooUpdate {
                hyper,
                left: a.b("left")?,
                right: a.b("right")?,
            }
        }
        "project" => Op::Project {
            back: a.b("back")?,
            left: a.b("left")?,
            right: a.b("right")?,
        },
        "block_copy" => Op::BlockCopy {
            row: a.u("row")?,
            col: a.u("col")?,
        },
        "block_write" => Op::BlockWrite {
            row: a.u("row")?,
            col: a.u("col")?,
        },
        "shampoo_update" => Op::ShampooUpdate {
            hyper: ShampooHyper {
                lr: a.f("lr")?,
                beta1: a.f("beta1")?,
                beta2: a.f("beta2")?,
                epsilon: a.f("epsilon")?,
                weight_decay: a.f("weight_decay")?,
                use_bias_correction: a.b("use_bias_correction")?,
                max_preconditioner_dim: a.num("max_preconditioner_dim", "a positive integer")?,
                grafting: a.b("grafting")?,
                grafting_beta2: a.f("grafting_beta2")?,
                grafting_epsilon: a.f("grafting_epsilon")?,
            },
        },
        "shampoo_factor_update" => Op::ShampooFactorUpdate {
            beta2: a.f("beta2")?,
            use_bias_correction: a.b("use_bias_correction")?,
            max_preconditioner_dim: a.num("max_preconditioner_dim", "a positive integer")?,
        },
        "shampoo_precondition" => Op::ShampooPrecondition {
            max_preconditioner_dim: a.num("max_preconditioner_dim", "a positive integer")?,
        },
        "graft" => Op::Graft {
            max_preconditioner_dim: a.num("max_preconditioner_dim", "a positive integer")?,
        },
        "kl_scale" => Op::KlScale { eps: a.f("eps")? },
        "kl_factor_update" => Op::KlFactorUpdate {
            shampoo_beta: a.f("shampoo_beta")?,
            init_factor: a.f("init_factor")?,
            max_clamp_value: a.f("max_clamp_value")?,
            left: a.b("left")?,
            right: a.b("right")?,
        },
        "soap_factor_update" => Op::SoapFactorUpdate {
            shampoo_beta: a.f("shampoo_beta")?,
            left: a.b("left")?,
            right: a.b("right")?,
        },
        "elementwise_update" => {
            let words = |s: &str| s.split_whitespace().map(str::to_string).collect::<Vec<_>>();
            let optimizer = a.raw("optimizer")?.0.to_string();
            let lr = a.f("lr")?;
            let state = words(a.raw("state")?.0);
            let outputs = words(a.raw("outputs")?.0);
            let (raw, at) = a.raw("scalars")?;
            let scalars = raw
                .split_whitespace()
                .map(|w| w.parse::<StepScalar>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| a.c.err_at(at, format!("attribute `scalars`: {e}")))?;
            let expr = a.raw("expr")?.0.to_string();
            let results = a.maybe_raw("results").map(words).unwrap_or_default();
            let hyper = match a.maybe_raw("hyper") {
                None => Vec::new(),
                Some(raw) => raw
                    .split_whitespace()
                    .map(|w| {
                        let (k, x) = w.split_once('=').ok_or("expected `key=value`")?;
                        let x = x.parse::<f64>().map_err(|_| "the value is not a number")?;
                        Ok((k.to_string(), x))
                    })
                    .collect::<Result<Vec<_>, &str>>()
                    .map_err(|e| a.c.err_at(a.op_at, format!("attribute `hyper`: {e}")))?,
            };
            let rule = ElementwiseRule {
                optimizer,
                lr,
                state,
                outputs,
                scalars,
                expr,
                results,
                hyper,
            };
            rule.check()
                .map_err(|e| a.c.err_at(a.op_at, format!("`elementwise_update`: {e}")))?;
            Op::ElementwiseUpdate { rule }
        }
        "eigenbasis_refresh" => {
            let (side, frequency, offset, staleness, placement, method) = (
                a.num("side", "0 or 1")?,
                a.num("frequency", "a positive integer")?,
                a.num("offset", "a non-negative integer")?,
                a.num("staleness", "a non-negative integer")?,
                a.num("placement", "`host` or `gpu_side`")?,
                a.num("method", "`soap`, `qr` or `inverse_root`")?,
            );
            let root = match method {
                RefreshMethod::InverseRoot => Some(InverseRoot {
                    exponent: a.num("exponent", "a positive integer")?,
                    epsilon: a.f("epsilon")?,
                }),
                _ => None,
            };
            Op::EigenbasisRefresh {
                side,
                frequency,
                offset,
                staleness,
                placement,
                method,
                root,
            }
        }
        _ => return Err(unknown(c, op_at, "op", name, &OP_NAMES)),
    };
    a.finish()?;
    Ok(op)
}
