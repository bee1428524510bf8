//! The text form of a [`Module`]: `Display` *is* the format, and [`crate::parse_module`] reads
//! it back (print → parse → print is the identity), so every pass dump is valid input.
//!
//! ```text
//! ; asteria IR
//! module tiny
//! config {"name":"tiny","model":{...},...}
//! state:
//!   %wte: f32[50257, 64] = state parameter normal(std = 0.02)
//!   %tokens: i32[1024] = input tokens
//! forward:
//!   %x: f32[1024, 64] = embedding %wte, %tokens
//!   loss %loss
//! optimizer:
//!   adam_w %p, %g, %m, %v {lr = 0.001, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1}
//! ```
//!
//! Instructions are printed grouped by section in execution order (`state`, `forward`,
//! `backward`, `optimizer`, `refresh`; empty sections are omitted), each section in layout
//! order. Floats use Rust's shortest round-trip form (`{:?}`), so they parse back bit-exactly.
use crate::module::{InstId, Module};
use crate::op::{InputRole, Op, Section};
use crate::verifier::VerifierError;
use schedule::{BufferClass, Init};
use std::fmt::{self, Write};

/// Text-format keyword of a buffer class (`parameter`, `exp_avg_sq`, ...).
pub(crate) fn class_keyword(class: BufferClass) -> &'static str {
    match class {
        BufferClass::Parameter => "parameter",
        BufferClass::Gradient => "gradient",
        BufferClass::Activation => "activation",
        BufferClass::Input => "input",
        BufferClass::ExpAvg => "exp_avg",
        BufferClass::ExpAvgSq => "exp_avg_sq",
        BufferClass::KroneckerFactor => "kronecker_factor",
        BufferClass::Eigenbasis => "eigenbasis",
        BufferClass::EigenvalueEstimate => "eigenvalue_estimate",
        BufferClass::InverseRoot => "inverse_root",
        BufferClass::Scalar => "scalar",
    }
}

/// Every buffer class, for the parser.
pub(crate) const CLASSES: [BufferClass; 11] = [
    BufferClass::Parameter,
    BufferClass::Gradient,
    BufferClass::Activation,
    BufferClass::Input,
    BufferClass::ExpAvg,
    BufferClass::ExpAvgSq,
    BufferClass::KroneckerFactor,
    BufferClass::Eigenbasis,
    BufferClass::EigenvalueEstimate,
    BufferClass::InverseRoot,
    BufferClass::Scalar,
];

/// Text-format keyword of an input role.
pub(crate) fn role_keyword(role: InputRole) -> &'static str {
    match role {
        InputRole::Tokens => "tokens",
        InputRole::Targets => "targets",
    }
}

/// One attribute value as printed.
pub(crate) enum Attr {
    /// A float (`{:?}`, shortest round-trip).
    F(f64),
    /// An unsigned integer.
    U(u64),
    /// A boolean.
    B(bool),
    /// An optional float (`none` when absent).
    OptF(Option<f64>),
    /// A bare word (`host`).
    W(String),
    /// A quoted string (`"(list m p)"`; never holds a `"`).
    S(String),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::F(x) | Attr::OptF(Some(x)) => write!(f, "{x:?}"),
            Attr::OptF(None) => f.write_str("none"),
            Attr::U(x) => write!(f, "{x}"),
            Attr::B(x) => write!(f, "{x}"),
            Attr::W(x) => f.write_str(x),
            Attr::S(x) => write!(f, "\"{x}\""),
        }
    }
}

