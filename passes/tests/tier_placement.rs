//! Placement tests on the LLaMA 1.44B and 6.9B specs (the three-target golden tests are in
//! `tests/placement_targets.rs`): what `tier-placement` moves first, the refresh pools, the
//! copies of `prefetch-insertion`, `copy-hoisting` and `copy-out-overlap`.
mod placement_common;
use passes::{PassManager, PassOptions};
use placement_common::*;
use schedule::{ArenaKind, Plan};
use std::path::PathBuf;

/// The plan of `bench/specs/llama-1.4b-soap.asteria` (built-in corpus) after `edit` of its
/// source, through the whole pipeline.
fn soap_plan(edit: impl FnOnce(String) -> String) -> Plan {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/specs/llama-1.4b-soap.asteria");
    let src = std::fs::read_to_string(path)
        .expect("spec")
        .replace("corpus = \"../data/medium\"", "corpus = builtin");
    let config =
        frontend::parse_spec("soap", &edit(src), &std::env::temp_dir()).expect("valid spec");
    let mut m = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pm");
    let (cx, _) = pm
        .run(&mut m, None, &mut std::io::sink())
        .expect("pipeline");
    cx.plan.expect("plan")
}

/// The plan of spec source `src` through the whole pipeline without the passes `skip`.
fn plan_skipping(name: &str, src: &str, skip: &[&str]) -> Plan {
    let config = frontend::parse_spec(name, src, &std::env::temp_dir()).expect("spec");
    let mut m = ir::Module::new(config);
    let options = PassOptions {
        skip: skip.iter().map(|s| s.to_string()).collect(),
        ..PassOptions::default()
    };
    let mut pm = PassManager::new(options).expect("pm");
    let (cx, _) = pm
        .run(&mut m, None, &mut std::io::sink())
        .expect("pipeline");
    cx.plan.expect("plan")
}

/// The shadow pools of asynchronous refreshes (`schedule::reserve::refresh_pools`) hold exactly
/// the most refreshes in flight at once, checked against a step-by-step replay of the refresh
/// runtime's order (installs whose deadline `launch + S` is reached, then the boundary's
/// launches; a task's previous refresh installed before its next launch) over 300 steps, for the
/// LLaMA 1.44B SOAP plan at staleness 5 and 2 — and fewer than one shadow per task.
#[test]
fn refresh_pools_hold_what_can_be_in_flight() {
    use schedule::{HostTask, Placement as P};
    for s in [5u32, 2] {
        let plan = soap_plan(|src| src.replace("staleness = 5", &format!("staleness = {s}")));
        let pools = schedule::reserve::refresh_pools(&plan);
        assert!(!pools.is_empty(), "S = {s}: no pools");
        let tasks: Vec<(bool, usize, u64, u64, u64)> = plan
            .host_tasks
            .iter()
            .map(|t| {
                let HostTask::EigenbasisRefresh {
                    factor,
                    frequency,
                    offset,
                    staleness,
                    placement,
                    ..
                } = t;
                let d = plan.buffer(*factor).shape[0];
                (
                    *placement == P::GpuSide,
                    d,
                    *frequency,
                    *offset,
                    u64::from(*staleness),
                )
            })
            .collect();
        let mut launched: Vec<Option<u64>> = vec![None; tasks.len()];
        let mut most = std::collections::HashMap::<(bool, usize), usize>::new();
        for t in 1..=300u64 {
            for (i, l) in launched.iter_mut().enumerate() {
                if l.is_some_and(|at| at + tasks[i].4 <= t) {
                    *l = None;
                }
            }
            for (i, &(_, _, f, off, st)) in tasks.iter().enumerate() {
                if st > 0 && t > 1 && schedule::refresh_due(t, f, off) {
                    launched[i] = Some(t);
                }
            }
            let mut now = std::collections::HashMap::<(bool, usize), usize>::new();
            for (i, l) in launched.iter().enumerate() {
                if l.is_some() {
                    *now.entry((tasks[i].0, tasks[i].1)).or_default() += 1;
                }
            }
            for (k, n) in now {
                let e = most.entry(k).or_default();
                *e = (*e).max(n);
            }
        }
        let total: usize = pools.iter().map(|p| p.count).sum();
        let async_tasks = tasks.iter().filter(|t| t.4 > 0).count();
        for p in &pools {
            assert_eq!(
                Some(&p.count),
                most.get(&(p.gpu_side, p.dim)),
                "S = {s}: pool {p:?}"
            );
        }
        assert!(
            total < async_tasks,
            "S = {s}: {total} shadows for {async_tasks} tasks"
        );
    }
}

