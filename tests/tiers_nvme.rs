//! The NVMe tier failing under the CPU engine: a truncated or byte-flipped NVMe file is detected
//! on the next read and the step stops with a clear error naming the file and the op; in a
//! training run the error also names the newest checkpoint, and the run resumed from it gives
//! the uninterrupted run's losses bit for bit.
mod tiers_common;
use engine::{CpuEngine, EngineError, EngineOptions};
use schedule::{ArenaKind, Budgets, Plan};
use tiers_common::*;

#[test]
fn a_corrupt_or_truncated_nvme_file_stops_the_step_with_a_clear_error() {
    use std::os::unix::fs::FileExt;
    for damage in ["flip", "truncate"] {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).expect("tempdir");
        let budgets = Budgets {
            device: Some(budget_below(Opt::AdamW, 2 * MIB)),
            host: Some(MIB),
            nvme_dir: Some(dir.path().display().to_string()),
            nvme: None,
            ..Default::default()
        };
        let plan = compile(config(Opt::AdamW, budgets)).expect("plan");
        assert!(plan.memory.arena_bytes(ArenaKind::Nvme) > 0);
        let (x, y) = batch(&plan);
        let mut e = engine(plan);
        step(&mut e, &x, &y, 1).expect("a clean step");
        let path = nvme_file(dir.path());
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open");
        if damage == "flip" {
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, 100).expect("read");
            f.write_all_at(&[b[0] ^ 0x40], 100).expect("write");
        } else {
            f.set_len(1000).expect("truncate");
        }
        drop(f);
        let err = step(&mut e, &x, &y, 2).expect_err("the damaged state is not used");
        let text = err.to_string();
        assert!(matches!(err, EngineError::Tier(_)), "{damage}: {err:?}");
        let want = if damage == "flip" {
            "corrupt"
        } else {
            "truncated"
        };
        assert!(
            text.contains(want) && text.contains(&path.display().to_string()),
            "{damage}: {text}"
        );
        assert!(text.contains("copy_in"), "{damage}: names the op: {text}");
    }
}

/// A CPU engine whose NVMe file is damaged (a byte flipped) just before the optimizer program
/// of step `at` reads it: what a failing drive does mid-run.
struct DamagedAt {
    inner: CpuEngine<f32>,
    at: u64,
    dir: std::path::PathBuf,
}

impl engine::StepExecutor for DamagedAt {
    fn plan(&self) -> &Plan {
        engine::StepExecutor::plan(&self.inner)
    }
    fn load_batch(&mut self, tokens: &[i32], targets: &[i32]) -> Result<(), EngineError> {
        engine::StepExecutor::load_batch(&mut self.inner, tokens, targets)
    }
    fn forward(&mut self) -> Result<f64, EngineError> {
        engine::StepExecutor::forward(&mut self.inner)
    }
    fn backward(&mut self, micro: u64) -> Result<(), EngineError> {
        engine::StepExecutor::backward(&mut self.inner, micro)
    }
    fn optimizer_step(&mut self, t: u64, lr_multiplier: f64) -> Result<bool, EngineError> {
        if t == self.at {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(nvme_file(&self.dir))
                .expect("open the NVMe file");
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, 100).expect("read");
            f.write_all_at(&[b[0] ^ 0x40], 100).expect("write");
        }
        engine::StepExecutor::optimizer_step(&mut self.inner, t, lr_multiplier)
    }
    fn run_host_tasks(&mut self, t: u64) -> Result<engine::HostTaskReport, EngineError> {
        engine::StepExecutor::run_host_tasks(&mut self.inner, t)
    }
    fn stats(&self) -> &engine::EngineStats {
        engine::StepExecutor::stats(&self.inner)
    }
    fn describe(&self) -> String {
        engine::StepExecutor::describe(&self.inner)
    }
    fn synchronize(&mut self) -> Result<(), EngineError> {
        engine::StepExecutor::synchronize(&mut self.inner)
    }
    fn read_state(&self, name: &str) -> Result<Vec<f64>, EngineError> {
        engine::StepExecutor::read_state(&self.inner, name)
    }
    fn read_range(&self, name: &str, start: usize, len: usize) -> Result<Vec<f64>, EngineError> {
        engine::StepExecutor::read_range(&self.inner, name, start, len)
    }
    fn write_state(&mut self, name: &str, values: &[f64]) -> Result<(), EngineError> {
        engine::StepExecutor::write_state(&mut self.inner, name, values)
    }
    fn stats_mut(&mut self) -> Result<&mut engine::EngineStats, EngineError> {
        engine::StepExecutor::stats_mut(&mut self.inner)
    }
    fn refreshes_initialized(&self) -> Vec<bool> {
        engine::StepExecutor::refreshes_initialized(&self.inner)
    }
    fn finish(&mut self) -> Result<(), EngineError> {
        engine::StepExecutor::finish(&mut self.inner)
    }
    fn set_refreshes_initialized(&mut self, flags: &[bool]) -> Result<(), EngineError> {
        engine::StepExecutor::set_refreshes_initialized(&mut self.inner, flags)
    }
    fn drain_refreshes(&mut self, t: u64) -> Result<(), EngineError> {
        engine::StepExecutor::drain_refreshes(&mut self.inner, t)
    }
    fn checkpoint_refreshes(
        &mut self,
        t: u64,
    ) -> Result<Vec<engine::checkpoint::InFlightRefresh>, EngineError> {
        engine::StepExecutor::checkpoint_refreshes(&mut self.inner, t)
    }
    fn restore_refreshes(
        &mut self,
        refreshes: &[engine::checkpoint::InFlightRefresh],
    ) -> Result<(), EngineError> {
        engine::StepExecutor::restore_refreshes(&mut self.inner, refreshes)
    }
}

