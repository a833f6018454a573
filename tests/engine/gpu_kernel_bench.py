"""The MoE and quantized-weight kernels alone on a GPU, against their torch counterparts (run by
tests/engine/gpu_check.sh's `moe` and `fp8` stages; not a test).

    python -m tests.engine.gpu_kernel_bench [moe] [quant] [--device cpu]

moe:   triton_moe.triton_experts against torch_experts on a layer of qwen3-moe-tiny (the bench's random model) and of
       Qwen3-30B-A3B, from one token to a prefill chunk: time, speed-up, the bytes of the experts the tokens route to
       against the copy bandwidth, and the difference between the two.
quant: triton_quant's GEMMs (int8 and int4 weight-only, FP8 per channel and block-wise, torch._scaled_mm's FP8 where
       the device has it) against the bf16 matmul of the same weights dequantized, on a 4096 x 4096 and a
       14336 x 4096 projection (Llama-3-8B's) for 1, 16 and 256 rows: time, weight bytes, bandwidth, error.
--device cpu runs every kernel once on tiny sizes under Triton's interpreter: the check that the script runs.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def _timer(device: torch.device):
    """ms of one call of fn: triton's do_bench on CUDA, one timed call on CPU (the interpreter: a check, no speed)."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    def once(fn):
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)

    return once


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


def moe_bench(device: torch.device, bandwidth: float) -> None:
    from kvgate.engine.models.moe import select_experts, torch_experts
    from kvgate.engine.triton_moe import triton_experts

    timed = _timer(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # (name, experts, top-k, hidden, width)
    layers = [("qwen3-moe-tiny", 64, 8, 1024, 384), ("qwen3-30b-a3b", 128, 8, 2048, 768)]
    token_counts = [1, 64, 256, 2048]
    if device.type != "cuda":
        layers, token_counts = [("tiny", 6, 2, 48, 40)], [1, 9]
    print(f"MoE experts ({dtype}): triton_experts vs torch_experts; bytes = the routed experts' weights")
    for name, experts, top_k, hidden, inter in layers:
        g = torch.Generator(device=device).manual_seed(0)
        w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=g) * hidden**-0.5
        w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=g) * inter**-0.5
        for tokens in token_counts:
            x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
            logits = torch.randn(tokens, experts, device=device, dtype=dtype, generator=g)
            weights, ids = select_experts(logits, top_k, renormalize=True, weights_in_fp32=False)
            routed = int(ids.unique().numel())
            nbytes = routed * 3 * inter * hidden * w13.element_size()
            fused = timed(lambda: triton_experts(x, w13, w2, weights, ids))
            ref = timed(lambda: torch_experts(x, w13, w2, weights, ids))
            err = _rel_err(triton_experts(x, w13, w2, weights, ids), torch_experts(x, w13, w2, weights, ids))
            print(f"  {name:<15} T={tokens:<5} experts used {routed:>3}: fused {1e3 * fused:8.1f} us, torch "
                  f"{1e3 * ref:8.1f} us ({ref / fused:5.2f}x); {nbytes / 1e6:6.1f} MB at "
                  f"{nbytes / fused / 1e6:6.0f} GB/s ({100 * nbytes / fused * 1e3 / bandwidth:5.1f}% of copy); "
                  f"rel. difference {err:.1e}")


