//! The `memory-planning` pass: the greedy-by-size offset assignment (property tests over
//! random interval sets), the plans it produces for the examples and GPT-2 124M, the residency
//! rules on real plans, and `Plan::verify` rejecting corrupt memory plans.
use passes::memory_planning::{assign_offsets, Block, MemorySummary};
use passes::{PassManager, PassOptions};
use proptest::prelude::*;
use schedule::{
    ArenaKind, ArenaPlan, BufferClass, BufferId, LiveRange, Op, PersistReason, Plan, PlanError,
    Residency, ARENA_ALIGN,
};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn compile_config(config: ir::config::Config) -> (Plan, MemorySummary, String) {
    let mut module = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions {
        print_after: vec!["memory-planning".into()],
        ..Default::default()
    })
    .expect("pass manager");
    let mut out = Vec::new();
    let (cx, _) = pm.run(&mut module, None, &mut out).expect("pipeline");
    (
        cx.plan.expect("plan"),
        cx.memory.expect("memory summary"),
        String::from_utf8(out).expect("utf8"),
    )
}

fn compile(spec: &Path) -> (Plan, MemorySummary, String) {
    compile_config(
        frontend::load_spec(spec).unwrap_or_else(|e| panic!("{}: {e:?}", spec.display())),
    )
}

