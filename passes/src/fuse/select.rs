//! Instruction selection for composed optimizer steps, the `fuse` rules `soap-update`,
//! `shampoo-update` and `kl-shampoo-update`: `expand-optimizer` writes every second-order step
//! as a composition of IR ops around update rules (`optim::optimizers`); where a chain matches
//! the hand-written op's semantics exactly (the same rules as `expand-optimizer` writes them,
//! before or after `simplify`, consecutive in the optimizer section), its step rule becomes
//! that op (`soap_update`, `shampoo_update`, `kl_shampoo_update`) and the rest of the chain
//! goes. Steps left composed are reported with the reason.
use super::{invalid, Fuse};
use crate::PassError;
use ir::{Module, Op, Section, ValueId};
use std::collections::HashMap;

/// The rule `expr` becomes after `simplify` (the pass runs before `fuse`).
fn simplified(mut rule: schedule::ElementwiseRule) -> Option<schedule::ElementwiseRule> {
    let expr: egg::RecExpr<optim::update::Update> = rule.expr.parse().ok()?;
    rule.expr = optim::update::simplify(&expr).0.to_string();
    Some(rule)
}

/// The parts of one composed SOAP step (`optim::optimizers::soap`) that `soap-update`
/// replaces.
struct SoapChain {
    hyper: ir::SoapHyper,
    /// `[param, grad, exp_avg, exp_avg_sq]`, then the bases.
    args: Vec<ValueId>,
    left: bool,
    right: bool,
    /// The moments `elementwise_update`.
    moments: ir::InstId,
}

/// `(moments, step)` rules of one set of SOAP hyperparameters, each as `expand-optimizer`
/// writes it and as `simplify` leaves it; memoized by the hyperparameters' bits (a blocked
/// model has thousands of steps of a few distinct sets).
type SoapRules = [Vec<schedule::ElementwiseRule>; 2];

/// Whether `g` is the gradient of parameter `p` (a `grad_of` marker), or the same block of it
/// (`block_copy` at the same place of a parameter and its gradient).
fn is_grad_of(m: &Module, p: ValueId, g: ValueId) -> bool {
    let (dp, dg) = (m.inst(m.value(p).def), m.inst(m.value(g).def));
    if let (Op::BlockCopy { row, col }, Op::BlockCopy { row: r, col: c }) = (&dp.op, &dg.op) {
        return (row, col) == (r, c) && is_grad_of(m, dp.args[0], dg.args[0]);
    }
    m.uses(p)
        .iter()
        .any(|&i| m.inst(i).op == Op::GradOf && m.inst(i).args == [p, g])
}

/// Whether `v` is a `state` buffer of class `class`.
fn is_state(m: &Module, v: ValueId, class: ir::BufferClass) -> bool {
    matches!(m.inst(m.value(v).def).op, Op::State { class: c, .. } if c == class)
}

