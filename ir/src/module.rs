//! The IR container: a [`Module`] holds the run [`Config`], the values (SSA, typed, named) and the
//! instructions, kept in a petgraph `StableGraph` whose edges are def → use data dependencies,
//! plus a layout (program order) like Cranelift's `Layout`. Ids are newtypes; petgraph's
//! `NodeIndex` never appears in the API.
use crate::config::Config;
use crate::op::{Op, Section};
use crate::types::TensorType;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use std::collections::HashMap;
use std::fmt;

/// An SSA value. Prints as `%name` (its unique name in the module).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(u32);

impl ValueId {
    /// Dense index of the value (`0..module.num_values()`).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// An instruction. Prints as `inst<n>`; in dumps instructions are identified by their results.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstId(NodeIndex<u32>);

impl fmt::Display for InstId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "inst{}", self.0.index())
    }
}

/// Data of one value.
#[derive(Clone, Debug, PartialEq)]
pub struct ValueData {
    /// Unique name (without `%`).
    pub name: String,
    /// Tensor type.
    pub ty: TensorType,
    /// Defining instruction.
    pub def: InstId,
}

/// One instruction: an op applied to argument values, defining result values.
#[derive(Clone, Debug, PartialEq)]
pub struct Inst {
    /// The operation and its attributes.
    pub op: Op,
    /// Operands, in the order the op documents.
    pub args: Vec<ValueId>,
    /// Defined values.
    pub results: Vec<ValueId>,
    /// Program section.
    pub section: Section,
}

/// An IR module: one training step of one run.
#[derive(Clone, Debug)]
pub struct Module {
    /// The run configuration (model, optimizer, data, train, target).
    pub config: Config,
    graph: StableDiGraph<Inst, ValueId, u32>,
    values: Vec<ValueData>,
    names: HashMap<String, ValueId>,
    layout: Vec<InstId>,
}

impl Module {
    /// An empty module for `config`.
    pub fn new(config: Config) -> Self {
        Module {
            config,
            graph: StableDiGraph::default(),
            values: Vec::new(),
            names: HashMap::new(),
            layout: Vec::new(),
        }
    }

    /// Appends an instruction at the end of the layout. `results` gives each result's name hint
    /// and type; names are made unique by suffixing `.1`, `.2`, ... Returns the instruction and
    /// its result values. Arguments must be values of this module (checked by the verifier).
    pub fn push(
        &mut self,
        section: Section,
        op: Op,
        args: &[ValueId],
        results: Vec<(String, TensorType)>,
    ) -> (InstId, Vec<ValueId>) {
        let node = self.graph.add_node(Inst {
            op,
            args: args.to_vec(),
            results: Vec::new(),
            section,
        });
        let inst = InstId(node);
        let mut ids = Vec::with_capacity(results.len());
        for (hint, ty) in results {
            let name = self.unique_name(&hint);
            let id = ValueId(self.values.len() as u32);
            self.names.insert(name.clone(), id);
            self.values.push(ValueData {
                name,
                ty,
                def: inst,
            });
            ids.push(id);
        }
        self.graph[node].results = ids.clone();
        for &a in args {
            if let Some(v) = self.values.get(a.index()) {
                let def = v.def.0;
                self.graph.add_edge(def, node, a);
            }
        }
        self.layout.push(inst);
        (inst, ids)
    }

    /// Inserts a single-result instruction into the layout just before instruction `before`
    /// (same rules as [`Module::push`]; `fuse`'s `bf16-cast` puts a `cast` before the GEMM that
    /// first reads its result). Returns the value.
    pub fn insert1_before(
        &mut self,
        before: InstId,
        section: Section,
        op: Op,
        args: &[ValueId],
        name: &str,
        ty: TensorType,
    ) -> ValueId {
        self.insert_before(before, section, op, args, vec![(name.to_string(), ty)])
            .1[0]
    }

    /// Inserts an instruction into the layout just before instruction `before` (at the end if
    /// `before` is not in the layout); `results` as in [`Module::push`]. Returns the
    /// instruction and its result values.
    pub fn insert_before(
        &mut self,
        before: InstId,
        section: Section,
        op: Op,
        args: &[ValueId],
        results: Vec<(String, TensorType)>,
    ) -> (InstId, Vec<ValueId>) {
        let (inst, r) = self.push(section, op, args, results);
        self.layout.pop();
        let at = self
            .layout
            .iter()
            .position(|&i| i == before)
            .unwrap_or(self.layout.len());
        self.layout.insert(at, inst);
        (inst, r)
    }

