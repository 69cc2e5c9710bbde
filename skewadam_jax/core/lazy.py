"""Third-party modules the library reads only in some calls, imported at first use.

`jax.extend` imports all of its submodules, Pallas among them: about half of what
`import skewadam_jax` would add to `import jax, optax`. Only the traced structure
analysis reads it, so it is imported when that analysis first runs.
"""

from __future__ import annotations

import importlib
from typing import Any


class _Lazy:
  """A module imported when one of its attributes is first read."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr: str) -> Any:
    return getattr(importlib.import_module(self._name), attr)


jex_core: Any = _Lazy('jax.extend.core')  # `jax.extend.core`
source_info_util: Any = _Lazy('jax.extend.source_info_util')  # `jax.extend.source_info_util`
