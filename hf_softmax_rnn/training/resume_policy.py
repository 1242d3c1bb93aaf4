"""Which settings `--resume` may change: a run continues a checkpoint only where the settings that shape the
trained weights are those it recorded (`TrainerState.config`, one entry per flag, as `FinetuneConfig.to_dict`
gives them; a checkpoint of an older release may lack the settings added since)."""

from __future__ import annotations

import json
import operator
from pathlib import Path
from typing import Any

from hf_softmax_rnn.data.corpus import SOURCE_SEPARATOR
from hf_softmax_rnn.default_model import DEFAULT_MODEL_ALIAS
from hf_softmax_rnn.training.input_settings import SOURCES_WITHOUT_COLUMNS
from hf_softmax_rnn.training.stage_settings import LORA_DEFAULTS, STATE_SETTINGS

#: Fields that may change between a run and its `--resume` without changing the trained weights.
RESUMABLE_CHANGES = frozenset(
    {
        "resume",
        "allow_inexact_resume",
        "overwrite",
        "output_dir",
        "eval_every",
        "save_every",
        "save_total_limit",
        "progress",
        "push_to_hub",
        "hub_private",
        "long_eval",
        "long_eval_texts",
        "long_eval_positions",
        "long_eval_sequences",
        "long_eval_passkey",
        "long_eval_trials",
        "long_eval_fidelity",
        "gradient_checkpointing",
        "state_gradient_checkpointing",
    }
)
#: Settings a checkpoint's record may lack, with the setting whose value its run used for them.
SET_AS_BEFORE = {"rnn_lr": "lr"}
#: Settings a checkpoint's record may lack, with the value its run had (it trained no state stage).
UNRECORDED_VALUES = {"state_steps": 0}


def _same_place(saved: Any, current: Any, names: tuple[str, ...] = ()) -> bool:
    """Whether two values of a --model or dataset source name the same thing: two existing local paths
    compared resolved (`./llama/` from /tmp is `/tmp/llama`), anything else (a Hub id, one of the reserved
    `names`) as given."""
    if isinstance(saved, str) and isinstance(current, str) and not {saved, current} & set(names):
        paths = [Path(value).expanduser() for value in (saved, current)]
        if all(path.exists() for path in paths):
            return paths[0].resolve() == paths[1].resolve()
    return saved == current


def _same_model(saved: Any, current: Any) -> bool:
    """`_same_place`, the embedded model's alias never read as a folder."""
    return _same_place(saved, current, (DEFAULT_MODEL_ALIAS,))


def _same_dataset(saved: Any, current: Any) -> bool:
    """Same sources in the same order, each compared by `_same_place`."""
    if not (isinstance(saved, str) and isinstance(current, str)):
        return saved == current
    then, now = saved.split(SOURCE_SEPARATOR), current.split(SOURCE_SEPARATOR)
    return len(then) == len(now) and all(
        _same_place(*pair, SOURCES_WITHOUT_COLUMNS) for pair in zip(then, now, strict=True)
    )


#: How `resume_conflicts` compares a setting whose values may be spelt differently (else: equal JSON).
SAME_SETTING = {"model": _same_model, "teacher": _same_model, "dataset": _same_dataset}


def resume_conflicts(current: dict[str, Any], saved: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    """ "name: checkpoint X, now Y" of each setting of `current` (flag name -> value) that differs from the
    checkpoint's record `saved` and would change the trained weights; `defaults` stand for the settings `saved`
    lacks. A local --model or dataset path compares resolved (`SAME_SETTING`); LoRA settings do not matter to
    full fine-tuning, nor the state stage's settings to a run without it."""
    backfilled = {name: saved[older] for name, older in SET_AS_BEFORE.items() if older in saved}
    saved = UNRECORDED_VALUES | backfilled | saved
    ignored = RESUMABLE_CHANGES | (set(LORA_DEFAULTS) if current["finetune_method"] != "lora" else set())
    # the step counts differ, or no state stage at all
    if not (current["state_steps"] and saved["state_steps"]):
        ignored |= set(STATE_SETTINGS)
    return [
        f"{name}: checkpoint {saved.get(name)!r}, now {current[name]!r}"
        for name in sorted(current)
        if name not in ignored
        and not SAME_SETTING.get(name, operator.eq)(saved.get(name, defaults[name]), _as_json(current[name]))
    ]


def _as_json(value: Any) -> Any:
    """`value` as it reads back from a checkpoint's JSON (tuples as lists)."""
    return json.loads(json.dumps(value))
