"""A run's checkpoints in object storage, when `save_dir` is a URL: staged locally as by checkpoint.py, then
uploaded and committed (docs/remote-storage.md, 'How a run writes to a URL' and 'Failures').

Object stores cannot rename a folder, so the commit is the last object (`trainer_state.json`, after `manifest.json`):
a folder without it, or one whose objects do not match its manifest, is never resumed from. A checkpoint leaves the
staging folder only once it, or a newer one the retention rules prefer, has reached the bucket.
"""

from __future__ import annotations

import json
import logging
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from ..storage import RemoteFolder, StorageError
from .checkpoint_files import (
    MANIFEST,
    STATE_FILE,
    STEP_DIR,
    file_entries,
    is_complete,
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

    def upload(self, local: Path, step: int, checksums: bool) -> dict:
        """This node's files of the checkpoint in `local` (all but the manifest and the commit); their entries."""
        names = listed_files(local)
        entries = file_entries(local, names, checksums)
        self.folder.put_tree(local, step_folder(step), names)
        return entries

    def commit(self, step: int, entries: dict, state: dict, point_latest: bool = True) -> None:
        """The manifest, then trainer_state.json (the commit), then `latest` (main rank, after every upload;
        not for a checkpoint older than one already committed)."""
        self.folder.put_text(f"{step_folder(step)}/{MANIFEST}", json.dumps(manifest_of(state, entries), indent=2))
        self.folder.put_text(f"{step_folder(step)}/{STATE_FILE}", json.dumps(state, indent=2, sort_keys=True))
        if point_latest:
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

    def committed_steps(self) -> set[int]:
        """The steps whose folder holds its commit (one listing for all)."""
        committed = [name.split("/")[0] for name in self.folder.sizes(CHECKPOINTS) if name.endswith(f"/{STATE_FILE}")]
        return {int(m.group(1)) for name in committed if (m := STEP_DIR.match(name))}

    def apply_retention(self, newest: int, keep_last: int | None, keep_every: int | None) -> None:
        if not keep_last:
            return
        steps, complete = self.steps(), self.committed_steps()
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
    """Each checkpoint saved to the staging folder, uploaded and committed (docs/remote-storage.md). Every rank calls
    `start` and `finish` in the same order: `finish` is collective, and every rank keeps the same record."""

    def __init__(self, args, engine, after_commit=None):
        self.remote = RemoteCheckpoints(RemoteFolder(args.remote_save_dir, args.storage_retries))
        self.engine, self.background, self.failure = engine, args.async_checkpoint, args.checkpoint_failure
        self.checksums = args.checkpoint_checksums
        self.keep_last, self.keep_every = args.keep_last_checkpoints, args.keep_checkpoints_every
        self.after_commit = after_commit  # the main rank's uploads that follow a commit (metrics.jsonl)
        self.uploads_here = engine.world.local_rank == 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-upload") if self.uploads_here else None
        self._pending: Upload | None = None
        self.committed: list[int] = []         # this run's checkpoints that reached the bucket
        self.staged: dict[int, Upload] = {}    # this run's checkpoints whose upload failed, kept in staging
        self.leftovers: list[Path] = []        # complete checkpoints an earlier run left in staging
        self.last_problem: str | None = None

    def keep_leftovers(self, root: Path) -> None:
        """What an earlier process left in this node's staging folder `root` (docs/remote-storage.md, 'Failures')."""
        if not self.uploads_here or not root.is_dir():
            return
        complete = []
        for path in sorted(root.iterdir()):
            if STEP_DIR.match(path.name) and is_complete(path):
                complete.append(path)
            elif path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)  # `latest`, a partial file
        if not complete:
            return
        try:
            in_bucket = self.remote.committed_steps()
        except StorageError:
            in_bucket = set()
        for path in complete:
            if int(STEP_DIR.match(path.name).group(1)) in in_bucket:
                shutil.rmtree(path, ignore_errors=True)
            else:
                self.leftovers.append(path)
        if self.leftovers:
            logger.warning("the staging folder holds checkpoint(s) that never reached %s: %s; they are kept (resume "
                           "from one with resume: PATH, or delete it)", self.url_of_checkpoints,
                           ", ".join(map(str, self.leftovers)))

    @property
    def url_of_checkpoints(self) -> str:
        return self.remote.folder.url_of(CHECKPOINTS)

    def start(self, step: int, local: Path, state: dict) -> None:
        """Upload the complete staged checkpoint `local`; in the background with `async_checkpoint`."""
        self._pending = Upload(step, local, state, self._submit(local, step))
        if not self.background:
            self.finish()

    def _submit(self, local: Path, step: int) -> Future | None:
        return self._pool.submit(self.remote.upload, local, step, self.checksums) if self.uploads_here else None

    def finish(self) -> None:
        """Wait for the upload under way, commit it, and apply `checkpoint_failure` to an error (collective).
        Once one reaches the bucket, the checkpoints kept in staging are uploaded again."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        problem = self._conclude(pending)
        if problem is not None:
            self.staged[pending.step] = pending  # never deleted: it may be the only copy
            self._fail(pending, problem)
            return
        self._drop_staged_copy(pending)
        self._upload_staged_again(pending.step)

    def _conclude(self, upload: Upload) -> str | None:
        """Wait for every node's upload of `upload` and commit it; why it failed, or None (collective)."""
        outcomes = self.engine.all_gather_object(_result(upload.future))
        problem = next((text for kind, text in outcomes if kind == "error"), None)
        if problem is None and self.engine.is_main:
            entries = {name: entry for kind, files in outcomes if kind == "ok" for name, entry in files.items()}
            problem = self._commit(upload, entries)
        problem = self.engine.broadcast_object(problem)
        if problem is None:
            self.committed.append(upload.step)
        else:
            self.last_problem = problem
        return problem

    def _commit(self, pending: Upload, entries: dict) -> str | None:
        try:
            newest = pending.step >= max(self.committed, default=pending.step)  # an older one leaves `latest`
            self.remote.commit(pending.step, entries, pending.state, point_latest=newest)
            logger.info("uploaded checkpoint %s", self.remote.folder.url_of(step_folder(pending.step)))
            self.remote.apply_retention(pending.step, self.keep_last, self.keep_every)
            if self.after_commit is not None:
                self.after_commit()
        except StorageError as exc:
            return str(exc)
        return None

    def _drop_staged_copy(self, upload: Upload) -> None:
        if self.uploads_here:  # in the bucket now: the staging folder need not keep it
            shutil.rmtree(upload.local, ignore_errors=True)

    def _upload_staged_again(self, newest: int) -> None:
        """After `newest` reached the bucket, the checkpoints kept in staging (docs/remote-storage.md, 'Failures'); the
        first that fails again stays, with those after it, for the next commit (collective)."""
        known = sorted({*self.committed, *self.staged})
        outdated = set(retention_victims(known, set(known), newest, self.keep_last, self.keep_every))
        for step in sorted(self.staged):
            upload = self.staged.pop(step)
            if step in outdated:
                logger.info("dropped checkpoint %s from the staging folder: %s holds newer ones "
                            "(keep_last_checkpoints=%s)", upload.local, self.url_of_checkpoints, self.keep_last)
                self._drop_staged_copy(upload)
                continue
            logger.info("uploading checkpoint %s again (its first upload failed)", upload.local)
            upload.future = self._submit(upload.local, step)
            problem = self._conclude(upload)
            if problem is not None:
                self.staged[step] = upload
                logger.warning("checkpoint %s was not saved again: %s; it stays in the staging folder %s",
                               self.remote.folder.url_of(step_folder(step)), problem, upload.local)
                return
            self._drop_staged_copy(upload)

    def _fail(self, upload: Upload, problem: str) -> None:
        where = self.remote.folder.url_of(step_folder(upload.step))
        if self.failure == "fatal":
            newest = self.engine.broadcast_object(self._newest_in_bucket() if self.engine.is_main else None)
            raise CheckpointError(f"checkpoint {where} was not saved: {problem}. {newest}; this checkpoint is kept "
                                  f"in the staging folder {upload.local} (resume: {upload.local} continues from "
                                  "it; checkpoint_failure: warn goes on training instead)")
        logger.warning("checkpoint %s was not saved: %s; checkpoint_failure is warn, so the run goes on, the "
                       "checkpoint stays in the staging folder %s, and it is uploaded again once one reaches the "
                       "bucket", where, problem, upload.local)

    def _newest_in_bucket(self) -> str:
        """What a fatal failure leaves to resume from in the bucket, in words."""
        try:
            step = max(self.committed) if self.committed else self.remote.find_latest()
        except StorageError as exc:
            return f"Whether {self.url_of_checkpoints} holds an earlier complete checkpoint could not be read " \
                   f"({exc})"
        if step is None:
            return f"No complete checkpoint is in {self.url_of_checkpoints}"
        return f"The newest complete checkpoint there, {self.remote.folder.url_of(step_folder(step))}, is " \
               "intact (resume: auto continues from it)"

    def report_end(self) -> None:
        """At the run's end (collective; after `finish`): the checkpoints that exist only in staging, named in
        one warning; a run none of whose checkpoints reached the bucket ends with CheckpointError (exit 4)."""
        staged = [str(self.staged[step].local) for step in sorted(self.staged)]
        only_here = [*map(str, self.leftovers), *staged]  # oldest first
        if only_here and self.engine.is_main:
            logger.warning("checkpoint(s) that exist only in the staging folder, not in %s: %s (resume: PATH "
                           "continues from one)", self.url_of_checkpoints, ", ".join(only_here))
        if staged and not self.committed:
            raise CheckpointError(f"no checkpoint of this run reached {self.url_of_checkpoints}: every upload "
                                  f"failed (the last: {self.last_problem}); they are kept in the staging folder: "
                                  f"{', '.join(staged)}")

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


