"""Test certificates made with the `openssl` command line, for the servers'
TLS and client-authentication tests (test_verifiers.py here and
../env-server/test_envs.py): CAs, a server certificate for 127.0.0.1 and
client certificates, with or without a SPIFFE ID. Nothing here is used by
the servers themselves."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from typing import Optional

CURVE = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def available() -> bool:
    return shutil.which("openssl") is not None


def _run(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class Pki:
    """Files in `directory`; each method returns PEM bytes."""

    def __init__(self, directory: str):
        self.dir = directory

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def ca(self, name: str) -> bytes:
        """A self-signed CA: NAME.crt, NAME.key."""
        _run("req", "-x509", *CURVE, "-days", "2", "-subj", f"/CN={name}",
             "-keyout", self.path(f"{name}.key"), "-out", self.path(f"{name}.crt"),
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        return _read(self.path(f"{name}.crt"))

    def leaf(self, ca: str, name: str, server: bool = False,
             spiffe: Optional[str] = None) -> tuple:
        """(certificate, key) NAME.crt/NAME.key issued by CA `ca`: a
        server certificate for 127.0.0.1 and localhost, or a client one,
        with SAN URI `spiffe` when given."""
        key, csr, crt = (self.path(f"{name}.{x}") for x in ("key", "csr", "crt"))
        ext = self.path(f"{name}.ext")
        sans = ["IP:127.0.0.1", "DNS:localhost"] if server else []
        if spiffe:
            sans.append(f"URI:{spiffe}")
        lines = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature",
                 f"extendedKeyUsage={'serverAuth' if server else 'clientAuth'}"]
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        with open(ext, "w") as f:
            f.write("\n".join(lines) + "\n")
        _run("req", "-new", *CURVE, "-subj", f"/CN={name}", "-keyout", key, "-out", csr)
        _run("x509", "-req", "-in", csr, "-CA", self.path(f"{ca}.crt"), "-CAkey",
             self.path(f"{ca}.key"), "-set_serial", str(secrets.randbits(63)), "-days", "2",
             "-extfile", ext, "-out", crt)
        return _read(crt), _read(key)
