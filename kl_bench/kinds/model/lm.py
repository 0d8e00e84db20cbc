"""The one place that talks to Hugging Face ``transformers`` (imported lazily: ``import kl_bench`` never
loads it). Loading two causal LMs from local folders, reading prompts, next-token log-probabilities and
KV-cached continuations.

Numerics: the models run in their ``dtype`` (float32 by default); each step's log-softmax is taken in
float32 (at least) and then cast to float64, so that every statistic (log r = log p − log q, the
per-step analytic KL, sums over tokens and draws) accumulates in float64. The float64 values are exact
functions of the float32 log-probs. The pairs renormalise them once more in float64 (they sum to 1 only
to float32 rounding), so a next-token case's truth and its exact means are float64 sums over the
vocabulary of the same normalised tables, the ones a categorical case builds from dump-logits' float32
file, and a continuation's per-step KL is that of normalised distributions.
"""
from __future__ import annotations

import inspect

import json
import warnings
from pathlib import Path

import torch

from ...foundation.errors import SpecError
from ...foundation.safe_io import decode_text, parse_json, read_regular

# Prompts per forward pass: beyond it a batch's activations exceed any machine's memory.
MAX_BATCH_SIZE = 1 << 20

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise SpecError("model cases need Hugging Face transformers: pip install 'kl-bench[hf]'") from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def check_model_dir(path: Path, key: str) -> None:
    """A one-line error for a path that is not a saved model folder (never a hub download)."""
    if not path.exists():
        raise SpecError(f"model folder not found: {path} (a local folder saved with save_pretrained; "
                        "nothing is downloaded)", key=key)
    if not path.is_dir():
        raise SpecError(f"{path} is not a folder (a model folder saved with save_pretrained)", key=key)
    config = path / "config.json"
    if not config.exists() and not config.is_symlink():
        raise SpecError(f"{path} is not a saved model folder (no config.json)", key=key)
    refuse_remote_code(path, key)


def refuse_remote_code(path: Path, key: str) -> None:
    """A model or tokenizer folder whose config names its own Python code (``auto_map``) is refused:
    kl-bench never runs code from a model folder (transformers' trust_remote_code stays False)."""
    for name in ("config.json", "tokenizer_config.json"):
        f = path / name
        if f.exists() or f.is_symlink():
            try:
                data = parse_json(read_regular(f, "model config", name), f, name)
            except SpecError as e:      # the spec is named by the caller, the model's file here
                raise SpecError(f"{e.file}: {e.message}", key=key) from None
            if isinstance(data, dict) and (data.get("auto_map") or data.get("trust_remote_code")):
                raise SpecError(f"{f} asks for code from the model folder (auto_map); kl-bench never runs such "
                                "code: use a model that transformers supports natively", key=key)


def check_prompts(prompts: list[list[int]], path: Path, models: list, length: int, eos: int | None,
                  key: str = "prompts") -> None:
    """Token ids inside every model's vocabulary, and the longest prompt plus ``length`` generated tokens
    within every model's positions (beyond them a model indexes past its position table)."""
    vocab = min(vocab_size(m) for m in models)
    top = max(max(p) for p in prompts)
    if top >= vocab:
        raise SpecError(f"{path}: token id {top} is outside the models' vocabulary [0, {vocab})", key=key)
    if eos is not None and not 0 <= eos < vocab:
        raise SpecError(f"must be a token id in [0, {vocab}), got {eos}", key="eos" if key == "prompts" else "--eos")
    limit = position_limit(models)
    longest = max(len(p) for p in prompts)
    if limit is not None and longest + length > limit:
        i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
        raise SpecError(f"{path}: prompt {i + 1} has {longest} tokens; with {length} generated that is more than "
                        f"the model's {limit} positions", key=key)


def position_limit(models: list) -> int | None:
    """The fewest positions any of the models has (its config's ``max_position_embeddings`` or ``n_positions``);
    None where none says."""
    limits = [getattr(m.config, "max_position_embeddings", None) or getattr(m.config, "n_positions", None)
              for m in models]
    return min((int(x) for x in limits if isinstance(x, int) and x > 0), default=None)


def load_model(path: Path, dtype: str, key: str):
    """A causal LM from a local folder, in eval mode, on the CPU."""
    check_model_dir(path, key)
    tf = transformers_module()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tf.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=DTYPES[dtype],
                                                            trust_remote_code=False)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else "unreadable"
        raise SpecError(f"cannot load the model in {path}: {e.__class__.__name__}: {first}", key=key) from None
    # Older transformers take torch_dtype, not dtype: cast explicitly so that `dtype` holds on every version.
    return model.to(DTYPES[dtype]).eval()


def vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def read_prompts(path: Path, tokenizer_dir: Path) -> list[list[int]]:
    """Token ids of every prompt: a text file (one prompt a line, tokenised with the tokenizer saved in
    ``tokenizer_dir``, the policy's folder) or ``.jsonl`` with ``input_ids`` on every line."""
    if not path.exists() and not path.is_symlink():
        raise SpecError(f"prompts file not found: {path}", key="prompts")
    try:                      # a regular file of at most 256 MiB of UTF-8 text: never a FIFO or a binary
        text = decode_text(read_regular(path, "prompts"), path, "prompts")
    except SpecError as e:
        raise SpecError(f"{e.file}: {e.message}", key="prompts") from None
    if path.suffix.lower() == ".jsonl":
        out = [_jsonl_ids(line, i, path) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    else:
        tok = _tokenizer(tokenizer_dir)
        out = [tok(s)["input_ids"] for s in text.splitlines() if s.strip()]
        if any(not ids for ids in out):
            raise SpecError(f"{path}: a prompt tokenises to no tokens", key="prompts")
    if not out:
        raise SpecError(f"{path}: no prompts", key="prompts")
    return out


def _tokenizer(tokenizer_dir: Path):
    """The tokenizer saved in the policy's folder, for a text prompts file (never code from the folder)."""
    tf = transformers_module()
    refuse_remote_code(tokenizer_dir, "prompts")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tf.AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True, trust_remote_code=False)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else "unreadable"
        raise SpecError(f"a text prompts file needs the tokenizer saved in the policy's folder {tokenizer_dir} "
                        f"({e.__class__.__name__}: {first}); or give .jsonl with input_ids", key="prompts") from None


def _jsonl_ids(line: str, i: int, path: Path) -> list[int]:
    try:
        ids = json.loads(line)["input_ids"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise SpecError(f"{path}: line {i} is not a JSON object with 'input_ids'", key="prompts") from None
    if not (isinstance(ids, list) and ids and all(type(x) is int and x >= 0 for x in ids)):
        raise SpecError(f"{path}: line {i}: input_ids must be a non-empty list of token ids", key="prompts")
    return ids


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [n, L] (pad id 0, masked) and the attention mask [n, L] (1 on real tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # host: tokenized prompts, moved with the batch
    mask = torch.zeros(len(prompts), width, dtype=torch.long)  # host: tokenized prompts, moved with the batch
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)  # host: tokenized prompts
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def log_probs64(logits: torch.Tensor) -> torch.Tensor:
    """Normalised float64 log-probs from model logits [..., V]: log-softmax in float32 (or the model's
    wider dtype), then cast to float64 for every statistic (module docstring)."""
    wide = logits if logits.dtype == torch.float64 else logits.float()
    return torch.log_softmax(wide, dim=-1).to(torch.float64)


def _cache_name(model) -> str:
    """The keyword (and output field) of a model's KV cache: transformers 5.x names it ``cache`` (its
    ``past_key_values`` warns that it is deprecated), 4.x ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Step:
    """One batch of prompts fed through a model with its KV cache, one token at a time."""

    def __init__(self, model, ids: torch.Tensor, mask: torch.Tensor):
        """``ids``, ``mask``: left-padded prompts [n, L]. Positions count real tokens only, so a padded
        prompt sees exactly the positions it would see alone."""
        self.model, self.mask = model, mask
        self.cache_name = _cache_name(model)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        self.cache, self.last = getattr(out, self.cache_name), out.logits[:, -1]
        self.pos = pos[:, -1:]

    def advance(self, tokens: torch.Tensor) -> None:
        """Feed the next tokens [n]; ``self.last`` becomes the logits [n, V] after them."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.pos = self.pos + 1
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.pos,
                         use_cache=True, **{self.cache_name: self.cache})
        self.cache, self.last = getattr(out, self.cache_name), out.logits[:, -1]


@torch.no_grad()
def next_token_logprobs(model, prompts: list[list[int]], batch_size: int, device) -> torch.Tensor:
    """log q(·|prompt) for every prompt, float64 [B, V] (CPU), ``batch_size`` prompts per forward pass."""
    out = []
    for i in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[i:i + batch_size], device)
        out.append(log_probs64(Step(model, ids, mask).last).cpu())
    return torch.cat(out)
