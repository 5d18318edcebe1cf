"""Test certificates made with the `openssl` command: a CA and certificates it signs, for
the local smoke run of the manifests and the security tests. Not for production: there,
certificates come from your PKI or cert-manager (docs/deploy.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: names every certificate made here is valid for: loopback, and the name the manifests
#: make clients check (PIPEFB_TLS_SERVER_NAME)
NAMES = "IP:127.0.0.1,DNS:localhost,DNS:pipefb"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA valid for 2 days: (certificate, key)."""
    key, cert = folder / f"{name}.key", folder / f"{name}.crt"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
             str(cert), "-days", "2", "-subj", f"/CN={name}")
    return cert, key


def make_signed(folder: Path, name: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    """A certificate for `NAMES`, for servers and clients alike, signed by `ca`:
    (certificate, key)."""
    key, csr, cert = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.crt"
    ext = folder / f"{name}.ext"
    ext.write_text(f"subjectAltName={NAMES}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
             "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return cert, key


def tls_secret(folder: Path) -> dict[str, str]:
    """The keys of a pipefb-tls Secret (tls.crt, tls.key, ca.crt), freshly made."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = make_ca(folder, "pipefb-ca")
    cert, key = make_signed(folder, "pipefb", ca)
    return {"tls.crt": cert.read_text(), "tls.key": key.read_text(), "ca.crt": ca[0].read_text()}
