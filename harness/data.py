"""The data: MNIST through torchvision's real reader, or built-in synthetic digits offline.

Step 00 first needs it. Both sets are held in memory as uint8 (47 MB for MNIST) and normalised
batch by batch; step 06 streams the training set from HDF5 instead (step06_digits_h5.py).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys
import tempfile
import urllib.parse
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common import (MNIST_MEAN, MNIST_STD, Digits, make_loader, seed_worker,  # noqa: F401
                    synthetic_digits)

from .errors import UserError, first_line
from .ranks import all_ranks_agree

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> zero-mean, unit-variance floats (MNIST's statistics), as common.Digits."""
    return (images.float() / 255 - MNIST_MEAN) / MNIST_STD


def check_digits(images: torch.Tensor, labels: torch.Tensor, source: str) -> None:
    """Refuse data that would train on garbage: the wrong shape or type, counts that differ,
    labels outside 0-9. (`source` names the files in the message.)"""
    if images.dtype != torch.uint8 or images.dim() != 3 or tuple(images.shape[1:]) != (28, 28):
        raise UserError(f"{source} holds {tuple(images.shape)} {images.dtype} images, expected "
                        f"N x 28 x 28 uint8")
    if labels.dim() != 1 or len(labels) != len(images):
        raise UserError(f"{source} has {len(images)} images but {tuple(labels.shape)} labels; "
                        f"they must match one for one")
    if len(labels) == 0:
        raise UserError(f"{source} holds no samples")
    if labels.min() < 0 or labels.max() > 9:
        raise UserError(f"{source} has labels from {int(labels.min())} to {int(labels.max())}; "
                        f"digits are 0-9")


def load_datasets(args, run, download: bool) -> tuple[Digits, Digits]:
    """(train, test) as chosen by --data; prefixes when --train/--test-samples are given.

    Only processes with `download=True` fetch MNIST (one per machine, or one in all); the others
    wait at a barrier and then read the files. Every rank then checks that all ranks found MNIST,
    so no two ranks ever train on different data.
    """
    mnist_dir = args.data_dir / "MNIST" / "raw"
    if args.data != "synthetic":
        if download and not mnist_present(mnist_dir):
            extract_mnist(mnist_dir)  # the four .gz files, as MNIST's site serves them
        if download and not mnist_present(mnist_dir):
            try_download_mnist(args.data_dir)
        if dist.is_initialized():
            dist.barrier()
    use_mnist = args.data != "synthetic" and all_ranks_agree(run, mnist_present(mnist_dir))
    if args.data == "mnist" and not use_mnist:
        raise UserError(f"MNIST not found in {mnist_dir} on every rank, and it could not be "
                        f"downloaded (offline?): copy the four files {', '.join(MNIST_FILES)} "
                        f"(or their .gz) there, or run with --data synthetic")
    if use_mnist:
        train, test = read_mnist(args.data_dir)
    else:
        if args.data == "auto" and run.is_main:
            print(f"warning: MNIST not in {mnist_dir} and not downloadable; using built-in "
                  f"synthetic digits (--data synthetic to silence this)", flush=True)
        train = Digits(*synthetic_digits(args.train_samples or 60_000, seed=1))
        test = Digits(*synthetic_digits(args.test_samples or 10_000, seed=2))
    return prefix(train, args.train_samples), prefix(test, args.test_samples)


def prefix(data: Digits, count: int | None) -> Digits:
    """The first `count` samples (all of them for None)."""
    if count is None:
        return data
    if count > len(data):
        raise UserError(f"asked for {count} samples, but the dataset has {len(data)}")
    return Digits(data.images[:count], data.labels[:count])


def mnist_present(mnist_dir: Path) -> bool:
    return all((mnist_dir / name).is_file() for name in MNIST_FILES)


def extract_mnist(mnist_dir: Path) -> None:
    """Unpack the .gz files of MNIST found without their unpacked file (MNIST's site serves
    them gzipped; torchvision's download unpacks them, its reader reads only the unpacked
    ones). Each is written whole or not at all (checkpoint.write_atomically)."""
    import gzip
    import zlib

    from .checkpoint import write_atomically, write_failure

    for name in MNIST_FILES:
        packed, target = mnist_dir / f"{name}.gz", mnist_dir / name
        if target.exists() or not packed.is_file():
            continue
        try:
            with gzip.open(packed, "rb") as source:
                write_atomically(target, lambda f: shutil.copyfileobj(source, f, 2**20))
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:  # not gzip, cut short, ...
            raise UserError(f"could not unpack {packed}: it is damaged ({type(err).__name__}: "
                            f"{first_line(err, 80)}); copy it again") from None
        except OSError as err:  # a full disk, a read-only folder, ...
            raise UserError(f"could not unpack {packed}: {write_failure(err, target)}") from None


def try_download_mnist(data_dir: Path) -> None:
    """Download MNIST with torchvision if one of its mirrors answers within seconds (no long
    retries when offline). Files land in a new folder with a random name (mkdtemp: no one can
    plant a link at it beforehand) and are renamed into place, so an interrupted download, or
    two nodes downloading into one shared folder, leave no half file."""
    from torchvision.datasets import MNIST  # imported here: torchvision costs ~3 s to import

    if not any(_reachable(mirror) for mirror in MNIST.mirrors):
        return
    tmp = None
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=data_dir))
        MNIST(tmp, train=True, download=True)
        MNIST(tmp, train=False, download=True)
        target = data_dir / "MNIST" / "raw"
        target.mkdir(parents=True, exist_ok=True)
        for name in MNIST_FILES:
            os.replace(tmp / "MNIST" / "raw" / name, target / name)
    except Exception as err:  # noqa: BLE001 -- any failure means "not downloadable"
        print(f"warning: MNIST download failed: {first_line(err, 200)}", file=sys.stderr,
              flush=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _reachable(url: str, timeout_s: float = 3.0) -> bool:
    """Whether the server of `url` accepts a connection, on its own port (http: 80)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def read_mnist(data_dir: Path) -> tuple[Digits, Digits]:
    """Read the four IDX files with torchvision's MNIST class (we keep its tensors, not its
    per-sample PIL conversion, which would make the loader the bottleneck)."""
    from torchvision.datasets import MNIST

    raw = data_dir / "MNIST" / "raw"
    try:
        train = MNIST(data_dir, train=True, download=False)
        test = MNIST(data_dir, train=False, download=False)
    except Exception as err:  # noqa: BLE001 -- torchvision raises many kinds for bad files
        raise UserError(f"could not read MNIST in {raw} ({first_line(err, 120)}); "
                        f"delete the folder to download it again") from None
    check_digits(train.data, train.targets, f"MNIST's training files in {raw}")
    check_digits(test.data, test.targets, f"MNIST's test files in {raw}")
    return Digits(train.data, train.targets), Digits(test.data, test.targets)
