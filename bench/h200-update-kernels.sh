#!/usr/bin/env bash
# Element-wise update kernels generated from update rules (issue 19): the CUDA self-test of the
# update kernels with the AdamW and Lion train-matches (CPU vs GPU engine, 20 steps), the
# train-matches of tiny-soap with its steps composed (`--skip-pass fuse`), the `asteria bench
# update-kernels` medians (the element-wise kernels, then SOAP's step hand-written against
# composed at the 124M and 1.44B shapes), then 30 training steps of AdamW and Lion on GPT-2 124M
# and LLaMA 1.44B (bench/specs/{gpt2-124m,llama-1.4b}-{adamw,lion}.asteria; median step and
# peak GPU memory). BENCHMARKS.md "Element-wise update kernels on the H200" is its output.
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, an H200, CUDA 13
# under $CUDA_HOME. Takes ~3 minutes.
# Usage: bench/h200-update-kernels.sh OUT_DIR
set -uo pipefail
[[ $# -ge 1 ]] || { echo "usage: bench/h200-update-kernels.sh OUT_DIR" >&2; exit 2; }
out="$1"; mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-update-kernels; source "$here/gpu-env.sh"
stamp selftest
$B selftest --device cuda --quick --train-match $S/tiny.asteria --train-match $S/tiny-lion.asteria \
  --steps 20 --cache-dir "$TC" > "$out/selftest.txt" 2>&1; echo "selftest rc=$?"
grep -E "passed|PASS|FAIL" "$out/selftest.txt" | tail -4
# SOAP's step composed (`--skip-pass fuse`: `project`, the moments rule with its result, `project`
# back, the step rule, as expand-optimizer writes them) on both engines, the CPU's eigenbases
# injected: fp32 and the production bf16 path.
stamp "composed SOAP train-match"
$B selftest --device cuda --no-kernels --train-match $S/tiny-soap.asteria --skip-pass fuse \
  --inject-cpu-refreshes --steps 20 --cache-dir "$TC" > "$out/selftest-soap-composed.txt" 2>&1
echo "composed SOAP fp32 rc=$?"; grep -E "^(PASS|FAIL)" "$out/selftest-soap-composed.txt"
$B selftest --device cuda --no-kernels --train-match $S/tiny-soap.asteria --skip-pass fuse \
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
