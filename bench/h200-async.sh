#!/usr/bin/env bash
# The GPT-2 124M benchmark of BENCHMARKS.md on one H200, every row in one device call: asteria
# AdamW; asteria SOAP with synchronous refreshes (staleness S=0) and off the critical path (S=5),
# at max_precond_dim 10000 (soap.py's default) and 2048 (the paper's); the PyTorch reference SOAP
# (soap.py, fp32 and TF32 matmuls) at both settings; PyTorch AdamW eager and torch.compile. Batch
# 16x1024, bf16, SOAP frequency 10. Before the runs, the checks: the quick kernel self-test, the
# CPU-vs-GPU train-matches (AdamW and SOAP in fp32, both in bf16) and tiny-soap on the GPU at S=0
# and S=5; after them, bench/check_staleness.py (each S=5 run's last validation loss within 0.05 of
# its S=0 run's; tiny-soap within 0.02).
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, an NVIDIA GPU
# with ~35 GiB free, CUDA 13 under $CUDA_HOME (default /usr/local/cuda), nvidia-smi, python3 with
# PyTorch (CUDA).
# Writes into OUT_DIR: per run NAME.jsonl (asteria --metrics, or bench/torch_steps.py's) and
# NAME.txt (its log; "GPU peak used" lines), selftest*.txt, summary.md (max_precond_dim 10000),
# summary-mpd2048.md (2048; both against the same AdamW runs), step-time.svg,
# step-time-mpd2048.svg, check-staleness*.txt; with --profile, profile-*.txt; and OUT_DIR.tgz
# holding all of it (a device call returns a limited number of files).
# Takes: ~6 minutes with the defaults, ~5 with `120 60` (the regression run of BENCHMARKS.md);
# --profile adds ~2.
#
# Usage: bench/h200-async.sh OUT_DIR [STEPS [TORCH_STEPS]] [--skip-checks] [--profile]
#   STEPS: asteria steps per run (default 300); TORCH_STEPS: PyTorch steps per row (default 80).
#   Step statistics skip the first 12 steps of every run.
#   --skip-checks: no self-test, train-matches or tiny-soap runs.
#   --profile: after the timed runs, 30-step `asteria train --profile events` runs of AdamW and
#   both SOAP S=5 settings (per-op GPU time from CUDA events, host enqueue time, compute-stream
#   idle time) and bench/torch_profile.py (PyTorch's AdamW step by kernel, and cuBLAS alone on
#   the model's GEMM shapes).
set -uo pipefail
usage="usage: bench/h200-async.sh OUT_DIR [STEPS [TORCH_STEPS]] [--skip-checks] [--profile]"
pos=(); checks=1; profile=0
for a in "$@"; do
  case "$a" in
    --skip-checks) checks=0 ;;
    --profile) profile=1 ;;
    -*) echo "$usage" >&2; exit 2 ;;
    *) pos+=("$a") ;;
  esac
