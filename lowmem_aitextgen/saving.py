"""Writing files without ever losing what was there: atomic saves, output_dir's preparation and lock.

Model weights are streamed into model.safetensors a tensor at a time (safetensors' own save_file first
serialises every tensor to bytes, a second copy of the model; a LoRA model's merged weights are made a
tensor at a time too), so a save needs one tensor more than the model, not a model more.

Every file is written under a temporary name in its own folder, flushed to disk, given the mode
the process's umask asks for (0644 under the usual 022, like any other tool's files), then moved
over the old one with os.replace, which is atomic on POSIX and Windows.  A crash at any moment
leaves every file either old or new, never half-written.  Weights that are not finite are never
written over anything: a NaN model is worse than whatever it would replace.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import secrets
import shutil
import socket
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .heap import freed_memory_returned, release_freed_heap

logger = logging.getLogger("lowmem_aitextgen")

STAGING_PREFIX, WRITING_PREFIX = ".saving-", ".writing-"  # names of files not yet complete
LOCK_NAME = ".lowmem_aitextgen.lock"  # in output_dir while a train() writes there
LEGACY_WEIGHTS = "pytorch_model.bin"  # what aitextgen 0.6 wrote; model.safetensors now


def read_json(path: str) -> Any:
    """A JSON file this package or a library wrote, read; UnreadableJson (a ValueError) names the file and
    what is wrong with it, for the caller to add the fix (or to take it as absent)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as error:
        raise UnreadableJson(f"{path} is not readable JSON ({error})") from error


class UnreadableJson(ValueError):
    """A JSON file that exists but cannot be read (damaged, not UTF-8, not JSON, unreadable)."""


class NonFiniteWeights(ValueError):
    """Weights with NaN/inf values, which are never saved."""


# --- file modes and single files ----------------------------------------------------


def umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc), else by setting
    and restoring it."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def apply_umask(path: str) -> None:
    """Give `path` (and everything below a folder) the modes a plain open()/mkdir() would have:
    temporary files and folders are created private (0600/0700), which would leave a model that
    another account cannot read."""
    mask = umask()
    for root, folders, files in os.walk(path) if os.path.isdir(path) else [(None, [], [path])]:
        for name in folders:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(name if root is None else os.path.join(root, name), 0o666 & ~mask)
    if os.path.isdir(path):
        os.chmod(path, 0o777 & ~mask)


def _unique_name(folder: str, prefix: str, suffix: str = "") -> str:
    return os.path.join(folder, f"{prefix}{secrets.token_hex(6)}{suffix}")


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write one file so that readers see the old or the new content, never a mix."""
    with atomic_file(path) as f:
        f.write(data)


@contextmanager
def atomic_file(path: str) -> Iterator[Any]:
    """A binary file opened under a temporary name beside `path`; on success it is flushed to disk
    and renamed over `path`, on any failure removed (a full disk leaves nothing behind)."""
    folder = os.path.dirname(os.path.abspath(path))
    temporary = _unique_name(folder, WRITING_PREFIX, "-" + os.path.basename(path)[:64])
    # 0o666 through os.open: the kernel applies the umask, as for any file a tool writes
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


# --- streamed weights -----------------------------------------------------------------

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class WeightSource:
    """One tensor of a weights file: its name, dtype and shape, and how to make it when it is written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]


def model_weights(model: nn.Module) -> list[WeightSource]:
    """A plain transformers model's weights as save_pretrained writes them: the state dict without the
    tied copies (GPT-2's lm_head.weight is transformer.wte.weight)."""
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    weights, written = [], set()
    for name, value in model.state_dict().items():
        # a 4-bit tensor (four_bit.py) has no storage of its own: its packed values' tell it apart
        storage = getattr(value, "quantized_data", value).untyped_storage().data_ptr()
        if name in tied and storage in written:
            continue
        written.add(storage)
        weights.append(WeightSource(name, value.dtype, tuple(value.shape), lambda value=value: value))
    return weights


