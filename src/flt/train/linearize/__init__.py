"""Linearising a trained ``transformers`` decoder: attention transfer, then fine-tuning.

:func:`linearize` loads a local checkpoint (``AutoModelForCausalLM.from_pretrained``, no
download), converts a copy with :func:`flt.integrations.transformers.convert` and trains it
in two stages, as Hedgehog and LoLCATs linearise pretrained models:

1. **attention transfer** (``transfer_steps``): every converted attention module sees the
   *teacher's* input to that layer (the original softmax model's hidden states, captured by
   forward hooks) and is trained (``transfer``) to reproduce the teacher layer's output
   (``"outputs"``, the default: after its output projection, by the relative squared error
   :func:`relative_error` summed over layers), its attention weights (``"weights"``, as
   Hedgehog and LoLCATs do: the KL divergence of each row of the core's weights from the
   softmax's, :func:`attention_kl`, averaged over layers) or both (their sum). Only the flt
   cores' parameters train (spectrum, feature maps, near-field terms, temperatures); every
   weight of the original model is frozen. Each layer learns from the teacher's inputs, not
   from the student's own earlier layers, so the layers train independently in one pass.
2. **fine-tuning** (``finetune_steps``): the whole converted model (``finetune="all"``,
   default), its attention modules (``"attention"``: cores and q/k/v/o projections) or the
   cores only (``"cores"``), by next-token cross-entropy on the same text.

Both stages run on the training loop of ``flt train`` (:func:`flt.train.loop.run_steps`,
one :class:`flt.train.loop.Run` per stage; :mod:`flt.train.linearize.run` says how), and
the run directory is the one ``flt train`` writes (the same checkpoint, lock, metrics and
plot code of :mod:`flt.train`): ``run.json``, ``metrics.jsonl`` (``transfer`` records: the
loss, each layer's output error ``layers`` and, when weights are matched, its weights' KL
``kl``; ``train``; ``valid``; ``matching`` before and after transfer), ``checkpoints/``
(atomic, hashed; ``resume=True`` continues bit for bit), ``summary.json`` (validation
perplexity of the softmax model, of the converted model before transfer, after transfer
and after fine-tuning), ``learning_curves.png`` and ``model/``, the linearised model saved
with ``save_pretrained`` (load it with :func:`flt.integrations.transformers.from_pretrained`).

Text: a UTF-8 file (its last ``valid_fraction`` is validation) or, by default, the
embedded Python-documentation corpus (:func:`flt.data.text.load_python_docs`). Tokens: the
checkpoint's tokenizer when ``MODEL_DIR`` has one (``AutoTokenizer``), else, when asked
for (``byte_tokens=True``, ``--bytes``), bytes (ids 0..255, for models with ``vocab_size >=
256`` trained on bytes, such as ``examples/train_tiny_llama.py``'s). A folder without a
tokenizer is refused unless bytes are asked for: a model trained on another tokenizer
would otherwise train, silently, on ids that mean nothing to it.

Attention dropout is set to 0 on load (a linear core has no attention matrix to drop);
the random features are drawn once (``seed``) and not redrawn. Matching weights runs the
teacher with ``transformers``' eager attention, which returns them (its perplexity then
differs from the default implementation's by float32 rounding only).

The modules: :mod:`~flt.train.linearize.config` (:class:`LinearizeConfig` and its checks),
:mod:`~flt.train.linearize.data` (text, tokens, windows, perplexity),
:mod:`~flt.train.linearize.model` (the softmax checkpoint), :mod:`~flt.train.linearize.matching`
(attention transfer), :mod:`~flt.train.linearize.plots` and :mod:`~flt.train.linearize.run`
(:func:`linearize`); their public names are all importable from here.
"""

from flt.train.linearize.config import FINETUNE, TRANSFER, LinearizeConfig, check_attention
from flt.train.linearize.data import (
    METRIC,
    TOKENIZER_FILES,
    Tokens,
    byte_ids,
    check_tokens,
    eval_windows,
    load_text,
    next_token_loss,
    perplexity,
    window_batch,
)
from flt.train.linearize.matching import (
    LayerMatching,
    attention_kl,
    relative_error,
    trainable_parameters,
    transfer_loss,
)
from flt.train.linearize.model import ATTENTION_DROPOUT, check_model_dir, load_softmax_model
from flt.train.linearize.plots import plot_linearization
from flt.train.linearize.run import LinearizeInterrupted, linearize

__all__ = [
    "ATTENTION_DROPOUT",
    "FINETUNE",
    "METRIC",
    "TOKENIZER_FILES",
    "TRANSFER",
    "LayerMatching",
    "LinearizeConfig",
    "LinearizeInterrupted",
    "Tokens",
    "attention_kl",
    "byte_ids",
    "check_attention",
    "check_model_dir",
    "check_tokens",
    "eval_windows",
    "linearize",
    "load_softmax_model",
    "load_text",
    "next_token_loss",
    "perplexity",
    "plot_linearization",
    "relative_error",
    "trainable_parameters",
    "transfer_loss",
    "window_batch",
]
