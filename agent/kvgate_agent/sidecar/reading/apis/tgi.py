"""TGI's native API (https://huggingface.github.io/text-generation-inference/): ``POST /generate``
with ``inputs`` (shared with SGLang, told apart by the body:
:mod:`kvgate_agent.sidecar.reading.apis.generate`) and ``POST /generate_stream``, which always
streams. Output limit ``parameters.max_new_tokens``; sequences ``parameters.best_of`` (TGI samples
that many and returns the best one). Usage: ``details.generated_tokens`` (plus
``best_of_sequences``), a batch's list summed; a stream has one ``token`` per event, the last with
``generated_text`` and ``details``. Pure JSON logic: no HTTP framework.
"""

from __future__ import annotations

from typing import Any

from kvgate_agent.sidecar.reading.apis.native import Fields, NativeApi, stream_flag
from kvgate_agent.sidecar.reading.request import bad, check_sequences, positive_int
from kvgate_agent.sidecar.reading.usage import (
    Counts,
    EventReader,
    batch_usage,
    count,
    decode_body,
    sum_known,
)

__all__ = ["TGI", "TGI_STREAM", "Tgi", "TgiReader"]


class Tgi(NativeApi):
    """See the module's docstring; ``always_stream``: ``/generate_stream``."""

    def __init__(self, always_stream: bool) -> None:
        super().__init__("tgi", "inputs", "parameters.max_new_tokens")
        self.always_stream = always_stream

    def fields(self, body: dict[str, Any]) -> Fields:
        """``inputs`` (a string), ``parameters.max_new_tokens`` and ``parameters.best_of``."""
        inputs = body.get("inputs")
        if not isinstance(inputs, str):
            raise bad("'inputs' must be a string", "inputs")
        params = _object(body, "parameters")
        limit = positive_int(params, "max_new_tokens", "parameters.max_new_tokens")
        best_of = positive_int(params, "best_of", "parameters.best_of") or 1
        sequences = check_sequences(best_of, 1, "parameters.best_of")
        stream = True if self.always_stream else stream_flag(body)
        return Fields(
            None, stream, limit, ("parameters", "max_new_tokens"), "parameters.max_new_tokens",
            sequences, {"prompt": inputs},
        )  # fmt: skip

    def body_usage(self, data: bytes) -> Counts:
        """``details.generated_tokens`` plus each of ``details.best_of_sequences`` (TGI reports
        neither its prompt's count nor cached prompt tokens)."""
        return batch_usage(decode_body(data), _usage)

    def event_reader(self) -> EventReader:
        """A :class:`TgiReader`."""
        return TgiReader()


#: ``POST /generate`` with ``inputs``.
TGI = Tgi(always_stream=False)
#: ``POST /generate_stream``.
TGI_STREAM = Tgi(always_stream=True)


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    v = body.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad(f"'{key}' must be an object", key)
    return v


def _usage(obj: Any) -> Counts:
    """(None, the generated tokens of every sequence, None) of one result."""
    if not isinstance(obj, dict):
        return None, None, None
    details = obj.get("details")
    if not isinstance(details, dict):
        return None, None, None
    out = [count(details.get("generated_tokens"))]
    best = details.get("best_of_sequences")
    if isinstance(best, list):
        out += [count(b.get("generated_tokens")) for b in best if isinstance(b, dict)]
    return None, sum_known(out), None


class TgiReader(EventReader):
    """A TGI stream: one ``token`` per event; the last has ``generated_text`` and
    ``details``."""

    __slots__ = ()

    def event(self, obj: dict[str, Any]) -> None:
        """Account one event's JSON object."""
        if "token" in obj:
            self.deltas += 1
        if obj.get("generated_text") is not None:
            self.done = True
            _, out, _ = _usage(obj)
            if out is not None:
                self.reported = out