impl Fuse {
    /// Matches the composed SOAP step whose last op (the step rule) is `step`: `project` the
    /// parameter's gradient, the moments rule over its `exp_avg` and `exp_avg_sq` (result `u`),
    /// `project` `u` back with the same bases, the step rule — consecutive in the layout (so
    /// nothing between them sees the state half-updated), each intermediate read only by the
    /// next op, both rules exactly `optim::optimizers::soap::rules` of the hyperparameters they
    /// carry (as written or after `simplify`); a parameter with no rotated side has only the two
    /// rules. `Err` says why a SOAP step rule did not match; `Ok(None)` for other ops.
    fn soap_chain(
        m: &Module,
        step: ir::InstId,
        layout: &HashMap<ir::InstId, usize>,
        cache: &mut HashMap<[u64; 7], SoapRules>,
    ) -> Result<Option<SoapChain>, String> {
        use optim::optimizers::soap;
        let inst = m.inst(step);
        let Op::ElementwiseUpdate { rule } = &inst.op else {
            return Ok(None);
        };
        if rule.optimizer != soap::NAME || !rule.results.is_empty() || inst.args.len() != 2 {
            return Ok(None);
        }
        let hyper = soap::hyper_of(rule).ok_or("the step rule carries no SOAP hyperparameters")?;
        let key = [
            hyper.lr.to_bits(),
            hyper.beta1.to_bits(),
            hyper.beta2.to_bits(),
            hyper.eps.to_bits(),
            hyper.weight_decay.to_bits(),
            u64::from(hyper.correct_bias),
            u64::from(hyper.normalize_grads),
        ];
        let rules = match cache.get(&key) {
            Some(r) => r.clone(),
            None => {
                let (raw_moments, raw_step) = soap::rules(&hyper).map_err(|e| e.to_string())?;
                let unparsable = "a regenerated rule does not parse";
                let r: SoapRules = [
                    vec![
                        simplified(raw_moments.clone()).ok_or(unparsable)?,
                        raw_moments,
                    ],
                    vec![simplified(raw_step.clone()).ok_or(unparsable)?, raw_step],
                ];
                cache.insert(key, r.clone());
                r
            }
        };
        let [want_moments, want_step] = &rules;
        if !want_step.contains(rule) {
            return Err("the step rule is not SOAP's for its hyperparameters".into());
        }
        let (p, dir) = (inst.args[0], inst.args[1]);
        let only_reader = |v: ValueId, reader: ir::InstId| m.uses(v) == [reader];
        if !only_reader(dir, step) {
            return Err(format!("{} has other readers", m.display_value(dir)));
        }
        // The rotation back, if any: its bases.
        let dir_def = m.value(dir).def;
        let (u, back) = match m.inst(dir_def).op {
            Op::Project {
                back: true,
                left,
                right,
            } => (m.inst(dir_def).args[0], Some((dir_def, left, right))),
            _ => (dir, None),
        };
        let moments = m.value(u).def;
        let mi = m.inst(moments);
        match &mi.op {
            Op::ElementwiseUpdate { rule } if want_moments.contains(rule) => {}
            _ => {
                return Err(format!(
                    "{} is not SOAP's moments update",
                    m.display_value(u)
                ))
            }
        }
        if mi.args.len() != 4 || mi.args[0] != p || mi.results != [u] {
            return Err("the moments update is not of the step's parameter".into());
        }
        if !is_state(m, mi.args[2], ir::BufferClass::ExpAvg)
            || !is_state(m, mi.args[3], ir::BufferClass::ExpAvgSq)
        {
            return Err("the moments update's state is not an exp_avg and an exp_avg_sq".into());
        }
        if !only_reader(u, back.map_or(step, |b| b.0)) {
            return Err(format!("{} has other readers", m.display_value(u)));
        }
        let g_eig = mi.args[1];
        let mut chain = vec![moments];
        let (grad, left, right, bases) = match back {
            None => (g_eig, false, false, vec![]),
            Some((back_id, left, right)) => {
                let def = m.value(g_eig).def;
                let fwd = m.inst(def);
                let same = matches!(fwd.op, Op::Project { back: false, left: l, right: r }
                    if (l, r) == (left, right));
                let bases = m.inst(back_id).args[1..].to_vec();
                if !same || fwd.args[1..] != bases[..] || !only_reader(g_eig, moments) {
                    return Err(format!(
                        "{} is not the gradient rotated into the same bases",
                        m.display_value(g_eig)
                    ));
                }
                chain.insert(0, def);
                chain.push(back_id);
                (fwd.args[0], left, right, bases)
            }
        };
        if !is_grad_of(m, p, grad) {
            return Err(format!(
                "{} is not the gradient of {}",
                m.display_value(grad),
                m.display_value(p)
            ));
        }
        chain.push(step);
        let at = |i: ir::InstId| layout.get(&i).copied();
        let first = at(chain[0]).ok_or("internal: an op of the chain is not in the layout")?;
        if chain
            .iter()
            .enumerate()
            .any(|(k, &i)| at(i) != Some(first + k))
        {
            return Err("its ops are not consecutive (another op runs between them)".into());
        }
        let mut args = vec![p, grad, mi.args[2], mi.args[3]];
        args.extend(bases);
        Ok(Some(SoapChain {
            hyper,
            args,
            left,
            right,
            moments,
        }))
    }
}

