//! The op dispatch: [`CudaEngine::exec`] runs one plan op through the launchers of
//! [`crate::ops`] and [`crate::gemm`], with the bf16 operand helpers it reads GEMM inputs
//! through (bf16 plan buffers; SOAP's eigenbasis shadows).
use super::{attn_dims, flash_math, CudaEngine};
use crate::error::CudaError;
use crate::gemm::{self, Dims};
use crate::memory::{Buf, Elem};
use crate::ops::{attention as at, kl_shampoo as kl, loss, nn, norm, optim as op, shampoo as sh};
use schedule::{BufferId, Op};

impl CudaEngine {
    /// The bf16 copy of buffer `id`, cast now unless still fresh.
    fn shadow(&mut self, id: BufferId) -> Result<Buf, CudaError> {
        let s = self.shadows[id.index()].clone().ok_or(CudaError::Invalid {
            op: "mat_mul",
            what: format!("buffer {id} has no bf16 shadow"),
        })?;
        if !self.shadow_fresh[id.index()] {
            gemm::cast_f32_to_bf16(&self.dev, &self.bufs[id.index()], &s)?;
            self.shadow_fresh[id.index()] = true;
            self.shadow_casts += 1;
        }
        Ok(s)
    }

    /// Buffer `id` as a bf16 GEMM operand: a bf16 plan buffer (the plan casts f32 operands,
    /// `fuse`'s `bf16-cast`).
    fn gemm_operand(&self, id: BufferId) -> Result<Buf, CudaError> {
        match self.bufs[id.index()].elem() {
            Elem::BF16 => Ok(self.bufs[id.index()].clone()),
            _ => Err(CudaError::Invalid {
                op: "mat_mul",
                what: format!("buffer {id} is f32 where the plan reads a bf16 operand"),
            }),
        }
    }

    /// Whether a GEMM runs in bf16: both operands bf16 plan buffers (else both f32: an fp32
    /// GEMM; mixed operand dtypes are refused by the plan verifier).
    fn bf16_operands(&self, a: BufferId, b: BufferId) -> Result<bool, CudaError> {
        let bf16 = |id: BufferId| self.bufs[id.index()].elem() == Elem::BF16;
        match (bf16(a), bf16(b)) {
            (true, true) => Ok(true),
            (false, false) => Ok(false),
            _ => Err(CudaError::Invalid {
                op: "mat_mul",
                what: format!("operands {a} and {b} have different dtypes"),
            }),
        }
    }

