//! Compiles every kernel family with NVRTC for sm_90a (the H200/H100, with the wgmma kernels
//! of flash_attention_wgmma.cu), sm_90 and sm_80, when NVRTC is
//! present; skips (passing) on machines without it, such as CI. NVRTC needs no GPU, so a
//! development machine with the `nvidia-cuda-nvrtc` and `nvidia-cuda-runtime` wheels unpacked
//! (LD_LIBRARY_PATH=…/nvidia/cu13/lib, CUDA_HOME=…/nvidia/cu13) checks the CUDA C here.
use cuda::kernels::{COMMON, FAMILIES};
use cuda::nvrtc;

#[test]
fn every_family_compiles_for_sm90a_sm90_and_sm80() {
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("libnvrtc not found: skipping the NVRTC compile check");
        return;
    }
    let include = nvrtc::include_dir();
    let mut failures = Vec::new();
    for arch in ["sm_90a", "sm_90", "sm_80"] {
        let options = nvrtc::options(arch, include.as_deref());
        for fam in FAMILIES {
            let source = format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", fam.name, fam.source);
            match nvrtc::compile_cubin(fam.name, &source, arch, &options) {
                Ok(cubin) => assert!(!cubin.is_empty(), "{} produced an empty CUBIN", fam.name),
                Err(e) => failures.push(format!("{arch} {}: {e}", fam.name)),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "NVRTC failures:\n{}",
        failures.join("\n")
    );
}

/// The kernels generated from the optimizer update rules (`optim::update`) compile too.
#[test]
fn generated_update_kernels_compile_for_sm90a_and_sm80() {
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        eprintln!("libnvrtc not found: skipping the NVRTC compile check");
        return;
    }
    use optim::optimizers::{update_rule, DEFINITIONS};
    use optim::update::{adamw_rule, cuda_kernel, simplify, UpdateRule};
    let include = nvrtc::include_dir();
    let mut rules = vec![adamw_rule(0.9, 0.95, 1e-8, 0.1)];
    for d in DEFINITIONS {
        let rule = d.plan_rule(&[]).expect("rule");
        rules.push(update_rule(&rule).expect("update rule"));
    }
    for rule in rules {
        let (expr, _) = simplify(&rule.expr);
        let src = cuda_kernel(&UpdateRule { expr, ..rule }).expect("generated source");
        for arch in ["sm_90a", "sm_80"] {
            let options = nvrtc::options(arch, include.as_deref());
            let source = format!("{COMMON}\n{src}");
            let cubin = nvrtc::compile_cubin("generated", &source, arch, &options)
                .unwrap_or_else(|e| panic!("{arch}: {e}\n{src}"));
            assert!(!cubin.is_empty());
        }
    }
}
