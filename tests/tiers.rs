//! Offload tiers on the CPU engine (`target cpu { memory = … host_memory = … nvme = "DIR"
//! nvme_memory = … }`): the `tier-placement` pass moves optimizer moments off the device when
//! the `memory` budget cannot hold them, `prefetch-insertion` adds the copies, and the CPU
//! engine keeps the moved state in its host store or its checksummed NVMe file:
//! - a tiered run is bit-identical to the untiered run of the same spec (AdamW, SOAP and Lion,
//!   host tier and NVMe tier), and its planned device arenas fit the budget;
//! - (`tests/tiers_nvme.rs`: a truncated or byte-flipped NVMe file stops the step with a clear
//!   error, and a training run keeps its newest checkpoint);
//! - a budget no placement can meet is a compile error naming the largest consumers;
//! - the plan verifier refuses a tiered plan whose copies were tampered with.
mod tiers_common;
use engine::{CpuEngine, EngineOptions};
use ir::config::*;
use passes::PassError;
use schedule::{ArenaKind, Budgets, Op, Plan};
use tiers_common::*;

type Named = Vec<(String, Vec<f64>)>;

/// Losses, parameters and moments (read through `CpuEngine::buffer`, from their tier when
/// offloaded) after `steps` steps; an offloaded moment also survives a `set_buffer` round trip.
fn train(plan: Plan, steps: u64) -> (Vec<f64>, Named, Named) {
    let (x, y) = batch(&plan);
    let names: Vec<String> = plan
        .buffers
        .iter()
        .filter(|b| b.name.ends_with(".exp_avg") || b.name.ends_with(".exp_avg_sq"))
        .map(|b| b.name.clone())
        .collect();
    let offloaded: Vec<String> = plan
        .buffers
        .iter()
        .enumerate()
        .filter(|(i, _)| {
            plan.memory
                .tier(schedule::BufferId(*i as u32))
                .is_some_and(|k| !k.on_device())
        })
        .map(|(_, b)| b.name.clone())
        .collect();
    let mut e = engine(plan);
    let losses = (1..=steps)
        .map(|t| step(&mut e, &x, &y, t).expect("step"))
        .collect();
    let moments: Named = names
        .iter()
        .map(|n| (n.clone(), e.buffer(n).expect("moment")))
        .collect();
    for n in &offloaded {
        let v = e.buffer(n).expect("offloaded buffer");
        let doubled: Vec<f64> = v.iter().map(|x| 2.0 * x).collect();
        e.set_buffer(n, &doubled).expect("set offloaded");
        assert_eq!(e.buffer(n).expect("read back"), doubled, "{n}");
        e.set_buffer(n, &v).expect("restore");
        assert!(
            e.set_buffer(n, &v[1..]).is_err(),
            "{n}: a short write is refused"
        );
    }
    (losses, e.params(), moments)
}

/// The plan `compile` gives under the smallest device budget, in 64 KiB steps below `need`,
/// that compiles (every tensor the pass may move has left), verified and within its budget.
fn smallest_budget_plan(
    need: u64,
    compile: impl Fn(Budgets) -> Result<Plan, Box<PassError>>,
) -> Plan {
    let mut budget = need;
    let mut last = None;
    while let Ok(p) = compile(Budgets {
        device: Some(budget - (64 << 10)),
        ..Default::default()
    }) {
        budget -= 64 << 10;
        last = Some(p);
    }
    let plan = last.expect("some budget below the need compiles");
    plan.verify().expect("verifies");
    assert!(plan.memory.device_bytes() as u64 <= budget);
    plan
}

/// Copies in and out of the backward and optimizer programs (`copy-hoisting` moves some
/// copies in into the backward).
fn copies(plan: &Plan) -> (usize, usize) {
    let n = |name| {
        plan.backward
            .iter()
            .chain(&plan.optimizer)
            .filter(|o| o.name() == name)
            .count()
    };
    (n("copy_in"), n("copy_out"))
}

