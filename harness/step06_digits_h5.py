"""The HDF5 file step 06 streams from: written once, checked before training.

One file holds both sets as uint8 (4x smaller than float32), in chunks of --h5-chunk samples
with a checksum each; it is written under a temporary name and renamed when complete, so an
interrupted `prepare` leaves no half file and no reader ever sees one.

common.py's plain write_h5 and open_h5 (a copied 06 runs with them) are replaced here
(harness/__init__.py) by checked ones that write the same file and read the same samples:
- write_h5: a place that cannot be written is one line, and so is a full disk, which leaves no
  temporary file (checkpoint.write_atomically, which also removes a dead process's);
- open_h5: open_checked, the file's shapes, types, links and stored sizes checked before any
  byte is read (`prepare` reads every chunk's checksum), one line for a bad file.
around(script): a chunk damaged after those checks fails in h5py, in a DataLoader worker, with
no word of where; the run then ends with one line naming the file and the chunk.
"""

from __future__ import annotations

import contextlib
import io
from argparse import ArgumentTypeError
from pathlib import Path

import numpy as np
import torch

from .checkpoint import write_atomically, write_failure
from .data import MNIST_MEAN, MNIST_STD, Digits, prefix
from .errors import UserError, first_line
from .flags import SAMPLES_LIMIT, writable_dir

# h5py is imported where it is used: harness/__init__.py imports this module for every step.


def check_writable(path: Path) -> None:
    """Fail in one line when the file could not be written there (--out-dir's check)."""
    try:
        writable_dir(str(path.parent))
    except ArgumentTypeError as err:
        raise UserError(f"cannot write {path}: {err} (choose another --h5)") from None


def write_h5(path: Path, train_set: Digits, test_set: Digits, chunk: int,
             compression: str | None) -> None:
    """common.write_h5, checked: the place first, then write()."""
    check_writable(path)
    write(path, train_set, test_set, chunk, compression)


def write(path: Path, train_set: Digits, test_set: Digits, chunk: int,
          compression: str | None) -> None:
    """Both sets into one file, built in memory, then written under a temporary name and renamed
    into place (checkpoint.write_atomically).

    In memory first: HDF5 delays its writes, and when the disk fills up under it, it fails
    later, where h5py cannot report it (in a destructor), and was seen to crash the process
    (a segfault) as it closed the file, leaving the part it wrote. Writing the finished bytes
    ourselves, a full disk is an OSError, and the temporary file goes. (The conversion holds the
    sets in memory anyway; the file is about their size.)
    """
    import h5py
    image = io.BytesIO()
    with h5py.File(image, "w") as f:
        f.attrs.update(mean=MNIST_MEAN, std=MNIST_STD)  # see data.normalize
        for name, data in [("train", train_set), ("test", test_set)]:
            rows = min(chunk, len(data))
            group = f.create_group(name)
            group.attrs.update(count=len(data), shape=(28, 28))
            # No compression by default: an uncompressed chunk goes into the batch with no
            # CPU work in the workers. gzip shrinks MNIST ~4x for a little CPU per chunk,
            # worth it when the filesystem rather than the CPU is the bottleneck. fletcher32
            # stores a checksum per chunk: a damaged copy fails instead of training on garbage.
            group.create_dataset("images", data=data.images.numpy(), chunks=(rows, 28, 28),
                                 compression=compression, fletcher32=True)
            group.create_dataset("labels", data=data.labels.numpy(), chunks=(rows,),
                                 compression=compression, fletcher32=True)
    try:
        write_atomically(path, lambda f: f.write(image.getbuffer()))
    except OSError as err:
        raise UserError(f"cannot write {path}: {write_failure(err, path)}") from None


def open_checked(path: Path, train_samples: int | None, test_samples: int | None,
                 verify_all: bool = False) -> tuple[int, int, Digits]:
    """Check a file that write() wrote and read what is small: (training samples to use, chunk
    size, the test set in memory). Runs before training, so a bad file is one clear line, not
    a crash mid-epoch. verify_all reads every chunk (checksums); otherwise the labels and the
    last chunk, where a cut-off copy ends."""
    import h5py
    try:
        with h5py.File(path, "r") as f:
            for name in ["train", "test"]:
                images, labels = (only_inside(f, path, f"{name}/{part}")
                                  for part in ("images", "labels"))
                count = f[name].attrs["count"]
                if (images.dtype != np.uint8 or images.shape != (count, 28, 28)
                        or labels.shape != (count,) or labels.dtype.kind not in "iu"):
                    raise UserError(
                        f"{path}: {name} holds {images.dtype} images {images.shape} and "
                        f"{labels.dtype} labels {labels.shape}, expected uint8 {count} x 28 x 28 "
                        f"and {count} integers; delete it to prepare it again")
                check_stored(path, name, count, images, labels)
                values = labels[:]
                if not 0 <= values.min() <= values.max() <= 9:
                    raise UserError(f"{path}: {name} has labels outside 0-9; delete it to "
                                    f"prepare it again")
                rows = (images.chunks or [1024])[0]
                for a in range(0, count, rows) if verify_all else [count - 1]:
                    _ = images[a:a + rows]  # reading checks the chunks' checksums
            chunk = (f["train/images"].chunks or [1024])[0]
            train_count = train_samples or len(f["train/labels"])
            if train_count > len(f["train/labels"]):
                raise UserError(f"asked for {train_count} samples, but {path} holds "
                                f"{len(f['train/labels'])}")
            test_set = Digits(torch.from_numpy(f["test/images"][:]),
                              torch.from_numpy(f["test/labels"][:]).long())
    except (OSError, KeyError, ValueError) as err:
        raise UserError(f"{path} is not a readable digits file ({str(err)[:120]}); "
                        f"delete it to prepare it again") from None
    return train_count, chunk, prefix(test_set, test_samples)


