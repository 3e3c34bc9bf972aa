"""vLLM alone: the CPU build cannot place its workers with its own Ray executor.

vLLM 0.32.0 (cpu): ``LLM(..., distributed_executor_backend="ray", tensor_parallel_size=2)`` (or
``vllm serve --distributed-executor-backend ray``) fails in ``initialize_ray_cluster`` with "current
platform cpu does not support ray": the CPU platform sets no ``ray_device_key``, the resource the
executor asks Ray for per worker (upstream vllm#21602; a CPU-support PR was closed). A
``vllm.platform_plugins`` subclass of the CPU platform could set one, but the Ray path would also drop
vLLM's OpenMP thread binding and preload environment on CPU, which nothing here could measure against.
vllm-specrl therefore places whole engines in Ray actors on CPU
(``vllm_specrl.integrations.ray_actors``, ``examples/ray_fleet.py``).

    python scripts/repro/repro_cpu_ray_executor.py .fixtures/tiny/target
Exits 0 and prints the error when the fault is present; 1 if the engine started.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_PLUGINS", "")  # vLLM alone: no vllm-specrl plugin
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core's error raised here, not logged


def main(model: str) -> int:
    import ray
    from vllm import LLM

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, tensor_parallel_size=2,
            distributed_executor_backend="ray")
    except Exception as exc:  # noqa: BLE001 - the fault is the point
        if "does not support ray" not in str(exc):
            raise
        print(f"FAULT PRESENT: {type(exc).__name__}: {exc}")
        return 0
    finally:
        ray.shutdown()
    print("the Ray executor started on CPU: fault absent")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
