"""Command-line conventions shared by the examples and the benchmarks.

Options are spelled with hyphens (`--batch-size`); the underscore spelling
(`--batch_size`) is accepted too, so that older commands keep working. `--help` shows
every option's default.
"""

from __future__ import annotations

import argparse
from typing import Any


def parser(description: str) -> argparse.ArgumentParser:
  """An `ArgumentParser` whose `--help` shows the defaults."""
  return argparse.ArgumentParser(
      description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def spellings(flag: str) -> tuple[str, ...]:
  """`'--batch-size'` -> `('--batch-size', '--batch_size')`; one-word flags alone."""
  if not flag.startswith('--') or '_' in flag:
    raise ValueError(f'Spell options with hyphens: {flag!r}.')
  alias = '--' + flag[2:].replace('-', '_')
  return (flag,) if alias == flag else (flag, alias)


def option(p: argparse.ArgumentParser, flag: str, **kwargs: Any) -> argparse.Action:
  """`p.add_argument(flag, ...)` that also accepts `flag`'s underscore spelling."""
  return p.add_argument(*spellings(flag), **kwargs)
