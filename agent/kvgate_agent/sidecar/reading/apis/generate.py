"""``POST /generate``, TGI's and SGLang's both: the body says which
(:class:`~kvgate_agent.sidecar.reading.apis.tgi.Tgi` with ``inputs``,
:class:`~kvgate_agent.sidecar.reading.apis.sglang.SGLang` with ``text``, ``input_ids`` or
``input_embeds``); both or neither is refused. The parsed request carries the API chosen. Pure
JSON logic: no HTTP framework.
"""

from __future__ import annotations

from kvgate_agent.sidecar.reading.apis.sglang import SGLANG
from kvgate_agent.sidecar.reading.apis.tgi import TGI
from kvgate_agent.sidecar.reading.request import ParsedRequest, bad, decode_object

__all__ = ["GENERATE", "Generate"]


class Generate:
    """A :class:`~kvgate_agent.sidecar.reading.apis.base.Route` choosing TGI or SGLang by the
    body."""

    def __init__(self) -> None:
        self.name = "generate"

    def __repr__(self) -> str:
        return "<Route generate: tgi | sglang>"

    def parse(
        self,
        raw: bytes,
        *,
        default_max_tokens: int,
        max_tokens_cap: int | None,
        max_model_len: int | None,
    ) -> ParsedRequest:
        """TGI's or SGLang's :meth:`~kvgate_agent.sidecar.reading.apis.native.NativeApi.parse`.

        Raises:
            RequestError: 400 naming ``inputs`` when the body has both kinds of prompt or
                neither; as the API's own parse otherwise.
        """
        body = decode_object(raw)
        tgi = "inputs" in body
        sglang = any(k in body for k in ("text", "input_ids", "input_embeds"))
        if tgi and sglang:
            raise bad("give 'inputs' (TGI) or 'text'/'input_ids' (SGLang), not both", "inputs")
        if not (tgi or sglang):
            raise bad("'inputs' (TGI) or 'text'/'input_ids' (SGLang) is required", "inputs")
        return (TGI if tgi else SGLANG).parse_body(
            raw,
            body,
            default_max_tokens=default_max_tokens,
            max_tokens_cap=max_tokens_cap,
            max_model_len=max_model_len,
        )


#: ``POST /generate``.
GENERATE = Generate()
