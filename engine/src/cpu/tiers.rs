//! The CPU engine's offload tiers: where the buffers the compiler's `tier-placement` pass moved
//! off the device live (`host` and `nvme` arenas of the plan's memory plan), and the plan's
//! `CopyIn` / `CopyOut` ops that move them through their staging buffers.
//!
//! - `host`: one vector per offloaded buffer, outside the engine's working [`Store`] (on a GPU
//!   this is pinned host memory; here it exercises the same placement and copies).
//! - `nvme`: a [`NvmeStore`] file in the plan's NVMe directory (`nvme = "DIR"`), one region per
//!   buffer at its plan offset (scaled from the plan's f32 bytes to this engine's float size;
//!   [`crate::nvme::plan_store`] and [`crate::nvme::plan_regions`], shared with the CUDA engine),
//!   checksummed per block and verified on every read: a truncated or corrupted file stops the
//!   step with [`EngineError::Tier`] before the bad state is used.
//!
//! Copies are synchronous on this engine (the CUDA engine's copy streams are what overlap
//! them); the values are the bits the working buffer held, so a tiered run is bit-identical to
//! the untiered one.
use super::store::{Data, Loc, Store};
use super::Float;
use crate::nvme::NvmeStore;
use crate::EngineError;
use schedule::{ArenaKind, BufferId, DType, Plan};

/// Offloaded buffers of one engine.
pub(crate) struct Tiers<T> {
    /// Per buffer: its contents when it lives in the host tier.
    host: Vec<Option<Vec<T>>>,
    /// Per buffer: its region offset in the NVMe store when it lives there.
    nvme_at: Vec<Option<u64>>,
    nvme: Option<NvmeStore>,
}

fn tier_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tier(e.to_string())
}

impl<T: Float> Tiers<T> {
    /// The stores of `plan`'s offloaded buffers, each filled by `init(buffer index, values)`
    /// (the engine's initialisation, so that the same seed gives the same state).
    ///
    /// # Errors
    /// A non-f32 offloaded buffer; a missing NVMe directory; the NVMe file cannot be reserved
    /// (a full disk) or written.
    pub(crate) fn new(
        plan: &Plan,
        init: impl Fn(usize, &mut [T]) + Sync,
    ) -> Result<Tiers<T>, EngineError> {
        let n = plan.buffers.len();
        let mut tiers = Tiers {
            host: (0..n).map(|_| None).collect(),
            nvme_at: vec![None; n],
            nvme: None,
        };
        let scale = T::BYTES as u64 / 4;
        tiers.nvme = crate::nvme::plan_store(plan, scale)?;
        let regions = crate::nvme::plan_regions(plan, scale);
        for (i, b) in plan.buffers.iter().enumerate() {
            let Some(slot) = plan.memory.slots.get(i).filter(|s| !s.arena.on_device()) else {
                continue;
            };
            if b.dtype != DType::F32 {
                return Err(tier_err(format!(
                    "`{}` is offloaded but is {:?}; only f32 state is offloaded",
                    b.name, b.dtype
                )));
            }
            let mut v = vec![T::zero(); b.numel()];
            init(i, &mut v);
            match slot.arena {
                ArenaKind::Host => tiers.host[i] = Some(v),
                _ => {
                    let at = regions[i].ok_or_else(|| tier_err("no NVMe region"))?;
                    tiers.nvme_at[i] = Some(at);
                    let store = tiers
                        .nvme
                        .as_ref()
                        .ok_or_else(|| tier_err("no NVMe store"))?;
                    store.write(at, &to_bytes(&v)).map_err(tier_err)?;
                }
            }
        }
        Ok(tiers)
    }

    /// Whether buffer `id` lives in the host or NVMe tier.
    pub(crate) fn is_offloaded(&self, id: BufferId) -> bool {
        matches!(self.host.get(id.index()), Some(Some(_)))
            || matches!(self.nvme_at.get(id.index()), Some(Some(_)))
    }

    /// Reads the offloaded buffer `src` into `out` (its element count).
    pub(crate) fn read(&self, src: BufferId, out: &mut [T], loc: Loc) -> Result<(), EngineError> {
        let at = |what: String| tier_err(format!("{loc}: {what}"));
        if let Some(Some(v)) = self.host.get(src.index()) {
            if v.len() != out.len() {
                return Err(at("host copy of a different length".into()));
            }
            out.copy_from_slice(v);
            return Ok(());
        }
        match (self.nvme_at.get(src.index()).copied().flatten(), &self.nvme) {
            (Some(offset), Some(store)) => {
                let mut bytes = vec![0u8; out.len() * T::BYTES];
                store
                    .read(offset, &mut bytes)
                    .map_err(|e| at(e.to_string()))?;
                from_bytes(&bytes, out);
                Ok(())
            }
            _ => Err(at(format!("buffer #{} is not offloaded", src.0))),
        }
    }

