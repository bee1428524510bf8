//! Placement file tests for three targets: the LLaMA-style 1.44B spec of `bench/specs/llama-1.4b-adamw.asteria`
//! (d 2048, 24 layers, batch 4×1024, AdamW) compiled for three targets, each
//! `--print-after tier-placement` report compared with `passes/tests/placement/<name>.expected`
//! (`ASTERIA_BLESS=1` rewrites them):
//! - `h200-24gib`: the H200 description with `gpu_memory = 24GiB` and `host_memory = 96GiB`:
//!   the plan needs ~24.9 GiB with the CUDA context, so the pass moves the largest moments to
//!   pinned host memory;
//! - `h200-unconstrained`: no budget, nothing moves;
//! - `gb10-24gib`: the GB10 description (unified memory) with the same budget and an NVMe
//!   directory: host memory is the device's there, so the same moments go to NVMe instead.
//! The test also asserts those choices directly, so a changed expectation cannot hide them.
//! `the_largest_model_on_three_targets_places_differently` does the same for LLaMA 6.9B SOAP,
//! larger than all three targets (the GB10 there at its 128 GB).
mod placement_common;
use passes::tier_placement::Placement;
use placement_common::*;
use schedule::{ArenaKind, Plan};
use std::path::PathBuf;

#[test]
fn three_targets_place_the_same_model_differently() {
    const GIB: usize = 1 << 30;
    let nvme_dir = std::env::temp_dir().display().to_string();
    let h200 = spec("target cuda {\n  gpu_memory = 24GiB\n  host_memory = 96GiB\n}");
    let free = spec("target cuda { }");
    let gb10 = spec(&format!(
        "target cuda {{\n  calibration = gb10\n  gpu_memory = 24GiB\n  nvme = \"{nvme_dir}\"\n}}"
    ));
    let (p_h200, r_h200, d_h200) = compile("h200-24gib", &h200);
    let (p_free, r_free, _) = compile("h200-unconstrained", &free);
    let (p_gb10, r_gb10, d_gb10) = compile("gb10-24gib", &gb10);
    // The report names the NVMe directory, which differs between machines.
    let r_gb10 = r_gb10.replace(&nvme_dir, "<nvme dir>");
    check_expected("h200-24gib", &r_h200);
    check_expected("h200-unconstrained", &r_free);
    check_expected("gb10-24gib", &r_gb10);

    // Unconstrained: everything on the device, more than 24 GiB of it.
    assert_eq!(p_free.memory.arena_bytes(ArenaKind::Host), 0);
    assert_eq!(p_free.memory.arena_bytes(ArenaKind::Nvme), 0);
    let d = p_free.memory.device_bytes();
    assert!(d + schedule::reserve::engine_reserve(&p_free, d).total() > 24 * GIB);
    // H200 at 24 GiB: moments to pinned host memory, the device under the budget with the
    // engine's own bytes and the CUDA context counted.
    assert_eq!(
        d_h200.reserve.context,
        schedule::reserve::CUDA_CONTEXT_BYTES
    );
    assert!(p_h200.memory.device_bytes() + d_h200.reserve.total() <= 24 * GIB);
    assert!(p_h200.memory.arena_bytes(ArenaKind::Host) > 0);
    assert_eq!(p_h200.memory.arena_bytes(ArenaKind::Nvme), 0);
    assert!(d_h200.host_note.is_none());
    // GB10 at 24 GiB: unified memory, so the same tensors go to NVMe, and the report says why.
    assert!(p_gb10.memory.device_bytes() <= 24 * GIB);
    assert_eq!(p_gb10.memory.arena_bytes(ArenaKind::Host), 0);
    assert!(p_gb10.memory.arena_bytes(ArenaKind::Nvme) > 0);
    assert!(r_gb10.contains("unified memory"), "{r_gb10}");
    let names = |p: &Placement| {
        p.decisions
            .iter()
            .map(|d| d.name.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        names(&d_h200),
        names(&d_gb10),
        "the same tensors leave the device"
    );
    // NVMe copies are predicted slower than the host link's.
    assert!(d_gb10.copy_ms() > d_h200.copy_ms());
}

/// The three targets on a model larger than all of them:
/// `bench/specs/llama-6.9b-soap.asteria` (d 4096, 32 layers, SwiGLU 11008, SOAP with
/// `max_precond_dim` 4096: 143.5 GiB on the device with everything there), compiled for
/// - `h200-24gib-6.9b-soap`: the H200 with `gpu_memory = 24GiB`, `host_memory = 96GiB` and an
///   NVMe directory: 120 GiB must leave the device, so after the refresh shadows and the
///   moments the gradients, Kronecker factors, eigenbases and parameters go too, pinned host
///   memory first (the H200's own link) and the rest of the moments to NVMe once the 96 GiB
///   are full;
/// - `h200-unconstrained-6.9b-soap`: no budget, nothing moves, and the report warns that the
///   plan needs more than the H200's 139.8 GiB;
/// - `gb10-128gb-6.9b-soap`: the GB10 description, whose 128 GB are shared by the CPU and the
///   GPU (`unified_memory`), with `gpu_memory = 128GB` and an NVMe directory: pinning host
///   memory there frees no device byte, so the pass skips the host tier (the refresh shadows
///   included) and puts the largest moments straight on NVMe, moving only the ~24 GiB the
///   budget is short.
/// Each report is compared with its `passes/tests/placement/<name>.expected`; the choices are
/// asserted directly too.
#[test]
fn the_largest_model_on_three_targets_places_differently() {
    const GIB: usize = 1 << 30;
    let nvme_dir = std::env::temp_dir().display().to_string();
    let spec69 = |target: &str| -> String {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../bench/specs/llama-6.9b-soap.asteria");
        let src = std::fs::read_to_string(path)
            .expect("spec")
            .replace("corpus = \"../data/medium\"", "corpus = builtin");
        let cut = src.find("target cuda").expect("target block");
        format!(
            "{}target cuda {{\n  staleness = 5\n  precision = bf16\n{target}}}\n",
            &src[..cut]
        )
    };
    let h200 = spec69(&format!(
        "  gpu_memory = 24GiB\n  host_memory = 96GiB\n  nvme = \"{nvme_dir}\"\n  nvme_memory = 200GiB\n"
    ));
    let free = spec69("");
    let gb10 = spec69(&format!(
        "  calibration = gb10\n  gpu_memory = 128GB\n  nvme = \"{nvme_dir}\"\n  nvme_memory = 200GiB\n"
    ));
    let (p_h200, r_h200, d_h200) = compile("h200-24gib-6.9b-soap", &h200);
    let (p_free, r_free, d_free) = compile("h200-unconstrained-6.9b-soap", &free);
    let (p_gb10, r_gb10, d_gb10) = compile("gb10-128gb-6.9b-soap", &gb10);
    let r_h200 = r_h200.replace(&nvme_dir, "<nvme dir>");
    let r_gb10 = r_gb10.replace(&nvme_dir, "<nvme dir>");
    check_expected("h200-24gib-6.9b-soap", &r_h200);
    check_expected("h200-unconstrained-6.9b-soap", &r_free);
    check_expected("gb10-128gb-6.9b-soap", &r_gb10);

    // Unconstrained: nothing moves, and the plan is said not to fit the H200.
    assert_eq!(p_free.memory.arena_bytes(ArenaKind::Host), 0);
    assert_eq!(p_free.memory.arena_bytes(ArenaKind::Nvme), 0);
    assert!(d_free.decisions.is_empty() && d_free.shadows.is_none());
    let h200_memory = d_free
        .device_memory
        .expect("the h200 description has its memory");
    assert!(d_free.device_need as u64 > h200_memory);
    assert!(r_free.contains("; warning: the plan needs"), "{r_free}");
    // Neither budgeted plan is warned about: each fits its device.
    assert!(d_h200.device_memory_warning().is_none());
    assert!(d_gb10.device_memory_warning().is_none());

    // H200 at 24 GiB: both tiers, and every kind of state the pass may move.
    let budget = |p: &Plan, d: &Placement| p.memory.device_bytes() + d.reserve.total();
    assert!(budget(&p_h200, &d_h200) <= 24 * GIB);
    assert!(p_h200.memory.arena_bytes(ArenaKind::Host) > 0);
    assert!(p_h200.memory.arena_bytes(ArenaKind::Nvme) > 0);
    assert!(
        d_h200.shadows.is_some(),
        "the refresh shadows are pinned first"
    );
    // Everything pinned fits `host_memory`: the host tier, the refresh shadows and the CUDA
    // engine's NVMe bounce slots (four of the largest NVMe tensor).
    let bounce = schedule::reserve::nvme_bounce_bytes(&p_h200);
    assert_eq!(bounce, d_h200.nvme_bounce);
    let largest_nvme = d_h200
        .decisions
        .iter()
        .filter(|d| d.tier == ArenaKind::Nvme)
        .map(|d| d.bytes)
        .max()
        .expect("NVMe tensors");
    assert_eq!(bounce, 4 * largest_nvme);
    assert!(
        p_h200.memory.arena_bytes(ArenaKind::Host)
            + schedule::reserve::refresh_pinned_bytes(&p_h200)
            + bounce
            <= 96 * GIB,
        "pinned memory over host_memory"
    );
    let kinds = |d: &Placement, tier: ArenaKind| {
        let mut k: Vec<String> = d
            .decisions
            .iter()
            .filter(|x| x.tier == tier)
            .map(|x| x.what.clone())
            .collect();
        k.sort();
        k.dedup();
        k
    };
    let host_kinds = kinds(&d_h200, ArenaKind::Host);
    for what in [
        "exp_avg",
        "exp_avg_sq",
        "gradient",
        "kronecker_factor",
        "eigenbasis",
        "parameter",
    ] {
        assert!(
            host_kinds.iter().any(|k| k == what),
            "h200 at 24 GiB moves no {what} to the host: {host_kinds:?}"
        );
    }
    // NVMe holds moments only (the others move every step or between steps through
    // the host link).
    for k in kinds(&d_h200, ArenaKind::Nvme) {
        assert!(k.starts_with("exp_avg"), "{k} on NVMe");
    }

    // GB10 at 128 GB: unified memory, so no host tier and no pinned shadows; moments to NVMe,
    // only as many bytes as the budget is short (plus one tensor).
    assert!(budget(&p_gb10, &d_gb10) as u64 <= 128_000_000_000);
    assert_eq!(p_gb10.memory.arena_bytes(ArenaKind::Host), 0);
    assert!(d_gb10.shadows.is_none());
    assert!(r_gb10.contains("unified memory"), "{r_gb10}");
    assert_eq!(
        kinds(&d_gb10, ArenaKind::Nvme),
        vec!["exp_avg".to_string(), "exp_avg_sq".to_string()]
    );
    let short = d_gb10.device_need - 128_000_000_000usize;
    let moved = p_gb10.memory.arena_bytes(ArenaKind::Nvme);
    let largest = d_gb10.decisions.iter().map(|d| d.bytes).max().unwrap_or(0);
    assert!(
        moved >= short && moved < short + 2 * largest + GIB,
        "{moved} for {short}"
    );
    // The three choose differently.
    assert!(d_gb10.decisions.len() < d_h200.decisions.len());
    assert_ne!(
        p_h200.memory.arena_bytes(ArenaKind::Nvme),
        p_gb10.memory.arena_bytes(ArenaKind::Nvme)
    );
}