/// The refresh shadows (factor snapshots and result bases of the asynchronous side-stream
/// refreshes) leave the device before any moment, because they cost a copy per refresh where a
/// moment costs one per step: on the LLaMA 1.44B SOAP plan, a budget that the shadows alone
/// meet pins them and offloads nothing else; 24 GiB pins them and offloads moments too; no
/// budget changes nothing. The engine reserve the compiler plans with drops by their bytes
/// (less the side stream's one staging set).
#[test]
fn refresh_shadows_leave_the_device_before_any_moment() {
    use schedule::reserve::{engine_reserve, refresh_pinned_bytes, refresh_shadow_device_bytes};
    const GIB: usize = 1 << 30;
    // `weight_casts = twice` in all three: `auto` would pick `once` without a budget and
    // `twice` under one, and that difference alone would meet a budget just below the free need.
    let budget = |b: &str| {
        let b = b.to_string();
        move |src: String| {
            src.replace(
                "target cuda {",
                &format!(
                    "target cuda {{\n  weight_casts = twice\n  gpu_memory = {b}\n  host_memory = 96GiB"
                ),
            )
        }
    };
    let free = soap_plan(|s| s.replace("target cuda {", "target cuda {\n  weight_casts = twice"));
    assert!(!free.memory.pinned_refresh_shadows);
    let on_device = refresh_shadow_device_bytes(&free);
    assert!(on_device > GIB, "{on_device} bytes of shadows");
    let need = |p: &Plan| {
        let d = p.memory.device_bytes();
        d + engine_reserve(p, d).total()
    };
    // Just below the unconstrained need: pinning the shadows is enough.
    let cap = need(&free) - on_device / 2;
    let just = soap_plan(budget(&format!("{cap}B")));
    assert!(just.memory.pinned_refresh_shadows);
    assert_eq!(
        just.memory.arena_bytes(ArenaKind::Host),
        0,
        "no moment moves"
    );
    assert_eq!(refresh_shadow_device_bytes(&just), 0);
    assert!(refresh_pinned_bytes(&just) >= on_device);
    assert!(need(&just) <= cap);
    let saved = engine_reserve(&free, 0).refresh - engine_reserve(&just, 0).refresh;
    assert!(saved > on_device * 9 / 10, "{saved} of {on_device}");
    // 24 GiB: the shadows and moments.
    let tight = soap_plan(budget("24GiB"));
    assert!(tight.memory.pinned_refresh_shadows);
    assert!(tight.memory.arena_bytes(ArenaKind::Host) > 0);
    assert!(need(&tight) <= 24 * GIB);
}

/// `prefetch-insertion`'s pipeline on the LLaMA 1.44B SOAP plan under `gpu_memory = 24GiB`
/// (`rematerialize = layers`, as bench/h200-tiers.sh runs it): the copies in for an update
/// that reads offloaded state are issued before the previous such update (double buffering),
/// and the staging buffers of two consecutive such updates never share bytes — else the copy
/// in of the next would have to wait for the copy out of the previous one and the two copy
/// streams could not overlap.
#[test]
fn copies_in_run_one_offloaded_update_ahead_into_bytes_of_their_own() {
    use schedule::{ArenaKind, BufferId, Op};
    let plan = soap_plan(|src| {
        src.replace(
            "target cuda {",
            "target cuda {\n  gpu_memory = 24GiB\n  host_memory = 96GiB",
        )
        .replace("train {", "train {\n  rematerialize = layers")
    });
    let opt = &plan.optimizer;
    // Staging buffer -> position of its copy in.
    let mut copied_in: std::collections::HashMap<BufferId, usize> = Default::default();
    for (i, op) in opt.iter().enumerate() {
        if let Op::CopyIn { dst, .. } = op {
            copied_in.insert(*dst, i);
        }
    }
    // The updates that read staging buffers, in order, with those buffers.
    let users: Vec<(usize, Vec<BufferId>)> = opt
        .iter()
        .enumerate()
        .filter(|(_, op)| !matches!(op, Op::CopyIn { .. } | Op::CopyOut { .. }))
        .filter_map(|(i, op)| {
            let staged: Vec<BufferId> = op
                .operands()
                .into_iter()
                .map(|(_, id)| id)
                .filter(|id| copied_in.contains_key(id))
                .collect();
            (!staged.is_empty()).then_some((i, staged))
        })
        .collect();
    // (41 once the refresh shadows moved to pinned memory first; 28 since the refresh swap
    // works in chunks and saved attention copies share slots, with the CUDA context counted.)
    assert!(users.len() > 20, "{} offloaded updates", users.len());
    let range = |id: BufferId| {
        let s = plan.memory.slot(id).expect("slot");
        assert_eq!(s.arena, ArenaKind::Activations, "{}", plan.buffer(id).name);
        (s.offset, s.offset + plan.buffer(id).size_bytes())
    };
    for w in users.windows(2) {
        let ((prev, prev_bufs), (_, bufs)) = (&w[0], &w[1]);
        for b in bufs {
            assert!(
                copied_in[b] < *prev,
                "`{}` is copied in at optimizer[{}], not before the previous offloaded update \
                 optimizer[{prev}]",
                plan.buffer(*b).name,
                copied_in[b]
            );
            for p in prev_bufs {
                let ((s1, e1), (s2, e2)) = (range(*b), range(*p));
                assert!(
                    e1 <= s2 || e2 <= s1,
                    "`{}` and `{}` share bytes",
                    plan.buffer(*b).name,
                    plan.buffer(*p).name
                );
            }
        }
    }
}

