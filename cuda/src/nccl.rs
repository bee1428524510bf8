//! NCCL through cudarc (`cudarc::nccl`), and finding `libnccl` where cudarc does not look.
//!
//! cudarc 0.19 opens NCCL by the names `libnccl.so`, `libnccl.so.{9..13}` and a few more, but
//! NVIDIA's packages install only the versioned soname `libnccl.so.2` (no development symlink
//! on a runtime-only host such as the reference H200 box). [`probe`] finds the
//! library either way; [`ensure_loadable`] makes it loadable for cudarc by creating a
//! `libnccl.so` symlink to the found file in a private folder and re-executing the current
//! program once with that folder prepended to `LD_LIBRARY_PATH` (the dynamic loader reads it
//! only at start-up). [`all_reduce_check`] is the self-test of the collective path: a sum
//! all-reduce over every visible GPU (single process, one communicator per device) checked
//! against the float64 sum on the host.
use crate::error::{CudaError, Result};
use cudarc::driver::CudaContext;
use cudarc::nccl::{result as nres, safe as nccl};
use std::path::{Path, PathBuf};

/// Where NCCL is, for cudarc.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NcclLib {
    /// cudarc opens it by one of its own names.
    Found,
    /// Only the versioned soname `libnccl.so.2` exists, at this path.
    Versioned(PathBuf),
    /// Not installed (or not on the loader's search path).
    Missing,
}

/// The versioned sonames tried after cudarc's own names.
const VERSIONED: [&str; 1] = ["libnccl.so.2"];

/// The environment variable set on the re-executed program (guards against a loop).
pub const ALIAS_ENV: &str = "ASTERIA_NCCL_ALIAS_DIR";

/// Where NCCL is (no side effects besides `dlopen` attempts).
pub fn probe() -> NcclLib {
    // SAFETY: only dlopen attempts of the candidate names.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return NcclLib::Found;
    }
    for name in VERSIONED {
        // SAFETY: loading NCCL runs its (trusted, vendor) initialisers only.
        if let Ok(lib) = unsafe { libloading::Library::new(name) } {
            if let Some(path) = library_path(&lib) {
                return NcclLib::Versioned(path);
            }
        }
    }
    NcclLib::Missing
}

/// The file a loaded NCCL came from (`dladdr` of `ncclGetVersion`).
fn library_path(lib: &libloading::Library) -> Option<PathBuf> {
    // SAFETY: the symbol is only used for its address, never called.
    let sym: libloading::Symbol<'_, unsafe extern "C" fn()> =
        unsafe { lib.get(b"ncclGetVersion\0") }.ok()?;
    let addr = *sym as *const libc::c_void;
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `addr` is inside a loaded object; `info` is a live out-parameter.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated path owned by the loader.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let p = PathBuf::from(name.to_string_lossy().into_owned());
    std::fs::canonicalize(&p).ok().or(Some(p))
}

/// The fix a user can apply by hand.
const MANUAL_FIX: &str = "install NCCL (e.g. the libnccl2 package), or make a `libnccl.so` symlink to libnccl.so.2 in a folder on LD_LIBRARY_PATH";

/// Makes NCCL loadable for cudarc in this process. `Found`: nothing to do. `Versioned`:
/// creates `alias_dir/libnccl.so → <found file>` and re-executes the current program with
/// `alias_dir` prepended to `LD_LIBRARY_PATH` (does not return when that works).
///
/// # Errors
/// [`CudaError::MissingLibrary`] when NCCL is not installed, when the alias cannot be made or
/// the re-execution fails, or when the re-executed program still cannot load it; the hint
/// names the manual fix.
pub fn ensure_loadable(alias_dir: &Path) -> Result<()> {
    let missing = || CudaError::MissingLibrary {
        lib: "libnccl.so",
        hint: MANUAL_FIX,
    };
    match probe() {
        NcclLib::Found => Ok(()),
        NcclLib::Missing => Err(missing()),
        NcclLib::Versioned(path) => {
            if std::env::var_os(ALIAS_ENV).is_some() {
                // Already re-executed with the alias and still not found.
                return Err(missing());
            }
            let (link, ld) = make_alias(&path, alias_dir).map_err(|_| missing())?;
            tracing::info!(nccl = %path.display(), alias = %link.display(),
                "cudarc does not open libnccl.so.2 by itself: re-executing with a libnccl.so alias on LD_LIBRARY_PATH");
            let exe = std::env::current_exe().map_err(|_| missing())?;
            use std::os::unix::process::CommandExt;
            let err = std::process::Command::new(exe)
                .args(std::env::args_os().skip(1))
                .env("LD_LIBRARY_PATH", ld)
                .env(ALIAS_ENV, alias_dir)
                .exec();
            tracing::error!(error = %err, "re-executing with the NCCL alias failed");
            Err(missing())
        }
    }
}

