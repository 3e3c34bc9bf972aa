"""Starting the draft trainer must not fork the policy process: a fork write-protects all of its
pages, and the policy's next pass then faults on every page it writes. Each case runs in a fresh
interpreter holding 256 MiB it rewrites after the start, counting its own page faults.

Engines: a fresh interpreter per case: page-fault counts are process state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, os, resource, subprocess, sys
from vllm_specrl.processes import start_niced

buf = bytearray(256 << 20)
buf[::4096] = b"\1" * len(range(0, len(buf), 4096))    # every page written once: resident, private
# the child reports its niceness and scheduling policy, and those of a thread it starts afterwards
child = [sys.executable, "-c", "import os, threading, time; time.sleep(0.3); seen = []; "
         "t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0))); t.start(); t.join(); "
         "print(os.nice(0), os.sched_getscheduler(0), seen[0])"]
if sys.argv[1].startswith("start_niced"):
    proc = start_niced(child, 19, idle=sys.argv[1].endswith("idle"), stdout=subprocess.PIPE, text=True)
else:  # what the demo did before: niceness from a preexec_fn, which needs fork()
    proc = subprocess.Popen(child, stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.nice(19))
niceness, policy, thread_policy = map(int, proc.communicate()[0].split())
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
buf[::4096] = b"\2" * len(range(0, len(buf), 4096))
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, "child_nice": niceness,
                  "child_policy": policy, "child_thread_policy": thread_policy}))
"""
PAGES = (256 << 20) // 4096


def probe(how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_trainer_starts_niced_without_write_protecting_the_callers_pages():
    forked, spawned = probe("preexec_fn"), probe("start_niced")
    assert forked["faults"] >= PAGES * 0.9, forked      # the reference: fork() made every page copy-on-write
    assert forked["child_nice"] == 19, forked
    assert spawned["faults"] < PAGES * 0.01, spawned
    assert spawned["child_nice"] == 19, spawned
    assert spawned["child_policy"] == spawned["child_thread_policy"] == os.SCHED_OTHER, spawned


def test_an_idle_trainer_runs_sched_idle_threads_included():
    idle = probe("start_niced_idle")
    assert idle["child_policy"] == idle["child_thread_policy"] == os.SCHED_IDLE, idle
    assert idle["child_nice"] == 19 and idle["faults"] < PAGES * 0.01, idle


def test_a_preexec_fn_is_refused():
    from vllm_specrl.processes import start_niced

    with pytest.raises(ValueError, match="preexec_fn"):
        start_niced(["true"], 19, preexec_fn=lambda: None)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_a_trainer_given_cpus_runs_only_there_threads_included():
    """``rl_demo.py`` starts the online draft trainer on the CPUs a CPU engine's worker leaves to its engine
    core, so it never takes the forward's core: the child and a thread it starts later run only there."""
    from vllm_specrl.processes import start_niced

    cpu = max(os.sched_getaffinity(0))
    child = [sys.executable, "-c", "import json, os, threading, time; time.sleep(0.3); seen = []; "
             "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0)))); t.start(); t.join(); "
             "print(json.dumps([sorted(os.sched_getaffinity(0)), seen[0]]))"]
    proc = start_niced(child, 19, idle=True, cpus={cpu}, stdout=subprocess.PIPE, text=True)
    main_cpus, thread_cpus = json.loads(proc.communicate(timeout=60)[0])
    assert main_cpus == thread_cpus == [cpu]
