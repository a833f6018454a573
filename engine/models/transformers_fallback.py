"""The transformers fallback: any decoder-only causal LM that transformers can build, on kvgate's paged KV cache.

An architecture outside the native families (engine/models/__init__.py's MODEL_REGISTRY) is built with
transformers' own modeling code (AutoModelForCausalLM.from_config) and run as transformers runs it, except for
attention: the config's attention implementation is "kvgate_paged", registered in transformers' AttentionInterface,
so every attention module calls `paged_attention_forward` with its q/k/v. That writes the layer's K/V into the
engine's paged cache and attends through the step's metadata (attention.py's SDPA path or triton_attention.py's
kernels), exactly as the native models' Attention does. The engine packs a step's tokens flat; the HF model sees
them as one sequence of batch 1 ([1, T] ids and positions), and the attention metadata keeps the sequences apart.

What the paged attention cannot do is refused at load (ModelLoadError) rather than computed wrongly: attention
logit softcapping, attention sinks, multi-head latent attention, layers with different head
sizes, non-causal (encoder) attention, encoder-decoder and multimodal models. The weights keep the HF model's own
parameter names; load_weights has the native models' contract (an unknown tensor, a wrong shape or a missing weight
is a ModelLoadError). LoRA is not served on this path (lora/layers.py refuses it: the HF modules have no fused
projections to wrap).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kvgate.common.errors import ModelLoadError
from kvgate.engine.models.checkpoint_writes import write_checkpoint
from kvgate.engine.models.layer_windows import layer_windows

ATTN_IMPLEMENTATION = "kvgate_paged"


class StepContext:
    """The step's KV caches and attention metadata, set by the model's forward for its attention modules."""

    def __init__(self, config_windows: list[int | None], windows: list[int | None]) -> None:
        self.kv_caches: list | None = None
        self.meta = None
        self.config_windows = config_windows  # each layer's window as its config says (what its module asks for)
        self.windows = windows  # each layer's window as attended (None where a window spans every position)


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D],
    no weights). The layer's K/V go into its paged cache (kv_caches[module.layer_idx]) and the queries attend over
    their sequences' cached context through the step's metadata; attention_mask is None (the metadata masks)."""
    step: StepContext | None = getattr(module, "kvgate_step", None)
    if step is None or step.meta is None:
        raise RuntimeError(f"{type(module).__name__} ran outside a kvgate step (attention {ATTN_IMPLEMENTATION!r} "
                           "needs TransformersForCausalLM.forward's KV caches and metadata)")
    if kwargs.get("softcap") is not None:
        raise RuntimeError(f"{type(module).__name__} asks for attention logit softcapping, which kvgate's paged "
                           "attention does not compute")
    if kwargs.get("s_aux") is not None:
        raise RuntimeError(f"{type(module).__name__} has attention sinks, which kvgate's paged attention does not "
                           "compute")
    window, layer = kwargs.get("sliding_window"), module.layer_idx
    if window != step.config_windows[layer]:  # the config said one window for this layer; the module another
        raise RuntimeError(f"{type(module).__name__} (layer {layer}) asks for sliding window {window}, the model "
                           f"was loaded with {step.config_windows[layer]} for it from its config")
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()
    scale = module.scaling if scaling is None else scaling
    out = step.meta.attend(q, k, v, step.kv_caches[layer], scale, step.windows[layer])
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def check_supported(config) -> str:
    """The architecture name transformers builds for `config`, or a ModelLoadError saying why it cannot run here
    (from config.json alone: before anything is built)."""
    archs = list(getattr(config, "architectures", None) or [])
    name = f"{archs or '(none given in config.json)'}"
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"model architecture {name} is encoder-decoder; kvgate serves decoder-only models")
    if config.get_text_config() is not config:
        raise ModelLoadError(f"model architecture {name} is multimodal (a text model inside a composite config); "
                             "kvgate serves text-only decoder models")
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    if causal is None or not archs or causal not in archs:
        raise ModelLoadError(f"model architecture {name} (model_type {getattr(config, 'model_type', None)!r}) is "
                             "neither a native family nor a decoder-only causal LM that transformers builds")
    if getattr(config, "kv_lora_rank", None) is not None:
        raise ModelLoadError(f"{causal}: multi-head latent attention (kv_lora_rank) is not supported (kvgate's KV "
                             "cache holds one K and one V of one head size per KV head)")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ModelLoadError(f"{causal}: attn_logit_softcapping {config.attn_logit_softcapping} is not supported "
                             "(kvgate's paged attention has no logit softcapping)")
    layer_windows(config)
    return causal


