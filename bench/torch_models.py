"""The PyTorch models of bench/specs/*.asteria and bench/h200-scale.sh, by name: (constructor,
batch of 1024-token rows), built as bench/torch_baseline.py's `train`, `big`, `llama` and `huge`
modes build them. Shared by bench/torch_steps.py and bench/torch_profile.py."""
import torch_baseline as tb

MODELS = {
    "gpt2-124m": (lambda: tb.GPT(), 16),
    "gpt-0.9b": (lambda: tb.GPT(L=16, d=2048, h=16), 4),
    "llama-1.4b": (lambda: tb.Llama(L=24, d=2048, h=16, m=5632), 4),
    "llama-6.9b": (lambda: tb.Llama(L=32, d=4096, h=32, m=11008), 1),
}


def pop_model(argv, default="gpt2-124m"):
    """Removes `--model M` from argv and returns (name, constructor, batch); exits on an unknown
    name with the list of known ones."""
    import sys
    name = default
    if "--model" in argv:
        k = argv.index("--model"); name = argv[k + 1]; del argv[k:k + 2]
    if name not in MODELS:
        sys.exit("unknown --model %s (one of %s)" % (name, ", ".join(MODELS)))
    return (name,) + MODELS[name]