/// The bf16 qkv copies that saving attentions keep for their backward share slots of the
/// engine's attention-saved arena when they are live at disjoint times: under `rematerialize =
/// layers` each layer's recomputed attention makes its copy just before its backward, so one
/// slot serves all 24 layers; without it every forward copy lives until the backward. (`fuse`
/// makes LLaMA's rotated qkv bf16, which needs no copy at all; the test puts it back to f32, as
/// a plan whose qkv has another reader keeps it.)
#[test]
fn saved_attention_copies_share_one_slot_under_rematerialize_layers() {
    let f32_qkv = |mut plan: Plan| {
        assert!(schedule::reserve::saved_attention_qkvs(&plan).is_empty());
        let qkvs: Vec<schedule::BufferId> = plan
            .forward
            .iter()
            .chain(&plan.backward)
            .filter_map(|o| match o {
                schedule::Op::Attention { qkv, .. } => Some(*qkv),
                _ => None,
            })
            .collect();
        for q in qkvs {
            plan.buffers[q.index()].dtype = schedule::DType::F32;
        }
        plan
    };
    let plain = f32_qkv(soap_plan(|s| s));
    let remat = f32_qkv(soap_plan(|s| {
        s.replace("train {", "train {\n  rematerialize = layers")
    }));
    let qkv_bf16 = 4 * 1024 * 3 * 2048 * 2;
    for (plan, slots) in [(&plain, 24usize), (&remat, 1)] {
        let want = schedule::reserve::saved_attention_qkvs(plan);
        let (slot_of, lens) = schedule::reserve::saved_attention_slots(plan);
        assert_eq!(want.len(), 24);
        assert_eq!(slot_of.len(), 24);
        assert_eq!(lens.len(), slots, "{slot_of:?}");
        let reserve = schedule::reserve::engine_reserve(plan, 0);
        assert_eq!(reserve.attention_saved, slots * qkv_bf16);
    }
}

