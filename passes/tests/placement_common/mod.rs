//! Helpers of the placement tests (`tests/tier_placement.rs`, `tests/placement_targets.rs`):
//! the 1.44B spec with a given target block, the plan and `--print-after tier-placement` report
//! of a spec, and the golden-file comparison.
#![allow(dead_code)] // each test file uses its own subset
use passes::tier_placement::Placement;
use passes::{PassManager, PassOptions};
use schedule::{ArenaKind, Plan};
use std::path::PathBuf;

pub fn spec(target: &str) -> String {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/specs/llama-1.4b-adamw.asteria");
    let src = std::fs::read_to_string(path).expect("spec");
    let src = src.replace("corpus = \"../data/medium\"", "corpus = builtin");
    let cut = src.find("target cuda").expect("target block");
    format!("{}{target}\n", &src[..cut])
}

/// The plan and the tier-placement report of `spec`.
pub fn compile(name: &str, src: &str) -> (Plan, String, Placement) {
    let dir = std::env::temp_dir();
    let config = frontend::parse_spec(name, src, &dir).expect("valid spec");
    let mut m = ir::Module::new(config);
    let mut pm = PassManager::new(PassOptions::default()).expect("pm");
    let (cx, _) = pm
        .run(&mut m, None, &mut std::io::sink())
        .expect("pipeline");
    let plan = cx.plan.expect("plan");
    // The placement again, alone, for its report (the pipeline's pass object is internal).
    let mut m = ir::Module::new(frontend::parse_spec(name, src, &dir).expect("spec"));
    let mut pm = PassManager::new(PassOptions::default()).expect("pm");
    let (mut cx, _) = pm
        .run(&mut m, Some("lower"), &mut std::io::sink())
        .expect("to lower");
    let desc = passes::precond_scheduling::target_description(&m.config.target).expect("desc");
    let budgets = m.config.target.budgets().clone();
    let placement = passes::tier_placement::place(cx.plan.as_mut().expect("plan"), &budgets, &desc)
        .expect("placement");
    let mut report = passes::tier_placement::report(&placement);
    report.push_str(&format!(
        "; planned device arenas {} bytes, host {} bytes, nvme {} bytes\n",
        plan.memory.device_bytes(),
        plan.memory.arena_bytes(ArenaKind::Host),
        plan.memory.arena_bytes(ArenaKind::Nvme)
    ));
    (plan, report, placement)
}

pub fn check_expected(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/placement")
        .join(format!("{name}.expected"));
    if std::env::var_os("ASTERIA_BLESS").is_some() {
        std::fs::write(&path, actual).expect("bless");
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("{}: missing; run with ASTERIA_BLESS=1", path.display()));
    assert_eq!(want, actual, "{name}: the placement changed");
}