WRITE_CHECK = ".pretrainer-write-check"  # the probe object written and deleted under save_dir at the start


def check_save_dir(world, args) -> None:
    """A save_dir URL's bucket takes this run's objects (docs/remote-storage.md, 'How a run writes to a URL')."""
    if not args.remote_save_dir:
        return
    problem = None
    if world.is_main:
        try:
            RemoteFolder(args.remote_save_dir, args.storage_retries).check_access(
                WRITE_CHECK, need_delete=bool(args.keep_last_checkpoints))
        except StorageError as exc:
            problem = f"key 'save_dir': {exc}"
    problem = world.broadcast_object(problem)
    if problem is not None:
        raise StorageError(problem)


class NotACheckpoint(StorageError):
    """A URL that names a checkpoint folder which cannot be resumed from (incomplete, or not its manifest's)."""


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
            raise NotACheckpoint(f"{url} cannot be resumed from: {problem}")
        return remote, step
    remote = RemoteCheckpoints(RemoteFolder(url, retries))
    return remote, remote.find_latest()


def fetch_checkpoint(world, url: str, local_root: Path, retries: int, given_as: str | None = None) -> Path | None:
    """The checkpoint `url` names, downloaded by the first process of every node into `local_root/step-<N>`
    (collective; docs/remote-storage.md, 'Resuming'). None where the URL holds none, unless it was `given_as` the
    checkpoint to start from (e.g. "key 'resume'"): then that is a ConfigError."""
    choice = None
    if world.is_main:
        try:
            remote, step = locate_remote(url, retries)
            choice = ("ok", remote.folder.url, step) if step is not None or given_as is None else \
                ("missing", f"{url} holds no complete checkpoint (none under {remote.folder.url}/{CHECKPOINTS})", None)
        except NotACheckpoint as exc:
            choice = ("missing" if given_as else "error", str(exc), None)
        except StorageError as exc:
            choice = ("error", str(exc), None)
    kind, found, step = world.broadcast_object(choice)
    if kind == "missing":
        raise ConfigError(f"{given_as}: {found}; give a complete checkpoint folder (e.g. "
                          f"s3://bucket/run/{CHECKPOINTS}/step-100) or a save_dir URL holding one")
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
