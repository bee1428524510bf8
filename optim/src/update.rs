//! Element-wise optimizer updates written once, as expressions: the language ([`Update`]),
//! the `simplify` rewrites (egg: named rules, each exact in IEEE f32 arithmetic, and constant
//! folding), the reference interpreter ([`Program`]) and the CUDA C a backend compiles from the
//! same expression ([`cuda_kernel`]).
//!
//! An update maps per-element inputs (a parameter, its gradient, its state tensors) and
//! per-step scalars (the scheduled learning rate's derived factors, bias corrections) to new
//! values of some of those tensors. All arithmetic is f32 with round-to-nearest-even, one
//! rounding per operation (no fused multiply-add): the interpreter, the folded constants and
//! the generated CUDA (`__fadd_rn`, `__fmul_rn`, ...) compute bit-identical results.
//!
//! ```text
//! (list m' v' p')                       the outputs, in the order of UpdateRule::outputs
//! (+ a b) (- a b) (* a b) (/ a b)       f32 arithmetic
//! (neg a) (sqrt a) (sign a)             sign: -1, 0 or 1 (NaN stays NaN), torch.sign's values
//! (select_lt a b x y)                   a < b ? x : y (torch.lerp's two branches)
//! 0.9  -1e-8                            f32 constants
//! g  m  lr_step                         inputs and scalars, by name
//! ```
//!
//! Optimizers written as rules are defined in [`crate::optimizers`] (their spec keys, state and
//! expression); [`adamw_rule`] is AdamW as a rule, bit-identical to [`crate::adamw_update`], the
//! measure of the generated kernels against the hand-written ones.
use egg::{
    define_language, rewrite as rw, Analysis, DidMerge, EGraph, Extractor, Id, Language, RecExpr,
    Rewrite, Runner, Symbol,
};
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::Real;

/// An f32 constant of an update expression, kept by its bits so that it is an e-graph leaf
/// (total order, hashing; `-0.0` and `0.0` are different constants).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Const(u32);

impl Const {
    /// The constant `v`.
    pub fn new(v: f32) -> Const {
        Const(v.to_bits())
    }
    /// Its value.
    pub fn get(self) -> f32 {
        f32::from_bits(self.0)
    }
}

impl fmt::Debug for Const {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.get())
    }
}

impl fmt::Display for Const {
    // Rust prints the shortest text that parses back to the same f32.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.get())
    }
}

impl FromStr for Const {
    type Err = String;
    fn from_str(s: &str) -> Result<Const, String> {
        // Only decimal numerals: `inf` or `nan` would otherwise shadow variables of that name.
        if !s.starts_with(|c: char| c.is_ascii_digit() || c == '-' || c == '.') {
            return Err(format!("`{s}` is not a number"));
        }
        s.parse::<f32>()
            .map(Const::new)
            .map_err(|e| format!("`{s}`: {e}"))
    }
}

define_language! {
    /// The update expression language (see the module docs for the semantics).
    #[allow(missing_docs)]
    pub enum Update {
        "+" = Add([Id; 2]),
        "-" = Sub([Id; 2]),
        "*" = Mul([Id; 2]),
        "/" = Div([Id; 2]),
        "neg" = Neg([Id; 1]),
        "sqrt" = Sqrt([Id; 1]),
        "sign" = Sign([Id; 1]),
        "select_lt" = SelectLt([Id; 4]),
        "list" = List(Box<[Id]>),
        Num(Const),
        Var(Symbol),
    }
}

/// torch.sign's value of `x`: -1, 0 (keeping the sign of a zero) or 1; NaN stays NaN.
fn sign<T: Real>(x: T) -> T {
    if x > T::zero() {
        T::one()
    } else if x < T::zero() {
        -T::one()
    } else {
        x
    }
}

/// The value of node `n` given its children's values (`None` for `list` and leaves), in `T`
/// (f32: the rule's semantics; f64: the same expression in double precision, for tests
/// against float64 references).
fn apply<T: Real>(n: &Update, v: impl Fn(Id) -> T) -> Option<T> {
    Some(match n {
        Update::Add([a, b]) => v(*a) + v(*b),
        Update::Sub([a, b]) => v(*a) - v(*b),
        Update::Mul([a, b]) => v(*a) * v(*b),
        Update::Div([a, b]) => v(*a) / v(*b),
        Update::Neg([a]) => -v(*a),
        Update::Sqrt([a]) => v(*a).sqrt(),
        Update::Sign([a]) => sign(v(*a)),
        Update::SelectLt([a, b, x, y]) => {
            if v(*a) < v(*b) {
                v(*x)
            } else {
                v(*y)
            }
        }
        Update::List(_) | Update::Num(_) | Update::Var(_) => return None,
    })
}

/// Constant folding: an e-class whose value is known holds that constant. Exact: the folded
/// value is the f32 operation the interpreter would perform.
#[derive(Default)]
pub struct Fold;

impl Analysis<Update> for Fold {
    type Data = Option<Const>;

