"""Adapters that serve a model framework's attention through attnd (see transformers.py)."""
