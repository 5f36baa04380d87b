"""Text every Python install has: the standard library's own ``.py`` files, as bytes, split into
training and held-out files by a hash of each file's path.

The split is deterministic: files are listed by their path relative to the standard library
folder (POSIX form, sorted), a file is held out when the first byte of the SHA-256 of that path
is below ``HELDOUT_HASH_BELOW`` (about 10% of the files), and only the first
``MAX_FILE_BYTES`` of each file are used (so no single file, e.g. the 740 kB of
``pydoc_data/topics.py``, dominates). Tests, third-party packages and machine-specific files are
left out (``EXCLUDED_DIRS``, ``_sysconfigdata*``). Nothing depends on the file system's order,
the locale or the machine; what does depend on the Python version is which files exist and
what they hold (see examples/train_tiny_lm.py for how much that moves the held-out score).

Byte-level: a token is a byte (vocabulary 256), no tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sys
import sysconfig

import numpy as np

#: Folders (at any depth) whose files are not used: tests, third-party packages, caches,
#: compiled modules, and the build configuration folder (``config-3.11-x86_64-linux-gnu``).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__", "lib-dynload"})
#: A file is held out when the first byte of sha256(relative path) is below this (26/256: ~10%).
HELDOUT_HASH_BELOW = 26
#: Only the first this many bytes of each file are used.
MAX_FILE_BYTES = 64 * 1024


def stdlib_dir() -> pathlib.Path:
    """The running interpreter's standard library folder."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def source_files(root=None) -> list[str]:
    """Relative POSIX paths of the ``.py`` files used, sorted."""
    root = pathlib.Path(root or stdlib_dir())
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith("config-")]
        for name in files:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append((pathlib.Path(folder) / name).relative_to(root).as_posix())
    return sorted(found)


def is_heldout(relative_path: str) -> bool:
    """Whether a file (by its relative POSIX path) belongs to the held-out split."""
    return hashlib.sha256(relative_path.encode()).digest()[0] < HELDOUT_HASH_BELOW


@dataclasses.dataclass
class Split:
    """The files of one split and their bytes (each capped at ``MAX_FILE_BYTES``)."""
    root: str
    paths: list
    texts: list

    @property
    def num_bytes(self) -> int:
        return sum(len(t) for t in self.texts)

    def stream(self) -> np.ndarray:
        """All files concatenated in path order, uint8."""
        return np.frombuffer(b"".join(self.texts), np.uint8)

    def fingerprint(self) -> str:
        """SHA-256 (first 16 hex digits) over the paths and bytes: equal on two machines iff
        the split's text is."""
        h = hashlib.sha256()
        for path, text in zip(self.paths, self.texts):
            h.update(path.encode() + b"\0" + len(text).to_bytes(8, "little") + text)
        return h.hexdigest()[:16]


def load_split(heldout: bool, root=None) -> Split:
    """The training (``heldout=False``) or held-out split of the standard library at ``root``
    (default: the running interpreter's)."""
    root = pathlib.Path(root or stdlib_dir())
    paths = [p for p in source_files(root) if is_heldout(p) == heldout]
    texts = []
    for p in paths:
        with open(root / p, "rb") as f:
            texts.append(f.read(MAX_FILE_BYTES))
    return Split(str(root), paths, texts)


def heldout_windows(split: Split, length: int, max_per_file: int):
    """Evaluation windows: from each file, up to ``max_per_file`` non-overlapping windows of
    ``length`` bytes spread evenly over it (the first at its start; files shorter than one
    window are skipped), in path order.

    Returns ``(windows uint8 [N, length], file index [N])``: the file index groups windows for
    paired standard errors (files, not windows, are the independent units).
    """
    windows, owners = [], []
    for i, text in enumerate(split.texts):
        count = min(max_per_file, len(text) // length)
        for w in range(count):
            start = w * (len(text) // count)        # stride >= length: no overlap
            windows.append(np.frombuffer(text[start:start + length], np.uint8))
            owners.append(i)
    return np.stack(windows), np.asarray(owners, np.int32)


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))