#[test]
fn a_tiered_run_is_bit_identical_to_the_untiered_run() {
    let dir = tempfile::tempdir_in(std::env::temp_dir()).expect("tempdir");
    // Copies in that `copy-hoisting` issued during the backward, over all these plans.
    let mut hoisted = 0;
    for opt in [
        Opt::AdamW,
        Opt::Soap,
        Opt::Lion,
        Opt::KlShampoo,
        Opt::Shampoo,
        Opt::SoapBlocked,
    ] {
        let soap = matches!(opt, Opt::Soap | Opt::SoapBlocked);
        let plain = compile(config(opt, Budgets::default())).expect("untiered");
        assert_eq!(copies(&plain), (0, 0));
        let device = budget_below(opt, 2 * MIB);
        let host_only = Budgets {
            device: Some(device),
            ..Default::default()
        };
        let with_nvme = Budgets {
            device: Some(device),
            host: Some(MIB),
            nvme_dir: Some(dir.path().display().to_string()),
            nvme: Some(64 * MIB),
            ..Default::default()
        };
        let (l0, p0, m0) = train(plain, 5);
        assert!(l0[4] < l0[0], "{opt:?}: the loss falls: {l0:?}");
        for (budgets, nvme) in [(host_only, false), (with_nvme, true)] {
            let plan = compile(config(opt, budgets)).expect("tiered plan");
            plan.verify().expect("verifies");
            let m = &plan.memory;
            assert!(m.device_bytes() as u64 <= device, "{opt:?}: device fits");
            assert!(
                m.arena_bytes(ArenaKind::Host) > 0,
                "{opt:?}: host tier used"
            );
            assert_eq!(m.arena_bytes(ArenaKind::Nvme) > 0, nvme, "{opt:?}");
            let (ins, outs) = copies(&plan);
            assert!(ins > 0 && ins == outs, "{opt:?}: {ins} in, {outs} out");
            hoisted += plan
                .backward
                .iter()
                .filter(|o| matches!(o, schedule::Op::CopyIn { .. }))
                .count();
            if soap {
                // Some moved moment is re-projected by a refresh swap.
                let swapped = plan.host_tasks.iter().any(|t| {
                    t.operands().iter().any(|(f, id)| {
                        f.starts_with("exp_avg") && m.tier(*id).is_some_and(|k| !k.on_device())
                    })
                });
                assert!(swapped, "nvme {nvme}: a refresh's moments are offloaded");
            }
            let (l, p, mo) = train(plan, 5);
            assert_eq!(l, l0, "{opt:?}, nvme {nvme}: losses");
            assert_eq!(p, p0, "{opt:?}, nvme {nvme}: parameters");
            assert_eq!(mo, m0, "{opt:?}, nvme {nvme}: moments");
        }
    }
    // The bits above include runs whose moments come in during the backward.
    assert!(hoisted > 0, "no copy in was issued during the backward");
    // The NVMe file is removed with its engine.
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
}

