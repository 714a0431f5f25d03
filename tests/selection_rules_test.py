"""Every op's selection rules stand on their evidence (what `bazel run //tools:selection -- --check`
checks), every rule names backends its op has, and every rule's conditions read features its op
computes."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

from forgeax.core import OPS
from forgeax.core.selection import check_claims

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # not resolved: Bazel's runfiles tree

RULES = [(name, rule) for name in sorted(OPS) for rule in OPS[name].selection.rules]


def test_some_ops_have_rules():
    assert {"attention", "rms_norm"} <= {name for name, _ in RULES}


@pytest.mark.parametrize("op_name, rule", RULES, ids=[f"{n}:{r.id}" for n, r in RULES])
def test_rule_claims_hold_in_their_evidence(op_name, rule):
    assert os.path.isdir(os.path.join(ROOT, "benchmarks", "results")), ROOT
    assert check_claims(rule, ROOT) == []
    assert set(rule.prefer) <= set(OPS[op_name].backends)


def test_a_claim_the_evidence_contradicts_fails(tmp_path):
    rule = OPS["rms_norm"].selection.rules[0]
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    source = os.path.join(ROOT, rule.evidence["file"])
    text = open(source).read()
    # The same file with the two compared backends' names swapped must fail the claim.
    swapped = text.replace('"backend": "pallas_gpu"', '"backend": "@"').replace('"backend": "triton"', '"backend": "pallas_gpu"').replace('"backend": "@"', '"backend": "triton"')
    (tmp_path / rule.evidence["file"]).write_text(swapped)
    assert check_claims(rule, str(tmp_path)) != []
    assert check_claims(rule, str(tmp_path / "nowhere"))[0].endswith("is missing")


def test_rule_conditions_name_features_the_op_computes():
    attention = OPS["attention"]
    from forgeax.kernels.common.attention import AttentionSpec

    q = jax.ShapeDtypeStruct((1, 256, 8, 128), jnp.bfloat16)
    features = attention.features((q, q, q, None, None, None, None, None), {"spec": AttentionSpec(causal=True)})
    for rule in attention.selection.rules:
        assert set(rule.when) <= set(features), rule.id
    norm_features = OPS["rms_norm"].features((jax.ShapeDtypeStruct((4, 768), jnp.bfloat16), None), {})
    for rule in OPS["rms_norm"].selection.rules:
        assert set(rule.when) <= set(norm_features), rule.id
