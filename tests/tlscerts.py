"""Certificates made at test time with the `openssl` command (OpenSSL 3 on these machines): a CA,
and leaf certificates it signs for servers and clients (P-256 keys: fast to make)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class CA:
    cert: str
    key: str
    dir: Path

    def issue(self, name: str, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> tuple[str, str]:
        """(certificate, key) files for `name`, valid for `hosts` (IP or DNS names), usable by a
        server and as a client certificate."""
        d = self.dir
        sans = ",".join(f"IP:{h}" if h[0].isdigit() or ":" in h else f"DNS:{h}" for h in hosts)
        (d / f"{name}.ext").write_text(f"subjectAltName={sans}\nbasicConstraints=CA:FALSE\n"
                                       "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n")
        _openssl("req", "-new", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", self.cert, "-CAkey", self.key, "-CAcreateserial",
                 "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d)
        return str(d / f"{name}.pem"), str(d / f"{name}.key")


def make_ca(directory: Path, name: str = "test-ca") -> CA:
    d = Path(directory) / name
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)
    return CA(str(d / "ca.pem"), str(d / "ca.key"), d)
