//! Text generation from a checkpoint (`asteria sample`): the plan stored in the checkpoint runs
//! its forward program with the checkpoint's weights, one new token per pass, on the CPU
//! engine ([`generate`]; it runs CPU and CUDA plans) or any [`StepExecutor`] ([`generate_with`],
//! the CUDA engine for `asteria sample --device cuda`).
//!
//! The plan's batch is `B × T` tokens; generation uses row 0: the last `T` tokens of the
//! prompt and what was generated so far, left-aligned, the rest of the batch zeros (causal
//! attention keeps positions after the context from influencing it). The next token is drawn
//! from the logits of the context's last position (the plan's `cross_entropy` input): divided
//! by the temperature, limited to the `top_k` largest (0 = all), softmax in float64, one
//! seeded uniform draw; temperature 0 takes the argmax. Ids the tokenizer cannot decode (the
//! padding of a vocabulary rounded up, e.g. GPT-2's 50257 → 50304) are never drawn.
use crate::checkpoint::Checkpoint;
use crate::cpu::{CpuEngine, EngineOptions};
use crate::rng::Rng;
use crate::EngineError;
use crate::StepExecutor;
use schedule::{Op, Plan, Tokenizer};

/// Options of [`generate`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleOptions {
    /// New tokens to generate (1..=100_000).
    pub tokens: usize,
    /// Softmax temperature (0 = greedy; at most 100).
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Seed of the draws.
    pub seed: u64,
}

/// What [`generate`] produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// The generated token ids.
    pub ids: Vec<u32>,
    /// The generated text (invalid UTF-8 from byte tokens replaced by U+FFFD).
    pub text: String,
}

/// The CPU engine with `ckpt`'s weights: its stored plan (CPU or CUDA target: the CPU engine
/// runs both), restored.
///
/// # Errors
/// [`EngineError::Checkpoint`] when the checkpoint has no plan (written before plans were
/// stored); the engine's errors.
pub fn cpu_engine(ckpt: &Checkpoint) -> Result<CpuEngine<f32>, EngineError> {
    let plan = stored_plan(ckpt)?;
    let mut engine = CpuEngine::<f32>::new(plan.clone(), EngineOptions::default())?;
    crate::checkpoint::restore(&mut engine, ckpt)?;
    Ok(engine)
}

/// The plan stored in `ckpt`.
///
/// # Errors
/// [`EngineError::Checkpoint`] when it has none (written before plans were stored).
pub fn stored_plan(ckpt: &Checkpoint) -> Result<&Plan, EngineError> {
    ckpt.plan.as_ref().ok_or_else(|| {
        EngineError::Checkpoint(format!(
            "{} has no plan.json (written before checkpoints stored their plan): it cannot be sampled",
            ckpt.dir.display()
        ))
    })
}

/// The plan's logits buffer (the `cross_entropy` input, `[B·T, V]`): its name and `V`.
fn logits_buffer(plan: &Plan) -> Result<(String, usize), EngineError> {
    let logits = plan
        .forward
        .iter()
        .find_map(|op| match op {
            Op::CrossEntropy { logits, .. } => Some(*logits),
            _ => None,
        })
        .ok_or_else(|| {
            EngineError::Unsupported(format!(
                "plan `{}` has no cross_entropy: no logits to sample",
                plan.name
            ))
        })?;
    let b = plan.buffer(logits);
    Ok((b.name.clone(), b.shape.last().copied().unwrap_or(0)))
}

/// The logits of a forward pass over `tokens` (`B·T` token ids, the plan's batch, row-major):
/// `[B·T, V]` values, row `i` predicting the token after position `i`.
///
/// # Errors
/// [`EngineError::Option`] when `tokens` is not `B·T` long; the engine's errors.
pub fn forward_logits<E: StepExecutor + ?Sized>(
    engine: &mut E,
    tokens: &[i32],
) -> Result<Vec<f64>, EngineError> {
    let plan = engine.plan();
    let (b, t) = (plan.data.batch_size, plan.data.seq_len);
    if tokens.len() != b * t {
        return Err(EngineError::Option(format!(
            "{} tokens given; plan `{}` takes a batch of {b} x {t} = {}",
            tokens.len(),
            plan.name,
            b * t
        )));
    }
    let (name, _) = logits_buffer(plan)?;
    engine.load_batch(tokens, &vec![0i32; b * t])?;
    engine.forward()?;
    engine.synchronize()?;
    engine.read_state(&name)
}

/// Generates `o.tokens` tokens after `prompt` with the weights of `ckpt` (its stored plan) on
/// the CPU engine.
///
/// # Errors
/// As [`cpu_engine`] and [`generate_with`].
pub fn generate(ckpt: &Checkpoint, prompt: &str, o: &SampleOptions) -> Result<Sample, EngineError> {
    check_options(o)?;
    let mut engine = cpu_engine(ckpt)?;
    generate_with(&mut engine, prompt, o)
}

