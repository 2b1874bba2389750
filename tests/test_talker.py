"""The talker library on the generated checkpoint: prefill, alignment, seeds, batching."""

import numpy as np
import pytest
import torch

from conftest import greedy_tokens_of, snapshot_tensors, tiny_moshi_lm, unforced_step
from moshi.modules.transformer import RingKVCache

from personaplex_triton.core import loaders, tunables
from personaplex_triton.lm import kv_cache
from personaplex_triton.lm.generation import SlotGenerator, StepInputs
from personaplex_triton.lm.kv_cache import FilledRingKVCache
from personaplex_triton.lm.sampling import SamplingParams, exponential_noise, sample, uniform
from personaplex_triton.lm.token_grid import NUM_AUDIO
from personaplex_triton.mimi.runtime import open_step
from personaplex_triton.stages.persona import Persona, VoicePrompt, load_voice, system_prompt_tokens, wrap_system_prompt
from personaplex_triton.stages.talker import Talker, TalkerSetup, make_voice_bundle, prefill_program

NUM_SLOTS = 3


@pytest.fixture(scope="session")
def talker(files):
    talker = Talker(loaders.get_lm(files), open_step("encoder", files), loaders.get_tokenizer(files), NUM_SLOTS)
    yield talker
    talker.close()


@pytest.fixture(scope="session")
def wav_voice(files):
    """The first 8 frames of a WAV voice prompt: short prefills keep these tests quick."""
    full = load_voice(files.voices / "NATF0.wav")
    return VoicePrompt("NATF0-short", frames=full.frames[:8])


@pytest.fixture(scope="session")
def user_frames():
    rng = np.random.default_rng(7)
    return (0.1 * rng.standard_normal((12, 1920))).astype(np.float32)


def converse(talker, slot, setup, frames, others=()):
    """Run one conversation on `slot` (while `others`, (slot, setup, frames) each, run beside
    it) and return its agent steps as (text token, codes) tuples."""
    everyone = [(slot, setup, frames), *others]
    for s, st, _ in everyone:
        talker.prefill(s, st)
    answers = {s: [] for s, _, _ in everyone}
    while len(answers[slot]) < len(frames):
        items = {s: f[len(answers[s])] for s, _, f in everyone if len(answers[s]) < len(f)}
        for s, step in talker.tick(items).items():
            answers[s].append((step.text_token, tuple(int(c) for c in step.codes)))
    for s, _, _ in everyone:
        talker.stop(s)
    return answers[slot]


def setup(voice, tokenizer=None, prompt="", **sampling):
    tokens = system_prompt_tokens(tokenizer, prompt) if tokenizer else ()
    return TalkerSetup(Persona(voice, tokens), SamplingParams(**sampling))