done
[[ ${#pos[@]} -ge 1 ]] || { echo "$usage" >&2; exit 2; }
out="${pos[0]}"; steps="${pos[1]:-300}"; torch_steps="${pos[2]:-80}"
mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-async; source "$here/gpu-env.sh"
stamp machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
python3 -c 'import torch; print("torch", torch.__version__)'
cat .gpu/BUILD 2>/dev/null; $B --version

if [[ $checks == 1 ]]; then
  stamp selftest
  timeout 150 $B selftest --device cuda --quick --cache-dir "$TC" --train-match $S/tiny.asteria > "$out/selftest.txt" 2>&1
  echo "selftest rc=$?"; grep -E "passed, |^(PASS|FAIL)" "$out/selftest.txt" | tail -4; grep -E "FAIL" "$out/selftest.txt" | head -5
  # SOAP train-match (fp32, GPU vs CPU engine; the CPU's new eigenbases injected after refreshes:
  # two correct eigensolvers disagree on nearly degenerate factors, the self-test covers the GPU's).
  timeout 120 $B selftest --device cuda --no-kernels --cache-dir "$TC" --train-match $S/tiny-soap.asteria \
    --inject-cpu-refreshes > "$out/selftest-soap-match.txt" 2>&1
  echo "soap train-match rc=$?"; tail -n 3 "$out/selftest-soap-match.txt"
  # The production bf16 path against the fp32 CPU engine (measured ~1e-5 AdamW, ~5e-5 SOAP).
  for spec in tiny tiny-soap; do
    timeout 150 $B selftest --device cuda --no-kernels --cache-dir "$TC" --train-match $S/$spec.asteria \
      --inject-cpu-refreshes --match-precision bf16 --tol 1e-3 > "$out/selftest-$spec-bf16-match.txt" 2>&1
    echo "$spec bf16 train-match rc=$?"; tail -n 3 "$out/selftest-$spec-bf16-match.txt"
  done
  # tiny-soap on the GPU in fp32, S=0 and S=5, 400 steps.
  for s in 0 5; do
    sed -e 's/^target cpu {/target cuda {\n  precision = fp32/' -e "s/staleness = 0/staleness = $s/" \
      $S/tiny-soap.asteria > $S/tiny-soap-cuda-s$s.asteria
    stamp "tiny-soap cuda S=$s"
    timeout 90 $B train $S/tiny-soap-cuda-s$s.asteria --quiet --cache-dir "$TC" \
      --metrics "$out/tiny-soap-cuda-s$s.jsonl" > "$out/tiny-soap-cuda-s$s.txt" 2>&1
    echo "rc=$?"; tail -n 2 "$out/tiny-soap-cuda-s$s.txt"
  done
  python3 "$here/check_staleness.py" "$out/tiny-soap-cuda-s0.jsonl" "$out/tiny-soap-cuda-s5.jsonl" --tol 0.02 \
    | tee "$out/check-staleness-tiny.txt"
fi

sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap-mpd2048.asteria > $S/gpt2-124m-soap-mpd2048-s5.asteria
run() { # name spec timeout
  stamp "$1"
  timeout "$3" $B train "$2" --steps "$steps" --quiet --cache-dir "$TC" --metrics "$out/$1.jsonl" > "$out/$1.txt" 2>&1
  echo "$1 rc=$?"; tail -n 3 "$out/$1.txt"
}
run adamw $S/gpt2-124m-adamw.asteria 120
run soap-s5 $S/gpt2-124m-soap-s5.asteria 150
run soap-s0 $S/gpt2-124m-soap.asteria 150
run mpd2048-soap-s5 $S/gpt2-124m-soap-mpd2048-s5.asteria 150
run mpd2048-soap-s0 $S/gpt2-124m-soap-mpd2048.asteria 150
for row in "torch-soap soap" "torch-soaptf32 soap --tf32" "torch-mpd2048-soap soap --mpd 2048" \
  "torch-mpd2048-soaptf32 soap --tf32 --mpd 2048" "torch-adamw adamw" "torch-adamw-compile adamw --compile"; do
  set -- $row; n=$1; shift
  stamp "$n"
  timeout 200 python3 "$here/torch_steps.py" "$@" "$torch_steps" "$out/$n.jsonl" > "$out/$n.txt" 2>&1 || echo "$n failed"
  tail -n 2 "$out/$n.txt"
done

stamp summary
row() { echo "$1=$out/$2.jsonl:$out/$2.txt"; }
python3 "$here/summarize.py" --skip 12 "$(row "asteria AdamW" adamw)" \
  "$(row "asteria SOAP S0" soap-s0)" "$(row "asteria SOAP S5" soap-s5)" \
  "$(row "PyTorch ref SOAP fp32" torch-soap)" "$(row "PyTorch ref SOAP tf32" torch-soaptf32)" \
  "$(row "torch AdamW eager" torch-adamw)" "$(row "torch AdamW compile" torch-adamw-compile)" | tee "$out/summary.md"
python3 "$here/summarize.py" --skip 12 "$(row "asteria AdamW" adamw)" \
  "$(row "asteria SOAP mpd2048 S0" mpd2048-soap-s0)" "$(row "asteria SOAP mpd2048 S5" mpd2048-soap-s5)" \
  "$(row "PyTorch ref SOAP mpd2048 fp32" torch-mpd2048-soap)" "$(row "PyTorch ref SOAP mpd2048 tf32" torch-mpd2048-soaptf32)" \
  "$(row "torch AdamW eager" torch-adamw)" | tee "$out/summary-mpd2048.md"
$B plot --metric step_ms --title "GPT-2 124M step time, H200 (batch 16x1024)" -o "$out/step-time.svg" \
  "asteria AdamW=$out/adamw.jsonl" "asteria SOAP S0=$out/soap-s0.jsonl" "asteria SOAP S5=$out/soap-s5.jsonl" \
  "PyTorch ref. SOAP fp32=$out/torch-soap.jsonl" "PyTorch ref. SOAP tf32=$out/torch-soaptf32.jsonl" 2>&1 | tail -n 1
$B plot --metric step_ms --title "GPT-2 124M step time, H200, max_precond_dim 2048" -o "$out/step-time-mpd2048.svg" \
  "asteria AdamW=$out/adamw.jsonl" "asteria SOAP S0=$out/mpd2048-soap-s0.jsonl" "asteria SOAP S5=$out/mpd2048-soap-s5.jsonl" \
  "PyTorch ref. SOAP fp32=$out/torch-mpd2048-soap.jsonl" "PyTorch ref. SOAP tf32=$out/torch-mpd2048-soaptf32.jsonl" 2>&1 | tail -n 1
grep -h "refresh host ms" "$out"/soap-s5.txt "$out"/mpd2048-soap-s5.txt
# S > 0 must train as well as S = 0 (a stale-basis bug once left S=5 0.141 behind at step 300).
python3 "$here/check_staleness.py" "$out/soap-s0.jsonl" "$out/soap-s5.jsonl" --tol 0.05 | tee "$out/check-staleness.txt"
python3 "$here/check_staleness.py" "$out/mpd2048-soap-s0.jsonl" "$out/mpd2048-soap-s5.jsonl" --tol 0.05 \
  | tee "$out/check-staleness-mpd2048.txt"

if [[ $profile == 1 ]]; then
  for r in "adamw gpt2-124m-adamw" "soap-s5 gpt2-124m-soap-s5" "mpd2048-soap-s5 gpt2-124m-soap-mpd2048-s5"; do
    set -- $r
    stamp "profile $1"
    timeout 120 $B train $S/$2.asteria --steps 30 --profile events --quiet --cache-dir "$TC" > "$out/profile-$1.txt" 2>&1
    echo "rc=$?"
  done
  stamp "profile torch adamw"
  timeout 120 python3 "$here/torch_profile.py" > "$out/profile-torch-adamw.txt" 2>&1; echo "rc=$?"
fi
stamp done
tar czf "$out.tgz" -C "$out" .
