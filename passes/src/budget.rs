//! The memory ceiling: after every pass the [`crate::PassManager`] adds up the bytes of the
//! module's tensors (one place each, with checked arithmetic) and refuses a module whose tensors
//! together exceed [`schedule::limits::MAX_PLAN_BYTES`] (16 TiB, more than any host or device
//! holds) or one tensor over [`schedule::limits::MAX_BUFFER_ELEMENTS`], naming the largest
//! tensors. Later passes and the engines can then add sizes without overflow.
use crate::PassError;
use ir::limits::{MAX_BUFFER_ELEMENTS, MAX_PLAN_BYTES};
use ir::Module;

/// How many tensors the error names.
const NAMED: usize = 5;

pub use schedule::checked_bytes;

/// Total bytes of `module`'s live tensors, one place each.
///
/// # Errors
/// [`PassError::TooLarge`] (naming `pass` and the largest tensors) when a tensor has more than
/// [`MAX_BUFFER_ELEMENTS`] elements or all together exceed [`MAX_PLAN_BYTES`].
pub fn check(module: &Module, pass: &'static str) -> Result<u64, PassError> {
    let mut total: Option<u64> = Some(0);
    let mut sizes: Vec<(u64, ir::ValueId)> = Vec::new();
    let mut too_big = false;
    for inst in module.insts() {
        for &v in &module.inst(inst).results {
            let ty = &module.value(v).ty;
            let bytes = checked_bytes(&ty.shape, ty.dtype.size_bytes());
            let elems = checked_bytes(&ty.shape, 1);
            too_big |= elems.is_none_or(|n| n > MAX_BUFFER_ELEMENTS);
            let bytes = bytes.unwrap_or(u64::MAX);
            total = total.and_then(|t| t.checked_add(bytes));
            sizes.push((bytes, v));
        }
    }
    if !too_big && total.is_some_and(|t| t <= MAX_PLAN_BYTES) {
        return Ok(total.unwrap_or(0));
    }
    sizes.sort_by_key(|s| std::cmp::Reverse(s.0));
    let largest = sizes
        .iter()
        .take(NAMED)
        .map(|&(bytes, v)| {
            let size = if bytes == u64::MAX {
                "more than 2^64 bytes".to_string()
            } else {
                human(bytes)
            };
            format!(
                "{} {} ({size})",
                module.display_value(v),
                module.value(v).ty
            )
        })
        .collect();
    Err(PassError::TooLarge {
        pass,
        total: total.map_or("more than 2^64 bytes".to_string(), human),
        largest,
    })
}

/// A byte count with binary units, up to PiB.
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
