//! `asteria-gpu-selftest`: runs every CUDA launcher on fresh random inputs against the CPU
//! reference kernels and prints a table (kernel, size, max relative error, pass). Exits 0 when
//! everything passed, 1 when a case failed, 2 when no device could be opened.
//!
//! Usage: `asteria-gpu-selftest [--device N] [--seed S] [--filter NAME] [--quick] [--verbose] [--list]`
use std::process::ExitCode;

fn usage() -> ExitCode {
    eprintln!(
        "usage: asteria-gpu-selftest [--device N] [--seed S] [--filter NAME] [--quick] [--verbose] [--list]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut ordinal = 0usize;
    let mut opts = cuda::selftest::Options::default();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let parsed: Result<(), String> = match a.as_str() {
            "--device" => value("--device")
                .and_then(|v| v.parse().map(|d| ordinal = d).map_err(|e| e.to_string())),
            "--seed" => value("--seed").and_then(|v| {
                v.parse()
                    .map(|s| opts.seed = Some(s))
                    .map_err(|e| e.to_string())
            }),
            "--filter" => value("--filter").map(|v| opts.filter = Some(v)),
            "--verbose" | "-v" => {
                opts.verbose = true;
                Ok(())
            }
            "--quick" => {
                opts.quick = true;
                Ok(())
            }
            "--list" => {
                for k in cuda::selftest::case_kernels() {
                    println!("{k}");
                }
                return ExitCode::SUCCESS;
            }
            "-h" | "--help" => return usage(),
            other => Err(format!("unknown argument `{other}`")),
        };
        if let Err(e) = parsed {
            eprintln!("error: {e}");
            return usage();
        }
    }
    let dev = match cuda::Device::new(ordinal) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    println!("{}", dev.info());
    match cuda::nvrtc::cache_dir() {
        Some(d) => println!("  kernel cache {}", d.display()),
        None => println!("  kernel cache: none (no $HOME / $XDG_CACHE_HOME)"),
    }
    for l in dev.kernel_loads() {
        let how = match (&l.error, l.origin) {
            (Some(e), _) => format!("FAILED: {e}"),
            (None, Some(cuda::nvrtc::Origin::Cache)) => "from cache".into(),
            (None, _) => "compiled".into(),
        };
        println!("  kernels {:<14} {:>8.1} ms  {how}", l.family, l.ms);
    }
    let report = cuda::selftest::run(&dev, &opts);
    println!();
    print!("{}", report.table());
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
