"""Case kind ``model``: a policy and a reference causal LM from local folders (see :mod:`.pair`)."""
from .pair import ModelCase, ModelPair, NextTokenPair

__all__ = ["ModelCase", "ModelPair", "NextTokenPair"]
