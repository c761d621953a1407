"""Tenant cache salts: one scheme for prefix blocks, KV tiers and answers (seed 003: "a prefix
cache is a timing side channel: scope it to a trust group").

With tenants (`--api-keys`), the salt the engine hashes into a request's first KV block (and so
into every block hash, on the device and in a disk or Redis tier) is

    "tenant-" + hex(HMAC-SHA256(secret, lp(tenant) || 0x00))                 no cache_salt
    "tenant-" + hex(HMAC-SHA256(secret, lp(tenant) || 0x01 || lp(cache_salt)))

with lp(s) = 4-byte big-endian length || UTF-8 bytes: an unambiguous encoding, so one
`cache_salt` sent by two tenants gives two salts, and nobody without the secret can name
another tenant's salt. The answer caches key on the same salt (server/answers.py).

Every instance of a deployment must hold the same secret -- prefill and decode instances,
data-parallel replicas, a server restarted on its disk tier -- or their block hashes never
agree. `load_secret` takes it from, in order: `--salt-secret-file PATH`; `$KVSERVE_SALT_SECRET`
(the secret itself); `<api keys file>.salt-secret`. A file that does not exist is created with
32 random bytes as 64 hex digits, mode 0600, atomically (written to a temporary file, then
hard-linked into place), so replicas starting at once end up with one secret.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import tempfile

SECRET_ENV = "KVSERVE_SALT_SECRET"
MIN_SECRET_CHARS = 32
log = logging.getLogger("kvserve.server")


def _lp(text: str) -> bytes:
    b = text.encode("utf-8", "surrogatepass")
    return len(b).to_bytes(4, "big") + b


def derive_salt(secret: bytes, tenant: str, cache_salt: str | None) -> str:
    """The engine salt of (tenant, the request's cache_salt or None)."""
    msg = _lp(tenant) + (b"\x00" if cache_salt is None else b"\x01" + _lp(cache_salt))
    return "tenant-" + hmac.new(secret, msg, hashlib.sha256).hexdigest()


def _checked(text: str, where: str) -> bytes:
    text = text.strip()
    if len(text) < MIN_SECRET_CHARS:
        raise ValueError(f"the salt secret in {where} has {len(text)} characters; it needs at least "
                         f"{MIN_SECRET_CHARS} (delete the file and kvserve writes 64 random hex digits)")
    return text.encode("utf-8", "surrogateescape")


def _read(path: str) -> bytes:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ValueError(f"cannot read the salt secret file {path!r}: {e.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the salt secret file %s is readable by others (chmod 600 it)", path)
    return _checked(text, path)


def _create(path: str) -> bytes:
    """Write a new secret to `path` unless some other process got there first; read what is there."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".salt-secret-", dir=d)      # mode 0600
    except OSError as e:
        raise ValueError(f"cannot create the salt secret file {path!r}: {e.strerror}; pass "
                         f"--salt-secret-file PATH or set ${SECRET_ENV}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)          # atomic; fails if the file exists
            log.info("created the salt secret file %s", path)
        except FileExistsError:
            pass
        except OSError as e:
            raise ValueError(f"cannot create the salt secret file {path!r}: {e.strerror}; pass "
                             f"--salt-secret-file PATH or set ${SECRET_ENV}") from None
    finally:
        os.unlink(tmp)
    return _read(path)


def load_secret(path: str | None, default_path: str) -> bytes:
    """The deployment's salt secret: `path`, else $KVSERVE_SALT_SECRET, else `default_path`;
    a file that does not exist is created."""
    if path is None:
        env = os.environ.get(SECRET_ENV)
        if env:
            return _checked(env, f"${SECRET_ENV}")
        path = default_path
    return _read(path) if os.path.exists(path) else _create(path)