def test_the_pool_keeps_code2wavs_memory_free_unless_code2wav_holds_it_in_this_process(talker, monkeypatch):
    """talker.conversations_that_fit, the GPU's free memory given (no GPU here): beside code2wav's
    process, GPU_DECODER_RESERVED_BYTES stay free for it; in one tick, where code2wav was built
    first in the talker's process and holds its largest tick already, none do, and the pool
    stops at code2wav's slots."""
    from personaplex_triton.stages.talker import conversation_bytes, conversations_that_fit

    lm, encoder, kv = talker.lm, talker.mimi.runner, torch.float32
    each = conversation_bytes(lm, encoder, kv)
    prefill = kv_cache.bytes_per_conversation(lm.transformer, kv)
    free = tunables.GPU_RESERVED_BYTES + tunables.GPU_DECODER_RESERVED_BYTES + prefill + 10 * each + each // 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    beside, beside_why = conversations_that_fit(lm, encoder, kv)
    inside, inside_why = conversations_that_fit(lm, encoder, kv, decoder_in_process=True)
    assert beside == 10 and "6 for code2wav's largest tick" in beside_why
    assert inside == min(10 + (tunables.GPU_DECODER_RESERVED_BYTES + each // 2) // each, tunables.GPU_DECODER_SLOTS)
    assert inside > beside and "code2wav's largest tick held in this process" in inside_why


def test_system_prompt_wrapping(talker):
    assert wrap_system_prompt("  Be kind. ") == "<system> Be kind. <system>"
    assert wrap_system_prompt("<system> Be kind. <system>") == "<system> Be kind. <system>"
    assert system_prompt_tokens(talker.tokenizer, "   ") == ()
    tokens = system_prompt_tokens(talker.tokenizer, "Be kind.")
    assert talker.tokenizer.decode(list(tokens)) == "<system> Be kind. <system>"


def test_prefill_order_wav_voice(wav_voice):
    prompt = (101, 102, 103)
    steps = list(prefill_program(Persona(wav_voice, prompt), 2048))
    n, sil = wav_voice.num_frames, loaders.PREFILL_SILENCE_FRAMES
    assert len(steps) == n + sil + len(prompt) + sil
    assert all(s.user == loaders.SINE_TOKENS for s in steps)
    voice, rest = steps[:n], steps[n:]
    assert [s.runs_model for s in voice] == [False] + [True] * (n - 1)  # frame 0 only primes Mimi
    assert all(s.agent is None and s.text == loaders.TEXT_PROMPT_PAD for s in voice)
    assert all(np.array_equal(s.pcm, f) for s, f in zip(voice, wav_voice.frames))
    assert all(s.agent == loaders.SILENCE_TOKENS and s.pcm is None for s in rest)
    assert [s.text for s in rest] == [3] * sil + list(prompt) + [3] * sil


def test_prefill_order_bundle_voice(talker, wav_voice):
    bundle = make_voice_bundle(talker, wav_voice)
    n = wav_voice.num_frames
    assert bundle["embeddings"].shape == (n - 1, 1, 1, talker.lm.dim)
    assert bundle["cache"].shape == (1, 17, talker.generator.grid.ring)
    voice = VoicePrompt("b", embeddings=bundle["embeddings"], cache=bundle["cache"][0])
    steps = list(prefill_program(Persona(voice, ()), 2048))
    assert len(steps) == (n - 1) + 2 * loaders.PREFILL_SILENCE_FRAMES
    replay = steps[:n - 1]
    assert all(s.embedding is not None and s.agent == (2048,) * 8 for s in replay)
    assert [s.restore_cache is not None for s in replay] == [False] * (n - 2) + [True]


def test_first_frame_is_the_prompt_tail(talker, wav_voice, user_frames):
    answer = converse(talker, 0, setup(wav_voice, seed=1), user_frames[:3])
    assert answer[0] == (loaders.TEXT_PROMPT_PAD, loaders.SILENCE_TOKENS)
    assert len(answer) == 3


def test_a_ticks_packed_inputs_are_what_its_step_inputs_pack():
    """A served tick builds its step's one packed tensor in numpy (`tick_inputs`): the same
    tensor as the StepInputs of that tick pack, with the user's codes forced or coming later;
    and unpacking gives each input back."""
    from personaplex_triton.lm.step_inputs import StepInputs, tick_inputs, unpack

    rng = np.random.default_rng(5)
    table, carried = np.array([6, 2, 9, 0]), 3
    active = torch.tensor([True, True, True, False])
    user = rng.integers(0, 2048, (carried, 8))
    none = torch.zeros(4, dtype=torch.bool)
    zeros = torch.zeros(4, 8, dtype=torch.long)
    for codes, later in ((user, False), (None, True)):
        user_codes = zeros.clone()
        if codes is not None:
            user_codes[:carried] = torch.from_numpy(codes)
        inputs = StepInputs(active, user_codes, zeros, none, torch.zeros(4, dtype=torch.long), none,
                            user_later=later, rows=torch.from_numpy(table))
        packed = torch.from_numpy(tick_inputs(table, carried, codes))
        assert torch.equal(packed, inputs.pack())
        rows, stepping, embeds, forced, is_forced = unpack(packed)
        assert rows.tolist() == table.tolist() and torch.equal(stepping, active) and not embeds.any()
        assert torch.equal(forced[:, 9:], user_codes) and bool(is_forced[:, 9:].all()) is not later
        assert not is_forced[:, :9].any()


def test_outputs_are_aligned_for_the_decoder(talker):
    """Tokens forced at one call come back, every stream aligned, at the next call:
    text and cb0 (delay 0) beside cb1..7 (delay 1)."""
    gen = talker.generator
    gen.start(1, SamplingParams(greedy=True))
    rng = np.random.default_rng(3)
    S = NUM_SLOTS
    active = torch.zeros(S, dtype=torch.bool)
    active[1] = True
    forced, outputs = [], []
    for _ in range(8):
        agent = torch.from_numpy(rng.integers(0, 2048, (S, 8)))
        user = torch.from_numpy(rng.integers(0, 2048, (S, 8)))
        text = torch.from_numpy(rng.integers(4, 1000, S))
        forced.append(torch.cat([text[1:2], agent[1], user[1]]))
        tokens, has_output, _ = gen.step(StepInputs(active, user, agent, active.clone(), text, active.clone()))
        outputs.append((tokens[1].clone(), bool(has_output[1])))
    assert [has for _, has in outputs] == [False] + [True] * 7  # delays: first call has none
    for i in range(1, 8):
        assert torch.equal(outputs[i][0], forced[i - 1]), i


def test_seed_reproducible_and_distinct(talker, wav_voice, user_frames):
    a = converse(talker, 0, setup(wav_voice, seed=11), user_frames)
    b = converse(talker, 1, setup(wav_voice, seed=11), user_frames)
    c = converse(talker, 0, setup(wav_voice, seed=12), user_frames)
    assert a == b
    assert a != c


def test_alone_equals_batched(talker, wav_voice, user_frames, files):
    alone = converse(talker, 0, setup(wav_voice, seed=5), user_frames)
    other_voice = VoicePrompt("NATM0-short", frames=load_voice(files.voices / "NATM0.wav").frames[:5])
    noise = np.random.default_rng(9).standard_normal((20, 1920)).astype(np.float32) * 0.2
    others = [(1, setup(other_voice, talker.tokenizer, "Be brief.", seed=6), noise),
              (2, setup(wav_voice, seed=5, greedy=True), noise[::-1].copy())]
    batched = converse(talker, 0, setup(wav_voice, seed=5), user_frames, others=others)
    assert batched == alone


def test_a_tick_carries_any_slots(talker, wav_voice, user_frames, files):
    """A tick's rows are the carried slots, wherever they sit in the pool (a slot table, not
    the first b rows): a conversation in slot 2 gives its tokens alone, and beside slot 0 while
    slot 1's conversation skips every other tick (ticks of slots 0 and 2 only, not consecutive);
    the skipping one gives its own tokens too."""
    other_voice = VoicePrompt("NATM0-short", frames=load_voice(files.voices / "NATM0.wav").frames[:5])
    noise = np.random.default_rng(3).standard_normal((len(user_frames), 1920)).astype(np.float32) * 0.2
    conversations = {2: (setup(wav_voice, seed=5), user_frames), 0: (setup(other_voice, seed=6), noise),
                     1: (setup(wav_voice, seed=2, greedy=True), noise[::-1].copy())}
    alone = {slot: converse(talker, slot, st, frames) for slot, (st, frames) in conversations.items()}
    for slot, (st, _) in conversations.items():
        talker.prefill(slot, st)
    answers = {slot: [] for slot in conversations}
    sent = dict.fromkeys(conversations, 0)
    for tick in range(2 * len(user_frames)):
        items = {slot: frames[sent[slot]] for slot, (_, frames) in conversations.items()
                 if sent[slot] < len(frames) and (slot != 1 or tick % 2)}
        for slot in items:
            sent[slot] += 1
        for slot, step in talker.tick(items).items():
            answers[slot].append((step.text_token, tuple(int(c) for c in step.codes)))
    for slot in conversations:
        talker.stop(slot)
    assert answers == alone


def test_bundle_replay_equals_wav_voice(talker, wav_voice, user_frames):
    bundle = make_voice_bundle(talker, wav_voice)
    replayed = VoicePrompt("b", embeddings=bundle["embeddings"], cache=bundle["cache"][0])
    prompt = "You are a wise and friendly teacher."
    a = converse(talker, 0, setup(wav_voice, talker.tokenizer, prompt, greedy=True), user_frames)
    b = converse(talker, 1, setup(replayed, talker.tokenizer, prompt, greedy=True), user_frames)
    assert a == b


def test_persona_changes_output(talker, wav_voice, user_frames, files):
    base = converse(talker, 0, setup(wav_voice, talker.tokenizer, "Be kind.", greedy=True), user_frames)
    prompt = converse(talker, 0, setup(wav_voice, talker.tokenizer, "Talk about cooking.", greedy=True),
                      user_frames)
    other_voice = VoicePrompt("NATM0-short", frames=load_voice(files.voices / "NATM0.wav").frames[:8])
    voice = converse(talker, 0, setup(other_voice, talker.tokenizer,
                                      "Be kind.", greedy=True), user_frames)
    assert base != prompt and base != voice


def test_user_audio_changes_output(talker, wav_voice, user_frames):
    a = converse(talker, 0, setup(wav_voice, greedy=True), user_frames)
    b = converse(talker, 0, setup(wav_voice, greedy=True), user_frames * 0.3)
    assert a[0] == b[0]  # the prompt's tail
    assert a[1:] != b[1:]


@pytest.mark.parametrize("params, message", [
    (dict(temperature=0.0), r"TEMPERATURE must lie in \(0, 10\]"),
    (dict(top_k=0), r"TOP_K must lie in \[1, 500\], got 0"),
    (dict(top_k=5000), r"TOP_K must lie in \[1, 500\], got 5000"),
])
def test_invalid_sampling_rejected(talker, wav_voice, params, message):
    with pytest.raises(ValueError, match=message):
        talker.prefill(0, setup(wav_voice, **params))


def test_cached_persona_starts_at_once_with_the_same_output(talker, wav_voice, user_frames):
    from personaplex_triton.stages.talker import PersonaCache

    prompt = "You are a wise and friendly teacher."
    fresh = converse(talker, 0, setup(wav_voice, talker.tokenizer, prompt, seed=21), user_frames)
    fresh_other_seed = converse(talker, 0, setup(wav_voice, talker.tokenizer, prompt, seed=22), user_frames)
    talker.persona_cache = PersonaCache(2)
    try:
        first = converse(talker, 1, setup(wav_voice, talker.tokenizer, prompt, seed=21), user_frames)
        assert len(talker.persona_cache) == 1 and talker.persona_cache.hits == 0
        # slot 1 again, as `first` left it: the cached state is put in place of all of it, unreset
        cached = converse(talker, 1, setup(wav_voice, talker.tokenizer, prompt, seed=22), user_frames)
        assert talker.persona_cache.hits == 1  # no prefill: the cached state was put in place
        assert first == fresh
        assert cached == fresh_other_seed
        for prompt_ in ("Be brief.", "Talk about cooking."):  # capacity 2: the oldest goes
            converse(talker, 0, setup(wav_voice, talker.tokenizer, prompt_, seed=1), user_frames[:1])
        assert len(talker.persona_cache) == 2
        assert setup(wav_voice, talker.tokenizer, prompt).persona.key not in talker.persona_cache
    finally:
        talker.persona_cache = PersonaCache(0)


def test_starting_together_equals_starting_one_by_one(talker, wav_voice, user_frames):
    """Conversations started in one call (one reset for all; a cached persona copied in, a new
    one prefilled in its first slot and copied into the next) answer as each does alone; a
    bad setup among them fails alone."""
    from personaplex_triton.stages.talker import PersonaCache

    def a(**sampling):
        return setup(wav_voice, talker.tokenizer, "You are a wise and friendly teacher.", **sampling)

    def b(**sampling):
        return setup(wav_voice, talker.tokenizer, "Talk about cooking.", **sampling)

    together = {0: a(seed=5), 1: b(seed=6), 2: b(seed=7)}
    alone = {slot: converse(talker, 0, st, user_frames) for slot, st in together.items()}
    talker.persona_cache = PersonaCache(2)
    try:
        converse(talker, 0, a(seed=1), user_frames[:1])  # persona a is cached, b is new
        assert talker.prefill_many(together) == {}
        assert talker.persona_cache.hits == 1 and b().persona.key in talker.persona_cache
        answers = {slot: [] for slot in together}
        for frame in user_frames:
            for slot, step in talker.tick({slot: frame for slot in together}).items():
                answers[slot].append((step.text_token, tuple(int(c) for c in step.codes)))
        assert answers == alone
        failed = talker.prefill_many({0: a(seed=5), 1: b(temperature=0.0)})
        assert list(failed) == [1] and "TEMPERATURE" in str(failed[1])
        assert [talker.tick({0: frame})[0].text_token for frame in user_frames] == [t for t, _ in alone[0]]
    finally:
        for slot in together:
            talker.stop(slot)
        talker.persona_cache = PersonaCache(0)



def steps_of(answers: dict, slot: int) -> list:
    return [(step.text_token, tuple(int(c) for c in step.codes)) for step in answers[slot]]


def test_a_prefill_in_chunks_beside_a_ticking_conversation_answers_as_each_alone(talker, wav_voice, user_frames,
                                                                                 monkeypatch):
    """A new persona's prefill in chunks (a transformer pass each, here of 8 positions), with
    another conversation ticking between the chunks: both answer exactly as each does alone."""
    from personaplex_triton.lm import prefill_graphs

    live = setup(wav_voice, talker.tokenizer, "Talk about cooking.", seed=3)
    new = setup(wav_voice, talker.tokenizer, "You are a wise and friendly teacher.", seed=4)
    alone_live, alone_new = converse(talker, 0, live, user_frames), converse(talker, 0, new, user_frames)
    monkeypatch.setattr(prefill_graphs, "PREFILL_CHUNK", 8)
    answers = {1: [], 2: []}
    talker.prefill(1, live)
    try:
        for frame in user_frames[:2]:
            answers[1] += [talker.tick({1: frame})[1]]
        job, chunks = talker.begin_prefills({2: new}), 0
        while not job.advance():
            chunks += 1
            answers[1] += [talker.tick({1: user_frames[len(answers[1])]})[1]]
        assert job.failed == {} and chunks >= 3
        while len(answers[2]) < len(user_frames):
            items = {2: user_frames[len(answers[2])]}
            if len(answers[1]) < len(user_frames):
                items[1] = user_frames[len(answers[1])]
            for slot, step in talker.tick(items).items():
                answers[slot].append(step)
        assert steps_of(answers, 1) == alone_live
        assert steps_of(answers, 2) == alone_new
    finally:
        talker.stop(1), talker.stop(2)


def test_a_start_waits_for_another_starts_prefill_of_its_persona(talker, wav_voice, user_frames, monkeypatch):
    """Two starts of one new persona begun apart (two passes of the engine): the second does
    not prefill it again but waits, then takes it from the cache; both answer as alone."""
    from personaplex_triton.lm import prefill_graphs
    from personaplex_triton.stages.talker import PersonaCache

    persona = "You are a wise and friendly teacher."
    alone = {slot: converse(talker, 0, setup(wav_voice, talker.tokenizer, persona, seed=slot), user_frames)
             for slot in (1, 2)}
    monkeypatch.setattr(prefill_graphs, "PREFILL_CHUNK", 8)
    talker.persona_cache = PersonaCache(2)
    try:
        first = talker.begin_prefills({1: setup(wav_voice, talker.tokenizer, persona, seed=1)})
        assert not first.advance()  # its prefill under way
        second = talker.begin_prefills({2: setup(wav_voice, talker.tokenizer, persona, seed=2)})
        done = {}
        while len(done) < 2:
            for name, job in (("first", first), ("second", second)):
                if name not in done and job.advance():
                    done[name] = job.failed
        assert done == {"first": {}, "second": {}}
        assert len(talker.persona_cache) == 1 and talker.persona_cache.hits == 1
        answers = {1: [], 2: []}
        for frame in user_frames:
            for slot, step in talker.tick({1: frame, 2: frame}).items():
                answers[slot].append(step)
        assert {slot: steps_of(answers, slot) for slot in (1, 2)} == alone
        talker.stop(1), talker.stop(2)
        # a prefill at once (nothing ticks until it is done) never waits for a chunked prefill: it
        # prefills a persona the other is prefilling again
        talker.persona_cache = PersonaCache(2)
        other = setup(wav_voice, talker.tokenizer, "Talk about cooking.", seed=1)
        paused = talker.begin_prefills({1: other})
        assert not paused.advance()
        assert talker.prefill_many({2: setup(wav_voice, talker.tokenizer, "Talk about cooking.", seed=2)}) == {}
        while not paused.advance():
            pass
        assert paused.failed == {} and talker.persona_cache.hits == 0
    finally:
        talker.stop(1), talker.stop(2)
        talker.persona_cache = PersonaCache(0)

def prefill_step_by_step(talker, slot, persona):
    """The reference prefill (the talker's path before batched prefill): one full model step per
    prefill step, depformer and sampling included, every stream forced."""
    talker.mimi.reset([slot])
    for step in prefill_program(persona, talker.lm.initial_token_id):
        agent = step.agent if step.pcm is None else talker.mimi.encode({slot: step.pcm})[slot]
        rows = slot + 1  # a batch bucket as long as slot + 1 is one (slots 0, 1 and 3 here)
        active = torch.zeros(rows, dtype=torch.bool)
        active[slot] = step.runs_model
        user, agent_codes = torch.zeros(rows, 8, dtype=torch.long), torch.zeros(rows, 8, dtype=torch.long)
        user[slot], agent_codes[slot] = torch.tensor(step.user), torch.as_tensor(agent)
        text = torch.zeros(rows, dtype=torch.long)
        text[slot] = step.text
        forced = torch.ones(rows, dtype=torch.bool)
        embeddings = embed_rows = None
        if step.embedding is not None:
            embeddings = torch.zeros(rows, 1, talker.lm.dim)
            embeddings[slot] = step.embedding
            embed_rows = active.clone()
        talker.generator.step(StepInputs(active, user, agent_codes, forced, text, forced, embeddings, embed_rows))
        if step.restore_cache is not None:
            talker.generator.grid.cache[slot] = step.restore_cache
    talker.mimi.reset([slot])


@pytest.mark.parametrize("voice_kind", ["wav", "bundle"])
def test_batched_prefill_equals_step_by_step(talker, wav_voice, user_frames, voice_kind):
    """Batched prefill (one chunked transformer pass, no depformer) leaves the slot as the
    step-by-step prefill does (fp32), so the conversation's tokens are the same."""
    voice = wav_voice
    if voice_kind == "bundle":
        bundle = make_voice_bundle(talker, wav_voice)
        voice = VoicePrompt("b", embeddings=bundle["embeddings"], cache=bundle["cache"][0])
    persona = setup(voice, talker.tokenizer, "You are a wise and friendly teacher.", seed=5).persona
    talker.prefill(0, setup(voice, talker.tokenizer, "You are a wise and friendly teacher.", seed=5))
    batched = talker.generator.snapshot(0)
    talker.generator.start(1, SamplingParams(seed=5))
    prefill_step_by_step(talker, 1, persona)
    stepped = talker.generator.snapshot(1)
    batched, stepped = snapshot_tensors(batched), snapshot_tensors(stepped)
    assert batched.keys() == stepped.keys() and "kv" in batched
    for name, value in batched.items():
        torch.testing.assert_close(value, stepped[name], atol=1e-4, rtol=1e-4)
    # the same conversation after either prefill
    answers = {0: [], 1: []}
    for frame in user_frames:
        out = talker.tick({0: frame, 1: frame})
        for s in answers:
            answers[s].append((out[s].text_token, tuple(int(c) for c in out[s].codes)))
    assert answers[0] == answers[1]
    talker.stop(0)
    talker.stop(1)


def test_a_snapshot_from_the_hosts_length_restores_into_several_slots_at_once(talker, wav_voice, user_frames):
    """A start's snapshot into the persona cache takes the prefill's length from the host (read
    back, it would wait for the passes queued on a GPU): it is the snapshot that reads the
    length back. Restored into two slots in one call, each holds it, entry for entry, and the
    third slot keeps its own."""
    from personaplex_triton.stages.talker import PersonaCache

    persona_setup = setup(wav_voice, talker.tokenizer, "You are a careful pilot.", seed=3)
    talker.prefill(2, setup(wav_voice, seed=4))
    talker.tick({2: user_frames[0]})
    talker.settle()  # the tick's user codes written
    kept = snapshot_tensors(talker.generator.snapshot(2))
    talker.persona_cache = PersonaCache(1)
    try:
        talker.prefill(0, persona_setup)
        cached = snapshot_tensors(talker.persona_cache.get(persona_setup.persona.key))
        read_back = snapshot_tensors(talker.generator.snapshot(0))
        assert cached.keys() == read_back.keys() and "kv" in cached
        for name, value in read_back.items():
            assert torch.equal(value, cached[name]), name
        talker.generator.restore([1, 0], talker.persona_cache.get(persona_setup.persona.key))
        for slot in (0, 1):
            for name, value in snapshot_tensors(talker.generator.snapshot(slot)).items():
                assert torch.equal(value, cached[name]), (slot, name)
        for name, value in snapshot_tensors(talker.generator.snapshot(2)).items():
            assert torch.equal(value, kept[name]), name
    finally:
        talker.persona_cache = PersonaCache(0)
        for slot in range(NUM_SLOTS):
            talker.stop(slot)


def test_the_largest_top_k_is_kept_on_the_host_as_the_tensors_hold_it():
    """The step's graphs are keyed by the largest top-k's bucket; the host keeps it (a start
    need not wait for the GPU to learn it), equal to the tensors' largest after any settings,
    a slot's old one counting until it is set again; `at` carries the tensors only."""
    from personaplex_triton.lm.sampling import SlotSampling

    sampling = SlotSampling(4, "cpu")
    for slot, top_k, top_k_text in ((2, 250, 25), (1, 40, 100), (2, 5, 3)):
        sampling.set(slot, SamplingParams(top_k=top_k, top_k_text=top_k_text))
        assert sampling.largest_top_k() == (int(sampling.top_k.max()), int(sampling.top_k_text.max()))
    assert sampling.largest_top_k() == (40, 100)
    carried = sampling.at(torch.tensor([1, 2]))
    assert carried.top_k.tolist() == [40, 5] and not hasattr(carried, "_host_top_k")


def test_sampling_noise_is_the_per_channel_hash():
    """The noise of all 17 channels of a step, drawn at once, holds the draws each sampling call
    made for itself before (recorded from that code: (seed, step, channel, column) hashes), and
    a draw depends on neither the number of columns nor of channels computed."""
    seed, step = torch.tensor([0, 7, 2**40 + 3]), torch.tensor([1, 5, 9])
    recorded = {0: [[1461123477, 3144699569, 4044968883], [2408606927, 3357163072, 1639439167],
                    [1735736726, 1924257447, 664214899]],
                16: [[320986070, 3887548909, 3097972219], [3381589791, 2309931406, 969301220],
                     [1609779643, 695499469, 2005300739]]}
    drawn = uniform(seed, step, 17, 500)
    for channel, hashes in recorded.items():
        assert torch.equal(drawn[:, channel, :3], (torch.tensor(hashes, dtype=torch.float64) + 0.5) / 2.0**32)
    assert torch.equal(uniform(seed, step, 4, 25), drawn[:, :4, :25])
    assert torch.equal(exponential_noise(seed, step, 17, 500), -torch.log(drawn).float())


def moshi_depformer(generator):
    """The depformer as the generator ran it before its streaming bookkeeping was written out:
    moshi's `LMModel.forward_depformer`, one codebook a call, in a fresh `depformer.streaming`."""
    lm = generator.lm

    def depformer(transformer_out, first_input, forced, forced_mask, noise, smp, top_k_bound):
        tokens, prev = [], first_input
        with lm.depformer.streaming(first_input.shape[0]):
            for cb in range(lm.dep_q):
                logits = lm.forward_depformer(cb, prev[:, None, None], transformer_out)[:, 0, 0]
                if cb < NUM_AUDIO:
                    tokens.append(sample(logits, smp.greedy, smp.temperature, smp.top_k, noise[:, cb],
                                         top_k_bound))
                else:  # the user's codebooks: their samples give way to the user's codes
                    tokens.append(logits.argmax(dim=-1))
                prev = torch.where(forced_mask[:, cb], forced[:, cb], tokens[-1])
        return torch.stack(tokens, dim=1)

    return depformer


def test_depformer_equals_moshis(talker, wav_voice, user_frames, monkeypatch):
    """The depformer with its bookkeeping written out gives moshi's tokens: greedy and sampled,
    beside another conversation, whose forced-free rows differ."""
    noise = np.random.default_rng(4).standard_normal((len(user_frames), 1920)).astype(np.float32) * 0.2

    def conversations():
        return [converse(talker, 0, setup(wav_voice, **params), user_frames,
                         others=[(1, setup(wav_voice, seed=3), noise)])
                for params in (dict(greedy=True), dict(seed=8))]

    ours = conversations()
    monkeypatch.setattr(talker.generator.model_step, "depformer", moshi_depformer(talker.generator))
    assert conversations() == ours


def test_encode_after_the_answer_gives_the_same_tokens(files, talker, wav_voice, user_frames):
    """A talker that Mimi-encodes each tick's frames after answering (the CPU default) gives the
    tokens and token grid of one that encodes them first: greedy and sampled, two conversations,
    the second joining mid-way (its start settles the first's pending codes)."""
    assert talker._encoder is not None  # the CPU default
    in_tick = Talker(loaders.get_lm(files), open_step("encoder", files), talker.tokenizer, NUM_SLOTS,
                     encode_after=False)
    try:
        for params in (dict(greedy=True), dict(seed=8)):
            runs = []
            for t in (talker, in_tick):
                late = setup(wav_voice, seed=3)
                t.prefill(0, setup(wav_voice, **params))
                answers = []
                for i, frame in enumerate(user_frames):
                    if i == 4:
                        t.prefill(2, late)
                    out = t.tick({0: frame, **({2: frame[::-1].copy()} if i >= 4 else {})})
                    answers.append([(s, step.text_token, tuple(map(int, step.codes))) for s, step in sorted(out.items())])
                t.settle()  # the last frame's codes into the grid
                runs.append((answers, t.generator.grid.cache[[0, 2]].clone(), t.generator.grid.provided[[0, 2]].clone()))
                t.stop(0)
                t.stop(2)
            (ours, cache, provided), (theirs, cache_in_tick, provided_in_tick) = runs
            assert ours == theirs and len(ours) == len(user_frames)
            assert torch.equal(cache, cache_in_tick) and torch.equal(provided, provided_in_tick)
    finally:
        in_tick.close()


def test_a_tick_waits_only_for_its_own_slots_codes(talker, wav_voice, user_frames, monkeypatch):
    """Conversations whose frames come at different moments tick apart: a tick waits for the
    encodes of its own slots' earlier frames, not for another conversation's still running."""
    import threading

    for slot in (0, 1):
        talker.prefill(slot, setup(wav_voice, seed=slot))
    talker.tick({0: user_frames[0], 1: user_frames[0]})
    release, answered = threading.Event(), threading.Event()
    encode = talker.mimi.encode_rows
    monkeypatch.setattr(talker.mimi, "encode_rows", lambda frames: release.wait(60) and encode(frames))
    talker.tick({1: user_frames[1]})  # slot 1's encode now holds until released
    ticking = threading.Thread(target=lambda: talker.tick({0: user_frames[1]}) is not None and answered.set())
    ticking.start()
    try:
        assert answered.wait(30), "slot 0's tick waited for slot 1's encode"
    finally:
        release.set()
        ticking.join()
    talker.settle()
    assert not talker._unencoded
    for slot in (0, 1):
        talker.stop(slot)


def test_a_failed_background_encode_ends_only_its_conversations(talker, wav_voice, user_frames, monkeypatch):
    """An encode after the answer that fails leaves its frames without user codes: the next tick
    names each of those slots (SlotFault, one at a time, as the engine ends them), not the
    conversations beside them, and does not step them on a grid with a hole."""
    from personaplex_triton.core.errors import SlotFault

    for slot in (0, 1, 2):
        talker.prefill(slot, setup(wav_voice, seed=slot))
    encode = talker.mimi.encode_rows
    monkeypatch.setattr(talker.mimi, "encode_rows", lambda frames: (_ for _ in ()).throw(RuntimeError("no codes")))
    talker.tick({0: user_frames[0], 1: user_frames[0]})  # answered; its encode fails behind it
    monkeypatch.setattr(talker.mimi, "encode_rows", encode)
    batch, failed = {0: user_frames[1], 1: user_frames[1], 2: user_frames[1]}, []
    for _ in range(3):  # what the engine does: end the conversation named, step the rest again
        try:
            talker.tick(batch)
            break
        except SlotFault as fault:
            assert "no codes" in str(fault)
            failed.append(fault.slot)
            batch.pop(fault.slot)
            talker.stop(fault.slot)
    assert sorted(failed) == [0, 1] and list(batch) == [2]  # slot 2 stepped on
    for slot in (0, 1, 2):
        talker.stop(slot)


def test_the_encode_after_the_answer_yields_the_cpu(talker, wav_voice, user_frames):
    """On a CPU the background encode runs at nice 19, the thread that ticks does not: the
    decode and the next tick get the cores first."""
    import os
    import threading

    talker.prefill(0, setup(wav_voice))
    talker.tick({0: user_frames[0]})
    talker.settle()
    talker.stop(0)
    encoders = [t for t in threading.enumerate() if t.name.startswith("talker-encode")]
    assert encoders and all(os.getpriority(os.PRIO_PROCESS, t.native_id) == 19 for t in encoders)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19


def test_filled_ring_gives_moshis_tokens():
    """On a CPU the step's attention reads the ring only up to the last entry written
    (FilledRingKVCache). Greedy, fp32, a 24-frame context so the ring wraps, slots idling and
    joining late: the same tokens as moshi's attention over the whole ring (the reference)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(tunables.TORCH_THREADS)  # as served; two threads crawl on a busy 2-core host
    try:
        lm = tiny_moshi_lm("cpu", torch.float32, context=24)
        filled, moshi = greedy_tokens(lm, ring=True), greedy_tokens(lm, ring=False)
    finally:
        torch.set_num_threads(threads)
    assert sum(map(len, filled)) > 120
    assert filled == moshi


def greedy_tokens(lm, ring: bool) -> list:
    """60 greedy steps of 4 slots on `lm`, two of them idling or joining late."""
    gen = SlotGenerator(lm, 4, cuda_graphs=False, ring=ring)
    caches = {type(a._streaming_state.kv_cache) for a in kv_cache.self_attentions(lm.transformer)}
    assert caches == {FilledRingKVCache if ring else RingKVCache}
    try:
        for slot in range(4):
            gen.start(slot, SamplingParams(greedy=True))
        return greedy_tokens_of(gen, lambda i: [True, i % 3 != 0, i > 8, i > 30], 60)
    finally:
        gen.close()


def compact_greedy_tokens(lm, schedule, steps: int = 200) -> list:
    """The greedy tokens of the conversation in slot 5 of an 8-slot pool over `steps` compact
    steps; `schedule(i)` gives the other slots that step i carries beside it (a slot first
    carried is a conversation joining; one no longer carried has left, its slot restarted
    before it is carried again). Each conversation's user codes depend only on its own steps."""
    gen = SlotGenerator(lm, 8, cuda_graphs=False)
    try:
        gen.start(5, SamplingParams(greedy=True))
        started, out = {5}, []
        taken = dict.fromkeys(range(8), 0)
        for i in range(steps):
            others = schedule(i)
            for slot in set(started) - {5} - set(others):  # it left: the slot starts over when next carried
                started.discard(slot)
            for slot in others:
                if slot not in started:
                    gen.start(slot, SamplingParams(greedy=True, seed=slot))
                    started.add(slot)
            rows = [5, *sorted(others)]
            user = torch.stack([torch.randint(0, 2048, (8,), generator=torch.Generator().manual_seed(
                1000 * slot + taken[slot])) for slot in rows])
            for slot in rows:
                taken[slot] += 1
            tokens, has_output = unforced_step(gen, torch.ones(len(rows), dtype=torch.bool), user, torch.tensor(rows))
            if has_output[0]:
                out.append(tokens[0].tolist())
        return out
    finally:
        gen.close()


def test_compact_greedy_tokens_alone_and_beside_conversations_that_join_skip_and_leave():
    """Fidelity of the compact engine (a CPU version of the H200's fp32 check): over 200 greedy
    steps, a conversation gives the same tokens alone as carried in ticks with others that join
    late, skip ticks (some ticks carry slots apart in the pool, some consecutive ones) and leave.
    A 128-frame context: the rings wrap."""
    torch.manual_seed(0)
    lm = tiny_moshi_lm("cpu", torch.float32, context=128)

    def busy(i):
        return [slot for slot, carried in ((0, i >= 20), (2, i % 3 != 0), (3, True), (4, i % 5 == 1),
                                           (6, 40 <= i < 120 or i >= 150), (7, i < 100)) if carried]

    alone = compact_greedy_tokens(lm, lambda i: [])
    assert len(alone) > 190
    assert compact_greedy_tokens(lm, busy) == alone


def test_a_prefill_runs_in_passes_of_prefill_chunk_and_the_rest_in_one(talker):
    """A prefill's passes are PREFILL_CHUNK positions each and the rest in one, graphed (a graph
    for each length, captured at load) or eager (here, the CPU) alike."""
    from personaplex_triton.lm.prefill_graphs import all_pass_lengths, pass_lengths

    assert all_pass_lengths() == list(range(64, 0, -1))
    for positions in range(300):
        lengths = pass_lengths(positions)
        assert sum(lengths) == positions and set(lengths) <= set(all_pass_lengths())
        assert len(lengths) == -(-positions // 64)
    assert pass_lengths(167) == [64, 64, 39]
    assert talker.generator.prefill.lengths(230) == [64, 64, 64, 38]
    assert len(talker.generator.prefill) == 0  # no CUDA here: no graph


def test_a_loaded_voice_crosses_to_another_process_by_its_file(files):
    """A persona's voice loaded from the checkpoint pickles as its file (a start crossing to the
    talker's process, which loaded the same voices): here it comes back as the same object, in a
    process that loaded nothing it is loaded from the file, equal; a voice made in memory
    crosses by value."""
    import pickle
    import subprocess
    import sys

    voice = load_voice(files.voices / "NATM0.wav")
    data = pickle.dumps(Persona(voice, (5, 6)), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(data) < 1000 < voice.frames.nbytes
    assert pickle.loads(data).voice is voice
    child = subprocess.run([sys.executable, "-c", "import pickle, sys; p = pickle.load(sys.stdin.buffer); "
                            "sys.stdout.buffer.write(pickle.dumps((p.voice.name, p.voice.frames, p.text_tokens)))"],
                           input=data, capture_output=True, check=True)
    name, frames, tokens = pickle.loads(child.stdout)
    assert name == "NATM0.wav" and tokens == (5, 6) and np.array_equal(frames, voice.frames)
    made = VoicePrompt("short", frames=voice.frames[:4])
    again = pickle.loads(pickle.dumps(made))
    assert again is not made and again.source is None and np.array_equal(again.frames, made.frames)
