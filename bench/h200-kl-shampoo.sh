#!/usr/bin/env bash
# KL-Shampoo on one H200 (issue 19), in one device call: the quick kernel self-test (the
# kl_shampoo_update and `qr` refresh cases among them), the CPU-vs-GPU train-matches of
# tiny-kl-shampoo (fp32, and the production bf16 path), tiny-kl-shampoo on the GPU at
# staleness 0 and 5 (400 steps each, bench/check_staleness.py), then step times at staleness 5
# beside AdamW and SOAP: GPT-2 124M (batch 16x1024) and LLaMA 1.44B (batch 4x1024,
# max_precond_dim 2048), bench/specs/{gpt2-124m,llama-1.4b}-{adamw,soap,kl-shampoo}.asteria,
# and the reference KL-Shampoo (bench/torch_steps.py kl: KLOpt of yorkerlin/KL-Methods in bf16
# on the matrices, AdamW on the rest) on the same models. BENCHMARKS.md "KL-Shampoo on the
# H200" is its output.
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu plus
# .gpu/.ext/kl_opt.py (github.com/yorkerlin/KL-Methods optim/kl_opt.py; never commit it), an
# H200, CUDA 13 under $CUDA_HOME, python3 with PyTorch (CUDA).
# Writes into OUT_DIR: NAME.jsonl / NAME.txt per run, selftest*.txt, summary-124m.md,
# summary-1.4b.md, check-staleness.txt, and OUT_DIR.tgz holding all of it.
# Takes ~8 minutes with the defaults.
# Usage: bench/h200-kl-shampoo.sh OUT_DIR [STEPS [TORCH_STEPS]] [--skip-checks] [--skip-runs]
#   STEPS: asteria steps per timed run (default 60); TORCH_STEPS: reference steps (default 40).
#   Step statistics skip the first 12 steps of every run.
set -uo pipefail
usage="usage: bench/h200-kl-shampoo.sh OUT_DIR [STEPS [TORCH_STEPS]] [--skip-checks] [--skip-runs]"
pos=(); checks=1; runs=1
for a in "$@"; do
  case "$a" in
    --skip-checks) checks=0 ;;
    --skip-runs) runs=0 ;;
    -*) echo "$usage" >&2; exit 2 ;;
    *) pos+=("$a") ;;
  esac
done
[[ ${#pos[@]} -ge 1 ]] || { echo "$usage" >&2; exit 2; }
out="${pos[0]}"; steps="${pos[1]:-60}"; torch_steps="${pos[2]:-40}"
mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-kl-shampoo; source "$here/gpu-env.sh"
stamp machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
cat .gpu/BUILD 2>/dev/null

if [[ $checks == 1 ]]; then
  stamp selftest
  timeout 150 $B selftest --device cuda --quick --cache-dir "$TC" > "$out/selftest.txt" 2>&1
  echo "selftest rc=$?"; grep -E "passed, |^(PASS|FAIL)" "$out/selftest.txt" | tail -3
  grep -iE "kl_shampoo|qr" "$out/selftest.txt" | head -12; grep -E "FAIL" "$out/selftest.txt" | head -5
  timeout 120 $B selftest --device cuda --no-kernels --cache-dir "$TC" \
    --train-match $S/tiny-kl-shampoo.asteria --inject-cpu-refreshes > "$out/selftest-kl-match.txt" 2>&1
  echo "kl train-match fp32 rc=$?"; tail -n 3 "$out/selftest-kl-match.txt"
  timeout 150 $B selftest --device cuda --no-kernels --cache-dir "$TC" \
    --train-match $S/tiny-kl-shampoo.asteria --inject-cpu-refreshes --match-precision bf16 --tol 1e-3 \
    > "$out/selftest-kl-bf16-match.txt" 2>&1
  echo "kl train-match bf16 rc=$?"; tail -n 3 "$out/selftest-kl-bf16-match.txt"
  for s in 0 5; do
    sed -e 's/^target cpu {/target cuda {\n  precision = fp32/' -e "s/staleness = 0/staleness = $s/" \
      $S/tiny-kl-shampoo.asteria > $S/tiny-kl-shampoo-cuda-s$s.asteria
    stamp "tiny-kl-shampoo cuda S=$s"
    timeout 120 $B train $S/tiny-kl-shampoo-cuda-s$s.asteria --quiet --cache-dir "$TC" \
      --metrics "$out/tiny-kl-cuda-s$s.jsonl" > "$out/tiny-kl-cuda-s$s.txt" 2>&1
    echo "rc=$?"; tail -n 2 "$out/tiny-kl-cuda-s$s.txt"
  done
  python3 "$here/check_staleness.py" "$out/tiny-kl-cuda-s0.jsonl" "$out/tiny-kl-cuda-s5.jsonl" --tol 0.04 \
    > "$out/check-staleness.txt" 2>&1; echo "check_staleness rc=$?"; cat "$out/check-staleness.txt"
fi

if [[ $runs == 1 ]]; then
  for m in gpt2-124m llama-1.4b; do
    for o in adamw soap kl-shampoo; do
      stamp "$m-$o"
      timeout 200 $B train "$S/$m-$o.asteria" --steps "$steps" --set target.staleness=5 --quiet --cache-dir "$TC" \
        --metrics "$out/$m-$o.jsonl" > "$out/$m-$o.txt" 2>&1
      echo "$m-$o rc=$? $(grep -oE 'median step [0-9.]+ ms|peak used [0-9.]+ GiB' "$out/$m-$o.txt" | tr '\n' ' ')"
    done
    stamp "$m torch kl"
    timeout 240 python3 "$here/torch_steps.py" kl "$torch_steps" "$out/$m-torch-kl.jsonl" --model "$m" \
      > "$out/$m-torch-kl.txt" 2>&1 || echo "$m torch kl failed: $(tail -n 2 "$out/$m-torch-kl.txt")"
  done
  # Row names may not contain `=` (summarize.py splits NAME=METRICS:LOG at the first one).
  for m in gpt2-124m llama-1.4b; do
    rows=()
    for r in "asteria AdamW:$m-adamw" "asteria SOAP S5:$m-soap" "asteria KL-Shampoo S5:$m-kl-shampoo" \
             "reference KL-Shampoo (KLOpt bf16):$m-torch-kl"; do
      f="${r##*:}"
      [[ -s "$out/$f.jsonl" ]] && rows+=("${r%:*}=$out/$f.jsonl:$out/$f.txt")
    done
    python3 "$here/summarize.py" --skip 12 "${rows[@]}" > "$out/summary-$m.md" 2>&1
    cat "$out/summary-$m.md"
  done
fi
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
stamp done
