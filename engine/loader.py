"""Load an HF model folder: config, tokenizer, and the safetensors weights (single file or sharded), memory-mapped.

The weights are never read into a state dict: each file is mapped read-only, its header checked (offsets inside
the file, known dtypes, shape x item size equal to the byte span, no two tensors sharing bytes), each tensor is a
zero-copy view of the mapped bytes, and the model's `load_weights` writes it into its parameter with one `copy_`
(the dtype conversion, and on CUDA the host-to-device transfer, happen in that copy). The pages a tensor was read
from are dropped from the process (madvise DONTNEED; they stay in the page cache) once it is copied, so the load's
peak memory is the parameters plus about one tensor. `kvgate bench load` (bench/engine_load.py) measures it
against transformers' `from_pretrained` and the loader this replaced.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from kvgate.common import bounded_json
from kvgate.common.errors import ModelLoadError
from kvgate.common.tokenizer_files import check_json_files

# The JSON files of a model folder that transformers parses (with json.loads: no bound on size or nesting), with
# the size each may have; each present is checked against it and bounded_json.MAX_DEPTH first.
CONFIG_FILES = {"config.json": bounded_json.CONFIG_BYTES, "generation_config.json": bounded_json.CONFIG_BYTES}


def load_hf_config(model_path: str | Path):
    from transformers import AutoConfig

    path = Path(model_path)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {str(path)!r} does not exist (give a local HF model folder or 'demo')")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {str(path)!r} has no config.json")
    check_json_files(path, CONFIG_FILES)
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc


def safetensors_files(model_path: str | Path) -> list[Path]:
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = bounded_json.read(index, bounded_json.INDEX_BYTES)["weight_map"]
            names = set(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"cannot read {index}: {exc!r}") from None
        if not all(isinstance(n, str) and n and Path(n).name == n and n not in (".", "..") for n in names):
            raise ModelLoadError(f"{index}: the weight_map must name files of the folder itself")
        files = sorted(path / f for f in names)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"sharded checkpoint in {str(path)!r} lacks {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        kind = " (only PyTorch .bin weights, which are not loaded; convert them to safetensors)" if any(
            path.glob("*.bin")) else ""
        raise ModelLoadError(f"model folder {str(path)!r} has no .safetensors weights{kind}")
    return files


# safetensors dtype names -> torch dtypes (unsigned 16/32/64-bit ints are left out: no model weights use them).
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit on the JSON header


class SafetensorsFile:
    """One .safetensors file, memory-mapped read-only, with its header checked: every tensor's bytes lie inside the
    file, its dtype is known, its shape times the item size is its byte span, and no two tensors share bytes. A
    corrupt or hostile file raises ModelLoadError here, before any tensor is read, and nothing is allocated for it
    beyond its (bounded) header.

    The mapping lives as long as this object or any tensor view of it (each view keeps a reference to the mmap
    object), so it is never unmapped under a view: drop them all and it is unmapped."""

    def __init__(self, path: str | Path, map_data: bool = True) -> None:
        """map_data False: the header alone is read (and checked the same, against the file's size), nothing is
        mapped and tensor() cannot be called (`kvgate serve --print-config` reads the weights' shapes so)."""
        self.path = Path(path)
        self._map = None
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 8:
                    raise ModelLoadError(f"{self.path}: {size} bytes, too short for a safetensors file")
                if map_data:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                (header_len,) = struct.unpack("<Q", self._map[:8] if map_data else f.read(8))
                if header_len > MAX_HEADER_BYTES:
                    raise ModelLoadError(f"{self.path}: header length {header_len} is over the "
                                         f"{MAX_HEADER_BYTES >> 20} MiB limit (not a safetensors file, or a corrupt "
                                         "one)")
                if 8 + header_len > size:
                    raise ModelLoadError(f"{self.path}: header length {header_len} runs past the end of the file "
                                         f"({size} bytes)")
                raw = bytes(self._map[8:8 + header_len]) if map_data else f.read(header_len)
        except OSError as exc:
            raise ModelLoadError(f"cannot {'map' if map_data else 'read'} {self.path}: {exc}") from None
        self._data_start = 8 + header_len
        self.entries = self._parse_header(raw, size - self._data_start)

    def _parse_header(self, raw: bytes, data_len: int) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
        """name -> (dtype, shape, begin, end), begin/end relative to the data section."""
        where = str(self.path)

        def no_duplicates(pairs):
            keys = [k for k, _ in pairs]
            if len(set(keys)) != len(keys):
                raise ModelLoadError(f"{where}: the header names a key twice")
            return dict(pairs)

        try:
            text = raw.decode("utf-8")
            bounded_json.check_depth(text)  # a real header is 3 levels deep
            header = json.loads(text, object_pairs_hook=no_duplicates)
        except ValueError as exc:  # bad UTF-8 or JSON, or nested too deep (all ValueErrors)
            raise ModelLoadError(f"{where}: the header is not valid JSON: {exc!s:.200}") from None
        if not isinstance(header, dict):
            raise ModelLoadError(f"{where}: the header is not a JSON object")
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(info, dict):
                raise ModelLoadError(f"{where}: tensor {name!r}: its header entry is not an object")
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
                raise ModelLoadError(f"{where}: tensor {name!r} has an unknown dtype {dtype!r:.40} (known: "
                                     f"{', '.join(SAFETENSORS_DTYPES)})")
            if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
                raise ModelLoadError(f"{where}: tensor {name!r} has an invalid shape {shape!r:.80}")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
                    and offsets[0] <= offsets[1]):
                raise ModelLoadError(f"{where}: tensor {name!r} has invalid data_offsets {offsets!r:.80}")
            begin, end = offsets
            if end > data_len:
                raise ModelLoadError(f"{where}: tensor {name!r} spans bytes [{begin}, {end}) of a data section of "
                                     f"{data_len} bytes (offsets out of range: a truncated or corrupt file)")
            torch_dtype = SAFETENSORS_DTYPES[dtype]
            nbytes = math.prod(shape) * torch_dtype.itemsize
            if nbytes != end - begin:
                raise ModelLoadError(f"{where}: tensor {name!r} of shape {shape} and dtype {dtype} needs {nbytes} "
                                     f"bytes, but its data_offsets span {end - begin}")
            entries[name] = (torch_dtype, tuple(shape), begin, end)
        previous = None
        for name, (_, _, begin, end) in sorted(entries.items(), key=lambda e: (e[1][2], e[1][3])):
            if previous is not None and begin < previous[1]:
                raise ModelLoadError(f"{where}: tensors {previous[0]!r} and {name!r} overlap (bytes [{begin}, "
                                     f"{previous[1]}) of the data section)")
            if end > begin:
                previous = (name, end)
        return entries

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy, read-only view of the mapped bytes (never write to it)."""
        if self._map is None:
            raise RuntimeError(f"{self.path} was opened for its header only (map_data False)")
        dtype, shape, begin, end = self.entries[name]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        start = self._data_start + begin
        if start % dtype.itemsize:  # a misaligned tensor (no writer of the format makes one): an aligned copy
            return torch.frombuffer(bytearray(self._map[start:self._data_start + end]), dtype=dtype).view(shape)
        with warnings.catch_warnings():  # torch warns that the buffer is read-only: the views are only read
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(self._map, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                    offset=start).view(shape)

    def release(self, name: str) -> None:
        """Drop the pages of `name`'s bytes from this process (they stay in the page cache; a later read of them
        faults them in again), so a load holds about one tensor's pages of the file at a time."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        _, _, begin, end = self.entries[name]
        first = (self._data_start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, first, self._data_start + end - first)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def open_safetensors(model_path: str | Path, map_data: bool = True) -> list[SafetensorsFile]:
    """The folder's safetensors files, mapped (map_data False: their headers only read) and checked; a tensor in
    two files is a load error."""
    files = [SafetensorsFile(f, map_data) for f in safetensors_files(model_path)]
    owner: dict[str, Path] = {}
    for f in files:
        for name in f.entries:
            if name in owner:
                raise ModelLoadError(f"tensor {name!r} is in both {owner[name].name} and {f.path.name}")
            owner[name] = f.path
    return files


