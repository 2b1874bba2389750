"""The anchor of every GPU figure: moshi's own `LMGen.step` (PyPI moshi 0.2.13, CUDA graphs) on
PersonaPlex's 7B shape (16 depformer codebooks, random bf16 weights), ms per step by batch size.

    python -m bench.moshi_anchor --batch 1 8 16 32 48 64 --out bench/results/moshi_anchor.json

moshi's `LMGen` cannot run PersonaPlex itself (with 16 depformer codebooks it takes no user
audio and cannot force prompt tokens), but it runs the same transformer, depformer and
sampling per step: the cost a step of this size has in moshi's own code. Run it where the GPU
is otherwise idle (after the server has stopped): it loads a second copy of the weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.gpu_step import timed


def step_ms(lm, batch: int, steps: int) -> float:
    from moshi.models.lm import LMGen

    gen = LMGen(lm, temp=0.8, temp_text=0.7, top_k=250, top_k_text=25)
    codes = torch.zeros(batch, lm.num_codebooks - lm.dep_q - 1, 1, dtype=torch.long, device=lm.device)
    with gen.streaming(batch):
        return timed(lambda: gen.step(codes), steps)  # its first calls warm up and capture


def main(argv=None) -> int:
    from moshi.models import loaders as moshi_loaders

    from personaplex_triton.core import loaders

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32, 48, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True, help="JSON file of the figures")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    lm = moshi_loaders.get_moshi_lm(None, lm_kwargs=loaders.PERSONAPLEX_LM_KWARGS, device="cuda",
                                    dtype=torch.bfloat16).eval()
    rows = []
    with torch.no_grad():
        for batch in args.batch:
            torch.cuda.reset_peak_memory_stats()
            rows.append({"batch": batch, "step_ms": step_ms(lm, batch, args.steps),
                         "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)})
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    result = {"what": "moshi 0.2.13 LMGen.step, PersonaPlex 7B shape (dep_q 16), random bf16, CUDA graphs",
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": args.steps, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
