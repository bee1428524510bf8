//! The plan verifier's range checks: every hyperparameter and size a plan carries is checked
//! against the range its spec key has ([`crate::limits`]), and the buffers together against
//! [`crate::limits::MAX_PLAN_BYTES`], so a hand-edited plan (`lr: -1`, `eval_batches: 0`,
//! `threads: 0`) is refused before an engine allocates or runs anything.
use crate::limits::{self, FloatRange, IntRange};
use crate::{HostTask, Init, Op, Plan, PlanError, TargetPlan};

fn int(field: impl Into<String>, x: u64, range: IntRange) -> Result<(), PlanError> {
    if range.contains_u64(x) {
        return Ok(());
    }
    Err(PlanError::OutOfRange {
        field: field.into(),
        value: x.to_string(),
        range: range.to_string(),
    })
}

fn float(field: impl Into<String>, x: f64, range: FloatRange) -> Result<(), PlanError> {
    if range.contains(x) {
        return Ok(());
    }
    Err(PlanError::OutOfRange {
        field: field.into(),
        value: x.to_string(),
        range: range.to_string(),
    })
}

/// AdamW / SOAP hyperparameters of the op at `at`.
fn optimizer_hyper(
    at: &str,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
) -> Result<(), PlanError> {
    float(format!("{at}: lr"), lr, limits::LR)?;
    float(format!("{at}: beta1"), betas.0, limits::BETA)?;
    float(format!("{at}: beta2"), betas.1, limits::BETA)?;
    float(format!("{at}: eps"), eps, limits::EPS)?;
    float(
        format!("{at}: weight_decay"),
        weight_decay,
        limits::WEIGHT_DECAY,
    )
}

