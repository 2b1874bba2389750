"""On a CUDA GPU: the CUDA-graphed step gives exactly the eager step's tokens (with a bf16 and an
fp8 KV cache), a conversation's tokens do not depend on the others in the batch there either,
the ring attention gives moshi's attention's tokens and reads an fp8 cache, and the PyTorch Mimi
steps (graphed and eager) match moshi's streaming Mimi."""

import pytest
import torch
from conftest import greedy_tokens_of, rope_and_store_against_moshi, snapshot_tensors, tiny_moshi_lm, unforced_step
from moshi.modules.gating import ActivationGating
from moshi.modules.transformer import RMSNorm
from torch.nn import functional as F

from personaplex_triton.lm import fused_ops, kv_cache, ring_attention
from personaplex_triton.lm.generation import SlotGenerator
from personaplex_triton.lm.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

SLOTS = 4


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return tiny_moshi_lm("cuda", torch.bfloat16)


def run(lm, cuda_graphs, live, steps=24, kv_dtype=None):
    """Tokens of slot 0 over `steps` steps; slots in `live` (besides 0) run other inputs."""
    gen = SlotGenerator(lm, SLOTS, cuda_graphs=cuda_graphs, kv_dtype=kv_dtype)
    try:
        for slot in {0, *live}:
            gen.start(slot, SamplingParams(seed=100 + slot))
        rng = torch.Generator().manual_seed(1)
        active = torch.zeros(SLOTS, dtype=torch.bool)
        active[[0, *live]] = True
        out = []
        for _ in range(steps):
            user = torch.randint(0, 2048, (SLOTS, 8), generator=rng)
            user[0] = torch.randint(0, 2048, (8,), generator=torch.Generator().manual_seed(len(out)))
            tokens, has_output = unforced_step(gen, active, user)
            if has_output[0]:
                out.append(tokens[0].cpu().tolist())
        return out
    finally:
        gen.close()


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16-kv", "fp8-kv"])
def test_cuda_graphs_match_eager(lm, kv_dtype):
    assert run(lm, True, [1, 2, 3], kv_dtype=kv_dtype) == run(lm, False, [1, 2, 3], kv_dtype=kv_dtype)


def test_alone_equals_batched_on_gpu(lm):
    assert run(lm, cuda_graphs=True, live=[]) == run(lm, cuda_graphs=True, live=[1, 2, 3])


def carried(lm, cuda_graphs, table, steps=24, kv_dtype=None):
    """Tokens of the conversation in `table[0]` when every step carries the slots of `table`
    (row i: slot table[i]; each with its own seed and user codes by conversation, not by slot),
    and slot 2's conversation, started too, idles."""
    gen = SlotGenerator(lm, SLOTS, cuda_graphs=cuda_graphs, kv_dtype=kv_dtype)
    try:
        for i, slot in enumerate([*table, 2] if 2 not in table else table):
            gen.start(slot, SamplingParams(seed=100 + i))
        out = []
        rows = torch.tensor(table)
        for step in range(steps):
            user = torch.stack([torch.randint(0, 2048, (8,), generator=torch.Generator().manual_seed(1000 * i + step))
                                for i in range(len(table))])
            tokens, has_output = unforced_step(gen, torch.ones(len(table), dtype=torch.bool), user, rows)
            if has_output[0]:
                out.append(tokens[0].cpu().tolist())
        return out
    finally:
        gen.close()


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16-kv", "fp8-kv"])
def test_a_graphed_step_carries_any_slots(lm, kv_dtype):
    """Through the slot table, a graphed step of slots (3, 1) or (3, 0) packed in 2 rows gives
    the tokens the same two conversations give in slots (0, 1), eager (the pool's own rows)."""
    alone = carried(lm, False, [0, 1], kv_dtype=kv_dtype)
    assert carried(lm, True, [3, 1], kv_dtype=kv_dtype) == alone
    assert carried(lm, True, [3, 0], kv_dtype=kv_dtype) == alone