    fn make(egraph: &mut EGraph<Update, Fold>, enode: &Update, _id: Id) -> Self::Data {
        if let Update::Num(c) = enode {
            return Some(*c);
        }
        if matches!(enode, Update::List(_) | Update::Var(_)) {
            return None;
        }
        // A select needs only its condition and the branch it takes.
        if let Update::SelectLt([a, b, x, y]) = enode {
            let (a, b) = (egraph[*a].data?, egraph[*b].data?);
            let taken = if a.get() < b.get() { *x } else { *y };
            return egraph[taken].data;
        }
        if enode.children().iter().any(|c| egraph[*c].data.is_none()) {
            return None;
        }
        apply::<f32>(enode, |c| egraph[c].data.map_or(f32::NAN, Const::get)).map(Const::new)
    }

    fn merge(&mut self, to: &mut Self::Data, from: Self::Data) -> DidMerge {
        egg::merge_option(to, from, |a, b| {
            // Two constants for one class would be a rule that is not exact: keep the first.
            debug_assert_eq!(a, &b, "an inexact rewrite merged two different constants");
            DidMerge(false, false)
        })
    }

    fn modify(egraph: &mut EGraph<Update, Fold>, id: Id) {
        if let Some(c) = egraph[id].data {
            let leaf = egraph.add(Update::Num(c));
            egraph.union(id, leaf);
        }
    }
}

/// The `simplify` rules, by name. Each is exact in IEEE f32 (the left and right sides give the
/// same bits for every input, the sign of zero included), which the tests check on random and
/// special inputs; reassociation and distribution are not, and are not here.
pub fn rules() -> Vec<Rewrite<Update, Fold>> {
    vec![
        rw!("mul-one"; "(* ?x 1)" => "?x"),
        rw!("mul-comm"; "(* ?a ?b)" => "(* ?b ?a)"),
        rw!("add-comm"; "(+ ?a ?b)" => "(+ ?b ?a)"),
        rw!("sub-zero"; "(- ?x 0)" => "?x"),
        rw!("div-one"; "(/ ?x 1)" => "?x"),
        rw!("neg-neg"; "(neg (neg ?x))" => "?x"),
        rw!("sub-neg"; "(- ?a (neg ?b))" => "(+ ?a ?b)"),
        rw!("add-neg"; "(+ ?a (neg ?b))" => "(- ?a ?b)"),
        rw!("mul-minus-one"; "(* ?x -1)" => "(neg ?x)"),
        rw!("div-half"; "(/ ?x 2)" => "(* ?x 0.5)"),
        rw!("div-quarter"; "(/ ?x 4)" => "(* ?x 0.25)"),
        rw!("select-same"; "(select_lt ?a ?b ?x ?x)" => "?x"),
        rw!("select-taken"; "(select_lt ?a ?b ?x ?y)" => "?x" if constant_lt("?a", "?b", true)),
        rw!("select-not-taken"; "(select_lt ?a ?b ?x ?y)" => "?y" if constant_lt("?a", "?b", false)),
    ]
}

/// Condition of the select rules: `?a` and `?b` are constants and `a < b` is `holds`.
fn constant_lt(
    a: &str,
    b: &str,
    holds: bool,
) -> impl Fn(&mut EGraph<Update, Fold>, Id, &egg::Subst) -> bool {
    let (a, b): (egg::Var, egg::Var) = (
        a.parse().expect("pattern variable"),
        b.parse().expect("pattern variable"),
    );
    move |eg, _, s| match (eg[s[a]].data, eg[s[b]].data) {
        (Some(x), Some(y)) => (x.get() < y.get()) == holds,
        _ => false,
    }
}

/// The runner's limits: iterations, e-nodes, wall time. An optimizer update has tens of nodes;
/// commutativity doubles a class at most, so these only bound a pathological expression.
pub const RUNNER_LIMITS: (usize, usize, Duration) = (16, 50_000, Duration::from_secs(1));

/// Cost of a node for extraction: the smallest expression, a constant cheaper than anything.
struct Cost;

impl egg::CostFunction<Update> for Cost {
    type Cost = usize;
    fn cost<C: FnMut(Id) -> usize>(&mut self, enode: &Update, mut costs: C) -> usize {
        let own = match enode {
            Update::Num(_) | Update::Var(_) => 1,
            Update::List(_) => 0,
            _ => 2,
        };
        enode.fold(own, |sum, id| sum + costs(id))
    }
}

/// What `simplify` did: node counts before and after, and the runner's stop reason.
#[derive(Clone, Debug)]
pub struct SimplifyReport {
    /// Nodes of the input expression (a DAG: shared subterms once).
    pub before: usize,
    /// Nodes of the simplified one.
    pub after: usize,
    /// Why the runner stopped (saturated, or a limit).
    pub stop: String,
}

