"""Run engine code in a fresh interpreter (vLLM allows one engine per process): a test's own function
(``in_engine_process``, ``run_function``) or a snippet (``run_python``); load the repo's scripts."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import REPO
from vllm_specrl.launcher import VLLMServer

STOCK_START_PROCESS = VLLMServer._start_process


def load_script(path: str):
    """A script under the repo (``scripts/...``) imported as a module, to test its functions."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 600,
               expect_failure: bool = False) -> str:
    """Run ``code`` as a fresh ``python -c`` (in-process engine mode); return its output. It runs in
    a forked child of the session's zygote, which imported vLLM once for all of them.

    Fails the test when the subprocess fails (or, with ``expect_failure``, succeeds).
    """
    full_env = dict(os.environ)
    full_env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    full_env.update(env or {})
    code = textwrap.dedent(code)
    zygote = _zygote()
    if zygote is not None and zygote.serves(full_env):
        returncode, out = zygote.run(code, full_env, timeout)
    else:
        proc = subprocess.run([sys.executable, "-c", code], env=full_env,
                              capture_output=True, text=True, timeout=timeout)
        returncode, out = proc.returncode, proc.stdout + proc.stderr
    if expect_failure:
        assert returncode != 0, f"subprocess was expected to fail:\n{out[-3000:]}"
    else:
        assert returncode == 0, f"subprocess failed (rc={returncode}):\n{out[-6000:]}"
    return out


# The one program ``run_function`` runs: the function's module imported by its name (the test modules'
# folders on the path, as pytest puts them), the function called with the pickled arguments, its value (or
# its traceback) pickled back.
_CALL = """
import importlib, pickle, sys, traceback
sys.path[:0] = [{tests!r}, {folder!r}]
fn = importlib.import_module({module!r})
for part in {qualname!r}.split("."):
    fn = getattr(fn, part)
fn = getattr(fn, "__wrapped__", fn)
with open({call!r}, "rb") as f:
    args, kwargs = pickle.load(f)
try:
    out = ("ok", fn(*args, **kwargs))
except BaseException:
    out = ("error", traceback.format_exc())
with open({result!r}, "wb") as f:
    pickle.dump(out, f)
"""


