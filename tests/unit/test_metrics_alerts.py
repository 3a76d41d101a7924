"""deploy/prometheus/ alert rules: well-formed, and every metric they use is
one the agent exports (a renamed metric must not silently disable an alert).
With `promtool` on PATH (Debian's `prometheus` package) the rules are also
checked by Prometheus itself and exercised on synthetic series."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tierckpt.service.observability import metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "tierckpt-alerts.yml"

# Families computed from the catalog at scrape time (observability/catalog.py).
CATALOG_FAMILIES = {
    "tierckpt_jobs",
    "tierckpt_jobs_retrying",
    "tierckpt_oldest_job_age_seconds",
    "tierckpt_replicas",
    "tierckpt_pending_bytes",
    "tierckpt_replication_lag_seconds",
    "tierckpt_checkpoints",
    "tierckpt_last_durable_timestamp_seconds",
    "tierckpt_last_durable_step",
    "tierckpt_last_registered_timestamp_seconds",
    "tierckpt_last_registered_step",
    "tierckpt_catalog_up",
    "tierckpt_catalog_scrape_duration_seconds",
    "tierckpt_agent_info",
    "tierckpt_worker_busy_jobs",
}


def exported_names() -> set[str]:
    names = set(CATALOG_FAMILIES)
    for family in metrics.REGISTRY.collect():
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_count", "_sum"))
    return names


def rules() -> list[dict]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_rules_are_well_formed_and_use_exported_metrics():
    known = exported_names()
    found = rules()
    assert len(found) >= 8
    names = [rule["alert"] for rule in found]
    assert len(set(names)) == len(names)
    for rule in found:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"]
        used = set(re.findall(r"\btierckpt_[a-z_]+\b", rule["expr"]))
        assert used, rule["alert"]
        assert used <= known, (rule["alert"], used - known)


def test_the_issue_asks_for_these_alerts():
    exprs = {rule["alert"]: rule["expr"] for rule in rules()}
    assert "tierckpt_last_durable_timestamp_seconds" in exprs["TierckptRecoveryPointTooOld"]
    assert "tierckpt_replication_lag_seconds" in exprs["TierckptReplicationLagHigh"]
    assert 'state="corrupt"' in exprs["TierckptCorruptReplicas"]
    assert 'kind=~"upload|commit"' in exprs["TierckptUploadsFailing"]


PROMTOOL_TEST = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # Run "stuck": last durable checkpoint registered at t=0, keeps registering.
      - series: 'tierckpt_last_durable_timestamp_seconds{{run="stuck",region="east"}}'
        values: '0x120'
      - series: 'tierckpt_last_registered_timestamp_seconds{{run="stuck"}}'
        values: '0+60x120'
      # Region west: a checkpoint waiting 40 min for its copy.
      - series: 'tierckpt_replication_lag_seconds{{region="west"}}'
        values: '2400x30'
      - series: 'tierckpt_replicas{{region="west",state="corrupt"}}'
        values: '0x30'
    alert_rule_test:
      - eval_time: 50m
        alertname: TierckptRecoveryPointTooOld
        exp_alerts: []
      - eval_time: 80m
        alertname: TierckptRecoveryPointTooOld
        exp_alerts:
          - exp_labels: {{severity: critical, run: stuck}}
            exp_annotations:
              summary: "Run stuck: last durable checkpoint is 1h 20m 0s old"
              description: >-
                Checkpoints are registered but none became valid recently. Check the
                upload jobs (tierckpt_jobs{{kind="upload"}}) and the primary region.
      - eval_time: 20m
        alertname: TierckptReplicationLagHigh
        exp_alerts:
          - exp_labels: {{severity: warning, region: west}}
            exp_annotations:
              summary: "Region west: replication lag 40m 0s"
              description: >-
                Replicate jobs into this region are failing or slow (a region outage
                only delays them). See tierckpt_jobs_retrying{{kind="replicate"}} and
                the run pages of the dashboard (/ui) for the errors.
      - eval_time: 20m
        alertname: TierckptCorruptReplicas
        exp_alerts: []
"""


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian: prometheus) absent")
def test_promtool_checks_and_fires_the_rules(tmp_path):
    check = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(PROMTOOL_TEST.format(rules=RULES))
    run = subprocess.run(
        ["promtool", "test", "rules", str(spec)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr
