"""What the package knows about vLLM's internals, at the bottom of its import graph (it imports no
feature of the package): the version gate (``version``), reads of vLLM's config and worker objects
(``engine_config``), the patch registry (``registry``) with the internals read without patching
(``touch_points``), and the fixes of vLLM faults that belong to no feature (``cpu_expand_kernel``,
``cpu_seeded_rewind``, ``cpu_start_method``). Each feature's own patches live beside it and are
installed through the registry; ``vllm_specrl.patches`` lists them all."""