/// LLaMA 1.44B SOAP under `gpu_memory = 16GiB` with `rematerialize = layers`: the moments are
/// not enough (30.9 GiB needed with everything on the device, 10.7 GiB of moments), so the
/// pass also streams gradients to pinned host memory during the backward — the plan fits the
/// budget with the engine's own bytes, the clip reads partial sums, and each streamed
/// gradient is copied out after its last backward write and in before its first optimizer
/// use. Without a budget no gradient moves.
#[test]
fn sixteen_gib_streams_gradients_to_host_memory_after_the_moments() {
    const GIB: usize = 1 << 30;
    let plan = soap_plan(|s| {
        s.replacen("target cuda {", "target cuda {\n  gpu_memory = 16GiB", 1)
            .replacen("train {", "train {\n  rematerialize = layers", 1)
    });
    let device = plan.memory.device_bytes();
    let reserve = schedule::reserve::engine_reserve(&plan, device).total();
    assert!(device + reserve <= 16 * GIB, "{device} + {reserve}");
    let outs: Vec<_> = plan
        .backward
        .iter()
        .filter_map(|o| match o {
            schedule::Op::CopyOut { src, dst } => Some((*src, *dst)),
            _ => None,
        })
        .collect();
    assert!(!outs.is_empty(), "gradients leave the device");
    for &(g, home) in &outs {
        let (gb, hb) = (plan.buffer(g), plan.buffer(home));
        assert_eq!(gb.class, schedule::BufferClass::Gradient, "{}", gb.name);
        assert_eq!(plan.memory.tier(home), Some(ArenaKind::Host), "{}", hb.name);
        assert_eq!(plan.memory.tier(g), Some(ArenaKind::Activations));
        // Copied in once in the optimizer, scaled by the clip's factor before any other use.
        let pos_in = plan
            .optimizer
            .iter()
            .position(|o| matches!(o, schedule::Op::CopyIn { src, .. } if *src == home))
            .expect("copied back in");
        let staged = match &plan.optimizer[pos_in] {
            schedule::Op::CopyIn { dst, .. } => *dst,
            _ => unreachable!(),
        };
        let first_use = plan.optimizer[pos_in + 1..]
            .iter()
            .find(|o| o.operands().iter().any(|&(_, b)| b == staged))
            .expect("used");
        assert_eq!(first_use.name(), "scale_by_scalar", "{}", gb.name);
    }
    // The moments moved first: what stays is what the pass took back once gradients had
    // left (keeping a tensor's moments on the device also saves their staging bytes).
    let moments_left: usize = plan
        .buffers
        .iter()
        .enumerate()
        .filter(|(i, b)| {
            matches!(
                b.class,
                schedule::BufferClass::ExpAvg | schedule::BufferClass::ExpAvgSq
            ) && plan.memory.tier(schedule::BufferId(*i as u32)) == Some(ArenaKind::Persistent)
        })
        .map(|(_, b)| b.size_bytes())
        .sum();
    let moments: usize = plan
        .buffers
        .iter()
        .filter(|b| {
            matches!(
                b.class,
                schedule::BufferClass::ExpAvg | schedule::BufferClass::ExpAvgSq
            ) && !b.name.ends_with(".staged")
        })
        .map(|b| b.size_bytes())
        .sum();
    assert!(
        moments_left * 10 < moments,
        "{moments_left} of {moments} bytes of moments stayed"
    );
    let clip = plan
        .optimizer
        .iter()
        .find(|o| o.name() == "clip_grad_norm")
        .expect("clip");
    assert!(matches!(
        clip,
        schedule::Op::ClipGradNorm { grads, partials: Some(_), .. } if grads.is_empty()
    ));
    assert_eq!(
        plan.backward
            .iter()
            .filter(|o| o.name() == "grad_sum_squares")
            .count(),
        plan.params.len()
    );
    plan.verify().expect("verifies");
    let free = soap_plan(|s| s);
    assert!(!free.backward.iter().any(|o| o.name() == "copy_out"));
    assert!(!free.backward.iter().any(|o| o.name() == "grad_sum_squares"));
}

