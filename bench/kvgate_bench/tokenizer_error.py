"""``python -m kvgate_bench.tokenizer_error``: how far kvgate's prompt estimate is from the
engine's own count, on a few hundred varied prompts.

Sends each prompt (chat and completions; English, German, French, Spanish, Russian, Arabic,
Hindi, Chinese, Japanese, Korean, Python, JavaScript, SQL, JSON, shell, numbers, emoji; built
from :data:`SNIPPETS` with a seeded random generator, so a run is repeatable) to the engine's
``/tokenize`` the way ``--tokenizer engine`` does (:class:`EngineTokenizer`: vLLM's or
llama.cpp's dialect) and compares kvgate's estimate (:class:`PromptCounter`, no tokenizer file)
with it. Two estimates are reported: ``initial`` (a fresh sidecar: ``DEFAULT_BYTES_PER_TOKEN``)
and ``calibrated`` (after the sidecar has seen the usage of the prompts before, in order: the
moving average :meth:`PromptCounter.observe` keeps). Relative error is
``(estimate - engine) / engine``: positive over-counts (safe: admission reserves more), negative
under-counts. ``--check-usage K`` also checks the engine's count against the ``usage.
prompt_tokens`` of a one-token generation for K prompts (that the count is the one it charges).

Engine: ``--url`` (one already serving), or ``--llama-server BIN --model GGUF`` (started here on a
free loopback port, stopped at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvgate_agent.sidecar.engine.engine_tokens import EngineTokenizer
from kvgate_agent.sidecar.reading.tokens import PromptCounter
from kvgate_bench.kit.processes import Proc, start
from kvgate_bench.kit.toolkit import free_port, percentile

#: Text of each kind, one line per snippet; prompts are drawn from these.
SNIPPETS: dict[str, list[str]] = {
    "en": [
        "The quick brown fox jumps over the lazy dog near the river bank.",
        "Please summarise the following meeting notes in three bullet points.",
        "Our quarterly revenue grew by twelve percent, driven by strong demand in Europe.",
        "Explain why the sky appears blue during the day and red at sunset.",
        "I would like to book a table for four people tomorrow evening at seven.",
        "Kubernetes schedules pods onto nodes according to their resource requests.",
    ],
    "de": [
        "Die Straßenbahn fährt alle zehn Minuten vom Hauptbahnhof ab.",
        "Können Sie mir bitte erklären, wie die Heizungsanlage funktioniert?",
        "Übermorgen beginnt die Konferenz über erneuerbare Energien in München.",
    ],
    "fr": [
        "Le conseil municipal a voté le budget de l'année prochaine à l'unanimité.",
        "Pourriez-vous m'indiquer le chemin le plus court jusqu'à la gare ?",
        "Les élèves étudient l'histoire de la Révolution française cette semaine.",
    ],
    "es": [
        "El tren de alta velocidad conecta Madrid con Barcelona en menos de tres horas.",
        "¿Cuál es la mejor época del año para visitar la Patagonia?",
    ],
    "ru": [
        "Москва является столицей России и крупнейшим городом страны.",
        "Пожалуйста, переведите этот текст на английский язык.",
        "Вчера вечером шёл сильный снег, и дороги замело.",
    ],
    "ar": [
        "القاهرة هي عاصمة مصر وأكبر مدنها من حيث عدد السكان.",
        "هل يمكنك مساعدتي في كتابة رسالة رسمية إلى المدير؟",
    ],
    "hi": [
        "भारत की राजधानी नई दिल्ली है और यह एक बड़ा शहर है।",
        "कृपया मुझे इस लेख का सारांश हिंदी में दीजिए।",
    ],
    "zh": [
        "北京是中华人民共和国的首都，也是全国的政治和文化中心。",
        "请把下面这段话翻译成英文，并解释其中的成语。",
        "今天天气很好，我们去公园散步吧。",
    ],
    "ja": [
        "東京は日本の首都であり、世界有数の大都市です。",
        "この文章を要約して、三つのポイントにまとめてください。",
        "昨日は雨が降っていたので、家で本を読みました。",
    ],
    "ko": [
        "서울은 대한민국의 수도이며 가장 큰 도시입니다.",
        "다음 문장을 영어로 번역해 주세요.",
    ],
    "python": [
        "def fibonacci(n: int) -> int:\n"
        "    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
        "import asyncio\n\nasync def main() -> None:\n    await asyncio.sleep(0.1)\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
        "    def push(self, x):\n        self.items.append(x)\n",
        "with open('data.csv') as f:\n    rows = [line.strip().split(',') for line in f]\n",
    ],
    "js": [
        "const sum = (xs) => xs.reduce((a, b) => a + b, 0);\n",
        "fetch('/api/items').then((r) => r.json()).then((items) => console.log(items.length));\n",
        "export function debounce(fn, ms) {\n  let t;\n"
        "  return (...a) => { clearTimeout(t); t = setTimeout(() => fn(...a), ms); };\n}\n",
    ],
    "sql": [
        "SELECT u.id, u.name, COUNT(o.id) AS orders FROM users u LEFT JOIN orders o "
        "ON o.user_id = u.id GROUP BY u.id, u.name;\n",
        "CREATE INDEX idx_orders_created_at ON orders (created_at DESC);\n",
    ],
    "json": [
        '{"id": 1234, "name": "widget", "tags": ["a", "b"], "price": 19.99, "in_stock": true}\n',
        '{"user": {"email": "jane@example.com", "roles": ["admin", "editor"]}, "active": false}\n',
    ],
    "shell": [
        "kubectl get pods -n kvgate -o wide | grep -v Running\n",
        "tar -czf backup-$(date +%F).tar.gz /var/lib/data && ls -lh *.tar.gz\n",
    ],
    "numbers": [
        "3.14159 2.71828 1.41421 1.73205 0.57721 1.61803 299792458 6.02214076e23",
        "Order #48213 totals $1,294.50 (tax 8.25%), due 2026-12-01 at 17:30 UTC.",
    ],
    "emoji": [
        "Great job team 🎉🎉 see you at the party 🥳🍕🍰!",
        "Weather today: ☀️ then 🌧️ later, 🌡️ 18°C.",
    ],
}

#: Kinds grouped for the report.
GROUPS: dict[str, tuple[str, ...]] = {
    "latin": ("en", "de", "fr", "es"),
    "other scripts": ("ru", "ar", "hi"),
    "cjk": ("zh", "ja", "ko"),
    "code": ("python", "js", "sql", "json", "shell"),
    "mixed": ("numbers", "emoji"),
}


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: its request path, body and dominant kind."""

    path: str
    body: dict[str, Any]
    kind: str


