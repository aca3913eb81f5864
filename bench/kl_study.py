"""The five-estimator study: which KL estimator is more stable on one task?

    python -m bench.kl_study [--steps 20] [--only k3,k1_reward] [--out bench/results/kl_study.json]

SmolLM2-135M-Instruct learns single-digit addition (the recipe of BENCHMARKS.md section 3, made
smaller: 4 prompts x 8 completions a step) six times, with the same seeds: no KL, then k1, k2,
k3, k3_unbiased and k1_causal in the loss, and k1 in the reward, all at the same beta. Every run records
each step's metrics (reward, grad norm, the estimators' own `kl`) and, every ``--kl-every``
steps, the TRUE KL to the reference measured the same way for every run: completions sampled
from the current policy on the held-out prompts, and at each of their positions the exact
KL(pi || ref) over the whole vocabulary, averaged per token (:func:`exact_kl`). An estimator's
own `kl` metric cannot be compared across estimators; this can.

Results go to ``--out`` after every run (a rerun skips the runs already there, so an
interrupted study continues), and ``--plot`` draws docs/kl-study.png from them.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn

from jobspec import JobSpec
from trainer.models.loading import load_policy, resolve_model
from trainer.run.callbacks import Callbacks
from trainer.run.loop import train

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-arithmetic.yaml"

# name -> (estimator, placement); beta is the study's, 0 for "none".
CONFIGS: dict[str, tuple[str, str]] = {
    "none": ("none", "loss"),
    "k1": ("k1", "loss"),
    "k2": ("k2", "loss"),
    "k3": ("k3", "loss"),
    "k3_unbiased": ("k3_unbiased", "loss"),
    "k1_reward": ("k1", "reward"),
    "k1_causal": ("k1_causal", "loss"),
}


def study_spec(name: str, *, steps: int, beta: float, seed: int) -> JobSpec:
    """The recipe, smaller per step, with run ``name``'s KL settings."""
    data: dict[str, Any] = yaml.safe_load(RECIPE.read_text())
    estimator, placement = CONFIGS[name]
    data["name"] = f"kl-study-{name}"
    data["seed"] = seed
    data["grpo"].update(
        {
            "steps": steps,
            "prompts_per_step": 4,
            "group_size": 8,
            "max_new_tokens": 32,
            "learning_rate": 2e-5,
            "warmup_steps": 1,
            "kl": {
                "estimator": estimator,
                "beta": 0.0 if estimator == "none" else beta,
                "placement": placement,
            },
        }
    )
    data["eval"] = {"interval": 5, "max_rows": 32}
    data["checkpoint_interval"] = steps
    return JobSpec.model_validate(data)


@torch.no_grad()
def exact_kl(
    policy: nn.Module, reference: nn.Module, tokenizer: Any, prompts: list[str], *, seed: int
) -> float:
    """Mean per-token KL(pi || ref) over the vocabulary, at the positions of completions sampled
    from ``policy`` (temperature 1, at most 32 tokens) on ``prompts`` (chat-formatted).

    [N, L] sequences -> both models' [N, T, V] log-softmax at the completion positions ->
    sum_v p (log p - log q) per position -> mean over the real completion tokens.
    """
    torch.manual_seed(seed)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    was_training = policy.training
    policy.eval()
    out = policy.generate(
        **enc,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=32,
        pad_token_id=tokenizer.pad_token_id,
    )
    prompt_width = enc["input_ids"].shape[1]
    attention = (out != tokenizer.pad_token_id).long()
    attention[:, :prompt_width] = enc["attention_mask"]
    completion_mask = attention[:, prompt_width:].float()  # [N, T]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)

    def log_probs(model: nn.Module) -> Tensor:
        logits = model(input_ids=out, attention_mask=attention, position_ids=positions).logits
        # The logits at position i predict token i + 1: completion token t at prompt_width - 1 + t.
        return torch.log_softmax(logits[:, prompt_width - 1 : -1].float(), dim=-1)  # [N, T, V]

    lp, lq = log_probs(policy), log_probs(reference)
    per_position = (lp.exp() * (lp - lq)).sum(-1)  # [N, T]
    policy.train(was_training)
    return float((per_position * completion_mask).sum() / completion_mask.sum().clamp(min=1))


