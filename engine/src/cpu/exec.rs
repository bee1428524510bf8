//! The op dispatcher: one `match` over [`schedule::Op`] that fetches the operands from the
//! store and calls the kernel (or the `asteria-optim` update) with buffer slices.
use super::attention::{attention_backward, attention_forward, attention_lse, AttnDims};
use super::matmul::{matmul, Dims};
use super::rope::{rope_backward, rope_forward, RopeDims};
use super::store::{Loc, Store};
use super::{
    clip, cross_entropy as ce, elementwise as ew, embedding as emb, norms, positional as pos, Float,
};
use crate::EngineError;
use optim::Real;
use schedule::{BufferId, Op};

/// What an op reports back to the program loop.
pub(crate) enum OpOutcome {
    /// Nothing to report.
    Done,
    /// A `ClipGradNorm` computed this global gradient norm (before clipping).
    GradNorm(f64),
}

fn optim_err(loc: Loc, e: impl std::fmt::Display) -> EngineError {
    EngineError::Optim {
        location: loc.to_string(),
        message: e.to_string(),
    }
}

/// Executes one op. `t` is the 1-based step for optimizer ops and the 0-based micro-batch for
/// the backward's `GradAccumulate`; `lr_multiplier` is only used by optimizer ops.
pub(crate) fn exec_op<T: Float + Real>(
    st: &mut Store<T>,
    op: &Op,
    loc: Loc,
    t: u64,
    lr_multiplier: f64,
) -> Result<OpOutcome, EngineError> {
    use OpOutcome::Done;
    let cols = |st: &Store<T>, id: BufferId| st.dims2(id).1;
    match op {
        Op::CopyIn { .. } | Op::CopyOut { .. } => {
            return Err(EngineError::Tier(format!(
                "{loc}: tier copies run through the engine's tier stores, not as kernels"
            )))
        }
        Op::Project {
            x,
            out,
            basis_left,
            basis_right,
            back,
        } => {
            let (m, n) = st.dims2(*x);
            let reads: Vec<BufferId> = [*x]
                .into_iter()
                .chain(*basis_left)
                .chain(*basis_right)
                .collect();
            st.with_outs(loc, &[("out", *out)], &reads, |s, o| {
                let (ql, qr) = (s.opt_f(*basis_left)?, s.opt_f(*basis_right)?);
                let y = match back {
                    false => optim::project(s.f(*x)?, ql, qr, m, n),
                    true => optim::project_back(s.f(*x)?, ql, qr, m, n),
                };
                o[0].copy_from_slice(&y);
                Ok(())
            })?;
        }
        Op::BlockCopy { src, dst, row, col } => {
            let n = cols(st, *src);
            let (r, c) = st.dims2(*dst);
            st.with_outs(loc, &[("dst", *dst)], &[*src], |s, o| {
                let x = s.f(*src)?;
                for (i, out) in o[0].chunks_exact_mut(c.max(1)).take(r).enumerate() {
                    let at = (row + i) * n + col;
                    out.copy_from_slice(&x[at..at + c]);
                }
                Ok(())
            })?;
        }
        Op::BlockWrite { src, dst, row, col } => {
            let n = cols(st, *dst);
            let (r, c) = st.dims2(*src);
            st.with_outs(loc, &[("dst", *dst)], &[*src], |s, o| {
                let x = s.f(*src)?;
                for i in 0..r {
                    let at = (row + i) * n + col;
                    o[0][at..at + c].copy_from_slice(&x[i * c..(i + 1) * c]);
                }
                Ok(())
            })?;
        }
        Op::Embedding { table, ids, out } => {
            let (v, c) = st.dims2(*table);
            st.with_outs(loc, &[("out", *out)], &[*table, *ids], |s, o| {
                emb::embedding_forward(s.f(*table)?, v, c, s.i(*ids)?, &mut o[0])
            })?;
        }
        Op::EmbeddingBackward { dout, ids, dtable } => {
            let (v, c) = st.dims2(*dtable);
            st.with_outs(loc, &[("dtable", *dtable)], &[*dout, *ids], |s, o| {
                emb::embedding_backward(s.f(*dout)?, s.i(*ids)?, &mut o[0], v, c)
            })?;
        }
        Op::AddPositional {
            x,
            pos: p,
            out,
            seq_len,
        } => {
            let c = cols(st, *x);
            st.with_outs(loc, &[("out", *out)], &[*x, *p], |s, o| {
                pos::add_positional(s.f(*x)?, s.f(*p)?, &mut o[0], c, *seq_len)
            })?;
        }
        Op::AddPositionalBackward {
            dout,
            dpos,
            seq_len,
        } => {
            let c = cols(st, *dout);
            st.with_outs(loc, &[("dpos", *dpos)], &[*dout], |s, o| {
                pos::add_positional_backward(s.f(*dout)?, &mut o[0], c, *seq_len)
            })?;
        }
        Op::LayerNorm {
            x,
            weight,
            bias,
            out,
            eps,
        } => {
            let c = cols(st, *x);
            let reads: Vec<BufferId> = [*x, *weight].into_iter().chain(*bias).collect();
            st.with_outs(loc, &[("out", *out)], &reads, |s, o| {
                norms::layernorm_forward(
                    s.f(*x)?,
                    s.f(*weight)?,
                    s.opt_f(*bias)?,
                    &mut o[0],
                    c,
                    *eps,
                )
            })?;
        }
        Op::LayerNormBackward {
            dout,
            x,
            weight,
            dx,
            dweight,
            dbias,
            eps,
        } => {
            let c = cols(st, *x);
            let mut outs = vec![("dx", *dx), ("dweight", *dweight)];
            outs.extend(dbias.map(|b| ("dbias", b)));
            st.with_outs(loc, &outs, &[*dout, *x, *weight], |s, o| {
                let (dxv, rest) = o.split_at_mut(1);
                let (dw, db) = rest.split_at_mut(1);
                let db = db.first_mut().map(|v| v.as_mut_slice());
                norms::layernorm_backward(
                    s.f(*dout)?,
                    s.f(*x)?,
                    s.f(*weight)?,
                    &mut dxv[0],
                    &mut dw[0],
                    db,
                    c,
                    *eps,
                )
            })?;
        }
        Op::RmsNorm {
            x,
            weight,
            out,
            eps,
        } => {
            let c = cols(st, *x);
            st.with_outs(loc, &[("out", *out)], &[*x, *weight], |s, o| {
                norms::rmsnorm_forward(s.f(*x)?, s.f(*weight)?, &mut o[0], c, *eps)
            })?;
        }
        Op::RmsNormBackward {
            dout,
            x,
            weight,
            dx,
            dweight,
            eps,
        } => {
            let c = cols(st, *x);
            st.with_outs(
                loc,
                &[("dx", *dx), ("dweight", *dweight)],
                &[*dout, *x, *weight],
                |s, o| {
                    let (a, b) = o.split_at_mut(1);
                    norms::rmsnorm_backward(
                        s.f(*dout)?,
                        s.f(*x)?,
                        s.f(*weight)?,
                        &mut a[0],
                        &mut b[0],
                        c,
                        *eps,
                    )
                },
            )?;
        }
        Op::MatMul {
            a,
            b,
            out,
            trans_a,
            trans_b,
            accumulate,
            micro_accumulate,
        } => {
            let (ar, ac) = st.dims2(*a);
            let (br, bc) = st.dims2(*b);
            st.with_outs(loc, &[("out", *out)], &[*a, *b], |s, o| {
                let (ad, bd) = (Dims { rows: ar, cols: ac }, Dims { rows: br, cols: bc });
                let Some(scale) = micro_accumulate else {
                    return matmul(
                        s.f(*a)?,
                        ad,
                        s.f(*b)?,
                        bd,
                        &mut o[0],
                        *trans_a,
                        *trans_b,
                        *accumulate,
                    );
                };
                // Gradient accumulation (`t` is the micro-batch): the product rounded, then
                // scaled and added as `GradAccumulate` does — the same bits as the unfused pair.
                let mut product = vec![<T as Float>::from_f64(0.0); o[0].len()];
                matmul(
                    s.f(*a)?,
                    ad,
                    s.f(*b)?,
                    bd,
                    &mut product,
                    *trans_a,
                    *trans_b,
                    false,
                )?;
                let sc = <T as Float>::from_f64(*scale);
                for (acc, &x) in o[0].iter_mut().zip(&product) {
                    let scaled = x * sc;
                    *acc = if t == 0 { scaled } else { *acc + scaled };
                }
                Ok(())
            })?;
        }
        Op::MatMulBias {
            a,
            b,
            bias,
            out,
            trans_a,
            trans_b,
        } => {
            // The product into `out`, then the bias added in place: the same f32 operations
            // as the unfused `MatMul` + `BiasAdd`, so bit-identical results.
            let (ar, ac) = st.dims2(*a);
            let (br, bc) = st.dims2(*b);
            let c = cols(st, *out);
            st.with_outs(loc, &[("out", *out)], &[*a, *b, *bias], |s, o| {
                let (ad, bd) = (Dims { rows: ar, cols: ac }, Dims { rows: br, cols: bc });
                matmul(
                    s.f(*a)?,
                    ad,
                    s.f(*b)?,
                    bd,
                    &mut o[0],
                    *trans_a,
                    *trans_b,
                    false,
                )?;
                ew::bias_add_in_place(&mut o[0], s.f(*bias)?, c)
            })?;
        }
        Op::BiasAdd { x, bias, out } => {
            let c = cols(st, *x);
            st.with_outs(loc, &[("out", *out)], &[*x, *bias], |s, o| {
                ew::bias_add(s.f(*x)?, s.f(*bias)?, &mut o[0], c)
            })?;
        }
        Op::SumRows { x, out } => {
            let c = cols(st, *x);
            st.with_outs(loc, &[("out", *out)], &[*x], |s, o| {
                ew::sum_rows(s.f(*x)?, &mut o[0], c)
            })?;
        }
        // The column sums of `SumRows` and the copy of `Cast` (the store rounds it to bf16).
        Op::SumRowsCast { x, out, out_bf16 } => {
            let c = cols(st, *x);
            st.with_outs(
                loc,
                &[("out", *out), ("out_bf16", *out_bf16)],
                &[*x],
                |s, o| {
                    let x = s.f(*x)?;
                    let (sums, copy) = o.split_at_mut(1);
                    copy[0].copy_from_slice(x);
                    ew::sum_rows(x, &mut sums[0], c)
                },
            )?;
        }
        Op::Add { a, b, out } => {
            st.with_outs(loc, &[("out", *out)], &[*a, *b], |s, o| {
                ew::add(s.f(*a)?, s.f(*b)?, &mut o[0])
            })?;
        }
        // The store rounds the bf16 output.
        Op::Cast { x, out } => {
            st.with_outs(loc, &[("out", *out)], &[*x], |s, o| {
                o[0].copy_from_slice(s.f(*x)?);
                Ok(())
            })?;
        }
        Op::Gelu { x, out } => {
            st.with_outs(loc, &[("out", *out)], &[*x], |s, o| {
                ew::gelu(s.f(*x)?, &mut o[0])
            })?;
        }
        Op::GeluBackward { dout, x, dx } => {
            st.with_outs(loc, &[("dx", *dx)], &[*dout, *x], |s, o| {
                ew::gelu_backward(s.f(*dout)?, s.f(*x)?, &mut o[0])
            })?;
        }
        Op::SwiGlu { x, out } => {
            let f = cols(st, *out);
            st.with_outs(loc, &[("out", *out)], &[*x], |s, o| {
                ew::swiglu(s.f(*x)?, &mut o[0], f)
            })?;
        }
        Op::SwiGluBackward { dout, x, dx } => {
            let f = cols(st, *dout);
            st.with_outs(loc, &[("dx", *dx)], &[*dout, *x], |s, o| {
                ew::swiglu_backward(s.f(*dout)?, s.f(*x)?, &mut o[0], f)
            })?;
        }
        Op::Rope {
            x,
            out,
            seq_len,
            head_dim,
            rotated_cols,
            theta,
        } => {
            let d = RopeDims {
                width: cols(st, *x),
                seq_len: *seq_len,
                head_dim: *head_dim,
                rotated_cols: *rotated_cols,
                theta: *theta,
            };
            st.with_outs(loc, &[("out", *out)], &[*x], |s, o| {
                rope_forward(s.f(*x)?, &mut o[0], &d)
            })?;
        }
        Op::RopeBackward {
            dout,
            dx,
            seq_len,
            head_dim,
            rotated_cols,
            theta,
        } => {
            let d = RopeDims {
                width: cols(st, *dout),
                seq_len: *seq_len,
                head_dim: *head_dim,
                rotated_cols: *rotated_cols,
                theta: *theta,
            };
            st.with_outs(loc, &[("dx", *dx)], &[*dout], |s, o| {
                rope_backward(s.f(*dout)?, &mut o[0], &d)
            })?;
        }
        Op::Attention {
            qkv,
            out,
            lse,
            batch,
            seq_len,
            n_heads,
        } => {
            let d = AttnDims {
                batch: *batch,
                seq_len: *seq_len,
                n_heads: *n_heads,
                channels: cols(st, *qkv) / 3,
            };
            st.with_outs(loc, &[("out", *out)], &[*qkv], |s, o| {
                attention_forward(s.f(*qkv)?, &mut o[0], &d)
            })?;
            if let Some(lse) = lse {
                st.with_outs(loc, &[("lse", *lse)], &[*qkv], |s, o| {
                    attention_lse(s.f(*qkv)?, &mut o[0], &d)
                })?;
            }
        }
        // The saved `fwd_out` / `lse`, when present, are not read: the CPU backward recomputes
        // the probabilities from qkv (the same math as using them).
        Op::AttentionBackward {
            dout,
            qkv,
            dqkv,
            batch,
            seq_len,
            n_heads,
            ..
        } => {
            let d = AttnDims {
                batch: *batch,
                seq_len: *seq_len,
                n_heads: *n_heads,
                channels: cols(st, *qkv) / 3,
            };
            st.with_outs(loc, &[("dqkv", *dqkv)], &[*dout, *qkv], |s, o| {
                attention_backward(s.f(*dout)?, s.f(*qkv)?, &mut o[0], &d)
            })?;
        }
        Op::CrossEntropy {
            logits,
            targets,
            loss,
        } => {
            let v = cols(st, *logits);
            st.with_outs(loc, &[("loss", *loss)], &[*logits], |s, o| {
                let l = ce::cross_entropy_forward(s.f(*logits)?, s.i(*targets)?, v)?;
                o[0].iter_mut().for_each(|x| *x = <T as Float>::from_f64(l));
                Ok(())
            })?;
        }
        Op::CrossEntropyBackward {
            logits,
            targets,
            dlogits,
        } => {
            let v = cols(st, *logits);
            st.with_outs(loc, &[("dlogits", *dlogits)], &[*logits], |s, o| {
                ce::cross_entropy_backward(s.f(*logits)?, s.i(*targets)?, &mut o[0], v)
            })?;
        }
        // With `scale`: the factor `clip_to` would apply, written instead of applied.
        // The gradients' sums of squares, each in its slot's first f64 (the others zero):
        // the norm below adds them in slot order, as `clip::global_norm` adds the gradients'.
        Op::GradSumSquares {
            grad,
            partials,
            slot,
        } => {
            let words = 2 * schedule::reserve::SUMSQ_BLOCKS;
            st.with_outs(loc, &[("partials", *partials)], &[*grad], |s, o| {
                let sum = clip::sum_sq(s.f(*grad)?);
                let part = o[0]
                    .get_mut(slot * words..(slot + 1) * words)
                    .ok_or_else(|| optim_err(loc, format!("partials slot {slot} out of range")))?;
                part.iter_mut().for_each(|x| *x = T::zero());
                T::put_f64(part, sum);
                Ok(())
            })?;
        }
        Op::ClipGradNorm {
            norm,
            scale,
            max_norm,
            partials: Some(partials),
            ..
        } => {
            let words = 2 * schedule::reserve::SUMSQ_BLOCKS;
            let scale = scale
                .ok_or_else(|| optim_err(loc, "clip_grad_norm: partials without a scale output"))?;
            let outs = [("norm", *norm), ("scale", scale)];
            let total = st.with_outs(loc, &outs, &[*partials], |s, o| {
                let total = s
                    .f(*partials)?
                    .chunks(words)
                    .map(|c| T::get_f64(c))
                    .sum::<f64>()
                    .sqrt();
                let factor = max_norm.map_or(1.0, |m| clip::clip_factor(total, m));
                o[0].iter_mut()
                    .for_each(|x| *x = <T as Float>::from_f64(total));
                o[1].iter_mut()
                    .for_each(|x| *x = <T as Float>::from_f64(factor));
                Ok(total)
            })?;
            return Ok(OpOutcome::GradNorm(total));
        }
        // Gradient accumulation: `t` is the 0-based micro-batch in the backward.
        Op::GradAccumulate {
            micro,
            total,
            scale,
        } => {
            let s = <T as Float>::from_f64(*scale);
            let first = t == 0;
            st.with_outs(loc, &[("total", *total)], &[*micro], |s2, o| {
                let m = s2.f(*micro)?;
                for (acc, &x) in o[0].iter_mut().zip(m) {
                    // Two roundings, as the CUDA kernel (`__fmul_rn`, `__fadd_rn`).
                    let scaled = x * s;
                    *acc = if first { scaled } else { *acc + scaled };
                }
                Ok(())
            })?;
        }
        // `x · scale`, the values an in-place clip by that factor stores (`clip::scaled`).
        Op::ScaleByScalar { x, scale } => {
            let f = st
                .f(*scale)?
                .first()
                .copied()
                .ok_or_else(|| optim_err(loc, "scale_by_scalar: empty scale"))?;
            let v = st.f_mut(*x)?;
            let scaled = clip::scaled(v, f);
            *v = scaled;
        }
        Op::ClipGradNorm {
            grads,
            norm,
            scale: Some(scale),
            max_norm,
            partials: None,
        } => {
            let outs = [("norm", *norm), ("scale", *scale)];
            let total = st.with_outs(loc, &outs, grads, |s, o| {
                let gs = grads
                    .iter()
                    .map(|&g| s.f(g))
                    .collect::<Result<Vec<_>, _>>()?;
                let total = clip::global_norm(&gs);
                let factor = max_norm.map_or(1.0, |m| clip::clip_factor(total, m));
                o[0].iter_mut()
                    .for_each(|x| *x = <T as Float>::from_f64(total));
                o[1].iter_mut()
                    .for_each(|x| *x = <T as Float>::from_f64(factor));
                Ok(total)
            })?;
            return Ok(OpOutcome::GradNorm(total));
        }
        Op::ClipGradNorm {
            grads,
            norm,
            scale: None,
            max_norm,
            partials: None,
        } => {
            let mut outs: Vec<(&'static str, BufferId)> =
                grads.iter().map(|&g| ("grads", g)).collect();
            outs.push(("norm", *norm));
            let total = st.with_outs(loc, &outs, &[], |_, o| {
                let (gs, nb) = o.split_at_mut(grads.len());
                let total = clip::global_norm(&gs.iter().map(|g| g.as_slice()).collect::<Vec<_>>());
                nb[0]
                    .iter_mut()
                    .for_each(|x| *x = <T as Float>::from_f64(total));
                if let Some(m) = max_norm {
                    clip::clip_to(
                        &mut gs.iter_mut().map(|g| g.as_mut_slice()).collect::<Vec<_>>(),
                        total,
                        *m,
                    );
                }
                Ok(total)
            })?;
            return Ok(OpOutcome::GradNorm(total));
        }
        Op::AdamW {
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            grad_scale,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            ..
        } => {
            let hp = optim::AdamWParams {
                lr: lr * lr_multiplier,
                beta1: *beta1,
                beta2: *beta2,
                eps: *eps,
                weight_decay: *weight_decay,
            };
            let outs = [
                ("param", *param),
                ("exp_avg", *exp_avg),
                ("exp_avg_sq", *exp_avg_sq),
            ];
            let reads: Vec<BufferId> = std::iter::once(*grad).chain(*grad_scale).collect();
            st.with_outs(loc, &outs, &reads, |s, o| {
                let [p, m, v] = o else {
                    return Err(optim_err(loc, "internal: operand count"));
                };
                let g = s.f(*grad)?;
                match grad_scale {
                    // `grad · scale` as an in-place clip (`clip::clip_to`) would store it.
                    Some(sc) => {
                        let f = s.f(*sc)?.first().copied().unwrap_or_else(T::one);
                        let scaled = clip::scaled(g, f);
                        optim::adamw_update(t, &hp, p, &scaled, m, v)
                    }
                    None => optim::adamw_update(t, &hp, p, g, m, v),
                }
                .map_err(|e| optim_err(loc, e))
            })?;
        }
        Op::SoapUpdate {
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            basis_left,
            basis_right,
            hyper,
        } => {
            let (m, n) = st.dims2(*param);
            let hp = optim::SoapParams {
                beta1: hyper.beta1,
                beta2: hyper.beta2,
                eps: hyper.eps,
                weight_decay: hyper.weight_decay,
                correct_bias: hyper.correct_bias,
                normalize_grads: hyper.normalize_grads,
            };
            let lr = hyper.lr * lr_multiplier;
            let outs = [
                ("param", *param),
                ("exp_avg", *exp_avg),
                ("exp_avg_sq", *exp_avg_sq),
            ];
            let reads: Vec<BufferId> = [*grad]
                .into_iter()
                .chain(*basis_left)
                .chain(*basis_right)
                .collect();
            st.with_outs(loc, &outs, &reads, |s, o| {
                let [p, ea, eas] = o else {
                    return Err(optim_err(loc, "internal: operand count"));
                };
                let (ql, qr) = (s.opt_f(*basis_left)?, s.opt_f(*basis_right)?);
                optim::soap_update(t, lr, &hp, p, s.f(*grad)?, ea, eas, ql, qr, m, n)
                    .map_err(|e| optim_err(loc, e))
            })?;
        }
        Op::KlShampooUpdate {
            param,
            grad,
            exp_avg,
            factor_left,
            factor_right,
            basis_left,
            basis_right,
            eig_left,
            eig_right,
            hyper,
        } => {
            let (m, n) = st.dims2(*param);
            let hp = optim::KlShampooParams {
                beta1: hyper.beta1,
                shampoo_beta: hyper.shampoo_beta,
                eps: hyper.eps,
                weight_decay: hyper.weight_decay,
                precondition_frequency: 0,
                init_factor: hyper.init_factor,
                max_clamp_value: hyper.max_clamp_value,
                normalize_grads: hyper.normalize_grads,
            };
            let lr = hyper.lr * lr_multiplier;
            let mut outs = vec![
                ("param", *param),
                ("exp_avg", *exp_avg),
                ("eig_left", *eig_left),
                ("eig_right", *eig_right),
            ];
            outs.extend(factor_left.map(|f| ("factor_left", f)));
            outs.extend(factor_right.map(|f| ("factor_right", f)));
            let reads: Vec<BufferId> = [*grad]
                .into_iter()
                .chain(*basis_left)
                .chain(*basis_right)
                .collect();
            st.with_outs(loc, &outs, &reads, |s, o| {
                let [p, ea, dl, dr, rest @ ..] = o else {
                    return Err(optim_err(loc, "internal: operand count"));
                };
                let mut rest = rest.iter_mut();
                let fl = factor_left
                    .and_then(|_| rest.next())
                    .map(|v| v.as_mut_slice());
                let fr = factor_right
                    .and_then(|_| rest.next())
                    .map(|v| v.as_mut_slice());
                let left = optim::KlSide {
                    factor: fl,
                    basis: s.opt_f(*basis_left)?,
                    eig: dl,
                };
                let right = optim::KlSide {
                    factor: fr,
                    basis: s.opt_f(*basis_right)?,
                    eig: dr,
                };
                optim::kl_shampoo_update(t, &hp, lr, p, s.f(*grad)?, ea, left, right, m, n)
                    .map_err(|e| optim_err(loc, e))
            })?;
        }
        Op::ShampooUpdate {
            param,
            grad,
            exp_avg,
            graft_sq,
            factors,
            roots,
            hyper,
        } => {
            let hp = shampoo_params(hyper);
            let lr = hyper.lr * lr_multiplier;
            let shape = st.shape(*param).to_vec();
            let mut outs = vec![("param", *param), ("exp_avg", *exp_avg)];
            outs.extend(graft_sq.map(|v| ("graft_sq", v)));
            outs.extend(factors.iter().map(|&f| ("factor", f)));
            let mut reads = vec![*grad];
            reads.extend(roots.iter().copied());
            st.with_outs(loc, &outs, &reads, |s, o| {
                let (head, fs) = o.split_at_mut(if graft_sq.is_some() { 3 } else { 2 });
                let (p, rest) = head
                    .split_first_mut()
                    .ok_or_else(|| optim_err(loc, "internal"))?;
                let (ea, v) = rest
                    .split_first_mut()
                    .ok_or_else(|| optim_err(loc, "internal"))?;
                let mut fs: Vec<&mut [T]> = fs.iter_mut().map(|f| f.as_mut_slice()).collect();
                let rs = roots
                    .iter()
                    .map(|&r| s.f(r))
                    .collect::<Result<Vec<&[T]>, _>>()?;
                let v = v.first_mut().map(|v| v.as_mut_slice());
                optim::shampoo_update(t, &hp, lr, p, s.f(*grad)?, ea, v, &shape, &mut fs, &rs)
                    .map_err(|e| optim_err(loc, e))
            })?;
        }
        Op::KlScale {
            x,
            out,
            eig_left,
            eig_right,
            eps,
        } => {
            let (m, n) = st.dims2(*x);
            st.with_outs(
                loc,
                &[("out", *out)],
                &[*x, *eig_left, *eig_right],
                |s, o| {
                    let y = optim::kl_scale(
                        t,
                        *eps,
                        s.f(*x)?,
                        (s.f(*eig_left)?, s.f(*eig_right)?),
                        m,
                        n,
                    )
                    .map_err(|e| optim_err(loc, e))?;
                    o[0].copy_from_slice(&y);
                    Ok(())
                },
            )?;
        }
        Op::KlFactorUpdate {
            grad,
            factor_left,
            factor_right,
            basis_left,
            basis_right,
            eig_left,
            eig_right,
            shampoo_beta,
            init_factor,
            max_clamp_value,
        } => {
            let (m, n) = st.dims2(*grad);
            let hp = optim::KlShampooParams {
                shampoo_beta: *shampoo_beta,
                init_factor: *init_factor,
                max_clamp_value: *max_clamp_value,
                ..optim::KlShampooParams::default()
            };
            let mut outs = vec![("eig_left", *eig_left), ("eig_right", *eig_right)];
            outs.extend(factor_left.map(|f| ("factor_left", f)));
            outs.extend(factor_right.map(|f| ("factor_right", f)));
            let reads: Vec<BufferId> = [*grad]
                .into_iter()
                .chain(*basis_left)
                .chain(*basis_right)
                .collect();
            st.with_outs(loc, &outs, &reads, |s, o| {
                let [dl, dr, rest @ ..] = o else {
                    return Err(optim_err(loc, "internal: operand count"));
                };
                let mut rest = rest.iter_mut();
                let fl = factor_left
                    .and_then(|_| rest.next())
                    .map(|v| v.as_mut_slice());
                let fr = factor_right
                    .and_then(|_| rest.next())
                    .map(|v| v.as_mut_slice());
                let left = optim::KlSide {
                    factor: fl,
                    basis: s.opt_f(*basis_left)?,
                    eig: dl,
                };
                let right = optim::KlSide {
                    factor: fr,
                    basis: s.opt_f(*basis_right)?,
                    eig: dr,
                };
                optim::kl_factor_update(t, &hp, s.f(*grad)?, (left, right), m, n)
                    .map_err(|e| optim_err(loc, e))
            })?;
        }
        Op::ShampooFactorUpdate {
            grad,
            factors,
            beta2,
            use_bias_correction,
            max_preconditioner_dim,
        } => {
            let shape = st.shape(*grad).to_vec();
            let b = usize::try_from(*max_preconditioner_dim).unwrap_or(usize::MAX);
            let outs: Vec<(&'static str, BufferId)> =
                factors.iter().map(|&f| ("factor", f)).collect();
            st.with_outs(loc, &outs, &[*grad], |s, o| {
                let mut fs: Vec<&mut [T]> = o.iter_mut().map(|f| f.as_mut_slice()).collect();
                let bits = (*beta2, *use_bias_correction);
                optim::shampoo_factor_update(t, bits, (&shape, b), s.f(*grad)?, &mut fs)
                    .map_err(|e| optim_err(loc, e))
            })?;
        }
        Op::ShampooPrecondition {
            x,
            out,
            roots,
            max_preconditioner_dim,
        } => {
            let shape = st.shape(*x).to_vec();
            let b = usize::try_from(*max_preconditioner_dim).unwrap_or(usize::MAX);
            let mut reads = vec![*x];
            reads.extend(roots.iter().copied());
            st.with_outs(loc, &[("out", *out)], &reads, |s, o| {
                let rs = roots
                    .iter()
                    .map(|&r| s.f(r))
                    .collect::<Result<Vec<&[T]>, _>>()?;
                let y = optim::shampoo_precondition((&shape, b), s.f(*x)?, &rs)
                    .map_err(|e| optim_err(loc, e))?;
                o[0].copy_from_slice(&y);
                Ok(())
            })?;
        }
        Op::Graft {
            x,
            graft,
            out,
            max_preconditioner_dim,
        } => {
            let shape = st.shape(*x).to_vec();
            let b = usize::try_from(*max_preconditioner_dim).unwrap_or(usize::MAX);
            st.with_outs(loc, &[("out", *out)], &[*x, *graft], |s, o| {
                let y = optim::graft(t, (&shape, b), s.f(*x)?, s.f(*graft)?)
                    .map_err(|e| optim_err(loc, e))?;
                o[0].copy_from_slice(&y);
                Ok(())
            })?;
        }
        Op::SoapFactorUpdate {
            grad,
            factor_left,
            factor_right,
            shampoo_beta,
        } => {
            let (m, n) = st.dims2(*grad);
            let outs: Vec<(&'static str, BufferId)> = factor_left
                .map(|f| ("factor_left", f))
                .into_iter()
                .chain(factor_right.map(|f| ("factor_right", f)))
                .collect();
            st.with_outs(loc, &outs, &[*grad], |s, o| {
                let mut it = o.iter_mut();
                let fl = factor_left
                    .and_then(|_| it.next())
                    .map(|v| v.as_mut_slice());
                let fr = factor_right
                    .and_then(|_| it.next())
                    .map(|v| v.as_mut_slice());
                optim::soap_factor_update(s.f(*grad)?, fl, fr, m, n, *shampoo_beta)
                    .map_err(|e| optim_err(loc, e))
            })?;
        }
        Op::ElementwiseUpdate {
            param,
            grad,
            state,
            results,
            rule,
        } => {
            let prog = rule_program(rule).map_err(|e| optim_err(loc, e))?;
            let scalars: Vec<T> = optim::optimizers::step_scalars(rule, rule.lr * lr_multiplier, t);
            let outs: Vec<(&'static str, BufferId)> = std::iter::once(("param", *param))
                .chain(state.iter().map(|s| ("state", *s)))
                .chain(results.iter().map(|r| ("result", *r)))
                .collect();
            st.with_outs(loc, &outs, &[*grad], |s, o| {
                // The program reads every tensor through one list (p, g, state...): `g` is the
                // one it never writes, so a copy of it joins the written ones.
                let mut g = s.f(*grad)?.to_vec();
                let (p, rest) = o
                    .split_first_mut()
                    .ok_or_else(|| optim_err(loc, "no param"))?;
                let mut all: Vec<&mut [T]> = vec![p.as_mut_slice(), g.as_mut_slice()];
                all.extend(rest.iter_mut().map(|v| v.as_mut_slice()));
                run_chunked(&prog, all, &scalars).map_err(|e| optim_err(loc, e))
            })?;
        }
    }
    Ok(Done)
}

/// The host program of a plan's element-wise update rule.
///
/// # Errors
/// The rule's expression does not parse, names an unknown tensor or scalar, or its outputs do
/// not match it.
pub(crate) fn rule_program(
    rule: &schedule::ElementwiseRule,
) -> Result<optim::update::Program, optim::update::RuleError> {
    optim::update::Program::new(&optim::optimizers::update_rule(rule)?)
}

/// Runs `prog` over `tensors` (one length) in chunks of 16 Ki elements on the rayon pool; each
/// element's result does not depend on the others, so this is the sequential run's bits.
fn run_chunked<T: Real>(
    prog: &optim::update::Program,
    tensors: Vec<&mut [T]>,
    scalars: &[T],
) -> Result<(), optim::update::RuleError> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 14;
    let n = tensors.first().map_or(0, |t| t.len());
    if tensors.iter().any(|t| t.len() != n) {
        return Err(optim::update::RuleError::Length(
            "tensors of different lengths".into(),
        ));
    }
    let mut chunks: Vec<Vec<&mut [T]>> = (0..n.div_ceil(CHUNK)).map(|_| Vec::new()).collect();
    for t in tensors {
        for (c, part) in chunks.iter_mut().zip(t.chunks_mut(CHUNK)) {
            c.push(part);
        }
    }
    chunks
        .into_par_iter()
        .try_for_each(|mut c| prog.run(&mut c, scalars))
}

/// `optim`'s Shampoo parameters of a plan's [`schedule::ShampooHyper`] (the refresh schedule
/// is the plan's host tasks', not these fields').
pub(crate) fn shampoo_params(h: &schedule::ShampooHyper) -> optim::ShampooParams {
    optim::ShampooParams {
        beta1: h.beta1,
        beta2: h.beta2,
        epsilon: h.epsilon,
        weight_decay: h.weight_decay,
        max_preconditioner_dim: usize::try_from(h.max_preconditioner_dim).unwrap_or(usize::MAX),
        precondition_frequency: 1,
        start_preconditioning_step: None,
        use_bias_correction: h.use_bias_correction,
        grafting: h.grafting.then_some(optim::AdamGrafting {
            beta2: h.grafting_beta2,
            epsilon: h.grafting_epsilon,
        }),
    }
}
