//! `liveness`: an analysis. For every value: its class, size in bytes and live range (program
//! positions of its definition and last use over the whole step: state → forward → backward →
//! optimizer → refresh). Summarizes bytes per class (parameters, gradients, activations, each
//! kind of optimizer state) and the peak of simultaneously live step-local tensors
//! (activations, gradients, inputs, scalars) — the memory a buffer-reusing allocator needs.
use crate::{Pass, PassContext, PassError};
use ir::{BufferClass, Module, ValueId};
use std::collections::BTreeMap;
use std::fmt::Write;

/// Live range and size of one value.
#[derive(Clone, Debug, PartialEq)]
pub struct ValueLiveness {
    /// The value.
    pub value: ValueId,
    /// What it holds.
    pub class: BufferClass,
    /// Size in bytes.
    pub bytes: usize,
    /// Program position (index in the layout) of the definition.
    pub def: usize,
    /// Program position of the last use (`def` if unused). Persistent state lives across steps.
    pub last_use: usize,
}

/// Result of the liveness analysis.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Liveness {
    /// Per value, in value order.
    pub values: Vec<ValueLiveness>,
    /// Total bytes per class name (`parameter`, `gradient`, `activation`, `exp_avg`, ...).
    pub bytes_per_class: BTreeMap<&'static str, usize>,
    /// Peak bytes of simultaneously live step-local values (everything but parameters and
    /// optimizer state).
    pub peak_step_bytes: usize,
    /// Instructions per section name.
    pub ops_per_section: BTreeMap<&'static str, usize>,
}

/// Snake-case name of a buffer class, as in the plan JSON.
pub fn class_name(c: BufferClass) -> &'static str {
    match c {
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

/// Whether a class lives across steps (parameters and optimizer state).
pub fn is_persistent(c: BufferClass) -> bool {
    matches!(
        c,
        BufferClass::Parameter
            | BufferClass::ExpAvg
            | BufferClass::ExpAvgSq
            | BufferClass::KroneckerFactor
            | BufferClass::Eigenbasis
            | BufferClass::EigenvalueEstimate
            | BufferClass::InverseRoot
    )
}

/// Runs the analysis on `module`.
pub fn analyze(module: &Module) -> Liveness {
    let classes = codegen::classify_values(module);
    let order: Vec<_> = module.insts().collect();
    let mut def = vec![usize::MAX; module.num_values()];
    let mut last = vec![0usize; module.num_values()];
    let mut ops_per_section = BTreeMap::new();
    for (pos, &i) in order.iter().enumerate() {
        let inst = module.inst(i);
        *ops_per_section.entry(inst.section.keyword()).or_insert(0) += 1;
        for r in &inst.results {
            def[r.index()] = pos;
            last[r.index()] = pos;
        }
        for a in &inst.args {
            last[a.index()] = last[a.index()].max(pos);
        }
    }
    let mut out = Liveness {
        ops_per_section,
        ..Default::default()
    };
    let mut delta = vec![0i64; order.len() + 1];
    for (idx, &d) in def.iter().enumerate() {
        if d == usize::MAX {
            continue; // removed instruction's value
        }
        let v = Module::value_id_from_index(idx);
        let class = classes[idx];
        let bytes = module.value(v).ty.size_bytes();
        *out.bytes_per_class.entry(class_name(class)).or_insert(0) += bytes;
        if !is_persistent(class) {
            delta[d] += bytes as i64;
            delta[last[idx] + 1] -= bytes as i64;
        }
        out.values.push(ValueLiveness {
            value: v,
            class,
            bytes,
            def: d,
            last_use: last[idx],
        });
    }
    let mut live = 0i64;
    for d in delta {
        live += d;
        out.peak_step_bytes = out.peak_step_bytes.max(live.max(0) as usize);
    }
    out
}

/// Formats a byte count with binary units.
pub fn human_bytes(b: usize) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{x:.2} {}", units[u])
    }
}

impl Liveness {
    /// Human-readable summary as `;` comment lines (appended to `--print-after liveness`).
    pub fn report(&self, module: &Module) -> String {
        let mut s = String::from("; liveness: bytes per class\n");
        for (c, b) in &self.bytes_per_class {
            let _ = writeln!(s, ";   {c:<17} {:>14} B  ({})", b, human_bytes(*b));
        }
        let _ = writeln!(
            s,
            "; peak live step-local bytes: {} ({})",
            self.peak_step_bytes,
            human_bytes(self.peak_step_bytes)
        );
        let _ = writeln!(s, "; live ranges (def..last_use, program positions):");
        for v in &self.values {
            let _ = writeln!(
                s,
                ";   {} {} {}..{} {} B",
                module.display_value(v.value),
                class_name(v.class),
                v.def,
                v.last_use,
                v.bytes
            );
        }
        s
    }
}

/// The `liveness` pass (analysis only; the module is unchanged).
pub struct LivenessPass;

impl Pass for LivenessPass {
    fn name(&self) -> &'static str {
        "liveness"
    }
    fn run(&mut self, module: &mut Module, cx: &mut PassContext) -> Result<String, PassError> {
        let l = analyze(module);
        let total: usize = l.bytes_per_class.values().sum();
        let summary = format!(
            "{} values, {} total, peak step-local {}",
            l.values.len(),
            human_bytes(total),
            human_bytes(l.peak_step_bytes)
        );
        cx.liveness = Some(l);
        Ok(summary)
    }
    fn dump_extra(&self, module: &Module, cx: &PassContext) -> Option<String> {
        cx.liveness.as_ref().map(|l| l.report(module))
    }
}
