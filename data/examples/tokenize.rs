//! Tokenizes a corpus and reports its size and timing.
//!
//! `cargo run --release -p asteria-data --example tokenize -- [--bytes] [FILE|DIR ...]`
//! With no paths, tokenizes the built-in Moby-Dick. Directories contribute their `*.txt` files
//! (sorted). No cache is used, so the time is the full read + tokenize time.

use std::path::PathBuf;
use std::time::Instant;

use data::{load_corpus_tokens, CorpusSource, Tokenizer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut tokenizer = Tokenizer::Gpt2;
    let mut files = Vec::new();
    for arg in std::env::args().skip(1) {
        if arg == "--bytes" {
            tokenizer = Tokenizer::Bytes;
            continue;
        }
        let path = PathBuf::from(arg);
        if path.is_dir() {
            let mut txt: Vec<PathBuf> = std::fs::read_dir(&path)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "txt"))
                .collect();
            txt.sort();
            files.extend(txt);
        } else {
            files.push(path);
        }
    }
    let source = if files.is_empty() {
        CorpusSource::Builtin
    } else {
        CorpusSource::Files(files)
    };

    // Warm the BPE tables so the timing below is tokenization only.
    let t0 = Instant::now();
    tokenizer.encode("warm up")?;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;

    let t1 = Instant::now();
    let tokens = load_corpus_tokens(&source, tokenizer, None)?;
    let secs = t1.elapsed().as_secs_f64();
    println!(
        "{source}: {} {tokenizer} tokens in {:.3} s (tables loaded in {load_ms:.0} ms, {} threads)",
        tokens.len(),
        secs,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    );
    if matches!(source, CorpusSource::Builtin) {
        let t2 = Instant::now();
        let seq = tokenizer.encode(data::BUILTIN_CORPUS)?;
        println!(
            "single-threaded Tokenizer::encode: {} tokens in {:.3} s",
            seq.len(),
            t2.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
