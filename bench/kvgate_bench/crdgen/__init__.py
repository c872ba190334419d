"""``scripts/gen-crds`` (``python -m kvgate_bench.crdgen``): the CRDs generated from the policy's
pydantic models and a hand-written source each.

The models (``agent/kvgate_agent/contract/``) state each field's type, enum, bounds, default and
whether it is required; the sources (``crds/source/*.yaml``) state the rest: descriptions, CEL
rules, the constraints only the CRD has (bounds for the CEL cost estimator, label syntax), the
names, printer columns and status subresource. A policy field is then written in the model, its
description in the source, its line in the README's policy table: nothing else is edited by hand.

``facts`` reads a model's schema, ``scalars`` writes its values as the CRDs do, ``splice`` puts
them into the source's schema nodes (keeping the source's own lines as written), ``crds`` knows
the two CRDs (and what NodeAdmission's thresholds repeat of RateLimitPolicy), ``__main__`` writes
both copies (``crds/`` and the chart's ``charts/kvgate/crds/``) or, with ``--check``, fails
while a committed copy differs.
"""
