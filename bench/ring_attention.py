"""One decode step's attention of one 7B layer on a GPU: moshi's (SDPA over the whole ring with
a mask), SDPA over the whole ring without one (flash, what a full ring costs at best), and
ring_attention.attend (reads only the filled entries), at several batches and context fills,
the launch variants of `attend`, and `attend` over the ring stored in fp8 (kv_cache.py), with
launch variants of its own (FP8_VARIANTS).

    python bench/ring_attention.py --out bench/results

Writes ring_attention.{json,md,png} under --out: median microseconds per layer call.
"""

import argparse
import json
import platform
import statistics
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from personaplex_triton.lm import kv_cache, ring_attention

HEADS, HEAD_DIM, CAPACITY = 32, 128, 3000  # the 7B's temporal transformer
# The fp8 ring reads half the bytes of the bf16 one at about the same time per entry (docs/gpu-serving-log.md):
# more programs in flight, longer loads per iteration, more loads in flight (a pipeline of more
# stages: half the bytes a load wants twice the loads in flight for the same bandwidth), or fp16
# dots (e4m3 to fp16 is one packed conversion, to bf16 three) are the launches to try there.
# "attend, fp8 ring" is attend's own default (bf16 dots); the decode step launches FP8_LAUNCH.
FP16 = {"dot_dtype": torch.float16}
FP8_VARIANTS = {"attend, fp8 ring": {}, "fp8, 2 splits": {"splits": 2}, "fp8, 4 splits": {"splits": 4},
                "fp8, block 128, 8 warps": {"block": 128, "warps": 8},
                "fp8, 4 splits, block 128, 8 warps": {"splits": 4, "block": 128, "warps": 8},
                "fp8, fp16 dot": FP16, "fp8, fp16 dot, 2 splits": {"splits": 2, **FP16},
                "fp8, fp16 dot, block 128, 8 warps": {"block": 128, "warps": 8, **FP16},
                "fp8, 2 stages": {"stages": 2}, "fp8, 4 stages": {"stages": 4}, "fp8, 6 stages": {"stages": 6},
                "fp8, the step's launch (FP8_LAUNCH)": ring_attention.FP8_LAUNCH,
                "fp8, fp16 dot, 2 splits, 4 stages": {"splits": 2, "stages": 4, **FP16}}


def timed_us(fn, steps=50):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(steps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return round(statistics.median(times), 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--fill", type=int, nargs="+", default=[400, 3000])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    variants = {"attend": {}, "attend, block 128": {"block": 128}, "attend, block 128, 8 warps": {"block": 128, "warps": 8},
                "attend, 1 split": {"splits": 1}}
    rows = []
    for batch in args.batch:
        cache = torch.randn(2, batch, HEADS, CAPACITY, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        fp8 = kv_cache.store(cache, torch.float8_e4m3fn)
        q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        for fill in args.fill:
            lengths = torch.full((batch,), fill, device="cuda").clamp(max=CAPACITY)
            mask = (torch.arange(CAPACITY, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
            row = {"batch": batch, "context_frames": fill,
                   "kv_read_mb": round(2 * batch * HEADS * min(fill, CAPACITY) * HEAD_DIM * 2 / 1e6, 1),
                   "moshi_us": timed_us(lambda: F.scaled_dot_product_attention(q, cache[0], cache[1], mask)),
                   "sdpa_full_ring_us": timed_us(lambda: F.scaled_dot_product_attention(q, cache[0], cache[1]))}
            for name, launch in variants.items():
                row[name] = timed_us(lambda: ring_attention.attend(q, cache[0], cache[1], lengths, **launch))
            for name, launch in FP8_VARIANTS.items():
                row[name] = timed_us(lambda: ring_attention.attend(q, fp8[0], fp8[1], lengths, **launch))
            row["attend_gb_s"] = round(row["kv_read_mb"] / row["attend"] * 1e3)  # MB per µs = 1000 GB/s
            rows.append(row)
            print(row, flush=True)
        del cache, fp8
    report = {"date": date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(), "heads": HEADS, "head_dim": HEAD_DIM, "capacity": CAPACITY,
              "rows": rows}
    write_report(report, args.out)


def write_report(report, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ring_attention.json").write_text(json.dumps(report, indent=1) + "\n")
    rows = report["rows"]
    columns = [k for k in rows[0] if k not in ("batch", "context_frames", "kv_read_mb", "attend_gb_s")]
    lines = [f"# One layer's decode attention ({report['date']}, {report['gpu']}, torch {report['torch']})", "",
             f"{report['heads']} heads of {report['head_dim']}, a {report['capacity']}-entry bf16 ring; median "
             "microseconds per call. moshi: SDPA over the whole ring with a mask; sdpa full ring: no mask "
             "(flash); attend: ring_attention.py, which reads only the filled entries (fp8 ring: the "
             "same entries stored in float8_e4m3fn, half the bytes of `filled KV`). "
             "Command: `python bench/ring_attention.py`.", "",
             "| batch | context frames | filled KV (MB) | " + " | ".join(columns) + " | attend GB/s |",
             "| ---: | ---: | ---: | " + " | ".join("---:" for _ in columns) + " | ---: |"]
    lines += [f"| {r['batch']} | {r['context_frames']} | {r['kv_read_mb']} | "
              + " | ".join(str(r[c]) for c in columns) + f" | {r['attend_gb_s']:.0f} |" for r in rows]
    (out / "ring_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for fill in sorted({r["context_frames"] for r in rows}):
        mine = [r for r in rows if r["context_frames"] == fill]
        batches = [r["batch"] for r in mine]
        ax.plot(batches, [r["moshi_us"] for r in mine], "s--", label=f"moshi, {fill} frames")
        ax.plot(batches, [r["attend"] for r in mine], "o-", label=f"attend, {fill} frames")
    ax.set(xscale="log", yscale="log", xlabel="conversations (batch)", ylabel="µs per layer")
    ax.legend(fontsize=7)
    ax.set_title(f"{report['gpu']}, {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "ring_attention.png", dpi=110)


if __name__ == "__main__":
    main()
