"""Elastic restarts under torchrun: a restarted ``txl train`` continues its own run by itself.

``torchrun --max-restarts K`` starts every worker again when one dies (the agent ends the others), with
the same command line and ``TORCHELASTIC_RESTART_COUNT`` one higher. No person is there to add
``--resume``, so the restarted command must tell the run directory its own job wrote from one that an
earlier, finished or abandoned, job left behind (which a fresh command must refuse, txl.rundir):

* the first attempt (restart count 0) checks the run directory as always (a non-empty one is refused
  unless ``--resume`` or ``--overwrite``), and once it is accepted, the main process writes
  ``elastic.json`` there: the job's identity, ``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``; a random
  one under ``--standalone``; with neither it is "none" and the master address and port are added);
* a later attempt (restart count > 0) whose identity matches ``elastic.json`` continues from the run's
  latest checkpoint, or starts afresh over its own files when none was written yet. Without a matching
  ``elastic.json`` the directory is not this job's (its first attempt never got past the check) and it is
  treated like a first attempt.

So give each job its own ``--rdzv-id`` (SLURM: ``$SLURM_JOB_ID``) or use ``--standalone``. The checks run
in the main process, which reads and writes the run directory; multi-node runs need it on a shared file
system (as the checkpoints do).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from txl.fileio import write_json

log = logging.getLogger(__name__)

JOB_FILE = "elastic.json"


def job_identity(env: Mapping[str, str]) -> str | None:
    """This torchrun job's identity, the same in every attempt; None outside torchrun."""
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    if run_id == "none":  # no --rdzv-id: the static rendezvous keeps its master address across restarts
        return f"none@{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    return run_id


def restart_count(env: Mapping[str, str]) -> int:
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def record_job(out_dir: Path, env: Mapping[str, str] | None = None) -> None:
    """Mark ``out_dir`` as this torchrun job's (main process, once the directory was accepted)."""
    env = os.environ if env is None else env
    identity = job_identity(env)
    if identity is not None:
        write_json(Path(out_dir) / JOB_FILE, {"job": identity, "attempt": restart_count(env)})


def own_run(out_dir: Path, env: Mapping[str, str]) -> bool:
    """Whether ``out_dir`` was accepted by an earlier attempt of this same torchrun job."""
    identity = job_identity(env)
    try:
        recorded = json.loads((Path(out_dir) / JOB_FILE).read_text(encoding="utf-8")).get("job")
    except (OSError, ValueError, AttributeError):
        return False
    return identity is not None and recorded == identity


def restart_plan(out_dir: str | os.PathLike, resume: str | None, overwrite: bool,
                 env: Mapping[str, str] | None = None) -> tuple[str | None, bool]:
    """``(resume, overwrite)`` for this attempt: as given on the first one; on a restart of this job, its
    run directory when a checkpoint exists (else start again over its own files)."""
    from txl.rundir import latest

    env = os.environ if env is None else env
    out = Path(out_dir)
    if restart_count(env) == 0 or not own_run(out, env):
        return resume, overwrite
    found = latest(out)
    if found is not None and found.is_dir():
        log.info("torchrun restart %d of this job: continuing %s from %s", restart_count(env), out, found)
        return str(out), False
    log.info("torchrun restart %d of this job: no checkpoint yet in %s, starting again", restart_count(env), out)
    return None, True
