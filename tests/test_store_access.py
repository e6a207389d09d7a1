"""How processes reach etcd (`StoreAccess`, its options) and the spec check every reader makes.

Fast: no etcd, no processes (certificates are written to a temporary directory).
"""

from __future__ import annotations

import argparse
import math
import os
import ssl
import stat

import pytest

from transom.job_spec import ConfigError, JobSpec
from transom.store import Store, StoreAccess, StoreError
from transom.store import access as store_access
from transom.store.spec import parse_spec
from transom.store.tls import write_certificates


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return write_certificates(tmp_path_factory.mktemp("store") / "tls", ["10.0.0.7"])


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    store_access.add_store_options(parser, required=False)
    return parser.parse_args(argv)


# -- StoreAccess ----------------------------------------------------------------------------------


def test_options_round_trip_through_argv(tls):
    argv = ["--store", "https://10.0.0.7:2379", "--store-ca", str(tls.ca)]
    argv += ["--store-cert", str(tls.client_cert), "--store-key", str(tls.client_key)]
    access = store_access.from_args(_parse(argv))
    assert access == StoreAccess("https://10.0.0.7:2379", tls.ca, tls.client_cert, tls.client_key)
    assert access.argv() == argv
    assert store_access.from_args(_parse(access.argv())) == access
    assert (access.scheme, access.host, access.port) == ("https", "10.0.0.7", 2379)
    assert access.warning() is None
    assert store_access.from_args(_parse([])) is None


def test_the_store_client_gets_the_tls_files(tls):
    access = StoreAccess("https://10.0.0.7:2379", tls.ca, tls.client_cert, tls.client_key)
    client = Store(access, "j").client
    assert client.session.verify == str(tls.ca)  # the watch streams'
    assert client.session.cert == (str(tls.client_cert), str(tls.client_key))
    context = client.tls  # every other request's (its client certificate: test_store.py)
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    ca = ssl.PEM_cert_to_DER_cert(tls.ca.read_text())
    assert context.get_ca_certs(binary_form=True) == [ca]  # this CA only, not a bundle
    assert Store("http://127.0.0.1:2379", "j").access == StoreAccess("http://127.0.0.1:2379")


def test_relative_files_become_absolute(tls, monkeypatch):
    monkeypatch.chdir(tls.directory)
    access = StoreAccess("https://h:1", ca=tls.ca.name)  # type: ignore[arg-type]
    assert access.ca == tls.ca and access.argv()[-1] == str(tls.ca)


def test_plain_http_to_another_machine_is_warned_about():
    warning = StoreAccess("http://10.0.0.7:2379").warning()
    assert warning is not None and "unauthenticated" in warning and "\n" not in warning
    for quiet in ("http://127.0.0.1:2379", "http://localhost:1", "https://10.0.0.7:2379"):
        assert StoreAccess(quiet).warning() is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"url": "ftp://h:1"}, "bad store URL"),
        ({"url": "http://h:notaport"}, "bad store URL"),
        ({"url": "http://"}, "bad store URL"),
        ({"url": "http://h:1", "ca": "CA"}, "need an https://"),
        ({"url": "https://h:1", "cert": "CERT"}, "go together"),
        ({"url": "https://h:1", "ca": "/nonexistent/ca.crt"}, "not a readable file"),
    ],
)
def test_bad_access_is_refused(tls, kwargs, message):
    files = {"CA": tls.ca, "CERT": tls.client_cert}
    kwargs = {k: files.get(v, v) for k, v in kwargs.items()}
    with pytest.raises(StoreError, match=message):
        StoreAccess(**kwargs)


def test_certificate_options_need_a_store(tls):
    with pytest.raises(StoreError, match="only with --store"):
        store_access.from_args(_parse(["--store-ca", str(tls.ca)]))


def test_certificates_are_written_private_and_anew(tls):
    assert stat.S_IMODE(os.stat(tls.directory).st_mode) == 0o700
    before = tls.ca.read_bytes()
    os.chmod(tls.ca, 0o644)
    again = write_certificates(tls.directory, [])
    assert again.ca.read_bytes() != before  # a new CA each time
    for path in tls.directory.iterdir():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


