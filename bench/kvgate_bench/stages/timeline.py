"""The stage arithmetic of ``python -m kvgate_bench.stages`` (pure: no clock, no I/O).

A run records *marks*, ``(t_ns, sign, label)``: ``+1`` when a wrapped function (or coroutine)
of the sidecar starts, ``-1`` when it returns. At c=1 one request is in flight at a time, so the
marks nest like a call stack (a coroutine's mark pair spans its suspensions, and what runs while
it is suspended, the upstream connection's ``data_received``, nests inside it).

Every interval between two consecutive marks goes to exactly one *key*:

* inside a wrapped call: the innermost open one's label (its exclusive time);
* inside a wait (label :data:`WAIT`, renamed ``wait[<enclosing label>]``): ``:idle`` from its
  start to the first mark inside it (the loop waits for the other side), ``:wake`` from the
  last mark inside it to its end (the loop turns to resume the task), ``:mid`` between;
* outside every wrapped call: a gap named by the marks on either side,
  ``gap <label><+|-> > <label><+|->`` (e.g. ``gap conn.read- > serve+``, the loop turn from
  the request's bytes to its task's first step).

So the keys of one request sum to its span exactly; :data:`STAGES` groups keys into the table's
stages and whatever no stage claims is the table's *unattributed* remainder.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvgate_bench.kit.toolkit import percentile_of

#: (t_ns, +1 start / -1 end, label)
Mark = tuple[int, int, str]
WAIT = "wait"
#: The label whose start begins a request (the client connection's ``data_received``) and the
#: one whose end closes it (the request's task, ``ClientConnection._serve``).
START, END = "conn.read", "serve"
#: The label of a write to the client: the answer is out once the last one of a request ends.
SEND = "client.send"

#: The table's stages, in request order: (stage, keys it sums).
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("read + llhttp parse (data_received)", ("conn.read",)),
    ("request head: headers decoded, Request built", ("req.head",)),
    ("task creation", ("conn.task",)),
    ("loop turn: task's first step", ("gap conn.read- > serve+",)),
    ("serve glue (route, _answer)", ("serve", "serve.answer")),
    ("pipeline glue (_completion, _prompt)", ("pipeline",)),
    ("identity", ("identity",)),
    ("read body", ("body.read",)),
    ("parse JSON + validate", ("body.parse",)),
    ("token estimate", ("estimate",)),
    ("admission request build (_admit)", ("admit.build",)),
    ("admission submit (decision)", ("admit.submit", "admit.async")),
    ("metrics (decision, tokens)", ("metrics",)),
    ("build upstream request (body, headers, head)", ("up.build",)),
    ("upstream connection from the pool", ("up.acquire",)),
    ("upstream write (writelines)", ("up.write",)),
    # (wait[pipeline], wait[serve]: on a compiled build, where the wait begins as the upstream
    # write returns, inside the outermost stamped call)
    (
        "wait for upstream first byte",
        ("wait[up.write]:idle", "wait[up.write]:mid", "wait[pipeline]:idle", "wait[serve]:idle"),
    ),
    ("upstream read + llhttp parse", ("up.read",)),
    ("loop turn: resume after upstream headers", ("wait[up.write]:wake",)),
    ("forward glue (admitted, _exchange)", ("forward",)),
    ("answer headers copied (forward_headers)", ("relay.headers",)),
    ("answer body read", ("relay.body",)),
    ("wait for upstream events (stream)", ("wait[relay.body]:idle", "wait[relay.body]:mid")),
    ("loop turn: resume after upstream event", ("wait[relay.body]:wake",)),
    ("usage parse (non-streamed)", ("relay.usage",)),
    ("stream relay loop glue", ("relay.stream",)),
    ("SSE accounting (feed)", ("relay.sse",)),
    ("admission observe_tokens", ("observe",)),
    ("stream head / chunk framing / end", ("stream.head", "stream.write", "stream.eof")),
    ("release: admission", ("release.admission",)),
    ("release: settle (metrics, calibration)", ("release.settle",)),
    ("answer head build (response_bytes, head_bytes)", ("answer.head",)),
    ("client write (transport.write)", ("client.send",)),
    ("next-request bookkeeping (_next)", ("conn.next",)),
)
UNATTRIBUTED = "unattributed (keys no stage names)"


def attribute(
    marks: Iterable[Mark], stack: list[tuple[str, str]] | None = None
) -> list[tuple[int, int, str]]:
    """``(t_from, t_to, key)`` for each interval between consecutive ``marks`` (see the module
    docstring). ``stack`` (``(label, name)`` pairs, open calls) carries over between calls. An
    end without its start is skipped; an end closes whatever opened above its start."""
    stack = [] if stack is None else stack
    out: list[tuple[int, int, str]] = []
    prev: Mark | None = None
    for mark in marks:
        t, sign, label = mark
        if prev is not None:
            out.append((prev[0], t, _key(stack, prev, mark)))
        if sign > 0:
            name = label
            if label == WAIT:
                name = f"{WAIT}[{stack[-1][1] if stack else '-'}]"
            stack.append((label, name))
        else:
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][0] == label:
                    del stack[i:]
                    break
        prev = mark
    return out


def _key(stack: Sequence[tuple[str, str]], prev: Mark, nxt: Mark) -> str:
    if not stack:
        return f"gap {prev[2]}{'+' if prev[1] > 0 else '-'} > {nxt[2]}{'+' if nxt[1] > 0 else '-'}"
    label, name = stack[-1]
    if label != WAIT:
        return name
    if prev[1] > 0 and prev[2] == WAIT:
        return f"{name}:idle"
    if nxt[1] < 0 and nxt[2] == WAIT:
        return f"{name}:wake"
    return f"{name}:mid"


@dataclass
class Request:
    """One request's marks summed: ``path`` (key -> ns) up to the end of its last write to the
    client (``answered``), ``tail`` after it; ``calls``: wrapped calls by label."""

    start: int
    answered: int
    end: int
    path: dict[str, int] = field(default_factory=dict)
    tail: dict[str, int] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)

    @property
    def span(self) -> int:
        """ns from the first byte read to the answer's last write returning."""
        return self.answered - self.start


