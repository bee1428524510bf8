#!/usr/bin/env bash
# Session 9 call 4: is max_precond_dim 2048's S=5 ratio reproducible, and where do S=5's extra
# ~2.6 ms over S=0's median go (events profile: per-op GPU time and compute-stream idle)?
set -uo pipefail
out="${1:?OUT}"; mkdir -p "$out"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap-mpd2048.asteria > $S/mpd2048-s5.asteria
run() { echo "== $(date -u +%T) $1"; shift; n=$1; shift
  timeout 150 "$@" --quiet --cache-dir $TC --metrics "$out/$n.jsonl" > "$out/$n.txt" 2>&1; echo "rc=$?"; }
run adamw adamw $B train $S/gpt2-124m-adamw.asteria --steps 300
run s5 mpd2048-s5 $B train $S/mpd2048-s5.asteria --steps 300
run s0 mpd2048-s0 $B train $S/gpt2-124m-soap-mpd2048.asteria --steps 300
ASTERIA_CUDA_PROFILE=events run prof-s0 prof-mpd2048-s0 $B train $S/gpt2-124m-soap-mpd2048.asteria --steps 60
ASTERIA_CUDA_PROFILE=events run prof-s5 prof-mpd2048-s5 $B train $S/mpd2048-s5.asteria --steps 60
python3 .gpu/bench/summarize.py --skip 12 "asteria AdamW=$out/adamw.jsonl:$out/adamw.txt" \
  "asteria SOAP mpd2048 S0=$out/mpd2048-s0.jsonl:$out/mpd2048-s0.txt" \
  "asteria SOAP mpd2048 S5=$out/mpd2048-s5.jsonl:$out/mpd2048-s5.txt" | tee "$out/summary.md"
for f in prof-mpd2048-s0 prof-mpd2048-s5; do echo "-- $f"; grep -E "idle|total|swap|refresh host" "$out/$f.txt" | head -12; done
( cd "$out" && tar czf ../c4.tgz . )