def test_the_checkpoint_server_takes_the_same_options(tls):
    from transom.checkpoint import server_options

    access = StoreAccess("https://10.0.0.7:2379", tls.ca, tls.client_cert, tls.client_key)
    argv = server_options.to_argv(node_id="n1", job_id="j", **server_options.store_options(access))
    assert argv[4:] == access.argv()
    parsed = server_options.build_parser().parse_args(argv)
    cfg = server_options.from_args(parsed, environ={"TRANSOM_CKPT_SECRET": "s"})
    assert cfg.store_access() == access
    lone_cert = server_options.build_parser().parse_args(["--store-ca", str(tls.ca)])
    with pytest.raises(ValueError, match="need --store"):
        server_options.from_args(lone_cert, environ={})


# -- the spec as read back from etcd --------------------------------------------------------------


def _spec(**changes) -> dict:
    return JobSpec(script=__file__, job_id="j1").to_dict() | changes


def test_a_good_spec_passes():
    spec = parse_spec(_spec(evict_window_s=12), "j1", check_script=True)
    assert spec.script == __file__ and spec.evict_window_s == 12.0
    elsewhere = parse_spec(_spec(script="elsewhere.py"), "j1", check_script=False)
    assert elsewhere.script == "elsewhere.py"


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "expected an object"),
        (["not", "a", "spec"], "expected an object"),
        ({"job_id": "j1"}, "missing field 'script'"),
        (_spec(script_args="--lr 1"), "script_args"),
        (_spec(script_args=["ok", 3]), "script_args"),
        (_spec(nnodes_min="2"), "nnodes_min"),
        (_spec(nproc_per_node=True), "nproc_per_node"),
        (_spec(warm_workers="yes"), "warm_workers"),
        (_spec(faults={"type": "crash"}), "faults"),
        (_spec(hang_floor_s=math.nan), "--hang-floor nan"),
        (_spec(join_timeout_s=-1), "--join-timeout"),
        (_spec(spares=-1), "--spares"),
        (_spec(job_id="../../x"), "--job-id"),
        (_spec(job_id="other"), "names job 'other'"),
        (_spec(script=""), "not a file name"),
        (_spec(script="a\0b"), "not a file name"),
        (_spec(script_args=["a\0b"]), "NUL"),
        (_spec(script="/nonexistent/train.py"), "script not found"),
        (_spec(faults=[{"type": "format-disk", "id": "f0"}]), "fault 0: 'format-disk'"),
        (_spec(faults=[{"type": "crash", "step": "x", "id": "f0"}]), "faults[0]: Fault.step"),
        (_spec(faults=[{"type": "crash"}]), "faults[0]: Fault: missing field 'id'"),
    ],
)
def test_a_bad_spec_is_one_clear_error(value, message):
    with pytest.raises(ConfigError, match="refused") as refused:
        parse_spec(value, "j1", check_script=True)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_every_process_the_launcher_starts_reaches_etcd_the_same_way(tls, tmp_path):
    from transom.launcher import Launch, Launcher

    access = StoreAccess("https://10.0.0.7:2379", tls.ca, tls.client_cert, tls.client_key)
    spec = JobSpec(script=__file__, job_id="j1", nnodes_min=2, nnodes_max=2)
    launcher = Launcher(Launch(spec=spec, run_dir=tmp_path, store=access, local_nodes=2))
    launcher.store = Store(access, spec.job_id)  # what `run` connects; nothing is started here
    children = launcher._children()
    assert {c.kind for c in children} == {"agent"}  # candidates start once their nodes are live
    argvs = [c.argv for c in children] + [launcher._argv("controller")]
    for argv in argvs:
        at = argv.index("--store")
        assert argv[at : at + 8] == access.argv(), argv


def test_the_environment_cannot_replace_the_stores_ca(tls, monkeypatch):
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/elsewhere/ca.pem")
    access = StoreAccess("https://10.0.0.7:2379", tls.ca, tls.client_cert, tls.client_key)
    session = Store(access, "j").client.session
    settings = session.merge_environment_settings("https://10.0.0.7:2379/v3/", {}, None, None, None)
    assert settings["verify"] == str(tls.ca)


def test_commands_warn_in_one_line_about_plain_http_to_another_machine(capsys):
    from transom import cli

    parser = cli.build_parser()
    store = ["--store", "http://10.0.0.7:2379"]
    for argv in (["status", *store], ["agent", *store, "--job-id", "j"], ["run", *store, "t.py"]):
        args = parser.parse_args(argv)
        assert cli._store(args) == StoreAccess("http://10.0.0.7:2379")
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "unauthenticated" in err[0], argv
    cli._store(parser.parse_args(["status", "--store", "http://127.0.0.1:2379"]))
    assert capsys.readouterr().err == ""