/// Gradients that the backward writes and only the optimizer reads leave the device when the
/// moments are not enough (ZeRO-Offload's streaming): the backward sums each one's squares into the
/// clip's partials and copies it to pinned host memory after its last write; the optimizer
/// brings it back, scales it by the clip's factor and updates. The run is bit-identical to the
/// untiered one, with the in-place clip (SOAP, Lion) and with the clip fused into the update
/// (AdamW's `grad_scale`).
#[test]
fn gradients_streamed_to_host_memory_keep_the_run_bit_identical() {
    for opt in [Opt::AdamW, Opt::Soap, Opt::Lion] {
        let plain = compile(config(opt, Budgets::default())).expect("untiered");
        let need = plain.memory.device_bytes() as u64;
        let (l0, p0, m0) = train(plain, 5);
        // The largest budget (in 64 KiB steps below the need) at which gradients leave.
        let mut budget = need;
        let plan = loop {
            budget -= 64 << 10;
            let b = Budgets {
                device: Some(budget),
                ..Default::default()
            };
            match compile(config(opt, b)) {
                Ok(p) if p.backward.iter().any(|o| matches!(o, Op::CopyOut { .. })) => break p,
                Ok(_) => {}
                Err(e) => panic!("{opt:?}: no placement streamed gradients before: {e}"),
            }
        };
        plan.verify().expect("verifies");
        assert!(plan.memory.device_bytes() as u64 <= budget, "{opt:?}: fits");
        let n = |ops: &[Op], name: &str| ops.iter().filter(|o| o.name() == name).count();
        let grads_out = n(&plan.backward, "copy_out");
        let clip_grads = plan.params.len();
        assert_eq!(n(&plan.backward, "grad_sum_squares"), clip_grads, "{opt:?}");
        let clip = plan
            .optimizer
            .iter()
            .find(|o| o.name() == "clip_grad_norm")
            .expect("clip");
        assert!(
            matches!(clip, Op::ClipGradNorm { grads, partials: Some(_), scale: Some(_), .. } if grads.is_empty()),
            "{opt:?}: the clip reads partials: {clip:?}"
        );
        // Each streamed gradient comes back once; none is written back from the optimizer.
        let ins_of_grads = plan
            .optimizer
            .iter()
            .filter(|o| matches!(o, Op::CopyIn { src, .. } if plan.buffer(*src).name.ends_with(".host")))
            .count();
        assert_eq!(ins_of_grads, grads_out, "{opt:?}");
        let (l, p, m) = train(plan, 5);
        assert_eq!(l, l0, "{opt:?}: losses");
        assert_eq!(p, p0, "{opt:?}: parameters");
        assert_eq!(m, m0, "{opt:?}: moments");
    }
}

