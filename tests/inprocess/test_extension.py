"""``combined_extension``: one qualified name any new interpreter resolves to a class with the framework's
extension and the package's; a name both define is an error when the combination is asked for.

Engines: none; one fresh interpreter resolves the combined name, as a spawned worker does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_specrl.inprocess.extension import combined_extension
from vllm_specrl.sync.worker.extension import SpecRLWorkerExtension

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_a_fresh_interpreter_resolves_the_combined_name(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    name = combined_extension("framework_extension.FrameworkExtension")
    code = (f"import sys; sys.path.insert(0, {str(EXAMPLES)!r})\n"
            "from vllm.utils.import_utils import resolve_obj_by_qualname\n"
            f"cls = resolve_obj_by_qualname({name!r})\n"
            "print([c.__name__ for c in cls.__mro__[1:3]], hasattr(cls, 'framework_param_sums'), "
            "hasattr(cls, 'specrl_commit_update'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['FrameworkExtension', 'SpecRLWorkerExtension'] True True"


def test_a_method_both_define_is_refused():
    class Clashing:
        def specrl_status(self):
            return {}

    Clashing.__module__, Clashing.__qualname__ = __name__, "Clashing"
    globals()["Clashing"] = Clashing
    with pytest.raises(TypeError, match="specrl_status"):
        combined_extension(Clashing)


def test_the_package_extension_alone_stays_the_plain_name():
    assert SpecRLWorkerExtension.__module__ == "vllm_specrl.sync.worker.extension"
