//! File tests in the style of Cranelift's `.clif` tests: each `passes/filetests/*.ir` file
//! starts with `; test: <pass>` and holds the pass's input IR; the expected output (the IR after
//! the pass, plus the analysis report for `liveness`) is in `<name>.expected` beside it.
//! `ASTERIA_BLESS=1 cargo test --release -p asteria-passes --test filetests` rewrites the
//! expectations; otherwise a difference fails with a line diff.
use passes::PassManager;
use std::path::PathBuf;

fn diff(expected: &str, actual: &str) -> String {
    let mut out = String::new();
    let (e, a): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), actual.lines().collect());
    for i in 0..e.len().max(a.len()) {
        let (x, y) = (e.get(i).copied(), a.get(i).copied());
        if x != y {
            out.push_str(&format!(
                "line {}:\n  - {}\n  + {}\n",
                i + 1,
                x.unwrap_or("<none>"),
                y.unwrap_or("<none>")
            ));
            if out.len() > 4000 {
                break;
            }
        }
    }
    out
}

#[test]
fn filetests() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("filetests");
    let bless = std::env::var_os("ASTERIA_BLESS").is_some();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("filetests/ exists")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "ir"))
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "no file tests found in {}",
        dir.display()
    );
    let mut failures = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read");
        let pass = text
            .lines()
            .find_map(|l| l.strip_prefix("; test:"))
            .map(str::trim)
            .unwrap_or_else(|| panic!("{}: missing `; test: <pass>` header", file.display()));
        let mut module =
            ir::parse_module(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let (cx, extra) = PassManager::run_one(pass, &mut module)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let mut actual = module.to_string();
        if let Some(extra) = extra {
            actual.push_str(&extra);
        }
        if let Some(plan) = &cx.plan {
            actual = plan.to_json();
            actual.push('\n');
        }
        let expected_path = file.with_extension("expected");
        if bless {
            std::fs::write(&expected_path, &actual).expect("write expectation");
            continue;
        }
        let expected = std::fs::read_to_string(&expected_path).unwrap_or_else(|_| {
            panic!(
                "{}: no expectation; run with ASTERIA_BLESS=1",
                expected_path.display()
            )
        });
        if expected != actual {
            failures.push(format!(
                "{} ({pass}):\n{}",
                file.display(),
                diff(&expected, &actual)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} file test(s) failed (ASTERIA_BLESS=1 rewrites):\n{}",
        failures.len(),
        failures.join("\n")
    );
}
