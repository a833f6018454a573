"""The quantized-weight GEMMs (engine/triton_quant.py) on CPU under Triton's interpreter, against x @ the torch
references' dequantized weights: int4/int8 with and without zero points, group sizes 32/64/128, per-channel and
block-wise FP8 scales, FP8 through Triton's fp8 conversion and through the in-kernel bit decoding (the path of
devices below compute capability 8.9), M of one row and of more than one row tile, sizes off the tiles; the
_scaled_mm path's arithmetic through torch's CPU _scaled_mm. The `cuda` tests run the kernels compiled and
torch._scaled_mm's FP8 path on the GPU (skipped without CUDA)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the kernels' module below)
pytest.importorskip("triton")

from kvgate.engine import triton_moe, triton_quant as tq  # noqa: E402

if not _CUDA and "Interpreted" not in type(tq._weight_gemm_kernel).__name__:  # decorated before the variable was set
    importlib.reload(triton_moe)
    importlib.reload(tq)

interpreted = pytest.mark.skipif(_CUDA, reason="CUDA is present: the cuda tests check the compiled kernels")
needs_cuda = pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")


def _int_problem(m, n, k, bits, group, dtype, zeros, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.005).to(dtype)
    # zero points in int8 storage, as loaders keep them: 8-bit ones up to 255 as their bit pattern
    zero = torch.randint(0, 2**bits, (n, k // group), generator=g, dtype=torch.int32).to(torch.uint8).view(
        torch.int8) if zeros else None
    qweight = tq.pack_int4(q) if bits == 4 else q
    x = torch.randn(m, k, generator=g).to(dtype)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(qweight), to(scales), to(zero)


def _assert_matches(got, x, w):
    expected = (x.double() @ w.double().t())
    assert got.shape == expected.shape and got.dtype == x.dtype
    err = ((got.double() - expected).norm() / expected.norm()).item()
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 5e-3}[x.dtype]  # the output's rounding
    assert err < tol, err


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_int4_and_reference(bits):
    x, qweight, scales, zeros = _int_problem(1, 3, 64, bits, 32, torch.float32, zeros=True)
    q = tq._int_values(qweight, bits)
    if bits == 4:
        assert torch.equal(tq.pack_int4(q), qweight) and qweight.shape == (3, 32)
        assert int(qweight[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)  # the low nibble is the even k
    w = tq.dequantize_int_weight(qweight, scales, zeros, bits, 32)
    assert w.shape == (3, 64)
    zero = int(zeros.view(torch.uint8)[1, 1])  # int8 storage of an unsigned zero point
    assert w[1, 40].item() == pytest.approx((int(q[1, 40]) - zero) * scales[1, 1].item())
    sym = tq.dequantize_int_weight(qweight, scales, None, bits, 32)
    assert sym[2, 5].item() == pytest.approx((int(q[2, 5]) - 2 ** (bits - 1)) * scales[2, 0].item())


@interpreted
@pytest.mark.parametrize("bits,group,zeros", [(4, 128, False), (4, 32, True), (8, 64, False), (8, 32, True)])
@pytest.mark.parametrize("m,n,k,dtype", [
    (1, 72, 256, torch.float16),  # decode: one row
    (70, 100, 384, torch.float32),  # more rows than a tile; N off the tiles
    (5, 40, 128, torch.bfloat16),
])
def test_int_weight_gemm(bits, group, zeros, m, n, k, dtype):
    x, qweight, scales, zero = _int_problem(m, n, k, bits, group, dtype, zeros, seed=m + bits)
    got = tq.int_weight_gemm(x, qweight, scales, zero, bits, group)
    _assert_matches(got, x, tq.dequantize_int_weight(qweight, scales, zero, bits, group))


@interpreted
def test_int_weight_gemm_group_off_the_tile_and_int8_storage():
    """A group of 48 (K tiles of 16) and a strided x; int8 storage read as its uint8 bit pattern."""
    x, qweight, scales, zero = _int_problem(3, 24, 96, 8, 48, torch.float32, zeros=True, seed=7)
    x_wide = torch.randn(3, 200)
    x_wide[:, :96] = x
    zero = zero.view(torch.uint8).to(torch.int32)  # zero points as int32 this time
    assert zero.max() > 127
    got = tq.int_weight_gemm(x_wide[:, :96], qweight.view(torch.int8), scales, zero, 8, 48)
    _assert_matches(got, x, tq.dequantize_int_weight(qweight, scales, zero, 8, 48))


def test_bad_shapes_are_named():
    x, qweight, scales, _ = _int_problem(2, 8, 64, 4, 32, torch.float32, zeros=False)
    with pytest.raises(ValueError, match="scales"):
        tq.int_weight_gemm(x, qweight, scales[:, :1], None, 4, 32)
    with pytest.raises(ValueError, match="bits"):
        tq.int_weight_gemm(x, qweight, scales, None, 3, 32)
    w = torch.randn(8, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block-wise scale"):
        tq.fp8_weight_gemm(x, w, torch.ones(2, 2), block_size=(128, 128))
    with pytest.raises(ValueError, match="per channel"):
        tq.fp8_weight_gemm(x, w, torch.ones(3))


def _fp8_problem(m, n, k, dtype, scale_kind, block=None, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if scale_kind == "tensor":
        scale = torch.tensor(0.003)
    elif scale_kind == "channel":
        scale = torch.rand(n, generator=g) * 0.004 + 0.001
    else:
        scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.004 + 0.001
    x = torch.randn(m, k, generator=g).to(dtype)
    return x.to(device), w.to(device), scale.to(device)


@interpreted
@pytest.mark.parametrize("decode_bits", [False, True])
@pytest.mark.parametrize("m,n,k,dtype,scale_kind,block", [
    (1, 40, 96, torch.bfloat16, "tensor", None),
    (33, 72, 160, torch.float32, "channel", None),
    (70, 200, 300, torch.float16, "block", (128, 128)),  # partial blocks on both axes, three row tiles
    (4, 64, 256, torch.bfloat16, "block", (32, 64)),
])
def test_fp8_weight_gemm(decode_bits, m, n, k, dtype, scale_kind, block):
    x, w, scale = _fp8_problem(m, n, k, dtype, scale_kind, block, seed=m)
    got = tq.fp8_triton_gemm(x, w, scale, block, decode_bits=decode_bits)
    _assert_matches(got, x, tq.dequantize_fp8_weight(w, scale, block, dtype))
    assert torch.equal(got, tq.fp8_weight_gemm(x, w, scale, block))  # CPU: the Triton kernel


@interpreted
@pytest.mark.parametrize("decode_bits", [False, True])
def test_fp8_decoding_covers_every_bit_pattern(decode_bits):
    """All 256 float8_e4m3fn patterns (subnormals, both zeros, NaN) as a [256, 1] weight times x = [[1.0]]. (The
    interpreter's own fp8 conversion reads the two NaN patterns as +-480, the exponent's next step; a checkpoint
    holds no NaN weights.)"""
    w = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(256, 1)
    decoded = tq.fp8_triton_gemm(torch.ones(1, 1), w, torch.tensor(1.0), decode_bits=decode_bits)[0]
    expected = w.float()[:, 0]
    finite = ~expected.isnan()
    assert torch.equal(decoded[finite], expected[finite])
    assert (~finite).sum() == 2
    if decode_bits:
        assert decoded[~finite].isnan().all()


@pytest.mark.parametrize("scale_kind", ["tensor", "channel"])
def test_fp8_scaled_mm_arithmetic(scale_kind):
    """fp8_scaled_mm's per-token activation quantization and both scales, through torch._scaled_mm's CPU
    implementation (the CUDA one runs in test_compiled_fp8_scaled_mm): equal, to bf16 rounding, to the product of
    the FP8-rounded activations and the dequantized weights."""
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("this torch has no _scaled_mm")
    x, w, scale = _fp8_problem(24, 48, 64, torch.bfloat16, scale_kind, seed=5)
    x[3] *= 100  # rows of very different ranges: each its own scale
    got = tq.fp8_scaled_mm(x, w, scale)
    x_scale = x.float().abs().amax(dim=1, keepdim=True) / tq.FP8_MAX
    x_rounded = (x.float() / x_scale).to(torch.float8_e4m3fn).double() * x_scale.double()
    expected = x_rounded @ tq.dequantize_fp8_weight(w, scale, None, torch.float32).double().t()
    assert got.dtype == torch.bfloat16
    err = ((got.double() - expected).norm(dim=1) / expected.norm(dim=1)).max().item()
    assert err < 5e-3, err


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("m", [1, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_int_and_fp8(m, dtype):
    for bits, group, zeros in ((4, 128, False), (4, 64, True), (8, 128, False)):
        x, qweight, scales, zero = _int_problem(m, 1000, 2048, bits, group, dtype, zeros, device="cuda")
        got = tq.int_weight_gemm(x, qweight, scales, zero, bits, group)
        _assert_matches(got, x, tq.dequantize_int_weight(qweight, scales, zero, bits, group))
    for scale_kind, block in (("tensor", None), ("channel", None), ("block", (128, 128))):
        x, w, scale = _fp8_problem(m, 1000, 2048, dtype, scale_kind, block, device="cuda")
        for decode_bits in (False, True) if torch.cuda.get_device_capability() >= (8, 9) else (True,):
            got = tq.fp8_triton_gemm(x, w, scale, block, decode_bits=decode_bits)
            _assert_matches(got, x, tq.dequantize_fp8_weight(w, scale, block, dtype))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("scale_kind", ["tensor", "channel"])
def test_compiled_fp8_scaled_mm(scale_kind):
    """torch._scaled_mm with per-token FP8 activations: the activations' FP8 rounding (3 mantissa bits) on top."""
    x, w, scale = _fp8_problem(64, 1024, 2048, torch.bfloat16, scale_kind, device="cuda")
    if not tq.scaled_mm_supported(x, w):
        pytest.skip("torch._scaled_mm's rowwise FP8 GEMM needs compute capability 9.0")
    got = tq.fp8_weight_gemm(x, w, scale)
    expected = x.double() @ tq.dequantize_fp8_weight(w, scale, None, torch.bfloat16).double().t()
    err = ((got.double() - expected).norm() / expected.norm()).item()
    assert err < 0.05, err
