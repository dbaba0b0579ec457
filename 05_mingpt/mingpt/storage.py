"""Where snapshots live: local disk or any fsspec URL (s3://...), with bounded waits, atomic
writes, and an object store's errors as one line.

    fs, path = fs("s3://bucket/run1/snapshot")       # filesystem and path, S3 waits bounded
    write_bytes_atomic(url, data)                    # readers see the old bytes or the new
    storage_error(url, error)                        # "what happened; the fix", or None

snapshot.py decides what is written (shards.py and its commit); this module how.
s3fs reads the endpoint and credentials from the usual AWS_* environment variables.
"""
import contextlib
import functools
import io
import os
import pickle
import tempfile
from collections.abc import Callable
from typing import BinaryIO

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem


def reason(error: BaseException) -> str:
    """The root cause of a failed call, in one short line."""
    rank = ""
    if isinstance(error, CheckpointException):  # DCP collects every rank's exception
        ranks = sorted(error.failures)
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank has it: whose?
            rank = f"rank {ranks[0]}{f' (and {len(ranks) - 1} more)' if len(ranks) > 1 else ''}: "
        error = error.failures[ranks[0]][0]
    lines = str(error).strip().splitlines()
    return f"{rank}{type(error).__name__}: {lines[0][:160] if lines else ''}"


# How long an s3:// snapshot_path may keep a run waiting. botocore (under s3fs) retries a failed
# request (legacy mode: 5 attempts, AWS_MAX_ATTEMPTS) and s3fs retries botocore's timeouts
# again (5 times), each attempt waiting up to 15 s for an answer: an endpoint that accepts the
# connection and never answers held a run for 14 minutes before its traceback. Here: botocore
# tries 3 times (unless AWS_MAX_ATTEMPTS says otherwise), s3fs adds no retries of its own, and
# an attempt waits 5 s to connect and 15 s for an answer. Settings in fsspec's s3 config (e.g.
# FSSPEC_S3='{"config_kwargs": {"read_timeout": 60}}') take precedence over these.
S3_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 15}
S3_MAX_ATTEMPTS = 3


def fs_options(url: str) -> dict:
    """fsspec options that bound the wait on an s3:// URL; none for other filesystems."""
    if fsspec.utils.get_protocol(url) not in ("s3", "s3a"):
        return {}
    conf = fsspec.config.conf.get("s3", {})  # the user's: FSSPEC_S3 or fsspec's config files
    config_kwargs = {**S3_TIMEOUTS, **conf.get("config_kwargs", {})}
    if "AWS_MAX_ATTEMPTS" not in os.environ:  # botocore reads it, unless a config overrides
        # total_max_attempts counts the first request, as AWS_MAX_ATTEMPTS does ("max_attempts"
        # counts the retries in botocore's legacy mode: one attempt more).
        config_kwargs.setdefault("retries", {"total_max_attempts": S3_MAX_ATTEMPTS})
    return {"config_kwargs": config_kwargs}


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of `url` and the path in it; for s3:// with bounded retries and waits."""
    options = fs_options(url)
    fs, path = fsspec.core.url_to_fs(url, **options)
    if options:
        # s3fs's own retry loop (a class attribute, no constructor argument) would repeat
        # botocore's retries 5 times over; DCP's FsspecWriter gets this same cached instance.
        fs.retries = 1
        # A missing bucket is found here, when the snapshot is first looked for, rather than
        # by the first save, hours later. (Refused credentials raise PermissionError here.)
        bucket = path.split("/")[0]
        try:
            fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            raise FileNotFoundError(f"bucket {bucket!r} does not exist") from None
    return fs, path


def storage_error(url: str, error: BaseException) -> str | None:
    """An error of the object store behind `url` (refused credentials, missing bucket,
    unreachable or silent endpoint) as "what happened; the fix" in one line; None for any
    other error, and for local paths (their OSErrors have their own messages). Shows no
    credential: this reads none, and S3's error messages do not echo them."""
    if isinstance(error, CheckpointException):  # DCP: every failed rank's exception
        error = next(iter(error.failures.values()))[0]
    if "://" not in url or not (isinstance(error, OSError) or is_botocore(error)):
        return None
    line = reason(error)
    if isinstance(error, PermissionError):
        fix = ("check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
               "AWS_PROFILE) and that they may read and write there")
    elif isinstance(error, FileNotFoundError) and "bucket" in line:
        fix = "create the bucket, or set trainer_config.snapshot_path to an existing one"
    elif isinstance(error, FileNotFoundError):
        fix = "it vanished while in use; check what else writes there"
    else:  # refused, unreachable, timed out: botocore's connection errors are not OSErrors
        attempts = os.environ.get("AWS_MAX_ATTEMPTS", S3_MAX_ATTEMPTS)
        fix = (f"check AWS_ENDPOINT_URL ({os.environ.get('AWS_ENDPOINT_URL', 'not set')}) and "
               f"the network (gave up after {attempts} attempts: AWS_MAX_ATTEMPTS)")
    return f"{line}; {fix}"


def storage_errors(wrap: type[Exception], prefix: bool = False) -> Callable:
    """Decorator: an object store's error (storage_error) in a function whose first argument
    is the URL becomes `wrap` with that one line (`prefix`: led by "snapshot storage URL: ");
    main.py prints it as one `error:` line. SnapshotError while looking for a snapshot,
    OSError while saving one."""
    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(url: str, *args, **kwargs):
            try:
                return function(url, *args, **kwargs)
            # CheckpointException, DCP's collected failures, is a BaseException.
            except (Exception, CheckpointException) as e:
                message = storage_error(url, e)
                if message is None:
                    raise
                raise wrap(f"snapshot storage {url}: {message}" if prefix else message) from None
        return wrapper
    return decorate