def write_safetensors(path: str, weights: list[WeightSource]) -> None:
    """A safetensors file (little-endian: the header's size, the JSON header, the tensors' bytes) written
    one tensor at a time; the file is readable by safetensors, transformers and peft like any other."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for weight in weights:
        size = math.prod(weight.shape) * weight.dtype.itemsize
        header[weight.name] = {"dtype": SAFETENSORS_DTYPES[weight.dtype], "shape": list(weight.shape),
                               "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for weight in weights:
            tensor = weight.make().detach().to("cpu").contiguous()
            if tensor.dtype != weight.dtype or tuple(tensor.shape) != weight.shape:
                raise RuntimeError(f"{weight.name} came out {tensor.dtype} {tuple(tensor.shape)}, not "
                                   f"{weight.dtype} {weight.shape}")
            f.write(tensor.view(-1).view(torch.uint8).numpy().data)
            del tensor
            # under glibc's dynamic threshold a freed tensor stays in the heap, where the next, larger one
            # does not fit: given back at once, the save grows by one tensor (heap.py: no mallopt here)
            release_freed_heap()


def save_model_files(folder: str, plain: nn.Module, weights: list[WeightSource] | None = None) -> None:
    """config.json, generation_config.json and model.safetensors into `folder`, as save_pretrained writes
    them, a tensor at a time; `weights`: what to write in place of the model's own (lora.py's merge)."""
    weights = model_weights(plain) if weights is None else weights
    config = plain.config
    config.architectures = [type(plain).__name__]
    floating = next((w.dtype for w in weights if w.dtype.is_floating_point), torch.float32)
    config.dtype = str(floating).removeprefix("torch.")
    config.save_pretrained(folder)
    if getattr(plain, "generation_config", None) is not None and plain.can_generate():
        plain.generation_config.save_pretrained(folder)
    write_safetensors(os.path.join(folder, "model.safetensors"), weights)


# --- models -------------------------------------------------------------------------


# Elements checked at a time: isfinite of a whole weight makes temporaries several times its size (18 MB
# for one 1024x4096 bf16 weight), more than a save of that model otherwise adds.
FINITE_CHECK_ELEMENTS = 2**20


def check_finite(model: nn.Module, what: str = "The model's weights") -> None:
    """Raise NonFiniteWeights naming the first parameter with a NaN or inf."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if hasattr(param, "get_original_weight"):  # a frozen 4-bit base weight (four_bit.py): never trained
                continue
            param = param.to_local() if hasattr(param, "to_local") else param  # a shard (sharding.py): this rank's
            flat = param.reshape(-1)
            if param.is_floating_point() and not all(
                    torch.isfinite(flat[i:i + FINITE_CHECK_ELEMENTS]).all()
                    for i in range(0, flat.numel(), FINITE_CHECK_ELEMENTS)):
                raise NonFiniteWeights(f"{what} are not finite (NaN/inf in {name}).")


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def _move_into(staging: str, target: str, top: bool = True) -> None:
    """os.replace every staged file into target, weights before config.  A staged subfolder (lora_adapter/)
    is the save's whole: what an earlier save left in it and this one did not write is removed."""
    entries = sorted(os.listdir(staging), key=lambda n: (n == "config.json", n))
    for name in entries:
        source = os.path.join(staging, name)
        if os.path.isdir(source):
            os.makedirs(os.path.join(target, name), exist_ok=True)
            _move_into(source, os.path.join(target, name), top=False)
        else:
            os.replace(source, os.path.join(target, name))
    for name in [] if top else sorted(set(os.listdir(target)) - set(entries)):
        path = os.path.join(target, name)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def remove_leftovers(output_dir: str) -> None:
    """Half-written files of a save that was killed (only one process saves into output_dir)."""
    for name in leftovers(output_dir):
        path = os.path.join(output_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def leftovers(folder: str) -> list[str]:
    return [name for name in os.listdir(folder) if name.startswith((STAGING_PREFIX, WRITING_PREFIX))]


def write_model(folder: str, model: nn.Module, tokenizer: Any | None = None) -> None:
    """A plain transformers model (+ tokenizer) as save_pretrained writes it: what atomic_save stages."""
    save_model_files(folder, model)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


# How a full disk or a file-size limit reads in the errors of libraries that write files of their own and do not
# raise OSError for it: safetensors' Rust writer ("No space left on device (os error 28)", "File too large (os
# error 27)"), tokenizers', torch's zip writer ("unexpected pos").
_DISK_FULL = ("no space left", "os error 28", "storagefull")
_TOO_LARGE = ("file too large", "os error 27", "filetoolarge")
_STOPPED_SHORT = ("unexpected pos",)  # torch's zip writer: it cannot tell which


def write_error(error: BaseException) -> OSError | None:
    """The OSError a failed write stands for (a full disk, a file-size limit), whichever library raised it, or
    None where `error` is no write failure."""
    for candidate in (error, error.__cause__, error.__context__):
        if isinstance(candidate, OSError):
            return candidate
    said = str(error).lower()
    for words, code in ((_DISK_FULL, errno.ENOSPC), (_TOO_LARGE, errno.EFBIG)):
        if any(word in said for word in words):
            return OSError(code, os.strerror(code))
    if any(word in said for word in _STOPPED_SHORT):
        return OSError(errno.EIO, "the write stopped short (a full disk or a file-size limit)")
    return None


def atomic_save(output_dir: str, model: nn.Module, tokenizer: Any | None = None,
                write: Callable[[str], None] | None = None) -> list[str]:
    """Save model (+ tokenizer) so a crash never corrupts output_dir: `write(folder)` (default write_model)
    fills a staging folder, whose files then replace output_dir's.  Weights that are not finite are refused
    before anything is written.  Returns the names written into output_dir (files and folders)."""
    write = write or (lambda folder: write_model(folder, model, tokenizer))
    check_finite(model, f"The weights to save in {output_dir}")
    os.makedirs(output_dir, exist_ok=True)
    remove_leftovers(output_dir)
    staging = _unique_name(output_dir, STAGING_PREFIX)
    try:
        try:
            os.mkdir(staging)
            with freed_memory_returned():
                write(staging)
            apply_umask(staging)
            _fsync_tree(staging)
        except Exception as error:  # before the first rename: nothing in output_dir has changed
            failed = write_error(error)
            if failed is None:
                raise
            raise OSError(failed.errno, f"Saving the model to {output_dir} failed ({failed.strerror or failed}); the "
                                        "files already there are untouched. Free some disk space or choose another "
                                        "folder.") from error
        written = find_weights(staging)
        names = sorted(os.listdir(staging))
        _move_into(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    legacy = os.path.join(output_dir, LEGACY_WEIGHTS)
    if written == "model.safetensors" and os.path.isfile(legacy):
        # transformers loads model.safetensors first: the old weights would only be copied by mistake
        os.remove(legacy)
        logger.warning(f"Removed the older {LEGACY_WEIGHTS} from {output_dir}: the new weights are in "
                       "model.safetensors (lowmem_aitextgen.colab.copy_file_to_gdrive('pytorch_model.bin') "
                       "copies that file).")
    return names


# --- output_dir ---------------------------------------------------------------------


def check_folder_name(argument: str, folder: Any) -> str:
    """A folder argument as a str path, or a ValueError naming what cannot work with it."""
    if isinstance(folder, bytes):
        folder = os.fsdecode(folder)
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"{argument}={folder!r} must be a folder path (a str), not {type(folder).__name__}.")
    folder = os.fspath(folder)
    if not folder.strip():
        raise ValueError(f"{argument}={folder!r} is empty; name a folder, e.g. {argument}='trained_model'.")
    try:
        folder.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{argument}={folder!r} has characters that are not valid UTF-8 "
                         f"({error.reason}); rename it with plain characters.") from error
    return folder