def iterate_weights(files: list[SafetensorsFile]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, zero-copy view) of every tensor, file by file in the order of its bytes."""
    for f in files:
        for name in sorted(f.entries, key=lambda n: f.entries[n][2]):
            yield name, f.tensor(name)


def load_safetensors(model, model_path: str | Path, workers: int = 1, quantization=None, kernel_routes=None):
    """Write the folder's weights into `model`'s parameters (allocated, on any device) through its load_weights.

    quantization: the checkpoint's QuantConfig (engine/quantization), or None: each quantized linear's tensors
    are dequantized into the parameters' dtype on the way (quantization.dequantize_weights), copied on this
    thread whatever `workers`; returns what was read (a QuantSummary), None for an unquantized checkpoint.
    kernel_routes: the GPU path (quantization/linear.py's route_kernel_linears, run on the model before it was
    allocated): the quantized linears it replaced by QuantizedLinears get the checkpoint's quantized tensors in the
    Triton kernels' layout.

    workers > 1 runs the copies on that many threads (copy_ releases the GIL) while this thread maps the names
    and checks the shapes; load_weights' own checks (unknown tensor, wrong shape, missing weights) are the same.
    On the CPU it does not help, so the engine loads with one (`kvgate bench load --loaders mmap --mmap-workers
    1,2,4 --rounds 5` compares them): torch's copy_ already runs on every core, and most of the time is the kernel
    faulting in the parameters' fresh pages, while more threads map more tensors' pages at once and raise the peak
    RSS. On CUDA the copies are pageable host-to-device transfers: the knob stays for measuring that."""
    files = open_safetensors(model_path)
    owner = {name: f for f in files for name in f.entries}

    def release(name: str) -> None:
        if name in owner:  # a dequantized weight's name may be none of the checkpoint's tensors
            owner[name].release(name)

    def copy(name: str, dest: torch.Tensor, tensor: torch.Tensor) -> None:
        dest.copy_(tensor)
        release(name)

    weights, summary, routes = _dequantized(iterate_weights(files), quantization, model, owner, release,
                                            kernel_routes)
    # a dequantized weight is memory, not a view of the file: queued copies would hold many at once
    if workers <= 1 or quantization is not None:
        model.load_weights(weights, copy)
        if routes:
            from kvgate.engine.quantization.linear import check_routes_complete

            check_routes_complete(routes)
        return summary
    pending = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvgate-load") as pool:  # exit waits for all
        model.load_weights(weights, lambda *args: pending.append(pool.submit(copy, *args)))
    for future in pending:
        future.result()
    return summary


def _dequantized(weights, quantization, model, names, release=None, kernel_routes=None):
    """(the weight stream, with quantization's linears dequantized into the model's floating-point dtype but those
    of kernel_routes (route_kernel_linears' routes and reasons); the QuantSummary it fills; the routes) — the stream
    as it is and None for an unquantized checkpoint."""
    if quantization is None:
        return weights, None, None
    from kvgate.engine.quantization import QuantSummary, dequantize_weights

    summary = QuantSummary(quantization.method)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    routes = None
    if kernel_routes is not None:
        routes, reasons = kernel_routes
        summary.kernels, summary.dequantized = 0, dict(reasons)
    stream = dequantize_weights(weights, quantization, dtype, names, release, summary, routes)
    return stream, summary, routes


def build_model(hf_config, device: torch.device, dtype: torch.dtype, max_positions: int,
                before_allocation: Callable[[nn.Module], None] | None = None):
    """Our model of hf_config's architecture on `device`, its floating-point parameters in `dtype`, allocated but
    not written (uninitialised): built on the meta device, then allocated. On the meta device nothing is allocated
    (the shapes and dtypes alone, for checkpoint_weight_bytes). before_allocation(model): called on the meta
    model before its parameters are allocated (the GPU path's quantized linears replace dense ones there)."""
    from kvgate.engine.models import resolve_model_class
    from kvgate.engine.models.layers import RotaryEmbedding

    model_cls = resolve_model_class(hf_config)
    with torch.device("meta"), _no_random_init():
        model = model_cls(hf_config, max_positions=max_positions)
    if before_allocation is not None:
        before_allocation(model)
    # to_empty's empty_like of a meta tensor goes through torch's Python refs, whose first use imports sympy (slow):
    # the same allocation (uninitialised, floating-point tensors in `dtype`) with torch.empty instead.
    model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device))
    model.tie_weights()
    if torch.device(device).type != "meta":
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_buffers(device)
        if hasattr(model, "reset_buffers"):  # the transformers fallback's buffers computed at build time
            model.reset_buffers(device)
    return model


def load_model(hf_config, model_path: str | Path, device: torch.device, dtype: torch.dtype, max_positions: int,
               workers: int = 1, weights: Iterator[tuple[str, torch.Tensor]] | None = None, read_weights: bool = True,
               quantization: str | None = None, keep_quantized: bool = False):
    """Our model of hf_config's architecture on `device` in `dtype`, with the folder's weights: built and allocated
    (build_model), then every parameter written once (load_safetensors). weights: (name, tensor) pairs to load
    instead of the folder's (the load benchmark's reference loader). read_weights False: the parameters stay
    uninitialised and no byte of the checkpoint is read (`kvgate serve --print-config`'s CUDA memory profile, whose
    memory use does not depend on the values). quantization: --quantization (None: from config.json), checked
    against the checkpoint's quantization_config; the model's `quantization` attribute is what the load read (a
    QuantSummary; None for an unquantized checkpoint or without read_weights). keep_quantized: a quantized
    checkpoint's linears stay quantized on the Triton kernels (load_safetensors; the runner's choice)."""
    from kvgate.engine.quantization import quant_config_from_hf

    qconfig = quant_config_from_hf(hf_config, quantization)
    routes = None

    def route(meta_model) -> None:  # before allocation: a replaced linear's dense weight is never allocated
        nonlocal routes
        from kvgate.engine.quantization import plan_modules
        from kvgate.engine.quantization.linear import route_kernel_linears

        names = {name for f in open_safetensors(model_path, map_data=False) for name in f.entries}
        routes = route_kernel_linears(meta_model, plan_modules(names, qconfig), dtype, torch.device(device))

    keep = keep_quantized and qconfig is not None and read_weights and weights is None
    model = build_model(hf_config, device, dtype, max_positions, route if keep else None)
    model.quantization = None
    if not read_weights:
        return model.eval()
    if weights is None:
        model.quantization = load_safetensors(model, model_path, workers, qconfig, routes)
    else:
        model.load_weights(weights)
    return model.eval()


def checkpoint_weight_bytes(model, model_path: str | Path, quantization=None) -> tuple[int, int]:
    """(bytes, tensors) the folder's weights take in `model`'s parameters, each tensor counted at its parameter's
    dtype (the one the engine casts it to), from the safetensors headers alone: every file's header is read and
    checked as for a load, and every tensor against the model as load_weights checks it (it belongs to the model,
    its shape fits, no parameter is left unwritten, a tied LM head is skipped), but no byte of tensor data is read
    (but the few bytes of a pack-quantized module's weight_shape, its dense shape). quantization: the checkpoint's
    QuantConfig; a quantized linear counts as its dense weight (what the engine holds; checkpoint_file_bytes is
    what the folder stores). model: build_model's, on the meta device."""
    files = open_safetensors(model_path, map_data=quantization is not None)
    total = count = 0

    def add(name: str, dest: torch.Tensor, tensor: torch.Tensor) -> None:
        nonlocal total, count
        total += tensor.numel() * dest.element_size()
        count += 1

    def shape_of(f: SafetensorsFile, name: str) -> torch.Tensor:
        dtype, shape, _, _ = f.entries[name]
        if quantization is not None and name.endswith(".weight_shape"):
            return f.tensor(name)
        return torch.empty(shape, dtype=dtype, device="meta")

    shapes = ((name, shape_of(f, name)) for f in files for name in f.entries)
    shapes, _, _ = _dequantized(shapes, quantization, model, {name for f in files for name in f.entries})
    model.load_weights(shapes, add)
    return total, count


def checkpoint_file_bytes(model_path: str | Path) -> int:
    """Bytes of tensor data the folder's safetensors files store (quantized weights at their stored size), from
    their headers."""
    return sum(end - begin for f in open_safetensors(model_path, map_data=False)
               for _, _, begin, end in f.entries.values())


@contextmanager
def _no_random_init() -> Iterator[None]:
    """torch.nn.init's random fills as no-ops while the model is built on the meta device (every parameter is then
    written from the checkpoint, and load_weights checks that none is missed). On meta they fill nothing, but the
    first one in a process imports torch._dynamo (a slow import, tens of MB of RSS), which the engine otherwise never
    imports. What transformers' no_init_weights does too; not thread-safe (module-level)."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    for name in _RANDOM_INITS:
        setattr(nn.init, name, _keep)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "orthogonal_", "sparse_")


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor
