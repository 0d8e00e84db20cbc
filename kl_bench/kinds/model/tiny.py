"""Tiny random causal LMs for tests, examples and benchmarks: no download, built in seconds.

:func:`build_tiny_models` trains a byte-level BPE tokenizer (``tokenizers``) on a generated corpus and
saves two GPT-2 models (2 layers, vocabulary ≈ 1000) to ``<out>/policy`` and ``<out>/reference``, the
reference being the policy with perturbed weights, plus ``<out>/prompts.txt`` (one prompt a line) and
``<out>/prompts.jsonl`` (``input_ids``). Every weight comes from an explicit ``torch.Generator``; the
global RNG that transformers' own initialisation uses is restored afterwards.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ("the cat dog sat ran on a mat fast slow red blue big small tree house bird sang over under "
         "river stone light dark one two three and then it was very quite old new near far").split()


SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def lexicon(generator: torch.Generator, extra: int = 600) -> list[str]:
    """:data:`WORDS` plus ``extra`` made-up words of 2–3 syllables (enough text for ≈ 1000 BPE merges)."""
    made = []
    for _ in range(extra):
        k = int(torch.randint(2, 4, (), generator=generator))  # host: tiny test models are built on the CPU
        # host: tiny test models are built on the CPU
        made.append("".join(SYLLABLES[int(i)] for i in torch.randint(len(SYLLABLES), (k,), generator=generator)))
    return list(WORDS) + made


def corpus(lines: int, generator: torch.Generator, words: int = 12, vocab: list[str] | None = None) -> list[str]:
    """``lines`` lines of random words from ``vocab`` (default :data:`WORDS`): the tokenizer's training
    text and the prompts."""
    vocab = list(WORDS) if vocab is None else vocab
    ids = torch.randint(len(vocab), (lines, words), generator=generator)  # host: tiny test models are built on the CPU
    lens = torch.randint(3, words + 1, (lines,), generator=generator)  # host: tiny test models are built on the CPU
    return [" ".join(vocab[i] for i in row[:n]) for row, n in zip(ids.tolist(), lens.tolist())]


def build_tiny_models(out: str | Path, *, vocab: int = 1000, layers: int = 2, width: int = 64, heads: int = 2,
                      scale: float = 0.3, perturb: float = 0.01, prompts: int = 16, seed: int = 0) -> Path:
    """Write the policy, the reference, a tokenizer and prompts under ``out``; returns ``out``.

    ``scale``: std of the random weights (0.3 makes next-token distributions peaked like an LM's rather
    than near-uniform); ``perturb``: std of the noise added to every reference weight."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    transformers.utils.logging.disable_progress_bar()

    out = Path(out)
    g = torch.Generator().manual_seed(seed)  # host: tiny test models are built on the CPU
    text = corpus(3000, g, vocab=lexicon(g))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=256, n_embd=width, n_layer=layers,
                        n_head=heads, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):        # transformers' init draws from the global RNG
        policy = GPT2LMHeadModel(config).eval()
        reference = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for (name, w), w_ref in zip(policy.named_parameters(), reference.parameters()):
            if name.endswith(".weight") and w.ndim == 1:            # layer norm gains
                base = torch.ones_like(w)
            elif name.endswith(".bias"):
                base = torch.zeros_like(w)
            else:
                # host: tiny test models are built on the CPU
                base = scale * torch.randn(w.shape, generator=g) / (1.0 if "wte" in name or "wpe" in name
                                                                    else w.shape[0] ** 0.5 / 4)
            w.copy_(base)
            w_ref.copy_(base + perturb * torch.randn(w.shape, generator=g))  # host: tiny test models are built on the CPU
    for folder, model in (("policy", policy), ("reference", reference)):
        model.save_pretrained(out / folder)
        fast.save_pretrained(out / folder)
    lines = corpus(prompts, g, words=8)
    (out / "prompts.txt").write_text("\n".join(lines) + "\n")
    with open(out / "prompts.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps({"input_ids": fast(line)["input_ids"]}) + "\n")
    return out
