"""Certificates for the embedded etcd: a per-run CA, a server and a client certificate.

`write_certificates` makes a fresh CA, signs with it a server certificate (for etcd: valid for
127.0.0.1, localhost and the address etcd listens on) and a client certificate (for every
Transom process of the job), and writes them, each file mode 0600, into a directory of mode
0700. The CA's private key is never written: once the files exist nobody can sign another
certificate the job's etcd would trust. This module must never start a process or talk to etcd.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough for any training run; the CA (and so every certificate) is made anew each run.
VALID_FOR = datetime.timedelta(days=365)
# Tolerates a clock a little behind the one that signed.
BACKDATE = datetime.timedelta(hours=1)

CA_FILE = "ca.crt"
SERVER_CERT_FILE = "server.crt"
SERVER_KEY_FILE = "server.key"
CLIENT_CERT_FILE = "client.crt"
CLIENT_KEY_FILE = "client.key"


class TlsError(RuntimeError):
    """The certificate directory cannot be made private, or a file cannot be written."""


@dataclass(frozen=True)
class TlsFiles:
    """Where one run's certificates are."""

    directory: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def write_certificates(directory: Path, hosts: list[str]) -> TlsFiles:
    """A new CA, server certificate (for 127.0.0.1, localhost and `hosts`) and client
    certificate in `directory` (created mode 0700; files 0600, replacing any old ones)."""
    directory = _private_directory(Path(directory))
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("transom per-run CA")
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(sign_certificates=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    # etcd's own gateway dials etcd with the server certificate, so it must be a client's too.
    server_key, server = _leaf(
        ca,
        ca_key,
        "transom etcd",
        now,
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        _alt_names(["127.0.0.1", "localhost", *hosts]),
    )
    client_key, client = _leaf(
        ca, ca_key, "transom client", now, [ExtendedKeyUsageOID.CLIENT_AUTH], None
    )
    files = TlsFiles(
        directory,
        ca=directory / CA_FILE,
        server_cert=directory / SERVER_CERT_FILE,
        server_key=directory / SERVER_KEY_FILE,
        client_cert=directory / CLIENT_CERT_FILE,
        client_key=directory / CLIENT_KEY_FILE,
    )
    _write_private(files.ca, _pem(ca))
    _write_private(files.server_cert, _pem(server))
    _write_private(files.server_key, _pem_key(server_key))
    _write_private(files.client_cert, _pem(client))
    _write_private(files.client_key, _pem_key(client_key))
    return files


def _private_directory(directory: Path) -> Path:
    """`directory`, created if needed, owned by this user and mode 0700; TlsError if it is not."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise TlsError(f"{directory} is not a directory of this user; refusing to use it")
        os.chmod(directory, 0o700)
    except OSError as e:
        raise TlsError(f"cannot make the certificate directory {directory}: {e}") from e
    return directory.resolve()


def _write_private(path: Path, data: bytes) -> None:
    """Write `path` anew with mode 0600 (an old file or link of that name is removed first)."""
    try:
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError as e:
        raise TlsError(f"cannot write {path}: {e}") from e


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePublicKey, now: datetime.datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + VALID_FOR)
    )


def _key_usage(sign_certificates: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not sign_certificates,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=sign_certificates,
        crl_sign=sign_certificates,
        encipher_only=False,
        decipher_only=False,
    )


def _leaf(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    now: datetime.datetime,
    usages: list[x509.ObjectIdentifier],
    alt_names: x509.SubjectAlternativeName | None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(_name(common_name), ca.subject, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(sign_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
    )
    if alt_names is not None:
        builder = builder.add_extension(alt_names, critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def _alt_names(hosts: list[str]) -> x509.SubjectAlternativeName:
    """IP addresses as IP entries, names as DNS entries, each once."""
    entries: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
