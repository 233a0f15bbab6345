"""A config's dotted targets (``model.target``, ``model.loss``, a checkpoint's saved ``model.target``)
resolved to the object they name."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable


def import_target(target: str, key: str) -> Callable:
    """``package.module:attr`` (attr may be dotted) -> the object. The module is looked for on the
    Python path, then in the current directory (``torchrun scripts/train.py`` puts only scripts/ on
    the path, so a module of the user's project would not be found otherwise).

    Raises:
        ValueError: a module that does not import, or a missing attribute; names ``key``.
    """
    module_name, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if os.getcwd() in sys.path or not module_name.startswith(e.name or "\0"):
            raise ValueError(f"{key}={target!r}: cannot import {module_name!r}: {e}") from None
        sys.path.append(os.getcwd())
        return import_target(target, key)
    except ImportError as e:
        raise ValueError(f"{key}={target!r}: cannot import {module_name!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if not n.startswith("_"))[:20]
            raise ValueError(
                f"{key}={target!r}: {module_name!r} has no {attr!r} (it has: {', '.join(names)}, "
                "...)"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key}={target!r} is a {type(obj).__name__}, not a class or function")
    return obj