@pytest.mark.parametrize("dtype, stored, dot_dtype, stages", [
    (torch.float32, torch.float32, None, None), (torch.bfloat16, torch.bfloat16, None, None),
    (torch.bfloat16, torch.float8_e4m3fn, None, None), (torch.bfloat16, torch.float8_e4m3fn, torch.float16, None),
    (torch.bfloat16, torch.float8_e4m3fn, None, 5),
    (torch.bfloat16, torch.float8_e4m3fn, ring_attention.FP8_LAUNCH["dot_dtype"], ring_attention.FP8_LAUNCH["stages"])])
def test_ring_attention_kernel_matches_softmax_attention(dtype, stored, dot_dtype, stages):
    """Rows with no entry, part of the ring and all of it (3000 entries, 12 splits), against
    softmax attention over the values the cache stores; an fp8 ring also through fp16 dots,
    pipelined deeper (`stages`: more loads in flight), and as the decode step launches it
    (`FP8_LAUNCH`)."""
    torch.manual_seed(0)
    B, H, C, D = 4, 8, 3000, 128
    cache = kv_cache.store(torch.randn(2, B, H, C, D, device="cuda", dtype=dtype), stored)
    q = torch.randn(B, H, 1, D, device="cuda", dtype=dtype)
    lengths = torch.tensor([0, 1, 700, C], device="cuda")
    out = ring_attention.attend(q, cache[0], cache[1], lengths, dot_dtype=dot_dtype, stages=stages)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.count_nonzero(out[0]) == 0
    for b in range(1, B):
        n = int(lengths[b])
        k, v = cache[0, b, :, :n].float(), cache[1, b, :, :n].float()
        expected = torch.softmax(q[b].float() @ k.transpose(-1, -2) / D ** 0.5, dim=-1) @ v
        torch.testing.assert_close(out[b].float(), expected, **({} if dtype == torch.float32 else
                                                                 {"atol": 2e-2, "rtol": 2e-2}))


def test_fp8_kv_close_to_bf16(lm):
    """The temporal transformer with an fp8 KV cache, a prefill chunk (moshi's attention over the
    ring upcast) then one-frame steps (the ring kernel loading fp8), stays close to the bf16
    cache's outputs."""
    outputs = {}
    ring_attention.install(lm.transformer)
    try:
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            kv_cache.store_in(lm.transformer, dtype)
            torch.manual_seed(2)
            with lm.transformer.streaming(2):
                x = [torch.randn(2, 7, lm.dim, device="cuda", dtype=torch.bfloat16)]
                x += [torch.randn(2, 1, lm.dim, device="cuda", dtype=torch.bfloat16) for _ in range(9)]
                outputs[dtype] = [lm.transformer(chunk).float() for chunk in x]
    finally:
        ring_attention.uninstall(lm.transformer)
        kv_cache.store_in(lm.transformer, torch.bfloat16)
    for ref, fp8 in zip(outputs[torch.bfloat16], outputs[torch.float8_e4m3fn]):
        assert torch.isfinite(fp8).all()
        assert torch.linalg.norm(fp8 - ref) <= 0.1 * torch.linalg.norm(ref)