/// The Kronecker factors and eigenbases of SOAP refreshes move to the host tier when the moments
/// and gradients are not enough: each staged once a step (a factor in and out, a basis in only).
/// The 1.44B SOAP model with `rematerialize = layers` on the CPU target under `memory = 9GiB`
/// (the moments and gradients alone leave 10.9 GiB in the working memory), and on the CUDA
/// target under `gpu_memory = 12GiB` (they alone leave 14.05 GiB on the device): there the
/// device need counts the refreshers' and swap's `[d, d]` copies they are read through
/// (`reserve::RefreshStaging`), and the plan, engine included, fits the budget. The verifier
/// refuses a factor moved to NVMe.
#[test]
fn kronecker_factors_and_eigenbases_leave_the_device_last() {
    const GIB: usize = 1 << 30;
    let cpu = |src: String| {
        let cut = src.find("target cuda").expect("target block");
        format!(
            "{}target cpu {{\n  staleness = 5\n  memory = 9GiB\n  host_memory = 96GiB\n}}\n",
            &src[..cut]
        )
        .replacen("train {", "train {\n  rematerialize = layers", 1)
    };
    let cuda = |src: String| {
        src.replacen(
            "target cuda {",
            "target cuda {\n  gpu_memory = 12GiB\n  host_memory = 96GiB",
            1,
        )
        .replacen("train {", "train {\n  rematerialize = layers", 1)
    };
    for (target, plan, budget) in [
        ("cpu", soap_plan(cpu), 9 * GIB),
        ("cuda", soap_plan(cuda), 12 * GIB),
    ] {
        plan.verify().expect("verifies");
        let device = plan.memory.device_bytes();
        let reserve = schedule::reserve::engine_reserve(&plan, device).total();
        assert!(device + reserve <= budget, "{target}: {device} + {reserve}");
        let moved = |class: schedule::BufferClass| -> Vec<schedule::BufferId> {
            (0..plan.buffers.len())
                .map(|i| schedule::BufferId(i as u32))
                .filter(|&id| {
                    plan.buffer(id).class == class && plan.memory.tier(id) == Some(ArenaKind::Host)
                })
                .collect()
        };
        let factors = moved(schedule::BufferClass::KroneckerFactor);
        let bases = moved(schedule::BufferClass::Eigenbasis);
        assert!(
            !factors.is_empty() && !bases.is_empty(),
            "{target}: {} / {}",
            factors.len(),
            bases.len()
        );
        for &id in factors.iter().chain(&bases) {
            let ins = plan
                .optimizer
                .iter()
                .filter(|o| matches!(o, schedule::Op::CopyIn { src, .. } if *src == id))
                .count();
            let outs = plan
                .optimizer
                .iter()
                .filter(|o| matches!(o, schedule::Op::CopyOut { dst, .. } if *dst == id))
                .count();
            let factor = plan.buffer(id).class == schedule::BufferClass::KroneckerFactor;
            assert_eq!(
                (ins, outs),
                (1, usize::from(factor)),
                "{target}: {}",
                plan.buffer(id).name
            );
        }
        let staging = schedule::reserve::refresh_staging(&plan);
        if target == "cuda" {
            // The plan's refreshes are asynchronous: a GPU-side one reads its factor through
            // the snapshot, its basis through the side refresher's copy; its first basis and
            // its swaps run on the compute stream.
            assert!(staging.swap_basis && staging.sync_factor, "{staging:?}");
            let mut kept = plan.clone();
            for slot in &mut kept.memory.slots {
                if slot.arena == ArenaKind::Host {
                    slot.arena = ArenaKind::Persistent;
                }
            }
            assert_eq!(
                schedule::reserve::refresh_staging(&kept),
                Default::default()
            );
            assert!(
                schedule::reserve::engine_reserve(&plan, 0).refresh
                    > schedule::reserve::engine_reserve(&kept, 0).refresh
            );
        }
        // A factor on NVMe is refused.
        let f = factors[0].index();
        let mut bad = plan.clone();
        bad.memory.slots[f] = schedule::BufferSlot {
            arena: ArenaKind::Nvme,
            offset: 0,
        };
        bad.memory.budgets.nvme_dir = Some("/tmp".into());
        bad.memory.arenas.push(schedule::ArenaPlan {
            kind: ArenaKind::Nvme,
            bytes: bad.buffers[f].size_bytes().next_multiple_of(1 << 20),
        });
        let e = bad.verify().expect_err("a factor on NVMe");
        assert!(
            e.to_string().contains("factor and basis in the host tier"),
            "{target}: {e}"
        );
    }
}

/// The host budget is checked on the placement the pass ends with, not on the larger set its
/// search passes through before it takes back what is not needed; and tensors only pinned host
/// memory may take (gradients, Kronecker factors and eigenbases) claim it before the moments,
/// which may go to NVMe. The 1.44B SOAP plan with `layers` under `gpu_memory = 12GiB` moves
/// 18.24 GiB with an unlimited host tier: it compiles under `host_memory = 24GiB` (the
/// search's prefix alone was more), and under 20 GiB with an NVMe directory (the moments that
/// do not fit go there; without the directory it is an error naming the full host tier).
#[test]
fn host_budgets_are_checked_on_the_final_placement_host_only_tensors_first() {
    let spec = |host: &'static str, nvme: bool| {
        move |s: String| {
            let extra = if nvme {
                "\n  nvme = \"/tmp\"\n  nvme_memory = 40GiB"
            } else {
                ""
            };
            s.replacen(
                "target cuda {",
                &format!("target cuda {{\n  gpu_memory = 12GiB\n  host_memory = {host}{extra}"),
                1,
            )
            .replacen("train {", "train {\n  rematerialize = layers", 1)
        }
    };
    let plan = soap_plan(spec("24GiB", false));
    plan.verify().expect("verifies");
    assert!(plan.memory.arena_bytes(ArenaKind::Host) <= 24 << 30);
    let plan = soap_plan(spec("20GiB", true));
    plan.verify().expect("verifies");
    let on = |kind: ArenaKind, class: schedule::BufferClass| {
        (0..plan.buffers.len()).any(|i| {
            plan.buffers[i].class == class
                && plan.memory.tier(schedule::BufferId(i as u32)) == Some(kind)
        })
    };
    assert!(
        on(ArenaKind::Nvme, schedule::BufferClass::ExpAvg)
            || on(ArenaKind::Nvme, schedule::BufferClass::ExpAvgSq)
    );
    assert!(on(ArenaKind::Host, schedule::BufferClass::KroneckerFactor));
    // Without the directory the moments have nowhere to go.
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/specs/llama-1.4b-soap.asteria");
    let src = std::fs::read_to_string(path)
        .expect("spec")
        .replace("corpus = \"../data/medium\"", "corpus = builtin");
    let config = frontend::parse_spec("soap", &spec("20GiB", false)(src), &std::env::temp_dir())
        .expect("valid spec");
    let mut m = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pm");
    let err = pm
        .run(&mut m, None, &mut std::io::sink())
        .err()
        .expect("20 GiB of host memory without NVMe is too little")
        .to_string();
    assert!(
        err.contains("host_memory") && err.contains("no `nvme` directory"),
        "{err}"
    );
}

