"""Summary of an `asteria train --trace` file of a CUDA run (bench/h200-energy.sh).

usage: trace_summary.py TRACE.json [SKIP_STEPS]

Per GPU stream: slices and busy milliseconds; where the compute stream sat idle, by the host phase
(the innermost host span: forward, backward, optimizer, host tasks, synchronize, step) that was
open in the middle of each gap — the time the GPU waited for the host; for the side stream's
preconditioner refreshes:
how many, their GPU time, how much of it overlaps the compute stream's busy time (the refreshes
running under training, off the critical path) and how many step boundaries they cross. Steps are
the host's `step` slices; the first SKIP_STEPS (default 2) are left out (first eigendecompositions,
warm-up). Prints Markdown.
"""
import json
import sys


def merge(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap(a, b, busy):
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)


def main() -> int:
    path = sys.argv[1]
    skip = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    ev = json.load(open(path))
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"]) if e.get("ph") == "X" else (e["ts"], None)
        for e in ev
        if e.get("name") == "step" and e.get("ph") in ("X", "B")
    )
    # tracing-chrome writes B/E pairs for spans: pair them per thread.
    opened, spans = {}, []
    for e in ev:
        if e.get("ph") == "B" and e.get("name") == "step":
            opened[(e["pid"], e["tid"])] = e["ts"]
        elif e.get("ph") == "E" and e.get("name") == "step" and (e["pid"], e["tid"]) in opened:
            spans.append((opened.pop((e["pid"], e["tid"])), e["ts"]))
    steps = sorted(spans) or [s for s in steps if s[1] is not None]
    if len(steps) <= skip:
        print(f"{path}: {len(steps)} steps, nothing after skipping {skip}")
        return 1
    t0, t1 = steps[skip][0], steps[-1][1]
    gpu = [e for e in ev if e.get("ph") == "X" and e.get("pid", 1) >= 2 and t0 <= e["ts"] <= t1]
    streams = {}
    for e in gpu:
        streams.setdefault(e.get("cat", "?"), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    n = len(steps) - skip
    print(f"{path}: steps {skip + 1}..{len(steps)} ({n} steps, {(t1 - t0) / 1e3:.0f} ms)\n")
    print("| stream | slices | busy ms | busy ms per step |\n|---|---|---|---|")
    for s, sl in sorted(streams.items()):
        busy = sum(b - a for a, b in merge([(a, b) for a, b, _ in sl])) / 1e3
        print(f"| {s} | {len(sl)} | {busy:.1f} | {busy / n:.2f} |")
    side = streams.get("side", [])
    compute = merge([(a, b) for a, b, _ in streams.get("compute", [])])
    # Host spans (B/E pairs per thread, or X slices) of the engine's phases.
    phases, opened = [], {}
    for e in ev:
        if e.get("pid", 1) >= 2 or "name" not in e:
            continue
        key = (e.get("pid"), e.get("tid"), e["name"])
        if e.get("ph") == "B":
            opened.setdefault(key, []).append(e["ts"])
        elif e.get("ph") == "E" and opened.get(key):
            phases.append((opened[key].pop(), e["ts"], e["name"]))
        elif e.get("ph") == "X":
            phases.append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    idle = {}
    for (_, a), (b, _) in zip(compute, compute[1:]):
        if b <= a or a < t0 or b > t1:
            continue
        mid = (a + b) / 2
        open_at = [p for p in phases if p[0] <= mid <= p[1]]
        name = min(open_at, key=lambda p: p[1] - p[0])[2] if open_at else "(no host span)"
        idle[name] = idle.get(name, 0.0) + (b - a)
    if idle:
        print("\n| compute stream idle during host phase | ms | ms per step |\n|---|---|---|")
        for name, us in sorted(idle.items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {us / 1e3:.1f} | {us / 1e3 / n:.2f} |")
    if side:
        total = sum(b - a for a, b, _ in side)
        under = sum(overlap(a, b, compute) for a, b, _ in side)
        bounds = [s[0] for s in steps[skip:]]
        crossing = sum(1 for a, b, _ in side if any(a < x < b for x in bounds))
        print(
            f"\nside-stream refreshes: {len(side)}, {total / 1e3:.1f} ms of GPU time, "
            f"{100 * under / max(total, 1e-9):.0f}% of it while the compute stream was busy; "
            f"{crossing} crossed a step boundary"
        )
        longest = sorted(side, key=lambda x: x[0] - x[1])[:3]
        for a, b, name in longest:
            print(f"- {name}: {(b - a) / 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
