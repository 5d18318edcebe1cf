"""The coordinator's job journal: what a restarted coordinator needs to resume its jobs.

Each unfinished job has one JSON file, `{job_id}.json`: its spec, its plan once planned,
its attempt, why earlier attempts failed, and the newest step it checkpointed. The file
is written whole (temporary file, fsync, rename) whenever one of those changes and
deleted when the job ends. A coordinator started on the same journal resumes every job
in it with attempt + 1, from its newest checkpoint ([Note: restarts] in recovery.py).
Nothing is unpickled: the files are JSON, and each is validated (JobConfig, Plan) before
a job is built from it; a file that does not validate is renamed aside and logged.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipefb.errors import ConfigError
from pipefb.job.config import JobConfig
from pipefb.plan.plan import Plan
from pipefb.runtime.checkpoint import write_atomic

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """One unfinished job as the journal holds it."""

    config: JobConfig
    plan: Plan | None = None
    attempt: int = 0
    step: int = 0  # the newest checkpointed step (0: none)
    restarts: list[str] = field(default_factory=list)
    owner: str = "admin"  # the identity that submitted it (protos/security.py)

    def to_dict(self) -> dict[str, Any]:
        """The entry as JSON-ready data."""
        return {"job": self.config.to_dict(),
                "plan": self.plan.to_dict() if self.plan is not None else None,
                "attempt": self.attempt, "step": self.step, "restarts": self.restarts,
                "owner": self.owner}

    @classmethod
    def from_dict(cls, data: Any) -> Entry:
        """Validates journal data into an entry.

        Raises:
            ConfigError: a field missing or of the wrong type, a bad job or plan.
        """
        if not isinstance(data, dict) or not isinstance(data.get("job"), dict):
            raise ConfigError("a journal entry is an object with the job's spec under 'job'")
        attempt, step, restarts = data.get("attempt"), data.get("step"), data.get("restarts")
        if not (isinstance(attempt, int) and attempt >= 0 and isinstance(step, int)
                and step >= 0 and isinstance(restarts, list)
                and all(isinstance(r, str) for r in restarts)):
            raise ConfigError("a journal entry needs attempt >= 0, step >= 0 and a list of "
                              "restart messages")
        plan, owner = data.get("plan"), data.get("owner", "admin")
        if not isinstance(owner, str) or not owner:
            raise ConfigError("a journal entry's owner is a non-empty string")
        try:
            return cls(JobConfig.from_dict(data["job"]),
                       Plan.from_dict(plan) if isinstance(plan, dict) else None,
                       attempt, step, list(restarts), owner)
        except (TypeError, ValueError, KeyError) as error:
            raise ConfigError(f"bad journal entry: {error}") from None


class Journal:
    """The journal folder (None: jobs are not journaled and die with the coordinator)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder

    def record(self, entry: Entry) -> None:
        """Writes (or rewrites) the job's entry."""
        if self.folder is None:
            return
        text = json.dumps(entry.to_dict(), indent=1)
        write_atomic(self._path(entry.config.job_id), lambda tmp: tmp.write_text(text))

    def finish(self, job_id: str) -> None:
        """Deletes the ended job's entry."""
        if self.folder is not None:
            self._path(job_id).unlink(missing_ok=True)

    def pending(self) -> list[Entry]:
        """Every valid entry, oldest file first; an invalid one is renamed `*.bad`."""
        if self.folder is None or not self.folder.is_dir():
            return []
        entries = []
        for path in sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime):
            try:
                entries.append(Entry.from_dict(json.loads(path.read_text())))
            except (OSError, ValueError, ConfigError) as error:
                log.error("journal entry %s is unusable (%s); set aside as .bad", path, error)
                path.rename(path.with_suffix(".bad"))
        return entries

    def _path(self, job_id: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{job_id}.json"  # job ids match [A-Za-z0-9_.-]{1,64}