/// A moved Kronecker factor or eigenbasis is priced with its refreshes' own copies, amortised
/// over the refresh frequency, on top of the optimizer's staging copy: a GPU-placed refresh
/// copies the factor in and the stored basis in, and its swap the old basis in and the new one
/// out (the larger direction: two); a host-placed one only the swap's.
#[test]
fn moved_factors_and_bases_are_priced_with_their_refreshes_copies() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/specs/llama-1.4b-soap.asteria");
    let src = std::fs::read_to_string(path)
        .expect("spec")
        .replace("corpus = \"../data/medium\"", "corpus = builtin")
        .replacen(
            "target cuda {",
            "target cuda {\n  gpu_memory = 12GiB\n  host_memory = 96GiB",
            1,
        )
        .replacen("train {", "train {\n  rematerialize = layers", 1);
    let config = frontend::parse_spec("soap", &src, &std::env::temp_dir()).expect("valid spec");
    let mut m = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pm");
    let (mut cx, _) = pm
        .run(&mut m, Some("lower"), &mut std::io::sink())
        .expect("to lower");
    let desc = passes::precond_scheduling::target_description(&m.config.target).expect("desc");
    let budgets = m.config.target.budgets().clone();
    let plan = cx.plan.as_mut().expect("plan");
    let placement = passes::tier_placement::place(plan, &budgets, &desc).expect("placement");
    let (mut gpu, mut host) = (0, 0);
    for d in &placement.decisions {
        let class = plan.buffer(d.buffer).class;
        if !matches!(
            class,
            schedule::BufferClass::KroneckerFactor | schedule::BufferClass::Eigenbasis
        ) {
            continue;
        }
        let task = plan
            .host_tasks
            .iter()
            .find(|t| {
                t.operands()
                    .iter()
                    .any(|&(f, id)| id == d.buffer && (f == "factor" || f == "basis"))
            })
            .expect("a refresh owns it");
        let schedule::HostTask::EigenbasisRefresh {
            frequency,
            placement: where_,
            ..
        } = task;
        let on_gpu = *where_ == schedule::Placement::GpuSide;
        let per_refresh = match (class, on_gpu) {
            (schedule::BufferClass::KroneckerFactor, true) => 1.0,
            (schedule::BufferClass::KroneckerFactor, false) => 0.0,
            (_, true) => 2.0,
            (_, false) => 1.0,
        };
        let staging = passes::tier_placement::tier_copy_ms(&desc, ArenaKind::Host, d.bytes);
        let want = (1.0 + per_refresh / *frequency as f64) * staging;
        assert!(
            (d.copy_ms - want).abs() <= 1e-9 * want.max(1.0),
            "{}: {} ms, want {want}",
            d.name,
            d.copy_ms
        );
        if per_refresh > 0.0 {
            assert!(
                d.copy_ms > staging,
                "{}: its refreshes' copies count",
                d.name
            );
        }
        if on_gpu {
            gpu += 1;
        } else {
            host += 1;
        }
    }
    assert!(gpu + host > 0, "factors and bases moved");
    eprintln!("{gpu} moved under GPU-placed refreshes, {host} under host-placed ones");
}

