"""The PyTorch reference rows of BENCHMARKS.md: GPT-2 124M, B=16x1024, bf16 autocast, AdamW
eager, AdamW torch.compile and the reference SOAP (nikhilvyas/SOAP soap.py, frequency 10), each
60 timed steps after 12 warm-up steps, through shared/bench/torch_baseline.py's train_steps.
Usage (GPU host): python3 run_torch.py [adamw|soap ...: eager rows only]   (torch_baseline.py beside it, soap.py in ../.ext)"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_baseline as tb

tb.out(what="env", gpu=tb.torch.cuda.get_device_name(0), torch=tb.torch.__version__, cpus=os.cpu_count())
rows = [("adamw", {}), ("adamw", {"compile_": True}), ("soap", {})]
if len(sys.argv) > 1:  # e.g. `run_torch.py adamw` = the eager AdamW row only
    rows = [r for r in rows if r[0] in sys.argv[1:] and not r[1]]
for name, kw in rows:
    try:
        tb.train_steps(name, **kw)
    except Exception as e:  # keep the other rows
        tb.out(what="gpt_train_fail", opt=name, err=str(e)[:300])
