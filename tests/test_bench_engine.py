"""host_info: benchmark JSONs say which CPU (and which vector extensions) produced them."""

from __future__ import annotations

from pathlib import Path

from vllm_specrl.bench_engine import host_info

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni
"""


def test_reads_model_and_the_isa_flags_that_change_step_costs(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    info = host_info(str(path))
    assert info["cpu_model"] == "AMD EPYC 9R14"
    assert info["isa"] == ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]


def test_an_avx2_machine_is_told_apart(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text("model name\t: Intel Xeon\nflags\t\t: fpu sse avx avx2 fma\n")
    assert host_info(str(path))["isa"] == ["avx2"]


def test_without_cpuinfo_it_still_names_the_platform(tmp_path: Path) -> None:
    info = host_info(str(tmp_path / "missing"))
    assert info["cpus"] and info["platform"] and "isa" not in info
