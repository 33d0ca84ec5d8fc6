"""Tandem: disaggregated prefill/decode serving for Llama-family language models."""

__version__ = "0.1.0"
