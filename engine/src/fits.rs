//! Memory before allocation: an engine compares what a plan's buffers need with what the machine
//! has free (host: `MemAvailable` of `/proc/meminfo`; GPU: the driver's free memory) and refuses
//! a plan that cannot fit before it allocates anything, naming both sizes and the largest
//! buffers — instead of aborting in the allocator halfway through.
use crate::EngineError;
use schedule::{DType, Plan};

/// How many buffers the error names.
const NAMED: usize = 3;

/// Bytes the CPU engine allocates for `plan`'s buffers, one allocation each, with `float_bytes`
/// per f32 element (4 for `CpuEngine<f32>`, 8 for `f64`); saturates at `u64::MAX`.
pub fn host_bytes(plan: &Plan, float_bytes: usize) -> u64 {
    let on_disk =
        |i: usize| plan.memory.slots.get(i).map(|s| s.arena) == Some(schedule::ArenaKind::Nvme);
    plan.buffers.iter().enumerate().fold(0u64, |total, (i, b)| {
        if on_disk(i) {
            return total;
        }
        let elem = match b.dtype {
            // The CPU engine stores bf16 buffers in its float type (rounding every write).
            DType::F32 | DType::Bf16 => float_bytes,
            DType::I32 => 4,
        } as u64;
        let bytes = schedule::checked_bytes(&b.shape, elem as usize).unwrap_or(u64::MAX);
        total.saturating_add(bytes)
    })
}

/// Free host memory in bytes: `MemAvailable` of `/proc/meminfo` (`None` where there is no such
/// file, e.g. not Linux; then nothing is checked).
pub fn host_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Errors with [`EngineError::OutOfMemory`] when `needed` bytes exceed the `available` bytes of
/// `place` (`host memory`, `GPU 0 (NVIDIA H200)`).
pub fn check_fits(
    plan: &Plan,
    place: &str,
    needed: u64,
    available: u64,
) -> Result<(), EngineError> {
    if needed <= available {
        return Ok(());
    }
    let mut sizes: Vec<(u64, &str, &[usize])> = plan
        .buffers
        .iter()
        .map(|b| {
            let bytes = b
                .shape
                .iter()
                .try_fold(b.dtype.size_bytes() as u64, |a, &d| a.checked_mul(d as u64))
                .unwrap_or(u64::MAX);
            (bytes, b.name.as_str(), b.shape.as_slice())
        })
        .collect();
    sizes.sort_by_key(|s| std::cmp::Reverse(s.0));
    let largest = sizes
        .iter()
        .take(NAMED)
        .map(|(bytes, name, shape)| format!("`{name}` {shape:?} ({})", human(*bytes)))
        .collect::<Vec<_>>()
        .join(", ");
    Err(EngineError::OutOfMemory {
        plan: plan.name.clone(),
        place: place.to_string(),
        needed: human(needed),
        available: human(available),
        largest,
    })
}

/// A byte count with binary units (`52.66 GiB`).
pub fn human(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut x = b as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{x:.2} {}", units[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_is_read_where_there_is_one() {
        if std::path::Path::new("/proc/meminfo").exists() {
            assert!(host_available_bytes().is_some_and(|b| b > 0));
        }
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(52 << 30), "52.00 GiB");
    }
}
