#!/usr/bin/env bash
# The paper-scale benchmark of BENCHMARKS.md on one H200, in one device call: for each model of
# bench/specs (GPT-2 124M at batch 16x1024, GPT 0.9B and LLaMA 1.44B at batch 4x1024, LLaMA 6.9B at batch 1x1024; bf16),
# asteria AdamW, asteria SOAP (max_precond_dim 2048, staleness 5; not at 6.9B, where no side is
# at most 2048 wide), PyTorch AdamW eager and
# torch.compile (bench/torch_steps.py, fused AdamW, bf16 autocast) and the PyTorch reference SOAP
# (soap.py, TF32, max_precond_dim 2048; not at 6.9B). Each asteria run prints its memory report
# ("GPU peak used", arenas, engine scratch) and MFU.
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, an NVIDIA GPU
# with ~130 GiB free (the 6.9B rows), CUDA 13 under $CUDA_HOME, python3 with PyTorch (CUDA).
# Writes into OUT_DIR: per run NAME.jsonl and NAME.txt, summary-MODEL.md per model, and
# OUT_DIR.tgz holding all of it.
# Takes: ~8 minutes with the defaults.
#
# Usage: bench/h200-scale.sh OUT_DIR [STEPS [TORCH_STEPS]] [--models m1,m2] [--no-torch-soap] [--profile]
#   STEPS: asteria steps per run at 0.9B/1.4B (default 60; 6.9B runs a third of it);
#   TORCH_STEPS: PyTorch steps per row (default 40; 6.9B: a third). Statistics skip 10 steps
#   (3 at 6.9B). --models: a subset of gpt2-124m,gpt-0.9b,llama-1.4b,llama-6.9b (GPT-2 124M:
#   batch 16x1024; its SOAP row is max_precond_dim 10000).
#   --profile: instead of the timed rows, where each model's AdamW step goes: `asteria train
#   --profile events` (STEPS steps, per-op GPU time) as profile-MODEL.txt and
#   bench/torch_profile.py (PyTorch eager's kernels, and its linear GEMM shapes on cuBLAS alone)
#   as profile-torch-MODEL.txt; ~1 minute per model.
set -uo pipefail
usage="usage: bench/h200-scale.sh OUT_DIR [STEPS [TORCH_STEPS]] [--models m1,m2] [--no-torch-soap] [--profile]"
pos=(); models="gpt2-124m,gpt-0.9b,llama-1.4b,llama-6.9b"; torch_soap=1; want_models=0; profile=0
for a in "$@"; do
  if [[ $want_models == 1 ]]; then models="$a"; want_models=0; continue; fi
  case "$a" in
    --models) want_models=1 ;;
    --no-torch-soap) torch_soap=0 ;;
    --profile) profile=1 ;;
    -*) echo "$usage" >&2; exit 2 ;;
    *) pos+=("$a") ;;
  esac
done
[[ ${#pos[@]} -ge 1 ]] || { echo "$usage" >&2; exit 2; }
out="${pos[0]}"; steps="${pos[1]:-60}"; torch_steps="${pos[2]:-40}"
mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-scale; source "$here/gpu-env.sh"
stamp machine
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
cat .gpu/BUILD 2>/dev/null

run() { # name spec steps timeout
  stamp "$1"
  timeout "$4" $B train "$2" --steps "$3" --quiet --cache-dir "$TC" --metrics "$out/$1.jsonl" > "$out/$1.txt" 2>&1
  echo "$1 rc=$?"; grep -E "GPU peak|MFU|scratch|arena" "$out/$1.txt" | tail -n 6
}
trun() { # name timeout torch_steps.py-args...
  local n=$1 t=$2; shift 2
  stamp "$n"
  timeout "$t" python3 "$here/torch_steps.py" "$@" "$out/$n.jsonl" > "$out/$n.txt" 2>&1 || echo "$n failed"
  tail -n 3 "$out/$n.txt"
}
IFS=, read -ra ms <<< "$models"
if [[ $profile == 1 ]]; then
  for m in "${ms[@]}"; do
    stamp "profile $m"
    timeout 300 $B train "$S/$m-adamw.asteria" --steps "$steps" --profile events --quiet --cache-dir "$TC" \
      > "$out/profile-$m.txt" 2>&1; echo "rc=$?"
    stamp "profile torch $m"
    timeout 300 python3 "$here/torch_profile.py" 5 --model "$m" > "$out/profile-torch-$m.txt" 2>&1; echo "rc=$?"
  done
  stamp done
  tar czf "$out.tgz" -C "$out" .
  exit 0
fi
for m in "${ms[@]}"; do
  s=$steps; ts=$torch_steps; skip=10
  if [[ $m == llama-6.9b ]]; then s=$(( steps / 3 )); ts=$(( torch_steps / 3 )); skip=3; fi
  run "$m-adamw" "$S/$m-adamw.asteria" "$s" 300
  rows=("asteria AdamW=$out/$m-adamw.jsonl:$out/$m-adamw.txt")
  # At 6.9B every side (4096, 11008, the vocabulary) exceeds max_precond_dim 2048: without
  # blocking SOAP has no Kronecker factor there and is Adam in the original basis, so no row.
  if [[ $m != llama-6.9b ]]; then
    run "$m-soap" "$S/$m-soap.asteria" "$s" 300
    rows+=("asteria SOAP S5=$out/$m-soap.jsonl:$out/$m-soap.txt")
  fi
  trun "torch-$m-adamw" 300 adamw "$ts" --model "$m"
  rows+=("torch AdamW eager=$out/torch-$m-adamw.jsonl:$out/torch-$m-adamw.txt")
  if [[ $m != llama-6.9b ]]; then
    trun "torch-$m-adamw-compile" 300 adamw "$ts" --compile --model "$m"
    rows+=("torch AdamW compile=$out/torch-$m-adamw-compile.jsonl:$out/torch-$m-adamw-compile.txt")
    if [[ $torch_soap == 1 ]]; then
      trun "torch-$m-soap" 300 soap "$ts" --tf32 --mpd 2048 --model "$m"
      rows+=("PyTorch ref SOAP tf32=$out/torch-$m-soap.jsonl:$out/torch-$m-soap.txt")
    fi
  fi
  python3 "$here/summarize.py" --skip "$skip" "${rows[@]}" | tee "$out/summary-$m.md"
done
stamp done
tar czf "$out.tgz" -C "$out" .
