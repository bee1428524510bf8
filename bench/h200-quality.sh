#!/usr/bin/env bash
# Steps and wall-clock to AdamW's final validation loss (issue 19), one H200 device call:
# GPT-2 124M on the medium corpus (bench/specs/gpt2-124m-{adamw,soap,kl-shampoo,shampoo}.asteria,
# batch 16x1024, bf16), STEPS steps of AdamW, SOAP (max_precond_dim 10000), KL-Shampoo and Shampoo,
# the last three at staleness 5, for seeds 1337 and 7; validation every 25 steps. bench/steps_to_loss.py then
# gives, per seed, each run's steps and step time to that seed's AdamW final validation loss.
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, an NVIDIA GPU,
# CUDA 13 under $CUDA_HOME, python3.
# Writes into OUT_DIR: NAME.jsonl and NAME.txt per run, quality-seedN.md, and OUT_DIR.tgz.
# Takes ~8 minutes with the default 300 steps.
# Usage: bench/h200-quality.sh OUT_DIR [STEPS]
set -uo pipefail
[[ $# -ge 1 ]] || { echo "usage: bench/h200-quality.sh OUT_DIR [STEPS]" >&2; exit 2; }
out="$1"; steps="${2:-300}"; mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-quality; source "$here/gpu-env.sh"
cat .gpu/BUILD 2>/dev/null
for seed in 1337 7; do
  for o in adamw soap kl-shampoo shampoo; do
    name=$o-seed$seed
    stamp "$name"
    timeout 240 $B train "$S/gpt2-124m-$o.asteria" --steps "$steps" --quiet --cache-dir "$TC" \
      --set target.staleness=5 --set train.seed=$seed --set train.eval_interval=25 \
      --metrics "$out/$name.jsonl" > "$out/$name.txt" 2>&1
    echo "$name rc=$? $(grep -oE 'median step [0-9.]+ ms' "$out/$name.txt" | head -1)"
  done
  python3 "$here/steps_to_loss.py" --target adamw adamw="$out/adamw-seed$seed.jsonl" \
    soap="$out/soap-seed$seed.jsonl" kl-shampoo="$out/kl-shampoo-seed$seed.jsonl" \
    shampoo="$out/shampoo-seed$seed.jsonl" \
    > "$out/quality-seed$seed.md" 2>&1
  cat "$out/quality-seed$seed.md"
done
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
stamp done
