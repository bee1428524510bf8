//! Checks that run on a machine without CUDA (CI): the crate builds, opening a device without
//! a driver is an error (not a panic), the kernel sources are embedded and their `extern "C"`
//! names match the registry, the arena arithmetic, NVRTC options and cache keys, and the
//! self-test covers every plan op.
use cuda::kernels::{extern_c_names, family_of, kernel_signatures, FAMILIES};
use cuda::{nvrtc, Carver, CudaError, Device};

#[test]
fn no_driver_is_an_error_not_a_panic() {
    let opened = std::panic::catch_unwind(|| Device::new(0).map(|_| ()));
    let result = opened.expect("Device::new must not panic");
    if cuda::driver_present() {
        eprintln!(
            "a CUDA driver is present here: Device::new(0) gave {:?}",
            result.as_ref().err()
        );
    } else {
        assert!(
            matches!(result, Err(CudaError::NoDriver { .. })),
            "expected NoDriver, got {result:?}"
        );
        let msg = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            msg.contains("libcuda"),
            "the message names the library: {msg}"
        );
    }
}

#[test]
fn sources_are_embedded_and_names_match() {
    let mut all = Vec::new();
    for fam in FAMILIES {
        assert!(fam.source.len() > 100, "family {} is empty", fam.name);
        let declared: Vec<String> = fam.kernels.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            extern_c_names(fam.source),
            declared,
            "family {}: registry and extern \"C\" names differ",
            fam.name
        );
        let sigs =
            kernel_signatures(fam.source).unwrap_or_else(|e| panic!("family {}: {e}", fam.name));
        assert_eq!(sigs.len(), fam.kernels.len());
        all.extend(declared);
    }
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), n, "kernel names are unique across families");
    assert_eq!(family_of("soap_adam_eigen").map(|f| f.name), Some("soap"));
    assert_eq!(
        family_of("kl_precondition").map(|f| f.name),
        Some("kl_shampoo")
    );
    assert!(cuda::kernels::COMMON.contains("block_sum"));
}

#[test]
fn every_kernel_file_is_registered() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("kernels folder")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|f| f.strip_suffix(".cu").map(str::to_string))
        .collect();
    files.sort();
    let mut registered: Vec<String> = FAMILIES.iter().map(|f| f.name.to_string()).collect();
    registered.sort();
    assert_eq!(files, registered);
}

#[test]
fn signatures_parse_kinds() {
    use cuda::kernels::ArgKind::*;
    let src = "extern \"C\" __global__ void k(const float* __restrict__ a, long long n, int c, float e, double t) {}";
    let sigs = kernel_signatures(src).expect("parses");
    assert_eq!(sigs, vec![("k".to_string(), vec![Ptr, I64, I32, F32, F64])]);
    assert!(kernel_signatures("extern \"C\" __global__ void k(unsigned x) {}").is_err());
    // An occupancy hint between `void` and the name.
    let src = "extern \"C\" __global__ void __launch_bounds__(256, 2)\n    k2(float* a, int n) {}";
    let sigs = kernel_signatures(src).expect("parses");
    assert_eq!(sigs, vec![("k2".to_string(), vec![Ptr, I32])]);
    assert_eq!(extern_c_names(src), vec!["k2".to_string()]);
}

#[test]
fn carver_aligns_and_tracks_peak() {
    let mut c = Carver::new(1024);
    assert_eq!(c.carve(10, 256), Some(0));
    assert_eq!(c.carve(4, 256), Some(256));
    assert_eq!(c.carve(1, 8), Some(264));
    assert_eq!(c.used(), 265);
    assert_eq!(c.carve(1000, 256), None, "over capacity");
    assert_eq!(c.used(), 265, "a failed carve changes nothing");
    assert_eq!(c.carve(512, 512), Some(512));
    assert_eq!(c.peak(), 1024);
    c.reset();
    assert_eq!((c.used(), c.peak()), (0, 1024));
    assert_eq!(
        c.carve(usize::MAX, 256),
        None,
        "overflow is refused, not wrapped"
    );
}