def quant_bench(device: torch.device, bandwidth: float) -> None:
    import torch.nn.functional as F

    from kvgate.engine import triton_quant as tq

    timed = _timer(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes, rows, group = [(4096, 4096), (14336, 4096)], [1, 16, 256], 128
    if device.type != "cuda":
        shapes, rows, group = [(48, 64)], [1, 20], 32
    scaled_mm = device.type == "cuda" and tq.scaled_mm_supported(torch.empty(1, 16, device=device, dtype=dtype),
                                                                torch.empty(16, 16, device=device))
    print(f"quantized-weight GEMMs vs the {dtype} matmul of the dequantized weights; torch._scaled_mm FP8 "
          f"path: {'yes' if scaled_mm else 'no (needs compute capability 9.0 and bf16)'}")
    for n, k in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        q8 = torch.randint(0, 256, (n, k), device=device, dtype=torch.uint8, generator=g)
        q4 = torch.randint(0, 16, (n, k), device=device, dtype=torch.uint8, generator=g)
        packed = tq.pack_int4(q4)
        scales = (torch.rand(n, k // group, device=device, generator=g) * 0.01).to(dtype)
        zeros = torch.randint(0, 16, (n, k // group), device=device, dtype=torch.int8, generator=g)
        w_fp8 = (torch.randn(n, k, device=device, generator=g) * 50).to(torch.float8_e4m3fn)
        ch_scale = torch.rand(n, device=device, generator=g) * 0.004
        blk_scale = torch.rand(-(-n // 128), -(-k // 128), device=device, generator=g) * 0.004
        w_int8 = tq.dequantize_int_weight(q8, scales, None, 8, group)
        cases = [  # name, weight bytes, kernel, the same weights dequantized
            ("int8 g%d" % group, q8.numel() + scales.numel() * 2,
             lambda x: tq.int_weight_gemm(x, q8, scales, None, 8, group), w_int8),
            ("int4 g%d" % group, packed.numel() + scales.numel() * 2,
             lambda x: tq.int_weight_gemm(x, packed, scales, None, 4, group),
             tq.dequantize_int_weight(packed, scales, None, 4, group)),
            ("int4 g%d zeros" % group, packed.numel() + scales.numel() * 3,
             lambda x: tq.int_weight_gemm(x, packed, scales, zeros, 4, group),
             tq.dequantize_int_weight(packed, scales, zeros, 4, group)),
            ("fp8 channel (Triton)", w_fp8.numel() + n * 4,
             lambda x: tq.fp8_triton_gemm(x, w_fp8, ch_scale), tq.dequantize_fp8_weight(w_fp8, ch_scale, None, dtype)),
            ("fp8 block 128", w_fp8.numel() + blk_scale.numel() * 4,
             lambda x: tq.fp8_weight_gemm(x, w_fp8, blk_scale, (128, 128)),
             tq.dequantize_fp8_weight(w_fp8, blk_scale, (128, 128), dtype)),
        ]
        if scaled_mm:
            cases.append(("fp8 channel (_scaled_mm)", w_fp8.numel() + n * 4,
                          lambda x: tq.fp8_scaled_mm(x, w_fp8, ch_scale),
                          tq.dequantize_fp8_weight(w_fp8, ch_scale, None, dtype)))
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
            dense_bytes = n * k * w_int8.element_size()
            dense = timed(lambda: F.linear(x, w_int8))
            print(f"  [{m} x {k}] @ [{n} x {k}]^T: {dtype} matmul {1e3 * dense:8.1f} us, "
                  f"{dense_bytes / 1e6:6.1f} MB at {dense_bytes / dense / 1e6:6.0f} GB/s "
                  f"({100 * dense_bytes / dense * 1e3 / bandwidth:5.1f}% of copy)")
            for name, nbytes, fn, w in cases:
                ms = timed(lambda: fn(x))
                err = _rel_err(fn(x), F.linear(x.double(), w.double()))
                print(f"    {name:<25} {1e3 * ms:8.1f} us ({dense / ms:5.2f}x the matmul), {nbytes / 1e6:6.1f} MB "
                      f"at {nbytes / ms / 1e6:6.0f} GB/s ({100 * nbytes / ms * 1e3 / bandwidth:5.1f}% of copy); "
                      f"rel. error {err:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help="moe, quant (default: both)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if set(args.parts) - {"moe", "quant"}:
        parser.error(f"unknown parts {sorted(set(args.parts) - {'moe', 'quant'})}: moe, quant")
    args.parts = args.parts or ["moe", "quant"]
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' modules import triton
    from kvgate.bench.engine_roofline import copy_bandwidth

    bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}: copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s")
    if "moe" in args.parts:
        moe_bench(device, bandwidth)
    if "quant" in args.parts:
        quant_bench(device, bandwidth)


if __name__ == "__main__":
    main()
