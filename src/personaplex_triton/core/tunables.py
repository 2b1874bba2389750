"""Serving tunables: pool sizes, memory held back, scheduling, threads and the limits on what a
request may ask. The model's own hyperparameters and token ids are loaders.py's. Where a value
was chosen by measurement, docs/decisions.md has the runs."""

from __future__ import annotations

from .loaders import PREFILL_SILENCE_FRAMES, TOP_K, TOP_K_TEXT

# Conversation slots per stage when max_conversations is "auto". On a GPU the talker takes what
# fits in free memory beside GPU_RESERVED_BYTES (its graphs, persona cache, prefill) and
# GPU_DECODER_RESERVED_BYTES (code2wav's process at its largest tick: its pool's state and a
# tick of every slot, which it takes at load; the talker reserves it whether or not code2wav's
# process has loaded first, and not in one tick, where code2wav, built first in the talker's
# process, already holds it), at most the decoder's slots; the decoder keeps more slots than
# the talker can fill, since a conversation that ends without FINAL holds its decoder slot until
# replaced.
CPU_TALKER_SLOTS = 4
CPU_DECODER_SLOTS = 8
GPU_DECODER_SLOTS = 192
GPU_RESERVED_BYTES = 8 << 30
GPU_DECODER_RESERVED_BYTES = 6 << 30

# The engines' schedulers (engine/scheduler.py). Code2wav's frames come one response at a time
# from a talker tick's answers: its tick waits for all of a talker tick's frames, at most this
# long after the first. On a GPU the talker refuses a newcomer when its measured tick model says
# the live conversations and it would settle at ticks longer than GPU_ADMISSION_TICK_S: a frame
# waits up to a tick and is answered at the end of the next, and code2wav and Triton take their
# share of the 80 ms.
CODE2WAV_GATHER_MAX_S = 0.025
GPU_ADMISSION_TICK_S = 0.032
# And while the live conversations' answers of the last 2 s have a p99 over this: what the tick
# model does not see (a slow or noisy host's sends and request threads) made them near late.
GPU_ADMISSION_LATENCY_S = 0.065
# Ticks between two chunks of a talker's prefill while live frames wait (engine/scheduler.py:
# with one, the tick between two chunks is a catch-up tick, and the frames that come during it
# wait for it, a chunk and the next).
PREFILL_CHUNK_SPACING_TICKS = 2
# A tick's thread gives up the GIL while it waits for the GPU; the stub's send and request
# threads take it, and Python makes a thread that wants it back wait up to the switch interval
# (5 ms by default) for the holder to let go, at each of the tick's waits.
GPU_GIL_SWITCH_S = 0.0005
# Send threads (outbox lanes) of a stage whose ticks run in a process of their own. Each send is
# a round trip to tritonserver that waits with the GIL released, so a lane's rate is set by the
# wake-ups of two processes, which a busy or virtualised host slows; several lanes overlap the
# round trips. In the stub they would cost the tick its GIL; with the tick in its own process,
# only the stub's threads share it.
STAGE_PROCESS_SEND_THREADS = 4

# PyTorch's intra-op threads of a stage's process: 1. On a CPU the LM's ops are small, and an
# OpenMP team whose cores are shared (the other stage's process, Triton, anything else) waits for
# its slowest thread at every op. On a GPU the process's own CPU ops are a tick's host copies, too
# small to share out, and a team woken for one spins a while before it sleeps: cores taken from
# the stub and tritonserver beside it. ONNX Runtime's Mimi decoder (CPU) takes every core the
# process may run on (`os.sched_getaffinity`), its idle threads sleeping rather than spinning.
TORCH_THREADS = 1
# The talker's Mimi encoder on ONNX Runtime computes on its own low-priority thread (Talker's
# encode_after), one core: it has a whole frame to finish, and it must not take the cores the
# decoder and the next tick need at once.
CPU_ENCODER_THREADS = 1

# Top-k, audio and text: the largest accepted.
MAX_TOP_K = 500
# Sampling reads the top-k candidates of a fixed bound per step, the smallest of these buckets
# that holds every live conversation's top-k: a fixed set of shapes (CUDA graphs), whatever
# clients ask.
TOP_K_BUCKETS = (TOP_K, MAX_TOP_K)
TOP_K_TEXT_BUCKETS = (TOP_K_TEXT, MAX_TOP_K)

# Limits on what one request may ask of the server (docs/reliability.md); each bounds the work,
# memory or compiled state a client can cause.
MAX_ROLE_PROMPT_CHARS = 4000   # checked before tokenizing
MAX_ROLE_PROMPT_TOKENS = 256   # one prefill step per token; PersonaPlex's prompts take a few dozen
MAX_VOICE_PROMPT_FRAMES = 250  # 20 s, one prefill step per frame
# The longest prefill: voice prompt, silence, role prompt, silence (stages/talker.py's prefill_program).
MAX_PREFILL_POSITIONS = MAX_VOICE_PROMPT_FRAMES + MAX_ROLE_PROMPT_TOKENS + 2 * PREFILL_SILENCE_FRAMES
MAX_FRAMES_PER_REQUEST = 125   # 10 s of audio in one request
MAX_TEMPERATURE = 10.0