class StudyLog(Callbacks):
    """Every step's metrics, and the exact KL every ``every`` steps, on the live policy."""

    def __init__(
        self,
        policy: nn.Module,
        reference: nn.Module,
        tokenizer: Any,
        prompts: list[str],
        every: int,
    ) -> None:
        self.policy, self.reference, self.tokenizer = policy, reference, tokenizer
        self.prompts, self.every = prompts, every
        self.steps: list[dict[str, float]] = []
        self.true_kl: list[dict[str, float]] = []
        self.started = time.perf_counter()

    def measure(self, step: int) -> None:
        kl = exact_kl(self.policy, self.reference, self.tokenizer, self.prompts, seed=step)
        self.true_kl.append({"step": step, "kl": kl})

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append({"step": step, **metrics})
        if step % self.every == 0:
            self.measure(step)
        print(
            f"  step {step}: reward {metrics.get('reward/mean', float('nan')):.3f}, grad_norm "
            f"{metrics.get('grad_norm', float('nan')):.2f}, {time.perf_counter() - self.started:.0f}s",
            flush=True,
        )


def run_one(name: str, args: argparse.Namespace, base: tuple[nn.Module, Any]) -> dict[str, Any]:
    spec = study_spec(name, steps=args.steps, beta=args.beta, seed=args.seed)
    base_model, tokenizer = base
    policy = copy.deepcopy(base_model)
    prompts = [row.prompt for row in spec.dataset.all_rows()[-spec.dataset.holdout :]][:16]
    log = StudyLog(policy, base_model, tokenizer, prompts, args.kl_every)
    log.measure(0)
    started = time.perf_counter()
    train(spec, log, output_dir=args.work / name, model=policy, tokenizer=tokenizer)
    return {
        "name": name,
        "estimator": CONFIGS[name][0],
        "placement": CONFIGS[name][1],
        "beta": spec.grpo.kl.beta,
        "seconds": time.perf_counter() - started,
        "steps": log.steps,
        "true_kl": log.true_kl,
    }


def plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [
        (axes[0][0], "reward/mean", "train reward (mean)"),
        (axes[0][1], "eval/accuracy", "held-out accuracy (greedy)"),
        (axes[1][1], "grad_norm", "gradient norm (pre-clip)"),
    ]
    for run in results["runs"].values():
        label = run["name"]
        for ax, key, _ in panels:
            points = [(s["step"], s[key]) for s in run["steps"] if key in s]
            if points:
                ax.plot(*zip(*points, strict=True), "o-" if key.startswith("eval") else "-",
                        label=label)  # fmt: skip
        kl = run["true_kl"]
        axes[1][0].plot([p["step"] for p in kl], [p["kl"] for p in kl], "o-", label=label)
    for ax, _, title in panels:
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[1][0].set_title("true KL(pi || ref) per token, exact over the vocabulary")
    axes[1][0].set_xlabel("step")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"KL estimators on SmolLM2-135M arithmetic (beta {results['beta']}, seed {results['seed']})"
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kl-every", type=int, default=5)
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated run names")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kl_study.json")
    parser.add_argument("--work", type=Path, default=ROOT / ".grpo" / "kl-study")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "kl-study.png")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown runs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    results: dict[str, Any] = {"beta": args.beta, "seed": args.seed, "runs": {}}
    if args.out.exists():
        results = json.loads(args.out.read_text())
    base = load_policy(resolve_model("smollm2-135m-instruct"), dtype=torch.float32)
    base[0].eval()
    for name in names:
        if name in results["runs"]:
            print(f"{name}: already in {args.out}, skipped", flush=True)
            continue
        print(f"{name}: training", flush=True)
        results["runs"][name] = run_one(name, args, base)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