/// Nothing trained is lost when the NVMe tier fails mid-run: the training loop stops at the
/// step whose copy in reads the damaged block, its error names that step and the newest
/// checkpoint (and how to continue from it), the checkpoints written before stay, and the run
/// resumed from the newest gives the uninterrupted run's losses bit for bit, and without a
/// `--checkpoint-dir` the error says that none was written.
#[test]
fn a_failing_nvme_tier_keeps_the_newest_checkpoint_and_the_run_resumes_from_it() {
    let nvme = tempfile::tempdir_in(std::env::temp_dir()).expect("tempdir");
    let budgets = Budgets {
        device: Some(budget_below(Opt::AdamW, 2 * MIB)),
        host: Some(MIB),
        nvme_dir: Some(nvme.path().display().to_string()),
        nvme: None,
        ..Default::default()
    };
    let plan = compile(config(Opt::AdamW, budgets)).expect("plan");
    assert!(plan.memory.arena_bytes(ArenaKind::Nvme) > 0);
    let engine_opts = EngineOptions {
        threads: Some(2),
        synchronous_refresh: true,
        ..EngineOptions::default()
    };
    let opts =
        |ckpt: Option<&std::path::Path>, resume: Option<&std::path::Path>| engine::TrainOptions {
            steps: Some(8),
            quiet: true,
            engine: engine_opts.clone(),
            checkpoint_dir: ckpt.map(|p| p.to_path_buf()),
            checkpoint_every: ckpt.map(|_| 2),
            checkpoint_keep: 10,
            resume: resume.map(|p| p.to_path_buf()),
            ..Default::default()
        };
    let reference = engine::train(&plan, &opts(None, None)).expect("the uninterrupted run");
    assert_eq!(reference.train_losses.len(), 8);

    let root = tempfile::tempdir_in(std::env::temp_dir()).expect("tempdir");
    let ckpts = root.path().join("ck");
    let mut damaged = DamagedAt {
        inner: CpuEngine::<f32>::new(plan.clone(), engine_opts.clone()).expect("engine"),
        at: 5,
        dir: nvme.path().to_path_buf(),
    };
    let err = engine::train_with(&mut damaged, &opts(Some(&ckpts), None))
        .expect_err("the damaged block is not used");
    drop(damaged);
    let text = err.to_string();
    assert!(matches!(err, EngineError::Tier(_)), "{err:?}");
    assert!(
        text.contains("corrupt")
            && text.contains("step 5 did not finish")
            && text.contains("after step 4")
            && text.contains(&ckpts.join("step-000000004").display().to_string())
            && text.contains(&format!("--resume {}", ckpts.display())),
        "{text}"
    );
    for kept in ["step-000000002", "step-000000004"] {
        assert!(ckpts.join(kept).join("meta.json").is_file(), "{kept} kept");
    }
    assert!(!ckpts.join("step-000000006").exists());

    let resumed = engine::train(&plan, &opts(None, Some(&ckpts))).expect("the resumed run");
    assert_eq!(resumed.train_losses.len(), 4, "steps 5..=8");
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&resumed.train_losses),
        bits(&reference.train_losses[4..]),
        "the resumed run continues the uninterrupted one bit for bit"
    );

    // Without checkpoints the error says so.
    let mut damaged = DamagedAt {
        inner: CpuEngine::<f32>::new(plan.clone(), engine_opts.clone()).expect("engine"),
        at: 3,
        dir: nvme.path().to_path_buf(),
    };
    let text = engine::train_with(&mut damaged, &opts(None, None))
        .expect_err("damaged")
        .to_string();
    assert!(
        text.contains("step 3 did not finish") && text.contains("no checkpoint was written"),
        "{text}"
    );
}
