//! Run-time compilation of the kernel families with NVRTC, for the device's own compute
//! capability (never a hard-coded arch), to CUBIN, with an on-disk cache.
//!
//! The cache key is a 64-bit FNV-1a hash of the source, the options, the arch and the NVRTC
//! version; entries are `<family>-<key:016x>.cubin` under [`cache_dir`]. A cache that cannot be
//! read or written is logged and skipped, never an error.
use crate::error::{CudaError, Result};
use cudarc::nvrtc::{result as nv, sys as nvsys};
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

/// NVRTC target for compute capability `(major, minor)`: `sm_86` for (8, 6); for (9, 0)
/// `sm_90a`, Hopper's arch-specific target, whose warpgroup MMA (`wgmma`) the fused attention
/// kernels of `flash_attention_wgmma.cu` use (an `sm_90a` CUBIN runs on compute capability 9.0
/// only, which is the device it is compiled for).
pub fn arch_for(cc: (i32, i32)) -> String {
    let suffix = if cc == (9, 0) { "a" } else { "" };
    format!("sm_{}{}{suffix}", cc.0, cc.1)
}

/// The CUDA include folder for `cuda_bf16.h` / `cuda_fp16.h`: `$CUDA_HOME/include`,
/// `$CUDA_PATH/include`, else `/usr/local/cuda/include`; `None` when none exists.
pub fn include_dir() -> Option<PathBuf> {
    ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|root| PathBuf::from(root).join("include"))
        .chain(std::iter::once(PathBuf::from("/usr/local/cuda/include")))
        .find(|p| p.join("cuda_bf16.h").exists())
}

/// The NVRTC options for `arch`: architecture, C++17, line info, the CUDA include folder.
pub fn options(arch: &str, include: Option<&Path>) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-lineinfo".to_string(),
    ];
    if let Some(dir) = include {
        o.push(format!("--include-path={}", dir.display()));
    }
    o
}

/// The kernel cache folder: `$ASTERIA_KERNEL_CACHE`, else `$XDG_CACHE_HOME/asteria/kernels`,
/// else `~/.cache/asteria/kernels`; `None` when none can be determined.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("ASTERIA_KERNEL_CACHE") {
        return Some(PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("asteria").join("kernels"))
}

/// 64-bit FNV-1a over `parts`, each followed by a 0xff separator (stable across builds).
pub fn cache_key(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p.iter().chain(std::iter::once(&0xffu8)) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// NVRTC's `(major, minor)` version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-pointers to live integers.
    unsafe { nvsys::nvrtcVersion(&mut major, &mut minor) }.result()?;
    Ok((major, minor))
}

/// Compiles `source` (already including the common header) to a CUBIN with `options`.
pub fn compile_cubin(
    family: &'static str,
    source: &str,
    arch: &str,
    options: &[String],
) -> Result<Vec<u8>> {
    let invalid = |what: String| CudaError::Invalid { op: "nvrtc", what };
    let src = CString::new(source)
        .map_err(|_| invalid(format!("family `{family}` source contains a NUL byte")))?;
    let name =
        CString::new(format!("{family}.cu")).map_err(|_| invalid("bad family name".into()))?;
    let prog = nv::create_program(&src, Some(&name))?;
    // SAFETY: `prog` was just created and is destroyed exactly once below; `src`/`name` outlive it.
    let out = unsafe {
        let compiled = nv::compile_program(prog, options);
        let result = match compiled {
            Err(_) => {
                let log = nv::get_program_log(prog)
                    .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_else(|e| format!("(no log: {e})"));
                Err(CudaError::Compile {
                    family,
                    arch: arch.to_string(),
                    options: options.to_vec(),
                    log,
                })
            }
            Ok(()) => {
                let mut size = 0usize;
                match nvsys::nvrtcGetCUBINSize(prog, &mut size).result() {
                    Err(e) => Err(e.into()),
                    Ok(()) => {
                        let mut cubin = vec![0u8; size];
                        nvsys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                            .result()
                            .map(|()| cubin)
                            .map_err(Into::into)
                    }
                }
            }
        };
        let _ = nv::destroy_program(prog);
        result
    };
    out
}

/// Where a family's CUBIN came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// Read from the on-disk cache.
    Cache,
    /// Compiled now (and written to the cache when possible).
    Compiled,
}

/// The CUBIN of one family: from the cache when present, else compiled and cached.
pub fn load_or_compile(
    family: &'static str,
    source: &str,
    arch: &str,
    options: &[String],
    cache: Option<&Path>,
) -> Result<(Vec<u8>, Origin)> {
    let version = nvrtc_version()
        .map(|(a, b)| format!("{a}.{b}"))
        .unwrap_or_default();
    let key = cache_key(&[
        source.as_bytes(),
        options.join(" ").as_bytes(),
        arch.as_bytes(),
        version.as_bytes(),
    ]);
    let path = cache.map(|d| d.join(format!("{family}-{key:016x}.cubin")));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok((bytes, Origin::Cache));
            }
        }
    }
    let cubin = compile_cubin(family, source, arch, options)?;
    if let Some(p) = &path {
        let write = || -> std::io::Result<()> {
            if let Some(dir) = p.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, &cubin)?;
            std::fs::rename(&tmp, p)
        };
        if let Err(e) = write() {
            tracing::warn!("kernel cache {}: {e} (continuing without it)", p.display());
        }
    }
    Ok((cubin, Origin::Compiled))
}
