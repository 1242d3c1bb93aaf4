"""Fine-tuning of converted models: attention transfer, then LoRA or full fine-tuning, with Accelerate.

The trainer (and Accelerate, PEFT) is imported on first use, so that the settings and the optimizer
rule (`training.config` and its groups of settings, `training.optim`) import light.
"""

from hf_softmax_rnn.training.config import FinetuneConfig

__all__ = ["FinetuneConfig", "FinetuneResult", "Finetuner", "finetune"]
_TRAINER_NAMES = ("FinetuneResult", "Finetuner", "finetune")


def __getattr__(name: str):
    if name in _TRAINER_NAMES:
        from hf_softmax_rnn.training import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