def check_output_dir(output_dir: str) -> None:
    """What can be known of output_dir before any work: the nearest existing folder on its path is a
    folder, and this process can create files there."""
    existing = os.path.abspath(output_dir)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if os.path.islink(existing) and not os.path.exists(existing):
        raise ValueError(f"output_dir={output_dir!r}: {existing} is a broken or looping symbolic link; "
                         "choose another output_dir.")
    if not os.path.isdir(existing):
        raise ValueError(f"output_dir={output_dir!r}: {existing} is a file, not a folder; choose another output_dir.")
    try:  # a nameless file (O_TMPFILE): permission bits do not stop root, read-only disks do
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        raise PermissionError(f"output_dir={output_dir!r} is not writable ({error.strerror}); choose a folder "
                              "you can write to.") from error


def prepare_output_dir(output_dir: str, needed_bytes: int) -> None:
    """Create output_dir and prove it can hold this run's files (the free disk counted, a probe file
    written and removed) before training, so that no trained weights are lost to a folder that cannot
    take them."""
    check_output_dir(output_dir)
    existing = os.path.abspath(output_dir)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    reclaimable = sum(_size(os.path.join(existing, name)) for name in leftovers(existing))
    free = shutil.disk_usage(existing).free + reclaimable
    if free < needed_bytes:
        from .hardware import format_bytes

        raise OSError(
            errno.ENOSPC,
            f"output_dir={output_dir!r} is on a disk with {format_bytes(free)} free, but saving this model and "
            f"its resumable checkpoint needs at least {format_bytes(needed_bytes)}; free some space or choose "
            "an output_dir on another disk.")
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, "probe")
        atomic_write_bytes(probe, b"lowmem_aitextgen")
        os.remove(probe)
    except OSError as error:
        raise OSError(error.errno, f"output_dir={output_dir!r} cannot hold the trained model ({error.strerror}); "
                                   "choose another output_dir.") from error


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, files in os.walk(path) for name in files)


