#!/usr/bin/env bash
# Gradient accumulation on one H200, in one device call (issue 16: SOAP at the paper's scale),
# on the LLaMA-style 1.44B specs of bench/specs (d 2048, 24 layers, micro-batches of 4x1024,
# bf16; SOAP max_precond_dim 2048, staleness 5):
# - checks first: the `grad_accumulate` kernel's self-test (bit for bit against the CPU loop),
#   and CPU-vs-GPU train-matches of tiny AdamW (fp32), tiny-soap (fp32, CPU eigenbases
#   injected) and tiny-llama-soap (the production bf16 plan, `--match-target cuda`, CPU
#   eigenbases injected: without, the eigensolvers' drift alone nears its 1e-3), each with
#   `grad_accum = 3`;
# - asteria AdamW and SOAP at each `grad_accum` of ACCUMS (N x 4 x 1024 tokens per optimizer
#   step), each beside PyTorch eager AdamW with the same accumulation (`torch_steps.py
#   --accum`), and the reference soap.py (TF32, max_precond_dim 2048) at the first of ACCUMS.
# SOAP's per-step work (factor accumulation, projections, refreshes) is per optimizer step, so
# its share of the step falls as ACCUM grows; the summaries give "mean vs asteria AdamW mean".
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, an NVIDIA GPU
# with ~45 GiB free, CUDA 13 under $CUDA_HOME, PyTorch.
# Writes into OUT_DIR: per run NAME.jsonl and NAME.txt, the checks' logs, summary-accum-N.md
# per N, summary-ref.md, and OUT_DIR.tgz. ~4 minutes with ACCUMS 8, ~6 with the defaults.
# Usage: bench/h200-accum.sh OUT_DIR [ACCUMS [STEPS]]   (defaults 8,1 and 30: comma-separated
# accumulations; statistics skip 10 steps of asteria's runs; PyTorch runs 20 steps)
set -uo pipefail
[[ $# -ge 1 ]] || { echo "usage: bench/h200-accum.sh OUT_DIR [ACCUMS [STEPS]]" >&2; exit 2; }
out="$1"; IFS=, read -ra accums <<< "${2:-8,1}"; steps="${3:-30}"; accum="${accums[0]}"
mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-accum; source "$here/gpu-env.sh"
stamp machine
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
cat .gpu/BUILD 2>/dev/null
stamp checks
timeout 120 $B selftest --device cuda --filter grad_accumulate > "$out/selftest.txt" 2>&1
echo "selftest rc=$?"; tail -n 2 "$out/selftest.txt"
for t in tiny tiny-soap tiny-llama-soap; do
  sed -e 's/^train {/train {\n  grad_accum = 3/' "$S/$t.asteria" > "$out/$t-accum.asteria"
done
match() { # name spec args...
  local n=$1 spec=$2; shift 2
  timeout 120 $B selftest --device cuda --no-kernels --train-match "$spec" "$@" > "$out/$n.txt" 2>&1
  echo "$n rc=$?"; tail -n 2 "$out/$n.txt"
}
match match-tiny "$out/tiny-accum.asteria"
match match-tiny-soap "$out/tiny-soap-accum.asteria" --inject-cpu-refreshes
match match-tiny-llama-soap-bf16 "$out/tiny-llama-soap-accum.asteria" --match-target cuda --match-precision bf16 --tol 1e-3 --inject-cpu-refreshes
m=llama-1.4b
for g in "${accums[@]}"; do
  rows=()
  for k in adamw soap; do
    stamp "$k grad_accum $g"
    timeout 150 $B train "$S/$m-$k.asteria" --steps "$steps" --set train.grad_accum="$g" --quiet \
      --cache-dir "$TC" --metrics "$out/$m-$k-g$g.jsonl" > "$out/$m-$k-g$g.txt" 2>&1
    echo "rc=$?"; grep -E "GPU peak|MFU" "$out/$m-$k-g$g.txt" | tail -n 2
  done
  stamp "torch adamw accum $g"
  timeout 120 python3 "$here/torch_steps.py" adamw 20 --model $m --accum "$g" "$out/torch-$m-adamw-g$g.jsonl" \
    > "$out/torch-$m-adamw-g$g.txt" 2>&1 || echo "torch adamw failed"
  python3 "$here/summarize.py" --skip 10 "asteria AdamW=$out/$m-adamw-g$g.jsonl:$out/$m-adamw-g$g.txt" \
    "asteria SOAP S5=$out/$m-soap-g$g.jsonl:$out/$m-soap-g$g.txt" \
    "torch AdamW eager=$out/torch-$m-adamw-g$g.jsonl:$out/torch-$m-adamw-g$g.txt" | tee "$out/summary-accum-$g.md"
done
stamp "reference soap.py accum $accum"
timeout 150 python3 "$here/torch_steps.py" soap 15 --tf32 --mpd 2048 --model $m --accum "$accum" \
  "$out/torch-$m-soap-g$accum.jsonl" > "$out/torch-$m-soap-g$accum.txt" 2>&1 || echo "torch soap failed"
python3 "$here/summarize.py" --skip 5 "torch AdamW eager=$out/torch-$m-adamw-g$accum.jsonl:$out/torch-$m-adamw-g$accum.txt" \
  "PyTorch ref SOAP tf32=$out/torch-$m-soap-g$accum.jsonl:$out/torch-$m-soap-g$accum.txt" | tee "$out/summary-ref.md"
stamp done
tar czf "$out.tgz" -C "$out" .
