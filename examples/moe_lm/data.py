"""Byte-level language-modelling data from local text files (vocabulary 256).

The default corpus is the CPython standard library's own `.py` sources (about 12 MB
outside the test packages and `site-packages`), which every machine with Python has, so
nothing is downloaded. Any other directory works through `root` and `suffixes`.

Files are split into train and validation by a hash of their relative path, so a file
is never in both splits and the split does not depend on the machine or the file order.
Training batches are a pure function of `(seed, step)`: every optimizer in a comparison
sees the same batches in the same order. Validation batches are a fixed set of evenly
spaced windows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
import re
import sys
import sysconfig
from typing import Iterable, Sequence

import numpy as np

VOCAB_SIZE = 256
# Joins files; NUL never occurs in source text, so the model can learn "file starts here".
SEPARATOR = 0
# Directory names that hold tests, caches or third-party packages in the stdlib tree.
DEFAULT_EXCLUDE_DIRS = frozenset({
    'test', 'tests', 'idle_test', 'site-packages', 'dist-packages', '__pycache__',
})


def stdlib_dir() -> Path:
  """The directory of the running Python's standard library (where `os.py` lives)."""
  return Path(sysconfig.get_paths()['stdlib'])


def list_files(root: str | os.PathLike[str], suffixes: Sequence[str] = ('.py',),
               exclude_dirs: Iterable[str] = DEFAULT_EXCLUDE_DIRS) -> list[Path]:
  """All files under `root` with one of `suffixes`, outside excluded directories.

  Args:
    root: directory to search recursively.
    suffixes: file name endings to keep, e.g. `('.txt', '.md', '.py')`.
    exclude_dirs: directory names pruned anywhere in the tree (also names starting with
      `test` inside `idlelib`).

  Returns:
    Sorted paths relative to `root`.
  """
  root = Path(root)
  if not root.is_dir():
    raise FileNotFoundError(f'Not a directory: {root}')
  exclude = frozenset(exclude_dirs)
  suffixes = tuple(suffixes)
  found = []
  # os.walk with pruning: never descends into site-packages, which can be huge.
  for dirpath, dirnames, filenames in os.walk(root):
    here = Path(dirpath)
    dirnames[:] = [
        d for d in dirnames
        if d not in exclude and not (here.name == 'idlelib' and d.startswith('test'))
    ]
    found.extend((here / f).relative_to(root) for f in filenames if f.endswith(suffixes))
  return sorted(found)


def is_validation(rel_path: str | os.PathLike[str], val_fraction: float) -> bool:
  """Whether a file belongs to the validation split (a hash of its relative path)."""
  digest = hashlib.sha256(Path(rel_path).as_posix().encode()).digest()
  return int.from_bytes(digest[:8], 'big') / 2.0**64 < val_fraction


def split_files(files: Sequence[Path], val_fraction: float) -> tuple[list[Path], list[Path]]:
  """Splits relative paths into `(train, validation)` by `is_validation`.

  If the hash puts no file into validation (tiny directories), the file with the
  smallest hash goes there, so both splits are non-empty whenever there are two files.
  """
  train = [f for f in files if not is_validation(f, val_fraction)]
  val = [f for f in files if is_validation(f, val_fraction)]
  if not val and len(files) > 1 and val_fraction > 0:
    first = min(files, key=lambda f: hashlib.sha256(f.as_posix().encode()).digest())
    train.remove(first)
    val = [first]
  return train, val


def read_concatenated(root: Path, files: Sequence[Path]) -> np.ndarray:
  """The bytes of `files`, each followed by `SEPARATOR`, as one uint8 array."""
  chunks = []
  for f in files:
    chunks.append((root / f).read_bytes())
    chunks.append(bytes([SEPARATOR]))
  return np.frombuffer(b''.join(chunks), dtype=np.uint8)


