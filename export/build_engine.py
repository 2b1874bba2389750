"""Build TensorRT engines from the exported Mimi steps (on a GPU host with TensorRT).

Reads `<stage>.onnx` of the checkpoint's artefact folder (run `make export` or
export/export_mimi.py first) and writes `<stage>.plan` beside it, with `<stage>.plan.json`:
I/O names and shapes, the source checkpoint and step-code hashes, the TensorRT version,
precision and optimisation profile. The profile spans batch 1 to the model's
`max_conversations` (talker's for the encoder, code2wav's for the decoder), tuned for the
largest. Needs only `tensorrt` and the standard library, so it runs in NVIDIA's TensorRT
image (`docker compose run --rm mimi-engine`). An engine runs only with the TensorRT version
that built it: build with the version the server imports.

    python export/build_engine.py [--checkpoint DIR] [--stage encoder decoder]
                                  [--precision fp32|tf32|fp16|bf16] [--max-batch N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without installing the package

from personaplex_triton.core import loaders, tunables  # noqa: E402
from personaplex_triton.mimi.artefacts import (  # noqa: E402
    file_sha256, metadata_path, onnx_path, plan_path, read_metadata, stale_reason)
from personaplex_triton.serving.launch import model_parameter  # noqa: E402

STAGE_MODEL = {"encoder": "talker", "decoder": "code2wav"}  # the model whose pool sizes the profile
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


def build(onnx_file: Path, plan_file: Path, max_batch: int, precision: str, workspace_gb: float) -> dict:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch: the only mode of TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_file)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_file}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    if precision == "fp32":
        config.clear_flag(trt.BuilderFlag.TF32)  # on by default; fp32 means the exported numbers
    elif precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        rest = tuple(tensor.shape)[1:]
        profile.set_shape(tensor.name, (1, *rest), (max_batch, *rest), (max_batch, *rest))
    config.add_optimization_profile(profile)
    started = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_file} (see its log above)")
    plan_file.write_bytes(bytes(plan))
    return {"tensorrt": trt.__version__, "build_s": round(time.perf_counter() - started, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None,
                        help="checkpoint folder (default: $PERSONAPLEX_CHECKPOINT, else checkpoints/tiny)")
    parser.add_argument("--stage", nargs="+", choices=sorted(STAGE_MODEL), default=sorted(STAGE_MODEL))
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32: exact; tf32 / fp16 / bf16 let TensorRT pick faster, less precise "
                             "kernels (I/O stays as exported)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="largest batch of the profile (default: the model's max_conversations)")
    parser.add_argument("--workspace-gb", type=float, default=4.0)
    args = parser.parse_args(argv)
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"tensorrt does not import ({exc}): build on a GPU host with TensorRT, "
                         "e.g. `docker compose run --rm mimi-engine`")
    files = loaders.resolve_checkpoint(loaders.checkpoint_spec(args.checkpoint or ""))
    mimi_weights = files.mimi
    for stage in args.stage:
        source = onnx_path(mimi_weights, stage)
        reason = stale_reason(source, mimi_weights)
        if reason is not None:
            raise SystemExit(f"cannot build the {stage} engine: {reason}")
        configured = model_parameter(STAGE_MODEL[stage], "max_conversations")
        # auto: the decoder's GPU pool, which no talker pool exceeds.
        max_batch = args.max_batch or (int(configured) if configured.isdigit() else tunables.GPU_DECODER_SLOTS)
        target = plan_path(mimi_weights, stage)
        built = build(source, target, max_batch, args.precision, args.workspace_gb)
        onnx_meta = read_metadata(source)
        meta = {
            "stage": stage,
            "checkpoint": str(files.root),
            "checkpoint_sha256": onnx_meta["checkpoint_sha256"],
            "step_sha256": onnx_meta["step_sha256"],
            "onnx_sha256": file_sha256(source),
            "inputs": onnx_meta["inputs"],
            "outputs": onnx_meta["outputs"],
            "precision": args.precision,
            "profile": {"min": 1, "opt": max_batch, "max": max_batch},
            **built,
        }
        metadata_path(target).write_text(json.dumps(meta, indent=2) + "\n")
        print(f"{target}: built ({args.precision}, batch 1..{max_batch}, TensorRT {built['tensorrt']}, {built['build_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
