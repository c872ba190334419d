"""The pydantic base of every contract document (RateLimitPolicy, NodeAdmission, sync), and the
bounded number types the policy's parts share."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
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


#: Numbers a policy field may hold: an int > 0 or >= 0, a finite float > 0 or >= 0 (NaN and
#: infinities refused). Units are the field's own.
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
