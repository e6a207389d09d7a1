"""`python -m benchmarks.etcd_requests`: one short job, its requests a node a second by method
and its control plane's CPU a node by kind (the machinery, not the numbers)."""

from __future__ import annotations

import pytest

from benchmarks import last_json, run_module


@pytest.mark.e2e
def test_a_short_job_prints_its_requests_a_node_a_second_by_method():
    out = run_module(
        ["benchmarks.etcd_requests", "--runs", "1", "--steps", "300"]
        + ["--requests-every", "0.5", "--json"],
        timeout_s=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = last_json(out.stdout)
    per_node = result["per_node_s"]
    assert per_node["total"] > 0 and "LeaseKeepAlive" in per_node, per_node
    assert per_node["total"] == pytest.approx(sum(v for k, v in per_node.items() if k != "total"))
    assert "requests a node a second" in out.stdout
    cores = result["cores_per_node"]  # the control plane's CPU a node, by kind and in all
    assert set(cores) == {"etcd", "agents", "controllers", "launcher", "total"}, cores
    assert cores["agents"] > 0 and cores["total"] == pytest.approx(
        sum(v for k, v in cores.items() if k != "total")
    )
    assert "control plane, cores a node" in out.stdout