/// When the moments and the gradients are not enough, SOAP's Kronecker factors and eigenbases
/// leave the device too (pinned host memory only): the optimizer program stages each once a
/// step (a factor in and out around its accumulation, a basis in only: the step reads it), and
/// the refreshes read and write them where they live. The run is bit-identical to the
/// untiered one with synchronous refreshes (the reference path) and with refreshes in the
/// background (S = 2: snapshots at launch, installs later).
#[test]
fn kronecker_factors_and_eigenbases_in_host_memory_keep_the_run_bit_identical() {
    for (staleness, synchronous) in [(0u32, true), (2, false)] {
        let cfg = |budgets: Budgets| {
            let mut c = config(Opt::Soap, budgets);
            if let TargetConfig::Cpu { staleness: s, .. } = &mut c.target {
                *s = staleness;
            }
            // Installs at exactly S steps after launch: the same bases at the same steps in
            // every run.
            c.train.refresh_swap = ir::RefreshSwap::Deadline;
            c
        };
        let run = |plan: Plan| {
            let opts = EngineOptions {
                threads: Some(2),
                synchronous_refresh: synchronous,
                ..EngineOptions::default()
            };
            let (x, y) = batch(&plan);
            let mut e = CpuEngine::<f32>::new(plan, opts).expect("engine");
            let losses: Vec<f64> = (1..=6)
                .map(|t| step(&mut e, &x, &y, t).expect("step"))
                .collect();
            (losses, e.params())
        };
        let plain = compile(cfg(Budgets::default())).expect("untiered");
        let need = plain.memory.device_bytes() as u64;
        let (l0, p0) = run(plain);
        let refresh_state = |p: &Plan| -> Vec<String> {
            p.buffers
                .iter()
                .enumerate()
                .filter(|(i, b)| {
                    matches!(
                        b.class,
                        schedule::BufferClass::KroneckerFactor | schedule::BufferClass::Eigenbasis
                    ) && p.memory.tier(schedule::BufferId(*i as u32)) == Some(ArenaKind::Host)
                })
                .map(|(_, b)| b.name.clone())
                .collect()
        };
        // The smallest budget (64 KiB steps below the need) that compiles: every factor and
        // basis the pass may move has left.
        let plan = smallest_budget_plan(need, |b| compile(cfg(b)));
        let kinds: Vec<schedule::BufferClass> = plan
            .buffers
            .iter()
            .filter(|b| refresh_state(&plan).contains(&b.name))
            .map(|b| b.class)
            .collect();
        assert!(
            kinds.contains(&schedule::BufferClass::KroneckerFactor)
                && kinds.contains(&schedule::BufferClass::Eigenbasis),
            "{kinds:?}"
        );
        // Everything cheaper went first: every moment and gradient that can move has.
        let moved = refresh_state(&plan);
        for name in &moved {
            let id = schedule::BufferId(
                plan.buffers
                    .iter()
                    .position(|b| &b.name == name)
                    .expect("buffer") as u32,
            );
            let home = |o: &Op| matches!(o, Op::CopyIn { src, .. } if *src == id);
            assert_eq!(
                plan.optimizer.iter().filter(|o| home(o)).count(),
                1,
                "{name}: staged once a step"
            );
            let written_back = plan
                .optimizer
                .iter()
                .any(|o| matches!(o, Op::CopyOut { dst, .. } if *dst == id));
            assert_eq!(
                written_back,
                plan.buffer(id).class == schedule::BufferClass::KroneckerFactor,
                "{name}: a factor is written back, a basis is only read"
            );
        }
        // A refresh reads a factor or writes a basis in host memory.
        assert!(
            plan.host_tasks
                .iter()
                .any(|t| t
                    .operands()
                    .iter()
                    .any(|(f, id)| matches!(*f, "factor" | "basis")
                        && plan.memory.tier(*id) == Some(ArenaKind::Host))),
            "{moved:?}"
        );
        eprintln!(
            "S = {staleness}: {} of the factors and bases in host memory",
            moved.len()
        );
        let (l, p) = run(plan);
        assert_eq!(l, l0, "S = {staleness}: losses ({moved:?} in host memory)");
        assert_eq!(p, p0, "S = {staleness}: parameters");
    }
}

