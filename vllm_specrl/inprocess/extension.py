"""One worker extension class out of a framework's own and the package's.

vLLM takes a single ``worker_extension_cls`` (a qualified name each worker process imports) and appends it
to the worker's bases. A framework with an extension of its own (verl, OpenRLHF: their weight-sync calls)
needs both. ``combined_extension`` answers a qualified name that any process can import: the class is made
on first access from the names it carries (``vllm_specrl.inprocess.extension.Combined__<framework
class>``, PEP 562's module ``__getattr__``), so a spawned worker builds the same class the trainer named.
The package's methods all start with ``specrl_`` or ``_specrl_``; a framework method of the same name is an
error at the start, never a silent override.
"""

from __future__ import annotations

import importlib
from typing import Any

SPECRL_EXTENSION = "vllm_specrl.sync.worker.extension.SpecRLWorkerExtension"
PREFIX = "Combined__"
_DOT, _COLON = "__d__", "__c__"
_cache: dict[str, type] = {}


def _encode(qualname: str) -> str:
    if _DOT in qualname or _COLON in qualname:
        raise ValueError(f"cannot combine {qualname!r}: its name contains {_DOT!r} or {_COLON!r}")
    return qualname.replace(":", _COLON).replace(".", _DOT)


def _decode(name: str) -> str:
    return name.replace(_COLON, ":").replace(_DOT, ".")


def _resolve(qualname: str) -> type:
    """``pkg.module.Class`` or ``pkg.module:Class``."""
    module, sep, attr = qualname.partition(":")
    if not sep:
        module, _, attr = qualname.rpartition(".")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise TypeError(f"{qualname} is not a class")
    return obj


def conflicts(framework: type, specrl: type) -> list[str]:
    """Names both classes define (dunders aside): the combination would hide one of them."""
    ours = {n for n in dir(specrl) if not n.startswith("__")} - set(dir(object))
    theirs = {n for n in dir(framework) if not n.startswith("__")} - set(dir(object))
    return sorted(ours & theirs)


def build(framework_qualname: str) -> type:
    """The class ``Combined__<encoded>`` names: the framework's extension first, then the package's."""
    if framework_qualname in _cache:
        return _cache[framework_qualname]
    framework, specrl = _resolve(framework_qualname), _resolve(SPECRL_EXTENSION)
    clash = conflicts(framework, specrl)
    if clash:
        raise TypeError(f"{framework_qualname} and SpecRLWorkerExtension both define {clash}: rename yours")
    name = PREFIX + _encode(framework_qualname)
    cls = type(name, (framework, specrl), {"__module__": __name__, "__qualname__": name,
                                            "__doc__": f"{framework_qualname} with SpecRLWorkerExtension"})
    _cache[framework_qualname] = cls
    return cls


def combined_extension(framework_extension: str | type) -> str:
    """The ``worker_extension_cls`` to hand vLLM: the framework's extension (a class or its qualified name)
    with ``SpecRLWorkerExtension``. Built once here, so a clash is an error now rather than in a worker."""
    qualname = framework_extension if isinstance(framework_extension, str) else \
        f"{framework_extension.__module__}.{framework_extension.__qualname__}"
    cls = build(qualname)
    return f"{__name__}.{cls.__name__}"


def __getattr__(name: str) -> type:
    if name.startswith(PREFIX):
        return build(_decode(name[len(PREFIX):]))
    raise AttributeError(name)