/// Creates (or replaces) `alias_dir/libnccl.so → lib` and returns the link and the
/// `LD_LIBRARY_PATH` value with `alias_dir` in front of the current one.
fn make_alias(lib: &Path, alias_dir: &Path) -> std::io::Result<(PathBuf, std::ffi::OsString)> {
    std::fs::create_dir_all(alias_dir)?;
    let link = alias_dir.join("libnccl.so");
    match std::fs::remove_file(&link) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::os::unix::fs::symlink(lib, &link)?;
    let mut ld = alias_dir.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        ld.push(":");
        ld.push(old);
    }
    Ok((link, ld))
}

/// The outcome of [`all_reduce_check`].
#[derive(Clone, Debug)]
pub struct NcclCheck {
    /// NCCL's version code (e.g. 22703 for 2.27.3).
    pub version: i32,
    /// Ranks (GPUs) in the communicator.
    pub ranks: usize,
    /// Elements per rank (f32).
    pub elems: usize,
    /// Norm-wise relative error of the reduced buffer on every rank against the f64 sum.
    pub max_rel_err: f64,
    /// Wall time of the all-reduce (all ranks, synchronized), ms.
    pub ms: f64,
}

impl NcclCheck {
    /// Sum of `ranks` fp32 values per element: the error bound is `ranks · 2⁻²⁴` relative.
    pub fn passed(&self) -> bool {
        self.max_rel_err <= 1e-6 * self.ranks.max(1) as f64
    }
}

fn nccl_err(e: nres::NcclError) -> CudaError {
    CudaError::Invalid {
        op: "nccl",
        what: format!("{e:?}"),
    }
}

