"""Quantized checkpoints (FP8, compressed-tensors, GPTQ, AWQ): their quantization_config read and checked
(config.py), one scheme per storage format (fp8.py, compressed_tensors.py, gptq.py, awq.py), and the weight-stream
step that dequantizes each quantized linear at load (stream.py); on the GPU path the linears stay quantized instead,
in the Triton kernels' layout (kernel_layout.py) inside QuantizedLinear modules (linear.py)."""

from kvgate.engine.quantization.config import METHODS, QuantConfig, quant_config_from_hf
from kvgate.engine.quantization.stream import QuantSummary, dequantize_weights, plan_modules

__all__ = ["METHODS", "QuantConfig", "QuantSummary", "dequantize_weights", "plan_modules", "quant_config_from_hf"]
