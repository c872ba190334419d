"""The pydantic base of every contract document (RateLimitPolicy, NodeAdmission, sync)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ContractModel(BaseModel):
    """Base of the contract's models. Its config:

    - ``alias_generator=to_camel``, ``populate_by_name``: fields are camelCase in the manifest and
      on the wire (``burstTokens``), snake_case in Python (``burst_tokens``); either name is read.
    - ``extra="forbid"``: an unknown field is refused, so a typo must not silently do nothing.
    - ``frozen``: a parsed document is a value; nothing changes it in place.

    A subclass's ``model_config`` adds to this one (``ObjectMeta`` allows extra fields,
    ``SyncReport`` is strict).
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )
