"""The softmax model a linearisation starts from: a ``transformers`` checkpoint in
``MODEL_DIR``, checked (:func:`check_model_dir`) and loaded (:func:`load_softmax_model`).

``transformers`` and :mod:`flt.integrations.transformers` (which imports it) are the hf
extra: they are imported inside the functions that read a checkpoint, so that importing
:mod:`flt.train.linearize` needs neither."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flt._io import read_json_file

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: Config attributes of attention dropout in ``transformers`` configs (Llama family, GPT-2).
ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop")


def check_model_dir(model_dir: str | os.PathLike) -> Path:
    """``model_dir`` as a path, after checking that it looks like a ``transformers`` checkpoint
    of a softmax model: a directory with a ``config.json`` and no flt settings in it."""
    from flt.integrations.transformers import CONFIG_KEY

    directory = Path(model_dir)
    if not directory.exists():
        raise FileNotFoundError(f"MODEL_DIR {model_dir}: no such directory (expected a transformers checkpoint "
                                "written by save_pretrained)")
    if not directory.is_dir():
        raise ValueError(f"MODEL_DIR {model_dir} is a file, not a directory (expected a transformers checkpoint)")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"MODEL_DIR {model_dir} is not a transformers checkpoint: it has no config.json "
                         "(write one with model.save_pretrained)")
    config = read_json_file(str(config_file), f"MODEL_DIR {model_dir}: config.json")
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"MODEL_DIR {model_dir} is not a transformers checkpoint: its config.json has no model_type")
    if config.get(CONFIG_KEY):
        raise ValueError(f"MODEL_DIR {model_dir} holds a model converted by flt already ({CONFIG_KEY} in its config.json); "
                         "linearize starts from a softmax model")
    return directory


def load_softmax_model(model_dir: str | os.PathLike, device: torch.device | str | None = None) -> PreTrainedModel:
    """The checkpoint's causal LM in float32, eval mode, attention dropout set to 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = check_model_dir(model_dir)
    try:
        config = AutoConfig.from_pretrained(directory)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"MODEL_DIR {model_dir}: transformers cannot read its config.json ({err})") from None
    for name in ATTENTION_DROPOUT:
        if hasattr(config, name):
            setattr(config, name, 0.0)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=torch.float32)
    except OSError as err:
        raise ValueError(f"MODEL_DIR {model_dir}: no loadable weights ({err})") from None
    except ValueError as err:
        raise ValueError(f"MODEL_DIR {model_dir}: not a causal language model transformers can load ({err})") from None
    # transformers' annotations of its wrapped .to() read as an unbound method's.
    return model.to(device).eval()  # type: ignore[arg-type]