/// The parts of one composed Shampoo step (`optim::optimizers::shampoo`) that
/// `shampoo-update` replaces.
struct ShampooChain {
    hyper: ir::ShampooHyper,
    /// `[param, grad, exp_avg]`, `graft_sq` with grafting, then `(factor, root)` pairs.
    args: Vec<ValueId>,
    /// The in-place ops that go: the factor update and the moments update.
    in_place: [ir::InstId; 2],
}

/// `(moments, step)` rules of one set of Shampoo hyperparameters, as written and simplified.
type ShampooRules = [Vec<schedule::ElementwiseRule>; 2];

impl Fuse {
    /// Matches the composed Shampoo step whose last op (the step rule) is `step`:
    /// `shampoo_factor_update` of the parameter's gradient, the moments rule over its
    /// `exp_avg` (and `graft_sq`) with results `Ḡ` (and the grafting step), `shampoo_precondition`
    /// of `Ḡ`, `graft` (with grafting), the step rule — consecutive in the layout, each
    /// intermediate read only by the next op, both rules exactly
    /// `optim::optimizers::shampoo::rules` of the hyperparameters they carry (as written or
    /// after `simplify`), every op of the same block size. `Err` says why a Shampoo step rule
    /// did not match; `Ok(None)` for other ops.
    fn shampoo_chain(
        m: &Module,
        step: ir::InstId,
        (order, layout): (&[ir::InstId], &HashMap<ir::InstId, usize>),
        cache: &mut HashMap<Vec<u64>, ShampooRules>,
    ) -> Result<Option<ShampooChain>, String> {
        use optim::optimizers::shampoo;
        let inst = m.inst(step);
        let Op::ElementwiseUpdate { rule } = &inst.op else {
            return Ok(None);
        };
        if rule.optimizer != shampoo::NAME || !rule.results.is_empty() || inst.args.len() != 2 {
            return Ok(None);
        }
        let h =
            shampoo::hyper_of(rule).ok_or("the step rule carries no Shampoo hyperparameters")?;
        let key: Vec<u64> = rule
            .hyper
            .iter()
            .map(|x| x.1.to_bits())
            .chain([h.lr.to_bits()])
            .collect();
        let rules = match cache.get(&key) {
            Some(r) => r.clone(),
            None => {
                let (raw_moments, raw_step) = shampoo::rules(&h).map_err(|e| e.to_string())?;
                let raw_moments = raw_moments.ok_or("β₁ = 0: no moments rule to fuse")?;
                let unparsable = "a regenerated rule does not parse";
                let r: ShampooRules = [
                    vec![
                        simplified(raw_moments.clone()).ok_or(unparsable)?,
                        raw_moments,
                    ],
                    vec![simplified(raw_step.clone()).ok_or(unparsable)?, raw_step],
                ];
                cache.insert(key, r.clone());
                r
            }
        };
        let [want_moments, want_step] = &rules;
        if !want_step.contains(rule) {
            return Err("the step rule is not Shampoo's for its hyperparameters".into());
        }
        let b = h.max_preconditioner_dim;
        let (p, dir) = (inst.args[0], inst.args[1]);
        let only_reader = |v: ValueId, reader: ir::InstId| m.uses(v) == [reader];
        let def_of = |v: ValueId| m.value(v).def;
        let mut chain = vec![step];
        if !only_reader(dir, step) {
            return Err(format!("{} has other readers", m.display_value(dir)));
        }
        // The grafting op, if any, and the preconditioning.
        let (pre, pg) = match (&m.inst(def_of(dir)).op, h.grafting) {
            (
                Op::Graft {
                    max_preconditioner_dim,
                },
                true,
            ) if *max_preconditioner_dim == b => {
                let gi = m.inst(def_of(dir));
                chain.insert(0, def_of(dir));
                (gi.args[0], Some((gi.args[1], def_of(dir))))
            }
            (_, true) => {
                return Err(format!(
                    "{} is not a `graft` of the same blocks",
                    m.display_value(dir)
                ))
            }
            (_, false) => (dir, None),
        };
        let pre_id = def_of(pre);
        let pi = m.inst(pre_id);
        if !matches!(pi.op, Op::ShampooPrecondition { max_preconditioner_dim } if max_preconditioner_dim == b)
        {
            return Err(format!(
                "{} is not a `shampoo_precondition` of the same blocks",
                m.display_value(pre)
            ));
        }
        if !only_reader(pre, chain[0]) {
            return Err(format!("{} has other readers", m.display_value(pre)));
        }
        chain.insert(0, pre_id);
        let gbar = pi.args[0];
        let roots = pi.args[1..].to_vec();
        let moments = def_of(gbar);
        let mi = m.inst(moments);
        match &mi.op {
            Op::ElementwiseUpdate { rule } if want_moments.contains(rule) => {}
            _ => {
                return Err(format!(
                    "{} is not Shampoo's moments update",
                    m.display_value(gbar)
                ))
            }
        }
        let want_results = match pg {
            Some((pg, _)) => vec![gbar, pg],
            None => vec![gbar],
        };
        let n_state = 1 + usize::from(h.grafting);
        if mi.args.len() != 2 + n_state || mi.args[0] != p || mi.results != want_results {
            return Err("the moments update is not of the step's parameter".into());
        }
        if !is_state(m, mi.args[2], ir::BufferClass::ExpAvg)
            || (h.grafting && !is_state(m, mi.args[3], ir::BufferClass::ExpAvgSq))
        {
            return Err("the moments update's state is not an exp_avg (and a graft_sq)".into());
        }
        if !only_reader(gbar, pre_id) || pg.is_some_and(|(v, graft)| !only_reader(v, graft)) {
            return Err("the moments update's results have other readers".into());
        }
        chain.insert(0, moments);
        let grad = mi.args[1];
        if !is_grad_of(m, p, grad) {
            return Err(format!(
                "{} is not the gradient of {}",
                m.display_value(grad),
                m.display_value(p)
            ));
        }
        // The factor update: the op before the moments update.
        let at = |i: ir::InstId| layout.get(&i).copied();
        let first = at(moments).ok_or("internal: an op of the chain is not in the layout")?;
        let factor_update = first
            .checked_sub(1)
            .and_then(|k| order.get(k).copied())
            .filter(|&i| m.contains_inst(i))
            .ok_or("no `shampoo_factor_update` right before the moments update")?;
        let fi = m.inst(factor_update);
        let same_factors = matches!(fi.op, Op::ShampooFactorUpdate { beta2, use_bias_correction, max_preconditioner_dim }
            if beta2 == h.beta2 && use_bias_correction == h.use_bias_correction && max_preconditioner_dim == b);
        if !same_factors || fi.args.first() != Some(&grad) || fi.args.len() != roots.len() + 1 {
            return Err(
                "the op before the moments update is not the factor update of the same gradient \
                 and hyperparameters"
                    .into(),
            );
        }
        chain.insert(0, factor_update);
        if chain
            .iter()
            .enumerate()
            .any(|(k, &i)| at(i) != Some(first - 1 + k))
        {
            return Err("its ops are not consecutive (another op runs between them)".into());
        }
        let mut args = vec![p, grad, mi.args[2]];
        if h.grafting {
            args.push(mi.args[3]);
        }
        args.extend(fi.args[1..].iter().zip(&roots).flat_map(|(&f, &r)| [f, r]));
        Ok(Some(ShampooChain {
            hyper: h,
            args,
            in_place: [factor_update, moments],
        }))
    }
}

