"""``kvgate-sim`` command line: run the vLLM-compatible simulator until SIGTERM/SIGINT.

``--profile`` takes a built-in step-time profile or a JSON engine profile file
(:mod:`kvgate_bench.sim.profile_file`): the file sets the step-time model and the engine's
shape (KV pool, block size, max_model_len, max_num_seqs, the step's token budget), and a flag
among ``--kv-capacity-tokens``, ``--block-size``, ``--max-model-len``, ``--max-num-seqs`` and
``--max-num-batched-tokens`` given as well overrides the file's value. A missing or invalid
file exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvgate_bench.sim.config import SimConfig
from kvgate_bench.sim.lengths import OUTPUT_LENGTH_MODES
from kvgate_bench.sim.profile_file import load_profile
from kvgate_bench.sim.server import start_sim
from kvgate_bench.sim.steptime import PROFILE_NAMES


def build_parser() -> argparse.ArgumentParser:
    """Argument parser; sizes in tokens, latencies in ms / us as named."""
    p = argparse.ArgumentParser(
        prog="kvgate-sim", description="vLLM-compatible model server simulator for kvgate."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--model", default="kvgate-sim-model", help="served model name")
    p.add_argument("--extra-models", default="", help="comma-separated extra accepted model names")
    p.add_argument(
        "--profile",
        default="constant",
        help=f"step-time model: a built-in name ({', '.join(PROFILE_NAMES)}): constant "
        "(--decode-ms + --prefill-us-per-token, whole-prompt prefill) or a realistic a + "
        "b*prefill + c*decodes + d*context profile with chunked prefill; or a JSON engine "
        "profile file (examples/profiles/): its step times, and its engine shape (KV pool, "
        "block size, max model length, sequences, step token budget) wherever the matching "
        "flag below is not given (default: constant)",
    )
    p.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=None,
        help="KV pool size, tokens (default: the profile's or profile file's; constant: 65536)",
    )
    p.add_argument(
        "--block-size", type=int, help="tokens per KV block (default: a profile file's, else 16)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="max prompt+completion tokens (default: a profile file's, else 8192)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        help="max running requests (default: a profile file's, else 256)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step: prefill tokens for constant (default max(8192, "
        "max-model-len)), every scheduled token for chunked profiles (default: a profile "
        "file's prefill_chunk_tokens, else 8192)",
    )
    p.add_argument(
        "--decode-ms", type=float, default=10.0, help="constant profile: iteration time, ms"
    )
    p.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=20.0,
        help="constant profile: prefill cost per token, us",
    )
    p.add_argument(
        "--output-lengths",
        choices=OUTPUT_LENGTH_MODES,
        default="max",
        help="true output length of requests without an x-sim-output-tokens header: max "
        "(run to max_tokens) or lognormal (seeded draw, mu 5.02 sigma 0.86; default: max)",
    )
    p.add_argument(
        "--output-seed", type=int, default=0, help="seed of the lognormal output lengths"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="real seconds per modelled second: steps last this many times their modelled "
        "duration (> 1 runs slower than the modelled GPU, for load generators on small "
        "machines; default 1)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="reuse the KV blocks of prompts' leading tokens already cached, as vLLM does "
        "(default off: load generators' prompts of one repeated token would all share them)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens, as vLLM's flag of that name",
    )
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Translate parsed arguments into a :class:`SimConfig`. A ``--profile`` that is not a
    built-in name is read as a JSON engine profile file (the module docstring); raises
    ``ValueError`` (one line, naming the file) when it cannot be read or is invalid."""
    shape = {
        "kv_capacity_tokens": args.kv_capacity_tokens,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    profile, steptime = args.profile, None
    if args.profile in PROFILE_NAMES:
        defaults = {"block_size": 16, "max_model_len": 8192, "max_num_seqs": 256}
    else:
        if not Path(args.profile).exists():
            names = ", ".join(PROFILE_NAMES)
            raise ValueError(f"--profile {args.profile}: neither a built-in ({names}) nor a file")
        prof = load_profile(args.profile)
        profile, steptime = prof.name, prof.steptime()
        defaults = {
            "kv_capacity_tokens": prof.kv_capacity_tokens,
            "block_size": prof.block_size,
            "max_model_len": prof.max_model_len,
            "max_num_seqs": prof.max_num_seqs,
            "max_num_batched_tokens": prof.prefill_chunk_tokens,
        }
    shape = {k: defaults.get(k) if v is None else v for k, v in shape.items()}
    return SimConfig(
        model=args.model,
        extra_models=tuple(m.strip() for m in args.extra_models.split(",") if m.strip()),
        decode_ms=args.decode_ms,
        prefill_us_per_token=args.prefill_us_per_token,
        profile=profile,
        steptime_model=steptime,
        **shape,
        output_lengths=args.output_lengths,
        output_seed=args.output_seed,
        time_scale=args.time_scale,
        prefix_caching=args.enable_prefix_caching,
        prompt_tokens_details=args.enable_prompt_tokens_details,
    )


async def serve(config: SimConfig, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner, bound = await start_sim(config, host, port)
    print(
        f"kvgate-sim listening on http://{host}:{bound} model={config.model} "
        f"profile={config.profile} blocks={config.num_gpu_blocks}x{config.block_size} "
        f"time_scale={config.time_scale:g}",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvgate-sim`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)  # ValueError: e.g. a time scale <= 0
        config.engine_config()  # validate early
        config.output_length_source()
    except ValueError as exc:
        print(f"kvgate-sim: {exc}", file=sys.stderr)
        return 2
    coro = serve(config, args.host, args.port)
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)
    return 0


if __name__ == "__main__":
    sys.exit(main())
