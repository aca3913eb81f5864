"""Shared fixtures for the rollout engine tests: the tiny model, a teacher-forcing reference, and
a Qwen-style chat model whose turns end with another token than its eos."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from trainer.models.loading import TINY_ALPHABET, resolve_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("tiny-random-llama", cache_dir=tmp_path_factory.mktemp("models"))


def chat_prompts(tokenizer: PreTrainedTokenizerBase, questions: list[str]) -> list[list[int]]:
    """Token ids of single-turn chat prompts ending with the assistant header."""
    out = []
    for question in questions:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
        out.append(list(encoded["input_ids"]))
    return out


def teacher_forced_logprobs(
    model: PreTrainedModel, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token given everything before it, [len]."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


# --------------------------------------------------------------------------- Qwen-style chat model

# ChatML as Qwen2.5 writes it: each turn is closed by <|im_end|>, while the tokenizer's eos (and
# pad) is <|endoftext|>, as in Qwen2.5's base models.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def qwen_style_tokenizer(chat_template: str = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over ``TINY_ALPHABET`` in Qwen2.5 base's format: ChatML
    turns end with ``<|im_end|>``, the eos is ``<|endoftext|>``, no bos."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate((*QWEN_SPECIAL_TOKENS, *TINY_ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(QWEN_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def bigram_llama(
    vocab_size: int, next_token: dict[int, int], default: int, *, hidden_size: int = 128
) -> LlamaForCausalLM:
    """A Llama whose next token is a fixed function of the current one: ``next_token[t]``, else
    ``default``. Attention and MLP outputs are zeroed, so the last hidden state is the current
    token's embedding, a one-hot vector; the untied head turns it into a logit of 40 for the
    chosen token and 0 for every other (sampling at temperature 1 picks it with probability
    1 - 1e-15). Head dim 32, as vLLM's CPU attention needs."""
    if vocab_size > hidden_size:
        raise ValueError("one-hot embeddings need vocab_size <= hidden_size")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=hidden_size // 32,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).float().eval()
    scale = 40.0 / hidden_size**0.5  # RMSNorm turns a one-hot vector into sqrt(hidden) there
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab_size, hidden_size))
        head = torch.zeros(vocab_size, hidden_size)
        for token in range(vocab_size):
            head[next_token.get(token, default), token] = scale
        model.lm_head.weight.copy_(head)
    return model


def save_qwen_style_model(folder: Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A Qwen-style chat model in ``folder``: after the assistant header it answers "4" and
    closes the turn with <|im_end|>; after that (and after anything else) it writes "x" forever.
    Its generation config, as Qwen2.5 base's, names only <|endoftext|>."""
    tokenizer = qwen_style_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    model = bigram_llama(
        len(tokenizer), {ids("\n"): ids("4"), ids("4"): ids("<|im_end|>")}, ids("x")
    )
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return model, tokenizer