def _text(rng: random.Random, kind: str) -> str:
    """1 to 24 snippets of ``kind`` (a long prompt sometimes), joined as prose or code is."""
    n = rng.choice([1, 1, 2, 3, 4, 6, 8, 12, 24])
    parts = [rng.choice(SNIPPETS[kind]) for _ in range(n)]
    return ("" if kind in GROUPS["code"] else " ").join(parts)


def make_prompts(count: int, seed: int = 14) -> list[Prompt]:
    """``count`` varied prompts: about half chats (1 to 6 turns, a system prompt in some, the
    turns in one kind mixed with English sometimes), half completions."""
    rng = random.Random(seed)
    kinds = sorted(SNIPPETS)
    out: list[Prompt] = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        if i % 2 == 0:
            out.append(Prompt("/v1/completions", {"prompt": _text(rng, kind)}, kind))
            continue
        messages: list[dict[str, str]] = []
        if rng.random() < 0.4:
            messages.append({"role": "system", "content": _text(rng, rng.choice(["en", kind]))})
        turns = rng.choice([1, 1, 2, 3, 5])
        for t in range(turns):
            messages.append({"role": "user", "content": _text(rng, kind)})
            if t < turns - 1:
                messages.append({"role": "assistant", "content": _text(rng, kind)})
        out.append(Prompt("/v1/chat/completions", {"messages": messages}, kind))
    return out


@dataclass(frozen=True)
class Row:
    """One prompt's counts (tokens)."""

    prompt: Prompt
    engine: int
    initial: int
    calibrated: int
    seconds: float  # the engine's count: one /tokenize (llama.cpp chat: + /apply-template)


def _rel(est: int, real: int) -> float:
    return (est - real) / real


def summarise(rows: Sequence[Row], which: str) -> dict[str, float]:
    """Relative error of the ``initial`` or ``calibrated`` estimate: signed mean, and mean, p50,
    p95, max of its absolute value; ``under``: the share of prompts under-counted. Prompts the
    engine counted 0 tokens (a simulator's word tokenizer on CJK) have no relative error and are
    left out."""
    errs = [_rel(getattr(r, which), r.engine) for r in rows if r.engine > 0]
    if not errs:
        return {"n": 0.0}
    absolute = [abs(e) for e in errs]
    return {
        "n": float(len(errs)),
        "mean_signed": sum(errs) / len(errs),
        "mean": sum(absolute) / len(absolute),
        "p50": percentile(absolute, 50) or 0.0,
        "p95": percentile(absolute, 95) or 0.0,
        "max": max(absolute),
        "under": sum(e < 0 for e in errs) / len(errs),
    }