/// Last of all, parameters (master weights) leave the device: pinned host memory only, read
/// through a staging buffer of each program that reads them (a copy in before the forward's
/// first use, another in the backward where it reads them, a third in the optimizer program,
/// whose update is the one copied back). At the smallest budget that compiles, the run is
/// bit-identical to the untiered one for AdamW and SOAP (losses, parameters, moments).
#[test]
fn parameters_in_host_memory_keep_the_run_bit_identical() {
    for opt in [Opt::AdamW, Opt::Soap] {
        let plain = compile(config(opt, Budgets::default())).expect("untiered");
        let need = plain.memory.device_bytes() as u64;
        let (l0, p0, m0) = train(plain, 4);
        let plan = smallest_budget_plan(need, |b| compile(config(opt, b)));
        let moved: Vec<schedule::BufferId> = plan
            .params
            .iter()
            .map(|p| p.param)
            .filter(|&id| plan.memory.tier(id) == Some(ArenaKind::Host))
            .collect();
        assert!(!moved.is_empty(), "{opt:?}: no parameter left the device");
        for &id in &moved {
            let name = &plan.buffer(id).name;
            let ins = |ops: &[Op]| {
                ops.iter()
                    .filter(|o| matches!(o, Op::CopyIn { src, .. } if *src == id))
                    .count()
            };
            let reads = |ops: &[Op]| {
                ops.iter().any(|o| {
                    !matches!(o, Op::CopyIn { .. } | Op::CopyOut { .. })
                        && o.operands().iter().any(|&(_, b)| b == id)
                })
            };
            // Every use reads a staging buffer; each program that used it copies it in once.
            for (prog, ops) in [
                ("forward", &plan.forward),
                ("backward", &plan.backward),
                ("optimizer", &plan.optimizer),
            ] {
                assert!(!reads(ops), "{opt:?}: {name} read in place in the {prog}");
            }
            assert_eq!(ins(&plan.forward), 1, "{opt:?}: {name} in the forward");
            assert_eq!(ins(&plan.optimizer), 1, "{opt:?}: {name} in the optimizer");
            assert!(ins(&plan.backward) <= 1, "{opt:?}: {name} in the backward");
            let outs = plan
                .step_ops()
                .filter(|(_, o)| matches!(o, Op::CopyOut { dst, .. } if *dst == id))
                .count();
            assert_eq!(
                outs, 1,
                "{opt:?}: {name} written back once, by the optimizer"
            );
        }
        eprintln!("{opt:?}: {} parameter(s) in host memory", moved.len());
        // The CPU engine's working store holds neither the offloaded state nor, between
        // steps, its staging copies (allocated by each copy in, freed after the last use).
        let working = |plan: &Plan| {
            let (x, y) = batch(plan);
            let mut e = engine(plan.clone());
            step(&mut e, &x, &y, 1).expect("a step");
            e.working_bytes()
        };
        let plain_plan = compile(config(opt, Budgets::default())).expect("untiered");
        let offloaded: usize = (0..plan.buffers.len())
            .map(|i| schedule::BufferId(i as u32))
            .filter(|&id| plan.memory.tier(id).is_some_and(|k| !k.on_device()))
            .filter(|&id| {
                plain_plan
                    .buffers
                    .iter()
                    .any(|b| b.name == plan.buffer(id).name)
            })
            .map(|id| plan.buffer(id).size_bytes())
            .sum();
        let (w0, w) = (working(&plain_plan), working(&plan));
        assert!(
            w + offloaded <= w0 + (64 << 10),
            "{opt:?}: working store {w} B tiered against {w0} B untiered, {offloaded} B offloaded"
        );
        let (l, p, m) = train(plan, 4);
        assert_eq!(l, l0, "{opt:?}: losses");
        assert_eq!(p, p0, "{opt:?}: parameters");
        assert_eq!(m, m0, "{opt:?}: moments");
    }
}

#[test]
fn a_budget_no_placement_meets_is_a_compile_error_naming_the_largest_consumers() {
    let budgets = Budgets {
        device: Some(MIB),
        ..Default::default()
    };
    let err = compile(config(Opt::Soap, budgets)).expect_err("1 MiB cannot hold the parameters");
    let text = err.to_string();
    assert!(text.contains("cannot be met"), "{text}");
    assert!(text.contains("1.00 MiB"), "names the budget: {text}");
    assert!(
        text.contains("still leaves") && text.contains("staging buffers"),
        "says what offloading everything leaves on the device: {text}"
    );
    assert!(
        text.contains("largest device consumers: %"),
        "names the largest consumers: {text}"
    );
    // No NVMe directory and a full host tier: the error says so.
    let budgets = Budgets {
        device: Some(budget_below(Opt::AdamW, 2 * MIB)),
        host: Some(MIB),
        ..Default::default()
    };
    let text = compile(config(Opt::AdamW, budgets))
        .expect_err("nowhere to put the moments")
        .to_string();
    assert!(text.contains("no `nvme` directory"), "{text}");
}