    /// Runs one op; `Ok(Some(norm))` from a `ClipGradNorm`.
    pub(super) fn exec(&mut self, op: &Op, t: u64, lr_mult: f64) -> Result<Option<f64>, CudaError> {
        // A written buffer's bf16 shadow is stale (the same read/write classification the
        // memory planner uses: `schedule::Op::accesses`).
        for (_, id, access) in op.accesses() {
            if access.writes() {
                self.shadow_fresh[id.index()] = false;
                self.write_gen[id.index()] += 1;
            }
        }
        let dev = &self.dev;
        let s = &self.scratch;
        match op {
            Op::Project {
                x,
                out,
                basis_left,
                basis_right,
                back,
            } => {
                let (m, n) = self.dims(*x);
                let proj = CudaEngine::soap_projections(self.precision);
                let mut cached = [None, None];
                if proj == op::SoapProjections::Bf16 {
                    for (slot, q) in cached.iter_mut().zip([basis_left, basis_right]) {
                        if let Some(q) = q.filter(|q| self.shadows[q.index()].is_some()) {
                            *slot = Some(self.shadow(q)?);
                        }
                    }
                }
                let (dev, s) = (&self.dev, &self.scratch);
                op::project(
                    dev,
                    self.b(*x),
                    self.b(*out),
                    basis_left.map(|q| self.b(q)),
                    basis_right.map(|q| self.b(q)),
                    m,
                    n,
                    *back,
                    s,
                    proj,
                    [cached[0].as_ref(), cached[1].as_ref()],
                )?;
            }
            // Shampoo's composed step (`--skip-rule shampoo-update`): `ops::shampoo`.
            Op::ShampooFactorUpdate {
                grad,
                factors,
                beta2,
                use_bias_correction,
                max_preconditioner_dim,
            } => {
                let fs: Vec<&Buf> = factors.iter().map(|&f| self.b(f)).collect();
                let shape = &self.plan.buffer(*grad).shape;
                let blocking = (shape.as_slice(), *max_preconditioner_dim);
                let coefficients = (*beta2, *use_bias_correction);
                sh::shampoo_factor_update(dev, t, coefficients, blocking, self.b(*grad), &fs)?;
            }
            Op::ShampooPrecondition {
                x,
                out,
                roots,
                max_preconditioner_dim,
            } => {
                let rs: Vec<&Buf> = roots.iter().map(|&r| self.b(r)).collect();
                let blocking = (
                    self.plan.buffer(*x).shape.as_slice(),
                    *max_preconditioner_dim,
                );
                sh::shampoo_precondition(dev, blocking, self.b(*x), self.b(*out), &rs, s)?;
            }
            Op::Graft {
                x,
                graft,
                out,
                max_preconditioner_dim,
            } => {
                let blocking = (
                    self.plan.buffer(*x).shape.as_slice(),
                    *max_preconditioner_dim,
                );
                let (x, g, o) = (self.b(*x), self.b(*graft), self.b(*out));
                sh::graft(dev, t, blocking, x, g, o, s)?;
            }
            // KL-Shampoo's composed step (`--skip-rule kl-shampoo-update`): `ops::kl_shampoo`.
            Op::KlScale {
                x,
                out,
                eig_left,
                eig_right,
                eps,
            } => {
                let (m, n) = self.dims(*x);
                let eig = (self.b(*eig_left), self.b(*eig_right));
                kl::kl_scale(dev, t, *eps, self.b(*x), self.b(*out), eig, m, n, s)?;
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
                let (m, n) = self.dims(*grad);
                let side = |factor: &Option<BufferId>, basis: &Option<BufferId>, eig: BufferId| {
                    kl::KlSide {
                        factor: factor.map(|f| self.b(f)),
                        basis: basis.map(|q| self.b(q)),
                        eig: self.b(eig),
                    }
                };
                let hp = kl::FactorHyper {
                    shampoo_beta: *shampoo_beta,
                    init_factor: *init_factor,
                    max_clamp_value: *max_clamp_value,
                };
                let (l, r) = (
                    side(factor_left, basis_left, *eig_left),
                    side(factor_right, basis_right, *eig_right),
                );
                kl::kl_factor_update(dev, t, &hp, self.b(*grad), l, r, m, n, s)?;
            }
            Op::BlockCopy { src, dst, row, col } => {
                let (n, (r, c)) = (self.dims(*src).1, self.dims(*dst));
                dev.copy_block_f32(self.b(*dst), (c, 0, 0), self.b(*src), (n, *row, *col), r, c)?;
            }
            Op::BlockWrite { src, dst, row, col } => {
                let (n, (r, c)) = (self.dims(*dst).1, self.dims(*src));
                dev.copy_block_f32(self.b(*dst), (n, *row, *col), self.b(*src), (c, 0, 0), r, c)?;
            }
            Op::Embedding { table, ids, out } => {
                let (v, c) = self.dims(*table);
                nn::embedding_forward(dev, self.b(*table), self.b(*ids), self.b(*out), v, c)?;
            }
            Op::EmbeddingBackward { dout, ids, dtable } => {
                let (v, c) = self.dims(*dtable);
                let (b, s) = (|id: BufferId| self.b(id), &self.scratch);
                nn::embedding_backward(dev, b(*dout), b(*ids), b(*dtable), v, c, s)?;
            }
            Op::AddPositional {
                x,
                pos,
                out,
                seq_len,
            } => {
                let c = self.dims(*x).1;
                nn::add_positional(dev, self.b(*x), self.b(*pos), self.b(*out), c, *seq_len)?;
            }
            Op::AddPositionalBackward {
                dout,
                dpos,
                seq_len,
            } => {
                let c = self.dims(*dout).1;
                nn::add_positional_backward(dev, self.b(*dout), self.b(*dpos), c, *seq_len)?;
            }
            Op::LayerNorm {
                x,
                weight,
                bias,
                out,
                eps,
            } if self.b(*out).elem() == Elem::BF16 => {
                let c = self.dims(*x).1;
                let bias = bias.map(|b| self.b(b));
                norm::layernorm_forward_bf16(
                    dev,
                    self.b(*x),
                    self.b(*weight),
                    bias,
                    self.b(*out),
                    c,
                    *eps,
                )?;
            }
            Op::LayerNorm {
                x,
                weight,
                bias,
                out,
                eps,
            } => {
                let c = self.dims(*x).1;
                let bias = bias.map(|b| self.b(b));
                norm::layernorm_forward(
                    dev,
                    self.b(*x),
                    self.b(*weight),
                    bias,
                    self.b(*out),
                    c,
                    *eps,
                )?;
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
                let c = self.dims(*x).1;
                let dbias = dbias.map(|b| self.b(b));
                norm::layernorm_backward(
                    dev,
                    self.b(*dout),
                    self.b(*x),
                    self.b(*weight),
                    self.b(*dx),
                    self.b(*dweight),
                    dbias,
                    c,
                    *eps,
                    s,
                )?;
            }
            Op::RmsNorm {
                x,
                weight,
                out,
                eps,
            } => {
                let c = self.dims(*x).1;
                norm::rmsnorm_forward(dev, self.b(*x), self.b(*weight), self.b(*out), c, *eps)?;
            }
            Op::RmsNormBackward {
                dout,
                x,
                weight,
                dx,
                dweight,
                eps,
            } => {
                let c = self.dims(*x).1;
                norm::rmsnorm_backward(
                    dev,
                    self.b(*dout),
                    self.b(*x),
                    self.b(*weight),
                    self.b(*dx),
                    self.b(*dweight),
                    c,
                    *eps,
                    s,
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
                let (ar, ac) = self.dims(*a);
                let (br, bc) = self.dims(*b);
                let (ad, bd) = (Dims::new(ar, ac), Dims::new(br, bc));
                // out = α·op(a)op(b) + β·out: α = 1, β = 1 when accumulating; gradient
                // accumulation (`t` is the micro-batch): α = scale, β = 0 on the first
                // micro-batch and 1 after.
                let (alpha, beta) = match micro_accumulate {
                    Some(s) => (*s as f32, if t == 0 { 0.0 } else { 1.0 }),
                    None => (1.0, if *accumulate { 1.0 } else { 0.0 }),
                };
                if self.bf16_operands(*a, *b)? {
                    let (sa, sb) = (self.gemm_operand(*a)?, self.gemm_operand(*b)?);
                    let out = self.b(*out);
                    gemm::gemm_bf16(
                        &self.dev, &sa, ad, &sb, bd, out, *trans_a, *trans_b, alpha, beta,
                    )?;
                } else {
                    let (a, b, out) = (self.b(*a), self.b(*b), self.b(*out));
                    gemm::gemm_f32(dev, a, ad, b, bd, out, *trans_a, *trans_b, alpha, beta)?;
                }
            }
            Op::MatMulBias {
                a,
                b,
                bias,
                out,
                trans_a,
                trans_b,
            } => {
                let (ar, ac) = self.dims(*a);
                let (br, bc) = self.dims(*b);
                let (ad, bd) = (Dims::new(ar, ac), Dims::new(br, bc));
                let bf16 = self.bf16_operands(*a, *b)?;
                if bf16 && gemm::has_fused_bias(&self.dev) {
                    let (sa, sb) = (self.gemm_operand(*a)?, self.gemm_operand(*b)?);
                    gemm::gemm_bf16_bias(
                        &self.dev,
                        &sa,
                        ad,
                        &sb,
                        bd,
                        self.b(*bias),
                        self.b(*out),
                        *trans_a,
                        *trans_b,
                    )?;
                } else {
                    // The product, then the bias added in place (the unfused pair's math):
                    // under fp32, or where cuBLASLt did not load.
                    if self.b(*out).elem() == Elem::BF16 {
                        return Err(CudaError::Invalid {
                            op: "mat_mul_bias",
                            what: "a bf16 output is rounded in cuBLASLt's bias epilogue, and \
                                   cuBLASLt (libcublasLt.so) is not available"
                                .into(),
                        });
                    }
                    if bf16 {
                        let (sa, sb) = (self.gemm_operand(*a)?, self.gemm_operand(*b)?);
                        gemm::matmul_bf16(
                            &self.dev,
                            &sa,
                            ad,
                            &sb,
                            bd,
                            self.b(*out),
                            *trans_a,
                            *trans_b,
                            false,
                        )?;
                    } else {
                        let (a, b, o) = (self.b(*a), self.b(*b), self.b(*out));
                        gemm::matmul(dev, a, ad, b, bd, o, *trans_a, *trans_b, false)?;
                    }
                    let c = self.dims(*out).1;
                    let o = self.b(*out);
                    nn::bias_add(&self.dev, o, self.b(*bias), o, c)?;
                }
            }
            Op::BiasAdd { x, bias, out } => {
                let c = self.dims(*x).1;
                nn::bias_add(dev, self.b(*x), self.b(*bias), self.b(*out), c)?;
            }
            Op::SumRows { x, out } => {
                let c = self.dims(*x).1;
                nn::sum_rows(dev, self.b(*x), self.b(*out), c, s)?;
            }
            Op::SumRowsCast { x, out, out_bf16 } => {
                let c = self.dims(*x).1;
                nn::sum_rows_cast(dev, self.b(*x), self.b(*out), self.b(*out_bf16), c, s)?;
            }
            Op::Add { a, b, out } => nn::add(dev, self.b(*a), self.b(*b), self.b(*out))?,
            Op::Cast { x, out } => gemm::cast_f32_to_bf16(dev, self.b(*x), self.b(*out))?,
            Op::Gelu { x, out } => nn::gelu_forward(dev, self.b(*x), self.b(*out))?,
            Op::GeluBackward { dout, x, dx } => {
                nn::gelu_backward(dev, self.b(*dout), self.b(*x), self.b(*dx))?
            }
            Op::SwiGlu { x, out } => {
                let f = self.dims(*out).1;
                nn::swiglu_forward(dev, self.b(*x), self.b(*out), f)?;
            }
            Op::SwiGluBackward { dout, x, dx } => {
                let f = self.dims(*dout).1;
                nn::swiglu_backward(dev, self.b(*dout), self.b(*x), self.b(*dx), f)?;
            }
            Op::Rope {
                x,
                out,
                seq_len,
                head_dim,
                rotated_cols,
                theta,
            } => {
                let d = nn::RopeDims {
                    width: self.dims(*x).1,
                    seq_len: *seq_len,
                    head_dim: *head_dim,
                    rotated_cols: *rotated_cols,
                    theta: *theta,
                };
                nn::rope_forward(dev, self.b(*x), self.b(*out), &d, &self.scratch)?;
            }
            Op::RopeBackward {
                dout,
                dx,
                seq_len,
                head_dim,
                rotated_cols,
                theta,
            } => {
                let d = nn::RopeDims {
                    width: self.dims(*dout).1,
                    seq_len: *seq_len,
                    head_dim: *head_dim,
                    rotated_cols: *rotated_cols,
                    theta: *theta,
                };
                nn::rope_backward(dev, self.b(*dout), self.b(*dx), &d, &self.scratch)?;
            }
            Op::Attention {
                qkv,
                out,
                lse,
                batch,
                seq_len,
                n_heads,
            } => {
                let d = attn_dims(*batch, *seq_len, *n_heads, self.dims(*qkv).1);
                let math = flash_math(self.attention, &d, self.precision);
                // The bf16 qkv a saving forward keeps: the plan's own when the `fuse` pass made
                // qkv bf16, else the engine's copy in the attention-saved arena.
                let plan_bf16 = self.b(*qkv).elem() == Elem::BF16;
                let qkv16 = if plan_bf16 {
                    Some(self.b(*qkv).clone())
                } else {
                    self.saved_qkv.get(qkv).map(|sv| sv.qkv16.clone())
                };
                match (lse, qkv16, math) {
                    // A saving forward: lse into its plan buffer, the bf16 qkv into the cache.
                    (Some(lse), Some(qkv16), Some(at::FlashMath::Bf16)) => {
                        let sv = at::FlashSaved {
                            lse: self.b(*lse),
                            qkv16: &qkv16,
                        };
                        at::flash_attention_forward_saving(
                            dev,
                            self.b(*qkv),
                            self.b(*out),
                            &d,
                            s,
                            &sv,
                        )?;
                        let gen = self.write_gen[qkv.index()];
                        if let Some(slot) = self.saved_qkv.get(qkv).map(|sv| sv.slot) {
                            self.saved_slots[slot].holds = Some((*qkv, gen));
                        }
                    }
                    (Some(_), ..) => {
                        return Err(CudaError::Invalid {
                            op: "attention",
                            what: "a saving attention (`lse`) needs the tensor-core kernels".into(),
                        })
                    }
                    (None, _, Some(math)) => {
                        at::flash_attention_forward(dev, self.b(*qkv), self.b(*out), &d, s, math)?
                    }
                    (None, _, None) => {
                        at::attention_forward(dev, self.b(*qkv), self.b(*out), &d, s)?
                    }
                }
            }
            Op::AttentionBackward {
                dout,
                qkv,
                fwd_out,
                lse,
                dqkv,
                batch,
                seq_len,
                n_heads,
            } => {
                let d = attn_dims(*batch, *seq_len, *n_heads, self.dims(*qkv).1);
                let math = flash_math(self.attention, &d, self.precision);
                // The forward's bf16 qkv, if made from the qkv these buffers hold now and
                // its slot still holds it (a bf16 plan qkv is always current).
                let qkv16 = if self.b(*qkv).elem() == Elem::BF16 {
                    Some(self.b(*qkv).clone())
                } else {
                    let now = Some((*qkv, self.write_gen[qkv.index()]));
                    self.saved_qkv
                        .get(qkv)
                        .filter(|sv| self.saved_slots[sv.slot].holds == now)
                        .map(|sv| sv.qkv16.clone())
                };
                let saved = match (fwd_out, lse, qkv16, math) {
                    (Some(o), Some(l), Some(q16), Some(at::FlashMath::Bf16)) => {
                        Some((self.gemm_operand(*o)?, *l, q16))
                    }
                    _ => None,
                };
                let (dev, s) = (&self.dev, &self.scratch);
                let (g, q, dq) = (self.b(*dout), self.b(*qkv), self.b(*dqkv));
                if let Some((o16, l, q16)) = saved {
                    let fs = at::FlashSaved {
                        lse: self.b(l),
                        qkv16: &q16,
                    };
                    at::flash_attention_backward_saved(dev, g, dq, &d, s, &fs, &o16)?;
                } else if let Some(math) = math {
                    at::flash_attention_backward(dev, g, q, dq, &d, s, math)?;
                } else {
                    at::attention_backward(dev, g, q, dq, &d, s)?;
                }
            }
            Op::CrossEntropy {
                logits,
                targets,
                loss: l,
            } => {
                let v = self.dims(*logits).1;
                loss::cross_entropy_forward(
                    dev,
                    self.b(*logits),
                    self.b(*targets),
                    self.b(*l),
                    v,
                    s,
                )?;
            }
            Op::CrossEntropyBackward {
                logits,
                targets,
                dlogits,
            } if self.b(*dlogits).elem() == Elem::BF16 => {
                let v = self.dims(*logits).1;
                loss::cross_entropy_backward_bf16(
                    dev,
                    self.b(*logits),
                    self.b(*targets),
                    self.b(*dlogits),
                    v,
                )?;
            }
            Op::CrossEntropyBackward {
                logits,
                targets,
                dlogits,
            } => {
                let v = self.dims(*logits).1;
                loss::cross_entropy_backward(
                    dev,
                    self.b(*logits),
                    self.b(*targets),
                    self.b(*dlogits),
                    v,
                )?;
            }
            Op::GradSumSquares {
                grad,
                partials,
                slot,
            } => loss::grad_sum_squares(dev, self.b(*grad), self.b(*partials), *slot)?,
            Op::ScaleByScalar { x, scale } => {
                loss::scale_by_scalar(dev, self.b(*x), self.b(*scale))?
            }
            // `t` is the backward's micro-batch (`CudaEngine::backward`).
            Op::GradAccumulate {
                micro,
                total,
                scale,
            } => loss::grad_accumulate(dev, self.b(*micro), self.b(*total), *scale, t == 0)?,
            Op::ClipGradNorm {
                norm,
                scale: Some(scale),
                max_norm,
                partials: Some(partials),
                ..
            } => {
                loss::clip_grad_norm_partials(
                    dev,
                    self.b(*partials),
                    self.b(*norm),
                    self.b(*scale),
                    *max_norm,
                )?;
                let v = dev.download::<f32>(self.b(*norm))?;
                return Ok(Some(v.first().map_or(f64::NAN, |&x| f64::from(x))));
            }
            Op::ClipGradNorm {
                grads,
                norm,
                scale,
                max_norm,
                partials,
            } => {
                if partials.is_some() {
                    return Err(CudaError::Invalid {
                        op: "clip_grad_norm",
                        what: "partials without a scale output (the plan verifier refuses this)"
                            .into(),
                    }
                    .into());
                }
                let gs: Vec<&Buf> = grads.iter().map(|g| self.b(*g)).collect();
                let scale = scale.map(|b| self.b(b));
                loss::clip_grad_norm(dev, &gs, self.b(*norm), scale, *max_norm, s)?;
                let v = dev.download::<f32>(self.b(*norm))?;
                return Ok(Some(v.first().map_or(f64::NAN, |&x| f64::from(x))));
            }
            Op::AdamW { on_host: true, .. } => {
                // `CudaEngine::run` hands these to the host-update worker.
                return Err(CudaError::Invalid {
                    op: op.name(),
                    what: "a host-placed update reached the device executor".into(),
                });
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
                on_host: false,
            } => {
                let key = schedule::adamw_kernel_key(*beta1, *beta2, *eps, *weight_decay);
                let k = self
                    .adamw_kernels
                    .get(&key)
                    .ok_or_else(|| CudaError::Invalid {
                        op: "adam_w",
                        what: "the AdamW kernel of these constants was not compiled at set-up"
                            .into(),
                    })?;
                let st = op::AdamWStep {
                    t,
                    lr: lr * lr_mult,
                    beta1: *beta1,
                    beta2: *beta2,
                    eps: *eps,
                    weight_decay: *weight_decay,
                };
                k.run(
                    dev,
                    &st,
                    self.b(*param),
                    self.b(*grad),
                    self.b(*exp_avg),
                    self.b(*exp_avg_sq),
                    grad_scale.map(|b| self.b(b)),
                )?;
            }
            Op::ElementwiseUpdate {
                param,
                grad,
                state,
                results,
                rule,
            } => {
                let k = self.update_kernels.get(&rule.kernel_key()).ok_or_else(|| {
                    CudaError::Invalid {
                        op: "elementwise_update",
                        what: format!("the `{}` rule was not compiled at set-up", rule.optimizer),
                    }
                })?;
                let scalars: Vec<f32> = optim::optimizers::step_scalars(rule, rule.lr * lr_mult, t);
                let tensors: Vec<&Buf> = [*param, *grad]
                    .iter()
                    .chain(state)
                    .chain(results)
                    .map(|&b| self.b(b))
                    .collect();
                k.run(dev, &tensors, &scalars, None)?;
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
                let (m, n) = self.dims(*param);
                let proj = CudaEngine::soap_projections(self.precision);
                let mut cached = [None, None];
                if proj == op::SoapProjections::Bf16 {
                    for (slot, q) in cached.iter_mut().zip([basis_left, basis_right]) {
                        if let Some(q) = q.filter(|q| self.shadows[q.index()].is_some()) {
                            *slot = Some(self.shadow(q)?);
                        }
                    }
                }
                let (dev, s) = (&self.dev, &self.scratch);
                op::soap_update(
                    dev,
                    t,
                    hyper.lr * lr_mult,
                    hyper,
                    self.b(*param),
                    self.b(*grad),
                    self.b(*exp_avg),
                    self.b(*exp_avg_sq),
                    basis_left.map(|q| self.b(q)),
                    basis_right.map(|q| self.b(q)),
                    m,
                    n,
                    s,
                    proj,
                    [cached[0].as_ref(), cached[1].as_ref()],
                )?;
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
                let fs: Vec<&Buf> = factors.iter().map(|&f| self.b(f)).collect();
                let rs: Vec<&Buf> = roots.iter().map(|&r| self.b(r)).collect();
                sh::shampoo_update(
                    dev,
                    t,
                    hyper.lr * lr_mult,
                    hyper,
                    self.b(*param),
                    self.b(*grad),
                    self.b(*exp_avg),
                    graft_sq.map(|v| self.b(v)),
                    &self.plan.buffer(*param).shape,
                    &fs,
                    &rs,
                    s,
                )?;
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
                let (m, n) = self.dims(*param);
                let side = |factor: &Option<BufferId>, basis: &Option<BufferId>, eig: BufferId| {
                    kl::KlSide {
                        factor: factor.map(|f| self.b(f)),
                        basis: basis.map(|q| self.b(q)),
                        eig: self.b(eig),
                    }
                };
                kl::kl_shampoo_update(
                    dev,
                    t,
                    hyper.lr * lr_mult,
                    hyper,
                    self.b(*param),
                    self.b(*grad),
                    self.b(*exp_avg),
                    side(factor_left, basis_left, *eig_left),
                    side(factor_right, basis_right, *eig_right),
                    m,
                    n,
                    s,
                )?;
            }
            Op::SoapFactorUpdate {
                grad,
                factor_left,
                factor_right,
                shampoo_beta,
            } => {
                let (m, n) = self.dims(*grad);
                op::soap_factor_update(
                    dev,
                    self.b(*grad),
                    factor_left.map(|f| self.b(f)),
                    factor_right.map(|f| self.b(f)),
                    m,
                    n,
                    *shampoo_beta,
                    s,
                    CudaEngine::soap_projections(self.precision),
                )?;
            }
            // Host tier <-> staging buffer on the copy streams, ordered by the events of
            // `copies::CopyOrder` (placed around this call by `run`).
            // NVMe buffers through the pinned bounce slots (`nvme_tier`).
            // A copy of the warm-up steps only (`host_updates = delayed`), after them.
            Op::CopyIn {
                last_step: Some(l), ..
            } if t > *l => {}
            Op::CopyIn { src, dst, .. } if self.nvme.as_ref().is_some_and(|n| n.holds(*src)) => {
                if let Some(nv) = self.nvme.as_mut() {
                    nv.copy_in(&self.dev, *src, &self.bufs[dst.index()])?;
                }
            }
            Op::CopyOut { src, dst } if self.nvme.as_ref().is_some_and(|n| n.holds(*dst)) => {
                if let Some(nv) = self.nvme.as_mut() {
                    nv.copy_out(&self.dev, &self.bufs[src.index()], *dst)?;
                }
            }
            Op::CopyIn { src, dst, .. } | Op::CopyOut { src, dst } => {
                self.dev
                    .copy(self.b(*dst), self.b(*src), super::copies::stream_of(op))?
            }
        }
        Ok(None)
    }
}