    /// Appends a single-result instruction and returns its value.
    pub fn push1(
        &mut self,
        section: Section,
        op: Op,
        args: &[ValueId],
        name: &str,
        ty: TensorType,
    ) -> ValueId {
        let (_, r) = self.push(section, op, args, vec![(name.to_string(), ty)]);
        r[0]
    }

    /// Appends an instruction without results (markers, in-place updates).
    pub fn push0(&mut self, section: Section, op: Op, args: &[ValueId]) -> InstId {
        self.push(section, op, args, Vec::new()).0
    }

    fn unique_name(&self, hint: &str) -> String {
        let base: String = hint
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let base = if base.is_empty() {
            "v".to_string()
        } else {
            base
        };
        if !self.names.contains_key(&base) {
            return base;
        }
        (1..)
            .map(|i| format!("{base}.{i}"))
            .find(|n| !self.names.contains_key(n))
            .expect("invariant: an unused suffix exists")
    }

    /// Instructions in program order.
    pub fn insts(&self) -> impl Iterator<Item = InstId> + '_ {
        self.layout.iter().copied()
    }

    /// Instructions of `section` in program order.
    pub fn section(&self, section: Section) -> impl Iterator<Item = InstId> + '_ {
        self.layout
            .iter()
            .copied()
            .filter(move |&i| self.graph[i.0].section == section)
    }

    /// The instruction `id`.
    pub fn inst(&self, id: InstId) -> &Inst {
        &self.graph[id.0]
    }

    /// Mutable access to an instruction's op attributes (not its operands).
    pub fn op_mut(&mut self, id: InstId) -> &mut Op {
        &mut self.graph[id.0].op
    }

    /// Replaces instruction `id`'s op and arguments in place (a rewrite: the `fuse` pass turns
    /// a `bias_add` into the `mat_mul_bias` that defines the same value). Results (names,
    /// types) and the instruction's place in the layout stay; the def → use edges follow the
    /// new arguments. Arguments must be values of this module (checked by the verifier).
    pub fn replace_inst(&mut self, id: InstId, op: Op, args: &[ValueId]) {
        let incoming: Vec<_> = self
            .graph
            .edges_directed(id.0, petgraph::Direction::Incoming)
            .map(|e| petgraph::visit::EdgeRef::id(&e))
            .collect();
        for e in incoming {
            self.graph.remove_edge(e);
        }
        for &a in args {
            if let Some(v) = self.values.get(a.index()) {
                let def = v.def.0;
                self.graph.add_edge(def, id.0, a);
            }
        }
        let inst = &mut self.graph[id.0];
        inst.op = op;
        inst.args = args.to_vec();
    }

    /// Appends a result to instruction `id` (the `fuse` pass's `attention-saved` gives an
    /// `attention` its `lse`); `hint` is made unique as in [`Module::push`]. Returns the value.
    pub fn add_result(&mut self, id: InstId, hint: &str, ty: TensorType) -> ValueId {
        let name = self.unique_name(hint);
        let v = ValueId(self.values.len() as u32);
        self.names.insert(name.clone(), v);
        self.values.push(ValueData { name, ty, def: id });
        self.graph[id.0].results.push(v);
        v
    }

    /// Removes result `value` from instruction `id` when nothing reads it (the inverse of
    /// [`Module::add_result`]: `rematerialize` takes the `lse` back from a forward `attention`
    /// whose backward now reads a recomputed copy's). The value's id and name stay reserved; it
    /// is no longer defined. Returns whether it was removed.
    pub fn remove_unused_result(&mut self, id: InstId, value: ValueId) -> bool {
        if !self.graph[id.0].results.contains(&value) || !self.uses(value).is_empty() {
            return false;
        }
        self.graph[id.0].results.retain(|&r| r != value);
        true
    }

    /// Whether instruction `id` is (still) in the module.
    pub fn contains_inst(&self, id: InstId) -> bool {
        self.graph.contains_node(id.0)
    }

    /// Removes instruction `id` when none of its results is read (an in-place op a rewrite
    /// has replaced: `fuse`'s `soap-update` removes a composed SOAP's moments update, whose
    /// work the `soap_update` that replaces its step now does). Its results' ids and names stay
    /// reserved, no longer defined. Returns whether it was removed.
    pub fn remove_inst(&mut self, id: InstId) -> bool {
        if !self.graph.contains_node(id.0)
            || self
                .graph
                .edges_directed(id.0, petgraph::Direction::Outgoing)
                .next()
                .is_some()
        {
            return false;
        }
        self.graph.remove_node(id.0);
        self.layout.retain(|&l| l != id);
        true
    }

    /// Exchanges the names of values `a` and `b` (a rewrite that replaces a value by a new one
    /// gives the new one the old name: `fuse`'s `sum-rows-cast`).
    pub fn swap_names(&mut self, a: ValueId, b: ValueId) {
        if a == b || !self.contains_value(a) || !self.contains_value(b) {
            return;
        }
        let na = std::mem::take(&mut self.values[a.index()].name);
        let nb = std::mem::replace(&mut self.values[b.index()].name, na.clone());
        self.values[a.index()].name = nb.clone();
        self.names.insert(na, b);
        self.names.insert(nb, a);
    }

    /// Sets the element type of value `id` (its shape stays), e.g. to `bf16` for an output
    /// the `fuse` pass has its producer write in bf16.
    pub fn set_dtype(&mut self, id: ValueId, dtype: schedule::DType) {
        if let Some(v) = self.values.get_mut(id.index()) {
            v.ty.dtype = dtype;
        }
    }

    /// The value `id`.
    pub fn value(&self, id: ValueId) -> &ValueData {
        &self.values[id.index()]
    }

    /// The trainable parameters: the values of the `state parameter` instructions, in
    /// declaration order.
    pub fn parameters(&self) -> Vec<ValueId> {
        self.section(Section::State)
            .filter(|&i| {
                matches!(
                    self.inst(i).op,
                    Op::State {
                        class: crate::BufferClass::Parameter,
                        ..
                    }
                )
            })
            .map(|i| self.inst(i).results[0])
            .collect()
    }

    /// Number of values ever created.
    pub fn num_values(&self) -> usize {
        self.values.len()
    }

    /// Looks a value up by name (without `%`).
    pub fn value_by_name(&self, name: &str) -> Option<ValueId> {
        self.names.get(name).copied()
    }

    /// Whether `id` names a value of this module.
    pub fn contains_value(&self, id: ValueId) -> bool {
        id.index() < self.values.len()
    }

    /// Instructions that use `value` as an argument, in program order.
    pub fn uses(&self, value: ValueId) -> Vec<InstId> {
        let def = self.values[value.index()].def.0;
        let mut users: Vec<InstId> = self
            .graph
            .edges_directed(def, petgraph::Direction::Outgoing)
            .filter(|e| *e.weight() == value)
            .map(|e| InstId(petgraph::visit::EdgeRef::target(&e)))
            .collect();
        users.sort_by_key(|u| self.layout.iter().position(|l| l == u));
        users.dedup();
        users
    }

    /// Removes instructions whose results are all unused and that have no effects
    /// (markers, in-place ops and `State`/`Input` are kept). Returns how many were removed.
    pub fn remove_dead(&mut self) -> usize {
        let mut removed = 0;
        loop {
            let dead: Vec<InstId> = self
                .layout
                .iter()
                .copied()
                .filter(|&i| {
                    let inst = &self.graph[i.0];
                    !inst.results.is_empty()
                        && !inst.op.is_in_place()
                        && !matches!(inst.op, Op::State { .. } | Op::Input { .. })
                        && self
                            .graph
                            .edges_directed(i.0, petgraph::Direction::Outgoing)
                            .next()
                            .is_none()
                })
                .collect();
            if dead.is_empty() {
                return removed;
            }
            for d in &dead {
                self.graph.remove_node(d.0);
            }
            self.layout.retain(|l| !dead.contains(l));
            removed += dead.len();
        }
    }

    /// Display name of a value, `%name`.
    pub fn display_value(&self, id: ValueId) -> String {
        match self.values.get(id.index()) {
            Some(v) => format!("%{}", v.name),
            None => format!("%<invalid {}>", id.0),
        }
    }

    /// Crate-internal: creates a value id from a raw index (parser, tests).
    pub fn value_id_from_index(index: usize) -> ValueId {
        ValueId(index as u32)
    }
}
