//! Off-critical-path eigenbasis refreshes on the hand-built SOAP plan: S = 0 is bit-identical
//! to synchronous `optim::eigenbasis_refresh` calls, S > 0 swaps results in within the bound,
//! and injected failures (non-finite factors, a failing eigensolver) and all-zero factors (skipped, not failed) keep the
//! previous basis bitwise, are counted, and stop the run only after the configured number in a
//! row — with S = 0 and with S = 3. A rank-deficient factor is not a failure (SOAP factors
//! usually are; `soap.py` refreshes them): it gives a new orthonormal basis.
mod common;

use common::gpt::{plan, Gpt};
use common::rand_ids;
use engine::{CpuEngine, EngineError, EngineOptions, HostTaskReport, Rng};
use optim::{EigenError, Eigh, FaerEigensolver, HostEigensolver};
use schedule::{HostTask, Plan, TargetPlan};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The tiny SOAP plan with every refresh every `freq` steps (staggered by task index when
/// `stagger`), staleness `s` (the target's bound too).
fn soap_plan(freq: u64, s: u32, stagger: bool) -> Plan {
    let mut p = plan(&Gpt::tiny(true));
    for (i, task) in p.host_tasks.iter_mut().enumerate() {
        let HostTask::EigenbasisRefresh {
            frequency,
            offset,
            staleness,
            ..
        } = task;
        *frequency = freq;
        *offset = if stagger { i as u64 % freq } else { 0 };
        *staleness = s;
    }
    let TargetPlan::Cpu { staleness, .. } = &mut p.target else {
        unreachable!("the tiny plan targets the CPU")
    };
    *staleness = s;
    p
}

#[test]
fn a_refresh_staleness_above_the_targets_bound_is_rejected() {
    let mut p = soap_plan(5, 3, false);
    let TargetPlan::Cpu { staleness, .. } = &mut p.target else {
        unreachable!("the tiny plan targets the CPU")
    };
    *staleness = 2;
    let Err(e) = CpuEngine::<f32>::new(p, EngineOptions::default()) else {
        panic!("a plan whose refreshes exceed the target's staleness bound ran");
    };
    assert!(
        e.to_string()
            .contains("exceeds the target's staleness bound 2"),
        "{e}"
    );
}

fn engine(p: Plan, opts: EngineOptions) -> CpuEngine<f32> {
    CpuEngine::new(p, opts).expect("valid plan")
}

/// Load a step-dependent batch, forward, backward, optimizer (no host tasks).
fn compute_step(e: &mut CpuEngine<f32>, t: u64) -> f64 {
    let g = Gpt::tiny(true);
    let mut rng = Rng::new(1000 + t);
    let x = rand_ids(&mut rng, g.batch * g.seq, g.vocab);
    let y: Vec<i32> = x.iter().map(|&v| (v * 7 + 3) % g.vocab as i32).collect();
    e.load_batch(&x, &y).expect("batch");
    let loss = e.forward().expect("forward");
    e.backward().expect("backward");
    assert!(
        e.optimizer_step(t, 1.0).expect("optimizer"),
        "step {t} skipped"
    );
    loss
}

fn step(e: &mut CpuEngine<f32>, t: u64) -> Result<HostTaskReport, EngineError> {
    compute_step(e, t);
    e.run_host_tasks(t)
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every float buffer of the plan, by name.
fn state(e: &CpuEngine<f32>) -> Vec<(String, Vec<u64>)> {
    e.plan()
        .buffers
        .iter()
        .map(|b| (b.name.clone(), bits(&e.buffer(&b.name).expect("buffer"))))
        .collect()
}

#[test]
fn s0_is_bit_identical_to_synchronous_refreshes() {
    for stagger in [false, true] {
        let p = soap_plan(5, 0, stagger);
        let mut asynchronous = engine(p.clone(), EngineOptions::default());
        let mut reference = engine(
            p,
            EngineOptions {
                synchronous_refresh: true,
                ..EngineOptions::default()
            },
        );
        for t in 1..=25 {
            let a = step(&mut asynchronous, t).expect("async path");
            let r = step(&mut reference, t).expect("reference path");
            assert_eq!((a.refreshed, a.failed), (r.refreshed, r.failed), "t = {t}");
            assert_eq!(a.max_swap_staleness, (a.swapped > 0).then_some(0));
            assert_eq!(asynchronous.refreshes_in_flight(), 0);
            for ((name, x), (_, y)) in asynchronous.params().iter().zip(reference.params()) {
                assert!(
                    bits(x) == bits(&y),
                    "stagger {stagger}: {name} differs after step {t}"
                );
            }
        }
        assert_eq!(state(&asynchronous), state(&reference), "stagger {stagger}");
        let s = asynchronous.stats();
        let tasks = asynchronous.plan().host_tasks.len() as u64;
        assert_eq!(s.refreshes, reference.stats().refreshes);
        assert!(s.refreshes >= 5 * tasks, "{s:?}");
        assert_eq!(
            (
                s.refresh_waits,
                s.max_swap_staleness,
                s.total_refresh_failures()
            ),
            (0, 0, 0)
        );
    }
}

#[test]
fn staleness_3_swaps_results_within_the_bound() {
    let mut e = engine(soap_plan(5, 3, true), EngineOptions::default());
    let mut reference = engine(soap_plan(5, 0, true), EngineOptions::default());
    let tasks = e.plan().host_tasks.len();
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    for t in 1..=25 {
        let loss = compute_step(&mut e, t);
        compute_step(&mut reference, t);
        reference.run_host_tasks(t).expect("reference");
        if t == 1 {
            first = loss;
        }
        last = loss;
        let r = e.run_host_tasks(t).expect("host tasks");
        if t == 1 {
            // The first basis is always computed inline.
            assert_eq!(
                (r.launched, r.swapped, r.max_swap_staleness),
                (tasks, tasks, Some(0))
            );
            assert_eq!(e.refreshes_in_flight(), 0);
        } else if let Some(s) = r.max_swap_staleness {
            assert!((1..=3).contains(&s), "t = {t}: staleness {s}");
        }
        assert_eq!(r.failed, 0);
    }
    let s = e.stats().clone();
    assert_eq!(
        s.refresh_swaps + e.refreshes_in_flight() as u64,
        s.refreshes_launched
    );
    assert!(
        s.max_swap_staleness >= 1 && s.max_swap_staleness <= 3,
        "{s:?}"
    );
    assert!(s.mean_swap_staleness() > 0.0);
    assert!(last < first, "loss {first} -> {last}");
    // Stale bases change the trajectory (the comparison would be vacuous otherwise).
    assert_ne!(state(&e), state(&reference));
    e.finish_refreshes(25).expect("drain");
    assert_eq!(e.refreshes_in_flight(), 0);
    assert_eq!(e.stats().refresh_swaps, e.stats().refreshes_launched);
}

/// With `refresh_swap = deadline` every refresh is installed exactly at its bound, so S > 0
/// runs are reproducible: two runs of the same plan end in bit-identical state whatever the
/// host pool's timing.
#[test]
fn staleness_3_swapped_at_the_bound_is_reproducible() {
    let run = || {
        let mut plan = soap_plan(5, 3, true);
        plan.train.refresh_swap = schedule::RefreshSwap::Deadline;
        let mut e = engine(plan, EngineOptions::default());
        let mut late = Vec::new();
        for t in 1..=17 {
            compute_step(&mut e, t);
            let r = e.run_host_tasks(t).expect("host tasks");
            if t > 1 {
                late.extend(r.max_swap_staleness);
            }
        }
        assert!(!late.is_empty() && late.iter().all(|&s| s == 3), "{late:?}");
        state(&e)
    };
    assert_eq!(run(), run());
}

#[test]
fn a_refresh_still_in_flight_is_swapped_in_before_the_next_one_launches() {
    // S = 7 > frequency 5: at the next due step the previous result may be unfinished and
    // within its bound; either way it is installed before the new snapshot is taken.
    let mut e = engine(soap_plan(5, 7, false), EngineOptions::default());
    let tasks = e.plan().host_tasks.len();
    step(&mut e, 1).expect("init");
    for t in 2..=5 {
        step(&mut e, t).expect("no refresh due");
    }
    compute_step(&mut e, 6);
    let r = e.run_host_tasks(6).expect("launch");
    assert_eq!((r.launched, r.swapped), (tasks, 0));
    assert_eq!(e.refreshes_in_flight(), tasks);
    // Straight to the next due step (no boundary in between).
    let r = e.run_host_tasks(11).expect("swap then launch");
    assert_eq!(
        (r.swapped, r.launched, r.max_swap_staleness),
        (tasks, tasks, Some(5))
    );
    assert_eq!(e.refreshes_in_flight(), tasks);
    assert_eq!(e.stats().total_refresh_failures(), 0);
}

/// What to write into the factor before a refresh.
#[derive(Clone, Copy, Debug)]
enum Bad {
    Nan,
    Inf,
    Zero,
    RankTwo,
}

fn corrupt(kind: Bad, f: &[f64]) -> Vec<f64> {
    let d = (f.len() as f64).sqrt() as usize;
    match kind {
        Bad::Nan => f
            .iter()
            .enumerate()
            .map(|(i, &x)| if i == 3 { f64::NAN } else { x })
            .collect(),
        Bad::Inf => f
            .iter()
            .enumerate()
            .map(|(i, &x)| if i == d + 1 { f64::INFINITY } else { x })
            .collect(),
        Bad::Zero => vec![0.0; f.len()],
        Bad::RankTwo => {
            let mut rng = Rng::new(9);
            let u: Vec<f64> = (0..d).map(|_| rng.normal()).collect();
            let v: Vec<f64> = (0..d).map(|_| rng.normal()).collect();
            (0..d * d)
                .map(|k| u[k / d] * u[k % d] + 0.5 * v[k / d] * v[k % d])
                .collect()
        }
    }
}

/// The task refreshing `wte`'s right factor (its left side is over `max_precond_dim`, so its
/// moments are written by this task only).
fn wte_task(p: &Plan) -> (usize, [String; 4]) {
    for (i, t) in p.host_tasks.iter().enumerate() {
        let HostTask::EigenbasisRefresh {
            factor,
            basis,
            exp_avg,
            exp_avg_sq,
            ..
        } = t;
        if p.buffer(*factor).name == "wte.factor_right" {
            let name = |b| p.buffer(b).name.clone();
            return (
                i,
                [
                    name(*factor),
                    name(*basis),
                    name(*exp_avg),
                    name(*exp_avg_sq),
                ],
            );
        }
    }
    panic!("no wte refresh task");
}

fn injected_failure_keeps_the_basis(s: u32, kind: Bad) {
    let p = soap_plan(5, s, false);
    let (k, [factor, basis, ea, eas]) = wte_task(&p);
    let mut e = engine(p, EngineOptions::default());
    for t in 1..=10 {
        step(&mut e, t).expect("healthy steps");
    }
    compute_step(&mut e, 11);
    let f = e.buffer(&factor).expect("factor");
    let before: Vec<Vec<u64>> = [&basis, &ea, &eas]
        .iter()
        .map(|b| bits(&e.buffer(b).expect("buffer")))
        .collect();
    e.set_buffer(&factor, &corrupt(kind, &f)).expect("inject");
    let r1 = e.run_host_tasks(11).expect("a failure is survivable");
    // The refresh works on a snapshot: the live factor can be repaired at once.
    e.set_buffer(&factor, &f).expect("restore");
    let r2 = e.finish_refreshes(11).expect("a failure is survivable");
    // An exactly-zero factor (its gradients vanished) is a skipped refresh, not a failure.
    let fails = usize::from(!matches!(kind, Bad::Zero));
    assert_eq!(r1.failed + r2.failed, fails, "S = {s}, {kind:?}");
    assert_eq!(
        r1.failed,
        if s == 0 { fails } else { 0 },
        "S = {s}: found at the swap"
    );
    let after: Vec<Vec<u64>> = [&basis, &ea, &eas]
        .iter()
        .map(|b| bits(&e.buffer(b).expect("buffer")))
        .collect();
    assert!(
        before == after,
        "S = {s}, {kind:?}: basis or moments changed"
    );
    let stats = e.stats().clone();
    let fails = fails as u64;
    assert_eq!(stats.refresh_failures[k], fails);
    assert_eq!(stats.consecutive_refresh_failures[k], fails as u32);
    assert_eq!(stats.total_refresh_failures(), fails);
    assert_eq!(stats.zero_factor_refreshes, 1 - fails, "{kind:?}");
    // Training continues; the next refresh (step 16) succeeds and resets the run.
    for t in 12..=20 {
        step(&mut e, t).expect("training continues");
    }
    e.finish_refreshes(20).expect("drain");
    assert_eq!(e.stats().consecutive_refresh_failures[k], 0);
    assert_eq!(e.stats().total_refresh_failures(), fails);
    assert_ne!(bits(&e.buffer(&basis).expect("basis")), before[0]);
}

#[test]
fn non_finite_and_zero_factors_keep_the_basis_s0() {
    for kind in [Bad::Nan, Bad::Inf, Bad::Zero] {
        injected_failure_keeps_the_basis(0, kind);
    }
}

#[test]
fn non_finite_and_zero_factors_keep_the_basis_s3() {
    for kind in [Bad::Nan, Bad::Inf, Bad::Zero] {
        injected_failure_keeps_the_basis(3, kind);
    }
}

/// A rank-2 factor at step 11: the refresh succeeds with an orthonormal basis, no failure.
fn rank_deficient_factor_is_refreshed(s: u32) {
    let p = soap_plan(5, s, false);
    let (k, [factor, basis, ..]) = wte_task(&p);
    let mut e = engine(p, EngineOptions::default());
    for t in 1..=10 {
        step(&mut e, t).expect("healthy steps");
    }
    compute_step(&mut e, 11);
    let q0 = e.buffer(&basis).expect("basis");
    let f = e.buffer(&factor).expect("factor");
    e.set_buffer(&factor, &corrupt(Bad::RankTwo, &f))
        .expect("inject");
    e.run_host_tasks(11).expect("refresh");
    e.finish_refreshes(11).expect("drain");
    assert_eq!(e.stats().refresh_failures[k], 0, "S = {s}");
    let q = e.buffer(&basis).expect("basis");
    assert_ne!(bits(&q), bits(&q0), "S = {s}: basis not refreshed");
    let d = 16;
    for i in 0..d {
        for j in 0..d {
            let dot: f64 = (0..d).map(|r| q[r * d + i] * q[r * d + j]).sum();
            let want = if i == j { 1.0 } else { 0.0 };
            assert!((dot - want).abs() < 1e-4, "S = {s}: QᵀQ[{i},{j}] = {dot}");
        }
    }
}

#[test]
fn rank_deficient_factors_are_refreshed_s0_and_s3() {
    rank_deficient_factor_is_refreshed(0);
    rank_deficient_factor_is_refreshed(3);
}

/// Fails its first `fail` calls, then solves with faer.
struct FailsFirst {
    fail: usize,
    calls: AtomicUsize,
}

impl HostEigensolver for FailsFirst {
    fn name(&self) -> &'static str {
        "fails-first"
    }
    fn eigh_f32(&self, a: &[f32], n: usize) -> Result<Eigh<f32>, EigenError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) < self.fail {
            return Err(EigenError::NoConvergence {
                solver: "fails-first",
                info: 7,
            });
        }
        FaerEigensolver.eigh_f32(a, n)
    }
    fn eigh_f64(&self, a: &[f64], n: usize) -> Result<Eigh<f64>, EigenError> {
        FaerEigensolver.eigh_f64(a, n)
    }
}

