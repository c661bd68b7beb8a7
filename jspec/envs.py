"""Every environment variable jspec reads, declared here and read nowhere else.

Read through this module's attributes (``envs.JSPEC_CACHE``), each evaluated at the time
of the read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    JSPEC_CACHE: str


environment_variables: dict[str, Callable[[], Any]] = {
    # Folder of the generated default model (jspec/default_model.py); ~/.cache/jspec if unset.
    "JSPEC_CACHE": lambda: os.environ.get("JSPEC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jspec")),
}


def __getattr__(name: str):
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return list(environment_variables)