/// `host_updates` in the placement report: every AdamW update of the 1.44B spec on the host,
/// with the predicted host time beside the step's forward and backward where the target
/// description has the host kernel's throughput (the `cpu` built-in, measured), and a note
/// saying it is not predicted where it has none (the `h200` built-in).
#[test]
fn host_updates_are_reported_with_their_predicted_host_time() {
    let (plan, report, placement) = compile(
        "cpu-host-updates",
        &spec("target cpu {\n  host_updates = delayed\n}"),
    );
    plan.verify().expect("verifies");
    let params = plan.params.len();
    assert_eq!(placement.host_updates.len(), params, "{report}");
    let (host, step) = placement
        .host_update_ms
        .expect("the cpu built-in predicts it");
    let elements: usize = plan
        .params
        .iter()
        .map(|p| plan.buffer(p.param).numel())
        .sum();
    let want = (elements * 28) as f64 / 32e6;
    assert!((host - want).abs() < 1e-6 * want, "{host} ms, want {want}");
    assert!(step > host, "2 cores: the forward and backward take longer");
    assert!(
        report.contains(&format!("host_updates = delayed: {params} AdamW update(s)"))
            && report.contains("hidden under the next step's forward and backward"),
        "{report}"
    );
    // The `h200` built-in carries the rate `asteria calibrate` measured on its 16 host cores.
    let (_, report, placement) = compile(
        "h200-host-updates",
        &spec("target cuda {\n  host_updates = sync\n}"),
    );
    let (host, _) = placement.host_update_ms.expect("h200 predicts it");
    let want = (elements * 28) as f64 / 159e6;
    assert!((host - want).abs() < 1e-6 * want, "{host} ms, want {want}");
    assert!(report.contains("sync: on the step"), "{report}");
    // A description without the rate (the `h200` one less it, as a calibration file) says
    // so instead of guessing.
    let mut desc = passes::cost_model::TargetDescription::builtin("h200").expect("h200");
    desc.host_update_gbps = None;
    let file =
        std::env::temp_dir().join(format!("asteria-no-host-rate-{}.json", std::process::id()));
    std::fs::write(&file, serde_json::to_string(&desc).expect("json")).expect("write");
    let (_, report, placement) = compile(
        "uncalibrated-host-updates",
        &spec(&format!(
            "target cuda {{\n  calibration = \"{}\"\n  host_updates = sync\n}}",
            file.display()
        )),
    );
    let _ = std::fs::remove_file(&file);
    assert!(placement.host_update_ms.is_none());
    assert!(
        report.contains("host update time not predicted"),
        "{report}"
    );
}

/// `copy-hoisting` issues the optimizer's copies in during the backward where the device bytes
/// allow: under `gpu_memory = 24GiB` the 1.44B AdamW plan offloads four moments (the
/// embedding's and the LM head's, 1.54 GiB), and all four come in during the backward, after
/// the last op that touched their staging bytes' earlier tenants, while the device arenas stay
/// within those of the plan without the pass (`--skip-pass copy-hoisting`), which is otherwise
/// the same op for op.
#[test]
fn copies_in_move_into_the_backward_without_growing_the_device_need() {
    use schedule::Op;
    let src = spec("target cuda {\n  gpu_memory = 24GiB\n  host_memory = 96GiB\n}");
    let run = |skip: &[&str]| plan_skipping("h200-24gib", &src, skip);
    let hoisted = run(&[]);
    let plain = run(&["copy-hoisting"]);
    hoisted.verify().expect("verifies");
    let copies_in = |ops: &[Op]| {
        ops.iter()
            .filter(|o| matches!(o, Op::CopyIn { .. }))
            .count()
    };
    assert_eq!(copies_in(&plain.backward), 0);
    assert_eq!(copies_in(&plain.optimizer), 4);
    assert_eq!(
        copies_in(&hoisted.backward),
        4,
        "every copy in during the backward"
    );
    assert_eq!(copies_in(&hoisted.optimizer), 0);
    assert!(
        hoisted.memory.device_bytes() <= plain.memory.device_bytes(),
        "device arenas {} > {} without the pass",
        hoisted.memory.device_bytes(),
        plain.memory.device_bytes()
    );
    // The same ops otherwise, in the same order.
    let others = |p: &Plan| -> Vec<String> {
        p.backward
            .iter()
            .chain(&p.optimizer)
            .filter(|o| !matches!(o, Op::CopyIn { .. }))
            .map(|o| format!("{o:?}"))
            .collect()
    };
    assert_eq!(others(&hoisted), others(&plain));
    // Each copy's staging bytes are free from its new position on: no transient buffer live
    // there shares a byte with it (the plan's memory is planned with the copy where it is).
    let residency = hoisted.residency();
    for (pos, op) in hoisted.step_ops() {
        let Op::CopyIn { dst, .. } = op else { continue };
        let live = residency[dst.index()]
            .live_range()
            .expect("staging is step-local");
        assert_eq!(
            live.first,
            pos,
            "`{}` lives from its copy",
            hoisted.buffer(*dst).name
        );
        let slot = hoisted.memory.slot(*dst).expect("slot");
        let end = slot.offset + hoisted.buffer(*dst).size_bytes();
        for (i, r) in residency.iter().enumerate() {
            let id = schedule::BufferId(i as u32);
            let Some(other) = r.live_range() else {
                continue;
            };
            let Some(s) = hoisted.memory.slot(id) else {
                continue;
            };
            if id == *dst || s.arena != ArenaKind::Activations || !other.overlaps(&live) {
                continue;
            }
            let e = s.offset + hoisted.buffer(id).size_bytes();
            assert!(
                e <= slot.offset || end <= s.offset,
                "`{}` and `{}` share bytes while both live",
                hoisted.buffer(*dst).name,
                hoisted.buffer(id).name
            );
        }
    }
}

