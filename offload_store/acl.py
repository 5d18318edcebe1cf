"""The offload store's Redis users: one service user limited to pipefb's keys and to the
commands the store sends, and the default user off.

[Note: store ACL] The workers and the coordinator authenticate as `SERVICE_USER` (name in
`$PIPEFB_STORE_USER`, password in `$PIPEFB_STORE_PASSWORD`). The user may touch only keys
under `keys.PREFIX` and run only `COMMANDS`: SET (stash put, with its TTL), GETDEL (take),
UNLINK and SCAN (dropping a job's leftovers), INFO (used memory, readiness) and PING. So a
leaked service password cannot FLUSHALL, CONFIG, EVAL, read other tenants' keys or
subscribe to channels; the default user, which every unauthenticated connection is, can
do nothing. Redis reads the users from an ACL file, so the password stays out of every
process list: the local launcher writes it in its private directory, and on Kubernetes
the Redis pod's init container writes it (`python -m offload_store --write-acl`) into a
memory-backed volume (`k8s/base/redis.yaml`).
"""

from __future__ import annotations

from offload_store.keys import PREFIX

SERVICE_USER = "pipefb"
USER_ENV = "PIPEFB_STORE_USER"  # the user connect() authenticates as; unset: default
COMMANDS = ("set", "getdel", "unlink", "scan", "info", "ping")


def service_rule(password: str) -> list[str]:
    """The ACL rule of the service user, one token per item.

    Raises:
        ValueError: an empty password, or one with whitespace (it would split the rule).
    """
    if not password or any(c.isspace() for c in password):
        raise ValueError("the store password must be non-empty and without whitespace")
    return [SERVICE_USER, "on", f">{password}", "resetkeys", f"~{PREFIX}:*", "resetchannels",
            "-@all", *(f"+{c}" for c in COMMANDS)]


def acl_file(password: str) -> str:
    """The ACL file of a store: the default user off, the service user on."""
    return f"user default off\nuser {' '.join(service_rule(password))}\n"