#[test]
fn carver_places_at_given_offsets() {
    let mut c = Carver::new(1024);
    assert_eq!(c.place(256, 100, 256), Some(256));
    assert_eq!(c.place(256, 50, 256), Some(256), "placements may overlap");
    assert_eq!(c.place(0, 40, 256), Some(0));
    assert_eq!(
        c.used(),
        356,
        "carves continue after the highest placed byte"
    );
    assert_eq!(c.place(100, 4, 256), None, "misaligned");
    assert_eq!(c.place(768, 257, 256), None, "past the capacity");
    assert_eq!(c.place(usize::MAX & !255, 1024, 256), None, "overflow");
    assert_eq!(c.used(), 356, "a failed placement changes nothing");
    assert_eq!(c.carve(10, 256), Some(512));
    assert_eq!(c.place(768, 256, 256), Some(768));
    assert_eq!(c.peak(), 1024);
    assert_eq!(cuda::BUF_ALIGN, schedule::ARENA_ALIGN);
}

#[test]
fn nvrtc_arch_options_and_cache_keys() {
    // Hopper gets its arch-specific target (wgmma); every other device its plain one.
    assert_eq!(nvrtc::arch_for((9, 0)), "sm_90a");
    assert_eq!(nvrtc::arch_for((8, 0)), "sm_80");
    assert_eq!(nvrtc::arch_for((12, 1)), "sm_121");
    let o = nvrtc::options("sm_90", Some(std::path::Path::new("/opt/cuda/include")));
    assert!(o.contains(&"--gpu-architecture=sm_90".to_string()));
    assert!(o.contains(&"--include-path=/opt/cuda/include".to_string()));
    let k1 = nvrtc::cache_key(&[b"src", b"opts", b"sm_90"]);
    assert_eq!(k1, nvrtc::cache_key(&[b"src", b"opts", b"sm_90"]), "stable");
    assert_ne!(
        k1,
        nvrtc::cache_key(&[b"src", b"opts", b"sm_80"]),
        "arch is part of the key"
    );
    assert_ne!(
        nvrtc::cache_key(&[b"ab", b"c"]),
        nvrtc::cache_key(&[b"a", b"bc"]),
        "parts are separated"
    );
}

/// Serde tags of every `schedule::Op` the CUDA backend implements; each needs a self-test case.
const PLAN_OPS: &[&str] = &[
    "embedding",
    "embedding_backward",
    "add_positional",
    "add_positional_backward",
    "layer_norm",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_backward",
    "mat_mul",
    "bias_add",
    "sum_rows",
    "add",
    "gelu",
    "gelu_backward",
    "swi_glu",
    "swi_glu_backward",
    "rope",
    "rope_backward",
    "attention",
    "attention_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "clip_grad_norm",
    "adam_w",
    "soap_update",
    "soap_factor_update",
    "kl_shampoo_update",
    "shampoo_update",
    "shampoo_factor_update",
    "shampoo_precondition",
    "graft",
    "project",
    "kl_scale",
    "kl_factor_update",
];

#[test]
fn selftest_covers_every_plan_op() {
    let cases = cuda::selftest::case_kernels();
    for op in PLAN_OPS {
        assert!(cases.contains(op), "no self-test case for plan op `{op}`");
    }
    // The tags above are the plan format's: check a few against serde.
    let add = schedule::Op::Add {
        a: schedule::BufferId(0),
        b: schedule::BufferId(1),
        out: schedule::BufferId(2),
    };
    let json = serde_json::to_string(&add).expect("serializes");
    assert!(json.contains("\"op\":\"add\""), "{json}");
}

#[test]
fn rel_err_is_normwise_and_nan_aware() {
    use cuda::selftest::rel_err;
    assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
    assert!((rel_err(&[1.0, 2.5], &[1.0, 2.0]) - 0.25).abs() < 1e-12);
    assert_eq!(rel_err(&[f32::NAN], &[1.0]), f64::INFINITY);
    assert_eq!(rel_err(&[1.0], &[1.0, 2.0]), f64::INFINITY);
}