/// `copy-out-overlap` on the 1.44B AdamW plan under `gpu_memory = 24GiB` and `16GiB`: the
/// optimizer's copies out of the moments' staging buffers may run on into the next step's
/// forward, at least through its first third, with the device arenas no larger than without
/// the pass (`--skip-pass copy-out-overlap`), the same ops, and no buffer live in
/// `forward[0..=k]` sharing a byte with a staging buffer copied out. The verifier refuses the
/// same plan claiming a longer carry than its offsets allow, or carried with a refresh task.
#[test]
fn copies_out_run_into_the_next_forward_without_growing_the_device_need() {
    use schedule::Op;
    for budget in ["24GiB", "16GiB"] {
        let src = spec(&format!(
            "target cuda {{\n  gpu_memory = {budget}\n  host_memory = 96GiB\n}}"
        ));
        let run = |skip: &[&str]| plan_skipping("carry", &src, skip);
        let carried = run(&[]);
        let plain = run(&["copy-out-overlap"]);
        assert_eq!(plain.memory.carried_copy_outs, None);
        let k = carried
            .memory
            .carried_copy_outs
            .unwrap_or_else(|| panic!("{budget}: nothing carried"));
        assert!(
            3 * (k + 1) >= carried.forward.len(),
            "{budget}: carried only to forward[{k}] of {}",
            carried.forward.len()
        );
        carried.verify().expect("verifies");
        assert!(carried.memory.device_bytes() <= plain.memory.device_bytes());
        assert_eq!(
            format!(
                "{:?}",
                (&carried.forward, &carried.backward, &carried.optimizer)
            ),
            format!("{:?}", (&plain.forward, &plain.backward, &plain.optimizer)),
            "only the offsets change"
        );
        let residency = carried.residency();
        let sources = carried.optimizer_copy_out_sources(&residency);
        let n_sources = sources.iter().filter(|&&s| s).count();
        let copies_out = carried
            .optimizer
            .iter()
            .filter(|o| matches!(o, Op::CopyOut { .. }))
            .count();
        assert!(n_sources > 0 && n_sources <= copies_out, "{budget}");
        let head = schedule::LiveRange { first: 0, last: k };
        let bytes = |p: &Plan, i: usize| {
            let s = p.memory.slots[i];
            (s.arena, s.offset, s.offset + p.buffers[i].size_bytes())
        };
        for (i, _) in sources.iter().enumerate().filter(|(_, s)| **s) {
            let (a, s0, e0) = bytes(&carried, i);
            assert_eq!(a, ArenaKind::Activations);
            for (j, r) in residency.iter().enumerate() {
                let Some(live) = r.live_range() else { continue };
                let (b, s1, e1) = bytes(&carried, j);
                if b == a && live.overlaps(&head) {
                    assert!(
                        e1 <= s0 || e0 <= s1,
                        "{budget}: `{}` (copied out) and `{}` (live in forward[0..={k}]) share bytes",
                        carried.buffers[i].name,
                        carried.buffers[j].name
                    );
                }
            }
        }
        // A claim the offsets do not back is refused before anything runs: the whole forward,
        // when the search stopped short of it (the 16 GiB plan).
        if k + 1 < carried.forward.len() {
            let mut forged = carried.clone();
            forged.memory.carried_copy_outs = Some(carried.forward.len() - 1);
            let e = forged
                .verify()
                .expect_err("a carry through the whole forward clashes");
            assert!(
                e.to_string()
                    .contains("copied out across the step boundary"),
                "{e}"
            );
        }
        let mut forged = carried.clone();
        forged.memory.carried_copy_outs = Some(carried.forward.len());
        assert!(forged.verify().is_err(), "a position past the forward");
    }
    // A SOAP plan (eigenbasis refresh tasks between steps) carries nothing, and the verifier
    // refuses one that claims to.
    let soap = soap_plan(|s| {
        s.replace(
            "target cuda {",
            "target cuda {\n  gpu_memory = 24GiB\n  host_memory = 96GiB",
        )
    });
    assert_eq!(soap.memory.carried_copy_outs, None);
    let mut forged = soap.clone();
    forged.memory.carried_copy_outs = Some(0);
    let e = forged.verify().expect_err("refresh tasks");
    assert!(e.to_string().contains("refresh tasks"), "{e}");
}