def requests(marks: Sequence[Mark]) -> list[Request]:
    """The requests in ``marks`` (time-ordered): one begins at a :data:`START` mark opened
    with nothing else open once the last one's :data:`END` has closed; marks before the first
    are dropped."""
    out: list[Request] = []
    seg: list[Mark] = []
    stack: list[tuple[str, str]] = []
    ended = True
    for mark in marks:
        if mark[1] > 0 and mark[2] == START and not stack and ended:
            if seg:
                out.append(_request(seg))
            seg, ended = [], False
        if mark[1] < 0 and mark[2] == END:
            ended = True
        _track(stack, mark)
        if out or seg or mark[2] == START:
            seg.append(mark)
    if seg:
        out.append(_request(seg))
    return out


def _track(stack: list[tuple[str, str]], mark: Mark) -> None:
    if mark[1] > 0:
        stack.append((mark[2], mark[2]))
        return
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][0] == mark[2]:
            del stack[i:]
            return


def _request(seg: Sequence[Mark]) -> Request:
    sends = [t for t, sign, label in seg if sign < 0 and label == SEND]
    answered = sends[-1] if sends else seg[-1][0]
    req = Request(seg[0][0], answered, seg[-1][0])
    req.calls.update(label for _, sign, label in seg if sign > 0)
    for lo, hi, key in attribute(seg):
        into = req.path if hi <= answered else req.tail
        into[key] = into.get(key, 0) + hi - lo
    return req


def stage_values(req: Request) -> dict[str, int]:
    """``req``'s answered span by :data:`STAGES` (ns), with :data:`UNATTRIBUTED` the rest."""
    out = {name: sum(req.path.get(k, 0) for k in keys) for name, keys in STAGES}
    out[UNATTRIBUTED] = req.span - sum(out.values())
    return out


def count_between(times: Sequence[int], lo: int, hi: int) -> int:
    """How many of the sorted ``times`` lie in ``[lo, hi]``."""
    return bisect.bisect_right(times, hi) - bisect.bisect_left(times, lo)


def match(reqs: Sequence[Request], sent: Sequence[tuple[int, int]]) -> list[tuple[int, Request]]:
    """Pairs ``(i, request)``: the client's exchange ``sent[i]`` (``(t_send, t_done)``, sorted
    by ``t_send``, never overlapping) during which ``request`` began."""
    starts = [s for s, _ in sent]
    out = []
    for r in reqs:
        i = bisect.bisect_right(starts, r.start) - 1
        if i >= 0 and r.start <= sent[i][1]:
            out.append((i, r))
    return out


def summary(values: Mapping[str, Sequence[float]]) -> dict[str, tuple[float, float]]:
    """name -> (median, p90) of each non-empty series (units as given)."""
    return {
        k: (percentile_of(v, 50), percentile_of(v, 90)) for k, v in values.items() if len(v) > 0
    }


def key_medians(reqs: Sequence[Request]) -> dict[str, float]:
    """Every key's median over ``reqs`` (ns; 0 where a request lacks it), largest first: what
    the unattributed remainder is made of, for the JSON."""
    keys = {k for r in reqs for k in r.path}
    med = {k: percentile_of([r.path.get(k, 0) for r in reqs], 50) for k in keys}
    return dict(sorted(med.items(), key=lambda kv: -kv[1]))


def render(
    columns: Mapping[str, Mapping[str, tuple[float, float]]],
    rows: Sequence[str],
    *,
    share_of: str | None = None,
    shared: Sequence[str] = (),
) -> str:
    """A Markdown table: one row per ``rows`` entry, a median and p90 column per column (values
    in µs; '' where a column lacks the row) and, with ``share_of``, each column's median of the
    ``shared`` rows as a share of its median of row ``share_of``."""
    quantities = ("p50", "p90", "% of p50 span") if share_of else ("p50", "p90")
    head = ["stage"] + [f"{c} {q}" for c in columns for q in quantities]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for row in rows:
        cells = [row]
        for col in columns.values():
            got = col.get(row)
            cells += [_fmt(got[0]), _fmt(got[1])] if got is not None else ["", ""]
            if share_of:
                whole = col.get(share_of)
                ok = got is not None and whole is not None and whole[0] > 0 and row in shared
                cells.append(f"{100 * got[0] / whole[0]:.1f}" if ok and got and whole else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(x: float) -> str:
    if x != x:  # NaN: not measured
        return ""
    return f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"
