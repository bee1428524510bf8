//! The `fuse` pass's e-graph side: the [`Dataflow`] language, the named rewrite rules
//! (`bias-epilogue`, `attention-saved`) with their conditions, the runner limits and the
//! extraction cost. `fuse.rs` builds the terms from the IR and maps the extracted ones back.
use super::FuseTarget;
use egg::{
    define_language, CostFunction, EGraph, Id, Language, Pattern, Rewrite, Subst, Symbol, Var,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

define_language! {
    /// The dataflow terms the fusion rules rewrite: `(mat_mul trans_a trans_b a b)`,
    /// `(mat_mul_bias trans_a trans_b a b bias)`, `(bias_add x bias)`, `(attention g qkv)`,
    /// `(attention_backward g dout qkv)`, `(attention_backward_saved g dout qkv fwd)` (`fwd`:
    /// the forward whose output and statistics it reads), and the leaves `true` / `false` (a
    /// GEMM's transpose flags), `%name` (an IR value the rules treat as opaque) and
    /// `#b<B>.t<T>.h<NH>` (an attention's geometry), with the semantics of the IR ops of the
    /// same names.
    #[allow(missing_docs)]
    pub enum Dataflow {
        "mat_mul" = MatMul([Id; 4]),
        "mat_mul_bias" = MatMulBias([Id; 5]),
        "bias_add" = BiasAdd([Id; 2]),
        "attention" = Attention([Id; 2]),
        "attention_backward" = AttentionBackward([Id; 3]),
        "attention_backward_saved" = AttentionBackwardSaved([Id; 4]),
        Flag(bool),
        Value(Symbol),
    }
}

/// The geometry leaf of an attention: `#b<batch>.t<seq_len>.h<n_heads>`.
pub fn geometry(batch: usize, seq_len: usize, n_heads: usize) -> Symbol {
    Symbol::from(format!("#b{batch}.t{seq_len}.h{n_heads}"))
}

/// The runner's limits: iterations, e-nodes, wall time. One rule over disjoint matches
/// saturates in two iterations; the limits only bound a pathological module.
pub const RUNNER_LIMITS: (usize, usize, Duration) = (8, 200_000, Duration::from_secs(2));

/// Shapes `[rows, cols]` of the 2-D values the rules' conditions look at, by leaf symbol.
pub type Shapes = Arc<HashMap<Symbol, (usize, usize)>>;

/// The value leaf of e-class `id` (every e-class a rule variable binds to a value holds one).
fn leaf(egraph: &EGraph<Dataflow, ()>, id: Id) -> Option<Symbol> {
    egraph[id].nodes.iter().find_map(|n| match n {
        Dataflow::Value(s) => Some(*s),
        _ => None,
    })
}

/// The flag leaf of e-class `id`.
fn flag(egraph: &EGraph<Dataflow, ()>, id: Id) -> Option<bool> {
    egraph[id].nodes.iter().find_map(|n| match n {
        Dataflow::Flag(f) => Some(*f),
        _ => None,
    })
}

/// The fusion rewrite rules for `target`; `shapes` gives the `[rows, cols]` of the values the
/// conditions look at. Errors only if a pattern does not parse (a compiler bug).
pub fn rules(target: FuseTarget, shapes: Shapes) -> Result<Vec<Rewrite<Dataflow, ()>>, String> {
    let lhs: Pattern<Dataflow> = "(bias_add (mat_mul ?ta ?tb ?a ?b) ?bias)"
        .parse()
        .map_err(|e| format!("bias-epilogue lhs: {e}"))?;
    let rhs: Pattern<Dataflow> = "(mat_mul_bias ?ta ?tb ?a ?b ?bias)"
        .parse()
        .map_err(|e| format!("bias-epilogue rhs: {e}"))?;
    let var = |s: &str| s.parse::<Var>().map_err(|e| format!("variable {s}: {e}"));
    let (a, b, tb) = (var("?a")?, var("?b")?, var("?tb")?);
    let bf16 = target.bf16_gemms;
    // Under bf16 GEMMs: rows of a and b a multiple of 8 bf16 (16 bytes), the f32 output's a
    // multiple of 4. Otherwise no condition.
    let aligned = move |eg: &mut EGraph<Dataflow, ()>, _: Id, s: &Subst| {
        if !bf16 {
            return true;
        }
        let shape = |v: Var| leaf(eg, s[v]).and_then(|sym| shapes.get(&sym).copied());
        match (shape(a), shape(b), flag(eg, s[tb])) {
            (Some((_, ac)), Some((br, bc)), Some(trans_b)) => {
                let out_cols = if trans_b { br } else { bc };
                ac % 8 == 0 && bc % 8 == 0 && out_cols % 4 == 0
            }
            _ => false,
        }
    };
    let applier = egg::ConditionalApplier {
        condition: aligned,
        applier: rhs,
    };
    let mut rules = vec![Rewrite::new("bias-epilogue", lhs, applier)?];
    if target.bf16_attention {
        let lhs: Pattern<Dataflow> = "(attention_backward ?g ?dout ?qkv)"
            .parse()
            .map_err(|e| format!("attention-saved lhs: {e}"))?;
        let rhs: Pattern<Dataflow> = "(attention_backward_saved ?g ?dout ?qkv (attention ?g ?qkv))"
            .parse()
            .map_err(|e| format!("attention-saved rhs: {e}"))?;
        let (g, qkv) = (var("?g")?, var("?qkv")?);
        // Only where the forward of the same qkv and geometry is in the e-graph.
        let has_forward = move |eg: &mut EGraph<Dataflow, ()>, _: Id, s: &Subst| {
            eg.lookup(Dataflow::Attention([s[g], s[qkv]])).is_some()
        };
        let applier = egg::ConditionalApplier {
            condition: has_forward,
            applier: rhs,
        };
        rules.push(Rewrite::new("attention-saved", lhs, applier)?);
    }
    Ok(rules)
}

/// Extraction cost: kernel passes (one per op node, two for an `attention_backward` that
/// reruns its forward's score pass; leaves are free).
pub struct KernelCost;

impl CostFunction<Dataflow> for KernelCost {
    type Cost = usize;
    fn cost<C>(&mut self, enode: &Dataflow, mut costs: C) -> usize
    where
        C: FnMut(Id) -> usize,
    {
        let own = match enode {
            Dataflow::Flag(_) | Dataflow::Value(_) => 0,
            Dataflow::AttentionBackward(_) => 2,
            _ => 1,
        };
        enode.fold(own, |sum, id| sum + costs(id))
    }
}