def is_botocore(error: BaseException) -> bool:
    # botocore is imported only with s3fs; its connection errors are not OSErrors.
    return type(error).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp")


def write_bytes_atomic(url: str, data: bytes, before_commit: Callable[[], None] | None = None
                       ) -> None:
    """Readers see the old content or the new one, never a half-written file.

    `before_commit` runs when the new bytes are written but not yet visible (a fault-injection
    point: a crash there must leave the old snapshot in place).
    """
    write_atomic(url, lambda f: f.write(data), before_commit)


def write_atomic(url: str, write: Callable[[BinaryIO], object],
                  before_commit: Callable[[], None] | None) -> None:
    """write_bytes_atomic, where `write(f)` writes the new content into the open file `f`."""
    fs, path = filesystem(url)
    if isinstance(fs, LocalFileSystem):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
        if before_commit:
            before_commit()
        os.replace(tmp, path)  # atomic within one filesystem
    else:
        # An object store has no atomic rename (fsspec's mv is copy + delete), but an upload
        # is atomic: the object appears complete (at close) or not at all.
        if before_commit:
            before_commit()
        f = fs.open(path, "wb")
        try:
            write(f)  # large data: a multipart upload, one part per block
            f.close()  # the last part, then "complete the upload": the commit point
        except BaseException:
            # Not `with fs.open(...)`: its exit closes the file even after an error, and
            # closing completes the upload with the parts sent so far, replacing the snapshot
            # with a truncated one. discard() aborts the upload: the old object stays.
            with contextlib.suppress(Exception):  # keep the first error, not the abort's
                f.discard()
            f.closed = True  # nor may garbage collection close (and so commit) it later
            raise


def load_torch(url: str) -> object:
    """torch.load of the file at `url` on the CPU, weights_only=True (pickled code refused).

    A local file is memory-mapped: a tensor's pages are read when it is used, and come from
    the page cache, which the ranks of a node share and the kernel can drop again (reading it
    into a buffer first held it twice in memory, on every rank at once). Its tensors are views
    of the file (mapped private: writes never reach it): copy whatever must outlive it. Where
    it cannot be mapped (not a zip-format torch file, a corrupt one, a filesystem that refuses
    mmap), and from an object store, it is read whole, which loads it or raises the error."""
    fs, path = filesystem(url)
    if isinstance(fs, LocalFileSystem):
        try:
            return torch.load(path, mmap=True, map_location="cpu", weights_only=True)
        except Exception:  # noqa: S110 (read whole below, which names the error)
            pass
    with fs.open(path, "rb") as f:
        data = f.read()
    # To the CPU whatever device saved it: RNG states must be CPU tensors, and load_state_dict
    # moves each weight to its parameter's device.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def is_local(url: str) -> bool:
    return fsspec.utils.get_protocol(url) in ("file", "local")  # as _fs's LocalFileSystem


def writer(url: str) -> FileSystemWriter:
    # Local disk: DCP's own writer. Anything else (s3://): the same writer over fsspec, with
    # the same bounded waits as _fs (the same options: the same cached filesystem), and no
    # fsync: an object has no file descriptor (DCP warned on every file), and its upload is
    # complete when the file closes.
    return FileSystemWriter(url) if "://" not in url else FsspecWriter(
        url, sync_files=False, **fs_options(url))


# DCP pickles a checkpoint's index (.metadata) and the non-tensor values it holds (an
# optimizer's lr, betas, parameter names) and reads both back with plain pickle, which runs any
# code a tampered file names. Snapshots load with weights_only=True, so these do too: the index
# through an unpickler that builds only DCP's own metadata classes (the stdlib's "restricting
# globals" recipe: torch.load reads only its own file format), the values with torch.load's
# weights_only=True. Anything else is an UnpicklingError, raised before any code could run.
SAFE_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "torch": {"Size"},
}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not dtype and name not in SAFE_GLOBALS.get(module, ()):
            raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")
        return super().find_class(module, name)


class SafeMetadata:
    """read_metadata of DCP's FileSystemReader (fsspec's too), through MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:  # noqa: ANN002, ANN003 (DCP's own)
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class LocalReader(SafeMetadata, FileSystemReader):
    pass


class RemoteReader(SafeMetadata, FsspecReader):
    pass


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, whose non-tensor values are first read with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # UnpicklingError for anything but plain data
        value.seek(0)
        # The same bytes again, placed as DCP places them: the check above met every global
        # they name, so reading them without it runs nothing either.
        super().load_bytes(read_item, value)


def reader(url: str) -> FileSystemReader:
    return LocalReader(url) if "://" not in url else RemoteReader(url, **fs_options(url))


def load_dcp(state: dict, url: str, no_dist: bool = False) -> None:
    """dcp.load of the checkpoint directory at `url` into `state`, its pickles read safely."""
    dcp.load(state, storage_reader=reader(url), planner=SafePlanner(), no_dist=no_dist)


def check_writable(url: str) -> None:
    """ValueError (one line) unless a local snapshot_path can be written: found before training
    rather than at the first save, hours in. (s3:// is checked by its first save.)"""
    if "://" in url:
        return
    folder = os.path.dirname(os.path.abspath(url))
    while not os.path.exists(folder):  # the run directory is created later, by rank 0
        folder = os.path.dirname(folder)
    try:
        # A real file rather than os.access: root passes every permission check but still
        # cannot write to a read-only filesystem.
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ValueError(f"trainer_config.snapshot_path {url} cannot be written ({folder}: "
                         f"{e.strerror or e}); set trainer_config.snapshot_path to a writable "
                         "path") from None
