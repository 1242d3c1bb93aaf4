"""Training text written by the model itself: a diverse, offline corpus for distillation.

Distilling a converted model from its original only needs text that the original reads
well; the offline default corpus (Python's documentation) is one narrow kind of prose, and a
model distilled on it alone recovers mostly on that kind. `generated_corpus` asks the
original (instruction-tuned) model to write on `TOPICS` x `FORMS` (stories, letters, news,
essays, dialogues, ... about everyday, historical, scientific and practical subjects),
sampled with temperature, so the converted model is distilled on the original's own
distribution over many kinds of text. Nothing is downloaded.

The texts are cached as JSON lines under `<HF_HOME>/hf_softmax_rnn/generated/`, keyed by the
model's weights and every generation setting, so a second run (or a `--resume`) reads the
same texts instead of generating again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict
from huggingface_hub import constants as hub_constants
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

#: The source name that `load_sources` reads as this corpus.
GENERATED_CORPUS = "generated"
#: Bumped whenever the prompts change, so cached texts of other prompts are not reused.
PROMPT_VERSION = 1

TOPICS = (
    "a lighthouse keeper during a storm",
    "the history of the printing press",
    "how bees find their way home",
    "a family moving to a new city",
    "the first day at a new job",
    "why the sky is blue",
    "a small bakery that almost closes",
    "the building of a medieval cathedral",
    "a long train journey across a continent",
    "learning to play the violin as an adult",
    "the life cycle of a star",
    "a village football match",
    "how a bill becomes law",
    "an old map found in an attic",
    "the invention of the telephone",
    "a friendship between two neighbours",
    "the water cycle",
    "a mountain rescue",
    "how vaccines train the immune system",
    "a market town on a busy Saturday",
    "the fall of the Roman Republic",
    "a detective and a missing painting",
    "growing tomatoes on a balcony",
    "the migration of whales",
    "a letter that arrives forty years late",
    "how money and banks work",
    "a robot that learns to paint",
    "the expedition to the South Pole",
    "a grandmother's recipe book",
    "how earthquakes happen",
    "a ship lost in the fog",
    "the Silk Road",
    "a teacher who changed a student's life",
    "the chemistry of cooking",
    "a city during a power cut",
    "the discovery of penicillin",
    "a young chess champion",
    "how forests recover after a fire",
    "a wedding that goes wrong",
    "the Industrial Revolution in a mill town",
    "a musician's first concert",
    "the phases of the moon",
    "two rivals who become partners",
    "how the heart pumps blood",
    "a winter in a cabin in the woods",
    "the story of the Olympic Games",
    "a lost dog finding its way home",
    "how elections are run",
    "an island with a secret",
    "the architecture of bridges",
    "a nurse on a night shift",
    "the rise and fall of a newspaper",
    "how children learn language",
    "a festival in a coastal town",
    "the voyage of a cargo ship",
    "a scientist who makes a mistake",
    "the history of tea",
    "a courtroom on the last day of a trial",
    "how glaciers shape valleys",
    "a farmer during a drought",
)

FORMS = (
    "short story",
    "news article",
    "personal letter",
    "encyclopedia entry",
    "essay",
    "dialogue between two people",
    "diary entry",
    "speech",
)


@dataclass(frozen=True)
class GenerationSettings:
    """How the texts are sampled (part of the cache key)."""

    num_texts: int = 256
    max_new_tokens: int = 512
    temperature: float = 0.8
    top_p: float = 0.95
    batch_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_texts", "max_new_tokens", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GenerationSettings.{name}={value!r} is not allowed; expected an int >= 1")
        if not 0 < self.temperature <= 10:
            raise ValueError(f"GenerationSettings.temperature={self.temperature!r} is not allowed; expected (0, 10]")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"GenerationSettings.top_p={self.top_p!r} is not allowed; expected (0, 1]")


def prompts(count: int, seed: int) -> list[str]:
    """`count` writing requests, every (topic, form) pair once in a seeded order before any repeats."""
    pairs = [(topic, form) for topic in TOPICS for form in FORMS]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen = [pairs[order[i % len(pairs)]] for i in range(count)]
    return [f"Write a long, detailed {form} about {topic}." for topic, form in chosen]


def _model_fingerprint(model) -> str:
    """A short hash of the model's config and a sample of its weights (which model wrote the texts)."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for _, parameter in list(model.named_parameters())[:4]:
            digest.update(parameter.detach().float().flatten()[:4096].cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def cache_path(model, settings: GenerationSettings) -> Path:
    """Where the texts of `model` under `settings` are cached."""
    key = json.dumps({"model": _model_fingerprint(model), "prompts": PROMPT_VERSION, **asdict(settings)})
    name = hashlib.sha256(key.encode()).hexdigest()[:20]
    return Path(hub_constants.HF_HOME) / "hf_softmax_rnn" / "generated" / f"{name}.jsonl"


def _chat_prompt(tokenizer, request: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": request}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    return tokenizer(request + "\n\n", add_special_tokens=False)["input_ids"]


def _stop_ids(model) -> list[int]:
    """The ids that end a sampled text: the eos ids of the model's generation config (none: every text runs
    to `max_new_tokens`)."""
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _padding_id(model, tokenizer) -> int:
    """The id that pads the prompts on the left and fills a row after its stop id: the tokenizer's pad or eos
    token, else the model's. Masked prompt positions and what follows a stop id are never read, so with neither
    (no text then stops early) any id in the vocabulary does: 0."""
    candidates = (tokenizer.pad_token_id, tokenizer.eos_token_id, model.generation_config.pad_token_id)
    return next((id_ for id_ in (*candidates, *_stop_ids(model)) if id_ is not None), 0)


def _until_stop(row: list[int], stop_ids: list[int]) -> list[int]:
    """The tokens of a sampled `row` before its first stop id (after it comes padding)."""
    return next((row[:index] for index, token in enumerate(row) if token in stop_ids), row)


@torch.no_grad()
def generate_texts(model, tokenizer, settings: GenerationSettings, progress: bool = True) -> list[str]:
    """Sample `settings.num_texts` answers of `model` to `prompts(...)`, in batches (left padded), each cut at
    the first of the model's eos ids: a tokenizer without eos or pad token writes the same texts."""
    device = next(model.parameters()).device
    pad_id, stop_ids = _padding_id(model, tokenizer), _stop_ids(model)
    requests = prompts(settings.num_texts, settings.seed)
    texts = []
    was_training = model.training
    model.eval()
    batches = range(0, len(requests), settings.batch_size)
    for start in tqdm(batches, desc="Generating training text", unit="batch", disable=not progress):
        encoded = [_chat_prompt(tokenizer, request) for request in requests[start : start + settings.batch_size]]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in encoded], device=device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=device)
        torch.manual_seed(settings.seed * 1_000_003 + start)
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_new_tokens=settings.max_new_tokens,
            pad_token_id=pad_id,
        )
        rows = [_until_stop(row, stop_ids) for row in output[:, width:].tolist()]
        texts += tokenizer.batch_decode(rows, skip_special_tokens=True)
    model.train(was_training)
    return [text.strip() for text in texts]


def generated_corpus(
    model, tokenizer, settings: GenerationSettings | None = None, *, test_every: int = 16, progress: bool = True
) -> DatasetDict:
    """The model's own texts as {"train", "test"} datasets with a "text" column (every
    `test_every`-th text held out; the last one when there are fewer), generated once and then read
    from the cache."""
    settings = settings or GenerationSettings()
    path = cache_path(model, settings)
    if path.is_file():
        texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
        logger.info("Read %d generated texts from %s", len(texts), path)
    else:
        logger.info("Generating %d training texts with the model (cached in %s)", settings.num_texts, path)
        texts = generate_texts(model, tokenizer, settings, progress)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            handle.writelines(json.dumps({"text": text}) + "\n" for text in texts)
        os.replace(handle.name, path)
    texts = [text for text in texts if text]
    held_out = set(range(test_every - 1, len(texts), test_every)) or {len(texts) - 1}
    split = {"train": [], "test": []}
    for index, text in enumerate(texts):
        split["test" if index in held_out else "train"].append(text)
    return DatasetDict({name: Dataset.from_dict({"text": rows}) for name, rows in split.items()})