def run_function(fn: Callable, *args: Any, env: dict[str, str] | None = None, timeout: float = 600,
                 with_output: bool = False, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a forked child of the session's zygote, as ``run_python`` runs a snippet
    (engine mode, a fresh interpreter where the zygote cannot serve ``env``). ``fn`` is a module-level
    function of a test module or of the package (imported by its name there); its value comes back by pickle, and an
    exception it raises fails the caller with the child's traceback. ``with_output``: ``(value, the
    child's stdout and stderr)``, for a test that reads what the engine logged."""
    fn = inspect.unwrap(fn)
    folder = Path(inspect.getsourcefile(fn)).resolve().parent
    with tempfile.TemporaryDirectory(prefix="specrl-call-") as tmp:
        call, result = Path(tmp) / "call.pkl", Path(tmp) / "result.pkl"
        call.write_bytes(pickle.dumps((args, kwargs)))
        out = run_python(_CALL.format(tests=str(REPO / "tests"), folder=str(folder), module=fn.__module__,
                                      qualname=fn.__qualname__, call=str(call), result=str(result)),
                         env=env, timeout=timeout)
        if not result.exists():
            raise AssertionError(f"{fn.__qualname__} returned nothing from its engine process:\n{out[-4000:]}")
        status, value = pickle.loads(result.read_bytes())
    if status == "error":
        raise AssertionError(f"{fn.__qualname__} failed in its engine process:\n{value}\n"
                             f"--- the process's output ---\n{out[-4000:]}")
    return (value, out) if with_output else value


def in_engine_process(env: dict[str, str] | None = None, timeout: float = 600,
                      with_output: bool = False) -> Callable:
    """Decorator: calling the function runs it in its own engine process (``run_function``); the test
    module's engine code is ordinary Python, not a program in a string."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return run_function(fn, *args, env=env, timeout=timeout, with_output=with_output, **kwargs)
        return call
    return wrap


_ZYGOTES: dict[str, object] = {}


def _session_zygote(kind: str):
    """The session's zygote of ``kind`` (``Zygote``: snippets; ``ServerZygote``: ``vllm serve``), started on
    first use; ``SPECRL_TEST_ZYGOTE=0``: none, every snippet and server a fresh process."""
    if os.environ.get("SPECRL_TEST_ZYGOTE", "1") == "0":
        return None
    if kind not in _ZYGOTES:
        import atexit
        import tempfile

        import zygote

        handle = getattr(zygote, kind)(Path(tempfile.mkdtemp(prefix=f"specrl-{kind.lower()}-")))
        atexit.register(handle.close)
        _ZYGOTES[kind] = handle
    return _ZYGOTES[kind]


def _zygote():
    """The snippets' zygote (``run_python``)."""
    return _session_zygote("Zygote")


def _server_zygote():
    """The servers' zygote (``start_from_the_server_zygote``)."""
    return _session_zygote("ServerZygote")


def start_from_the_server_zygote(server) -> object:
    """``VLLMServer._start_process`` for the suite (tests/conftest.py): a ``vllm serve`` forked from the
    session's server zygote, which imported vLLM and its OpenAI server once for all of them; any other
    command (or an environment the zygote was not imported with) is started as the class does."""
    from vllm_specrl.launcher import vllm_executable

    zygote = _server_zygote()
    if zygote is None or server.cmd[:2] != [vllm_executable(), "serve"] or not zygote.serves(server.env):
        return STOCK_START_PROCESS(server)
    return zygote.start(server.cmd, server.env, str(server.log_path or os.devnull))  # the child writes the log


# glibc's own heap accounting for probe scripts: ``libc.mallinfo2()`` (``hblkhd``: mmapped blocks, ``arena``:
# the heap); ``libc.malloc`` returns a pointer.
GLIBC_MALLINFO = r"""
import ctypes

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
"""


def run_probe(script: str, *argv: str, timeout: float = 60, **env: str) -> dict:
    """``script`` in a fresh interpreter (malloc settings are process state), without the caller's malloc
    settings (plus ``env``); the JSON of its last line."""
    from vllm_specrl.cpu import malloc as cpu_malloc

    env = {**cpu_malloc.environ_without_malloc_settings(), **env}
    out = subprocess.run([sys.executable, "-c", script, *argv], env=env,
                         capture_output=True, text=True, check=True, timeout=timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def result_json(output: str, tag: str = "RESULT") -> dict:
    """The JSON a snippet printed on a line starting with ``tag``."""
    for line in reversed(output.splitlines()):
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise AssertionError(f"no {tag} line in output:\n{output[-4000:]}")


def perturbed_checkpoint(model_dir, out, seed: int, scale: float = 0.3):
    """A copy of ``model_dir`` whose matrices moved by ``scale`` of their std (an RL step, exaggerated)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from vllm_specrl.selftest.engine_job import perturbed

    shutil.copytree(model_dir, out)
    save_file(perturbed(load_file(model_dir / "model.safetensors"), seed, scale), out / "model.safetensors")
    return out


def assert_captured_rows_match_hf(model_dir, tokens: list[list[int]], captured: list[dict],
                                  keys: tuple[str, ...] = ("aux_hidden", "final_hidden")) -> None:
    """Each request (prompt + output tokens) was captured exactly once from position 0, and its
    rows equal an HF forward of the same tokens (per-row relative error < 2%). Frames of earlier
    requests may be among ``captured``: they are matched by tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_specrl.proposer.eagle3_config import default_aux_layer_ids
    from vllm_specrl.trainer.features import sequence_features

    cfg = json.loads((model_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = sequence_features(model, [t[:-1] for t in tokens], default_aux_layer_ids(cfg["num_hidden_layers"]),
                            dtype=torch.float32)
    for toks, want_rows in zip(tokens, ref):
        n = len(toks) - 1
        matches = [s for s in captured if s["start"] == 0 and s["token_ids"].tolist()[:n] == toks[:n]]
        assert len(matches) == 1, f"{len(matches)} captured streams for one request"
        for key in keys:
            got, want = matches[0][key][:n].float(), want_rows[key]
            err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max()
            assert err < 0.02, (key, float(err))


def record_drafts(model, speculative_config: dict, prompts: list[str], dump,
                  max_tokens: list[int] | None = None) -> dict:
    """Run seeded T=1 requests with the worker's draft recorder on; the drafter's records and each
    request's full token sequence (``{"records": [...], "outputs": {request_id: tokens}}``).
    ``max_tokens``: per request (default 24 each)."""
    import torch

    max_tokens = max_tokens or [24] * len(prompts)

    out = run_python(f"""
        import json, torch
        from vllm import LLM, SamplingParams
        llm = LLM(model={str(model)!r}, dtype="float32", enforce_eager=True, seed=0,
                  max_model_len=512, max_num_seqs=16, speculative_config={speculative_config!r},
                  worker_extension_cls="vllm_specrl.sync.SpecRLWorkerExtension")
        llm.collective_rpc("specrl_record_drafts", args=(True,))
        prompts = json.loads({json.dumps(json.dumps(prompts))})
        params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i)
                  for i, n in enumerate({max_tokens!r})]
        outs = llm.generate(prompts, params, use_tqdm=False)
        records = llm.collective_rpc("specrl_recorded_drafts")[0]
        torch.save({{"records": records,
                     "outputs": {{o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                                  for o in outs}}}}, {str(dump)!r})
        print("RESULT " + json.dumps({{"records": len(records)}}))
    """, env={"VLLM_PLUGINS": "specrl"})
    assert result_json(out)["records"] > 20
    return torch.load(dump, weights_only=False)


def sequence_of(outputs: dict, request_id: str) -> list[int]:
    """vLLM may suffix the engine-side request id; the output carries the caller's."""
    for rid, seq in outputs.items():
        if request_id == rid or request_id.startswith(rid + "-"):
            return seq
    raise KeyError(request_id)


def run_rl_demo(target, runs: str, out: Path, steps: int, prompts: int, group: int, *extra: str,
                warm_up_steps: int = 0) -> tuple[dict, str]:
    """``scripts/rl_demo.py`` in short float32 runs of the arithmetic task over a fixed set of ``prompts``
    tasks (the same prompts every step); fails the test if it fails. Returns (its JSON report, stdout)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "rl_demo.py"), "--target", str(target), "--runs", runs,
         "--dataset-size", str(prompts), "--steps", str(steps), "--prompts", str(prompts), "--group", str(group),
         "--max-tokens", "8", "--task", "arithmetic", "--dtype", "float32", "--lr", "1e-3",
         "--warm-up-steps", str(warm_up_steps), *extra,
         "--out", str(out)],
        capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout
