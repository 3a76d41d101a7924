"""S3's endpoint parameters that no rule names are dropped (storage/s3_endpoints.py),
so botocore's endpoint cache answers requests for new keys; one a rule names stays."""

from __future__ import annotations

from typing import Any

from botocore import loaders

from tierckpt.service.storage import s3_endpoints


def _ruleset(rules: list[Any]) -> dict[str, Any]:
    parameters = {name: {"type": "String"} for name in ("Bucket", "Key", "Prefix", "CopySource")}
    return {"version": "1.0", "parameters": parameters, "rules": rules}


def test_only_parameters_no_rule_names_are_dropped() -> None:
    bucket_rule = {"conditions": [{"fn": "isSet", "argv": [{"ref": "Bucket"}]}], "type": "endpoint"}
    assert s3_endpoints.unreferenced(_ruleset([bucket_rule])) == ("Key", "Prefix", "CopySource")
    by_ref = {"conditions": [{"fn": "isSet", "argv": [{"ref": "Key"}]}], "type": "endpoint"}
    in_template = {"endpoint": {"url": "https://{Bucket}.example/{Prefix}"}, "type": "endpoint"}
    assert s3_endpoints.unreferenced(_ruleset([by_ref, in_template])) == ("CopySource",)
    undeclared = {"version": "1.0", "parameters": {"Bucket": {}}, "rules": []}
    assert s3_endpoints.unreferenced(undeclared) == ()


def test_the_installed_s3_rule_set_names_none_of_them() -> None:
    """Fails when a botocore upgrade brings rules that use them (they then stay)."""
    ruleset = loaders.create_loader().load_service_model("s3", "endpoint-rule-set-1")
    assert s3_endpoints.unreferenced(ruleset) == s3_endpoints.UNREFERENCED


def test_a_client_without_a_rule_set_resolver_is_left_alone() -> None:
    assert s3_endpoints.make_cacheable(object()) == ()
