"""Configuration: schema dataclasses and the YAML/override loader."""
from megarl.config.loader import load_config, save_config
from megarl.config.schema import MegaRLConfig

__all__ = ["MegaRLConfig", "load_config", "save_config"]
