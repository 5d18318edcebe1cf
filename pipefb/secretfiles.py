"""Files only their user may read: the tokens of a local cluster, and where a client of
a coordinator finds that cluster's user token ([Note: access] in protos/security.py)."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from pipefb.errors import ConfigError

TOKEN_DIR_ENV = "PIPEFB_TOKEN_DIR"  # where local clusters leave their user tokens


def token_path(address: str, env: Mapping[str, str] | None = None) -> Path:
    """Where a local cluster whose coordinator serves `address` leaves its user token:
    `$PIPEFB_TOKEN_DIR` (default `~/.config/pipefb/tokens`), one file per address."""
    env = os.environ if env is None else env
    folder = env.get(TOKEN_DIR_ENV) or str(Path.home() / ".config" / "pipefb" / "tokens")
    return Path(folder) / address.replace(":", "_").replace("/", "_")


def write_private(path: Path, text: str) -> Path:
    """Writes `text` to `path`, readable and writable by this user only (0600), in a
    folder only this user may enter (0700)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text + "\n")
    return path


def read_private(path: Path) -> str:
    """The token in `path`, a file only its owner may read or write.

    Raises:
        ConfigError: others may read or write the file, or it is empty.
    """
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"token file {str(path)!r} is open to others (mode "
                          f"{stat.S_IMODE(mode):o}): chmod 600 it")
    token = path.read_text().strip()
    if not token:
        raise ConfigError(f"token file {str(path)!r} is empty")
    return token


def verifier(token: str) -> str:
    """The hex SHA-256 of `token`: what a worker holds to recognise the coordinator's
    credential ([Note: access] in protos/security.py). The credential is 32 random bytes,
    so the hash gives nothing to guess from and nothing to send."""
    return hashlib.sha256(token.encode()).hexdigest()
