"""Llama-family model runtime: config, module, checkpoint loader."""

from nebula_flow.models.config import ModelConfig, ModelConfigError
from nebula_flow.models.llama import CausalLM
from nebula_flow.models.loader import load_model

__all__ = ["CausalLM", "ModelConfig", "ModelConfigError", "load_model"]