fn eigensolver_errors_are_survived(s: u32) {
    let p = soap_plan(5, s, false);
    let tasks = p.host_tasks.len();
    let opts = EngineOptions {
        eigensolver: Some(Arc::new(FailsFirst {
            fail: tasks,
            calls: AtomicUsize::new(0),
        })),
        ..EngineOptions::default()
    };
    let mut e = engine(p, opts);
    let bases: Vec<String> = e
        .plan()
        .host_tasks
        .iter()
        .map(|t| {
            let HostTask::EigenbasisRefresh { basis, .. } = t;
            e.plan().buffer(*basis).name.clone()
        })
        .collect();
    let before: Vec<Vec<u64>> = bases
        .iter()
        .map(|b| bits(&e.buffer(b).expect("b")))
        .collect();
    let r = step(&mut e, 1).expect("first failures are survivable");
    assert_eq!((r.refreshed, r.failed), (0, tasks));
    let after: Vec<Vec<u64>> = bases
        .iter()
        .map(|b| bits(&e.buffer(b).expect("b")))
        .collect();
    assert!(before == after, "S = {s}: a basis changed");
    // The first eigendecomposition is retried (inline) at the next due step, and succeeds.
    for t in 2..=12 {
        step(&mut e, t).expect("training continues");
    }
    let stats = e.stats();
    assert_eq!(stats.total_refresh_failures(), tasks as u64);
    assert!(stats.consecutive_refresh_failures.iter().all(|&c| c == 0));
    assert!(stats.refreshes >= tasks as u64);
}

