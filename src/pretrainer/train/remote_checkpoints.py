"""A run's checkpoints in object storage, when `save_dir` is a URL.

A checkpoint is written to the local staging folder exactly as to a local save_dir (checkpoint.py), then
uploaded to `save_dir/checkpoints/step-<N>/`: the first process of every node uploads the files its node wrote
(so each rank's shards leave from the node that holds them), then the main rank writes `manifest.json` (every
node's files with their sizes and CRC-32) and `trainer_state.json` last, as the commit, then `latest`. Object
stores cannot rename a folder, so the commit is the last object: a folder without it is never resumed from, and
one whose objects do not match its manifest is skipped. With `async_checkpoint` the upload runs in the
background while training goes on and is committed at the next save or at the end of the run (a collective
point); without it, at once. After the commit the staged copy is deleted, and a save first waits for the
previous upload, so the staging folder holds one checkpoint at a time.

A failed upload (after `storage_retries` tries of each object) ends the run with one line naming the URL
(`checkpoint_failure: fatal`), or is logged and the run goes on (`warn`): the next save tries again, and the
partial folder is never resumed from (retention deletes it later).
"""

from __future__ import annotations

import json
import logging
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..storage import RemoteFolder, StorageError
from .checkpoint_files import (
    MANIFEST,
    STATE_FILE,
    STEP_DIR,
    file_entries,
    listed_files,
    manifest_of,
    retention_victims,
    verify_checkpoint,
)
from .errors import CheckpointError

logger = logging.getLogger("pretrainer")

CHECKPOINTS = "checkpoints"


def step_folder(step: int) -> str:
    return f"{CHECKPOINTS}/step-{step}"


class RemoteCheckpoints:
    """The checkpoints under a save_dir URL: upload, commit, find, download, retention."""

    def __init__(self, folder: RemoteFolder):
        self.folder = folder

    @property
    def url(self) -> str:
        return self.folder.url

    def upload(self, local: Path, step: int, checksums: bool) -> dict:
        """This node's files of the checkpoint in `local` (all but the manifest and the commit); their entries."""
        names = listed_files(local)
        entries = file_entries(local, names, checksums)
        self.folder.put_tree(local, step_folder(step), names)
        return entries

    def commit(self, step: int, entries: dict, state: dict) -> None:
        """The manifest, then trainer_state.json (the commit), then `latest` (main rank, after every upload)."""
        self.folder.put_text(f"{step_folder(step)}/{MANIFEST}", json.dumps(manifest_of(state, entries), indent=2))
        self.folder.put_text(f"{step_folder(step)}/{STATE_FILE}", json.dumps(state, indent=2, sort_keys=True))
        self.folder.put_text(f"{CHECKPOINTS}/latest", f"step-{step}")

    def steps(self) -> list[int]:
        return sorted(int(m.group(1)) for name in self.folder.folders(CHECKPOINTS) if (m := STEP_DIR.match(name)))

    def problem(self, step: int) -> str | None:
        """Why step-<step> cannot be resumed from (incomplete, or objects that do not match its manifest)."""
        sizes = self.folder.sizes(step_folder(step))
        if STATE_FILE not in sizes:
            return f"incomplete (no {STATE_FILE}: its upload did not finish)"
        text = self.folder.read_text(f"{step_folder(step)}/{MANIFEST}")
        if text is None:
            return None  # a folder copied in by hand without a manifest: trusted, as locally
        for name, entry in json.loads(text)["files"].items():
            if sizes.get(name) != entry["bytes"]:
                return f"{name} is {'missing' if name not in sizes else f'{sizes[name]:,} bytes'}, its manifest " \
                       f"says {entry['bytes']:,}"
        return None

    def find_latest(self) -> int | None:
        """The newest step that is complete and matches its manifest. By step, not by `latest` (which is written
        after the commit, and would name an older one if its own upload failed)."""
        for step in reversed(self.steps()):
            problem = self.problem(step)
            if problem is None:
                return step
            logger.warning("skipping checkpoint %s: %s", self.folder.url_of(step_folder(step)), problem)
        return None

    def download(self, step: int, local: Path) -> Path:
        """step-<step> into `local` (replacing what is there), checked against its manifest's checksums."""
        shutil.rmtree(local, ignore_errors=True)
        self.folder.get_tree(step_folder(step), local)
        problem = verify_checkpoint(local)
        if problem is not None:
            raise StorageError(f"downloading {self.folder.url_of(step_folder(step))} failed: {problem}")
        return local

    def apply_retention(self, newest: int, keep_last: int | None, keep_every: int | None) -> None:
        if not keep_last:
            return
        steps = self.steps()
        committed = [name.split("/")[0] for name in self.folder.sizes(CHECKPOINTS) if name.endswith(f"/{STATE_FILE}")]
        complete = {int(m.group(1)) for name in committed if (m := STEP_DIR.match(name))}  # one listing for all
        for step in retention_victims(steps, complete, newest, keep_last, keep_every):
            self.folder.remove(step_folder(step))
            logger.info("deleted checkpoint %s (keep_last_checkpoints=%d)", self.folder.url_of(step_folder(step)),
                        keep_last)


@dataclass
class Upload:
    step: int
    local: Path
    state: dict
    future: Future | None  # on the processes that upload (the first of each node); None on the others


