"""Bridges from flt to other libraries' models; each module needs its library's extra
(:mod:`flt.integrations.transformers` and :mod:`flt.train.linearize`, which trains a
converted model to replace its softmax original: ``pip install "flt-attention[hf]"``)."""
