//! `autodiff`: reverse-mode differentiation of the forward section. Walks the forward
//! instructions in reverse program order, applies each op's gradient rule to the gradient of its
//! results, sums the contributions of values used more than once (`add`), and marks the
//! gradient of every parameter with `grad_of`. Only values that depend on a parameter get
//! gradients; the seed is d loss / d loss = 1 (folded into `cross_entropy_backward`).
use crate::{Pass, PassContext, PassError};
use ir::{Module, Op, Section, TensorType, ValueId};
use std::collections::{HashMap, HashSet};

/// The `autodiff` pass.
pub struct Autodiff;

struct Grads<'m> {
    m: &'m mut Module,
    /// Gradient contributions per forward value, in the order they were produced.
    parts: HashMap<ValueId, Vec<ValueId>>,
}

impl Grads<'_> {
    fn ty(&self, v: ValueId) -> TensorType {
        self.m.value(v).ty.clone()
    }
    fn name(&self, v: ValueId) -> String {
        self.m.value(v).name.clone()
    }
    fn bwd(&mut self, op: Op, args: &[ValueId], name: String, ty: TensorType) -> ValueId {
        self.m.push1(Section::Backward, op, args, &name, ty)
    }
    fn add_part(&mut self, v: ValueId, g: ValueId) {
        self.parts.entry(v).or_default().push(g);
    }
    /// The total gradient of `v` (summing contributions), or `None` if nothing flows into it.
    fn total(&mut self, v: ValueId, name: Option<String>) -> Option<ValueId> {
        let parts = self.parts.remove(&v)?;
        let ty = self.ty(v);
        let mut acc = parts[0];
        for (i, &p) in parts.iter().enumerate().skip(1) {
            let n = match (&name, i + 1 == parts.len()) {
                (Some(n), true) => n.clone(),
                _ => format!("d.{}.acc", self.name(v)),
            };
            acc = self.bwd(Op::Add, &[acc, p], n, ty.clone());
        }
        Some(acc)
    }
}