class CheckpointUploads:
    """Each checkpoint saved to the staging folder, uploaded and committed; every rank calls `start` and
    `finish` in the same order (`finish` is collective)."""

    def __init__(self, remote: RemoteCheckpoints, engine, *, background: bool, failure: str, checksums: bool,
                 keep_last: int | None, keep_every: int | None, after_commit=None):
        self.remote, self.engine = remote, engine
        self.background, self.failure, self.checksums = background, failure, checksums
        self.keep_last, self.keep_every = keep_last, keep_every
        self.after_commit = after_commit  # the main rank's uploads that follow a commit (metrics.jsonl)
        self.uploads_here = engine.world.local_rank == 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-upload") if self.uploads_here else None
        self._pending: Upload | None = None

    def start(self, step: int, local: Path, state: dict) -> None:
        """Upload the complete staged checkpoint `local`; in the background with `async_checkpoint`."""
        future = self._pool.submit(self.remote.upload, local, step, self.checksums) if self.uploads_here else None
        self._pending = Upload(step, local, state, future)
        if not self.background:
            self.finish()

    def finish(self) -> None:
        """Wait for the upload under way, commit it, and apply `checkpoint_failure` to an error (collective)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        outcome = _result(pending.future)
        outcomes = self.engine.all_gather_object(outcome)
        problem = next((text for kind, text in outcomes if kind == "error"), None)
        if problem is None and self.engine.is_main:
            entries = {name: entry for kind, files in outcomes if kind == "ok" for name, entry in files.items()}
            problem = self._commit(pending, entries)
        problem = self.engine.broadcast_object(problem)
        if self.uploads_here:  # uploaded or given up: the staging folder keeps no finished checkpoint
            shutil.rmtree(pending.local, ignore_errors=True)
        if problem is not None:
            self._fail(pending.step, problem)

    def _commit(self, pending: Upload, entries: dict) -> str | None:
        try:
            self.remote.commit(pending.step, entries, pending.state)
            logger.info("uploaded checkpoint %s", self.remote.folder.url_of(step_folder(pending.step)))
            self.remote.apply_retention(pending.step, self.keep_last, self.keep_every)
            if self.after_commit is not None:
                self.after_commit()
        except StorageError as exc:
            return str(exc)
        return None

    def _fail(self, step: int, problem: str) -> None:
        where = self.remote.folder.url_of(step_folder(step))
        if self.failure == "fatal":
            raise CheckpointError(f"checkpoint {where} was not saved: {problem}. The last complete checkpoint there "
                                  "is intact; rerun with resume: auto to continue from it (checkpoint_failure: warn "
                                  "goes on training instead)")
        logger.warning("checkpoint %s was not saved: %s; checkpoint_failure is warn, so the run goes on and the next "
                       "save tries again", where, problem)

    def abandon(self) -> None:
        """A run that fails: an upload under way is left uncommitted (never resumed from)."""
        if self._pending is not None:
            logger.warning("checkpoint %s abandoned while being uploaded: it stays incomplete",
                           self.remote.folder.url_of(step_folder(self._pending.step)))
        self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _result(future: Future | None) -> tuple[str, object]:
    if future is None:
        return ("ok", {})
    try:
        return ("ok", future.result())
    except StorageError as exc:
        return ("error", str(exc))
    except OSError as exc:  # reading the staged files
        return ("error", f"{type(exc).__name__}: {exc}")


def locate_remote(url: str, retries: int) -> tuple[RemoteCheckpoints, int | None]:
    """The checkpoints and the step a URL names: a checkpoint folder (`.../checkpoints/step-<N>`) or a save_dir
    (its newest complete checkpoint; None if it has none)."""
    head, _, name = url.rstrip("/").rpartition("/")
    match = STEP_DIR.match(name)
    if match and head.endswith(f"/{CHECKPOINTS}"):
        remote = RemoteCheckpoints(RemoteFolder(head[: -len(CHECKPOINTS) - 1], retries))
        step = int(match.group(1))
        problem = remote.problem(step)
        if problem is not None:
            raise StorageError(f"{url} cannot be resumed from: {problem}")
        return remote, step
    remote = RemoteCheckpoints(RemoteFolder(url, retries))
    return remote, remote.find_latest()


def fetch_checkpoint(world, url: str, local_root: Path, retries: int) -> Path | None:
    """The checkpoint `url` names, chosen by the main rank and downloaded by the first process of every node into
    `local_root/step-<N>` (replacing what an earlier download left there; collective); None when a save_dir URL
    holds none yet."""
    choice = None
    if world.is_main:
        try:
            remote, step = locate_remote(url, retries)
            choice = ("ok", remote.url, step)
        except StorageError as exc:
            choice = ("error", str(exc), None)
    kind, found, step = world.broadcast_object(choice)
    if kind == "error":
        raise CheckpointError(found)
    if step is None:
        return None
    local = local_root / f"step-{step}"
    problem = None
    if world.local_rank == 0:
        shutil.rmtree(local_root, ignore_errors=True)  # one downloaded checkpoint at a time
        try:
            RemoteCheckpoints(RemoteFolder(found, retries)).download(step, local)
            logger.info("resuming from %s (downloaded to %s)", f"{found}/{step_folder(step)}", local)
        except StorageError as exc:
            problem = str(exc)
    problem = next((p for p in world.all_gather_object(problem) if p is not None), None)
    if problem is not None:
        raise CheckpointError(problem)
    return local
