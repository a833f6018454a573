"""The MoE, quantized-weight and split-KV decode kernels compiled for GPU architectures on a machine without one
(tests/engine/kernel_compile.py, in a child process without the interpreter): every variant the wrappers launch
compiles to a cubin within the architecture's shared memory, except Triton's fp8e4nv conversion below sm_89, which
is why fp8_triton_gemm decodes the FP8 bits itself there (and why an fp8 KV cache needs sm_89)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = [pytest.mark.processes, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _compile(arch: int, *dtypes: str) -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.engine.kernel_compile", str(arch), *dtypes], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok ", "FAILED "))]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.returncode, lines


@pytest.mark.parametrize("arch,dtypes", [(90, ("bf16", "fp32")), (89, ("fp32",))])
def test_every_variant_compiles(arch, dtypes):
    """Hopper in bf16 and fp32; Ada in fp32, the largest tiles against its 99 KiB of shared memory a block."""
    rc, lines = _compile(arch, *dtypes)
    assert rc == 0 and all(line.startswith("ok ") for line in lines), "\n".join(lines)
    assert len(lines) == 24 * len(dtypes)  # 18 MoE and weight GEMMs, 5 split-KV decode and its merge a dtype
    assert sum(" split_decode " in line or " split_merge " in line for line in lines) == 6 * len(dtypes)


def test_ampere_has_no_fp8e4nv_but_decodes_the_bits():
    rc, lines = _compile(80, "bf16")
    failed = [line for line in lines if line.startswith("FAILED")]
    assert len(failed) == rc == 2, "\n".join(lines)
    assert all("format 2" in line and "fp8e4nv not supported" in line for line in failed)
    assert sum(line.startswith("ok sm_80 weight_gemm format 3") for line in lines) == 2  # the bit decoding
    assert sum(line.startswith(("ok sm_80 split_decode", "ok sm_80 split_merge")) for line in lines) == 4
