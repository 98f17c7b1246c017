"""Integrations with the libraries users already run: ``transformers`` (an attention implementation
named "flexattn"). Each is imported on its own and needs its library (an optional extra)."""