/// Rewrites `expr` with [`rules`] and constant folding under [`RUNNER_LIMITS`] and extracts the
/// smallest equivalent expression (shared subterms appear once: common subexpressions).
pub fn simplify(expr: &RecExpr<Update>) -> (RecExpr<Update>, SimplifyReport) {
    let (iters, nodes, time) = RUNNER_LIMITS;
    let runner = Runner::<Update, Fold, ()>::default()
        .with_iter_limit(iters)
        .with_node_limit(nodes)
        .with_time_limit(time)
        .with_expr(expr)
        .run(&rules());
    let root = runner.roots[0];
    let (_, best) = Extractor::new(&runner.egraph, Cost).find_best(root);
    let report = SimplifyReport {
        before: expr.as_ref().len(),
        after: best.as_ref().len(),
        stop: runner
            .stop_reason
            .as_ref()
            .map_or_else(|| "not stopped".to_string(), |r| format!("{r:?}")),
    };
    (best, report)
}

/// One element-wise update: its per-element inputs, per-step scalars and the outputs it
/// writes (each the new value of one input tensor, in the order of the expression's `list`).
#[derive(Clone, Debug)]
pub struct UpdateRule {
    /// Name (kernel name suffix; letters, digits and `_`).
    pub name: String,
    /// Per-element inputs by name, e.g. `["p", "g", "m"]`.
    pub tensors: Vec<String>,
    /// Per-step scalars by name, e.g. `["lr", "decay"]`.
    pub scalars: Vec<String>,
    /// The input tensor each output overwrites, in the order of the expression's `list`.
    pub outputs: Vec<String>,
    /// `(list out0 out1 ...)` over the tensors, scalars and constants.
    pub expr: RecExpr<Update>,
}

/// Why a rule cannot be interpreted or compiled.
#[derive(Clone, Debug, PartialEq)]
pub enum RuleError {
    /// The root is not a `list` of one expression per output.
    Outputs(String),
    /// A name that is neither a tensor nor a scalar of the rule.
    Unbound(String),
    /// Operand lengths that do not match.
    Length(String),
    /// Expression text that does not parse.
    Syntax(String),
}

impl fmt::Display for RuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuleError::Outputs(s) => write!(f, "update outputs: {s}"),
            RuleError::Unbound(s) => write!(f, "update expression: unbound name `{s}`"),
            RuleError::Length(s) => write!(f, "update operands: {s}"),
            RuleError::Syntax(s) => write!(f, "update expression: {s}"),
        }
    }
}

impl std::error::Error for RuleError {}

/// Where a leaf's value comes from in a [`Program`].
#[derive(Clone, Copy, Debug)]
enum Leaf {
    Tensor(usize),
    Scalar(usize),
    Const(f32),
}

/// A rule ready to run on the host: its nodes in dependency order with their leaves resolved.
#[derive(Clone, Debug)]
pub struct Program {
    nodes: Vec<Update>,
    leaves: Vec<Option<Leaf>>,
    /// Node index of each output.
    outputs: Vec<usize>,
    /// Tensor index each output overwrites.
    targets: Vec<usize>,
    n_tensors: usize,
    n_scalars: usize,
}

