"""Steps and step time (wall-clock of the training steps, evaluations excluded) each run needs to
reach a target validation loss: by default the final validation loss of the run named by
--target (AdamW's), the quality result a user chooses an optimizer by. Reads asteria --metrics
JSONL files; a run's loss between two evaluations is interpolated linearly (in steps).
Usage: python3 steps_to_loss.py --target NAME NAME=metrics.jsonl ...
Prints a markdown table: run, final validation loss, steps to the target, their step time (s)
and the ratios against the target run."""
import json, sys

args = sys.argv[1:]
target_name = None
if "--target" in args:
    k = args.index("--target"); target_name = args[k + 1]; del args[k:k + 2]
runs = {}
for a in args:
    name, path = a.split("=", 1)
    val, step_ms = [], {}
    for line in open(path):
        d = json.loads(line)
        if "val_loss" in d:
            val.append((d["step"], d["val_loss"]))
        elif "step_ms" in d:
            step_ms[d["step"]] = d["step_ms"]
    runs[name] = (val, step_ms)
if target_name not in runs:
    sys.exit(f"--target {target_name!r} is not one of {list(runs)}")
target = runs[target_name][0][-1][1]

def reach(val, goal):
    """First (interpolated) step at which the validation curve is at or below goal."""
    for (s0, l0), (s1, l1) in zip(val, val[1:]):
        if l1 <= goal:
            return s0 + (s1 - s0) * ((l0 - goal) / (l0 - l1) if l0 != l1 else 1.0)
    return None

def time_to(step_ms, step):
    whole = int(step)
    t = sum(ms for s, ms in step_ms.items() if s <= whole)
    if step > whole and (whole + 1) in step_ms:
        t += (step - whole) * step_ms[whole + 1]
    return t / 1e3

base = reach(runs[target_name][0], target)
base_s = time_to(runs[target_name][1], base)
print(f"target: {target_name}'s final validation loss {target:.4f}\n")
print("| run | final val loss | steps to target | step time to target (s) | steps vs target run | time vs target run |")
print("|---|---|---|---|---|---|")
for name, (val, step_ms) in runs.items():
    s = reach(val, target)
    if s is None:
        print(f"| {name} | {val[-1][1]:.4f} | not reached | – | – | – |")
        continue
    t = time_to(step_ms, s)
    print(f"| {name} | {val[-1][1]:.4f} | {s:.0f} | {t:.1f} | {s / base:.2f} | {t / base_s:.2f} |")
