"""Fine-tuning of converted models: attention transfer, then LoRA or full fine-tuning, with Accelerate."""

from hf_softmax_rnn.training.config import FinetuneConfig
from hf_softmax_rnn.training.trainer import Finetuner, FinetuneResult, finetune

__all__ = ["FinetuneConfig", "FinetuneResult", "Finetuner", "finetune"]
