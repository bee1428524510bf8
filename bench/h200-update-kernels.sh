#!/usr/bin/env bash
# Element-wise update kernels generated from update rules (issue 19): the CUDA self-test of the
# update kernels with the AdamW and Lion train-matches (CPU vs GPU engine, 20 steps), the
# train-matches of tiny-soap with its steps composed (`--skip-rule soap-update`), the `asteria bench
# update-kernels` medians (the element-wise kernels, then SOAP's step hand-written against
# composed at the 124M and 1.44B shapes), then 30 training steps of AdamW and Lion on GPT-2 124M
# and LLaMA 1.44B (bench/specs/{gpt2-124m,llama-1.4b}-{adamw,lion}.asteria; median step and
# peak GPU memory). BENCHMARKS.md "Element-wise update kernels on the H200" is its output.
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, an H200, CUDA 13
# under $CUDA_HOME. Takes ~3 minutes.
# With --soap-steps [STEPS] only the whole-step comparison instead: SOAP (staleness 5) on GPT-2
# 124M and LLaMA 1.44B (bench/specs/{gpt2-124m,llama-1.4b}-soap.asteria), each with the hand-written
# `soap_update` (`--apply-rule soap-update`) and as a CUDA target compiles it by default (the
# composed step: `project`, the generated rule kernels), STEPS steps each (default 40), one after
# the other, then summarize.py's rows (statistics skip 10 steps). ~2 minutes.
# With --composed-steps [STEPS] the same for Shampoo and KL-Shampoo (staleness 5) on GPT-2 124M,
# the hand-written op (the default: `shampoo_update`, `kl_shampoo_update`) against the composed
# step (`--skip-rule shampoo-update`: `shampoo_factor_update`, the moment rules,
# `shampoo_precondition`, `graft`, the step rule; `--skip-rule kl-shampoo-update`: the momentum
# rule, `project`, `kl_scale`, `project` back, the step rule, `kl_factor_update`), each with
# `--profile events` (the optimizer ops' GPU times beside the whole step, whose median Shampoo's
# inverse roots dominate), STEPS steps each (default 20).
# Usage: bench/h200-update-kernels.sh OUT_DIR [--soap-steps [STEPS] | --composed-steps [STEPS]]
set -uo pipefail
usage="usage: bench/h200-update-kernels.sh OUT_DIR [--soap-steps [STEPS] | --composed-steps [STEPS]]"
[[ $# -ge 1 ]] || { echo "$usage" >&2; exit 2; }
out="$1"; mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-update-kernels; source "$here/gpu-env.sh"
if [[ ${2:-} == --composed-steps ]]; then
  steps="${3:-20}"
  [[ $steps =~ ^[0-9]+$ && $steps -gt 5 ]] || { echo "$usage (STEPS > 5)" >&2; exit 2; }
  for o in shampoo kl-shampoo; do
    rows=()
    for v in hand-written composed; do
      flags=(); [[ $v == composed ]] && flags=(--skip-rule "$o-update")
      stamp "gpt2-124m $o $v"
      f="$out/gpt2-124m-$o-$v"
      timeout 240 $B train "$S/gpt2-124m-$o.asteria" --steps "$steps" --set target.staleness=5 --quiet \
        --profile events --cache-dir "$TC" ${flags[@]+"${flags[@]}"} --metrics "$f.jsonl" > "$f.txt" 2>&1
      echo "rc=$? $(grep -oE 'median step [0-9.]+ ms|peak used [0-9.]+ GiB' "$f.txt" | tr '\n' ' ')"
      grep -E "^\| optimizer/" "$f.txt" | head -n 8
      rows+=("asteria $o S5 $v=$f.jsonl:$f.txt")
    done
    python3 "$here/summarize.py" --skip 5 "${rows[@]}" | tee "$out/summary-$o-gpt2-124m.md"
  done
  stamp done
  exit 0
fi
if [[ ${2:-} == --soap-steps ]]; then
  steps="${3:-40}"
  [[ $steps =~ ^[0-9]+$ && $steps -gt 10 ]] || { echo "$usage (STEPS > 10)" >&2; exit 2; }
  for m in gpt2-124m llama-1.4b; do
    rows=()
    for v in hand-written composed; do
      flags=(); [[ $v == hand-written ]] && flags=(--apply-rule soap-update)
      stamp "$m SOAP $v"
      timeout 240 $B train "$S/$m-soap.asteria" --steps "$steps" --set target.staleness=5 --quiet \
        --cache-dir "$TC" ${flags[@]+"${flags[@]}"} --metrics "$out/$m-soap-$v.jsonl" > "$out/$m-soap-$v.txt" 2>&1
      echo "rc=$? $(grep -oE 'median step [0-9.]+ ms|peak used [0-9.]+ GiB' "$out/$m-soap-$v.txt" | tr '\n' ' ')"
      rows+=("asteria SOAP S5 $v=$out/$m-soap-$v.jsonl:$out/$m-soap-$v.txt")
    done
    python3 "$here/summarize.py" --skip 10 "${rows[@]}" | tee "$out/summary-soap-$m.md"
  done
  stamp done
  exit 0
fi
stamp selftest
$B selftest --device cuda --quick --train-match $S/tiny.asteria --train-match $S/tiny-lion.asteria --train-match $S/tiny-adabelief.asteria \
  --steps 20 --cache-dir "$TC" > "$out/selftest.txt" 2>&1; echo "selftest rc=$?"
grep -E "passed|PASS|FAIL" "$out/selftest.txt" | tail -4
# SOAP's step composed (`--skip-rule soap-update`: `project`, the moments rule with its result,
# `project` back, the step rule, as expand-optimizer writes them and a CUDA target runs them; the
# CPU spec's plan would otherwise take `soap_update`) on both engines, the CPU's eigenbases
# injected: fp32 and the production bf16 path.
stamp "composed SOAP train-match"
$B selftest --device cuda --no-kernels --train-match $S/tiny-soap.asteria --skip-rule soap-update \
  --inject-cpu-refreshes --steps 20 --cache-dir "$TC" > "$out/selftest-soap-composed.txt" 2>&1
echo "composed SOAP fp32 rc=$?"; grep -E "^(PASS|FAIL)" "$out/selftest-soap-composed.txt"
$B selftest --device cuda --no-kernels --train-match $S/tiny-soap.asteria --skip-rule soap-update \
  --inject-cpu-refreshes --steps 20 --match-precision bf16 --tol 1e-3 --cache-dir "$TC" \
  > "$out/selftest-soap-composed-bf16.txt" 2>&1
echo "composed SOAP bf16 rc=$?"; grep -E "^(PASS|FAIL)" "$out/selftest-soap-composed-bf16.txt"
stamp bench
$B bench update-kernels --reps 50 > "$out/bench-update.txt" 2>&1; echo "bench rc=$?"
cat "$out/bench-update.txt"
for s in gpt2-124m-adamw gpt2-124m-lion llama-1.4b-adamw llama-1.4b-lion; do
  stamp "$s"
  timeout 240 $B train "$S/$s.asteria" --steps 30 --quiet --cache-dir "$TC" > "$out/$s.txt" 2>&1
  echo "$s rc=$? $(grep -E 'MFU|GPU peak' "$out/$s.txt" | grep -oE 'median step [0-9.]+ ms|peak used [0-9.]+ GiB' | tr '\n' ' ')"
done
