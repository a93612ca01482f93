"""FLT inside Hugging Face ``transformers`` decoders: :func:`convert` and :func:`from_pretrained`.

:func:`convert` gives every self-attention module of a decoder of the Llama family (Llama,
Qwen2, Mistral: any model whose attention goes through ``transformers``'
``AttentionInterface``) or of GPT-2 an :class:`flt.functional.AttentionCore`
(``module.flt_core``) and switches the model's attention implementation to ``"flt"``. The
model keeps everything else: the query, key, value and output projections with their
weights, its rotary embedding (applied by the model before the core sees the queries and
keys), its KV cache. The core reads the model's ``position_ids`` as 1-D positions, so
FLT's relative term sees the same positions as the rotary embedding.

The settings are stored in ``model.config.flt_attention``, and the converted model becomes
an instance of its family's converted class (:func:`converted_class`: ``FLTLlamaForCausalLM``,
``model_type`` ``flt_llama``). ``save_pretrained`` writes that ``model_type`` with the
settings and the cores' parameters; importing this module registers the converted classes
with ``AutoConfig`` and ``AutoModelForCausalLM``, so the standard loader returns the
converted model. :func:`from_pretrained` also loads folders saved by earlier versions.

Decoding: ``model.generate()`` works through the model's own KV cache, each new token the
last row of the causal core over all cached keys (``O(t)`` per token, as softmax), or, with
``past_key_values=FLTCache()``, from flt's constant-size decoding state
(:meth:`flt.functional.AttentionCore.prefill` / ``step``): no key or value is kept beyond
FLT's band, so memory does not grow with the prompt or the generated text. Either way a
batch of prompts padded on the left generates each row as its prompt alone (padded keys
are masked out of the core and of the state; the positions are the ``position_ids`` that
``generate`` derives from the attention mask), and beam search reorders the states with
the beams. Generating from a right-padded batch raises (:func:`check_left_padding`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch import nn
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface
from transformers.utils import logging

from flt._checks import check_choice
from flt._io import read_json_file, regular_files
from flt.functional import AttentionCore
from flt.layers.registry import ATTENTION

#: The name of flt's attention implementation in ``transformers``' registries.
IMPLEMENTATION = "flt"
#: The config attribute holding the conversion's settings.
CONFIG_KEY = "flt_attention"
#: The start of a converted model's ``model_type``: a converted Llama saves as ``flt_llama``
#: and loads back through ``AutoModelForCausalLM`` as one (:func:`converted_class`).
MODEL_TYPE_PREFIX = "flt_"
#: The families whose converted classes are registered with ``transformers``' Auto classes
#: when this module is imported: ``{model_type: (config class, causal-LM class)}``, names
#: in ``transformers``. Another family's classes are made and registered when
#: :func:`convert` or :func:`from_pretrained` first meets one.
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel")}
#: Original causal-LM class -> the class of its converted models.
_CONVERTED: dict[type[PreTrainedModel], type[PreTrainedModel]] = {}
#: How a converted core computes: its estimator, its O(N^2) reference of the same
#: features, or the exact attention it estimates (for FLT's logit coupling with ``f = 0``
#: and ``qk_norm=False``, softmax itself).
PATHS = ("forward", "reference", "exact")


class _ConvertedAttention(Protocol):
    """What the attention function reads of a self-attention module that :func:`convert`
    equipped (any model family's class: ``transformers`` calls the function with it)."""

    flt_core: AttentionCore
    _flt_cache: FLTCache | None
    training: bool
    layer_idx: int


def convert(model: PreTrainedModel, attention: str = "flt", *, path: str = "forward", attention_options: dict[str, Any] | None = None,
            **options: Any) -> PreTrainedModel:
    """Replace the attention core of a ``transformers`` decoder by flt's, in place.

    Args:
        model: a ``PreTrainedModel`` whose self-attention modules have ``q_proj`` /
            ``k_proj`` (the Llama family) or ``c_attn`` (GPT-2) and go through the
            ``AttentionInterface``.
        attention: a mechanism of :data:`flt.layers.ATTENTION` (``"flt"``,
            ``"performer"``, ``"softmax"``, ``"toeplitz"``).
        path: ``"forward"`` (default, the estimator), ``"reference"`` or ``"exact"``
            (:data:`PATHS`).
        **options: the core's options (``coupling``, ``near_field``, ``num_features``,
            ``qk_norm``, ``seed``, spectrum options, ...); ``causal`` is always True.
            Checked once for all layers.
        attention_options: the same options as one dict, instead of ``**options``; those
            that :func:`flt.options.check_attention_options` returned with
            :data:`flt.options.ATTENTION_ARGUMENTS` reserved are not checked again.

    Returns:
        ``model``, converted: every projection weight kept, one core per layer (its
        parameters in float32 or the model's dtype), ``model.config.flt_attention`` set,
        the model an instance of :func:`converted_class` (a subclass of its class) and its
        config of that class's config class, whose ``model_type`` is ``flt_`` and the original's.
    """
    check_choice("path", path, PATHS)
    if attention_options is not None:
        if options:
            raise TypeError(f"convert: give the options as attention_options or as keywords, not both ({sorted(options)})")
        options = attention_options
    if "causal" in options:
        raise ValueError("causal is not an option of convert: a decoder's attention is causal")
    _equip(model, attention, path, options)
    model.config.flt_attention = {"attention": attention, "path": path, **options}
    adopt(model)
    return model


def _equip(model: PreTrainedModel, attention: str, path: str, options: dict[str, Any]) -> None:
    """Give every self-attention module of ``model`` a core and switch its attention to flt's;
    ``options`` are checked once for all (:func:`flt.options.checked_once`)."""
    from flt.options import checked_once

    check_choice("mechanism", attention, sorted(ATTENTION))
    options = checked_once(attention, options)
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no self-attention module convert() knows (q_proj/k_proj of the Llama family, c_attn of GPT-2)")
    param = next(model.parameters())
    # `from_pretrained` builds a model under the meta device, where the cores cannot draw
    # their initial values; they are built on the CPU and replaced by the saved tensors.
    meta = param.device.type == "meta"
    device = torch.device("cpu") if meta else param.device
    for module in modules:
        heads, head_dim = _heads(model.config, module)
        converted = cast(_ConvertedAttention, module)  # gains the attributes the attention function reads
        with torch.device("cpu") if meta else contextlib.nullcontext():
            converted.flt_core = AttentionCore.from_checked_options(attention, options, heads=heads, head_dim=head_dim, causal=True,
                                                                    device=device, dtype=param.dtype)
        converted.flt_core.path = path
        if not hasattr(module, "_flt_cache"):
            converted._flt_cache = None
            module.register_forward_pre_hook(_remember_cache, with_kwargs=True)
    register()
    model.set_attn_implementation(IMPLEMENTATION)


def converted_class(model_class: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """The class of converted ``model_class`` models: a subclass whose config class (a
    subclass of ``model_class``'s) has its own ``model_type``, ``flt_`` and the original's
    (:data:`MODEL_TYPE_PREFIX`), and whose constructor converts the model its parent builds
    with the config's ``flt_attention`` settings. Made once per class and registered with
    ``AutoConfig`` and ``AutoModelForCausalLM``, so that a folder written by ``save_pretrained``
    loads back through ``AutoModelForCausalLM.from_pretrained`` as the converted model."""
    if model_class in _CONVERTED.values():
        return model_class
    if model_class in _CONVERTED:
        return _CONVERTED[model_class]
    base_config = model_class.config_class
    if not isinstance(base_config, type) or not getattr(base_config, "model_type", ""):
        raise ValueError(f"{model_class.__name__} has no config class with a model_type; convert() cannot name its converted models")
    model_type = MODEL_TYPE_PREFIX + base_config.model_type
    config_class = type(f"FLT{base_config.__name__}", (base_config,), {
        "model_type": model_type, "__module__": __name__,
        "__doc__": f"The config of a {base_config.__name__} model converted by flt: its settings plus ``{CONFIG_KEY}``."})

    def __init__(self: PreTrainedModel, config: PretrainedConfig, *args: Any, **kwargs: Any) -> None:
        settings = getattr(config, CONFIG_KEY, None)
        if not isinstance(settings, dict) or "attention" not in settings:
            raise ValueError(f"{type(self).__name__} needs config.{CONFIG_KEY}, the settings that "
                             "flt.integrations.transformers.convert stores")
        model_class.__init__(self, config, *args, **kwargs)
        options = dict(settings)
        _equip(self, options.pop("attention"), options.pop("path", "forward"), options)

    flt_class = type(f"FLT{model_class.__name__}", (model_class,), {
        "config_class": config_class, "__init__": __init__, "__module__": __name__,
        "__doc__": f"A {model_class.__name__} whose attention is flt's (:func:`convert`)."})
    AutoConfig.register(model_type, config_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, flt_class, exist_ok=True)
    _CONVERTED[model_class] = flt_class
    return flt_class


def adopt(model: PreTrainedModel) -> None:
    """Make a model that :func:`_equip` converted an instance of its :func:`converted_class`,
    and its config of that class's config class, in place (neither adds any state): its
    ``save_pretrained`` then writes the converted ``model_type``."""
    flt_class = converted_class(type(model))
    model.__class__ = flt_class
    model.config.__class__ = cast(type[PretrainedConfig], flt_class.config_class)


def register_families() -> None:
    """Register the converted classes of :data:`FAMILIES` with the Auto classes (idempotent)."""
    import transformers

    for config_name, model_name in FAMILIES.values():
        model_class = getattr(transformers, model_name)
        if model_class.config_class is not getattr(transformers, config_name):
            raise TypeError(f"transformers.{model_name} is not configured by transformers.{config_name}")
        converted_class(model_class)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of ``model`` that :func:`convert` equips with a core."""
    found = []
    for module in model.modules():
        llama = hasattr(module, "q_proj") and hasattr(module, "k_proj") and hasattr(module, "o_proj")
        gpt2 = hasattr(module, "c_attn") and not getattr(module, "is_cross_attention", False)
        if llama or gpt2:
            found.append(module)
    return found


def _heads(config: PretrainedConfig, module: nn.Module) -> tuple[int, int]:
    heads = config.num_attention_heads
    head_dim = getattr(module, "head_dim", None) or config.hidden_size // heads
    return heads, head_dim


def register() -> None:
    """Register ``"flt"`` in ``transformers``' attention and mask registries (idempotent)."""
    AttentionInterface.register(IMPLEMENTATION, flt_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, key_padding)


def key_padding(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """The mask function of ``"flt"``: the 2-D padding mask of the keys ``[B, kv_length]``
    (True: a real token), or None without padding. The core applies causality itself."""
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise ValueError(f"flt attention takes a 2-D padding mask [B, N]; got shape {tuple(attention_mask.shape)}")
    valid = attention_mask[:, kv_offset: kv_offset + kv_length].to(torch.bool)
    return None if bool(valid.all()) else valid


def flt_attention_forward(module: _ConvertedAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``transformers``' attention function for ``"flt"``: ``query [B, H, Nq, D]``, ``key``
    and ``value [B, Hkv, N, D]`` (after the model's rotary embedding and cache) through
    ``module.flt_core``; returns ``(out [B, Nq, H, D], None)``."""
    core = module.flt_core
    if dropout and module.training:
        raise ValueError(f"attention dropout ({dropout}) has no weights to drop in flt's cores: set the config's attention "
                         "dropout (attention_dropout, attn_pdrop) to 0 before training a converted model")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    head_dim = query.shape[-1]
    if scaling is not None and scaling != head_dim**-0.5:
        # The cores compute exp(q.k / sqrt(D)); the model's logits are scaling * q.k.
        query = query * (scaling * math.sqrt(head_dim))
    pad = None if attention_mask is None else ~attention_mask
    if module._flt_cache is not None:
        layer = module._flt_cache.layers[module.layer_idx]
        return _decode(layer, core, query, key, value, pad, kwargs.get("position_ids")), None
    if query.shape[2] < key.shape[2]:  # decoding: the cached keys' positions are taken to be consecutive
        check_left_padding(pad)
    pos = key_positions(kwargs.get("position_ids"), key.shape[0], key.shape[2], query.device)
    # The estimator through the module call, so that hooks on the core see its inputs
    # (flt.train.linearize records them to compute the core's attention weights).
    run = core if core.path == "forward" else getattr(core, core.path)
    out = run(query, key, value, pos, pad)
    return out.transpose(1, 2).contiguous(), None


def check_left_padding(pad: torch.Tensor | None) -> None:
    """Decoding a padded batch needs the padding on the left (``padding_side="left"``, as
    ``generate`` expects of a decoder): flt counts the cached keys' positions, and FLT's
    band its token slots, back from the newest token, which padding after a row's first
    real token would shift. ``pad [B, N]``: True marks padding."""
    if pad is not None and bool((~pad[:, :-1] & pad[:, 1:]).any()):
        raise ValueError("a padded batch decodes with left padding only (tokenizer padding_side='left': every row's "
                         "padding before its first real token); this attention_mask has padding after a real token")


def _remember_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a converted attention module: the attention function reaches an
    :class:`FLTCache` through the module (``transformers`` passes the cache to the module,
    not to the attention function)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    cast(_ConvertedAttention, module)._flt_cache = cache if isinstance(cache, FLTCache) else None


def _decode(layer: object, core: AttentionCore, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            pad: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor:
    """The new tokens' attention from the layer's state in the :class:`FLTCache` (``layer``,
    of the attention module's layer; a prompt by ``core.prefill``, then ``core.step`` per
    token): ``[B, Nq, H, Dv]``."""
    if core.path != "forward":
        raise ValueError(f"FLTCache decodes the estimator (path='forward'); this model was converted with path={core.path!r}: "
                         "generate with the default cache instead")
    if not isinstance(layer, FLTStateLayer):
        raise TypeError(f"an FLTCache holds FLTStateLayer layers, got {type(layer).__name__}")
    n = query.shape[2]
    if position_ids is None:
        position_ids = torch.arange(layer.length - n, layer.length, device=query.device).view(1, n)
    pos = position_ids.reshape(-1, n)
    if layer.state is None:
        check_left_padding(pad)
        out, layer.state = core.prefill(query, key, value, pos, pad)
    else:
        if pad is not None:
            raise ValueError("FLTCache takes padding in the prompt only (left padding, before each row's first token); "
                             "the tokens after the prompt must all be real (attention_mask 1)")
        rows = []
        for t in range(n):
            row, layer.state = core.step(query[:, :, t:t + 1], key[:, :, t:t + 1], value[:, :, t:t + 1], layer.state, pos[:, t:t + 1])
            rows.append(row)
        out = torch.cat(rows, dim=2)
    return out.transpose(1, 2).contiguous()


class FLTStateLayer(CacheLayerMixin):
    """One layer of an :class:`FLTCache`: flt's decoding state (``state``) and the number
    of tokens it has seen, instead of keys and values. ``update`` hands the new keys and
    values through to the attention function, which folds them into the state."""

    is_sliding = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.state = None
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.length += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.length  # only the new tokens reach the attention function

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self.state, self.length = None, 0

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``i`` of the state becomes row ``beam_idx[i]``."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` of the state (in that order)."""
        self.state = map_state(self.state, lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row of the state ``repeats`` times, next to each other."""
        self.state = map_state(self.state, lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("FLTCache cannot crop: its state has folded the past tokens into sums (assisted and "
                         "speculative decoding need a cache that keeps every key, the default cache)")


class FLTCache(Cache):
    """A ``transformers`` cache holding flt's constant-size decoding state per layer, for
    ``model.generate(..., past_key_values=FLTCache())`` on a model converted with
    ``path="forward"``: the kernel mechanisms keep their linear state (``[B, H, 2R, m,
    Dv]`` for FLT, ``[B, H, m, Dv]`` for a Performer) and, with FLT's band, the last
    ``w + 1`` keys and values; its size does not depend on the number of tokens seen
    (:meth:`state_bytes`). Left-padded batches (padded keys stay out of the state), greedy,
    sampled and beam-search decoding (the states are reordered with the beams); not
    assisted decoding, which crops the cache."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(layer_class_to_replicate=FLTStateLayer, **kwargs)

    def state_bytes(self) -> int:
        """Bytes held by the decoding states of every layer."""
        total = 0
        for layer in self.layers:
            if not isinstance(layer, FLTStateLayer):
                raise TypeError(f"an FLTCache holds FLTStateLayer layers, got {type(layer).__name__}")
            total += _tensor_bytes(layer.state)
        return total


def map_state(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A decoding state (a tensor, or a dataclass, list or tuple of them, as
    :meth:`flt.functional.AttentionCore.prefill` returns) with ``fn`` applied to each of
    its tensors, all of which have the batch first (the layers expand shared positions)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_state(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_state(o, fn) for o in obj)
    return obj


def _tensor_bytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj):
        return sum(_tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def key_positions(position_ids: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Positions ``[B|1, N, 1]`` of the ``N`` keys: the model's ``position_ids`` when they
    cover every key; when they cover only the newest tokens (decoding from a cache), the
    cached keys are taken to be the consecutive positions before them."""
    if position_ids is None:
        return torch.arange(length, device=device).view(1, length, 1)
    ids = position_ids.reshape(-1, position_ids.shape[-1])
    if ids.shape[-1] < length:
        last = ids[:, -1:]
        ids = last - (length - 1) + torch.arange(length, device=ids.device)
    return ids[:, -length:].unsqueeze(-1)


def from_pretrained(directory: str | Path, **kwargs: Any) -> PreTrainedModel:
    """Load a model saved by ``save_pretrained`` after :func:`convert`.

    A folder with a converted ``model_type`` (``flt_llama``, ...) loads by
    ``AutoModelForCausalLM.from_pretrained(directory, **kwargs)`` itself, its family's
    classes registered first if this process has not met it yet. A folder saved by an
    earlier flt (the original ``model_type`` with ``flt_attention`` settings, which the
    Auto classes load as the softmax model) loads as that model, converted again with the
    stored settings, then the cores' parameters from the checkpoint's safetensors files."""
    from safetensors.torch import load_file

    directory = Path(directory)
    _register_saved_family(directory)
    config = AutoConfig.from_pretrained(directory)
    # Before anything opens them: a FIFO named *.safetensors would block the load forever.
    # Links to regular files are read (a Hugging Face cache folder is made of them).
    weight_files = regular_files(str(directory), (".safetensors",), "model file")
    settings = getattr(config, CONFIG_KEY, None)
    if not settings:
        raise ValueError(f"{directory} holds no flt settings (config.{CONFIG_KEY}); it was not saved after flt.integrations.transformers.convert")
    if config.model_type.startswith(MODEL_TYPE_PREFIX):
        return AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its load report would list the cores' parameters as unexpected
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    finally:
        logging.set_verbosity(verbosity)
    settings = dict(settings)
    convert(model, settings.pop("attention"), **settings)
    cores = {}
    for file in weight_files:
        cores.update({k: t for k, t in load_file(file).items() if ".flt_core." in k})
    expected = {k for k in model.state_dict() if ".flt_core." in k}
    missing = expected - set(cores)
    if missing:
        raise ValueError(f"{directory} lacks {len(missing)} parameters of the flt cores, e.g. {sorted(missing)[:3]}")
    model.load_state_dict(cores, strict=False)
    return model



def _register_saved_family(directory: Path) -> None:
    """Register the converted classes of the family a folder's ``config.json`` names
    (``flt_<model_type>``), when it is one this process has not registered."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        # Bounded depth, and a FIFO refused unopened: AutoConfig, which reads it next,
        # would hang on a FIFO or end in a RecursionError on deep nesting.
        config = read_json_file(str(directory / "config.json"))
    except OSError:
        return  # AutoConfig names what is missing from the folder
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type.startswith(MODEL_TYPE_PREFIX) or model_type in CONFIG_MAPPING:
        return
    base = model_type[len(MODEL_TYPE_PREFIX):]
    if base not in CONFIG_MAPPING or CONFIG_MAPPING[base] not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{directory / 'config.json'}: model_type {model_type!r} is a converted {base!r}, which this "
                         "transformers has no causal language model for")
    found = MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[base]]
    # A few types map to several classes, the first the default.
    converted_class(cast(type[PreTrainedModel], found[0] if isinstance(found, tuple) else found))


# What importing this module is for: converted models load through the Auto classes.
register_families()
