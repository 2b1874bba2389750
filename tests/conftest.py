"""Shared fixtures: a checkpoint, and a server on it, to test against.

`tiny_checkpoint` is the folder named by the environment variable PERSONAPLEX_TEST_CHECKPOINT,
used as is, or else the generated development checkpoint in the repository's (git-ignored)
checkpoints/tiny, written by export/make_tiny_checkpoint.py on first use; either way its Mimi
is exported to ONNX (export/export_mimi.py), so the stages run on ONNX Runtime as served
(where `onnx` is installed: the GPU host's bundle has none, and its stages run Mimi on torch). Both
tools are idempotent, so later sessions reuse their output at no cost. `files` is its
`loaders.CheckpointFiles`; `server` is a real `tritonserver` serving it, one for every test
module that talks to a server, with the admin APIs restricted to `ADMIN_KEY`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from personaplex_triton.core.trace import TRACE_DIR_ENV
from personaplex_triton.serving.launch import ADMIN_KEY_HEADER, GRPC_ADMIN_KEY_HEADER, TritonServer

os.environ.setdefault("NO_TORCH_COMPILE", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_CHECKPOINT_CACHE = REPO_ROOT / "checkpoints" / "tiny"


def load_export_tool(name: str):
    """export/<name>.py as a module (export/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "export" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_moshi_lm(device, dtype, **size):
    """moshi's LMModel with PersonaPlex's architecture at the generated checkpoint's widths
    (`size` overrides some), random weights."""
    from moshi.models import loaders as moshi_loaders

    from personaplex_triton.core import loaders

    kwargs = {**loaders.PERSONAPLEX_LM_KWARGS, **loaders.TINY_LM_SIZE, **size}
    return moshi_loaders.get_moshi_lm(None, lm_kwargs=kwargs, device=device, dtype=dtype).eval()


def unforced_step(gen, active, user, rows=None):
    """One step of a SlotGenerator with the user's codes [b, 8] forced and nothing else:
    (tokens [b, 17], has_output [b]). `rows`: the slot table (None: the first b slots)."""
    import torch

    from personaplex_triton.lm.generation import StepInputs

    b, device = len(active), gen.device
    none = torch.zeros(b, dtype=torch.bool, device=device)
    tokens, has_output, _ = gen.step(StepInputs(
        torch.as_tensor(active, device=device), user.to(device), torch.zeros(b, 8, dtype=torch.long, device=device),
        none, torch.zeros(b, dtype=torch.long, device=device), none, rows=rows))
    return tokens, has_output


def snapshot_tensors(snap: dict) -> dict:
    """A SlotGenerator snapshot's tensors by name: the grid's, each per-row state's and the KV
    caches' ("kv"); the exec mask left out (each step sets it, for its own rows)."""
    grid = snap["grid"]
    modules = snap["modules"]
    found = {f"grid.{name}": getattr(grid, name) for name in ("cache", "provided", "offset")}
    found.update((name, rows) for name, rows in modules["rows"].items() if name != "exec_mask")
    if "kv" in modules:
        found["kv"] = modules["kv"]
    return found


def greedy_tokens_of(gen, active_at, steps: int) -> list:
    """The greedy tokens of `steps` steps of a SlotGenerator whose slots are started: random
    user codes, nothing else forced, `active_at(i)` the rows active at step i ([num_slots] bools)."""
    import torch

    rng = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        user = torch.randint(0, 2048, (gen.num_slots, 8), generator=rng)
        tokens, has_output = unforced_step(gen, active_at(i), user)
        out.append(tokens[has_output].cpu().tolist())
    return out


def rope_and_store_against_moshi(device, stored, rtol: float) -> None:
    """ring_attention.rope_and_store over 13 frames of 3 rows (4 query heads over 2 key heads of 8,
    a 5-entry ring: it wraps twice; a row idling at times; offsets apart) against moshi: the
    query is apply_rope's; the ring (to `rtol`) and its end_offset are `complete()`'s, less its
    write into the idle rows' next entry (past the wrap that entry is still attended to); the
    offsets move on where a row steps."""
    import torch
    from moshi.modules.rope import apply_rope
    from moshi.modules.transformer import RingKVCache

    from personaplex_triton.lm import kv_cache, ring_attention

    torch.manual_seed(2)
    device = torch.device(device)
    H, KV, D, C = 4, 2, 8, 5
    ours = kv_cache.CastRingKVCache(3, KV, D, C, device=device, dtype=stored)
    moshi = RingKVCache(3, KV, D, C, device=device, dtype=torch.float32)
    offset = torch.tensor([0, 4, 9], device=device)
    for step in range(13):
        mask = torch.tensor([True, step % 3 != 1, step > 6], device=device)
        projected = 10 * torch.randn(3, 1, (H + 2 * KV) * D, device=device)
        q, k, v = projected.split([H * D, KV * D, KV * D], dim=-1)
        want_q, want_k = apply_rope(q.view(3, 1, H, D).transpose(1, 2), k.view(3, 1, KV, D).transpose(1, 2),
                                    offset, max_period=10_000)
        before, index = moshi.cache.clone(), moshi.end_offset % C
        moshi.complete(kv_cache.store(want_k, stored).float(),
                       kv_cache.store(v.view(3, 1, KV, D).transpose(1, 2), stored).float(), mask)
        for row in torch.nonzero(~mask).flatten().tolist():
            moshi.cache[:, row, :, index[row]] = before[:, row, :, index[row]]
        moved = offset + mask
        got_q = ring_attention.rope_and_store(projected, offset, ours, mask, H, 10_000)
        torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
        assert torch.equal(offset, moved) and torch.equal(ours.end_offset, moshi.end_offset)
        torch.testing.assert_close(ours.cache.float(), moshi.cache, atol=1e-5, rtol=rtol)
    assert ours.end_offset.tolist() == [13, 9, 6]


@pytest.fixture(scope="session")
def make_tiny():
    return load_export_tool("make_tiny_checkpoint")


@pytest.fixture(scope="session")
def tiny_checkpoint(make_tiny) -> Path:
    checkpoint = Path(os.environ.get("PERSONAPLEX_TEST_CHECKPOINT") or TINY_CHECKPOINT_CACHE)
    if checkpoint == TINY_CHECKPOINT_CACHE:
        make_tiny.main(["--out", str(checkpoint)])
    try:
        import onnx  # noqa: F401
    except ImportError:  # absent from the GPU host's bundle, or at odds with its protobuf: Mimi runs on torch there
        return checkpoint
    load_export_tool("export_mimi").main(["--checkpoint", str(checkpoint)])
    return checkpoint


@pytest.fixture(scope="session")
def files(tiny_checkpoint):
    from personaplex_triton.core import loaders

    return loaders.resolve_checkpoint(tiny_checkpoint)


ADMIN_KEY = "test-admin-key"


@pytest.fixture(scope="session")
def server(tiny_checkpoint, tmp_path_factory):
    """With the deployment's secure defaults (admin APIs behind ADMIN_KEY): every test that
    talks to it shows that clients need no key. Its frame traces (trace.py) go to `server.trace_dir`."""
    folder = tmp_path_factory.mktemp("triton")
    env = {"PERSONAPLEX_CHECKPOINT": str(tiny_checkpoint), TRACE_DIR_ENV: str(folder / "trace")}
    with TritonServer(env=env, log_path=folder / "tritonserver.log", admin_key=ADMIN_KEY) as srv:
        srv.trace_dir = folder / "trace"
        yield srv


@pytest.fixture(scope="session")
def admin_headers():
    """The request headers that open the `server`'s admin APIs, by protocol."""
    return {"grpc": {GRPC_ADMIN_KEY_HEADER: ADMIN_KEY}, "http": {ADMIN_KEY_HEADER: ADMIN_KEY}}
