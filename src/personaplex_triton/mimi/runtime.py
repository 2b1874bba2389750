"""Where a Mimi step runs: TensorRT, ONNX Runtime or PyTorch, behind one interface.

A runner takes one 80 ms step of a batch of streams: `run(x, states) -> (y, outputs)`, with
`states` the step's state tensors (offset first) in the order of `MimiStep.state_specs()` and
`outputs` what the step makes of them, which `steps.write_state` puts in place.
The ONNX and TensorRT runners run the artefacts `make export` writes (artefacts.py).

`open_step` takes the first runtime that can run here, in the order TensorRT (an engine
exists, `tensorrt` imports, a CUDA device), ONNX Runtime (an export exists; on the CPU only:
on a GPU, TensorRT or PyTorch keep Mimi there), PyTorch (always), unless one is forced.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.buckets import batch_buckets, bucket_for
from ..core.collector import paused
from ..core.host_copies import copy_into
from .artefacts import onnx_path, plan_path, read_metadata, stale_reason
from .steps import STEPS, MimiStep, TensorSpec, write_state

RUNTIMES = ("tensorrt", "onnxruntime", "torch")


class RuntimeUnavailable(RuntimeError):
    """A forced runtime cannot run here; the message says why."""


def tensor_specs_json(specs: list[TensorSpec]) -> list[dict]:
    """For the metadata JSON: shapes with the dynamic batch dimension first."""
    return [{"name": s.name, "shape": ["batch", *s.shape], "dtype": str(s.dtype).removeprefix("torch."),
             **({} if s.ring is None else {"ring": s.ring})} for s in specs]


def _state_specs(meta: dict) -> list[TensorSpec]:
    return [TensorSpec(t["name"], tuple(t["shape"][1:]), getattr(torch, t["dtype"]), t.get("ring"))
            for t in meta["inputs"][1:]]


@dataclass
class StepRunner:
    """Runs one stage's step; subclasses say how. `device` is where inputs and state live."""

    stage: str
    runtime: str
    source: str
    device: torch.device
    state_specs: list = field(repr=False)
    skipped: list[str] = field(default_factory=list, repr=False)  # runtimes passed over, and why

    def run(self, x: torch.Tensor, states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One step of a batch: its output and its state outputs (see steps.write_state).
        The outputs may be reused by the next run: copy what you keep."""
        raise NotImplementedError

    def run_rows(self, x: torch.Tensor, slots: list[int], pool: list[torch.Tensor], spare: int) -> torch.Tensor:
        """One step of the streams in rows `slots` (sorted) of `pool`, the state tensors
        ([rows, ...] each, offset first), which it reads and writes back in place; `x` holds
        their inputs, on any device. `spare`: a row of `pool` no stream uses, which a padded
        batch may write. Returns the step's output, valid until the next run."""
        x = x.to(self.device)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        rows = slice(slots[0], slots[0] + len(slots)) if consecutive else torch.tensor(slots, device=self.device)
        y, outputs = self.run(x, [tensor[rows] for tensor in pool])
        write_state(pool, rows, outputs, self.state_specs)
        return y

    def prepare(self, pool: list[torch.Tensor], spare: int) -> None:
        """Get ready for every batch of `pool`'s streams before serving (graphs, engines)."""

    def describe(self) -> str:
        passed = "".join(f"; not {why}" for why in self.skipped)
        return f"Mimi {self.stage} on {self.runtime} ({self.source}, {self.device}){passed}"

    @property
    def names(self) -> tuple[list[str], list[str]]:
        """Input and output tensor names of the exported graph, in order."""
        step = STEPS[self.stage]
        states = [spec.name for spec in self.state_specs]
        return [step.input.name, *states], [step.output.name, *(f"{s}_out" for s in states)]


class TorchStepRunner(StepRunner):
    """The step in PyTorch: eager on the CPU. On a CUDA device a pool's step replays a CUDA
    graph, one per batch bucket (core/buckets.py; rows past the batch read and write the pool's
    spare row), which gathers the rows' state, steps them and writes their state back: eager,
    that is a few hundred small kernels, whose launches would keep the talker's encode thread
    busy most of the time under load."""

    def __init__(self, stage: str, mimi, skipped=(), cuda_graphs: bool | None = None):
        self.step: MimiStep = STEPS[stage](mimi).eval()
        device = next(mimi.parameters()).device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self._graphs: dict[int, tuple] = {}  # bucket -> (graph, static input, static rows, static output)
        self._pool: list[torch.Tensor] | None = None  # what the graphs read and write
        source = f"mimi.steps.{type(self.step).__name__}" + (", CUDA graphs" if self.cuda_graphs else "")
        super().__init__(stage, "torch", source, device, self.step.state_specs(), list(skipped))

    @torch.no_grad()
    def run(self, x, states):
        y, *new_states = self.step(x, *states)
        return y, new_states

    @torch.no_grad()
    def run_rows(self, x, slots, pool, spare):
        if not self.cuda_graphs:
            return super().run_rows(x, slots, pool, spare)
        if pool is not self._pool:
            self.prepare(pool, spare)
        n = len(slots)
        bucket = bucket_for(n, sorted(self._graphs))
        graph, static_x, static_rows, y = self._graphs[bucket]
        copy_into(static_x[:n], x)
        copy_into(static_rows, torch.tensor(slots + [spare] * (bucket - n)))
        graph.replay()
        return y[:n]

    @torch.no_grad()
    def prepare(self, pool, spare):
        """Capture the graph of every bucket for `pool` now, not inside a live tick: largest
        first, in one memory pool (a tick replays one graph at a time)."""
        if not self.cuda_graphs:
            return
        self._graphs.clear()
        self._pool = pool
        memory = torch.cuda.graph_pool_handle()
        for bucket in reversed(batch_buckets(pool[0].shape[0] - 1)):
            self._graphs[bucket] = self._capture(bucket, pool, spare, memory)

    def _capture(self, bucket: int, pool: list[torch.Tensor], spare: int, memory) -> tuple:
        x = torch.zeros((bucket, *self.step.input.shape), dtype=self.step.input.dtype, device=self.device)
        rows = torch.full((bucket,), spare, dtype=torch.long, device=self.device)

        def step() -> torch.Tensor:
            y, outputs = self.run(x, [tensor.index_select(0, rows) for tensor in pool])
            write_state(pool, rows, outputs, self.state_specs)
            return y

        with paused():  # no collection frees a graph mid-capture (core/collector.py)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up, as capture requires, off the main stream (spare row only)
                step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory):
                y = step()
        return graph, x, rows, y


