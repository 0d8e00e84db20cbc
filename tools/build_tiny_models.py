"""Build the two tiny random GPT-2 models that experiments/model.toml and the tests use (no download):

    python tools/build_tiny_models.py [OUT]        # default: experiments/tiny-models

OUT/policy and OUT/reference (the policy with perturbed weights), each with a trained BPE tokenizer
(vocabulary 1000), OUT/prompts.txt and OUT/prompts.jsonl. Needs the hf extra: pip install -e '.[hf]'.
"""
from __future__ import annotations

import sys
from pathlib import Path

from kl_bench.kinds.model.tiny import build_tiny_models

if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "experiments" / "tiny-models"
    print(build_tiny_models(out))