impl Pass for Autodiff {
    fn name(&self) -> &'static str {
        "autodiff"
    }

    fn run(&mut self, module: &mut Module, _cx: &mut PassContext) -> Result<String, PassError> {
        let forward: Vec<_> = module.section(Section::Forward).collect();
        let loss_marker = forward
            .iter()
            .find(|&&i| module.inst(i).op == Op::Loss)
            .copied();
        let Some(loss_marker) = loss_marker else {
            return Err(PassError::Invalid {
                pass: "autodiff",
                message: "no `loss` in the forward section (run expand-model first)".into(),
            });
        };
        if module.section(Section::Backward).next().is_some() {
            return Err(PassError::Invalid {
                pass: "autodiff",
                message: "module already has a backward section".into(),
            });
        }
        let loss = module.inst(loss_marker).args[0];
        let params: Vec<ValueId> = module.parameters();
        // Values that depend on a parameter (need a gradient).
        let mut active: HashSet<ValueId> = params.iter().copied().collect();
        for &i in &forward {
            let inst = module.inst(i);
            if inst.args.iter().any(|a| active.contains(a)) {
                active.extend(inst.results.iter().copied());
            }
        }
        let mut g = Grads {
            m: module,
            parts: HashMap::new(),
        };
        let mut n_rules = 0;
        for &i in forward.iter().rev() {
            let inst = g.m.inst(i).clone();
            if inst.results.is_empty() || !inst.results.iter().any(|r| active.contains(r)) {
                continue;
            }
            let out = inst.results[0];
            let dout = if out == loss {
                None
            } else {
                match g.total(out, None) {
                    Some(d) => Some(d),
                    None => continue, // does not reach the loss
                }
            };
            n_rules += 1;
            let a = &inst.args;
            let want = |v: &ValueId| active.contains(v);
            let dname = |g: &Grads, v: ValueId| format!("d.{}", g.name(v));
            match inst.op {
                Op::CrossEntropy => {
                    let d = g.bwd(
                        Op::CrossEntropyBackward,
                        &[a[0], a[1]],
                        dname(&g, a[0]),
                        g.ty(a[0]),
                    );
                    g.add_part(a[0], d);
                }
                Op::MatMul { trans_a, trans_b } => {
                    let d = dout.ok_or_else(no_grad)?;
                    let mm = |ta, tb| Op::MatMul {
                        trans_a: ta,
                        trans_b: tb,
                    };
                    // out = op(A) op(B); see the module docs for the four cases.
                    if want(&a[0]) {
                        let (op, args) = match (trans_a, trans_b) {
                            (false, false) => (mm(false, true), [d, a[1]]),
                            (false, true) => (mm(false, false), [d, a[1]]),
                            (true, false) => (mm(false, true), [a[1], d]),
                            (true, true) => (mm(true, true), [a[1], d]),
                        };
                        let da = g.bwd(op, &args, dname(&g, a[0]), g.ty(a[0]));
                        g.add_part(a[0], da);
                    }
                    if want(&a[1]) {
                        let (op, args) = match (trans_a, trans_b) {
                            (false, false) => (mm(true, false), [a[0], d]),
                            (false, true) => (mm(true, false), [d, a[0]]),
                            (true, false) => (mm(false, false), [a[0], d]),
                            (true, true) => (mm(true, true), [d, a[0]]),
                        };
                        let db = g.bwd(op, &args, dname(&g, a[1]), g.ty(a[1]));
                        g.add_part(a[1], db);
                    }
                }
                Op::BiasAdd => {
                    let d = dout.ok_or_else(no_grad)?;
                    if want(&a[0]) {
                        g.add_part(a[0], d);
                    }
                    if want(&a[1]) {
                        let db = g.bwd(Op::SumRows, &[d], dname(&g, a[1]), g.ty(a[1]));
                        g.add_part(a[1], db);
                    }
                }
                Op::Add => {
                    let d = dout.ok_or_else(no_grad)?;
                    for v in [a[0], a[1]] {
                        if want(&v) {
                            g.add_part(v, d);
                        }
                    }
                }
                Op::Gelu | Op::SwiGlu => {
                    let d = dout.ok_or_else(no_grad)?;
                    let op = if inst.op == Op::Gelu {
                        Op::GeluBackward
                    } else {
                        Op::SwiGluBackward
                    };
                    let dx = g.bwd(op, &[d, a[0]], dname(&g, a[0]), g.ty(a[0]));
                    g.add_part(a[0], dx);
                }
                Op::Rope {
                    seq_len,
                    head_dim,
                    rotated_cols,
                    theta,
                } => {
                    let d = dout.ok_or_else(no_grad)?;
                    let op = Op::RopeBackward {
                        seq_len,
                        head_dim,
                        rotated_cols,
                        theta,
                    };
                    let dx = g.bwd(op, &[d], dname(&g, a[0]), g.ty(a[0]));
                    g.add_part(a[0], dx);
                }
                Op::Attention {
                    batch,
                    seq_len,
                    n_heads,
                } => {
                    let d = dout.ok_or_else(no_grad)?;
                    let op = Op::AttentionBackward {
                        batch,
                        seq_len,
                        n_heads,
                    };
                    let dx = g.bwd(op, &[d, a[0]], dname(&g, a[0]), g.ty(a[0]));
                    g.add_part(a[0], dx);
                }
                Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
                    let d = dout.ok_or_else(no_grad)?;
                    let bias = a.len() == 3;
                    let op = match inst.op {
                        Op::LayerNorm { .. } => Op::LayerNormBackward { eps, bias },
                        _ => Op::RmsNormBackward { eps },
                    };
                    let mut results =
                        vec![(dname(&g, a[0]), g.ty(a[0])), (dname(&g, a[1]), g.ty(a[1]))];
                    if bias {
                        results.push((dname(&g, a[2]), g.ty(a[2])));
                    }
                    let (_, rs) = g.m.push(Section::Backward, op, &[d, a[0], a[1]], results);
                    for (v, r) in a.iter().zip(rs) {
                        if want(v) {
                            g.add_part(*v, r);
                        }
                    }
                }
                Op::Embedding => {
                    let d = dout.ok_or_else(no_grad)?;
                    if want(&a[0]) {
                        let dt = g.bwd(
                            Op::EmbeddingBackward,
                            &[d, a[1], a[0]],
                            dname(&g, a[0]),
                            g.ty(a[0]),
                        );
                        g.add_part(a[0], dt);
                    }
                }
                Op::AddPositional { seq_len } => {
                    let d = dout.ok_or_else(no_grad)?;
                    if want(&a[0]) {
                        g.add_part(a[0], d);
                    }
                    if want(&a[1]) {
                        let dp = g.bwd(
                            Op::AddPositionalBackward { seq_len },
                            &[d, a[1]],
                            dname(&g, a[1]),
                            g.ty(a[1]),
                        );
                        g.add_part(a[1], dp);
                    }
                }
                ref other => {
                    return Err(PassError::Invalid {
                        pass: "autodiff",
                        message: format!(
                            "no gradient rule for `{}` in the forward section",
                            other.name()
                        ),
                    })
                }
            }
        }
        let mut marked = 0;
        for p in params {
            let name = format!("grad.{}", g.name(p));
            match g.total(p, Some(name)) {
                Some(dp) => {
                    g.m.push0(Section::Backward, Op::GradOf, &[p, dp]);
                    marked += 1;
                }
                None => {
                    tracing::warn!(param = %g.name(p), "parameter does not reach the loss; it gets no gradient")
                }
            }
        }
        Ok(format!(
            "{n_rules} gradient rules applied, {marked} parameter gradients"
        ))
    }
}

fn no_grad() -> PassError {
    PassError::Invalid {
        pass: "autodiff",
        message: "internal: missing upstream gradient".into(),
    }
}