def test_ring_attention_gives_moshis_tokens():
    """Greedy, fp32, CUDA graphs, a 40-frame context so the ring wraps, slots idling and joining:
    the project's kernels (ring attention, RoPE and ring write, fused norms and gatings) give
    the same tokens as moshi's modules (the reference). Slot 2 idles only before its ring
    wraps: past it, moshi's write of an idle row's frame replaces an entry that row attends to,
    which the ring path leaves (conftest.rope_and_store_against_moshi)."""
    def greedy_tokens(ring: bool):
        torch.manual_seed(0)
        lm = tiny_moshi_lm("cuda", torch.float32, context=40)
        gen = SlotGenerator(lm, SLOTS, cuda_graphs=True, ring=ring)
        assert gen.ring_attention == ring
        try:
            for slot in (0, 1, 3):
                gen.start(slot, SamplingParams(greedy=True))
            return greedy_tokens_of(gen, lambda i: [True, True, i % 3 != 0 or i > 40, i > 10], 90)
        finally:
            gen.close()

    ring, moshi = greedy_tokens(True), greedy_tokens(False)
    assert sum(map(len, ring)) > 200
    assert ring == moshi


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_rope_and_store_on_gpu(stored):
    """The decode's RoPE and ring write against moshi's, to one step of the stored dtype (the
    kernel's fp32 RoPE may round its last bit otherwise, which can move a bf16 or fp8 value)."""
    rope_and_store_against_moshi("cuda", stored, rtol={torch.float32: 1e-5, torch.bfloat16: 2 ** -7}.get(stored, 2 ** -3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_on_gpu(dtype):
    """The 7B's widths: a norm of 4096 and a gating of 11264 hidden units routed through
    fused_ops give moshi's outputs (bf16: a sum in another order, a rounding step at most)."""
    torch.manual_seed(3)
    norm = RMSNorm(4096, eps=1e-8, dtype=torch.float32).to("cuda", dtype)
    gating = ActivationGating(4096, 16896, F.silu).to("cuda", dtype)
    x = torch.randn(5, 1, 4096, device="cuda", dtype=dtype)
    with torch.no_grad():
        norm.alpha.normal_()
        want = gating(norm(x))
        assert fused_ops.install(norm) + fused_ops.install(gating) == 2
        got = gating(norm(x))
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("stage", ["decoder", "encoder"])
def test_torch_mimi_step_on_gpu_matches_moshi_streaming(stage, cuda_graphs):
    """The PyTorch runtime (what a GPU without a TensorRT engine runs) on the generated
    checkpoint's Mimi, built in place: no checkpoint on disk needed. The pool's batch goes
    1, 2, 3 conversations, so the graphs run padded buckets."""
    from conftest import load_export_tool
    from mimi_parity import assert_parity
    from personaplex_triton.mimi.runtime import TorchStepRunner

    mimi = load_export_tool("make_tiny_checkpoint").build_mimi(seed=0).cuda()
    # Without TF32: cuDNN's TF32 convolutions (PyTorch's default) pick kernels by batch size,
    # so the pool's batches and moshi's round differently (measured: 99.7% of codes equal).
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        assert_parity(TorchStepRunner(stage, mimi, cuda_graphs=cuda_graphs), mimi)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def test_the_talkers_encode_on_a_stream_of_its_own_gives_the_same_tokens(files):
    """On a GPU the talker queues each tick's Mimi encode on a stream of its own, beside the
    step, and the next tick's step waits for it there: the same tokens and token grid as a
    talker that encodes before it steps, greedy and sampled, two conversations in slots apart,
    the second joining mid-way (its start writes the first's pending codes)."""
    import numpy as np

    from personaplex_triton.core import loaders
    from personaplex_triton.mimi.runtime import open_step
    from personaplex_triton.stages.persona import Persona, VoicePrompt, load_voice
    from personaplex_triton.stages.talker import Talker, TalkerSetup

    voice = VoicePrompt("NATF0-short", frames=load_voice(files.voices / "NATF0.wav").frames[:8])
    frames = (0.1 * np.random.default_rng(7).standard_normal((16, 1920))).astype(np.float32)
    talkers = [Talker(loaders.get_lm(files, "cuda"), open_step("encoder", files, device="cuda"),
                      loaders.get_tokenizer(files), SLOTS, encode_after=after) for after in (True, False)]
    try:
        assert talkers[0]._encode_stream is not None and talkers[0]._encoder is None
        for sampling in (SamplingParams(greedy=True), SamplingParams(seed=8)):
            runs = []
            for talker in talkers:
                talker.prefill(0, TalkerSetup(Persona(voice, ()), sampling))
                answers = []
                for i, frame in enumerate(frames):
                    if i == 5:
                        talker.prefill(3, TalkerSetup(Persona(voice, ()), SamplingParams(seed=3)))
                    out = talker.tick({0: frame, **({3: frame[::-1].copy()} if i >= 5 else {})})
                    answers.append([(s, step.text_token, tuple(map(int, step.codes))) for s, step in sorted(out.items())])
                talker.settle()
                grid = talker.generator.grid
                runs.append((answers, grid.cache[[0, 3]].cpu(), grid.provided[[0, 3]].cpu()))
                talker.stop(0)
                talker.stop(3)
            (ours, cache, provided), (theirs, cache_first, provided_first) = runs
            assert ours == theirs and sum(len(a) for a in ours) > len(frames)
            assert torch.equal(cache, cache_first) and torch.equal(provided, provided_first)
    finally:
        for talker in talkers:
            talker.close()


def test_a_graphed_tick_makes_few_pytorch_calls(files):
    """Each PyTorch call from Python lets a Triton stub's other threads take the GIL, and the
    tick's thread then waits to get it back (bench/experiments/tick_contention.py): a graphed talker tick
    hands its step one packed tensor and takes one back, Mimi's rows are stacked in numpy, so a
    tick's calls do not grow with its rows (bench/results/tick_contention-h100-*.md)."""
    import numpy as np

    from bench.gpu_step import calls_a_tick
    from personaplex_triton.core import loaders
    from personaplex_triton.mimi.runtime import open_step
    from personaplex_triton.stages.code2wav import Code2Wav, CodesFrame
    from personaplex_triton.stages.persona import Persona, VoicePrompt, load_voice
    from personaplex_triton.stages.talker import Talker, TalkerSetup

    voice = VoicePrompt("NATF0-short", frames=load_voice(files.voices / "NATF0.wav").frames[:4])
    rng = np.random.default_rng(7)
    talker = Talker(loaders.get_lm(files, "cuda"), open_step("encoder", files, device="cuda"),
                    loaders.get_tokenizer(files), SLOTS)
    decoder = Code2Wav(open_step("decoder", files, device="cuda"), SLOTS)
    try:
        calls = {}
        for rows in (1, SLOTS):
            for slot in range(rows):
                talker.prefill(slot, TalkerSetup(Persona(voice, ()), SamplingParams(seed=slot)))
                decoder.prefill(slot)
            frames = {s: (0.1 * rng.standard_normal(1920)).astype(np.float32) for s in range(rows)}
            codes = {s: CodesFrame(rng.integers(0, 2048, 8)) for s in range(rows)}
            talker.tick(frames)  # a first tick leaves an encode for the next one to settle
            calls[rows] = (calls_a_tick(lambda: talker.tick(frames)), calls_a_tick(lambda: decoder.tick(codes)))
        assert calls[1] == calls[SLOTS], calls
        assert calls[SLOTS][0] <= 45 and calls[SLOTS][1] <= 20, calls  # 41 and 15 on the H100 at 23ff55e
    finally:
        talker.close()


def test_no_garbage_collection_runs_inside_a_capture_and_one_walks_before_them_all(caplog):
    """A collection that frees a CUDA graph mid-capture invalidates the capture; collecting
    before each of a talker's hundred-odd captures cost a full walk each (collector.paused).
    The load's log says how long the captures took."""
    import gc
    import logging

    from personaplex_triton.core.collector import PauseWatch
    from personaplex_triton.lm.graph_capture import capture_graphs

    inside = []

    def during(phase, info):
        if phase == "start":
            inside.append(torch.cuda.is_current_stream_capturing())

    torch.manual_seed(0)
    gen = SlotGenerator(tiny_moshi_lm("cuda", torch.bfloat16), SLOTS, cuda_graphs=True)
    watch = PauseWatch()
    gc.callbacks.append(during)
    try:
        with caplog.at_level(logging.INFO, logger="personaplex_triton"):
            steps, prefills = capture_graphs(gen), len(gen.prefill)
        full = watch.take().get(2, [])
    finally:
        gc.callbacks.remove(during)
        watch.close()
        gen.close()
    assert steps + prefills >= 10 and inside, (steps, prefills, inside)
    assert not any(inside), "a collection ran inside a capture"
    assert 1 <= len(full) <= 2, f"{len(full)} full collections for {steps + prefills} captures"
    assert f"{steps} step graphs and {prefills} prefill graphs captured in" in caplog.text


def test_a_start_in_pieces_under_cuda_graphs_gives_the_tokens_of_a_start_at_once(files, monkeypatch):
    """A new persona's start in pieces (8-position prefill passes) while another conversation
    ticks between them, its graphed steps padding their batch with slots they do not carry (the
    starting one among them): both give the tokens they give when the start runs at once and
    the same ticks follow it (the same batches, in bf16), greedy."""
    import numpy as np

    from personaplex_triton.core import loaders
    from personaplex_triton.lm import prefill_graphs
    from personaplex_triton.mimi.runtime import open_step
    from personaplex_triton.stages.persona import Persona, VoicePrompt, load_voice
    from personaplex_triton.stages.talker import Talker, TalkerSetup

    voice = VoicePrompt("NATF0-short", frames=load_voice(files.voices / "NATF0.wav").frames[:8])
    frames = (0.1 * np.random.default_rng(7).standard_normal((12, 1920))).astype(np.float32)
    tokenizer = loaders.get_tokenizer(files)
    live = TalkerSetup(Persona(voice, tuple(tokenizer.encode("Talk about cooking."))), SamplingParams(greedy=True))
    new = TalkerSetup(Persona(voice, tuple(tokenizer.encode("Be a wise teacher."))), SamplingParams(greedy=True))
    talker = Talker(loaders.get_lm(files, "cuda"), open_step("encoder", files, device="cuda"), tokenizer, SLOTS)
    monkeypatch.setattr(prefill_graphs, "PREFILL_CHUNK", 8)

    def conversation(interleaved: bool):
        answers = {1: [], 2: []}

        def tick(items):
            for slot, step in talker.tick(items).items():
                answers[slot].append((step.text_token, tuple(map(int, step.codes))))

        talker.prefill(1, live)
        tick({1: frames[0]})
        job, pieces = talker.begin_prefills({2: new}), 0
        while not job.advance():
            pieces += 1
            if interleaved:
                tick({1: frames[len(answers[1])]})
        for _ in range(0 if interleaved else pieces):
            tick({1: frames[len(answers[1])]})
        assert job.failed == {} and pieces >= 2  # the setup piece runs the first pass; at least two more between live ticks
        while len(answers[2]) < len(frames):
            tick({2: frames[len(answers[2])], **({1: frames[len(answers[1])]} if len(answers[1]) < len(frames) else {})})
        talker.stop(1), talker.stop(2)
        return answers

    try:
        assert conversation(interleaved=True) == conversation(interleaved=False)
    finally:
        talker.close()


def test_a_graphed_prefill_leaves_the_slot_as_an_eager_one(files):
    """A new persona's prefill passes under CUDA graphs (prefill_graphs.py: one slot's state and
    its whole ring gathered in the graph, written back) leave its slot's state bit for bit as the
    same passes run eagerly on the slot's row do, in bf16 as served, and both then answer the
    same greedy tokens. (In fp32 two slots of one state, both prefilled eagerly, part after a
    tick on an H100: the tick is not row-invariant there, so the tokens are compared in bf16.)"""
    import numpy as np

    from personaplex_triton.core import loaders
    from personaplex_triton.mimi.runtime import open_step
    from personaplex_triton.stages.persona import Persona, load_voice
    from personaplex_triton.stages.talker import PersonaCache, Talker, TalkerSetup

    tokenizer = loaders.get_tokenizer(files)
    persona = Persona(load_voice(files.voices / "NATF0.wav"),
                      tuple(tokenizer.encode("You are a patient guide who explains each step of a recipe.")))
    frames = (0.1 * np.random.default_rng(9).standard_normal((12, 1920))).astype(np.float32)
    talker = Talker(loaders.get_lm(files, "cuda", torch.bfloat16), open_step("encoder", files, device="cuda"),
                    tokenizer, SLOTS)
    talker.persona_cache = PersonaCache(0)  # each start prefills
    prefill = talker.generator.prefill
    try:
        assert len(prefill) == 64
        assert prefill.lengths(100) == [64, 36]
        setup = TalkerSetup(persona, SamplingParams(greedy=True))
        talker.prefill(1, setup)
        graphed = talker.generator.snapshot(1)
        prefill.clear()  # the same passes, eagerly
        talker.prefill(2, setup)
        eager = talker.generator.snapshot(2)
        graphed, eager = snapshot_tensors(graphed), snapshot_tensors(eager)
        assert graphed.keys() == eager.keys() and "kv" in graphed
        for name, ours in graphed.items():
            theirs = eager[name]
            assert torch.equal(ours, theirs), (name, (ours.float() - theirs.float()).abs().max())
        answers = {1: [], 2: []}
        for frame in frames:
            for slot, step in talker.tick({1: frame, 2: frame}).items():
                answers[slot].append((step.text_token, tuple(map(int, step.codes))))
        assert len(answers[1]) >= 8, "too few answers in the frames played"
        assert answers[1] == answers[2], [(i, a, b) for i, (a, b) in enumerate(zip(answers[1], answers[2])) if a != b]
    finally:
        talker.close()


def _streaming_tensors(lm) -> dict[str, torch.Tensor]:
    """Every tensor of the LM's streaming state (the KV caches' too), live, by name."""
    found = {}
    for name, module in lm.named_modules():
        state = getattr(module, "_streaming_state", None)
        for holder, prefix in ((state, name), (getattr(state, "kv_cache", None), f"{name}.kv_cache")):
            for attr, value in (vars(holder).items() if holder is not None else ()):
                if isinstance(value, torch.Tensor):
                    found[f"{prefix}.{attr}"] = value
    return found


def test_a_starts_graphed_reset_and_embeddings_are_the_eager_ones(lm):
    """A start's model reset and its prefill's embeddings each replay one CUDA graph
    (generation.py, step_graphs.GraphedCall), where eager they are hundreds of launches between
    the live ticks: they leave the streaming state, and give the embeddings, bit for bit as
    moshi's reset and the eager embedding do; a prefill longer than the graph's buffer runs
    eagerly."""
    from personaplex_triton.core import tunables

    gen = SlotGenerator(lm, SLOTS, cuda_graphs=True)
    try:
        for slot in range(SLOTS):
            gen.start(slot, SamplingParams(seed=slot))
        for i in range(6):  # every slot's state moves on
            unforced_step(gen, torch.ones(SLOTS, dtype=torch.bool),
                          torch.randint(0, 2048, (SLOTS, 8), generator=torch.Generator().manual_seed(i)))
        live = _streaming_tensors(lm)
        before = {name: t.clone() for name, t in live.items()}
        gen.reset_model([1, 3])
        graphed = {name: t.clone() for name, t in live.items()}
        for name, t in live.items():
            t.copy_(before[name])
        mask = torch.zeros(SLOTS, dtype=torch.bool, device="cuda")
        mask[[1, 3]] = True
        lm.reset_streaming(mask)
        changed = [name for name in live if not torch.equal(before[name], graphed[name])]
        assert changed, "the reset changed nothing"
        assert all(torch.equal(graphed[name], live[name]) for name in live), \
            [name for name in live if not torch.equal(graphed[name], live[name])]

        for positions in (100, tunables.MAX_PREFILL_POSITIONS, tunables.MAX_PREFILL_POSITIONS + 1):
            tokens = torch.randint(0, 2048, (positions, 17), generator=torch.Generator().manual_seed(positions))
            embedded = gen.embed_prefill(tokens)
            assert embedded.shape == (positions, 1, lm.dim) and torch.equal(embedded, gen.embed(tokens.cuda()))
    finally:
        gen.close()


WAIT_FOR_THE_GPU = """
import sys, time, torch
from personaplex_triton.core import gpu_waits
if sys.argv[1] == "asleep":
    gpu_waits.sleep_while_gpu_works("cuda")
torch.cuda._sleep(1000)  # the context, made
torch.cuda.synchronize()
cpu, wall = time.thread_time(), time.perf_counter()
torch.cuda._sleep(int(1e9))  # a kernel that holds the GPU for about half a second
torch.cuda.synchronize()
print(gpu_waits.waits_asleep("cuda"), (time.thread_time() - cpu) / (time.perf_counter() - wall))
"""


def test_a_thread_that_waits_for_the_gpu_sleeps():
    """With the flag (set before the process's context is made, as the stage builds do) a wait
    costs the host next to nothing; without it, CUDA's default spins the waiting thread."""
    import subprocess
    import sys

    def wait(how: str) -> tuple[bool, float]:
        out = subprocess.run([sys.executable, "-c", WAIT_FOR_THE_GPU, how], capture_output=True, text=True,
                             check=True).stdout.split()
        return out[0] == "True", float(out[1])

    asleep, asleep_cpu = wait("asleep")
    spinning, spinning_cpu = wait("default")
    assert asleep and not spinning
    assert asleep_cpu < 0.2 < spinning_cpu
