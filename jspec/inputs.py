"""vLLM's prompt dictionaries (``vllm.inputs``): what ``LLM.generate`` and
``LLMEngine.add_request`` take besides a string or a list of token ids.

Only the keys of a text-only model's prompt are taken; the multimodal ones (and prompt
embeddings) are refused by name, since dropping them would change the request.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # only requests with the same salt share prefix-cache pages


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


_KEYS = {"prompt": {"prompt", "cache_salt"}, "prompt_token_ids": {"prompt_token_ids", "cache_salt"}}
_REFUSED = {"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "token_type_ids", "prompt_embeds"}


def check_cache_salt(salt) -> str | None:
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


def parse_prompt(prompt) -> tuple[object, str | None]:
    """(the prompt as a string or token ids, its cache salt) of any prompt ``generate``
    takes; a ValueError naming the key of a dict it cannot take."""
    if not isinstance(prompt, dict):
        return prompt, None
    refused = sorted(_REFUSED & prompt.keys())
    if refused:
        raise ValueError(f"prompt keys {refused} are not supported: jspec serves text-only models")
    kinds = [k for k in _KEYS if k in prompt]
    if len(kinds) != 1:
        raise ValueError("a prompt dict needs exactly one of 'prompt' (vLLM's TextPrompt) and 'prompt_token_ids' "
                         f"(TokensPrompt), got keys {sorted(prompt)}")
    unknown = sorted(prompt.keys() - _KEYS[kinds[0]])
    if unknown:
        raise ValueError(f"unknown prompt keys {unknown} (a {'TextPrompt' if kinds[0] == 'prompt' else 'TokensPrompt'}"
                         f" takes {sorted(_KEYS[kinds[0]])})")
    value = prompt[kinds[0]]
    if kinds[0] == "prompt" and not isinstance(value, str):
        raise ValueError(f"TextPrompt's 'prompt' must be a string, got {type(value).__name__}")
    if kinds[0] == "prompt_token_ids" and isinstance(value, str):
        raise ValueError("TokensPrompt's 'prompt_token_ids' must be a list of token ids, got a string")
    return value, check_cache_salt(prompt.get("cache_salt"))
