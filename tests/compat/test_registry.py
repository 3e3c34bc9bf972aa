"""The patch registry on stand-in classes (no vLLM object is patched here): a patch wraps the original
and uninstalling it puts back the very same object; a second install, or one over an attribute changed
behind the registry's back, is refused; patches on one attribute compose in their declared order; a
CPU-scoped patch is skipped off the CPU unless switched on; a signature drift skips with its reason
logged; the report lists every declared patch."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from vllm_specrl.compat.registry import CPU_ONLY_NOTE, SHORTCUTS_SWITCH, Patch, PatchError, Registry


class Base:
    def inherited(self, x):
        return f"base({x})"


class Runner(Base):
    def step(self, x, y):
        return f"step({x},{y})"

    @classmethod
    def make(cls, n):
        return f"make({n})"


MODULE = types.ModuleType("specrl_registry_standin")
MODULE.Runner = Runner
MODULE.helper = lambda a: f"helper({a})"
sys.modules[MODULE.__name__] = MODULE


def patch(name="p", attribute="Runner.step", scope="everywhere", signature=("self", "x", "y"), order=0,
          shortcut=False):
    return Patch(name=name, target=f"{MODULE.__name__}:{attribute}", why="test", scope=scope,
                 switch=f"SPECRL_TEST_{name.upper()}", checked_on=("0.32.0 cpu",), signature=signature, order=order,
                 shortcut=shortcut)


def tagging(tag):
    def wrap(inner):
        def wrapper(self, x, y):
            return f"{tag}[{inner(self, x, y)}]"
        return wrapper
    return wrap


@pytest.fixture
def registry():
    original = Runner.__dict__["step"]
    reg = Registry(is_cpu=lambda: True, environ={})
    yield reg
    Runner.step = original  # whatever a failing test left behind
    for name in ("inherited",):
        Runner.__dict__.get(name) and delattr(Runner, name)


def test_install_wraps_and_uninstall_restores_the_original_object(registry):
    original = Runner.__dict__["step"]
    assert registry.install(patch(), tagging("a")) == "installed"
    assert Runner().step(1, 2) == "a[step(1,2)]" and registry.original("p") is original
    registry.uninstall("p")
    assert Runner.__dict__["step"] is original
    assert registry.state("p")["state"] == "uninstalled"


def test_a_second_install_is_refused_and_changes_nothing(registry):
    registry.install(patch(), tagging("a"))
    with pytest.raises(PatchError, match="already installed"):
        registry.install(patch(), tagging("b"))
    assert Runner().step(1, 2) == "a[step(1,2)]"


def test_an_attribute_changed_behind_the_registry_is_not_patched_over(registry):
    registry.install(patch("p"), tagging("a"))
    Runner.step = lambda self, x, y: "someone else"
    with pytest.raises(PatchError, match="changed outside the registry"):
        registry.install(patch("q", order=1), tagging("b"))
    with pytest.raises(PatchError, match="changed outside the registry"):
        registry.uninstall("p")


def test_patches_on_one_attribute_compose_in_their_order_and_come_off_one_by_one(registry):
    original = Runner.__dict__["step"]
    registry.install(patch("outer", order=2), tagging("outer"))
    registry.install(patch("inner", order=1), tagging("inner"))
    assert Runner().step(1, 2) == "outer[inner[step(1,2)]]"
    registry.uninstall("inner")
    assert Runner().step(1, 2) == "outer[step(1,2)]"
    registry.uninstall("outer")
    assert Runner.__dict__["step"] is original


def test_an_inherited_method_patched_on_the_subclass_is_inherited_again_after(registry):
    registry.install(patch("i", attribute="Runner.inherited", signature=("self", "x")),
                     lambda inner: lambda self, x: f"i[{inner(self, x)}]")
    assert Runner().inherited(1) == "i[base(1)]" and Base().inherited(1) == "base(1)"
    registry.uninstall("i")
    assert "inherited" not in Runner.__dict__ and Runner().inherited(1) == "base(1)"


def test_module_functions_and_classmethods_can_be_patched(registry):
    helper = MODULE.helper
    registry.install(patch("h", attribute="helper", signature=("a",)), lambda inner: lambda a: f"h[{inner(a)}]")
    assert MODULE.helper(1) == "h[helper(1)]"
    registry.uninstall("h")
    assert MODULE.helper is helper
    make = Runner.__dict__["make"]
    registry.install(patch("m", attribute="Runner.make", signature=("cls", "n")),
                     lambda inner: classmethod(lambda cls, n: f"m[{inner.__func__(cls, n)}]"))
    assert Runner.make(3) == "m[make(3)]"
    registry.uninstall("m")
    assert Runner.__dict__["make"] is make


@pytest.mark.parametrize("is_cpu, switch, installed", [(True, None, True), (False, None, False),
                                                       (False, "1", True), (True, "0", False)])
def test_a_cpu_scoped_patch_applies_on_the_cpu_or_where_switched_on(is_cpu, switch, installed):
    environ = {} if switch is None else {"SPECRL_TEST_P": switch}
    reg = Registry(is_cpu=lambda: is_cpu, environ=environ)
    original = Runner.__dict__["step"]
    try:
        result = reg.install(patch(scope="cpu"), tagging("a"))
        assert (result == "installed") == installed, result
        assert (Runner.__dict__["step"] is original) != installed
        if not installed:
            assert ("SPECRL_TEST_P=1" in result and CPU_ONLY_NOTE in result) if switch is None else "=0" in result
    finally:
        Runner.step = original


@pytest.mark.parametrize("shortcut, shortcuts_switch, own_switch, installed", [
    (True, "0", None, False),   # the one switch turns a shortcut off
    (True, "0", "1", True),     # its own switch wins
    (True, "1", None, True),
    (False, "0", None, True),   # a fix of a vLLM fault is not a shortcut: it stays
])
def test_one_switch_turns_the_cpu_shortcuts_off(shortcut, shortcuts_switch, own_switch, installed):
    environ = {SHORTCUTS_SWITCH: shortcuts_switch, **({"SPECRL_TEST_P": own_switch} if own_switch else {})}
    reg = Registry(is_cpu=lambda: True, environ=environ)
    original = Runner.__dict__["step"]
    try:
        result = reg.install(patch(scope="cpu", shortcut=shortcut), tagging("a"))
        assert (result == "installed") == installed, result
        if not installed:
            assert f"{SHORTCUTS_SWITCH}=0" in result
    finally:
        Runner.step = original


def test_every_patch_in_the_cpu_package_is_a_shortcut_and_no_other_is():
    from vllm_specrl import patches  # noqa: F401 - declares every patch
    from vllm_specrl.compat.registry import REGISTRY

    shortcuts = {p.name for p in REGISTRY.patches() if p.shortcut}
    assert shortcuts and all(name.split(".")[0] in CPU_SHORTCUT_PATCHES for name in shortcuts)
    assert {p.name.split(".")[0] for p in REGISTRY.patches() if not p.shortcut}.isdisjoint(CPU_SHORTCUT_PATCHES)


# the patches of vllm_specrl/cpu/ (docs/cpu-shortcuts.md), by their names' first part
CPU_SHORTCUT_PATCHES = {"cpu_fast_sampling", "zero_draft_plain_sampler", "deferred_draft_kv", "skip_empty_draft_fetch",
                        "runner_step_timer", "cpu_start_method"}


def test_an_everywhere_patch_runs_off_the_cpu_too():
    reg = Registry(is_cpu=lambda: False, environ={})
    original = Runner.__dict__["step"]
    try:
        assert reg.install(patch(scope="everywhere"), tagging("a")) == "installed"
    finally:
        Runner.step = original


def test_a_signature_drift_skips_the_patch_with_its_reason_logged(registry, caplog):
    original = Runner.__dict__["step"]
    with caplog.at_level(logging.WARNING, logger="vllm_specrl.compat.registry"):
        result = registry.install(patch(signature=("self", "x")), tagging("a"))
    assert result.startswith("skipped: signature drift") and "['self', 'x', 'y']" in result
    assert Runner.__dict__["step"] is original
    assert any("signature drift" in r.getMessage() for r in caplog.records)


def test_a_missing_target_is_a_skip_not_an_error(registry):
    assert registry.install(patch(attribute="Runner.nowhere", signature=None), tagging("a")).startswith("skipped:")


def test_the_report_lists_every_declared_patch(registry):
    registry.declare(patch("never"))
    registry.install(patch("p"), tagging("a"))
    rows = {row["name"]: row for row in registry.report()}
    assert rows["never"]["state"] == "declared" and rows["p"]["state"] == "installed"
    assert rows["p"]["switch"] == "SPECRL_TEST_P" and rows["p"]["checked_on"] == ["0.32.0 cpu"]
    registry.uninstall("p")
    with pytest.raises(ValueError, match="scope"):
        Patch(name="x", target="m:a", why="", scope="gpu", switch="S", checked_on=())


def test_a_patch_on_one_object_wraps_its_bound_method_and_comes_off_it(registry):
    runner, other = Runner(), Runner()
    result = registry.install(patch("one", signature=("x", "y")),
                              lambda inner: lambda x, y: f"one[{inner(x, y)}]", on=runner)
    assert result == "installed"
    assert runner.step(1, 2) == "one[step(1,2)]" and other.step(1, 2) == "step(1,2)"
    registry.uninstall("one")
    assert "step" not in vars(runner) and runner.step(1, 2) == "step(1,2)"


def test_patches_on_one_object_compose_in_their_order_over_the_class_patches(registry):
    runner = Runner()
    registry.install(patch("cls"), tagging("cls"))
    registry.install(patch("late", signature=("x", "y"), order=11),
                     lambda inner: lambda x, y: f"late[{inner(x, y)}]", on=runner)
    registry.install(patch("early", signature=("x", "y"), order=10),
                     lambda inner: lambda x, y: f"early[{inner(x, y)}]", on=runner)
    assert runner.step(1, 2) == "late[early[cls[step(1,2)]]]"
    registry.uninstall("late")
    registry.uninstall("early")
    registry.uninstall("cls")
    assert runner.step(1, 2) == "step(1,2)"


def test_a_later_signature_the_patch_was_written_for_is_accepted(registry):
    drifted = Patch(name="later", target=f"{MODULE.__name__}:Runner.step", why="test", scope="everywhere",
                    switch="S", checked_on=(), signature=("self", "x"), also_checked=(("self", "x", "y"),))
    assert registry.install(drifted, tagging("a")) == "installed"
    registry.uninstall("later")


def test_skips_and_failures_are_reported_with_their_reason(registry):
    registry.skip(patch("absent"), "not needed (no fault here)")
    registry.declare(patch("broken"))
    registry.fail("broken", RuntimeError("boom"))
    rows = {row["name"]: row for row in registry.report()}
    assert rows["absent"]["state"] == "skipped" and rows["absent"]["detail"] == "not needed (no fault here)"
    assert rows["broken"]["state"] == "failed" and "boom" in rows["broken"]["detail"]
    registry.install(patch("p"), tagging("a"))
    with pytest.raises(PatchError, match="installed"):
        registry.skip(patch("p"), "too late")
    registry.uninstall("p")


def test_touch_points_list_each_patched_function_once_then_the_reads(registry):
    from vllm_specrl.compat.registry import TouchPoint

    registry.declare(patch("p"))
    registry.declare(patch("q", order=1))  # the same function: one touch point
    registry.reads(TouchPoint("x.py", "Thing", "attrs:a", "reading a"),
                   TouchPoint(f"{MODULE.__name__}.py", "Runner.step", "function", "a read too"))
    points = registry.touch_points()
    assert [(p.name, p.kind) for p in points] == [("Runner.step", "function"), ("Thing", "attrs:a")]
    assert points[0].used_for == "patch p"


def test_a_generic_wrapper_shows_the_signature_it_wraps(registry):
    """A later patch that checks the signature (or binds arguments by name) sees vLLM's parameters
    through a ``(self, *args, **kwargs)`` wrapper: the capture tap's check on a CPU runner's
    ``sample_tokens`` passed through the seeded-rewind fix only so."""
    import inspect

    registry.install(patch("generic", order=1), lambda inner: lambda self, *a, **k: inner(self, *a, **k))
    assert list(inspect.signature(Runner.step).parameters) == ["self", "x", "y"]
    runner = Runner()
    assert registry.install(patch("on_top", signature=("x", "y"), order=2),
                            lambda inner: lambda x, y: f"top[{inner(x, y)}]", on=runner) == "installed"
    assert runner.step(1, 2) == "top[step(1,2)]"
    registry.uninstall("on_top")
    registry.uninstall("generic")


def test_a_per_object_patch_goes_on_several_objects_once_each(registry):
    first, second = Runner(), Runner()
    wrap = lambda inner: lambda x, y: f"o[{inner(x, y)}]"  # noqa: E731
    for runner in (first, second):
        assert registry.install(patch("obj", signature=("x", "y")), wrap, on=runner) == "installed"
    with pytest.raises(PatchError, match="already installed"):
        registry.install(patch("obj", signature=("x", "y")), wrap, on=first)
    with pytest.raises(PatchError, match="say which"):
        registry.uninstall("obj")
    registry.uninstall("obj", on=first)
    assert first.step(1, 2) == "step(1,2)" and second.step(1, 2) == "o[step(1,2)]"
    assert registry.is_installed("obj")
    registry.uninstall("obj", on=second)
    assert not registry.is_installed("obj") and "step" not in vars(second)


def test_patches_that_work_only_together_install_all_or_none(registry):
    original = Runner.__dict__["step"]
    helper = MODULE.helper
    pair = [(patch("first"), tagging("first")),
            (patch("second", attribute="helper", signature=("other",)), lambda inner: lambda a: a)]
    assert registry.install_all(pair).startswith("skipped: signature drift")  # the second does not apply
    assert Runner.__dict__["step"] is original and MODULE.helper is helper  # so the first came off
    assert not registry.is_installed("first")
    pair[1] = (patch("second_ok", attribute="helper", signature=("a",)), lambda inner: lambda a: f"s[{inner(a)}]")
    assert registry.install_all(pair) == "installed"
    assert Runner().step(1, 2) == "first[step(1,2)]" and MODULE.helper(1) == "s[helper(1)]"
    registry.uninstall("second_ok")
    registry.uninstall("first")
