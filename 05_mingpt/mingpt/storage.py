"""Where snapshots live: local disk or any fsspec URL (s3://...), with bounded waits, atomic
writes, DCP's pickles read safely, and an object store's errors as one line. snapshot.py and
shards.py decide what is written; this module how (s3fs: endpoint and credentials from AWS_*).
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


# How long an s3:// snapshot_path may keep a run waiting (by default botocore's 5 attempts, each
# retried 5 times by s3fs): botocore tries 3 times (unless AWS_MAX_ATTEMPTS says otherwise),
# s3fs adds no retries, and an attempt waits 5 s to connect and 15 s for an answer. fsspec's
# s3 config (e.g. FSSPEC_S3='{"config_kwargs": {"read_timeout": 60}}') takes precedence.
S3_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 15}
S3_MAX_ATTEMPTS = 3


def fs_options(url: str) -> dict:
    """fsspec options that bound the wait on an s3:// URL; none for other filesystems."""
    if fsspec.utils.get_protocol(url) not in ("s3", "s3a"):
        return {}
    conf = fsspec.config.conf.get("s3", {})  # the user's: FSSPEC_S3 or fsspec's config files
    config_kwargs = {**S3_TIMEOUTS, **conf.get("config_kwargs", {})}
    if "AWS_MAX_ATTEMPTS" not in os.environ:  # botocore reads it, unless a config overrides
        # total_max_attempts counts the first request too, as AWS_MAX_ATTEMPTS does.
        config_kwargs.setdefault("retries", {"total_max_attempts": S3_MAX_ATTEMPTS})
    return {"config_kwargs": config_kwargs}


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of `url` and the path in it; for s3:// with bounded retries and waits."""
    options = fs_options(url)
    fs, path = fsspec.core.url_to_fs(url, **options)
    if options:
        # s3fs's own retries would repeat botocore's 5 times over (DCP's writer gets this fs).
        fs.retries = 1
        # A missing bucket (or refused credentials) found now, not by the first save, hours in.
        bucket = path.split("/")[0]
        try:
            fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            raise FileNotFoundError(f"bucket {bucket!r} does not exist") from None
    return fs, path


def storage_error(url: str, error: BaseException) -> str | None:
    """An error of the object store behind `url` (refused credentials, missing bucket,
    unreachable or silent endpoint) as "what happened; the fix" in one line; None for any
    other error, and for local paths. Shows no credential (S3's messages echo none)."""
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
    is the URL becomes `wrap` with that one line (`prefix`: led by "snapshot storage URL: ")."""
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
    """Readers see the old content or the new one, never a half-written file. `before_commit`
    runs when the new bytes are written but not yet visible (a fault-injection point)."""
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
        # No atomic rename (fsspec's mv copies), but an upload appears whole at close or never.
        if before_commit:
            before_commit()
        f = fs.open(path, "wb")
        try:
            write(f)  # large data: a multipart upload, one part per block
            f.close()  # the last part, then "complete the upload": the commit point
        except BaseException:
            # Not `with fs.open(...)`: closing after an error would complete the upload with
            # the parts sent so far, a truncated snapshot. discard() aborts: the old one stays.
            with contextlib.suppress(Exception):  # keep the first error, not the abort's
                f.discard()
            f.closed = True  # nor may garbage collection close (and so commit) it later
            raise


def load_torch(url: str) -> object:
    """torch.load of the file at `url` on the CPU, weights_only=True (pickled code refused). A
    local file is memory-mapped (pages from the page cache, which a node's ranks share): its
    tensors are views of the file (mapped private), so copy whatever must outlive it. Where it
    cannot be mapped, and from an object store, it is read whole (which names any error)."""
    fs, path = filesystem(url)
    if isinstance(fs, LocalFileSystem):
        with contextlib.suppress(Exception):  # read whole below, which names the error
            return torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    with fs.open(path, "rb") as f:
        data = f.read()
    # To the CPU whatever device saved it: RNG states must be CPU tensors.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def is_local(url: str) -> bool:
    return fsspec.utils.get_protocol(url) in ("file", "local")  # filesystem()'s LocalFileSystem


def writer(url: str) -> FileSystemWriter:
    # s3://: the same writer over fsspec, with filesystem()'s bounded waits, and no fsync (an
    # object has no file descriptor; its upload is complete when the file closes).
    return FileSystemWriter(url) if "://" not in url else FsspecWriter(
        url, sync_files=False, **fs_options(url))


# DCP reads a checkpoint's index (.metadata) and its non-tensor values (lr, betas, parameter
# names) with plain pickle, which runs any code a tampered file names. Here the index goes
# through an unpickler that builds only DCP's metadata classes (the stdlib's "restricting
# globals" recipe), the values through torch.load's weights_only=True: UnpicklingError first.
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
        value.seek(0)  # the check above met every global they name: safe to read again
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
    try:  # a real file, not os.access: root passes that even on a read-only filesystem
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ValueError(f"trainer_config.snapshot_path {url} cannot be written ({folder}: "
                         f"{e.strerror or e}); set trainer_config.snapshot_path to a writable "
                         "path") from None
