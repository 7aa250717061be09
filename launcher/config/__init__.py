"""Layered env-file configuration with provenance (see DESIGN.md, "Configuration")."""
from launcher.config.resolve import Config, Selection, available, load, resolve
from launcher.config.schema import KEYS, SCHEMA

__all__ = ["Config", "Selection", "available", "load", "resolve", "KEYS", "SCHEMA"]