/// The `{name = value, ...}` attributes of `op`, in the order they are printed. `state` and
/// `input` have none (their class / init / role are positional words).
pub(crate) fn attrs(op: &Op) -> Vec<(&'static str, Attr)> {
    use Attr::*;
    let u = |x: usize| U(x as u64);
    match *op {
        Op::AddPositional { seq_len } | Op::AddPositionalBackward { seq_len } => {
            vec![("seq_len", u(seq_len))]
        }
        Op::LayerNorm { eps } | Op::RmsNorm { eps } | Op::RmsNormBackward { eps } => {
            vec![("eps", F(eps))]
        }
        Op::LayerNormBackward { eps, bias } => vec![("eps", F(eps)), ("bias", B(bias))],
        Op::MatMul { trans_a, trans_b } | Op::MatMulBias { trans_a, trans_b } => {
            vec![("trans_a", B(trans_a)), ("trans_b", B(trans_b))]
        }
        Op::Rope {
            seq_len,
            head_dim,
            rotated_cols,
            theta,
        }
        | Op::RopeBackward {
            seq_len,
            head_dim,
            rotated_cols,
            theta,
        } => vec![
            ("seq_len", u(seq_len)),
            ("head_dim", u(head_dim)),
            ("rotated_cols", u(rotated_cols)),
            ("theta", F(theta)),
        ],
        Op::Attention {
            batch,
            seq_len,
            n_heads,
        }
        | Op::AttentionBackward {
            batch,
            seq_len,
            n_heads,
        } => {
            vec![
                ("batch", u(batch)),
                ("seq_len", u(seq_len)),
                ("n_heads", u(n_heads)),
            ]
        }
        Op::ClipGradNorm { max_norm } => vec![("max_norm", OptF(max_norm))],
        Op::AdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => vec![
            ("lr", F(lr)),
            ("beta1", F(beta1)),
            ("beta2", F(beta2)),
            ("eps", F(eps)),
            ("weight_decay", F(weight_decay)),
        ],
        Op::SoapUpdate { hyper, left, right } => vec![
            ("lr", F(hyper.lr)),
            ("beta1", F(hyper.beta1)),
            ("beta2", F(hyper.beta2)),
            ("eps", F(hyper.eps)),
            ("weight_decay", F(hyper.weight_decay)),
            ("correct_bias", B(hyper.correct_bias)),
            ("normalize_grads", B(hyper.normalize_grads)),
            ("left", B(left)),
            ("right", B(right)),
        ],
        Op::KlShampooUpdate { hyper, left, right } => vec![
            ("lr", F(hyper.lr)),
            ("beta1", F(hyper.beta1)),
            ("shampoo_beta", F(hyper.shampoo_beta)),
            ("eps", F(hyper.eps)),
            ("weight_decay", F(hyper.weight_decay)),
            ("init_factor", F(hyper.init_factor)),
            ("max_clamp_value", F(hyper.max_clamp_value)),
            ("normalize_grads", B(hyper.normalize_grads)),
            ("left", B(left)),
            ("right", B(right)),
        ],
        Op::Project { back, left, right } => {
            vec![("back", B(back)), ("left", B(left)), ("right", B(right))]
        }
        Op::BlockCopy { row, col } | Op::BlockWrite { row, col } => {
            vec![("row", U(row as u64)), ("col", U(col as u64))]
        }
        Op::ShampooUpdate { hyper } => vec![
            ("lr", F(hyper.lr)),
            ("beta1", F(hyper.beta1)),
            ("beta2", F(hyper.beta2)),
            ("epsilon", F(hyper.epsilon)),
            ("weight_decay", F(hyper.weight_decay)),
            ("use_bias_correction", B(hyper.use_bias_correction)),
            ("max_preconditioner_dim", U(hyper.max_preconditioner_dim)),
            ("grafting", B(hyper.grafting)),
            ("grafting_beta2", F(hyper.grafting_beta2)),
            ("grafting_epsilon", F(hyper.grafting_epsilon)),
        ],
        Op::ShampooFactorUpdate {
            beta2,
            use_bias_correction,
            max_preconditioner_dim,
        } => vec![
            ("beta2", F(beta2)),
            ("use_bias_correction", B(use_bias_correction)),
            ("max_preconditioner_dim", U(max_preconditioner_dim)),
        ],
        Op::ShampooPrecondition {
            max_preconditioner_dim,
        }
        | Op::Graft {
            max_preconditioner_dim,
        } => vec![("max_preconditioner_dim", U(max_preconditioner_dim))],
        Op::KlScale { eps } => vec![("eps", F(eps))],
        Op::KlFactorUpdate {
            shampoo_beta,
            init_factor,
            max_clamp_value,
            left,
            right,
        } => vec![
            ("shampoo_beta", F(shampoo_beta)),
            ("init_factor", F(init_factor)),
            ("max_clamp_value", F(max_clamp_value)),
            ("left", B(left)),
            ("right", B(right)),
        ],
        Op::SoapFactorUpdate {
            shampoo_beta,
            left,
            right,
        } => {
            vec![
                ("shampoo_beta", F(shampoo_beta)),
                ("left", B(left)),
                ("right", B(right)),
            ]
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
            let mut v = vec![
                ("side", U(side as u64)),
                ("frequency", U(frequency)),
                ("offset", U(offset)),
                ("staleness", U(staleness as u64)),
                ("placement", W(placement.to_string())),
                ("method", W(method.to_string())),
            ];
            if let Some(r) = root {
                v.extend([
                    ("exponent", U(u64::from(r.exponent))),
                    ("epsilon", F(r.epsilon)),
                ]);
            }
            v
        }
        Op::ElementwiseUpdate { ref rule } => {
            let scalars: Vec<String> = rule.scalars.iter().map(|s| s.to_string()).collect();
            let mut v = vec![
                ("optimizer", W(rule.optimizer.clone())),
                ("lr", F(rule.lr)),
                ("state", S(rule.state.join(" "))),
            ];
            if !rule.results.is_empty() {
                v.push(("results", S(rule.results.join(" "))));
            }
            if !rule.hyper.is_empty() {
                let h: Vec<String> = rule
                    .hyper
                    .iter()
                    .map(|(k, x)| format!("{k}={x:?}"))
                    .collect();
                v.push(("hyper", S(h.join(" "))));
            }
            v.extend([
                ("outputs", S(rule.outputs.join(" "))),
                ("scalars", S(scalars.join(" "))),
                ("expr", S(rule.expr.clone())),
            ]);
            v
        }
        Op::State { .. }
        | Op::Input { .. }
        | Op::Loss
        | Op::GradOf
        | Op::Embedding
        | Op::EmbeddingBackward
        | Op::BiasAdd
        | Op::SumRows
        | Op::SumRowsCast
        | Op::Add
        | Op::Cast
        | Op::Gelu
        | Op::GeluBackward
        | Op::SwiGlu
        | Op::SwiGluBackward
        | Op::CrossEntropy
        | Op::CrossEntropyBackward => Vec::new(),
    }
}