impl Program {
    /// Resolves `rule`'s names.
    ///
    /// # Errors
    /// [`RuleError`] for a root that is not a `list` of one expression per output, an output
    /// that names no tensor, or an unbound name.
    pub fn new(rule: &UpdateRule) -> Result<Program, RuleError> {
        let nodes: Vec<Update> = rule.expr.as_ref().to_vec();
        let Some(Update::List(outs)) = nodes.last() else {
            return Err(RuleError::Outputs("the root must be `(list ...)`".into()));
        };
        if outs.len() != rule.outputs.len() {
            return Err(RuleError::Outputs(format!(
                "{} expressions for {} outputs",
                outs.len(),
                rule.outputs.len()
            )));
        }
        let find = |names: &[String], s: &str| names.iter().position(|n| n == s);
        let mut leaves = Vec::with_capacity(nodes.len());
        for n in &nodes {
            leaves.push(match n {
                Update::Num(c) if !c.get().is_finite() => {
                    return Err(RuleError::Syntax(format!(
                        "non-finite constant `{}`",
                        c.get()
                    )));
                }
                Update::Num(c) => Some(Leaf::Const(c.get())),
                Update::Var(s) => {
                    let s = s.as_str();
                    Some(match (find(&rule.tensors, s), find(&rule.scalars, s)) {
                        (Some(i), _) => Leaf::Tensor(i),
                        (None, Some(i)) => Leaf::Scalar(i),
                        (None, None) => return Err(RuleError::Unbound(s.to_string())),
                    })
                }
                _ => None,
            });
        }
        let targets = rule
            .outputs
            .iter()
            .map(|o| find(&rule.tensors, o).ok_or_else(|| RuleError::Unbound(o.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Program {
            outputs: outs.iter().map(|&i| usize::from(i)).collect(),
            nodes,
            leaves,
            targets,
            n_tensors: rule.tensors.len(),
            n_scalars: rule.scalars.len(),
        })
    }

    /// Runs the update in place over `tensors` (all of one length, in the rule's order) with
    /// this step's `scalars` (in the rule's order). In f32 this is the rule's semantics, the
    /// generated kernels' bit for bit; in f64 the same expression in double precision (its
    /// constants are the f32 values), for comparisons against float64 references.
    ///
    /// # Errors
    /// [`RuleError::Length`] when the counts or lengths do not match (nothing modified).
    pub fn run<T: Real>(&self, tensors: &mut [&mut [T]], scalars: &[T]) -> Result<(), RuleError> {
        if tensors.len() != self.n_tensors || scalars.len() != self.n_scalars {
            return Err(RuleError::Length(format!(
                "{} tensors and {} scalars for a rule of {} and {}",
                tensors.len(),
                scalars.len(),
                self.n_tensors,
                self.n_scalars
            )));
        }
        let n = tensors.first().map_or(0, |t| t.len());
        if tensors.iter().any(|t| t.len() != n) {
            return Err(RuleError::Length("tensors of different lengths".into()));
        }
        let mut vals = vec![T::zero(); self.nodes.len()];
        let mut out = vec![T::zero(); self.outputs.len()];
        for i in 0..n {
            for (k, node) in self.nodes.iter().enumerate() {
                vals[k] = match self.leaves[k] {
                    Some(Leaf::Tensor(t)) => tensors[t][i],
                    Some(Leaf::Scalar(s)) => scalars[s],
                    Some(Leaf::Const(c)) => T::of(f64::from(c)),
                    None => apply(node, |c| vals[usize::from(c)]).unwrap_or(T::zero()),
                };
            }
            // Every output reads the old values: write after all are computed.
            for (o, &node) in out.iter_mut().zip(&self.outputs) {
                *o = vals[node];
            }
            for (&t, &v) in self.targets.iter().zip(&out) {
                tensors[t][i] = v;
            }
        }
        Ok(())
    }
}

/// An f32 constant as exact CUDA C (its bits).
fn cuda_const(c: f32) -> String {
    format!("__int_as_float(0x{:08x})", c.to_bits())
}

/// CUDA C source of a grid-stride kernel `asteria_update_<name>` running `rule`: parameters
/// `float*` per tensor (in the rule's order; `const` when not an output), `long long n`, one
/// `float` per scalar, and, when the rule reads a gradient `g`, a nullable `const float*
/// g_scale` (the update then reads `g · *g_scale`, rounded to f32). `float4` accesses where every
/// tensor is 16-byte aligned, scalar ones for the rest. Arithmetic through the round-to-nearest intrinsics (`__fadd_rn`,
/// `__fmul_rn`, `__fdiv_rn`, `__fsqrt_rn`), so the compiler cannot contract a multiply-add: the
/// results are the interpreter's bit for bit.
///
/// # Errors
/// As [`Program::new`]; a name that is not a C identifier.
pub fn cuda_kernel(rule: &UpdateRule) -> Result<String, RuleError> {
    let prog = Program::new(rule)?;
    let ident = |s: &str| {
        !s.is_empty()
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !s.starts_with(|c: char| c.is_ascii_digit())
    };
    for s in std::iter::once(&rule.name)
        .chain(&rule.tensors)
        .chain(&rule.scalars)
    {
        if !ident(s) {
            return Err(RuleError::Unbound(format!("`{s}` is not a C identifier")));
        }
    }
    let written: Vec<bool> = (0..rule.tensors.len())
        .map(|i| prog.targets.contains(&i))
        .collect();
    let mut params = Vec::new();
    let mut one_params = Vec::new();
    for (i, t) in rule.tensors.iter().enumerate() {
        let q = if written[i] { "" } else { "const " };
        params.push(format!("{q}float* __restrict__ t_{t}"));
        one_params.push(if written[i] {
            format!("float& e_{t}")
        } else {
            format!("const float e_{t}")
        });
    }
    params.push("long long n".to_string());
    let scalar_params: Vec<String> = rule
        .scalars
        .iter()
        .map(|s| format!("float s_{s}"))
        .collect();
    params.extend(scalar_params.iter().cloned());
    // A rule over a gradient `g` reads it times a factor on the device when `g_scale` is not
    // null (a gradient clip's factor, `fuse`'s clip-into-update): the value an in-place clip
    // would have stored. Multiplying by 1 is exact, so the product is always formed.
    let scaled = rule.tensors.iter().any(|t| t == "g");
    if scaled {
        params.push("const float* __restrict__ g_scale".to_string());
    }
    one_params.extend(scalar_params);
    let mut body = String::new();
    let v = |id: Id| format!("x{}", usize::from(id));
    for (k, node) in prog.nodes.iter().enumerate() {
        let e = match (node, prog.leaves[k]) {
            (_, Some(Leaf::Tensor(t))) => format!("e_{}", rule.tensors[t]),
            (_, Some(Leaf::Scalar(s))) => format!("s_{}", rule.scalars[s]),
            (_, Some(Leaf::Const(c))) => cuda_const(c),
            (Update::Add([a, b]), None) => format!("__fadd_rn({}, {})", v(*a), v(*b)),
            (Update::Sub([a, b]), None) => format!("__fsub_rn({}, {})", v(*a), v(*b)),
            (Update::Mul([a, b]), None) => format!("__fmul_rn({}, {})", v(*a), v(*b)),
            (Update::Div([a, b]), None) => format!("__fdiv_rn({}, {})", v(*a), v(*b)),
            (Update::Neg([a]), None) => format!("-{}", v(*a)),
            (Update::Sqrt([a]), None) => format!("__fsqrt_rn({})", v(*a)),
            (Update::Sign([a]), None) => {
                let a = v(*a);
                format!("({a} > 0.0f ? 1.0f : ({a} < 0.0f ? -1.0f : {a}))")
            }
            (Update::SelectLt([a, b, x, y]), None) => {
                format!("({} < {} ? {} : {})", v(*a), v(*b), v(*x), v(*y))
            }
            (Update::List(_), None) => continue,
            _ => unreachable!("leaves are resolved by Program::new"),
        };
        body.push_str(&format!("    const float x{k} = {e};\n"));
    }
    // Every output is computed from the old values before any is written.
    for (&node, &t) in prog.outputs.iter().zip(&prog.targets) {
        body.push_str(&format!("    e_{} = x{node};\n", rule.tensors[t]));
    }
    let name = &rule.name;
    let t = &rule.tensors;
    let aligned: Vec<String> = t
        .iter()
        .map(|t| format!("(((unsigned long long)t_{t} & 15ull) == 0ull)"))
        .collect();
    let scalars: Vec<String> = rule.scalars.iter().map(|s| format!("s_{s}")).collect();
    let mut vec_loop = String::new();
    for (i, t) in t.iter().enumerate() {
        let (c, q) = match (written[i], scaled && t == "g") {
            (true, _) => ("", ""),
            (false, true) => ("const ", ""),
            (false, false) => ("const ", "const "),
        };
        vec_loop.push_str(&format!(
            "        {q}float4 a_{t} = reinterpret_cast<{c}float4*>(t_{t})[i];\n"
        ));
    }
    if scaled {
        vec_loop.push_str(
            "        a_g.x = __fmul_rn(a_g.x, gs); a_g.y = __fmul_rn(a_g.y, gs);\n        \
             a_g.z = __fmul_rn(a_g.z, gs); a_g.w = __fmul_rn(a_g.w, gs);\n",
        );
    }
    for lane in ["x", "y", "z", "w"] {
        let mut args: Vec<String> = t.iter().map(|t| format!("a_{t}.{lane}")).collect();
        args.extend(scalars.iter().cloned());
        vec_loop.push_str(&format!(
            "        asteria_rule_{name}_one({});\n",
            args.join(", ")
        ));
    }
    for (i, t) in t.iter().enumerate() {
        if written[i] {
            vec_loop.push_str(&format!(
                "        reinterpret_cast<float4*>(t_{t})[i] = a_{t};\n"
            ));
        }
    }
    let mut tail = String::new();
    for (i, t) in t.iter().enumerate() {
        let c = if written[i] { "" } else { "const " };
        if scaled && t == "g" {
            tail.push_str("        const float e_g = __fmul_rn(t_g[i], gs);\n");
        } else {
            tail.push_str(&format!("        {c}float e_{t} = t_{t}[i];\n"));
        }
    }
    let mut args: Vec<String> = t.iter().map(|t| format!("e_{t}")).collect();
    args.extend(scalars.iter().cloned());
    tail.push_str(&format!(
        "        asteria_rule_{name}_one({});\n",
        args.join(", ")
    ));
    for (i, t) in t.iter().enumerate() {
        if written[i] {
            tail.push_str(&format!("        t_{t}[i] = e_{t};\n"));
        }
    }
    Ok(format!(
        "// Generated from the `{name}` update rule (optim::update).\n\
         __device__ __forceinline__ void asteria_rule_{name}_one({one}) {{\n{body}}}\n\
         // float4 steps where every operand is 16-byte aligned, then the scalar rest; the same\n\
         // per-element arithmetic.\n\
         extern \"C\" __global__ void asteria_update_{name}({params}) {{\n    \
         const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n    \
         const long long stride = (long long)gridDim.x * blockDim.x;\n    \
         {gs}\
         const long long n4 = ({aligned}) ? n / 4 : 0;\n    \
         for (long long i = tid; i < n4; i += stride) {{\n{vec_loop}    }}\n    \
         for (long long i = 4 * n4 + tid; i < n; i += stride) {{\n{tail}    }}\n}}\n",
        one = one_params.join(", "),
        params = params.join(", "),
        gs = if scaled {
            "const float gs = g_scale != nullptr ? *g_scale : 1.0f;\n    "
        } else {
            ""
        },
        aligned = aligned.join(" && "),
    ))
}

/// Builds an expression from `text` with named holes: `$name` is replaced by the value of
/// `subs[name]` (an f32 constant).
///
/// # Errors
/// [`RuleError::Syntax`] for a hole with no value or text that does not parse.
pub fn parse_template(text: &str, subs: &HashMap<&str, f32>) -> Result<RecExpr<Update>, RuleError> {
    let mut s = text.to_string();
    // Longest names first, so that `$w1` does not eat the prefix of `$w12`.
    let mut names: Vec<&&str> = subs.keys().collect();
    names.sort_by_key(|n| std::cmp::Reverse(n.len()));
    for n in names {
        s = s.replace(&format!("${n}"), &Const::new(subs[*n]).to_string());
    }
    if let Some(at) = s.find('$') {
        let hole: String = s[at..]
            .chars()
            .take_while(|c| *c == '$' || c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        return Err(RuleError::Syntax(format!("`{hole}` has no value")));
    }
    s.parse()
        .map_err(|e| RuleError::Syntax(format!("{e}: {s}")))
}

/// [`parse_template`] of a built-in rule (whose text is known to parse).
fn parse_with(text: &str, subs: &HashMap<&str, f32>) -> RecExpr<Update> {
    parse_template(text, subs).unwrap_or_else(|e| panic!("built-in update rule: {e}"))
}

/// AdamW (PyTorch single-tensor semantics, as [`crate::adamw_update`]) as an update rule over
/// tensors `p g m v` and scalars `decay` (1 − lr·wd), `step_size` (lr / (1 − β₁ᵗ)) and
/// `bc2_sqrt` (√(1 − β₂ᵗ)), computed per step on the host in f64 and rounded to f32, as the
/// hand-written kernels do. Outputs `m v p`. `weight_decay == 0` leaves out the decay product.
pub fn adamw_rule(beta1: f64, beta2: f64, eps: f64, weight_decay: f64) -> UpdateRule {
    let subs = HashMap::from([
        ("w1", (1.0 - beta1) as f32),
        ("beta2", beta2 as f32),
        ("w2", (1.0 - beta2) as f32),
        ("eps", eps as f32),
    ]);
    let p0 = if weight_decay != 0.0 {
        "(* p decay)"
    } else {
        "p"
    };
    // torch.lerp(m, g, w1): w1 < 0.5 → m + w1·(g − m), else g − (g − m)·(1 − w1).
    let m1 = "(select_lt $w1 0.5 (+ m (* $w1 (- g m))) (- g (* (- g m) (- 1 $w1))))";
    let v1 = "(+ (* v $beta2) (* (* $w2 g) g))";
    let text = format!(
        "(list {m1} {v1} (- {p0} (* step_size (/ {m1} (+ (/ (sqrt {v1}) bc2_sqrt) $eps)))))"
    );
    UpdateRule {
        name: "adamw".into(),
        tensors: vec!["p".into(), "g".into(), "m".into(), "v".into()],
        scalars: vec!["decay".into(), "step_size".into(), "bc2_sqrt".into()],
        outputs: vec!["m".into(), "v".into(), "p".into()],
        expr: parse_with(&text, &subs),
    }
}

/// This step's scalars of [`adamw_rule`] (`decay`, `step_size`, `bc2_sqrt`, in its order) at
/// 1-based step `t` (a `powi` exponent, as [`crate::adamw_update`]'s) with scheduled
/// learning rate `lr`: each computed in f64 and rounded once to f32, as the reference does.
/// The host and CUDA AdamW kernels both take them from here.
pub fn adamw_scalars(beta1: f64, beta2: f64, weight_decay: f64, lr: f64, t: i32) -> [f32; 3] {
    [
        (1.0 - lr * weight_decay) as f32,
        (lr / (1.0 - beta1.powi(t))) as f32,
        (1.0 - beta2.powi(t)).sqrt() as f32,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (splitmix64) for test inputs.
    struct Gen(u64);
    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        /// Mostly normal-ish values, sometimes a special one (zeros of both signs, tiny,
        /// huge, infinities, NaN).
        fn f32(&mut self) -> f32 {
            const SPECIAL: [f32; 8] = [
                0.0,
                -0.0,
                1e-40,
                -1e-40,
                3e38,
                -3e38,
                f32::INFINITY,
                f32::NAN,
            ];
            let r = self.next();
            if r % 16 == 0 {
                SPECIAL[(r >> 8) as usize % SPECIAL.len()]
            } else {
                let u = (r >> 11) as f64 / (1u64 << 53) as f64;
                ((u - 0.5) * 8.0 * if r & 1 == 0 { 1.0 } else { 1e-3 }) as f32
            }
        }
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// Evaluates a one-output expression over variables `a b x y` at one point.
    fn eval1(text: &str, env: [f32; 4]) -> f32 {
        let rule = UpdateRule {
            name: "t".into(),
            tensors: vec!["a".into(), "b".into(), "x".into(), "y".into(), "o".into()],
            scalars: vec![],
            outputs: vec!["o".into()],
            expr: format!("(list {text})").parse().expect("test expression"),
        };
        let prog = Program::new(&rule).expect("program");
        let mut cols: Vec<Vec<f32>> = env.iter().map(|&e| vec![e]).collect();
        cols.push(vec![0.0]);
        let mut refs: Vec<&mut [f32]> = cols.iter_mut().map(|c| c.as_mut_slice()).collect();
        prog.run(&mut refs, &[]).expect("run");
        cols[4][0]
    }

    /// Every rule is exact: its two sides give the same bits on 4000 random and special
    /// points, the sign of zero included.
    #[test]
    fn every_simplify_rule_is_exact_in_f32() {
        let cases = [
            ("mul-one", "(* a 1)", "a"),
            ("mul-comm", "(* a b)", "(* b a)"),
            ("add-comm", "(+ a b)", "(+ b a)"),
            ("sub-zero", "(- a 0)", "a"),
            ("div-one", "(/ a 1)", "a"),
            ("neg-neg", "(neg (neg a))", "a"),
            ("sub-neg", "(- a (neg b))", "(+ a b)"),
            ("add-neg", "(+ a (neg b))", "(- a b)"),
            ("mul-minus-one", "(* a -1)", "(neg a)"),
            ("div-half", "(/ a 2)", "(* a 0.5)"),
            ("div-quarter", "(/ a 4)", "(* a 0.25)"),
            ("select-same", "(select_lt a b x x)", "x"),
            ("select-taken", "(select_lt 0.25 0.5 x y)", "x"),
            ("select-not-taken", "(select_lt 0.5 0.25 x y)", "y"),
        ];
        let names: Vec<String> = rules().iter().map(|r| r.name.to_string()).collect();
        assert_eq!(
            names,
            cases.iter().map(|c| c.0.to_string()).collect::<Vec<_>>(),
            "every rule has a case"
        );
        let mut g = Gen(7);
        for (name, lhs, rhs) in cases {
            for _ in 0..4000 {
                let env = [g.f32(), g.f32(), g.f32(), g.f32()];
                let (l, r) = (eval1(lhs, env), eval1(rhs, env));
                assert!(
                    same(l, r),
                    "{name}: {lhs} = {l:e}, {rhs} = {r:e} at {env:?}"
                );
            }
        }
    }

    /// Constant folding computes what the interpreter computes, and removes the folded nodes.
    #[test]
    fn folding_and_sharing_shrink_an_expression_without_changing_its_values() {
        let text = "(list (+ (* a (- 1 0.9)) (* (/ b 2) (select_lt 0.1 0.5 x y))) \
                    (* (+ (* a (- 1 0.9)) 0) 1))";
        let expr: RecExpr<Update> = text.parse().expect("parse");
        let (best, report) = simplify(&expr);
        assert!(report.after < report.before, "{report:?}");
        // (- 1 0.9) is folded and the select resolved; the shared product appears once.
        let s = best.to_string();
        assert!(!s.contains("select_lt") && !s.contains("0.9 "), "{s}");
        let mk = |e: &RecExpr<Update>| UpdateRule {
            name: "t".into(),
            tensors: ["a", "b", "x", "y", "o", "q"].map(String::from).to_vec(),
            scalars: vec![],
            outputs: vec!["o".into(), "q".into()],
            expr: e.clone(),
        };
        let (p0, p1) = (
            Program::new(&mk(&expr)).expect("p0"),
            Program::new(&mk(&best)).expect("p1"),
        );
        let mut g = Gen(11);
        for _ in 0..2000 {
            let env: Vec<f32> = (0..4).map(|_| g.f32()).collect();
            let run = |p: &Program| {
                let mut cols: Vec<Vec<f32>> = env.iter().map(|&e| vec![e]).collect();
                cols.extend([vec![0.0], vec![0.0]]);
                let mut refs: Vec<&mut [f32]> = cols.iter_mut().map(|c| c.as_mut_slice()).collect();
                p.run(&mut refs, &[]).expect("run");
                (cols[4][0], cols[5][0])
            };
            let (a, b) = (run(&p0), run(&p1));
            assert!(same(a.0, b.0) && same(a.1, b.1), "{env:?}: {a:?} vs {b:?}");
        }
    }

    /// The AdamW rule, simplified and interpreted, is the hand-written host AdamW bit for bit
    /// over 25 steps of random awkward-sized tensors, with and without weight decay, for β₁
    /// on both sides of torch.lerp's branch.
    #[test]
    fn the_adamw_rule_is_the_hand_written_adamw_bit_for_bit() {
        for (beta1, wd) in [(0.9, 0.1), (0.3, 0.0), (0.95, 0.01)] {
            let hp = crate::AdamWParams {
                lr: 3e-4,
                beta1,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: wd,
            };
            let rule = adamw_rule(hp.beta1, hp.beta2, hp.eps, hp.weight_decay);
            let (expr, _) = simplify(&rule.expr);
            let prog = Program::new(&UpdateRule { expr, ..rule }).expect("program");
            let n = 1037;
            let mut g = Gen(3);
            let mut normal = || ((g.next() >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32;
            let mut p: Vec<f32> = (0..n).map(|_| normal()).collect();
            let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
            let (mut p2, mut m2, mut v2) = (p.clone(), m.clone(), v.clone());
            for t in 1..=25u64 {
                let mut grad: Vec<f32> = (0..n).map(|_| normal()).collect();
                crate::adamw_update(t, &hp, &mut p, &grad, &mut m, &mut v).expect("adamw");
                let ti = t as i32;
                let scalars = [
                    (1.0 - hp.lr * hp.weight_decay) as f32,
                    (hp.lr / (1.0 - hp.beta1.powi(ti))) as f32,
                    (1.0 - hp.beta2.powi(ti)).sqrt() as f32,
                ];
                let mut refs: Vec<&mut [f32]> = vec![&mut p2, &mut grad, &mut m2, &mut v2];
                prog.run(&mut refs, &scalars).expect("run");
            }
            for (a, b) in p
                .iter()
                .zip(&p2)
                .chain(m.iter().zip(&m2))
                .chain(v.iter().zip(&v2))
            {
                assert_eq!(a.to_bits(), b.to_bits(), "beta1 {beta1} wd {wd}");
            }
        }
    }

    /// A Lion-shaped rule (tensors `p g m`, scalars `decay lr`, outputs `m p`).
    fn lion_rule(beta1: f64, beta2: f64) -> UpdateRule {
        let subs = HashMap::from([("b1", beta1 as f32), ("b2", beta2 as f32)]);
        UpdateRule {
            name: "lion".into(),
            tensors: vec!["p".into(), "g".into(), "m".into()],
            scalars: vec!["decay".into(), "lr".into()],
            outputs: vec!["m".into(), "p".into()],
            expr: parse_with(
                "(list (+ (* $b2 m) (* (- 1 $b2) g)) \
                 (- (* p decay) (* lr (sign (+ (* $b1 m) (* (- 1 $b1) g))))))",
                &subs,
            ),
        }
    }

    #[test]
    fn templates_with_unfilled_holes_are_errors() {
        let subs = HashMap::from([("a", 1.0f32)]);
        assert!(matches!(
            parse_template("(list (+ m $a) (* p $b))", &subs),
            Err(RuleError::Syntax(s)) if s.contains("$b")
        ));
        assert!(matches!(
            parse_template("(list (+ m", &subs),
            Err(RuleError::Syntax(_))
        ));
    }

    #[test]
    fn bad_rules_are_errors_not_panics() {
        let mut r = lion_rule(0.9, 0.99);
        r.scalars.pop();
        assert_eq!(
            Program::new(&r).unwrap_err(),
            RuleError::Unbound("lr".into())
        );
        let mut r = lion_rule(0.9, 0.99);
        r.outputs.push("g".into());
        assert!(matches!(Program::new(&r), Err(RuleError::Outputs(_))));
        let prog = Program::new(&lion_rule(0.9, 0.99)).expect("program");
        let (mut a, mut b, mut c) = (vec![0.0f32; 3], vec![0.0f32; 2], vec![0.0f32; 3]);
        let mut refs: Vec<&mut [f32]> = vec![&mut a, &mut b, &mut c];
        assert!(matches!(
            prog.run(&mut refs, &[1.0, 1.0]),
            Err(RuleError::Length(_))
        ));
        let mut r = lion_rule(0.9, 0.99);
        r.name = "bad name".into();
        assert!(cuda_kernel(&r).is_err());
    }

    #[test]
    fn the_cuda_kernel_names_every_operand_and_uses_no_contractible_arithmetic() {
        let rule = adamw_rule(0.9, 0.95, 1e-8, 0.1);
        let (expr, _) = simplify(&rule.expr);
        let src = cuda_kernel(&UpdateRule { expr, ..rule }).expect("kernel");
        assert!(
            src.contains("extern \"C\" __global__ void asteria_update_adamw("),
            "{src}"
        );
        for p in [
            "float* __restrict__ t_p",
            "const float* __restrict__ t_g",
            "float s_step_size",
        ] {
            assert!(src.contains(p), "{p}: {src}");
        }
        let body: Vec<&str> = src
            .lines()
            .filter(|l| l.contains("const float x"))
            .collect();
        assert!(body.len() > 10, "{src}");
        for l in &body {
            assert!(
                !l.contains(" + ") && !l.contains(" * ") && !l.contains(" / "),
                "plain operator: {l}"
            );
        }
        for out in ["e_m = ", "e_v = ", "e_p = ", "t_p[i] = e_p", "= a_p;"] {
            assert!(src.contains(out), "{out}: {src}");
        }
        assert!(
            !src.contains("t_g[i] = ") && !src.contains("(t_g)[i] ="),
            "{src}"
        );
    }
}