#[test]
fn eigensolver_errors_keep_the_basis_and_are_retried_s0() {
    eigensolver_errors_are_survived(0);
}

#[test]
fn eigensolver_errors_keep_the_basis_and_are_retried_s3() {
    eigensolver_errors_are_survived(3);
}

/// A factor that stays NaN: refreshes at steps 6, 11, 16 fail; the third stops the run.
fn consecutive_failures_stop_the_run(s: u32) {
    let p = soap_plan(5, s, false);
    let (k, [factor, ..]) = wte_task(&p);
    let opts = EngineOptions {
        max_consecutive_refresh_failures: 3,
        ..EngineOptions::default()
    };
    let mut e = engine(p, opts);
    let mut stopped = None;
    for t in 1..=30 {
        compute_step(&mut e, t);
        if t >= 5 {
            // Re-poisoned every step (the optimizer's factor update keeps NaN anyway).
            let mut f = e.buffer(&factor).expect("factor");
            f[0] = f64::NAN;
            e.set_buffer(&factor, &f).expect("inject");
        }
        match e.run_host_tasks(t) {
            Ok(_) => {}
            Err(err) => {
                stopped = Some((t, err));
                break;
            }
        }
    }
    let (t, err) = stopped.expect("the run stops");
    // The third failure is launched at 16; with S = 3 it is found by the end of step 19.
    assert!(
        (16..=16 + u64::from(s)).contains(&t),
        "S = {s}: stopped at step {t}"
    );
    match &err {
        EngineError::RefreshFailures {
            task,
            factor: name,
            failures,
            limit,
            last,
        } => {
            assert_eq!((*task, *failures, *limit), (k, 3, 3));
            assert_eq!(name, "wte.factor_right");
            assert!(last.contains("non-finite"), "{last}");
        }
        other => panic!("S = {s}: expected RefreshFailures, got {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("wte.factor_right") && msg.contains("3 times in a row"),
        "{msg}"
    );
    assert_eq!(e.stats().refresh_failures[k], 3);
    assert_eq!(e.stats().total_refresh_failures(), 3);
}

#[test]
fn consecutive_failures_stop_the_run_s0() {
    consecutive_failures_stop_the_run(0);
}

#[test]
fn consecutive_failures_stop_the_run_s3() {
    consecutive_failures_stop_the_run(3);
}