/// Whether `name` can be printed bare after `module` (otherwise it is printed as a JSON string).
pub(crate) fn is_bare_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

impl Module {
    /// Writes one instruction (without indentation or newline), e.g.
    /// `%y: f32[8, 16] = layer_norm %x, %ln.w {eps = 1e-5}`.
    fn write_inst(&self, out: &mut dyn Write, id: InstId) -> fmt::Result {
        let inst = self.inst(id);
        for (i, &r) in inst.results.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            match self.contains_value(r) {
                true => write!(out, "{sep}{}: {}", self.display_value(r), self.value(r).ty)?,
                false => write!(out, "{sep}{}: ?", self.display_value(r))?,
            }
        }
        if !inst.results.is_empty() {
            out.write_str(" = ")?;
        }
        out.write_str(inst.op.name())?;
        match inst.op {
            Op::State { class, init } => {
                write!(out, " {}", class_keyword(class))?;
                match init {
                    Init::Zeros => out.write_str(" zeros")?,
                    Init::Ones => out.write_str(" ones")?,
                    Init::Normal { std } => write!(out, " normal(std = {std:?})")?,
                    // A plan-level init (`tier-placement`'s device copies): never in the IR.
                    Init::CopyOf { of } => write!(out, " copy_of(buffer {})", of.0)?,
                }
            }
            Op::Input { role } => write!(out, " {}", role_keyword(role))?,
            _ => {}
        }
        for (i, &a) in inst.args.iter().enumerate() {
            write!(
                out,
                "{}{}",
                if i == 0 { " " } else { ", " },
                self.display_value(a)
            )?;
        }
        let attrs = attrs(&inst.op);
        for (i, (name, value)) in attrs.iter().enumerate() {
            write!(out, "{}{name} = {value}", if i == 0 { " {" } else { ", " })?;
        }
        if !attrs.is_empty() {
            out.write_str("}")?;
        }
        Ok(())
    }

    /// Writes the whole module; `errors` are printed as `; error: ...` lines under the
    /// instruction they name (module-level errors right after the header).
    fn write_text(&self, out: &mut dyn Write, errors: &[VerifierError]) -> fmt::Result {
        writeln!(out, "; asteria IR")?;
        let name = &self.config.name;
        match is_bare_name(name) {
            true => writeln!(out, "module {name}")?,
            false => writeln!(
                out,
                "module {}",
                serde_json::to_string(name).map_err(|_| fmt::Error)?
            )?,
        }
        writeln!(
            out,
            "config {}",
            serde_json::to_string(&self.config).map_err(|_| fmt::Error)?
        )?;
        for e in errors.iter().filter(|e| e.inst().is_none()) {
            writeln!(out, "; error: {e}")?;
        }
        for section in Section::ALL {
            let mut insts = self.section(section).peekable();
            if insts.peek().is_none() {
                continue;
            }
            writeln!(out, "{}:", section.keyword())?;
            for id in insts {
                out.write_str("  ")?;
                self.write_inst(out, id)?;
                out.write_char('\n')?;
                for e in errors.iter().filter(|e| e.inst() == Some(id)) {
                    writeln!(out, "  ; error: {e}")?;
                }
            }
        }
        Ok(())
    }

    /// The module's text with each verifier error printed as a `; error: ...` comment line under
    /// the instruction it names (errors about the module as a whole, such as a missing `loss`,
    /// come right after the header). The result still parses (errors are comments).
    pub fn display_with_errors(&self, errors: &[VerifierError]) -> String {
        let mut s = String::new();
        // Writing into a String only fails if the config cannot be serialized.
        if self.write_text(&mut s, errors).is_err() {
            s.push_str("\n; error: the module could not be printed (config does not serialize)\n");
        }
        s
    }

    /// One instruction as printed in the text format (without indentation), e.g.
    /// `%y: f32[8, 16] = gelu %x`. Used by verifier messages and pass logs.
    pub fn display_inst(&self, id: InstId) -> String {
        let mut s = String::new();
        let _ = self.write_inst(&mut s, id);
        s
    }
}

impl fmt::Display for Module {
    /// Prints the module in the text format of this file's header; [`crate::parse_module`]
    /// reads it back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_text(f, &[])
    }
}