    /// Writes `v` (its element count) to the offloaded buffer `dst`.
    pub(crate) fn write(&mut self, dst: BufferId, v: &[T], loc: Loc) -> Result<(), EngineError> {
        let at = |what: String| tier_err(format!("{loc}: {what}"));
        if let Some(Some(h)) = self.host.get_mut(dst.index()) {
            if h.len() != v.len() {
                return Err(at("host copy of a different length".into()));
            }
            h.copy_from_slice(v);
            return Ok(());
        }
        match (self.nvme_at.get(dst.index()).copied().flatten(), &self.nvme) {
            (Some(offset), Some(store)) => store
                .write(offset, &to_bytes(v))
                .map_err(|e| at(e.to_string())),
            _ => Err(at(format!("buffer #{} is not offloaded", dst.0))),
        }
    }

    /// `CopyIn`: the offloaded `src` into the working buffer `dst`.
    pub(crate) fn copy_in(
        &self,
        st: &mut Store<T>,
        src: BufferId,
        dst: BufferId,
        loc: Loc,
    ) -> Result<(), EngineError> {
        let Some(Data::F(out)) = st.data.get_mut(dst.index()) else {
            return Err(tier_err(format!(
                "{loc}: staging buffer #{} is not a float buffer",
                dst.0
            )));
        };
        self.read(src, out, loc)
    }

    /// `CopyOut`: the working buffer `src` back to the offloaded `dst`.
    pub(crate) fn copy_out(
        &mut self,
        st: &Store<T>,
        src: BufferId,
        dst: BufferId,
        loc: Loc,
    ) -> Result<(), EngineError> {
        let Some(Data::F(v)) = st.data.get(src.index()) else {
            return Err(tier_err(format!(
                "{loc}: staging buffer #{} is not a float buffer",
                src.0
            )));
        };
        self.write(dst, v, loc)
    }

    /// Brings the offloaded buffers among `ids` into working storage in `st` (host tasks that
    /// re-project moments at a refresh swap run on the host, where the host tier lives);
    /// returns the ones it brought in, for [`Tiers::page_out`].
    pub(crate) fn page_in(
        &self,
        st: &mut Store<T>,
        ids: &[BufferId],
        loc: Loc,
    ) -> Result<Vec<BufferId>, EngineError> {
        let mut brought = Vec::new();
        for &id in ids {
            if !self.is_offloaded(id) {
                continue;
            }
            let len = st.shapes[id.index()].iter().product();
            st.data[id.index()] = Data::F(vec![T::zero(); len]);
            self.copy_in(st, id, id, loc)?;
            brought.push(id);
        }
        Ok(brought)
    }

    /// Writes the buffers [`Tiers::page_in`] brought in back to their tier and frees their
    /// working storage.
    pub(crate) fn page_out(
        &mut self,
        st: &mut Store<T>,
        ids: &[BufferId],
        loc: Loc,
    ) -> Result<(), EngineError> {
        for &id in ids {
            self.copy_out(st, id, id, loc)?;
            st.data[id.index()] = Data::F(Vec::new());
        }
        Ok(())
    }

    /// Bytes read from and written to the NVMe store so far, and whether it uses O_DIRECT.
    pub(crate) fn nvme_stats(&self) -> Option<crate::nvme::NvmeStats> {
        self.nvme.as_ref().map(|s| s.stats())
    }
}

/// `v` as little-endian bytes of `T` (`f32` or `f64`), bit-exact.
fn to_bytes<T: Float>(v: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * T::BYTES);
    for &x in v {
        if T::BYTES == 4 {
            out.extend_from_slice(&(Float::to_f64(x) as f32).to_le_bytes());
        } else {
            out.extend_from_slice(&Float::to_f64(x).to_le_bytes());
        }
    }
    out
}

/// The inverse of [`to_bytes`].
fn from_bytes<T: Float>(bytes: &[u8], out: &mut [T]) {
    for (x, c) in out.iter_mut().zip(bytes.chunks_exact(T::BYTES)) {
        *x = if T::BYTES == 4 {
            let a: [u8; 4] = c.try_into().unwrap_or_default();
            <T as Float>::from_f64(f64::from(f32::from_le_bytes(a)))
        } else {
            let a: [u8; 8] = c.try_into().unwrap_or_default();
            <T as Float>::from_f64(f64::from_le_bytes(a))
        };
    }
}
