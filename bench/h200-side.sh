#!/usr/bin/env bash
# H200 call: where should off-critical-path refreshes run? GPT-2 124M SOAP S=5 beside AdamW,
# all in one call: every refresh on the GPU side stream (ASTERIA_CUDA_REFRESH=gpu) and the cost
# model's own placement from a target description calibrated on this machine (host refreshes
# one per core). (The green-context rows of BENCHMARKS.md ran this script at 71c0d92, which
# had ASTERIA_CUDA_SIDE_SMS.) Usage: bench/h200-side.sh OUT_DIR [STEPS]   (repository root,
# .gpu/ prepared)
#   CAL=FILE: use that target description instead of calibrating; RUNS="name:env,env ...":
#   the SOAP S=5 rows, ENV=VALUE pairs without the ASTERIA_CUDA_ prefix (default below; names
#   starting with `cal` use the calibrated description).
set -uo pipefail
out="${1:?usage: bench/h200-side.sh OUT_DIR [STEPS]}"; steps="${2:-100}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1 ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s)
stamp() { echo "== $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }
stamp machine; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
if [[ -n "${CAL:-}" ]]; then cp "$CAL" "$out/cal.json"; else
stamp calibrate
timeout 200 $B calibrate --device cuda --sizes 768,1024,2304,3072 --reps 3 -o "$out/cal.json" > "$out/cal.txt" 2>&1
echo "rc=$?"; cat "$out/cal.txt"
fi
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
sed "s|staleness = 0|staleness = 5\n  calibration = \"$out/cal.json\"|" $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5-cal.asteria
$B compile $S/gpt2-124m-soap-s5-cal.asteria --print-after precond-scheduling -o /tmp/cal-plan.json > "$out/cal-decisions.txt" 2>&1
echo "placements: host $(grep -c 'placement = host' "$out/cal-decisions.txt"), gpu_side $(grep -c 'placement = gpu_side' "$out/cal-decisions.txt")"
run() { # name timeout spec [env...]
  local n=$1 t=$2 spec=$3; shift 3
  stamp "$n"
  env "$@" timeout "$t" $B train "$spec" --steps $steps --quiet --cache-dir $TC --metrics "$out/$n.jsonl" > "$out/$n.txt" 2>&1
  echo "$n rc=$?"; tail -2 "$out/$n.txt"
}
run adamw 90 $S/gpt2-124m-adamw.asteria
RUNS="${RUNS:-gpu:REFRESH=gpu cal:}"
names=()
for r in $RUNS; do
  n=s5-${r%%:*}; envs=${r#*:}; spec=$S/gpt2-124m-soap-s5.asteria
  [[ $n == s5-cal* ]] && spec=$S/gpt2-124m-soap-s5-cal.asteria
  ev=(); IFS=, read -ra kv <<< "$envs"; for x in "${kv[@]}"; do [[ -n $x ]] && ev+=("ASTERIA_CUDA_$x"); done
  run $n 120 $spec "${ev[@]}"; names+=($n)
done
stamp summary
args=("asteria AdamW=$out/adamw.jsonl:$out/adamw.txt")
for n in "${names[@]}"; do [[ -f $out/$n.jsonl ]] && args+=("SOAP $n=$out/$n.jsonl:$out/$n.txt"); done
python3 .gpu/bench/summarize.py --skip 12 "${args[@]}" | tee "$out/summary.md"
for f in "$out"/s5-*.txt; do echo "$f"; grep -h "refresh host ms\|waits\|wait" "$f" | tail -3; done
stamp done
