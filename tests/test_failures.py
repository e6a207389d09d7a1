"""Unit tests for transom/control/failures.py: what a worker's exit and log tail mean."""

from __future__ import annotations

import pytest

from transom.control.failures import LOG_TAIL_BYTES, classify_exit, read_tail

TRACEBACK = """\
step 1 loss 0.5
step 2 loss 0.4
Traceback (most recent call last):
  File "/tmp/train.py", line 12, in <module>
    main()
  File "/tmp/train.py", line 9, in main
    raise ValueError("bad shape: (3, 4)")
ValueError: bad shape: (3, 4)
"""

CHAINED = """\
Traceback (most recent call last):
  File "/tmp/train.py", line 3, in <module>
    x = d["k"]
KeyError: 'k'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/tmp/train.py", line 5, in <module>
    raise RuntimeError("no key")
RuntimeError: no key
"""

GLOO_PEER = """\
Traceback (most recent call last):
  File "/tmp/train.py", line 30, in <module>
    loss.backward()
  File "/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 347, in backward
    _engine_run_backward(
RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer \
[127.0.0.1]:62701. This is typically caused by a remote worker crashing.
"""


def _log(tmp_path, text: str, name: str = "rank0.log"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_traceback_gives_the_exception_line(tmp_path):
    f = classify_exit(3, 1, 1, _log(tmp_path, TRACEBACK))
    assert f.signature == "ValueError: bad shape: (3, 4)"
    assert f.signal is None
    assert f.peer_error is False
    assert (f.rank, f.local_rank, f.exitcode) == (3, 1, 1)
    assert f.describe == "rank 3 exit code 1: ValueError: bad shape: (3, 4)"
    d = f.to_dict()
    assert d["signature"] == f.signature and d["log"] == str(tmp_path / "rank0.log")


def test_chained_traceback_gives_the_last_exception(tmp_path):
    f = classify_exit(0, 0, 1, _log(tmp_path, CHAINED))
    assert f.signature == "RuntimeError: no key"


def test_qualified_exception_name(tmp_path):
    text = TRACEBACK.replace(
        "ValueError: bad shape: (3, 4)", "torch.OutOfMemoryError: CUDA out of memory."
    )
    f = classify_exit(0, 0, 1, _log(tmp_path, text))
    assert f.signature == "torch.OutOfMemoryError: CUDA out of memory."


def test_rank_prefixed_traceback_gives_the_exception_line(tmp_path):
    # Exactly what torch 2.x writes for `raise ValueError("bad shape")` after init_process_group.
    text = "".join(f"[rank0]: {line}\n" for line in TRACEBACK.splitlines()[2:])
    f = classify_exit(0, 0, 1, _log(tmp_path, text))
    assert f.signature == "ValueError: bad shape: (3, 4)"


@pytest.mark.parametrize(
    "code, name", [(-9, "SIGKILL"), (-15, "SIGTERM"), (-11, "SIGSEGV"), (-6, "SIGABRT")]
)
def test_negative_exit_code_gives_the_signal_name(tmp_path, code, name):
    f = classify_exit(1, 1, code, _log(tmp_path, "step 1 loss 0.5\n"))
    assert f.signal == name
    assert f.signature is None
    assert f.peer_error is False
    assert f.describe == f"rank 1 killed by {name}"


def test_unknown_signal_number(tmp_path):
    f = classify_exit(0, 0, -200, _log(tmp_path, ""))
    assert f.signal == "signal 200"


def test_a_killed_worker_is_never_a_peer_error(tmp_path):
    f = classify_exit(0, 0, -9, _log(tmp_path, GLOO_PEER))
    assert f.signal == "SIGKILL"
    assert f.peer_error is False


def test_gloo_connection_closed_by_peer_is_a_peer_error(tmp_path):
    f = classify_exit(0, 0, 1, _log(tmp_path, GLOO_PEER))
    assert f.peer_error is True
    assert f.signal is None
    assert f.signature.startswith("RuntimeError: [")
    assert "Connection closed by peer" in f.signature


def test_a_worker_that_aborts_on_a_broken_collective_is_a_peer_error(tmp_path):
    """gloo sometimes turns "Connection closed by peer" into std::terminate: SIGABRT, same error."""
    f = classify_exit(2, 0, -6, _log(tmp_path, GLOO_PEER))
    assert f.signal == "SIGABRT" and f.peer_error is True
    assert classify_exit(2, 0, -6, _log(tmp_path, TRACEBACK)).peer_error is False


def test_a_rank_whose_copies_were_good_when_another_ranks_were_not_is_a_peer_error(tmp_path):
    from transom.checkpoint.client import PEER_COPIES_BAD

    raised = (
        'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n'
        f"transom.checkpoint.client.CheckpointError: no step could be loaded by every rank "
        f"({PEER_COPIES_BAD})\n"
    )
    assert classify_exit(1, 1, 1, _log(tmp_path, raised)).peer_error is True
    own = raised.replace(f"({PEER_COPIES_BAD})", ": step 20 rank 0: no good copy in any tier")
    assert classify_exit(0, 0, 1, _log(tmp_path, own)).peer_error is False


def test_an_ordinary_error_is_not_a_peer_error(tmp_path):
    assert classify_exit(0, 0, 1, _log(tmp_path, TRACEBACK)).peer_error is False


def test_empty_log_gives_no_signature(tmp_path):
    f = classify_exit(0, 0, 1, _log(tmp_path, ""))
    assert f.signature is None
    assert f.peer_error is False
    assert f.describe == "rank 0 exit code 1"


def test_missing_log_gives_no_signature(tmp_path):
    f = classify_exit(2, 0, 3, tmp_path / "never-written.log")
    assert f.signature is None
    assert f.signal is None
    assert f.peer_error is False
    assert f.log == str(tmp_path / "never-written.log")


def test_indented_source_lines_are_not_signatures(tmp_path):
    text = 'Traceback (most recent call last):\n  File "x.py", line 1\n    raise ValueError("x")\n'
    assert classify_exit(0, 0, 1, _log(tmp_path, text)).signature is None


def test_read_tail_reads_only_the_end(tmp_path):
    path = tmp_path / "big.log"
    path.write_text("x" * (3 * LOG_TAIL_BYTES) + "\nValueError: at the end\n")
    tail = read_tail(path)
    assert len(tail) == LOG_TAIL_BYTES
    assert tail.endswith("ValueError: at the end\n")
    assert classify_exit(0, 0, 1, path).signature == "ValueError: at the end"
