"""The offload store's Redis users: the coordinator's service user limited to pipefb's
keys and to the commands it sends, one user per job limited to that job's keys, and the
default user off.

[Note: store ACL] The coordinator authenticates as `SERVICE_USER` (name in
`$PIPEFB_STORE_USER`, password in `$PIPEFB_STORE_PASSWORD`). The user may touch only keys
under `keys.PREFIX` and run only `COMMANDS`: SET (stash put, with its TTL), GETDEL (take),
UNLINK and SCAN (dropping a job's leftovers), INFO (used memory, readiness), PING, and
ACL SETUSER / DELUSER (the job users below). ACL SETUSER could make any user, so the
service user is the store's administrator and its password stays with the coordinator
(and Redis): no worker holds it. The default user, which every unauthenticated
connection is, can do nothing.

[Note: job store users] Workers hold no store password of their own. For every attempt
of a job the coordinator makes (or resets) the job's user, `job_user(job)`, with a fresh
password, keys `keys.job_pattern(job)` only and `JOB_COMMANDS` only, and hands it to the
job's ranks in their Assign, over the authenticated coordinator-to-worker channel; it
drops the user when the job ends (DELUSER also closes its connections). So a client
holding one job's user gets NOPERM on every key of another job, and cannot list keys
(no SCAN). A store restart loses the users with the stash; the replay makes them anew.

Redis reads the service user from an ACL file, so the password stays out of every
process list: the local launcher writes it in its private directory, and on Kubernetes
the Redis pod's init container writes it (`python -m offload_store --write-acl`) into a
memory-backed volume (`k8s/base/redis.yaml`).
"""

from __future__ import annotations

from offload_store.keys import PREFIX, check_name, job_pattern

SERVICE_USER = "pipefb"
USER_ENV = "PIPEFB_STORE_USER"  # the user connect() authenticates as; unset: default
COMMANDS = ("set", "getdel", "unlink", "scan", "info", "ping", "acl|setuser", "acl|deluser")
JOB_USER_PREFIX = "pipefb-job-"  # a job's store user is this + the job id
JOB_COMMANDS = ("set", "getdel", "unlink", "info", "ping",  # what a rank's stash sends
                "sadd", "smembers", "srem", "expire")  # these four: its local tier ranks


def job_user(job: str) -> str:
    """The name of `job`'s store user ([Note: job store users]).

    Raises:
        ValueError: a bad job id.
    """
    return JOB_USER_PREFIX + check_name("job", job)


def job_rule(job: str, password: str) -> list[str]:
    """The ACL SETUSER rule of `job`'s user, one token per item, from a reset user: on,
    `password` only, the job's keys only, `JOB_COMMANDS` only.

    Raises:
        ValueError: a bad job id or password.
    """
    _check_password(password)
    return ["reset", "on", f">{password}", f"~{job_pattern(job)}", "resetchannels",
            "-@all", *(f"+{c}" for c in JOB_COMMANDS)]


def _check_password(password: str) -> None:
    if not password or any(c.isspace() for c in password):
        raise ValueError("the store password must be non-empty and without whitespace")


def service_rule(password: str) -> list[str]:
    """The ACL rule of the service user, one token per item.

    Raises:
        ValueError: an empty password, or one with whitespace (it would split the rule).
    """
    _check_password(password)
    return [SERVICE_USER, "on", f">{password}", "resetkeys", f"~{PREFIX}:*", "resetchannels",
            "-@all", *(f"+{c}" for c in COMMANDS)]


def acl_file(password: str) -> str:
    """The ACL file of a store: the default user off, the service user on."""
    return f"user default off\nuser {' '.join(service_rule(password))}\n"