class OnnxRuntimeRunner(StepRunner):
    """On the CPU: torch tensors in and out share memory with the arrays ONNX Runtime sees."""

    def __init__(self, stage: str, path: Path, specs, skipped=(), threads: int | None = None):
        """`threads`: ONNX Runtime's intra-op threads (default: every core). With one, a run
        computes on the calling thread, so that thread's scheduling priority is the run's."""
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
        # Idle threads sleep rather than spin, even within a run: spinning made the decode
        # alone faster, but both stages and the LM share the cores, and served it was no
        # better (docs/mimi.md).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        super().__init__(stage, "onnxruntime", str(path), torch.device("cpu"), specs, list(skipped))
        self._inputs, self._outputs = self.names

    def run(self, x, states):
        feeds = {name: t.contiguous().numpy() for name, t in zip(self._inputs, [x, *states])}
        y, *new_states = (torch.from_numpy(a) for a in self.session.run(self._outputs, feeds))
        return y, new_states


class TensorRTRunner(StepRunner):
    """A TensorRT engine on the current CUDA stream, reading and writing torch CUDA tensors."""

    def __init__(self, stage: str, path: Path, specs, device: torch.device, skipped=()):
        import tensorrt as trt

        self._trt_logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self._trt_logger).deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise RuntimeUnavailable(f"TensorRT could not load {path} (built by another TensorRT version?)")
        self.context = self.engine.create_execution_context()
        self._dtypes = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                        trt.DataType.BF16: torch.bfloat16, trt.DataType.INT32: torch.int32,
                        trt.DataType.INT64: torch.int64, trt.DataType.BOOL: torch.bool}
        super().__init__(stage, "tensorrt", str(path), device, specs, list(skipped))
        self._inputs, self._outputs = self.names

    def run(self, x, states):
        feeds = [t.contiguous() for t in (x, *states)]  # kept alive until the step is queued
        for name, tensor in zip(self._inputs, feeds):
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = []
        for name in self._outputs:
            out = torch.empty(tuple(self.context.get_tensor_shape(name)),
                              dtype=self._dtypes[self.engine.get_tensor_dtype(name)], device=self.device)
            self.context.set_tensor_address(name, out.data_ptr())
            outputs.append(out)
        if not self.context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise RuntimeError(f"TensorRT step of the Mimi {self.stage} failed")
        return outputs[0], outputs[1:]