/// A sum all-reduce of `elems` random f32 per rank over every visible GPU (one communicator
/// per device, `ncclCommInitAll`, calls grouped), compared on every rank with the float64
/// sum of the inputs.
///
/// # Errors
/// [`CudaError::NoDriver`] / [`CudaError::MissingLibrary`] when CUDA or NCCL is absent (call
/// [`ensure_loadable`] first), driver and NCCL errors.
pub fn all_reduce_check(elems: usize, seed: u64) -> Result<NcclCheck> {
    if !crate::driver_present() {
        return Err(CudaError::NoDriver { lib: "libcuda.so" });
    }
    if probe() != NcclLib::Found {
        return Err(CudaError::MissingLibrary {
            lib: "libnccl.so",
            hint: MANUAL_FIX,
        });
    }
    cudarc::driver::result::init()?;
    let n = CudaContext::device_count()?.max(0) as usize;
    if n == 0 {
        return Err(CudaError::NoDevice {
            ordinal: 0,
            count: 0,
        });
    }
    let mut version = 0;
    // SAFETY: out-pointer to a live integer.
    unsafe { cudarc::nccl::sys::ncclGetVersion(&mut version) };
    let streams = (0..n)
        .map(|i| Ok(CudaContext::new(i)?.default_stream()))
        .collect::<Result<Vec<_>>>()?;
    let comms = nccl::Comm::from_devices(streams.clone()).map_err(nccl_err)?;
    let mut rng = engine::Rng::new(seed);
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|_| (0..elems).map(|_| rng.normal() as f32).collect())
        .collect();
    let mut sends = Vec::with_capacity(n);
    let mut recvs = Vec::with_capacity(n);
    for (s, x) in streams.iter().zip(&inputs) {
        sends.push(s.clone_htod(x)?);
        recvs.push(s.alloc_zeros::<f32>(elems)?);
    }
    for s in &streams {
        s.synchronize()?;
    }
    let t0 = std::time::Instant::now();
    nres::group_start().map_err(nccl_err)?;
    for ((c, s), r) in comms.iter().zip(&sends).zip(recvs.iter_mut()) {
        c.all_reduce(s, r, &nccl::ReduceOp::Sum).map_err(nccl_err)?;
    }
    nres::group_end().map_err(nccl_err)?;
    for s in &streams {
        s.synchronize()?;
    }
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let want: Vec<f64> = (0..elems)
        .map(|i| inputs.iter().map(|x| f64::from(x[i])).sum())
        .collect();
    let mut max_rel_err = 0.0f64;
    for (s, r) in streams.iter().zip(&recvs) {
        let got = s.clone_dtoh(r)?;
        max_rel_err = max_rel_err.max(crate::selftest::rel_err(&got, &want));
    }
    Ok(NcclCheck {
        version,
        ranks: n,
        elems,
        max_rel_err,
        ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a stand-in `libnccl.so.2` (one exported `ncclGetVersion`) with the system C
    /// compiler; `None` when there is none.
    fn fake_nccl(dir: &Path) -> Option<PathBuf> {
        let src = dir.join("fake_nccl.c");
        std::fs::write(
            &src,
            "int ncclGetVersion(int *v) { *v = 22803; return 0; }\n",
        )
        .ok()?;
        let lib = dir.join("libnccl.so.2");
        let ok = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&lib)
            .arg(&src)
            .status()
            .ok()?
            .success();
        ok.then_some(lib)
    }

    #[test]
    fn the_file_behind_a_loaded_versioned_library_is_found_and_aliased() {
        let dir = std::env::temp_dir().join(format!("asteria-nccl-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let Some(lib) = fake_nccl(&dir) else {
            eprintln!("no C compiler: skipped");
            return;
        };
        // SAFETY: our own stand-in library, no initialisers.
        let loaded = unsafe { libloading::Library::new(&lib) }.expect("load the stand-in");
        let found = library_path(&loaded).expect("dladdr names the file");
        assert_eq!(found, std::fs::canonicalize(&lib).expect("canonical"));
        let alias_dir = dir.join("alias");
        let (link, ld) = make_alias(&found, &alias_dir).expect("alias");
        assert_eq!(std::fs::read_link(&link).expect("a symlink"), found);
        assert!(ld
            .to_string_lossy()
            .starts_with(alias_dir.to_string_lossy().as_ref()));
        // Replacing an existing alias works too.
        make_alias(&found, &alias_dir).expect("alias again");
        // Through the alias name, the library loads and answers.
        // SAFETY: as above.
        let via = unsafe { libloading::Library::new(&link) }.expect("load via the alias");
        // SAFETY: the stand-in's signature.
        let f: libloading::Symbol<'_, unsafe extern "C" fn(*mut i32) -> i32> =
            unsafe { via.get(b"ncclGetVersion\0") }.expect("symbol");
        let mut v = 0;
        // SAFETY: a live out-pointer.
        assert_eq!(unsafe { f(&mut v) }, 0);
        assert_eq!(v, 22803);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn without_nccl_the_error_names_the_fix() {
        if probe() != NcclLib::Missing {
            eprintln!("NCCL is installed here: skipped");
            return;
        }
        let dir = std::env::temp_dir().join("asteria-nccl-missing-test");
        let err = ensure_loadable(&dir).expect_err("no NCCL");
        let msg = err.to_string();
        assert!(msg.contains("libnccl.so"), "{msg}");
        assert!(all_reduce_check(8, 1).is_err());
    }
}
