"""glibc malloc tuning: large blocks come from the heap and its pages stay mapped once freed.

Each case runs in a fresh interpreter (the thresholds are process state), reading glibc's own
accounting (``mallinfo2``): ``hblkhd`` is memory served by fresh mmaps, ``arena`` the heap.

Engines: a fresh interpreter per case: malloc thresholds are process state.
"""

import pytest

from helpers import GLIBC_MALLINFO, run_probe
from vllm_specrl.cpu import malloc as cpu_malloc

PROBE = GLIBC_MALLINFO + r"""
import json, sys
from vllm_specrl.cpu import malloc as cpu_malloc

result = cpu_malloc.tune_glibc_malloc() if sys.argv[1] == "tune" else "untouched"
size = 20 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
during = libc.mallinfo2()
libc.free(ctypes.c_void_p(block))
after = libc.mallinfo2()
print(json.dumps({"result": result, "again": cpu_malloc.tune_glibc_malloc() if sys.argv[1] == "tune" else None,
                  "mmapped_during": during.hblkhd, "heap_during": during.arena, "heap_after_free": after.arena}))
"""


def test_a_child_environment_drops_the_callers_malloc_settings_and_switch():
    env = {"PATH": "/bin", "MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "1", cpu_malloc.ENV: "0", "X": "MALLOC_"}
    assert cpu_malloc.environ_without_malloc_settings(env) == {"PATH": "/bin", "X": "MALLOC_"}


def probe(mode: str, **env) -> dict:
    return run_probe(PROBE, mode, **env)


def test_a_20_mib_block_is_served_from_the_heap_and_stays_mapped_after_free():
    untouched, tuned = probe("untouched"), probe("tune")
    assert untouched["mmapped_during"] >= 20 << 20, untouched       # glibc's default: a fresh mmap
    assert tuned["result"] == tuned["again"] == "installed", tuned
    assert tuned["mmapped_during"] < 1 << 20 and tuned["heap_during"] >= 20 << 20, tuned
    assert tuned["heap_after_free"] >= 20 << 20, tuned                # not trimmed: no fresh pages next time


@pytest.mark.parametrize("env, says", [({"VLLM_SPECRL_MALLOC_TUNING": "0"}, "off"),
                                       ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "left to the environment"),
                                       ({"LD_PRELOAD": "/nonexistent/libtcmalloc_minimal.so.4"}, "not needed")])
def test_left_alone_where_the_user_chose(env, says):
    got = probe("tune", **env)
    assert got["result"].startswith(says), got
    assert got["mmapped_during"] >= 20 << 20, got


REUSE_PROBE = r"""
import ctypes, json, resource, sys
from vllm_specrl.cpu import malloc as cpu_malloc

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
result = cpu_malloc.keep_every_block_on_heap() if sys.argv[1] == "heap" else cpu_malloc.tune_glibc_malloc()
size = int(sys.argv[2]) << 20
faults = []
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    libc.free(ctypes.c_void_p(block))
print(json.dumps({"result": result, "again": cpu_malloc.keep_every_block_on_heap(), "faults": faults}))
"""


def reuse_probe(mode: str, mib: int = 256, **env) -> dict:
    return run_probe(REUSE_PROBE, mode, str(mib), **env)


def test_a_training_process_reuses_the_pages_of_a_block_above_the_mmap_ceiling():
    # Above 32 MiB, glibc maps every block afresh even with the thresholds raised: each use faults it in
    # (a policy log-prob pass's logits are about 256 MiB).
    tuned = reuse_probe("tune", 256)
    assert all(f >= (256 << 20) // 4096 * 0.9 for f in tuned["faults"]), tuned
    # 1.1 GiB: freed at the heap's top it is also above the raised trim threshold, so it must not be trimmed.
    pages = (1152 << 20) // 4096
    heap = reuse_probe("heap", 1152)
    assert heap["result"] == heap["again"] == "installed, every block on the heap", heap
    assert heap["faults"][0] >= pages * 0.9, heap                   # the first use grows the heap
    assert heap["faults"][1] < pages * 0.01, heap                   # the next one reuses its pages


def test_the_heap_mode_is_left_alone_where_the_user_chose():
    got = reuse_probe("heap", VLLM_SPECRL_MALLOC_TUNING="0")
    assert got["result"].startswith("off"), got
    assert min(got["faults"]) >= (256 << 20) // 4096 * 0.9, got