def _artefact_reason(runtime: str, artefact: Path, mimi_weights: Path) -> str | None:
    """Why `runtime` cannot run `artefact` here (stale or missing, or the package is absent)."""
    reason = stale_reason(artefact, mimi_weights)
    if reason is None:
        try:
            importlib.import_module(runtime)
        except ImportError as exc:
            reason = f"the {runtime} package does not import ({exc})"
    return None if reason is None else f"{runtime}: {reason}"


def _why_not(runtime: str, stage: str, mimi_weights: Path, device: torch.device, forced: bool) -> str | None:
    if runtime == "tensorrt":
        if device.type != "cuda":
            return "tensorrt: it needs a CUDA device"
        return _artefact_reason(runtime, plan_path(mimi_weights, stage), mimi_weights)
    if runtime == "onnxruntime":
        if device.type != "cpu" and not forced:
            return "onnxruntime: CPU only here, and the model runs on " + device.type
        return _artefact_reason(runtime, onnx_path(mimi_weights, stage), mimi_weights)
    return None


def open_step(stage: str, files, runtime: str = "auto", device: str = "cpu",
              threads: int | None = None) -> StepRunner:
    """A runner of Mimi's `stage` ("encoder" or "decoder") for a checkpoint's Mimi (`files`:
    loaders.CheckpointFiles): the first runtime available in RUNTIMES' order, or the one
    forced (RuntimeUnavailable if it cannot run). `threads`: ONNX Runtime's intra-op threads
    (default: every core)."""
    from ..core import loaders

    if stage not in STEPS:
        raise ValueError(f"Mimi stage must be one of {', '.join(STEPS)}, not {stage!r}")
    if runtime not in ("auto", *RUNTIMES):
        raise ValueError(f"mimi_runtime must be auto or one of {', '.join(RUNTIMES)}, not {runtime!r}")
    device = torch.device(device)
    mimi_weights = files.mimi
    skipped = []
    for candidate in RUNTIMES if runtime == "auto" else (runtime,):
        reason = _why_not(candidate, stage, mimi_weights, device, forced=runtime != "auto")
        if reason is not None:
            if runtime != "auto":
                raise RuntimeUnavailable(f"Mimi {stage} cannot run on {reason}")
            skipped.append(reason)
            continue
        if candidate == "torch":
            return TorchStepRunner(stage, loaders.get_mimi(files, device), skipped)
        if candidate == "onnxruntime":
            path = onnx_path(mimi_weights, stage)
            return OnnxRuntimeRunner(stage, path, _state_specs(read_metadata(path)), skipped, threads)
        path = plan_path(mimi_weights, stage)
        try:
            return TensorRTRunner(stage, path, _state_specs(read_metadata(path)), device, skipped)
        except RuntimeUnavailable as exc:
            if runtime != "auto":
                raise
            skipped.append(f"tensorrt: {exc}")
    raise AssertionError("torch is always available")
