"""The identity examples in examples/identity/ (kept out of examples/, which is applied whole
with ``kubectl apply -f examples/`` and read as policies): each parses, the policies as
RateLimitPolicies, the keys file as the sidecar reads it (its commented keys hash to its
entries), and the NetworkPolicy opens only the injected sidecar's two ports (schema-free checks)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kvgate_agent.contract.identity import UnknownKeys
from kvgate_agent.contract.policy import load_policy
from kvgate_agent.sidecar.identity.classes import class_names
from kvgate_agent.sidecar.identity.keyfiles import key_digest, parse_api_keys
from kvgate_operator.template import ADMIN_PORT_NAME, PORT_NAME

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "identity"


def test_the_policies_parse() -> None:
    keys = load_policy(EXAMPLES / "ratelimitpolicy-api-keys.yaml").spec.tenants
    assert (keys.header, keys.unknown_keys) == ("authorization", UnknownKeys.REFUSE)
    jwt = load_policy(EXAMPLES / "ratelimitpolicy-jwt.yaml").spec.tenants.jwt
    assert jwt is not None and jwt.claim == "org"


def test_the_keys_file_parses_and_its_keys_hash_to_its_entries() -> None:
    path = EXAMPLES / "api-keys.yaml"
    text = path.read_text()
    keys = parse_api_keys(text.encode(), str(path))
    named = re.findall(r'^\s*# "(sk-[\w-]+)"', text, flags=re.MULTILINE)
    assert len(named) == len(keys) == 3
    assert [keys[key_digest(k)].tenant for k in named] == ["team-a", "team-a", "batch-jobs"]
    assert keys[key_digest("sk-batch-1")].tenant_class == "batch"


def test_each_class_of_the_keys_file_is_declared_by_the_paired_policy() -> None:
    """A key's ``class`` names a class of the policy it is used with; an undeclared one would
    be ignored (with a warning) and its requests take the match rules' class."""
    path = EXAMPLES / "api-keys.yaml"
    keys = parse_api_keys(path.read_bytes(), str(path))
    tenants = load_policy(EXAMPLES / "ratelimitpolicy-api-keys.yaml").spec.tenants
    named = {k.tenant_class for k in keys.values() if k.tenant_class is not None}
    assert named and named <= class_names(tenants)
    batch = next(c for c in tenants.classes if c.name == "batch")
    assert batch.priority < 0 and batch.batch  # sheddable, as the comments say


def test_the_network_policy_admits_only_the_sidecars_ports() -> None:
    """The sidecar's clients' port to the gateway and the agents; its admin port (every tenant's
    series) to Prometheus alone; nothing else, the model server's own port included."""
    (doc,) = list(yaml.safe_load_all((EXAMPLES / "networkpolicy-gateway-only.yaml").read_text()))
    assert (doc["apiVersion"], doc["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    spec = doc["spec"]
    assert spec["podSelector"]["matchLabels"]
    assert spec["policyTypes"] == ["Ingress"]
    clients, admin = spec["ingress"]
    assert clients["ports"] == [{"port": PORT_NAME, "protocol": "TCP"}]
    assert admin["ports"] == [{"port": ADMIN_PORT_NAME, "protocol": "TCP"}]
    for rule in (clients, admin):
        peers = rule["from"]
        assert peers and all(set(p) == {"namespaceSelector", "podSelector"} for p in peers)
        assert all(p["namespaceSelector"]["matchLabels"] for p in peers)  # no namespace is "any"
    (prometheus,) = admin["from"]
    assert prometheus["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert prometheus not in clients["from"]
    assert "egress" not in spec
