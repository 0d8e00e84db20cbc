"""A tiny GRPO (or RLOO) run on random GPT-2s with KLAudit attached: CPU, no download, ~20 s.

    python -m kl_bench.integrations.demo [--top-k 20] [--steps 3] [--out DIR]
    torchrun --nproc-per-node 2 -m kl_bench.integrations.demo --out DIR      # two CPU processes (gloo)

Builds the tiny policy and reference (kl_bench.kinds.model.tiny), loads the reference's weights into the
trainer's reference model (TRL builds it from the policy's path), trains with a toy reward, and audits
every step. Used by the README and by tests/test_audit_trl.py.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def tokenizer(models: Path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(models / "policy")
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def prompts(models: Path, count: int, equal_length: bool) -> list[str]:
    """Prompts from the tiny models' prompt file; ``equal_length``: all of one token length (no padding)."""
    tok = tokenizer(models)
    lines = [x for x in (models / "prompts.txt").read_text().splitlines() if x.strip()]
    if not equal_length:
        return (lines * count)[:count]
    ids = [tok(x)["input_ids"][:4] for x in lines]
    ids = [x for x in ids if len(x) == 4]
    return [tok.decode(ids[i % len(ids)]) for i in range(count)]


def build_trainer(models: Path, out: Path, *, trainer: str = "grpo", steps: int = 3, equal_length: bool = True,
                  position_ids: bool = False, learning_rate: float = 1e-3, seed: int = 0, **config):
    """A TRL trainer on the tiny models. ``position_ids``: patch the policy and reference forwards to
    derive position ids from the attention mask (as generate() does), which left padding needs."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    Config, Trainer = (GRPOConfig, GRPOTrainer) if trainer == "grpo" else (RLOOConfig, RLOOTrainer)
    import dataclasses
    # transformers 5 renamed gradient_checkpointing (TRL's configs default it to True): the old name set, by
    # us or by TRL's default, warns at every run; the new one, where it exists, silences it
    checkpointing = ("activation_checkpointing" if "activation_checkpointing" in {f.name for f in dataclasses.fields(Config)}
                     else "gradient_checkpointing")
    settings = {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 8, "beta": 0.1,
                "bf16": False, "disable_dropout": True, checkpointing: False, **config}
    use_cpu = settings.pop("use_cpu", True)
    args = Config(output_dir=str(out), max_steps=steps, learning_rate=learning_rate, logging_steps=1,
                  report_to="none", use_cpu=use_cpu, seed=seed, save_strategy="no", **settings)
    # Prompts a step: one generation batch (per-device batch × steps_per_generation, which defaults to the
    # gradient accumulation steps) holds batch / num_generations distinct prompts.
    per_step = settings["per_device_train_batch_size"] * int(settings.get("steps_per_generation") or
                                                             settings.get("gradient_accumulation_steps", 1))
    dataset = Dataset.from_dict({"prompt": prompts(models, per_step // settings["num_generations"] * steps,
                                                   equal_length)})

    def reward(completions, **kwargs):
        return [float(len(c)) / 10 for c in completions]

    tr = Trainer(model=str(models / "policy"), reward_funcs=reward, args=args, train_dataset=dataset,
                 processing_class=tokenizer(models))
    if tr.ref_model is not None:                      # None when beta = 0: TRL builds no reference
        ref = AutoModelForCausalLM.from_pretrained(models / "reference")
        with torch.no_grad():
            tr.ref_model.load_state_dict(ref.state_dict())
    if position_ids:
        for model in (m for m in (tr.model, tr.ref_model) if m is not None):
            _derive_position_ids(model)
    return tr


def _derive_position_ids(model) -> None:
    """Patch ``model.forward`` so that a call without position_ids gets them from the attention mask
    (cumsum − 1, as generate() builds them): left-padded rows then see the positions they were sampled at."""
    forward = model.forward

    def patched(*args, attention_mask=None, position_ids=None, **kwargs):
        if position_ids is None and attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return forward(*args, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    model.forward = patched


def _quiet_trainer_output(tr) -> None:
    """The audit's lines are what the demo shows: transformers' progress bar (drawn over them) and TRL's log
    dicts (one of 1,000 characters a step, printed between them) are taken off the terminal; TRL's logs stay in
    ``tr.state.log_history`` (written to trl_log_history.json with --out)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    for cb in (ProgressCallback, PrinterCallback):
        tr.remove_callback(cb)


def _wrapped_print():
    """print, wrapped on words at a terminal's width (a continuation indented), whole lines in a pipe or a log."""
    import shutil
    import sys
    import textwrap
    if not sys.stdout.isatty():
        return print
    width = max(shutil.get_terminal_size().columns, 20)
    return lambda line: print(textwrap.fill(str(line), width, subsequent_indent="  ", break_long_words=False,
                                            break_on_hyphens=False))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainer", choices=("grpo", "rloo"), default="grpo")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--left-padding", action="store_true", help="prompts of different lengths")
    ap.add_argument("--out", default=None, help="write audit.csv and run.json there")
    a = ap.parse_args(argv)
    import warnings

    import torch
    from .trl import KLAudit
    torch.set_num_threads(1)
    # TRL 1.x reads transformers' deprecated is_gradient_checkpointing at every generation (a FutureWarning each
    # step that is TRL's to fix, not the demo's); the demo's own settings use the new names and warn nothing
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    with tempfile.TemporaryDirectory() as tmp:
        from ..kinds.model.tiny import build_tiny_models
        models = build_tiny_models(Path(tmp) / "models")
        extra = {} if a.top_k is None else {"top_k": a.top_k}
        tr = build_trainer(models, Path(tmp) / "run", trainer=a.trainer, steps=a.steps,
                           equal_length=not a.left_padding, **extra)
        _quiet_trainer_output(tr)
        say = _wrapped_print()
        tr.add_callback(KLAudit(tr, every=1, max_rows=8, out=a.out, print_fn=say))
        tr.train()
        if tr.accelerator.is_main_process:
            if a.out is not None:
                # TRL's own logged metrics beside the audit, to compare `kl` with the audit's `logged`.
                import json
                log = Path(a.out) / "trl_log_history.json"
                log.write_text(json.dumps(tr.state.log_history, indent=1) + "\n")
                say(f"TRL's own logs ({len(tr.state.log_history)} entries, its `kl` among them): {log}")
            else:
                say(f"TRL's own logs ({len(tr.state.log_history)} entries, its `kl` among them): with --out DIR, "
                    "in DIR/trl_log_history.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