/// A bench spec with its corpus (a folder CI does not have) replaced by the built-in one.
fn compile_bench(name: &str) -> (Plan, MemorySummary, String) {
    let text = std::fs::read_to_string(root().join("bench/specs").join(name)).expect("bench spec");
    let text: String = text
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("corpus") {
                "  corpus = builtin".to_string()
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let dir = tempfile_dir();
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write spec");
    let r = compile(&path);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "asteria-memory-planning-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Checks the placement invariants of `assign_offsets` on `blocks`.
fn check_assignment(blocks: &[Block], offsets: &[usize], arena: usize, align: usize) {
    assert_eq!(offsets.len(), blocks.len());
    assert_eq!(arena % align, 0, "arena size {arena} is not aligned");
    for (i, (b, &o)) in blocks.iter().zip(offsets).enumerate() {
        assert_eq!(o % align, 0, "block {i} at misaligned offset {o}");
        assert!(o + b.bytes <= arena, "block {i} ends past the arena");
        for (j, (c, &p)) in blocks.iter().zip(offsets).enumerate().skip(i + 1) {
            // Live together in a step, or one held into the next step while the other lives.
            let apart = b.live.overlaps(&c.live)
                || b.also.is_some_and(|a| a.overlaps(&c.live))
                || c.also.is_some_and(|a| a.overlaps(&b.live));
            if apart {
                assert!(
                    o + b.bytes <= p || p + c.bytes <= o,
                    "blocks {i} {b:?} at {o} and {j} {c:?} at {p} are live together and overlap"
                );
            }
        }
    }
    // Lower bound: the bytes live at the busiest step position.
    let end = blocks.iter().map(|b| b.live.last + 1).max().unwrap_or(0);
    let peak = (0..end)
        .map(|p| {
            blocks
                .iter()
                .filter(|b| b.live.contains(p))
                .map(|b| b.bytes)
                .sum::<usize>()
        })
        .max()
        .unwrap_or(0);
    assert!(
        arena >= peak,
        "arena {arena} below the peak live bytes {peak}"
    );
    // Upper bound: no sharing at all.
    let unshared: usize = blocks.iter().map(|b| b.bytes.next_multiple_of(align)).sum();
    assert!(
        arena <= unshared,
        "arena {arena} above the unshared {unshared}"
    );
}

/// Blocks with random live ranges; about one in four also held into the next step's first
/// positions (a carried copy out's staging buffer, `copy-out-overlap`).
fn blocks_strategy() -> impl Strategy<Value = Vec<Block>> {
    prop::collection::vec(
        (1usize..5000, 0usize..40, 0usize..12, 0usize..4, 0usize..10),
        0..60,
    )
    .prop_map(|v| {
        v.into_iter()
            .map(|(bytes, first, len, carried, head)| Block {
                bytes,
                also: (carried == 0).then_some(LiveRange {
                    first: 0,
                    last: head,
                }),
                live: LiveRange {
                    first,
                    last: first + len,
                },
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn live_blocks_never_share_bytes(blocks in blocks_strategy(), shift in 0u32..10) {
        let align = 1usize << shift;
        let (offsets, arena) = assign_offsets(&blocks, align);
        check_assignment(&blocks, &offsets, arena, align);
    }

    #[test]
    fn the_assignment_is_deterministic(blocks in blocks_strategy()) {
        prop_assert_eq!(
            assign_offsets(&blocks, ARENA_ALIGN),
            assign_offsets(&blocks, ARENA_ALIGN)
        );
    }
}

#[test]
fn greedy_by_size_reuses_dead_bytes_and_fills_gaps() {
    let b = |bytes, first, last| Block::new(bytes, LiveRange { first, last });
    assert_eq!(assign_offsets(&[], 256), (vec![], 0));
    // A chain a → b → c of equal sizes: a and c can share, b cannot share with either.
    let chain = [b(1000, 0, 1), b(1000, 1, 2), b(1000, 2, 3)];
    let (o, arena) = assign_offsets(&chain, 256);
    assert_eq!(o, vec![0, 1024, 0]);
    assert_eq!(arena, 2048);
    // The big block goes first at 0; a small block live at the same time goes after it; a
    // small block live only later reuses offset 0.
    let mixed = [b(100, 5, 6), b(4096, 0, 3), b(300, 2, 4)];
    let (o, arena) = assign_offsets(&mixed, 256);
    assert_eq!(o, vec![0, 0, 4096]);
    assert_eq!(arena, 4096 + 512);
    // A gap between two placed blocks is filled when it is big enough: P and Q share offset
    // 0 (disjoint lives), R goes above both, S fits in [1536, 2048) between Q and R.
    let gap = [b(2000, 0, 1), b(1500, 2, 9), b(1000, 0, 9), b(400, 2, 9)];
    let (o, arena) = assign_offsets(&gap, 256);
    check_assignment(&gap, &o, arena, 256);
    assert_eq!(o, vec![0, 0, 2048, 1536]);
    assert_eq!(arena, 3072);
}

/// Memory plans of real specs: verified, aligned, at least the peak, and actually shared.
#[test]
fn real_plans_share_the_activation_bytes() {
    let mut rows = Vec::new();
    for spec in [
        "examples/tiny.asteria",
        "examples/tiny-soap.asteria",
        "examples/tiny-llama-soap.asteria",
        "examples/gpt2-124m.asteria",
    ] {
        let (plan, m, _) = compile(&root().join(spec));
        rows.push((spec.to_string(), plan, m));
    }
    for name in ["gpt2-124m-adamw.asteria", "gpt2-124m-soap.asteria"] {
        let (plan, m, _) = compile_bench(name);
        rows.push((format!("bench/specs/{name}"), plan, m));
    }
    for (spec, plan, m) in &rows {
        plan.verify().unwrap_or_else(|e| panic!("{spec}: {e}"));
        assert_eq!(*m, MemorySummary::of(plan));
        assert!(
            m.activations_bytes >= m.peak_live_bytes,
            "{spec}: arena below the peak"
        );
        assert!(
            m.activations_bytes < m.transient_unshared_bytes,
            "{spec}: no reuse: {m:?}"
        );
        assert!(m.planned_bytes() < m.unshared_bytes, "{spec}: {m:?}");
        // Greedy by size is close to the lower bound on these plans.
        assert!(
            m.activations_bytes as f64 <= 1.1 * m.peak_live_bytes as f64,
            "{spec}: activations arena {} far above the peak {}",
            m.activations_bytes,
            m.peak_live_bytes
        );
        for (i, s) in plan.memory.slots.iter().enumerate() {
            assert_eq!(s.offset % ARENA_ALIGN, 0, "{spec}: buffer {i}");
        }
        eprintln!(
            "{spec}: one place per buffer {} B; persistent arena {} B + activations arena {} B = {} B (peak live {} B, activations unshared {} B)",
            m.unshared_bytes,
            m.persistent_bytes,
            m.activations_bytes,
            m.planned_bytes(),
            m.peak_live_bytes,
            m.transient_unshared_bytes
        );
    }
    // GPT-2 124M, B = 16 × 1024: the activations need about half of one place per buffer.
    let (_, _, m) = rows
        .iter()
        .find(|r| r.0.ends_with("gpt2-124m-adamw.asteria"))
        .expect("gpt2 adamw");
    assert!(
        (m.planned_bytes() as f64) < 0.6 * m.unshared_bytes as f64,
        "{m:?}"
    );
}

/// Which buffers persist and why, on the tiny SOAP plan; gradients are step-local.
#[test]
fn residency_keeps_state_inputs_and_host_operands_persistent() {
    let (plan, _, _) = compile(&root().join("examples/tiny-soap.asteria"));
    let res = plan.residency();
    let persistent = |id: BufferId| matches!(res[id.index()], Residency::Persistent(_));
    assert_eq!(
        res[plan.loss.index()],
        Residency::Persistent(PersistReason::Loss)
    );
    assert!(persistent(plan.data.tokens) && persistent(plan.data.targets));
    let step_end = plan.step_len() - 1;
    for p in &plan.params {
        assert!(persistent(p.param));
        // A gradient is step-local: written in the backward pass, last read by the optimizer.
        let live = res[p.grad.index()]
            .live_range()
            .expect("gradients are step-local");
        assert!(
            live.first >= plan.forward.len() && live.last <= step_end,
            "{live:?}"
        );
        assert!(
            live.last >= plan.forward.len() + plan.backward.len(),
            "read by the optimizer"
        );
    }
    for t in &plan.host_tasks {
        for (_, id) in t.operands() {
            assert!(persistent(id));
        }
    }
    let mut transient = 0;
    for (i, (b, r)) in plan.buffers.iter().zip(&res).enumerate() {
        match r {
            Residency::Transient(live) => {
                transient += 1;
                assert!(
                    matches!(b.class, BufferClass::Activation | BufferClass::Gradient),
                    "{}",
                    b.name
                );
                assert!(live.first <= live.last && live.last < plan.step_len());
                assert_eq!(
                    plan.memory.slots[i].arena,
                    ArenaKind::Activations,
                    "{}",
                    b.name
                );
            }
            Residency::Persistent(_) => {
                assert_eq!(plan.memory.slots[i].arena, ArenaKind::Persistent)
            }
        }
    }
    assert!(transient > 10);
    // An op that accumulates into an activation reads it first: it must persist.
    let mut p = plan.clone();
    let (pos, out) = p
        .step_ops()
        .find_map(|(pos, op)| match op {
            Op::MatMul { out, .. } if matches!(res[out.index()], Residency::Transient(_)) => {
                Some((pos, *out))
            }
            _ => None,
        })
        .expect("a matmul into an activation");
    let range = res[out.index()].live_range().expect("transient");
    assert_eq!(range.first, pos, "the matmul defines it");
    for op in p.forward.iter_mut().chain(&mut p.backward) {
        if let Op::MatMul {
            out: o, accumulate, ..
        } = op
        {
            if *o == out {
                *accumulate = true;
            }
        }
    }
    assert_eq!(
        p.residency()[out.index()],
        Residency::Persistent(PersistReason::ReadBeforeWrite { at: pos })
    );
    // ... so the memory plan that shared it no longer verifies, with a clear message.
    let err = p
        .verify()
        .expect_err("read-before-write buffer in the shared arena");
    let msg = err.to_string();
    assert!(
        msg.contains("memory plan:")
            && msg.contains("must persist")
            && msg.contains("read before written"),
        "{msg}"
    );
}

fn tiny_plan() -> Plan {
    compile(&root().join("examples/tiny-soap.asteria")).0
}

fn memory_error(plan: &Plan) -> String {
    match plan.verify() {
        Err(e @ PlanError::Memory(_)) => {
            // The JSON path rejects it the same way, before anything runs.
            let again = Plan::from_json(&plan.to_json()).expect_err("from_json rejects it");
            assert_eq!(again, e);
            e.to_string()
        }
        other => panic!("expected a memory plan error, got {other:?}"),
    }
}

/// Two transient buffers `(i, j)` whose live ranges intersect, such that `j` still fits in the
/// arena when moved to `i`'s offset.
fn two_live_together(plan: &Plan) -> (usize, usize) {
    let res = plan.residency();
    let cap = plan.memory.arena_bytes(ArenaKind::Activations);
    let t: Vec<(usize, LiveRange)> = res
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.live_range().map(|l| (i, l)))
        .collect();
    for &(i, a) in &t {
        for &(j, b) in &t {
            let fits = plan.memory.slots[i].offset + plan.buffers[j].size_bytes() <= cap;
            if i != j && a.overlaps(&b) && fits {
                return (i, j);
            }
        }
    }
    panic!("no two transient buffers live together");
}

#[test]
fn verify_rejects_corrupt_memory_plans() {
    let good = tiny_plan();
    good.verify().expect("the planned plan verifies");

    // Two buffers live at the same time on the same bytes.
    let mut p = good.clone();
    let (i, j) = two_live_together(&p);
    p.memory.slots[j].offset = p.memory.slots[i].offset;
    let msg = memory_error(&p);
    assert!(
        msg.contains("are both live at")
            && msg.contains(&format!("`{}`", p.buffers[i].name))
            && msg.contains(&format!("`{}`", p.buffers[j].name))
            && msg.contains("arena `activations`"),
        "{msg}"
    );

    // A buffer past the end of its arena.
    let mut p = good.clone();
    let cap = p.memory.arena_bytes(ArenaKind::Activations);
    p.memory.slots[i].offset = cap;
    let msg = memory_error(&p);
    assert!(
        msg.contains("does not fit in arena `activations`") && msg.contains(&p.buffers[i].name),
        "{msg}"
    );

    // A misaligned offset.
    let mut p = good.clone();
    p.memory.slots[i].offset += 4;
    let msg = memory_error(&p);
    assert!(
        msg.contains("not a multiple of the 256-byte alignment"),
        "{msg}"
    );

    // Persistent buffers sharing bytes.
    let mut p = good.clone();
    let (a, b) = (p.params[0].param.index(), p.params[1].param.index());
    p.memory.slots[b] = p.memory.slots[a];
    let msg = memory_error(&p);
    assert!(
        msg.contains("persistent arena never share bytes")
            && msg.contains(&p.buffers[a].name)
            && msg.contains(&p.buffers[b].name),
        "{msg}"
    );

    // A parameter moved into the shared arena.
    let mut p = good.clone();
    p.memory.slots[a] = schedule::BufferSlot {
        arena: ArenaKind::Activations,
        offset: 0,
    };
    let msg = memory_error(&p);
    assert!(msg.contains("must persist (a parameter)"), "{msg}");

    // A slot missing.
    let mut p = good.clone();
    p.memory.slots.pop();
    assert!(memory_error(&p).contains("slots for"));

    // An arena listed twice, an arena the slots need missing, an oversized arena, a wrong
    // alignment.
    let mut p = good.clone();
    p.memory.arenas.push(p.memory.arenas[0]);
    assert!(memory_error(&p).contains("listed twice"));
    let mut p = good.clone();
    p.memory.arenas.retain(|a| a.kind != ArenaKind::Activations);
    assert!(memory_error(&p).contains("which the memory plan does not list"));
    let mut p = good.clone();
    for a in &mut p.memory.arenas {
        if a.kind == ArenaKind::Activations {
            *a = ArenaPlan {
                kind: a.kind,
                bytes: 1 << 50,
            };
        }
    }
    assert!(memory_error(&p).contains("without any sharing"));
    let mut p = good;
    p.memory.alignment = 128;
    assert!(memory_error(&p).contains("alignment is 128 bytes"));
}

#[test]
fn print_after_memory_planning_reports_arenas_and_largest_buffers() {
    let (plan, m, out) = compile(&root().join("examples/tiny.asteria"));
    assert!(
        out.starts_with("; memory plan after memory-planning"),
        "{out}"
    );
    for w in [
        "arena persistent",
        "arena activations",
        "peak live step-local bytes",
        "one place per buffer",
        "saved",
        "persistent because:",
        "largest step-local buffers",
        "logits",
    ] {
        assert!(out.contains(w), "report lacks `{w}`:\n{out}");
    }
    assert!(out.contains(&m.activations_bytes.to_string()));
    // The report's largest buffer line names its offset and live range.
    let logits = plan
        .buffers
        .iter()
        .position(|b| b.name == "logits")
        .expect("logits");
    let live = plan.residency()[logits].live_range().expect("transient");
    assert!(out.contains(&format!(
        "{}..{}",
        plan.step_position(live.first),
        plan.step_position(live.last)
    )));
    // `memory-planning` places the memory last (only `copy-out-overlap`, which may place it
    // again, follows); `lower` alone leaves the unshared layout.
    assert_eq!(
        PassManager::pass_names()
            .iter()
            .rev()
            .take(2)
            .collect::<Vec<_>>(),
        [&"copy-out-overlap", &"memory-planning"]
    );
    let config = frontend::load_spec(&root().join("examples/tiny.asteria")).expect("spec");
    let mut module = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pm");
    let (cx, _) = pm
        .run(&mut module, Some("lower"), &mut std::io::sink())
        .expect("pipeline");
    let lowered = cx.plan.expect("plan");
    assert_eq!(
        lowered.memory,
        schedule::MemoryPlan::unshared(&lowered.buffers)
    );
    assert_eq!(
        lowered.memory.total_bytes(),
        MemorySummary::of(&lowered).unshared_bytes
    );
}
