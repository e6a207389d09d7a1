"""`StoreAccess`: how a process reaches the job's etcd (its URL and TLS files), defined once.

The options `--store URL --store-ca F --store-cert F --store-key F` mean what etcdctl's
`--endpoints --cacert --cert --key` mean. Every command that talks to etcd takes them
(`add_store_options`, `from_args`), and a process that starts another one hands them on with
`argv()`, so the launcher, controller candidates, agents and the checkpoint servers all reach
etcd the same way. `Store` (etcd_client.py) builds its client from a `StoreAccess`.

This module checks options and files; it must never connect to etcd or start anything.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

FLAG_URL = "--store"
FLAG_CA = "--store-ca"
FLAG_CERT = "--store-cert"
FLAG_KEY = "--store-key"

DEFAULT_PORT = 2379
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class StoreError(RuntimeError):
    """etcd cannot be reached or refused a request, or the options to reach it are bad."""


@dataclass(frozen=True)
class StoreAccess:
    """The URL of the job's etcd and, for https, the files that authenticate both ends.

    `ca`: the CA certificate etcd's server certificate must be signed by (None: the system's);
    `cert`, `key`: this client's certificate and key (both or neither). StoreError if the URL
    is bad, a file is given for plain http, or a file cannot be read.
    """

    url: str
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        self._parsed()  # a bad URL fails here, not at the first request
        if (self.cert is None) != (self.key is None):
            raise StoreError(f"{FLAG_CERT} and {FLAG_KEY} go together: give both or neither")
        given = [(flag, path) for flag, path in self._files() if path is not None]
        if given and self.scheme != "https":
            raise StoreError(
                f"{' '.join(flag for flag, _ in given)}: need an https:// {FLAG_URL} URL, "
                f"not {self.url}"
            )
        for flag, path in given:
            absolute = Path(os.path.abspath(path))
            if not absolute.is_file() or not os.access(absolute, os.R_OK):
                raise StoreError(f"{flag} {path}: not a readable file")
            object.__setattr__(self, _FIELD_OF_FLAG[flag], absolute)

    def _files(self) -> list[tuple[str, Path | None]]:
        return [(FLAG_CA, self.ca), (FLAG_CERT, self.cert), (FLAG_KEY, self.key)]

    # -- the URL ------------------------------------------------------------------------------
    def _parsed(self) -> tuple[str, str, int]:
        url = self.url
        parsed = urlparse(url if "://" in url else f"http://{url}")
        try:
            port = parsed.port or DEFAULT_PORT
        except ValueError:
            port = None
        if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
            raise StoreError(f"bad store URL {url!r}: expected http(s)://HOST:PORT")
        return parsed.scheme, parsed.hostname, port

    @property
    def scheme(self) -> str:
        return self._parsed()[0]

    @property
    def host(self) -> str:
        return self._parsed()[1]

    @property
    def port(self) -> int:
        return self._parsed()[2]

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS

    # -- handing it on ------------------------------------------------------------------------
    def argv(self) -> list[str]:
        """The options that give a child process this same access."""
        out = [FLAG_URL, self.url]
        for flag, path in self._files():
            if path is not None:
                out += [flag, str(path)]
        return out

    def warning(self) -> str | None:
        """One line for a job whose etcd anyone on the network may read and write, else None."""
        if self.scheme == "http" and not self.loopback:
            return (
                f"warning: {FLAG_URL} {self.url} is plain http: anyone who can reach it can "
                f"read and write this job unauthenticated (use https with {FLAG_CA}, "
                f"{FLAG_CERT}, {FLAG_KEY})"
            )
        return None


_FIELD_OF_FLAG = {FLAG_CA: "ca", FLAG_CERT: "cert", FLAG_KEY: "key"}


def add_store_options(parser: argparse.ArgumentParser, required: bool, default: str = "") -> None:
    """`--store` (required or not; `default` says in words what happens without it) and the
    TLS files that go with it."""
    parser.add_argument(
        FLAG_URL,
        dest="store",
        required=required,
        metavar="URL",
        help="etcd of the job, e.g. https://10.0.0.1:2379" + (f" ({default})" if default else ""),
    )
    parser.add_argument(
        FLAG_CA, dest="store_ca", type=Path, metavar="FILE", help="CA certificate of etcd's server"
    )
    parser.add_argument(
        FLAG_CERT,
        dest="store_cert",
        type=Path,
        metavar="FILE",
        help="client certificate for etcd",
    )
    parser.add_argument(
        FLAG_KEY, dest="store_key", type=Path, metavar="FILE", help="client key for etcd"
    )


def from_args(args: argparse.Namespace) -> StoreAccess | None:
    """The access `add_store_options` parsed; None without --store (StoreError if TLS files
    were given without it)."""
    files = {
        FLAG_CA: getattr(args, "store_ca", None),
        FLAG_CERT: getattr(args, "store_cert", None),
        FLAG_KEY: getattr(args, "store_key", None),
    }
    if args.store is None:
        given = [flag for flag, path in files.items() if path is not None]
        if given:
            raise StoreError(f"{' '.join(given)}: only with {FLAG_URL}")
        return None
    return StoreAccess(args.store, files[FLAG_CA], files[FLAG_CERT], files[FLAG_KEY])
