import pytest

from vllm_specrl.compat import engine_config
from vllm_specrl.compat import version as vllm_versions
from vllm_specrl import engine_rpc


@pytest.mark.parametrize("version,ok", [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.33.1", True), ("0.33.0rc1", True),
    ("0.34.0", True), ("0.31.9", False), ("0.35.0", False), ("1.32.0", False), ("dev", False),
])
def test_supported_range(version, ok):
    assert vllm_versions.is_supported(version) is ok


def test_check_supported_names_the_range():
    with pytest.raises(vllm_versions.UnsupportedVLLMVersion, match=r">=0.32,<0.35.*found 0.31.0"):
        vllm_versions.check_supported("0.31.0")
    assert vllm_versions.check_supported("0.32.0") == "0.32.0"


def test_installed_vllm_is_supported():
    assert vllm_versions.is_supported(vllm_versions.vllm_version())


class _Spec:
    method = "eagle3"
    model = "/ckpt/draft"
    num_speculative_tokens = 3
    draft_sample_method = "probabilistic"
    rejection_sample_method = "standard"


class _Cfg:
    speculative_config = _Spec()


def test_speculative_config_summary():
    summary = engine_config.speculative_config_summary(_Cfg())
    assert summary["method"] == "eagle3" and summary["num_speculative_tokens"] == 3
    assert engine_config.speculative_config_summary(object()) is None


class _Engine:
    errored = False


def test_a_call_pending_when_the_engine_dies_fails_instead_of_hanging():
    """vLLM never answers a utility call that was pending when the engine core died; the guard
    turns it into ``EngineDied`` once ``errored`` is set, and leaves live calls alone."""
    import asyncio

    async def scenario():
        engine = _Engine()
        assert await engine_rpc.unless_engine_dies(engine, asyncio.sleep(0.01, result=7), "ok") == 7
        parked = asyncio.get_running_loop().create_future()  # what vLLM leaves in utility_results
        asyncio.get_running_loop().call_later(0.3, setattr, engine, "errored", True)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(engine_rpc.EngineDied, match="during specrl_commit_update"):
            await engine_rpc.unless_engine_dies(engine, parked, "specrl_commit_update")
        return asyncio.get_running_loop().time() - t0

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) < 0.3 + 2 * engine_rpc.ENGINE_POLL_S


def test_a_call_failed_by_a_dying_engine_reports_the_death(monkeypatch):
    """A worker's death can fail the pending call ("Call to collective_rpc method failed:
    cancelled") before vLLM marks the engine errored: that is the engine dying, reported as
    ``EngineDied``; a call that fails while the engine stays alive keeps its own error."""
    import asyncio

    monkeypatch.setattr(engine_rpc, "DEATH_GRACE_S", 1.0)

    async def failing():
        raise RuntimeError("Call to collective_rpc method failed: cancelled")

    async def scenario(dies: bool):
        engine = _Engine()
        if dies:
            asyncio.get_running_loop().call_later(0.3, setattr, engine, "errored", True)
        await engine_rpc.unless_engine_dies(engine, failing(), "specrl_commit_update")

    with pytest.raises(engine_rpc.EngineDied, match="during specrl_commit_update"):
        asyncio.run(asyncio.wait_for(scenario(dies=True), 10))
    with pytest.raises(RuntimeError, match="cancelled"):
        asyncio.run(asyncio.wait_for(scenario(dies=False), 10))


class _DataParallelCore:
    """The shape of vLLM's DP client: one answer list per engine core from call_utility_all_async."""
    core_engines = [b"\x00\x00", b"\x01\x00"]

    async def call_utility_all_async(self, method, *args):
        assert method == "collective_rpc"
        return [[{"core": 0, "rpc": args[0]}], [{"core": 1, "rpc": args[0]}]]


class _AsyncLLM:
    def __init__(self, core):
        self.engine_core = core

    async def collective_rpc(self, method, timeout=None, args=()):
        return [{"core": 0, "rpc": method}]  # what vLLM's collective_rpc returns: the first core's only


def test_worker_calls_are_answered_by_every_data_parallel_core():
    import asyncio

    every = asyncio.run(engine_rpc.collective_rpc_all_engines(_AsyncLLM(_DataParallelCore()), "m", 1.0))
    assert every == [{"core": 0, "rpc": "m"}, {"core": 1, "rpc": "m"}]
    single = asyncio.run(engine_rpc.collective_rpc_all_engines(_AsyncLLM(object()), "m", 1.0))
    assert single == [{"core": 0, "rpc": "m"}]


@pytest.mark.parametrize("version,says", [("0.32.0+cpu", "run"), ("0.33.1", "read, not run"),
                                          ("0.34.0", "port written, not run"), ("0.35.0", "not validated")])
def test_the_gate_says_what_was_run_and_what_was_only_read(version, says):
    assert vllm_versions.validation(version).startswith(says)