class _DecoderOutput:
    """What _HiddenStates returns: the hidden states, and None for any other decoder output the head code reads
    (the cache, all layers' hidden states, an MoE's router logits)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:
        return None

    def __getitem__(self, index: int) -> torch.Tensor | None:
        return self.last_hidden_state if index == 0 else None


class _HiddenStates(nn.Module):
    """Stands in for the decoder inside the HF causal LM that compute_logits runs: returns the hidden states it is
    given, so the LM's own head code (its LM head and any scaling or softcapping of the logits) runs on them."""

    def forward(self, inputs_embeds=None, **kwargs) -> _DecoderOutput:
        return _DecoderOutput(inputs_embeds)


class TransformersForCausalLM(nn.Module):
    """A transformers causal LM on the engine's paged KV cache: the HF model's modules are this module's children
    under their HF names (e.g. `model` and `lm_head`), so named_parameters() are the checkpoint's names."""

    supports_lora = False  # lora/layers.py: the HF modules have no fused qkv/gate_up projections to wrap

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.architecture = check_supported(config)
        hf_config = copy.deepcopy(config)  # the engine's config keeps its own attention implementation
        hf_config._attn_implementation = ATTN_IMPLEMENTATION
        # Parameters on the meta device (build_model allocates them); buffers computed for real (RoPE frequencies,
        # embedding scales), on the CPU, kept in _computed_buffers: allocation replaces them, reset_buffers restores.
        with torch.device("cpu"), _parameters_on_meta():
            hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                  attn_implementation=ATTN_IMPLEMENTATION)
        if type(hf).__name__ != self.architecture:
            raise ModelLoadError(f"transformers built {type(hf).__name__} for {self.architecture}")
        self.config = hf_config
        # transformers' renamings and conversions of this model's checkpoint names (load_weights follows them)
        transforms = get_model_conversion_mapping(hf)
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._decoder_name = hf.base_model_prefix
        for name, child in hf.named_children():
            self.add_module(name, child)
        setattr(hf, self._decoder_name, _HiddenStates())
        self._head = [hf]  # a list: not a submodule (its modules other than the decoder are this module's children)
        self._computed_buffers = {name: b.clone() for name, b in self._non_persistent_buffers()}
        self._tied = dict(getattr(hf, "all_tied_weights_keys", None) or {})  # tied parameter -> its source
        self.tie_weights()
        self.num_heads, self.num_kv_heads, self.head_dim = self._attention_layout(hf_config)
        self.layer_windows = layer_windows(hf_config, max_positions)
        self._step = StepContext(layer_windows(hf_config), self.layer_windows)
        for module in self._attention_modules():
            module.kvgate_step = self._step

    @property
    def decoder(self) -> nn.Module:
        """The HF decoder (embeddings, layers, final norm): the child named by the model's base_model_prefix."""
        return getattr(self, self._decoder_name)

    def _attention_modules(self) -> list[nn.Module]:
        return [m for m in self.decoder.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]

    def _attention_layout(self, config) -> tuple[int, int, int]:
        """(query heads, KV heads, head size), the same for every layer, and one attention module per layer."""
        modules = self._attention_modules()
        arch = self.architecture
        if sorted(m.layer_idx for m in modules) != list(range(config.num_hidden_layers)):
            raise ModelLoadError(f"{arch}: its attention modules do not map one to one onto its "
                                 f"{config.num_hidden_layers} layers (a hybrid or non-standard decoder)")
        if any(not m.is_causal for m in modules):
            raise ModelLoadError(f"{arch} has non-causal (encoder) attention; kvgate serves decoder-only models")
        if any(getattr(m, "sinks", None) is not None for m in modules):
            raise ModelLoadError(f"{arch} has attention sinks, which kvgate's paged attention does not compute")
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dims = {getattr(m, "head_dim", None) for m in modules}
        head_dim = head_dims.pop() if len(head_dims) == 1 else None
        if head_dim is None:
            raise ModelLoadError(f"{arch}: its layers' head sizes ({sorted(head_dims, key=str)}) are not one size "
                                 "(kvgate's KV cache has one)")
        return num_heads, num_kv_heads, head_dim

    def _non_persistent_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for module_name, module in self.named_modules():
            for name in module._non_persistent_buffers_set:
                buffer = module._buffers.get(name)
                if buffer is not None:
                    yield (f"{module_name}.{name}" if module_name else name), buffer

    def reset_buffers(self, device: torch.device) -> None:
        """Put back the buffers computed at build time (loader.build_model, after allocating the module)."""
        for name, value in self._computed_buffers.items():
            module_name, _, buffer_name = name.rpartition(".")
            self.get_submodule(module_name).register_buffer(buffer_name, value.to(device), persistent=False)

    def tie_weights(self) -> None:
        """Share each tied parameter with its source (again after the module was moved off the meta device)."""
        for target, source in self._tied.items():
            module_name, _, param_name = target.rpartition(".")
            setattr(self.get_submodule(module_name), param_name, self.get_parameter(source))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        """input_ids, positions: [T] (the step's tokens, packed) -> hidden states [T, hidden]."""
        self._step.kv_caches, self._step.meta = kv_caches, meta
        try:
            out = self.decoder(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                               use_cache=False)
        finally:
            self._step.kv_caches = self._step.meta = None
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The HF causal LM's own head over hidden [N, hidden] -> logits [N, vocab]."""
        return self._head[0](inputs_embeds=hidden.unsqueeze(0), use_cache=False).logits[0]

    # -- weights ----------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     copy: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """Write checkpoint tensors (HF names, any dtype) into the parameters and persistent buffers, with
        LlamaForCausalLM.load_weights' contract: each lands in its tensor, or its slice of one, with one copy; an
        unknown tensor, a wrong shape, or a tensor (or one expert's slice) left unwritten is a ModelLoadError; a tied
        parameter's tensor is skipped (it is its source's). Names go through transformers' own renamings of the
        model's checkpoints; its converters that stack per-expert tensors (an MoE's experts.{i}.gate_proj/up_proj/
        down_proj into experts.gate_up_proj/down_proj) are followed by writing each tensor into its expert's slice."""
        targets = dict(self.named_parameters())
        targets |= {name: b for name, b in self.named_buffers() if name not in self._computed_buffers}
        ignored = list(getattr(self._head[0], "_keys_to_ignore_on_load_unexpected", None) or [])

        def place(name: str, tensor: torch.Tensor):
            if name in self._tied or "rotary_emb.inv_freq" in name:
                return None
            key, dest = self._destination(name, targets)
            if dest is None and any(_matches(pattern, name) for pattern in ignored):
                return None
            return key, dest, tensor

        write_checkpoint(weights, place, self._expected_coverage(targets), self.architecture, copy)

    def _expected_coverage(self, targets: dict[str, torch.Tensor]) -> dict[str, int]:
        """Coverage key -> elements the checkpoint must write: one key per tensor, one per expert of a tensor that
        per-expert checkpoint tensors are stacked into (so a missing expert is named)."""
        stacked = [t for converter in self._converters for t in converter.target_patterns]
        expected = {}
        for name, tensor in targets.items():
            if name in self._tied:
                continue
            if any(name == t or name.endswith("." + t) for t in stacked):
                expected |= {_expert_key(name, e): tensor[e].numel() for e in range(tensor.shape[0])}
            else:
                expected[name] = tensor.numel()
        return expected

    def _destination(self, name: str, targets: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor | None]:
        """(coverage key, the tensor or slice checkpoint tensor `name` fills; None when the model has none)."""
        renamed, pattern = rename_source_key(name, self._renamings, self._converters)
        if pattern is None:
            dest = targets.get(renamed)
            return renamed, None if dest is None else dest.data
        converter = next(c for c in self._converters if pattern in c.source_patterns)
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
        if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
            raise ModelLoadError(f"checkpoint tensor {name!r}: transformers converts it into {renamed!r} with "
                                 f"{ops}, which kvgate's loader does not")
        index = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), name)
        dest = targets.get(renamed)
        if index is None or dest is None or int(index[1]) >= dest.shape[0]:
            return renamed, None
        expert = int(index[1])
        dest = dest.data[expert]
        if len(ops) == 2:  # the sources' tensors are concatenated: this one's rows of the expert's slice
            size = dest.shape[0] // len(converter.source_patterns)
            part = converter.source_patterns.index(pattern)
            dest = dest[part * size:(part + 1) * size]
        return _expert_key(renamed, expert), dest


def _expert_key(name: str, expert: int) -> str:
    return f"{name}[expert {expert}]"


def _matches(pattern: str, name: str) -> bool:
    return re.search(pattern, name) is not None


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every nn.Parameter registered while active is moved to the meta device (never allocated for real:
    torch.empty's fresh pages are not touched), while buffers are computed on the current device. Patches
    nn.Module.register_parameter: not thread-safe (as loader._no_random_init)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
