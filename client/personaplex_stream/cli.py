"""`personaplex-stream`: talk to PersonaPlex on Triton with a WAV file.

    personaplex-stream --input user.wav --output agent.wav --voice NATF0 \\
        --prompt "You are a helpful customer-service agent." --json

Reads the input at any sample rate / channel count, streams it in 80 ms frames over one
gRPC stream, and writes the agent's audio (24 kHz mono 16-bit, one 1920-sample frame per
input frame) and its transcript.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from . import contract
from .audio import read_wav, write_wav
from .connection import DEFAULT_URL
from .errors import StreamError
from .live import LiveLine
from .report import ConversationResult
from .request import Persona
from .stream import stream_conversation

PROG = "personaplex-stream"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Stream a WAV file to PersonaPlex on Triton Inference Server and save the agent's answer.",
    )
    p.add_argument("--input", "-i", required=True, help="user speech, a WAV file at any rate / channel count")
    p.add_argument("--output", "-o", required=True, help="where to write the agent's audio (24 kHz mono WAV)")
    p.add_argument("--url", default=DEFAULT_URL, help=f"Triton gRPC endpoint (default {DEFAULT_URL})")
    p.add_argument("--model", default=contract.MODEL_NAME, help=f"model name (default {contract.MODEL_NAME})")
    g = p.add_argument_group("persona (sent on the first request only; unset options use the server's defaults)")
    g.add_argument("--voice", help='voice name of the checkpoint, e.g. "NATF0"')
    g.add_argument("--prompt", help="text (role) prompt")
    g.add_argument("--seed", type=int, help="sampling seed")
    g.add_argument("--greedy", action="store_true", default=None, help="argmax decoding instead of sampling")
    g.add_argument("--temperature", type=float, help="audio sampling temperature")
    g.add_argument("--temperature-text", type=float, help="text sampling temperature")
    g.add_argument("--top-k", type=int, help="audio top-k")
    g.add_argument("--top-k-text", type=int, help="text top-k")
    p.add_argument("--realtime", action="store_true", help="send one frame per 80 ms, like a live microphone")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    p.add_argument("--text-output", help="where to write the transcript (default: OUTPUT with suffix .txt)")
    p.add_argument("--sequence-id", type=int, help="Triton sequence id (default: random)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without a response before giving up (default 60)")
    p.add_argument("--max-in-flight", type=int, default=8, help="unanswered frames allowed when not --realtime (default 8)")
    p.add_argument("--no-progress", action="store_true", help="do not show progress on stderr")
    return p


def persona_from_args(args: argparse.Namespace) -> Persona:
    return Persona(
        voice=args.voice,
        text_prompt=args.prompt,
        seed=args.seed,
        greedy=args.greedy,
        temperature=args.temperature,
        temperature_text=args.temperature_text,
        top_k=args.top_k,
        top_k_text=args.top_k_text,
    )


def text_output_path(args: argparse.Namespace) -> Path:
    return Path(args.text_output) if args.text_output else Path(args.output).with_suffix(".txt")


def _fail(msg: str, code: int = 1) -> int:
    print(f"{PROG}: error: {' '.join(str(msg).split())}", file=sys.stderr)
    return code


def _fmt_ms(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.1f} ms"


def _unwritable_output(paths: Sequence[Path]) -> Optional[str]:
    """Why an output cannot be written (its folder is missing or read-only), or None."""
    for path in paths:
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            return f"output directory {str(parent)!r} does not exist"
        if not os.access(parent, os.W_OK):
            return f"output directory {str(parent)!r} is not writable"
    return None


def _stream(args: argparse.Namespace, pcm) -> ConversationResult:
    """The conversation, its progress on stderr unless --no-progress."""
    live = LiveLine(sys.stderr)
    try:
        return stream_conversation(
            pcm,
            url=args.url,
            model_name=args.model,
            persona=persona_from_args(args),
            sequence_id=args.sequence_id,
            realtime=args.realtime,
            max_in_flight=args.max_in_flight,
            response_timeout_s=args.timeout,
            on_frame=None if args.no_progress else live,
        )
    finally:
        live.end()


def _print_report(args: argparse.Namespace, result: ConversationResult, out_path: Path, txt_path: Path) -> None:
    """What was written and the figures; with --json, stdout holds only the JSON summary's line."""
    info = sys.stderr if args.json else sys.stdout
    print(f"wrote {out_path} ({result.frames_received} frames, {result.audio_seconds:.2f} s)", file=info)
    print(f"wrote {txt_path}", file=info)
    print(
        f"real-time factor {result.real_time_factor:.2f}, "
        f"first audio {_fmt_ms(result.first_audio_ms)}, latency p50 {_fmt_ms(result.latency_ms_p50)}, "
        f"p95 {_fmt_ms(result.latency_ms_p95)}",
        file=info,
    )
    if args.json:
        summary = result.summary()
        summary.update({"output": str(out_path), "text_output": str(txt_path), "input": str(args.input)})
        print(json.dumps(summary, ensure_ascii=False))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    out_path = Path(args.output)
    txt_path = text_output_path(args)
    problem = _unwritable_output((out_path, txt_path))  # fail before streaming, not after
    if problem:
        return _fail(problem)
    try:
        pcm = read_wav(args.input, contract.SAMPLE_RATE)
    except ValueError as exc:
        return _fail(exc)
    if pcm.size == 0:
        return _fail(f"input {args.input!r} contains no audio")
    try:
        result = _stream(args, pcm)
    except (StreamError, ValueError) as exc:
        return _fail(exc)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    try:
        write_wav(out_path, result.audio, contract.SAMPLE_RATE)
        txt_path.write_text(result.text + "\n", encoding="utf-8")
    except OSError as exc:
        return _fail(f"cannot write output: {exc}")
    _print_report(args, result, out_path, txt_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
