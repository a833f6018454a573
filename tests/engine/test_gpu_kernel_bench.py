"""tests/engine/gpu_kernel_bench.py's CPU-side logic, for the GPU session that runs it: the spec bandwidth read
from device names, argument checks, and the splitkv part end to end on tiny sizes under Triton's interpreter (the
same code path a GPU run takes, less the CUDA graphs and the timings)."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA is present: gpu_check.sh runs the bench itself", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton")

from tests.engine import gpu_kernel_bench as bench  # noqa: E402


@pytest.mark.parametrize("name,bandwidth", [
    ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H200", 4.8e12), ("NVIDIA H100 PCIe", 2.0e12),
    ("NVIDIA H100 SXM5 80GB", 3.35e12), ("NVIDIA H100 NVL", None), ("NVIDIA A100-SXM4-80GB", 2.0e12),
    ("NVIDIA GeForce RTX 4090", None), ("cpu", None),
])
def test_spec_bandwidth_by_device_name(name, bandwidth):
    assert bench.spec_bandwidth(name) == bandwidth


def test_arguments():
    args = bench.parse_args(["splitkv", "--device", "cpu"])
    assert args.parts == ["splitkv"] and args.contexts == [1500]
    assert bench.parse_args(["--device", "cuda"]).contexts == [8192, 32768]
    assert bench.parse_args(["splitkv", "--contexts", "100,2000"]).contexts == [100, 2000]
    assert bench.parse_args([]).parts == ["moe", "quant"]
    for bad in (["attention"], ["splitkv", "--contexts", "0"], ["splitkv", "--contexts", "8k"],
                ["splitkv", "--contexts", ",".join(["64"] * 9)], ["splitkv", "--contexts", str((1 << 20) + 1)]):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(bad)
        assert exc.value.code == 2


def test_splitkv_part_runs_and_checks_the_kernels(capsys):
    """600 tokens: 5 tiles of 128 in 2 splits (the merge runs), a float and an int8 cache, against the reference."""
    from kvgate.engine.triton_split_decode import split_ranges

    assert len(split_ranges(600, None, 128, 2, 512)) == 2
    assert bench.splitkv_bench(torch.device("cpu"), 1e9, None, [600]) < 1e-6
    lines = [line for line in capsys.readouterr().out.splitlines() if "ctx=600" in line]
    assert len(lines) == 2 and all("splits  2" in line for line in lines)
    for line in lines:
        errors = [float(word.rstrip(",")) for word in line.split("rel. error split ")[1].split(" one program ")]
        assert max(errors) < 1e-6, line