/// The parts of one composed KL-Shampoo step (`optim::optimizers::kl_shampoo`) that
/// `kl-shampoo-update` replaces.
struct KlChain {
    hyper: ir::KlShampooHyper,
    left: bool,
    right: bool,
    /// `kl_shampoo_update`'s operands.
    args: Vec<ValueId>,
    /// The in-place ops that go: the momentum update and the factor update.
    in_place: [ir::InstId; 2],
}

impl Fuse {
    /// Matches the composed KL-Shampoo step whose step rule is `step`: the momentum rule over
    /// the parameter's gradient and `exp_avg` (result: the new momentum), `project` into the
    /// bases, `kl_scale`, `project` back with the same bases (no projections when neither side
    /// has a basis), the step rule, then `kl_factor_update` of the same gradient, estimates and
    /// bases — consecutive, each intermediate read only by the next op, both rules exactly
    /// `optim::optimizers::kl_shampoo::rules` of the hyperparameters they carry (as written or
    /// after `simplify`). `Err` says why a KL-Shampoo step rule did not match; `Ok(None)` for
    /// other ops.
    fn kl_chain(
        m: &Module,
        step: ir::InstId,
        (order, layout): (&[ir::InstId], &HashMap<ir::InstId, usize>),
        cache: &mut HashMap<Vec<u64>, ShampooRules>,
    ) -> Result<Option<KlChain>, String> {
        use optim::optimizers::kl_shampoo;
        let inst = m.inst(step);
        let Op::ElementwiseUpdate { rule } = &inst.op else {
            return Ok(None);
        };
        if rule.optimizer != kl_shampoo::NAME || !rule.results.is_empty() || inst.args.len() != 2 {
            return Ok(None);
        }
        let h = kl_shampoo::hyper_of(rule)
            .ok_or("the step rule carries no KL-Shampoo hyperparameters")?;
        let key: Vec<u64> = rule
            .hyper
            .iter()
            .map(|x| x.1.to_bits())
            .chain([h.lr.to_bits()])
            .collect();
        let rules = match cache.get(&key) {
            Some(r) => r.clone(),
            None => {
                let (raw_momentum, raw_step) = kl_shampoo::rules(&h).map_err(|e| e.to_string())?;
                let unparsable = "a regenerated rule does not parse";
                let r: ShampooRules = [
                    vec![
                        simplified(raw_momentum.clone()).ok_or(unparsable)?,
                        raw_momentum,
                    ],
                    vec![simplified(raw_step.clone()).ok_or(unparsable)?, raw_step],
                ];
                cache.insert(key, r.clone());
                r
            }
        };
        let [want_momentum, want_step] = &rules;
        if !want_step.contains(rule) {
            return Err("the step rule is not KL-Shampoo's for its hyperparameters".into());
        }
        let (p, u) = (inst.args[0], inst.args[1]);
        let only_reader = |v: ValueId, reader: ir::InstId| m.uses(v) == [reader];
        let def_of = |v: ValueId| m.value(v).def;
        if !only_reader(u, step) {
            return Err(format!("{} has other readers", m.display_value(u)));
        }
        let mut chain = vec![step];
        // The rotation back, if any.
        let (y, back) = match m.inst(def_of(u)).op {
            Op::Project {
                back: true,
                left,
                right,
            } => {
                chain.insert(0, def_of(u));
                (
                    m.inst(def_of(u)).args[0],
                    Some((left, right, m.inst(def_of(u)).args[1..].to_vec())),
                )
            }
            _ => (u, None),
        };
        let scale = def_of(y);
        let si = m.inst(scale);
        if !matches!(si.op, Op::KlScale { eps } if eps == h.eps) || !only_reader(y, chain[0]) {
            return Err(format!(
                "{} is not the `kl_scale` of this step",
                m.display_value(y)
            ));
        }
        chain.insert(0, scale);
        let (x, eig_left, eig_right) = (si.args[0], si.args[1], si.args[2]);
        let (mom, (left, right), bases) = match back {
            None => (x, (false, false), vec![]),
            Some((left, right, bases)) => {
                let fwd = m.inst(def_of(x));
                let same = matches!(fwd.op, Op::Project { back: false, left: l, right: r }
                    if (l, r) == (left, right));
                if !same || fwd.args[1..] != bases[..] || !only_reader(x, scale) {
                    return Err(format!(
                        "{} is not the momentum rotated into the same bases",
                        m.display_value(x)
                    ));
                }
                chain.insert(0, def_of(x));
                (fwd.args[0], (left, right), bases)
            }
        };
        let momentum = def_of(mom);
        let mi = m.inst(momentum);
        match &mi.op {
            Op::ElementwiseUpdate { rule } if want_momentum.contains(rule) => {}
            _ => {
                return Err(format!(
                    "{} is not KL-Shampoo's momentum update",
                    m.display_value(mom)
                ))
            }
        }
        if mi.args.len() != 3
            || mi.args[0] != p
            || mi.results != [mom]
            || !only_reader(mom, chain[0])
        {
            return Err("the momentum update is not of the step's parameter".into());
        }
        if !is_state(m, mi.args[2], ir::BufferClass::ExpAvg) {
            return Err("the momentum update's state is not an exp_avg".into());
        }
        let grad = mi.args[1];
        if !is_grad_of(m, p, grad) {
            return Err(format!(
                "{} is not the gradient of {}",
                m.display_value(grad),
                m.display_value(p)
            ));
        }
        chain.insert(0, momentum);
        // The factor update: the op after the step.
        let at = |i: ir::InstId| layout.get(&i).copied();
        let first = at(momentum).ok_or("internal: an op of the chain is not in the layout")?;
        let factor_update = order
            .get(first + chain.len())
            .copied()
            .filter(|&i| m.contains_inst(i))
            .ok_or("no `kl_factor_update` right after the step")?;
        let fi = m.inst(factor_update);
        let same = matches!(fi.op, Op::KlFactorUpdate { shampoo_beta, init_factor, max_clamp_value, left: l, right: r }
            if shampoo_beta == h.shampoo_beta && init_factor == h.init_factor
                && max_clamp_value == h.max_clamp_value && (l, r) == (left, right));
        let fbases: Vec<ValueId> = fi
            .args
            .get(3..)
            .unwrap_or_default()
            .chunks(2)
            .filter_map(|fq| fq.get(1).copied())
            .collect();
        if !same || fi.args.get(..3) != Some(&[grad, eig_left, eig_right][..]) || fbases != bases {
            return Err(
                "the op after the step is not the factor update of the same gradient, estimates, \
                 bases and hyperparameters"
                    .into(),
            );
        }
        chain.push(factor_update);
        if chain
            .iter()
            .enumerate()
            .any(|(k, &i)| at(i) != Some(first + k))
        {
            return Err("its ops are not consecutive (another op runs between them)".into());
        }
        let mut args = vec![p, grad, mi.args[2], eig_left, eig_right];
        args.extend(&fi.args[3..]);
        Ok(Some(KlChain {
            hyper: h,
            left,
            right,
            args,
            in_place: [momentum, factor_update],
        }))
    }
}