@dataclasses.dataclass
class ByteDataset:
  """Train/validation byte streams with seed-reproducible batches.

  Attributes:
    root: the corpus directory.
    train: all training bytes, uint8.
    validation: all validation bytes, uint8.
    train_files: relative paths in the training split.
    val_files: relative paths in the validation split.
    seq_len: tokens per example (each batch row holds `seq_len + 1` for the shift).
    batch_size: rows per batch.
    seed: seed of the training batch order.
  """

  root: Path
  train: np.ndarray
  validation: np.ndarray
  train_files: list[Path]
  val_files: list[Path]
  seq_len: int
  batch_size: int
  seed: int = 0

  @classmethod
  def load(cls, root: str | os.PathLike[str] | None = None, *, seq_len: int = 128,
           batch_size: int = 16, seed: int = 0, suffixes: Sequence[str] = ('.py',),
           val_fraction: float = 0.05,
           exclude_dirs: Iterable[str] = DEFAULT_EXCLUDE_DIRS) -> ByteDataset:
    """Reads and splits a directory of text files.

    Args:
      root: corpus directory; None means the standard library (`stdlib_dir()`).
      seq_len: tokens per example.
      batch_size: rows per batch.
      seed: seed of the training batch order.
      suffixes: file endings to read, e.g. `('.txt', '.md', '.py')`.
      val_fraction: expected fraction of files in validation.
      exclude_dirs: directory names to skip.

    Returns:
      The dataset.
    """
    root = stdlib_dir() if root is None else Path(root)
    files = list_files(root, suffixes, exclude_dirs)
    if not files:
      raise ValueError(f'No files ending in {tuple(suffixes)} under {root}.')
    train_files, val_files = split_files(files, val_fraction)
    train = read_concatenated(root, train_files)
    validation = read_concatenated(root, val_files)
    for name, data in (('train', train), ('validation', validation)):
      if len(data) < seq_len + 1:
        raise ValueError(
            f'The {name} split of {root} has {len(data)} bytes, fewer than seq_len + 1 = '
            f'{seq_len + 1}; use more files, a smaller seq_len or another val_fraction.')
    return cls(root, train, validation, train_files, val_files, seq_len, batch_size, seed)

  def train_batch(self, step: int) -> np.ndarray:
    """Training batch number `step`: `[batch_size, seq_len + 1]` int32, a function of
    `(seed, step)` only."""
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, len(self.train) - self.seq_len, size=self.batch_size)
    return _windows(self.train, starts, self.seq_len + 1)

  def val_batches(self, n_batches: int | None = None) -> list[np.ndarray]:
    """A fixed list of validation batches, `[batch_size, seq_len + 1]` int32 each.

    Args:
      n_batches: number of batches; None means as many as fit without overlap.

    Returns:
      The same batches on every call: windows evenly spaced over the validation bytes.
    """
    window = self.seq_len + 1
    n_fit = max(1, len(self.validation) // (window * self.batch_size))
    n_batches = n_fit if n_batches is None else n_batches
    starts = np.linspace(0, len(self.validation) - window, n_batches * self.batch_size)
    starts = starts.astype(np.int64).reshape(n_batches, self.batch_size)
    return [_windows(self.validation, s, window) for s in starts]

  def summary(self) -> str:
    """One line: the corpus, file and byte counts of both splits (the standard library
    is named, not its path on this machine)."""
    where = (f'Python {sys.version_info.major}.{sys.version_info.minor} standard library'
             if Path(self.root) == stdlib_dir() else str(self.root))
    return (f'{where}: train {len(self.train_files)} files / {len(self.train):,} bytes, '
            f'validation {len(self.val_files)} files / {len(self.validation):,} bytes')


def portable_summary(summary: str) -> str:
  """A `summary()` line recorded by an older version, with the standard library's path
  on the recording machine replaced by its name."""
  return re.sub(r'^\S*/lib/python(\d+\.\d+):', r'Python \1 standard library:', summary)


def _windows(data: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
  """Rows `data[s:s + length]` for each start, as int32."""
  return data[starts[:, None] + np.arange(length)].astype(np.int32)


def encode(text: str) -> np.ndarray:
  """UTF-8 bytes of `text` as int32 token ids."""
  return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32)


def decode(tokens: Iterable[int]) -> str:
  """Token ids back to text (invalid UTF-8 replaced)."""
  return bytes(int(t) for t in tokens).decode('utf-8', errors='replace')
