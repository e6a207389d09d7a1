"""benchmarks/isolation.py and `benchmarks.job_overhead --isolate-ranks`: the ranks end up on cores
of their own and everything else on the others (the pinning, not the speed)."""

from __future__ import annotations

import os

import pytest

from benchmarks import isolation, last_json, run_module


def test_the_last_cores_go_to_the_ranks_and_the_rest_keep_at_least_one():
    assert isolation.split([0, 1], isolation.ranks_for([0, 1])) == isolation.Cores((1,), (0,))
    assert isolation.split(range(8), isolation.ranks_for(range(8))) == isolation.Cores(
        (4, 5, 6, 7), (0, 1, 2, 3)
    )
    assert isolation.ranks_for([3]) == 1
    with pytest.raises(ValueError, match="need more than 1 cores"):
        isolation.split([3], 1)
    with pytest.raises(ValueError):
        isolation.split([0, 1], 0)


@pytest.mark.e2e
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to isolate one")
def test_isolate_ranks_pins_every_rank_of_both_systems_to_its_own_core(tmp_path):
    """One pair of tiny jobs: each system's rank seen only on the ranks' core, every other
    process only on the others."""
    available = sorted(os.sched_getaffinity(0))
    cores = isolation.split(available, isolation.ranks_for(available))
    out = run_module(
        ["benchmarks.job_overhead", "--isolate-ranks", "--pairs", "1"]
        + ["--steps", "400", "--ckpt-every", "100", "--requests-every", "0.5", "--json"],
        timeout_s=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = last_json(out.stdout)
    assert result["isolated"] == cores.to_dict()
    for pinned in result["pinned_pairs"][0]:  # torchrun's job, then Transom's
        assert pinned["ranks"], pinned  # a rank was seen and pinned
        for rank_cores in pinned["ranks"].values():
            assert set(rank_cores) <= set(cores.ranks), pinned
        assert pinned["rest"] and set(pinned["rest"]) <= set(cores.rest), pinned
    for name in ("step_rate_x", "ramp_delta_s", "startup_delta_s"):
        assert len(result[f"{name}_ci95"]) == 2 and name in result["targets"]
