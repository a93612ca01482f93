"""flt: FourierLearner-Transformers, relative positional encodings in linear-time attention."""

__version__ = "0.1.0"