class OutputDirInUse(RuntimeError):
    """Another process is training into the same output_dir."""


class OutputDirLock:
    """One train() per output_dir: an exclusive flock on output_dir/.lowmem_aitextgen.lock, holding the
    owner's pid and host.  The kernel drops the lock when its process dies, so a stale lock file is
    simply taken over; the file is removed on release.  (Without fcntl, on Windows, nothing is locked.)"""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.fd: int | None = None

    def __enter__(self) -> OutputDirLock:
        try:
            import fcntl
        except ImportError:
            return self
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)  # a filesystem that cannot lock (some network mounts): run unlocked, said once
                    os.remove(self.path)
                    logger.warning(f"output_dir={os.path.dirname(self.path)!r} cannot be locked ({error.strerror}); "
                                   "make sure no other run writes there.")
                    return self
                owner = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
                os.close(fd)
                raise OutputDirInUse(
                    f"output_dir={os.path.dirname(self.path)!r} is in use by {owner}, which is training into it; "
                    "wait for it to finish, or choose another output_dir.") from None
            if not os.path.exists(self.path) or os.stat(self.path).st_ino != os.fstat(fd).st_ino:
                os.close(fd)  # the holder removed it between our open and our lock: lock the new file
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
            self.fd = fd
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.fd is not None:  # None: not locked (no fcntl, or a filesystem without locks)
            os.remove(self.path)  # before closing: whoever waits locks a fresh file
            os.close(self.fd)
            self.fd = None


# Weight files a model folder may hold, newest format first.  aitextgen 0.6.0's
# `model_folder` asserted that pytorch_model.bin exists, but transformers has
# written model.safetensors by default since 4.35 (and only safetensors since 5).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def find_weights(folder: str) -> str | None:
    """The weight file transformers will load from `folder`, or None."""
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            return name
    return None
