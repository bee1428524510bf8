#!/usr/bin/env bash
# Session 7 call 3: cusolverDnXpotrf vs Spotrf inside rc-tc (ASTERIA_CUDA_POTRF=xpotrf), GPU time
# per refresh phase (ASTERIA_CUDA_REFRESH_PHASES=sync in calibrate), and the side stream above the
# compute stream (ASTERIA_CUDA_SIDE_PRIORITY=high); GPT-2 124M S=5, 300 steps, with AdamW.
set -uo pipefail
out=$1; mkdir -p $out
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
ASTERIA_CUDA_POTRF=xpotrf timeout 150 $B selftest --device cuda --filter eigenbasis_refresh_r > $out/selftest-xpotrf.txt 2>&1
echo "selftest xpotrf rc=$? (+$(el)s)"; grep -E "passed|failed" $out/selftest-xpotrf.txt | tail -1; grep -E "FAIL" $out/selftest-xpotrf.txt | head -8
for p in spotrf xpotrf; do
  ASTERIA_CUDA_POTRF=$p ASTERIA_CUDA_QR=rc-tc ASTERIA_CUDA_REFRESH_PHASES=sync RUST_LOG=asteria_cuda=info timeout 100 $B calibrate --device cuda --sizes 768,2304,3072 --reps 3 --threads 16 -o $out/cal-$p.json > $out/cal-$p.txt 2>&1
  echo "cal $p rc=$? (+$(el)s)"; grep -i "gpu n\|phases" $out/cal-$p.txt | cut -c1-330
done
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
run() { local n=$1 steps=$2 spec=$3; shift 3
  env "$@" timeout 110 $B train $spec --steps $steps --quiet --cache-dir $TC --metrics $out/$n.jsonl > $out/$n.txt 2>&1; echo "$n rc=$? (+$(el)s)"; }
run adamw 300 $S/gpt2-124m-adamw.asteria
run x-side-s5 300 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=rc-tc ASTERIA_CUDA_POTRF=xpotrf
run x-side-high-s5 300 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=rc-tc ASTERIA_CUDA_POTRF=xpotrf ASTERIA_CUDA_SIDE_PRIORITY=high
run x-inline-s5 300 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=rc-tc ASTERIA_CUDA_POTRF=xpotrf ASTERIA_CUDA_REFRESH=inline
python3 .gpu/bench/summarize.py --skip 12 "asteria AdamW=$out/adamw.jsonl:$out/adamw.txt" \
  "S5 rc-tc xpotrf side=$out/x-side-s5.jsonl:$out/x-side-s5.txt" \
  "S5 rc-tc xpotrf side high-priority=$out/x-side-high-s5.jsonl:$out/x-side-high-s5.txt" \
  "S5 rc-tc xpotrf inline=$out/x-inline-s5.jsonl:$out/x-inline-s5.txt" | tee $out/summary.md
grep -h "refresh host ms" $out/x-*.txt | cut -c1-420
cd $out && tar czf ../p73.tgz . && cd .. && rm -rf $out
