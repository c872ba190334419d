"""scripts/gen-crds (``kvgate_bench.crdgen``): the committed CRDs are what the models and the
sources make, and a source that disagrees with its model is refused with the field named."""

from __future__ import annotations

import pytest

from kvgate_bench.crdgen import crds
from kvgate_bench.crdgen.__main__ import main
from kvgate_bench.crdgen.scalars import key_lines, scalar
from kvgate_bench.crdgen.splice import SourceError

RLP = "ratelimitpolicies.yaml"


def test_the_committed_copies_are_generated() -> None:
    assert main(["--check"]) == 0


def test_the_thresholds_repeat_the_generated_policy_spec() -> None:
    """NodeAdmission's thresholds hold the policy spec's property lines, shifted right."""
    made = crds.generate_all()
    policy, node = made[RLP], made["nodeadmissions.yaml"]
    block = policy[
        policy.index("                model:\n") : policy.index("                capacity:\n")
    ]
    shifted = "".join("          " + line + "\n" for line in block.splitlines())
    assert shifted in node


def source() -> str:
    return (crds.SOURCES / RLP).read_text()


def generate(text: str) -> str:
    return crds.generate(text, RLP, (crds.POLICY,))


def test_a_keyword_the_model_gives_is_refused_in_the_source() -> None:
    text = source().replace(
        "                    blockSize:\n",
        "                    blockSize:\n                      type: integer\n",
        1,
    )
    with pytest.raises(SourceError, match=r"spec\.model\.blockSize\.type: the model gives it"):
        generate(text)


def test_a_field_without_a_description_is_refused() -> None:
    """A property of the model the source does not describe, and one the model lacks."""
    text = source().replace(
        "                    blockSize:\n", "                    blokSize:\n", 1
    )
    with pytest.raises(SourceError) as caught:
        generate(text)
    assert "model.blockSize: in the model, missing from the source" in str(caught.value)
    assert "model.blokSize: in the source, not in the model" in str(caught.value)


def test_source_notes_stay_out_of_the_crd() -> None:
    assert source().startswith("#: ")
    assert "\n#:" not in generate(source())


@pytest.mark.parametrize(
    ("value", "written"),
    [
        (True, "true"),
        (1.0, "1"),
        (0.999, "0.999"),
        ("FailOpen", "FailOpen"),
        ("None", '"None"'),
        ("", '""'),
        ("123", '"123"'),
        ("^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"),
        ("^\\S(.*\\S)?$", "'^\\S(.*\\S)?$'"),
        ("^https?://x(:[0-9]{1,5})?$", "'^https?://x(:[0-9]{1,5})?$'"),
    ],
)
def test_scalars_are_written_as_the_crds_write_them(value: object, written: str) -> None:
    assert scalar(value) == written


def test_lists_are_flow_style_and_quote_all_or_none() -> None:
    assert key_lines("enum", ["vLLM", "None"], 2) == ['  enum: ["vLLM", "None"]']
    assert key_lines("enum", ["In", "NotIn"], 0) == ["enum: [In, NotIn]"]
    long = key_lines("required", [f"field{i}" for i in range(20)], 90)
    assert long[0].strip() == "required:" and long[1].strip() == "- field0"
