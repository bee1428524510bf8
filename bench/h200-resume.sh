#!/usr/bin/env bash
# Checkpoints across engines (issue 18): examples/tiny-soap.asteria (tiny GPT-2, SOAP, built-in
# corpus), 20 steps with a checkpoint at step 10.
# - GPU -> CPU: the CUDA run's step-10 checkpoint resumed on the CPU engine;
# - CPU -> GPU: the CPU run's step-10 checkpoint resumed on the CUDA engine;
# each resumed run's losses (steps 11-20) against the run it came from and against the other
# engine's uninterrupted run (bf16 on the GPU, f32 on the CPU: their own gap is the yardstick).
# - GPU -> GPU: the CUDA run's checkpoint resumed on the CUDA engine;
# - CPU at staleness 5 -> GPU: the CPU checkpoint records refreshes in flight; the CUDA engine
#   computes them from their snapshots at the resume and installs each at its step (S=5 runs with
#   refresh_swap = deadline, so that both engines install every refresh at the same step).
# - `asteria sample` of the GPU checkpoint on both engines (greedy).
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, a CUDA GPU.
# Writes OUT_DIR/resume.md and the runs' metrics. Usage: bench/h200-resume.sh OUT_DIR
set -uo pipefail
[[ $# -ge 1 ]] || { echo "usage: bench/h200-resume.sh OUT_DIR" >&2; exit 2; }
out="$1"; mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-resume; source "$here/gpu-env.sh"
cpu="$S/tiny-soap.asteria"; gpu="$out/tiny-soap-cuda.asteria"
sed -e 's/^target cpu {/target cuda {/' -e '/^\s*threads\s*=/d' "$cpu" > "$gpu"
t() { timeout 120 $B train "$@" --steps 20 --quiet > /dev/null 2> "$out/last.err" || { echo "FAILED: train $*"; tail -n 5 "$out/last.err"; }; }
stamp "uninterrupted runs with checkpoints"
t "$gpu" --checkpoint-dir "$out/ck-gpu" --checkpoint-every 10 --metrics "$out/gpu.jsonl"
t "$cpu" --checkpoint-dir "$out/ck-cpu" --checkpoint-every 10 --metrics "$out/cpu.jsonl"
stamp "resumes across engines"
t "$cpu" --resume "$out/ck-gpu/step-000000010" --metrics "$out/gpu-to-cpu.jsonl"
t "$gpu" --resume "$out/ck-cpu/step-000000010" --metrics "$out/cpu-to-gpu.jsonl"
t "$gpu" --resume "$out/ck-gpu/step-000000010" --metrics "$out/gpu-to-gpu.jsonl"
stamp "CPU staleness 5 -> GPU"
# refresh_swap = deadline: every refresh installed exactly 5 steps after its launch on both
# engines, so the runs are comparable step by step.
s5=(--set target.staleness=5 --set train.refresh_swap=deadline)
t "$cpu" "${s5[@]}" --checkpoint-dir "$out/ck-cpu5" --checkpoint-every 10 --metrics "$out/cpu5.jsonl"
t "$gpu" "${s5[@]}" --metrics "$out/gpu5.jsonl"
python3 -c "import json,sys; m=json.load(open(sys.argv[1])); print('CPU S=5 checkpoint: refreshes in flight at step 10:', len(m.get('in_flight', [])))" "$out/ck-cpu5/step-000000010/meta.json"
RUST_LOG=info timeout 120 $B train "$gpu" "${s5[@]}" --resume "$out/ck-cpu5/step-000000010" --steps 20 --quiet \
  --metrics "$out/cpu5-to-gpu.jsonl" > /dev/null 2> "$out/cpu5-to-gpu.err"; echo "CPU S=5 -> GPU rc=$?"
grep -i "error\|failed" "$out/cpu5-to-gpu.err" | head -n 3
stamp "sample"
for d in cuda cpu; do
  $B sample "$out/ck-gpu" --device $d --prompt "The whale " --tokens 24 --temperature 0 \
    > "$out/sample-$d.txt" 2> "$out/sample-$d.err"; echo "sample --device $d rc=$?: $(cat "$out/sample-$d.txt")"
done
python3 - "$out" <<'PY' | tee "$out/resume.md"
import json, sys
out = sys.argv[1]
def losses(name):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"{out}/{name}.jsonl")) if "loss" in r}
g, c, g2c, c2g, g2g, c5, g5, c52g = (losses(n) for n in ["gpu", "cpu", "gpu-to-cpu", "cpu-to-gpu", "gpu-to-gpu", "cpu5", "gpu5", "cpu5-to-gpu"])
gap = lambda a, b: max(abs(a[s] - b[s]) for s in range(11, 21))
print("| resumed run | steps | vs the run it came from | vs the other engine's run | GPU vs CPU uninterrupted |")
print("|---|---|---|---|---|")
print(f"| GPU step 10 -> CPU | 11-20 | {gap(g2c, g):.4f} | {gap(g2c, c):.4f} | {gap(g, c):.4f} |")
print(f"| CPU step 10 -> GPU | 11-20 | {gap(c2g, c):.4f} | {gap(c2g, g):.4f} | {gap(g, c):.4f} |")
print(f"| GPU step 10 -> GPU | 11-20 | {gap(g2g, g):.4f} | {gap(g2g, c):.4f} | {gap(g, c):.4f} |")
print(f"| CPU S=5 step 10 (refreshes in flight) -> GPU S=5 | 11-20 | {gap(c52g, c5):.4f} | {gap(c52g, g5):.4f} | {gap(g5, c5):.4f} |")
print(f"\nlosses at step 20: GPU {g[20]:.4f}, CPU {c[20]:.4f}, GPU->CPU {g2c[20]:.4f}, CPU->GPU {c2g[20]:.4f}")
PY
