"""What an injected pod gets for llm-d's endpoint picker (the chart's ``injector.eppEngineType``
value): the pod label ``llm-d.ai/engine-type`` set to that value, so the picker's
``core-metrics-extractor`` reads the pod's metrics with the ``engineConfigs`` entry of that name
(``kvgate_queue_depth`` and ``kvgate_kv_reserved_fraction``, which the sidecar appends to the
engine's ``/metrics``; docs/routers.md). The label replaces one the pod sets itself: the chart's
value says every injected pod is read through kvgate. Pure: no Kubernetes client.
"""

from __future__ import annotations

from typing import Any

import jsonpatch

#: The pod label the endpoint picker chooses an ``engineConfigs`` entry by (its
#: ``engineLabelKey`` default).
ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
#: A Kubernetes label value: at most 63 characters (checked apart), alphanumeric at both ends,
#: ``-``, ``_`` and ``.`` between.
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


def engine_type_ops(labels: object, engine_type: str | None) -> list[dict[str, Any]]:
    """The JSON Patch operations labelling the pod ``llm-d.ai/engine-type: <engine_type>``
    (none when ``engine_type`` is None), given the pod's ``metadata.labels`` as sent
    (``labels``: a dict, or anything else when absent); to be applied after ``metadata``
    exists (the injection's marker annotation creates it)."""
    if engine_type is None:
        return []
    if isinstance(labels, dict):
        path = jsonpatch.JsonPointer.from_parts(("metadata", "labels", ENGINE_TYPE_LABEL)).path
        return [{"op": "add", "path": path, "value": engine_type}]
    return [{"op": "add", "path": "/metadata/labels", "value": {ENGINE_TYPE_LABEL: engine_type}}]