#[test]
fn the_verifier_refuses_tampered_copies() {
    let budgets = Budgets {
        device: Some(budget_below(Opt::AdamW, 2 * MIB)),
        ..Default::default()
    };
    let plan = compile(config(Opt::AdamW, budgets)).expect("plan");
    // Drop a copy out: the update of that moment would be lost.
    let mut p = plan.clone();
    let at = p
        .optimizer
        .iter()
        .position(|o| matches!(o, Op::CopyOut { .. }))
        .expect("a copy out");
    p.optimizer.remove(at);
    let e = p.verify().expect_err("missing copy out").to_string();
    assert!(e.contains("never copied back"), "{e}");
    // An update that reads the offloaded buffer itself instead of its staging copy.
    let mut p = plan.clone();
    let Some(Op::CopyIn { src, dst, .. }) = p
        .optimizer
        .iter()
        .find(|o| matches!(o, Op::CopyIn { .. }))
        .cloned()
    else {
        panic!("a copy in")
    };
    for op in p.optimizer.iter_mut() {
        if let Op::AdamW {
            exp_avg,
            exp_avg_sq,
            ..
        } = op
        {
            for b in [exp_avg, exp_avg_sq] {
                if *b == dst {
                    *b = src;
                }
            }
        }
    }
    let e = p
        .verify()
        .expect_err("an op on offloaded state")
        .to_string();
    assert!(e.contains("offloaded"), "{e}");
    // A copy in moved after the first op that reads its staging buffer (the optimizer's own
    // copies in, and those `copy-hoisting` put in the backward): the op would read stale bytes.
    let hoisted = plan
        .backward
        .iter()
        .filter(|o| matches!(o, Op::CopyIn { .. }))
        .count();
    assert!(hoisted > 0, "the plan hoists copies in into the backward");
    for in_backward in [false, true] {
        let mut p = plan.clone();
        let program = if in_backward {
            &mut p.backward
        } else {
            &mut p.optimizer
        };
        let at = program
            .iter()
            .position(|o| matches!(o, Op::CopyIn { .. }))
            .expect("a copy in");
        let copy = program.remove(at);
        let Op::CopyIn { dst, .. } = copy else {
            unreachable!()
        };
        let reader = p
            .optimizer
            .iter()
            .position(|o| {
                !matches!(o, Op::CopyIn { .. } | Op::CopyOut { .. })
                    && o.accesses().iter().any(|(_, id, _)| *id == dst)
            })
            .expect("an op reads the staging buffer");
        p.optimizer.insert(reader + 1, copy);
        let e = p
            .verify()
            .expect_err("a read before its copy in")
            .to_string();
        assert!(
            e.contains("before its copy_in") && e.contains(&p.buffer(dst).name),
            "in_backward {in_backward}: {e}"
        );
    }
    // A copy out moved before the update that writes its staging buffer: the update is lost.
    let mut p = plan.clone();
    let at = p
        .optimizer
        .iter()
        .position(|o| matches!(o, Op::CopyOut { .. }))
        .expect("a copy out");
    let copy = p.optimizer.remove(at);
    let Op::CopyOut { src, .. } = copy else {
        unreachable!()
    };
    let writer = p
        .optimizer
        .iter()
        .position(|o| {
            o.accesses()
                .iter()
                .any(|(_, id, a)| *id == src && a.writes())
        })
        .expect("an op writes the staging buffer");
    p.optimizer.insert(writer, copy);
    let e = p
        .verify()
        .expect_err("a write after its copy out")
        .to_string();
    assert!(e.contains("after its copy_out"), "{e}");
    // Over the recorded budget.
    let mut p = plan;
    p.memory.budgets.device = Some(MIB);
    let e = p.verify().expect_err("over budget").to_string();
    assert!(e.contains("more than"), "{e}");
}