impl Plan {
    /// Checks the plan's hyperparameters (optimizer, normalisation, RoPE, init), its data,
    /// training and target settings against [`crate::limits`], and the bytes of all buffers
    /// together against [`limits::MAX_PLAN_BYTES`]. Buffer shapes must already be checked
    /// (non-empty, at most [`limits::MAX_BUFFER_ELEMENTS`] elements each).
    pub(crate) fn verify_ranges(&self) -> Result<(), PlanError> {
        let d = &self.data;
        int("data.batch_size", d.batch_size as u64, limits::BATCH_SIZE)?;
        int("data.seq_len", d.seq_len as u64, limits::SEQ_LEN)?;
        float("data.val_fraction", d.val_fraction, limits::VAL_FRACTION)?;
        let t = &self.train;
        int("train.steps", t.steps, limits::STEPS)?;
        int("train.warmup_steps", t.warmup_steps, limits::WARMUP)?;
        if t.warmup_steps > t.steps {
            return Err(PlanError::Invalid(format!(
                "train.warmup_steps ({}) exceeds train.steps ({})",
                t.warmup_steps, t.steps
            )));
        }
        float("train.min_lr_ratio", t.min_lr_ratio, limits::MIN_LR_RATIO)?;
        int(
            "train.eval_interval",
            t.eval_interval,
            limits::EVAL_INTERVAL,
        )?;
        int("train.eval_batches", t.eval_batches, limits::EVAL_BATCHES)?;
        int("train.grad_accum", t.grad_accum, limits::GRAD_ACCUM)?;
        if let Some(n) = t.max_skipped_steps {
            int("train.max_skipped_steps", n, limits::MAX_SKIPPED_STEPS)?;
        }
        match &self.target {
            TargetPlan::Cpu {
                threads, staleness, ..
            } => {
                if let Some(n) = threads {
                    int("target.threads", *n as u64, limits::THREADS)?;
                }
                int("target.staleness", u64::from(*staleness), limits::STALENESS)?;
            }
            TargetPlan::Cuda {
                device, staleness, ..
            } => {
                int("target.device", u64::from(*device), limits::DEVICE)?;
                int("target.staleness", u64::from(*staleness), limits::STALENESS)?;
            }
        }
        for (section, prog) in [
            ("forward", &self.forward),
            ("backward", &self.backward),
            ("optimizer", &self.optimizer),
        ] {
            for (i, op) in prog.iter().enumerate() {
                let at = format!("{section}[{i}] ({})", op.name());
                match op {
                    Op::AdamW {
                        lr,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        ..
                    } => optimizer_hyper(&at, *lr, (*beta1, *beta2), *eps, *weight_decay)?,
                    Op::SoapUpdate { hyper: h, .. } => {
                        optimizer_hyper(&at, h.lr, (h.beta1, h.beta2), h.eps, h.weight_decay)?
                    }
                    Op::KlShampooUpdate { hyper: h, .. } => {
                        optimizer_hyper(&at, h.lr, (h.beta1, 0.0), h.eps, h.weight_decay)?;
                        float(format!("{at}: shampoo_beta"), h.shampoo_beta, limits::BETA)?;
                        float(
                            format!("{at}: init_factor"),
                            h.init_factor,
                            limits::INIT_FACTOR,
                        )?;
                        float(
                            format!("{at}: max_clamp_value"),
                            h.max_clamp_value,
                            limits::MAX_CLAMP_VALUE,
                        )?;
                    }
                    Op::ShampooUpdate { hyper: h, .. } => {
                        optimizer_hyper(&at, h.lr, (h.beta1, 0.0), h.epsilon, h.weight_decay)?;
                        float(format!("{at}: beta2"), h.beta2, limits::SHAMPOO_BETA2)?;
                        int(
                            format!("{at}: max_preconditioner_dim"),
                            h.max_preconditioner_dim,
                            limits::MAX_PRECONDITIONER_DIM,
                        )?;
                        if h.grafting {
                            float(
                                format!("{at}: grafting_beta2"),
                                h.grafting_beta2,
                                limits::BETA,
                            )?;
                            float(
                                format!("{at}: grafting_epsilon"),
                                h.grafting_epsilon,
                                limits::EPS,
                            )?;
                        }
                    }
                    Op::ElementwiseUpdate { rule, .. } => {
                        float(format!("{at}: lr"), rule.lr, limits::LR)?;
                        for s in &rule.scalars {
                            for (k, x) in s.hyperparameters() {
                                match k {
                                    "weight_decay" => {
                                        float(format!("{at}: {k}"), x, limits::WEIGHT_DECAY)?
                                    }
                                    _ => float(format!("{at}: {k}"), x, limits::BETA)?,
                                }
                            }
                        }
                    }
                    Op::SoapFactorUpdate { shampoo_beta, .. } => {
                        float(format!("{at}: shampoo_beta"), *shampoo_beta, limits::BETA)?
                    }
                    Op::ShampooFactorUpdate {
                        beta2,
                        max_preconditioner_dim,
                        ..
                    } => {
                        float(format!("{at}: beta2"), *beta2, limits::SHAMPOO_BETA2)?;
                        int(
                            format!("{at}: max_preconditioner_dim"),
                            *max_preconditioner_dim,
                            limits::MAX_PRECONDITIONER_DIM,
                        )?;
                    }
                    Op::ShampooPrecondition {
                        max_preconditioner_dim,
                        ..
                    }
                    | Op::Graft {
                        max_preconditioner_dim,
                        ..
                    } => int(
                        format!("{at}: max_preconditioner_dim"),
                        *max_preconditioner_dim,
                        limits::MAX_PRECONDITIONER_DIM,
                    )?,
                    Op::KlScale { eps, .. } => float(format!("{at}: eps"), *eps, limits::EPS)?,
                    Op::KlFactorUpdate {
                        shampoo_beta,
                        init_factor,
                        max_clamp_value,
                        ..
                    } => {
                        float(format!("{at}: shampoo_beta"), *shampoo_beta, limits::BETA)?;
                        float(
                            format!("{at}: init_factor"),
                            *init_factor,
                            limits::INIT_FACTOR,
                        )?;
                        float(
                            format!("{at}: max_clamp_value"),
                            *max_clamp_value,
                            limits::MAX_CLAMP_VALUE,
                        )?;
                    }
                    Op::ClipGradNorm {
                        max_norm: Some(m), ..
                    } => float(format!("{at}: max_norm"), *m, limits::GRAD_CLIP)?,
                    Op::LayerNorm { eps, .. }
                    | Op::LayerNormBackward { eps, .. }
                    | Op::RmsNorm { eps, .. }
                    | Op::RmsNormBackward { eps, .. } => {
                        float(format!("{at}: eps"), *eps, limits::NORM_EPS)?
                    }
                    Op::Rope { theta, .. } | Op::RopeBackward { theta, .. } => {
                        float(format!("{at}: theta"), *theta, limits::ROPE_THETA)?
                    }
                    _ => {}
                }
            }
        }
        for (i, task) in self.host_tasks.iter().enumerate() {
            let HostTask::EigenbasisRefresh {
                frequency,
                staleness,
                root,
                ..
            } = task;
            let at = format!("host_tasks[{i}]");
            if let Some(r) = root {
                float(format!("{at}: epsilon"), r.epsilon, limits::EPS)?;
            }
            int(
                format!("{at}: frequency"),
                *frequency,
                limits::PRECONDITION_FREQUENCY,
            )?;
            int(
                format!("{at}: staleness"),
                u64::from(*staleness),
                limits::STALENESS,
            )?;
        }
        let mut total: u64 = 0;
        for (i, b) in self.buffers.iter().enumerate() {
            if let Init::Normal { std } = b.init {
                float(
                    format!("buffer {i} `{}`: init std", b.name),
                    std,
                    limits::INIT_STD,
                )?;
            }
            if let Init::CopyOf { of } = b.init {
                let ok = self.buffers.get(of.index()).is_some_and(|o| {
                    o.shape == b.shape
                        && o.dtype == b.dtype
                        && !matches!(o.init, Init::CopyOf { .. })
                });
                if !ok {
                    return Err(PlanError::Invalid(format!(
                        "buffer {i} `{}`: init copy_of buffer {} must name a buffer of the same \
                         shape and dtype that is not itself a copy",
                        b.name, of.0
                    )));
                }
            }
            let bytes = b
                .shape
                .iter()
                .try_fold(b.dtype.size_bytes() as u64, |a, &d| a.checked_mul(d as u64));
            total = bytes.and_then(|n| total.checked_add(n)).unwrap_or(u64::MAX);
        }
        if total > limits::MAX_PLAN_BYTES {
            return Err(PlanError::Invalid(format!(
                "the plan's buffers take {total} bytes together, more than the {} bytes \
                 (16 TiB) any target holds",
                limits::MAX_PLAN_BYTES
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::memory::tests::plan;
    use crate::{Op, PlanError, TargetPlan};

    fn refused(edit: impl FnOnce(&mut crate::Plan)) -> String {
        let mut p = plan();
        edit(&mut p);
        match p.verify() {
            Err(e @ PlanError::OutOfRange { .. }) => e.to_string(),
            other => panic!("expected an out-of-range error, got {other:?}"),
        }
    }

    fn set_adamw(p: &mut crate::Plan, f: impl FnOnce(&mut f64, &mut f64, &mut f64)) {
        match &mut p.optimizer[0] {
            Op::AdamW { lr, beta1, eps, .. } => f(lr, beta1, eps),
            other => panic!("the fixture's optimizer op is AdamW, found {other:?}"),
        }
    }

    #[test]
    fn the_fixture_is_in_range() {
        assert_eq!(plan().verify(), Ok(()));
    }

    #[test]
    fn tampered_hyperparameters_are_refused_with_the_range() {
        let e = refused(|p| set_adamw(p, |lr, _, _| *lr = -1.0));
        assert_eq!(
            e,
            "optimizer[0] (adam_w): lr = -1 is outside the allowed range (0, 10]"
        );
        let e = refused(|p| set_adamw(p, |_, b1, _| *b1 = 1.5));
        assert!(e.contains("beta1 = 1.5") && e.contains("[0, 1)"), "{e}");
        let e = refused(|p| set_adamw(p, |_, _, eps| *eps = 0.0));
        assert!(e.contains("eps = 0") && e.contains("(0, 1]"), "{e}");
        let e = refused(|p| p.train.eval_batches = 0);
        assert_eq!(
            e,
            "train.eval_batches = 0 is outside the allowed range 1..=100_000"
        );
        let e = refused(|p| p.train.max_skipped_steps = Some(0));
        assert_eq!(
            e,
            "train.max_skipped_steps = 0 is outside the allowed range 1..=1_000_000_000"
        );
        let e = refused(|p| {
            p.target = TargetPlan::Cpu {
                threads: Some(0),
                staleness: 0,
                eigensolver: crate::Eigensolver::Faer,
            }
        });
        assert!(e.contains("target.threads = 0"), "{e}");
        let e = refused(|p| p.data.batch_size = usize::MAX);
        assert!(e.contains("data.batch_size"), "{e}");
    }

    #[test]
    fn warmup_longer_than_the_run_is_refused() {
        let mut p = plan();
        p.train.warmup_steps = p.train.steps + 1;
        assert!(matches!(p.verify(), Err(PlanError::Invalid(m)) if m.contains("warmup")));
    }
}
