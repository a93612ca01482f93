"""Bridges from flt to other libraries' models; each module needs its library's extra
(:mod:`flt.integrations.transformers`: ``pip install flt[hf]``)."""