/// `host_updates`: every AdamW update runs on the host, its parameter master copy, gradient
/// and moments in the host tier, and the forward and backward read a device copy that a
/// `copy_in` refreshes. Under `sync` the run is the untiered one to the last bit. Under
/// `delayed` each step's forward reads the parameters one update old (ZeRO-Offload's delayed
/// parameter update) once the learning-rate warm-up of W steps is over: on a repeated batch
/// steps 1..=W+1 have the untiered losses, step W+2 repeats step W+1's, step W+3 has the
/// untiered step W+2's (the first delayed update is the same), and from step W+4 on the runs
/// differ.
#[test]
fn host_updates_sync_is_bit_identical_and_delayed_lags_one_update() {
    use schedule::HostUpdates;
    for warmup in [0u64, 2] {
        let with = |budgets: Budgets| {
            let mut c = config(Opt::AdamW, budgets);
            c.train.warmup_steps = warmup;
            c
        };
        let plain = compile(with(Budgets::default())).expect("untiered");
        let (l0, p0, m0) = train(plain, 6);
        for mode in [HostUpdates::Sync, HostUpdates::Delayed] {
            let budgets = Budgets {
                host_updates: mode,
                ..Default::default()
            };
            let plan = compile(with(budgets)).expect("host updates compile");
            plan.verify().expect("verifies");
            check_host_update_plan(&plan, mode, warmup);
            let (l, p, m) = train(plan, 6);
            let w = warmup as usize;
            match mode {
                HostUpdates::Sync => {
                    assert_eq!(l, l0, "sync: losses");
                    assert_eq!(p, p0, "sync: parameters");
                    assert_eq!(m, m0, "sync: moments");
                }
                _ => {
                    assert_eq!(
                        l[..=w],
                        l0[..=w],
                        "delayed, warm-up {w}: the synchronous steps"
                    );
                    assert_eq!(
                        l[w + 1],
                        l0[w],
                        "delayed, warm-up {w}: the first delayed step"
                    );
                    assert_eq!(l[w + 2], l0[w + 1], "delayed, warm-up {w}: one update late");
                    assert_ne!(l[w + 3], l0[w + 2], "delayed, warm-up {w}: then different");
                    assert!(l[5] < l[0], "delayed: the loss falls: {l:?}");
                }
            }
        }
    }
}

/// The shape of a `host_updates` plan: every update on the host with its operands in the host
/// tier and the clip's factor among them, a copy in of each parameter into `<param>.device`
/// (after the update under `sync`, right before it under `delayed`, and again at the end with
/// `last_step` = the warm-up under `delayed`), the forward and backward reading the copy.
fn check_host_update_plan(plan: &Plan, mode: schedule::HostUpdates, warmup: u64) {
    let hosts: Vec<(usize, &Op)> = plan
        .optimizer
        .iter()
        .enumerate()
        .filter(|(_, o)| o.on_host())
        .collect();
    assert_eq!(hosts.len(), plan.params.len(), "{mode}: every update moves");
    for &(at, op) in &hosts {
        let Op::AdamW {
            param, grad_scale, ..
        } = *op
        else {
            panic!("{mode}: only adam_w runs on the host");
        };
        for (field, id) in op.operands() {
            assert_eq!(
                plan.memory.tier(id),
                Some(ArenaKind::Host),
                "{mode}: `{field}` of the update of {}",
                plan.buffer(param).name
            );
        }
        assert!(
            grad_scale.is_some(),
            "{mode}: the clip's factor reaches the host"
        );
        let copies: Vec<(usize, Option<u64>, schedule::BufferId)> = plan
            .optimizer
            .iter()
            .enumerate()
            .filter_map(|(i, o)| match *o {
                Op::CopyIn {
                    src,
                    dst,
                    last_step,
                } if src == param => Some((i, last_step, dst)),
                _ => None,
            })
            .collect();
        let dst = copies[0].2;
        assert_eq!(
            plan.buffer(dst).name,
            format!("{}.device", plan.buffer(param).name)
        );
        assert!(plan.memory.tier(dst).is_some_and(|k| k.on_device()));
        let expected: Vec<(bool, Option<u64>)> = match (mode, warmup) {
            (schedule::HostUpdates::Sync, _) => vec![(true, None)],
            (_, 0) => vec![(false, None)],
            _ => vec![(false, None), (true, Some(warmup))],
        };
        let got: Vec<(bool, Option<u64>)> = copies.iter().map(|c| (c.0 > at, c.1)).collect();
        assert_eq!(
            got,
            expected,
            "{mode}: copies of {} (after the update?)",
            plan.buffer(param).name
        );
        if mode == schedule::HostUpdates::Delayed {
            assert_eq!(
                copies[0].0 + 1,
                at,
                "delayed: the copy right before the update"
            );
        }
        for ops in [&plan.forward, &plan.backward] {
            assert!(
                !ops.iter()
                    .any(|o| o.operands().iter().any(|&(_, b)| b == param)),
                "{mode}: the forward and backward read the device copy"
            );
        }
    }
}

