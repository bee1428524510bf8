"""Logits of an exported model under Hugging Face transformers (tests/hf_export.rs).

usage: logits.py MODEL_DIR TOKENS.i32 OUT.f32 B T

Loads MODEL_DIR (what `asteria export --format hf` wrote) with
`AutoModelForCausalLM.from_pretrained` on the CPU in float32, refuses any missing, unexpected or
mismatched weight (transformers would otherwise initialise it at random), runs the B x T token
ids of TOKENS.i32 (little-endian int32, row-major) and writes the logits [B, T, V] as
little-endian float32 to OUT.f32. Prints the architecture and the torch / transformers versions.
"""
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM


def main() -> int:
    model_dir, tokens_path, out_path, b, t = sys.argv[1:6]
    b, t = int(b), int(t)
    ids = np.fromfile(tokens_path, dtype="<i4").reshape(b, t)
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True, attn_implementation="eager"
    )
    bad = {k: v for k, v in info.items() if k != "error_msgs" and len(v) > 0}
    if bad or info.get("error_msgs"):
        print(f"loading {model_dir}: {info}", file=sys.stderr)
        return 1
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(ids).long()).logits
    logits.numpy().astype("<f4").tofile(out_path)
    print(
        f"{type(model).__name__}: logits {tuple(logits.shape)} "
        f"(torch {torch.__version__}, transformers {transformers.__version__})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
