#!/usr/bin/env bash
# Equal step-time budgets (BENCHMARKS.md session 9, call 3). Usage: bench/h200-equal-time.sh OUT_DIR
# (repository root, .gpu/ from bench/prepare-gpu). Session 9 call 2 measured, same binary, mean
# step ms: AdamW 52.3, SOAP (max_precond_dim 10000) S=5 80.5; call 1: SOAP mpd2048 S=5 58.1 (AdamW
# 51.7 there). 300 SOAP-10000 steps = 24.15 s of steps = 462 AdamW steps = 416 SOAP-mpd2048
# steps. Each run's spec has `steps` set (so the cosine schedule spans the run) and a seed.
set -uo pipefail
out="${1:?OUT}"; mkdir -p "$out"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache; W=/tmp/eq; mkdir -p $W
mk() { # base staleness steps seed -> spec path
  local f=$W/$(basename $1 .asteria)-s$2-n$3-seed$4.asteria
  sed -e "s/staleness = 0/staleness = $2/" -e "s/^  steps = 300/  steps = $3\n  seed = $4/" -e "s#\"../data/medium\"#\"$PWD/.gpu/data/medium\"#" $1 > $f
  echo $f
}
for seed in 1337 7; do
  for row in "adamw gpt2-124m-adamw 0 462" "mpd2048-s5 gpt2-124m-soap-mpd2048 5 416" "soap-s5 gpt2-124m-soap 5 300"; do
    set -- $row; name=$1-seed$seed
    [[ $seed == 1337 && $1 == soap-s5 ]] && continue  # seed 1337, 300 steps: call 2's row
    spec=$(mk $S/$2.asteria $3 $4 $seed)
    grep -E "^  (steps|seed) =" $spec | tr '\n' ' '; echo
    echo "== $(date -u +%T) $name"
    timeout 150 $B train $spec --quiet --cache-dir $TC --metrics "$out/$name.jsonl" > "$out/$name.txt" 2>&1
    echo "rc=$?"; tail -1 "$out/$name.txt" | cut -c1-200
  done
done
python3 - "$out" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/*.jsonl")):
    st = [json.loads(l) for l in open(f) if l.strip()]
    tr = [s for s in st if "step_ms" in s]; va = [s for s in st if "val_loss" in s]
    ms = sorted(s["step_ms"] for s in tr[12:])
    tot = sum(s["step_ms"] for s in tr) / 1e3
    print("%-22s steps %d  median %.1f ms  mean %.1f  total step time %.1f s  val %s" % (
        os.path.basename(f), len(tr), ms[len(ms)//2], sum(ms)/len(ms), tot,
        " ".join("%d:%.4f" % (v["step"], v["val_loss"]) for v in va)))
PY
( cd "$out" && tar czf ../eq.tgz . )