fn check_options(o: &SampleOptions) -> Result<(), EngineError> {
    if !(1..=100_000).contains(&o.tokens) {
        return Err(EngineError::Option(format!(
            "--tokens {} is outside the allowed range 1..=100_000",
            o.tokens
        )));
    }
    if !(0.0..=100.0).contains(&o.temperature) {
        return Err(EngineError::Option(format!(
            "--temperature {} is outside the allowed range 0..=100",
            o.temperature
        )));
    }
    Ok(())
}

/// Generates `o.tokens` tokens after `prompt` on `engine` (any engine, its weights already
/// restored from a checkpoint).
///
/// # Errors
/// [`EngineError::Option`] for an empty prompt or options out of range; a prompt the
/// tokenizer cannot encode; the engine's errors.
pub fn generate_with<E: StepExecutor + ?Sized>(
    engine: &mut E,
    prompt: &str,
    o: &SampleOptions,
) -> Result<Sample, EngineError> {
    check_options(o)?;
    let plan = engine.plan().clone();
    let tokenizer = match plan.data.tokenizer {
        Tokenizer::Gpt2 => data::Tokenizer::Gpt2,
        Tokenizer::Bytes => data::Tokenizer::Bytes,
    };
    let prompt_ids = tokenizer
        .encode(prompt)
        .map_err(|e| EngineError::Option(format!("--prompt: {e}")))?;
    if prompt_ids.is_empty() {
        return Err(EngineError::Option(
            "--prompt is empty: give at least one token of text".into(),
        ));
    }
    let (logits_name, vocab) = logits_buffer(&plan)?;
    let drawable = vocab.min(tokenizer.vocab_size());
    let (b, t) = (plan.data.batch_size, plan.data.seq_len);
    let mut rng = Rng::new(o.seed);
    let mut ctx: Vec<u32> = prompt_ids.clone();
    let mut ids = Vec::with_capacity(o.tokens);
    let (mut x, y) = (vec![0i32; b * t], vec![0i32; b * t]);
    for _ in 0..o.tokens {
        let window = &ctx[ctx.len().saturating_sub(t)..];
        x.iter_mut().for_each(|v| *v = 0);
        for (slot, &id) in x.iter_mut().zip(window) {
            *slot = id as i32;
        }
        engine.load_batch(&x, &y)?;
        engine.forward()?;
        engine.synchronize()?;
        // Only the row that predicts the next token (a GPU engine downloads just it).
        let row = window.len() - 1;
        let l = engine.read_range(&logits_name, row * vocab, drawable)?;
        let next = draw(&l, o, &mut rng);
        ids.push(next);
        ctx.push(next);
    }
    let text = tokenizer
        .decode_lossy(&ids)
        .map_err(|e| EngineError::Option(format!("decoding the sample: {e}")))?;
    Ok(Sample {
        prompt_ids,
        ids,
        text,
    })
}

/// One token from `logits` (float64): argmax at temperature 0, else a draw from the softmax
/// of `logits / temperature` over the `top_k` largest (ties broken by the lower id).
fn draw(logits: &[f64], o: &SampleOptions, rng: &mut Rng) -> u32 {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if o.temperature == 0.0 || o.top_k == 1 {
        return order[0] as u32;
    }
    if o.top_k > 0 {
        order.truncate(o.top_k);
    }
    let top = logits[order[0]];
    let w: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] - top) / o.temperature).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut u = rng.uniform() * total;
    for (&i, &wi) in order.iter().zip(&w) {
        if u < wi {
            return i as u32;
        }
        u -= wi;
    }
    order[order.len() - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(temperature: f64, top_k: usize) -> SampleOptions {
        SampleOptions {
            tokens: 1,
            temperature,
            top_k,
            seed: 1,
        }
    }

    #[test]
    fn greedy_top_k_and_temperature() {
        let l = [0.0, 3.0, 1.0, 3.0, -2.0];
        let mut rng = Rng::new(7);
        // Greedy: the largest, the lower id on a tie.
        assert_eq!(draw(&l, &opts(0.0, 0), &mut rng), 1);
        assert_eq!(draw(&l, &opts(1.0, 1), &mut rng), 1);
        // top-k 2 only ever draws the two largest.
        for _ in 0..200 {
            let d = draw(&l, &opts(1.0, 2), &mut rng);
            assert!(d == 1 || d == 3, "{d}");
        }
        // A low temperature concentrates on the maximum; a high one spreads over all five.
        let mut seen = [0usize; 5];
        for _ in 0..2000 {
            seen[draw(&l, &opts(100.0, 0), &mut rng) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 200), "{seen:?}");
        let cold = (0..200)
            .filter(|_| {
                let d = draw(&[0.0, 1.0], &opts(0.01, 0), &mut rng);
                d == 1
            })
            .count();
        assert_eq!(cold, 200);
    }
}