/// `host_updates` refuses gradient accumulation (accumulated gradients stay on the device)
/// with a message naming both keys, and an optimizer without AdamW updates (nothing would
/// move); `off` changes nothing.
#[test]
fn host_updates_with_grad_accum_is_refused_and_off_changes_nothing() {
    use schedule::HostUpdates;
    let mut c = config(
        Opt::AdamW,
        Budgets {
            host_updates: HostUpdates::Delayed,
            ..Default::default()
        },
    );
    c.train.grad_accum = 2;
    let e = compile(c).expect_err("refused").to_string();
    assert!(
        e.contains("host_updates = delayed") && e.contains("grad_accum = 2"),
        "{e}"
    );
    // SOAP's updates are not element-wise: nothing could run on the host.
    let e = compile(config(
        Opt::Soap,
        Budgets {
            host_updates: HostUpdates::Sync,
            ..Default::default()
        },
    ))
    .expect_err("nothing to move")
    .to_string();
    assert!(
        e.contains("moves nothing") && e.contains("soap_update"),
        "{e}"
    );
    let plain = compile(config(Opt::AdamW, Budgets::default())).expect("plain");
    let off = compile(config(
        Opt::AdamW,
        Budgets {
            host_updates: HostUpdates::Off,
            ..Default::default()
        },
    ))
    .expect("off");
    assert_eq!(plain, off);
}

/// A step whose gradient norm is not finite skips its updates (the clip's rule) and leaves no
/// staging copy behind in the CPU engine's working store, also those that `copy-hoisting`
/// filled during the backward; the offloaded moments keep their values.
#[test]
fn a_skipped_step_frees_the_staging_copies_it_filled() {
    let opt = Opt::AdamW;
    let plan = compile(config(
        opt,
        Budgets {
            device: Some(budget_below(opt, 2 * MIB)),
            ..Default::default()
        },
    ))
    .expect("tiered plan");
    assert!(
        plan.backward
            .iter()
            .any(|o| matches!(o, schedule::Op::CopyIn { .. })),
        "a copy in runs during the backward"
    );
    let offloaded: Vec<String> = (0..plan.buffers.len())
        .filter(|&i| {
            plan.memory
                .tier(schedule::BufferId(i as u32))
                .is_some_and(|k| !k.on_device())
        })
        .map(|i| plan.buffers[i].name.clone())
        .collect();
    let (x, y) = batch(&plan);
    let mut e = engine(plan.clone());
    step(&mut e, &x, &y, 1).expect("a step");
    let working = e.working_bytes();
    let before: Vec<Vec<f64>> = offloaded
        .iter()
        .map(|n| e.buffer(n).expect("home"))
        .collect();
    let p = &plan.buffers[plan.params[0].param.index()].name;
    let n = e.buffer(p).expect("param").len();
    e.set_buffer(p, &vec![f64::NAN; n])
        .expect("poison a parameter");
    e.load_batch(&x, &y).expect("batch");
    e.forward().expect("forward");
    e.backward().expect("backward");
    assert!(
        !e.optimizer_step(2, 1.0).expect("optimizer"),
        "the step is skipped"
    );
    assert_eq!(e.working_bytes(), working, "staging copies freed");
    for (n, v) in offloaded.iter().zip(&before) {
        assert_eq!(&e.buffer(n).expect("home"), v, "{n} unchanged");
    }
}