/// A matched composed step: the hand-written op that replaces its step rule, the op's
/// operands, and the chain's in-place ops that go with it (its other ops have results only
/// the chain read, which `remove_dead` takes).
struct Selected {
    op: Op,
    args: Vec<ValueId>,
    in_place: Vec<ir::InstId>,
}

/// The optimizer section's ops in order and their positions in it, as the section was before
/// any rewrite: a rewrite removes only ops of its own chain, which no other chain interleaves
/// (chains are consecutive), so the positions of every later chain's ops stay consecutive.
type Layout<'a> = (&'a [ir::InstId], &'a HashMap<ir::InstId, usize>);

/// Instruction selection for composed optimizer steps (`soap-update`, `shampoo-update`,
/// `kl-shampoo-update`): `matcher` looks at every op of the optimizer section (`Ok(None)`:
/// not a step rule of its optimizer; `Err`: one that did not match, and why); each match's
/// step rule becomes the hand-written op and the rest of its chain goes. Returns the number of
/// rewrites and the `(parameter, why)` of the steps left composed.
///
/// # Errors
/// An internal error if a matched in-place op cannot be removed (it would then run as well as
/// the hand-written op).
fn select_composed(
    m: &mut Module,
    rule: &str,
    matcher: &mut dyn FnMut(&Module, ir::InstId, Layout<'_>) -> Result<Option<Selected>, String>,
) -> Result<(usize, Vec<(String, String)>), PassError> {
    let steps: Vec<ir::InstId> = m.section(Section::Optimizer).collect();
    let layout: HashMap<ir::InstId, usize> =
        steps.iter().enumerate().map(|(k, &i)| (i, k)).collect();
    let (mut rewrites, mut blocked) = (0, Vec::new());
    for &step in &steps {
        if !m.contains_inst(step) {
            continue;
        }
        match matcher(m, step, (&steps, &layout)) {
            Ok(None) => {}
            Err(why) => blocked.push((m.display_value(m.inst(step).args[0]), why)),
            Ok(Some(c)) => {
                m.replace_inst(step, c.op, &c.args);
                m.remove_dead();
                for id in c.in_place {
                    if !m.remove_inst(id) {
                        return Err(invalid(format!(
                            "internal: {rule} could not remove an op of the step of {}",
                            m.display_value(c.args[0])
                        )));
                    }
                }
                m.remove_dead();
                rewrites += 1;
            }
        }
    }
    Ok((rewrites, blocked))
}

impl Fuse {
    /// `soap-update`, `shampoo-update` and `kl-shampoo-update` (every target): each composed
    /// step becomes its hand-written op (`soap_update`: one pass over the moments between the
    /// projections' GEMMs; `shampoo_update`, `kl_shampoo_update`: their GEMMs and kernels) in
    /// the step rule's place.
    ///
    /// # Errors
    /// As [`select_composed`].
    pub(super) fn composed_updates(&mut self, m: &mut Module) -> Result<(), PassError> {
        let target = m.config.target.clone();
        let skip_soap = !self.applies("soap-update", &target);
        let skip_shampoo = !self.applies("shampoo-update", &target);
        let skip_kl = !self.applies("kl-shampoo-update", &target);
        let mut cache = HashMap::new();
        let (n, blocked) = select_composed(m, "soap-update", &mut |m, step, (_, layout)| {
            if skip_soap {
                return Ok(None);
            }
            Ok(
                Fuse::soap_chain(m, step, layout, &mut cache)?.map(|c| Selected {
                    op: Op::SoapUpdate {
                        hyper: c.hyper,
                        left: c.left,
                        right: c.right,
                    },
                    args: c.args,
                    in_place: vec![c.moments],
                }),
            )
        })?;
        (self.report.soap_updates, self.report.soap_blocked) = (n, blocked);
        let mut cache = HashMap::new();
        let (n, blocked) = select_composed(m, "shampoo-update", &mut |m, step, layout| {
            if skip_shampoo {
                return Ok(None);
            }
            Ok(
                Fuse::shampoo_chain(m, step, layout, &mut cache)?.map(|c| Selected {
                    op: Op::ShampooUpdate { hyper: c.hyper },
                    args: c.args,
                    in_place: c.in_place.to_vec(),
                }),
            )
        })?;
        (self.report.shampoo_updates, self.report.shampoo_blocked) = (n, blocked);
        let mut cache = HashMap::new();
        let (n, blocked) = select_composed(m, "kl-shampoo-update", &mut |m, step, layout| {
            if skip_kl {
                return Ok(None);
            }
            Ok(
                Fuse::kl_chain(m, step, layout, &mut cache)?.map(|c| Selected {
                    op: Op::KlShampooUpdate {
                        hyper: c.hyper,
                        left: c.left,
                        right: c.right,
                    },
                    args: c.args,
                    in_place: c.in_place.to_vec(),
                }),
            )
        })?;
        (
            self.report.kl_shampoo_updates,
            self.report.kl_shampoo_blocked,
        ) = (n, blocked);
        Ok(())
    }
}