async def measure(
    url: str, prompts: Sequence[Prompt], check_usage: int, model: str | None = None
) -> tuple[list[Row], int, str | None]:
    """The engine's count and both estimates of every prompt; how many of the first
    ``check_usage`` prompts had a ``usage.prompt_tokens`` different from the engine's count; the
    engine's dialect. ``model``: the ``model`` field of the generations (None: left out)."""
    fresh = PromptCounter()
    calibrating = PromptCounter()
    rows: list[Row] = []
    mismatches = 0
    async with aiohttp.ClientSession() as session:
        engine = EngineTokenizer(
            url, PromptCounter(), timeout=60.0, cache_size=1, session=lambda: session
        )
        for i, p in enumerate(prompts):
            initial = fresh.count(p.body)
            t0 = time.perf_counter()
            got = await engine.count(p.body, initial)
            seconds = time.perf_counter() - t0
            if not got.exact:
                raise RuntimeError(f"the engine at {url} gave no count for {p.body!r:.200}")
            calibrated = calibrating.count(p.body)
            rows.append(Row(p, got.tokens, initial.tokens, calibrated.tokens, seconds))
            calibrating.observe(calibrated.text_bytes, got.tokens, calibrated.overhead_tokens)
            if i < check_usage:
                named = {} if model is None else {"model": model}
                body = {**p.body, **named, "max_tokens": 1}
                async with session.post(url + p.path, json=body) as r:
                    answer = await r.json(content_type=None)
                if r.status != 200 or "usage" not in answer:
                    raise RuntimeError(f"{p.path} answered {r.status}: {answer!r:.300}")
                mismatches += answer["usage"]["prompt_tokens"] != got.tokens
    return rows, mismatches, engine.dialect


def report(rows: Sequence[Row], mismatches: int, checked: int, dialect: str | None) -> str:
    """The figures as a Markdown table: overall and per group, both estimates."""

    def ms(q: float) -> float:
        return 1000 * (percentile([r.seconds for r in rows], q) or 0.0)

    lines = [
        f"engine dialect: {dialect}; prompts: {len(rows)} "
        f"({sum(r.prompt.path.endswith('chat/completions') for r in rows)} chat); "
        f"engine tokens: {sum(r.engine for r in rows)}",
        f"engine count = usage.prompt_tokens on {checked - mismatches}/{checked} checked; "
        f"the engine's count took p50 {ms(50):.1f} ms, p95 {ms(95):.1f} ms, max {ms(100):.1f} ms",
        "",
        "| prompts | estimate | n | mean signed | mean abs | p50 abs | p95 abs | max abs "
        "| under-counted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    selections: list[tuple[str, Sequence[Row]]] = [("all", rows)]
    selections += [(g, [r for r in rows if r.prompt.kind in kinds]) for g, kinds in GROUPS.items()]
    for name, sel in selections:
        if not any(r.engine > 0 for r in sel):
            continue
        for which in ("initial", "calibrated"):
            s = summarise(sel, which)
            lines.append(
                f"| {name} | {which} | {int(s['n'])} | {s['mean_signed']:+.1%} | {s['mean']:.1%} "
                f"| {s['p50']:.1%} | {s['p95']:.1%} | {s['max']:.1%} | {s['under']:.0%} |"
            )
    return "\n".join(lines)


def _start_llama(binary: str, model: str, log: Path) -> Proc:
    """``binary`` serving ``model`` on a free loopback port, once ``/health`` answers 200
    (llama-server answers 503 while it loads the model).

    Raises:
        RuntimeError: it exited, or was not ready within 240 s.
    """
    port = free_port()
    return start(
        [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "8192"],
        log,
        url=f"http://127.0.0.1:{port}",
        ready="/health",
        status=200,
        timeout=240.0,
        what="llama-server",
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvgate_bench.tokenizer_error", description=__doc__)
    ap.add_argument("--url", help="an engine already serving, e.g. http://127.0.0.1:8000")
    ap.add_argument("--llama-server", help="llama-server binary to start (with --model)")
    ap.add_argument("--model", help="GGUF model file for --llama-server")
    ap.add_argument("--prompts", type=int, default=300, help="prompts to send")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument(
        "--check-usage",
        type=int,
        default=10,
        help="prompts also generated (1 token) to check "
        "the engine's count against its usage.prompt_tokens",
    )
    ap.add_argument("--served-model", help="the model field of the --check-usage generations")
    ap.add_argument("--json", action="store_true", help="print the summaries as JSON")
    args = ap.parse_args(argv)
    if (args.url is None) == (args.llama_server is None) or (
        args.llama_server is not None and args.model is None
    ):
        ap.error("give --url, or --llama-server with --model")
    proc: Proc | None = None
    url = args.url
    try:
        if args.llama_server is not None:
            log = Path(tempfile.mkdtemp(prefix="kvgate-llama-")) / "llama-server.log"
            proc = _start_llama(args.llama_server, args.model, log)
            url = proc.url
        prompts = make_prompts(args.prompts, args.seed)
        rows, mismatches, dialect = asyncio.run(
            measure(url.rstrip("/"), prompts, args.check_usage, args.served_model)
        )
    finally:
        if proc is not None:
            proc.stop()
    checked = min(args.check_usage, len(rows))
    if args.json:
        out: dict[str, Any] = {w: summarise(rows, w) for w in ("initial", "calibrated")}
        out["count_ms_p50"] = 1000 * (percentile([r.seconds for r in rows], 50) or 0.0)
        extra = {"usage_mismatches": mismatches, "checked": checked, "dialect": dialect}
        print(json.dumps({**out, **extra}))
    else:
        print(report(rows, mismatches, checked, dialect))
    return 0


if __name__ == "__main__":
    sys.exit(main())
