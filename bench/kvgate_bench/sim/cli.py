"""``kvgate-sim`` command line: run the vLLM-compatible simulator until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

from kvgate_bench.sim.lengths import OUTPUT_LENGTH_MODES
from kvgate_bench.sim.server import SimConfig, start_sim
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
        choices=PROFILE_NAMES,
        default="constant",
        help="step-time model: constant (--decode-ms + --prefill-us-per-token, whole-prompt "
        "prefill) or a realistic a + b*prefill + c*decodes + d*context profile with "
        "chunked prefill (default: constant)",
    )
    p.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=None,
        help="KV pool size, tokens (default: the profile's; constant: 65536)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=8192, help="max prompt+completion tokens")
    p.add_argument("--max-num-seqs", type=int, default=256, help="max running requests")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step: prefill tokens for constant (default max(8192, "
        "max-model-len)), every scheduled token for chunked profiles (default 8192)",
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
    """Translate parsed arguments into a :class:`SimConfig`."""
    return SimConfig(
        model=args.model,
        extra_models=tuple(m.strip() for m in args.extra_models.split(",") if m.strip()),
        kv_capacity_tokens=args.kv_capacity_tokens,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_ms=args.decode_ms,
        prefill_us_per_token=args.prefill_us_per_token,
        profile=args.profile,
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
