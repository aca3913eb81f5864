"""Write the local folders that tinker-cookbook's rl_loop and sl_loop read, offline.

    .venv/bin/python scripts/cookbook/make_datasets.py DIR \
        [--tokenizer meta-llama/Llama-3.2-1B=tiny-random-llama] [--gsm8k 64] [--no-robots 64]

Then run the loops with DIR as their working directory (scripts/cookbook/run.sh does), and
with HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1: every name the loops look up resolves to a
folder under DIR, and no hub is contacted. What is written (all text, a few hundred KB):

* ``DIR/openai/gsm8k``: what ``datasets.load_dataset("openai/gsm8k", "main")`` (rl_loop) loads:
  config ``main``, splits ``train``/``test`` of {question, answer}, the answer ending in the
  GSM8K ``#### <number>`` line rl_loop grades against. The problems are one-digit additions,
  so a small model gets some right and the reward has something to rise from.
* ``DIR/HuggingFaceH4/no_robots``: what ``datasets.load_dataset("HuggingFaceH4/no_robots")``
  (sl_loop) loads: splits ``train``/``test`` of {prompt, prompt_id, messages, category}, the
  ``messages`` a user/assistant chat. The assistant answers follow a few fixed patterns, so the
  loss of a small model falls within a few steps.
* ``DIR/<cookbook model name>``, one per ``--tokenizer NAME=PACKAGED``: the packaged model's
  tokenizer files, where the cookbook's ``get_tokenizer(NAME)`` finds a local folder first. The
  loops take one ``model_name`` for three things: the model table that picks a renderer (it must
  be a name the cookbook knows, ``org/model``), this tokenizer, and the base model sent to the
  server (which must map NAME to PACKAGED: docs/tinker-cookbook.md).

Runs with the main venv (.venv): it builds or finds the packaged model as the worker does
(trainer.models.loading), and only copies its tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# The files of a Hugging Face tokenizer folder (those that exist are copied; no weights).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)

GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
  - split: test
    path: main/test.jsonl
---
A tiny local stand-in for openai/gsm8k (config `main`), written by
scripts/cookbook/make_datasets.py: one-digit additions in GSM8K's format.
"""

NO_ROBOTS_CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train.jsonl
  - split: test
    path: data/test.jsonl
---
A tiny local stand-in for HuggingFaceH4/no_robots, written by
scripts/cookbook/make_datasets.py: short chats whose answers follow a few fixed patterns.
"""

WORDS = ("cat", "dog", "sun", "tree", "bird", "fish", "moon", "star", "rain", "lake", "frog", "bee")


def gsm8k_rows(n: int, rng: random.Random) -> list[dict[str, str]]:
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(0, 9)
        rows.append(
            {
                "question": f"What is {a} + {b}?",
                "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b}",
            }
        )
    return rows


def chat(i: int, rng: random.Random) -> tuple[str, str, str]:
    """A (category, user, assistant) triple; lower-case text, so that even tiny-random-llama's
    character-level tokenizer covers every character the loss is taken on."""
    kind = i % 3
    if kind == 0:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return "math", f"what is {a} + {b}?", f"{a} + {b} = {a + b}."
    word = rng.choice(WORDS)
    if kind == 1:
        return "spelling", f"spell {word}.", " ".join(word) + "."
    return "repeat", f"say {word} three times.", f"{word} {word} {word}."


def no_robots_rows(n: int, rng: random.Random, offset: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        category, user, assistant = chat(i, rng)
        rows.append(
            {
                "prompt": user,
                "prompt_id": f"local-{offset + i:06d}",
                "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": assistant},
                ],
                "category": category,
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_dataset(folder: Path, card: str, splits: dict[str, list[dict[str, Any]]]) -> None:
    shutil.rmtree(folder, ignore_errors=True)  # a re-run replaces, never mixes
    folder.mkdir(parents=True)
    (folder / "README.md").write_text(card)
    for relative, rows in splits.items():
        write_jsonl(folder / relative, rows)


def write_tokenizer(out: Path, cookbook_name: str, packaged: str) -> Path:
    from jobspec import PACKAGED_MODELS
    from trainer.models.loading import resolve_model

    if packaged not in PACKAGED_MODELS:
        raise SystemExit(f"{packaged!r} is not a packaged model ({', '.join(PACKAGED_MODELS)})")
    if "/" not in cookbook_name or cookbook_name.startswith(("/", ".")) or ".." in cookbook_name:
        raise SystemExit(f"{cookbook_name!r}: give the cookbook's org/model name")
    source = resolve_model(packaged)  # built on first use, as the worker does
    target = out / cookbook_name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, target / name)
    if "tokenizer_config.json" not in copied:
        raise SystemExit(f"{source} holds no tokenizer_config.json")
    (target / "GRPO_PACKAGED_MODEL").write_text(packaged + "\n")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder the loops run in")
    parser.add_argument(
        "--tokenizer",
        action="append",
        metavar="NAME=PACKAGED",
        help="a cookbook model name and the packaged model whose tokenizer it gets "
        "(repeatable; default meta-llama/Llama-3.2-1B=tiny-random-llama)",
    )
    parser.add_argument("--gsm8k", type=int, default=64, help="GSM8K train problems (64)")
    parser.add_argument("--no-robots", type=int, default=64, help="no_robots train chats (64)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)

    write_dataset(
        out / "openai" / "gsm8k",
        GSM8K_CARD,
        {"main/train.jsonl": gsm8k_rows(args.gsm8k, rng), "main/test.jsonl": gsm8k_rows(16, rng)},
    )
    write_dataset(
        out / "HuggingFaceH4" / "no_robots",
        NO_ROBOTS_CARD,
        {
            "data/train.jsonl": no_robots_rows(args.no_robots, rng, 0),
            "data/test.jsonl": no_robots_rows(16, rng, args.no_robots),
        },
    )
    print(f"datasets: {out}/openai/gsm8k ({args.gsm8k} train problems)")
    print(f"datasets: {out}/HuggingFaceH4/no_robots ({args.no_robots} train chats)")
    for pair in args.tokenizer or ["meta-llama/Llama-3.2-1B=tiny-random-llama"]:
        name, sep, packaged = pair.partition("=")
        if not sep:
            raise SystemExit(f"--tokenizer {pair!r}: write NAME=PACKAGED")
        folder = write_tokenizer(out, name, packaged)
        print(f"tokenizer: {folder} (the tokenizer of {packaged})")


if __name__ == "__main__":
    main()
