#!/usr/bin/env bash
# The largest LLaMA that trains with SOAP on one H200 (issue 17): bench/specs/llama-6.9b-soap.asteria
# (d 4096, 32 layers, SwiGLU 11008, 6.9B parameters, batch 1x1024, bf16, SOAP max_precond_dim 4096,
# staleness 5) under `gpu_memory = 132GiB`, `host_memory = 100GiB`: `tier-placement` moves ~20 GiB
# of SOAP's moments to pinned host memory. Then the reference soap.py on the same model and GPU
# (bench/torch_baseline.py's `huge` model, TF32, max_precond_dim 4096), which needs more memory
# than the GPU has: its row records the out-of-memory error and the bytes it had allocated.
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, an idle H200
# (~133 GiB of GPU memory, ~20 GiB of pinned host memory), CUDA 13 under $CUDA_HOME, python3
# with PyTorch (CUDA). Takes ~3 minutes (the first eigendecompositions of 352 factors of side
# 4096 run before the first step: ~15 s of cuSOLVER).
# With --nvme DIR also the same model with only 8 GiB of pinned host memory and the rest of the
# offloaded moments in an NVMe file in DIR (`nvme_memory = 40GiB`; ~12 GiB of it used, ~9 s of
# predicted NVMe copies a step on the `h200` description: ~3 more minutes at 10 steps).
# Writes into OUT_DIR: soap-6.9b{,-nvme}.{jsonl,txt}, soap-6.9b{,-nvme}-placement.txt,
# torch-soap-6.9b.txt, summary.md, and OUT_DIR.tgz.
# --gpu-memory SIZE / --host-memory SIZE override the spec's budgets in every row (e.g. an 80 GB
# H100: `--gpu-memory 76GiB --host-memory 64GiB`), --nvme-host-memory SIZE the NVMe row's host
# tier (default 8GiB).
# Usage: bench/h200-largest.sh OUT_DIR [STEPS] [--nvme DIR] [--gpu-memory SIZE] [--host-memory SIZE]
#        [--nvme-host-memory SIZE]   (default 12 steps; statistics skip 4 steps)
set -uo pipefail
usage="usage: bench/h200-largest.sh OUT_DIR [STEPS] [--nvme DIR] [--gpu-memory SIZE] [--host-memory SIZE] [--nvme-host-memory SIZE]"
pos=(); nvme=""; budget=""; nvme_host="8GiB"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nvme) [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }; nvme="$2"; shift 2 ;;
    --gpu-memory) [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }; budget+=" --set target.gpu_memory=$2"; shift 2 ;;
    --host-memory) [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }; budget+=" --set target.host_memory=$2"; shift 2 ;;
    --nvme-host-memory) [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }; nvme_host="$2"; shift 2 ;;
    -*) echo "$usage" >&2; exit 2 ;;
    *) pos+=("$1"); shift ;;
  esac
done
[[ ${#pos[@]} -ge 1 ]] || { echo "$usage" >&2; exit 2; }
out="${pos[0]}"; steps="${pos[1]:-12}"
[[ -z $nvme ]] || mkdir -p "$nvme" || { echo "h200-largest: cannot create $nvme" >&2; exit 2; }
mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-largest; source "$here/gpu-env.sh"
stamp machine
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
free -g | head -n 2
cat .gpu/BUILD 2>/dev/null
spec="$S/llama-6.9b-soap.asteria"
# One row per placement: the spec's (host tier only), and with --nvme DIR only 8 GiB of pinned
# host memory, the rest of what does not fit in an NVMe file in DIR.
runs=("soap-6.9b|$budget")
[[ -n $nvme ]] && runs+=("soap-6.9b-nvme|$budget --set target.host_memory=$nvme_host --set target.nvme=\"$nvme\" --set target.nvme_memory=40GiB")
rows=()
for r in "${runs[@]}"; do
  IFS='|' read -r name sets <<< "$r"
  eval "set -- $sets"   # the --set flags, with the quoted directory
  $B compile "$spec" "$@" --print-after tier-placement > "$out/$name-placement.txt" 2>&1
  grep -E "^; (host|device|nvme)" "$out/$name-placement.txt"
  stamp "$name"
  timeout 480 $B train "$spec" "$@" --steps "$steps" --set "train.eval_interval=$steps" --quiet \
    --cache-dir "$TC" --metrics "$out/$name.jsonl" > "$out/$name.txt" 2>&1
  echo "$name rc=$?"; grep -E "GPU peak|MFU|first step|val loss|rror" "$out/$name.txt" | tail -n 6
  rows+=("$name=$out/$name.jsonl:$out/$name.txt")
done
python3 "$here/summarize.py" --skip 4 "${rows[@]}" | tee "$out/summary.md"
stamp torch
( cd "$here" && timeout 200 python3 -c "
import torch_baseline as tb
tb.out(what='env', gpu=tb.torch.cuda.get_device_name(0), torch=tb.torch.__version__)
try:
    tb.train_steps(family='llama', L=32, d=4096, h=32, m=11008, B=1, steps=4, warm=3, opt_name='soap', mpd=4096, tf32=True)
except Exception as e:
    tb.out(what='gpt_train_fail', family='llama7b', mpd=4096, err=str(e)[:400],
           peak_GiB=tb.torch.cuda.max_memory_allocated() / 2**30)
" ) > "$out/torch-soap-6.9b.txt" 2>&1
echo "torch rc=$?"; tail -n 2 "$out/torch-soap-6.9b.txt" | tee -a "$out/summary.md"
stamp done
tar czf "$out.tgz" -C "$out" .