def only_inside(f, path: Path, name: str):
    """The dataset `name` ("train/images"), if it and the group above it lie in this file:
    reached by hard links only (an external link opens another file, a soft link may lead
    anywhere in this one), and its bytes stored here (HDF5's external storage reads them from
    any file it names, a FIFO too, which would block the read forever; a virtual dataset maps
    other files). Checked before any byte of it is read."""
    import h5py
    node, reached = f, []
    for part in name.split("/"):
        if not isinstance(node, h5py.Group):
            raise KeyError(f"{'/'.join(reached)!r} is not a group")
        link = node.get(part, getlink=True)
        reached.append(part)
        if link is None:
            raise KeyError(f"no {name!r} in the file")
        if not isinstance(link, h5py.HardLink):
            kind, to = (("an external link", f"{link.filename}:{link.path}")
                        if isinstance(link, h5py.ExternalLink)
                        else ("a soft link", getattr(link, "path", "?")))
            raise UserError(f"{path}: {'/'.join(reached)} is {kind} (to {to}), not data stored "
                            f"in the file; not following it. Delete the file to prepare it "
                            f"again")
        node = node[part]
    if not isinstance(node, h5py.Dataset):
        raise KeyError(f"{name!r} is not a dataset")
    if node.external or node.is_virtual:
        where = node.external[0][0] if node.external else "other files (a virtual dataset)"
        raise UserError(f"{path}: {name} keeps its data outside the file (in {where!r}); not "
                        f"reading it. Delete the file to prepare it again")
    return node


def check_stored(path: Path, name: str, count: int, images, labels) -> None:
    """The counts a header states, against what the file holds, before anything is allocated:
    a header may say 10^8 samples in a file of a megabyte (its chunks never written, which
    read as zeros), and reading them would ask numpy for 73 GiB."""
    if count > SAMPLES_LIMIT:
        raise UserError(f"{path}: {name} says it holds {count} samples, more than the "
                        f"{SAMPLES_LIMIT} any run uses; delete it to prepare it again")
    for dataset in images, labels:
        if dataset.chunks is None:  # contiguous: all of it is stored, or none
            missing = dataset.id.get_storage_size() < dataset.nbytes
        else:
            missing = dataset.id.get_num_chunks() < -(-len(dataset) // dataset.chunks[0])
        if missing:
            raise UserError(f"{path}: {name} says it holds {count} samples, but the file "
                            f"stores only part of {dataset.name} (its header was changed, or "
                            f"it was cut); delete it to prepare it again")


# The file open_h5 checked in this process, for around(): the path is in the step's args only.
_checked: list[Path] = []


def open_h5(args) -> tuple[int, int, Digits]:
    """common.open_h5, checked (open_checked); `prepare` reads every chunk once."""
    _checked.append(args.h5)
    return open_checked(args.h5, args.train_samples, args.test_samples,
                        verify_all=args.command == "prepare")


@contextlib.contextmanager
def around(script: Path):
    """Around step 06's main(): a chunk that fails its checksum while training (a copy damaged
    since open_h5 checked it) is an OSError from h5py, re-raised from a DataLoader worker, which
    names neither the file nor the chunk. Read the training chunks again: the first that fails
    is named in one line. (An OSError with no damaged chunk behind it stays as it came.)"""
    try:
        yield
    except OSError:
        if _checked:
            name_damaged_chunk(_checked[-1])
        raise


def name_damaged_chunk(path: Path) -> None:
    """Raise a one-line UserError naming the first training chunk of `path` that cannot be
    read; return if every chunk reads, or if `path` is no longer a digits file at all."""
    import h5py
    try:
        with h5py.File(path, "r") as f:
            images, labels = f["train/images"], f["train/labels"]
            rows = (images.chunks or [1024])[0]
            for a in range(0, len(labels), rows):
                try:
                    images[a:a + rows], labels[a:a + rows]
                except OSError as err:
                    why = first_line(err, 80)
                    break
            else:
                return
    except (OSError, KeyError, ValueError):
        return  # gone or replaced since it was checked: the error stands as it came
    raise UserError(f"{path}: chunk {a // rows} (training rows {a}-{a + rows - 1}) cannot be "
                    f"read ({why}); the file is damaged: delete it and prepare it again")
