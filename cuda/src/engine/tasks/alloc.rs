//! [`Refreshes::new`]: the CUDA engine's refresh allocations, each where the plan placed it
//! (the refreshers and their cuSOLVER work, the sync slot, the side-stream launcher and its
//! staging for pinned shadows, the swap buffers, the shadow pools in device or pinned memory;
//! `schedule::reserve::refresh_bytes` is the compiler's count of the same bytes).
use super::*;

impl Refreshes {
    /// Allocates what the plan's tasks need, each where the plan placed it.
    pub(in crate::engine) fn new(
        dev: &Arc<Device>,
        plan: &Plan,
        opts: &EngineOptions,
        trace: Option<GpuTrace>,
    ) -> Result<Refreshes, EngineError> {
        let e = |w: &'static str| move |err: CudaError| cuda_err(w, err);
        let runtime = RefreshRuntime::new(plan, opts);
        let tasks = runtime.tasks().to_vec();
        // Moments go through the swap for SOAP refreshes only (`schedule::reserve` counts the
        // same).
        let soap = |t: &&RefreshTask| t.method == RefreshMethod::Soap;
        let (mut max_dim, mut max_mn) = (0usize, 0usize);
        for t in &tasks {
            max_dim = max_dim.max(dim(plan, t));
        }
        for t in tasks.iter().filter(soap) {
            max_mn = max_mn.max(plan.buffer(t.exp_avg).numel());
        }
        let any_gpu = tasks.iter().any(on_gpu);
        let any_host = tasks.iter().any(|t| !on_gpu(t));
        let any_async = tasks.iter().any(|t| t.staleness > 0);
        let side_dim = tasks
            .iter()
            .filter(|t| on_gpu(t) && t.staleness > 0)
            .map(|t| dim(plan, t))
            .max();
        // Kronecker factors and eigenbases the plan keeps in pinned host memory: device copies
        // in the refreshers and the swap (`schedule::reserve::RefreshStaging`).
        let staging = schedule::reserve::refresh_staging(plan);
        let mut bytes = 0;
        let mut arenas = Vec::new();
        let (sync, sync_slot) = if any_gpu {
            let (mut r, b) = GpuRefresher::new(dev, StreamKind::Compute, max_dim)
                .map_err(e("setting up cuSOLVER refreshes"))?;
            bytes += r
                .stage_offloaded(dev, staging.sync_factor, staging.sync_basis)
                .map_err(e("allocating the refresh staging copies"))?;
            bytes += b + RefreshSlot::bytes(max_dim);
            let mut a = dev
                .arena("refresh-slot", Tier::Device, RefreshSlot::bytes(max_dim))
                .map_err(e("allocating the refresh slot"))?;
            let slot =
                RefreshSlot::carve(&mut a, max_dim).map_err(e("carving the refresh slot"))?;
            arenas.push(a);
            (Some(r), Some(slot))
        } else {
            (None, None)
        };
        // Pinned GPU-side shadows: the side stream's device copy of the factor and its output
        // slot, reused by one refresh after the other.
        let pinned = plan.memory.pinned_refresh_shadows;
        let side = match side_dim {
            Some(d) => {
                let (mut r, b) = GpuRefresher::new(dev, StreamKind::Side, d)
                    .map_err(e("setting up side-stream cuSOLVER refreshes"))?;
                // Its factor is a device snapshot (or staged below); an offloaded basis is
                // read live, through the refresher's copy.
                bytes += r
                    .stage_offloaded(dev, false, staging.side_basis)
                    .map_err(e("allocating the side stream's basis copy"))?;
                bytes += b;
                let staging = if pinned {
                    let n = d * d * 4 + crate::memory::BUF_ALIGN + RefreshSlot::bytes(d);
                    let mut a = dev
                        .arena("refresh-side-staging", Tier::Device, n)
                        .map_err(e("allocating the side stream's staging"))?;
                    let c = e("carving the side stream's staging");
                    let staging = SideStaging {
                        factor: a.buf(Elem::F32, d * d).map_err(c)?,
                        slot: RefreshSlot::carve(&mut a, d).map_err(c)?,
                    };
                    bytes += n;
                    arenas.push(a);
                    Some(staging)
                } else {
                    None
                };
                Some(SideLauncher::spawn(Arc::clone(dev), r, staging, trace)?)
            }
            None => None,
        };
        let swap = if any_gpu || any_async {
            let chunk = schedule::reserve::swap_chunk_len(max_dim, max_mn);
            bytes += SwapWork::bytes(max_dim, chunk, staging.swap_basis);
            Some(
                SwapWork::new(dev, max_dim, chunk, staging.swap_basis)
                    .map_err(e("allocating the swap buffers"))?,
            )
        } else {
            None
        };
        // Shadows: pools sized to the refreshes that can be in flight at once, per placement
        // and factor side (`schedule::reserve::refresh_pools`), one device arena and one
        // pinned arena for all of them. A launch takes a shadow, its install gives it back.
        let pool_sizes = schedule::reserve::refresh_pools(plan);
        let (mut dev_bytes, mut pin_bytes) = (0usize, 0usize);
        for p in &pool_sizes {
            dev_bytes +=
                p.count * schedule::reserve::shadow_device_bytes(p.dim, p.gpu_side, pinned);
            pin_bytes +=
                p.count * schedule::reserve::shadow_pinned_bytes(p.dim, p.gpu_side, pinned);
        }
        let mut pools = Vec::with_capacity(pool_sizes.len());
        let mut pinned_bytes = 0;
        if dev_bytes + pin_bytes > 0 {
            // No device arena when every shadow is pinned (the reserve counts none).
            let mut da = (dev_bytes > 0)
                .then(|| dev.arena("refresh-shadows", Tier::Device, dev_bytes))
                .transpose()
                .map_err(e("allocating refresh shadows"))?;
            let mut pa = dev
                .arena("refresh-shadows-pinned", Tier::PinnedHost, pin_bytes)
                .map_err(e("allocating pinned refresh shadows"))?;
            let c = e("carving refresh shadows");
            for p in &pool_sizes {
                let (d, gpu) = (p.dim, p.gpu_side);
                let mut free = Vec::with_capacity(p.count);
                for _ in 0..p.count {
                    let host = |pa: &mut Arena, elem, len| -> Result<Option<Buf>, EngineError> {
                        if gpu {
                            Ok(None)
                        } else {
                            pa.buf(elem, len).map(Some).map_err(c)
                        }
                    };
                    let on_host = gpu && pinned;
                    let a = match (on_host, da.as_mut()) {
                        (true, _) => &mut pa,
                        (false, Some(da)) => da,
                        (false, None) => {
                            return Err(EngineError::Unsupported(
                                "internal: a device refresh shadow without its arena".into(),
                            ))
                        }
                    };
                    let snapshot = a.buf(Elem::F32, d * d).map_err(c)?;
                    let slot = RefreshSlot::carve(a, d).map_err(c)?;
                    free.push(Shadow {
                        snapshot,
                        slot,
                        pinned: on_host,
                        status_host: pa.buf(Elem::I32, STATUS_WORDS).map_err(c)?,
                        host_f: host(&mut pa, Elem::F32, d * d)?,
                        host_q: host(&mut pa, Elem::F32, d * d)?,
                        host_idx: host(&mut pa, Elem::I32, d)?,
                    });
                }
                pools.push(ShadowPool {
                    gpu_side: gpu,
                    dim: d,
                    free,
                });
            }
            bytes += dev_bytes + pin_bytes;
            pinned_bytes = pin_bytes;
            arenas.extend(da);
            arenas.push(pa);
        }
        let mut held = Vec::with_capacity(tasks.len());
        held.resize_with(tasks.len(), || None);
        let host_pool = if any_host {
            Some(Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(host_pool_threads())
                    .thread_name(|i| format!("asteria-cuda-host-{i}"))
                    .build()
                    .map_err(|err| EngineError::Unsupported(format!("host pool: {err}")))?,
            ))
        } else {
            None
        };
        Ok(Refreshes {
            sync,
            sync_slot,
            side,
            swap,
            pools,
            held,
            runtime,
            synced: false,
            host_pool,
            times: [0.0; 5],
            _arenas: arenas,
            bytes,
            pinned_bytes,
        })
    }
}
