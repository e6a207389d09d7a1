"""How a stuck rank's stack is said in one line (transom.monitor.stacks): the library call and
the script's line, and ranks in the same place together, stopped ones first."""

from __future__ import annotations

import pytest

from transom.monitor import stacks


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        (
            [
                ("/x/site-packages/torch/distributed/distributed_c10d.py", 10, "all_reduce"),
                ("/x/site-packages/torch/distributed/c10d_logger.py", 5, "wrapper"),
                ("/home/u/train.py", 57, "<module>"),
            ],
            "in all_reduce at train.py:57",
        ),
        (
            [
                ("/x/site-packages/torch/autograd/graph.py", 8, "_engine_run_backward"),
                ("/x/site-packages/torch/autograd/__init__.py", 7, "backward"),
                ("/x/site-packages/torch/_tensor.py", 6, "backward"),
                ("/x/site-packages/transformers/trainer.py", 5, "train"),
                ("/home/u/train_hf.py", 73, "<module>"),
            ],
            "in backward, from train at train_hf.py:73",
        ),
        ([("/home/u/train.py", 9, "loop")], "at train.py:9 in loop"),
        ([("/x/site-packages/torch/a.py", 3, "f")], "in f at a.py:3"),
        ([], "no Python stack"),
    ],
)
def test_where_names_the_library_call_and_the_scripts_line(frames, expected):
    assert stacks.where([stacks.Frame(*f) for f in frames]) == expected


def test_group_where_puts_ranks_in_the_same_place_together():
    text = stacks.group_where(
        {2: "in all_reduce at t.py:5", 1: "stopped", 0: "in all_reduce at t.py:5"}
    )
    assert text == "rank 1: stopped; ranks 0, 2: in all_reduce at t.py:5"
