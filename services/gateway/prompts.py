"""The gateway's use of the tokenizer: prompts (text, token ids, chat messages rendered with
the checkpoint's chat template) to token ids, token ids to text pieces for logprobs.

Rendering errors (a template that rejects the conversation) become InvalidArgumentError
naming the field. No grpc.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from services.gateway.validation import InvalidArgumentError

# Inputs above this size are tokenized on a thread so the event loop keeps serving.
LARGE_INPUT_CHARS = 64 * 1024


class PromptTokenizer:
    def __init__(self, tokenizer, chat_template: str | None = None) -> None:
        """`chat_template`: used instead of the checkpoint's (vLLM's --chat-template)."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        field: str,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of the conversation, exactly as transformers' apply_chat_template
        (`tools`: the functions the template lists, as vLLM passes them)."""
        if not self.has_chat_template:
            raise InvalidArgumentError(
                f"{field} needs a chat template, and this model's tokenizer has none: "
                "send prompt.text or prompt.token_ids"
            )
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template=self.chat_template,
                tokenize=False,
            )
        except Exception as exc:  # jinja2 errors, raise_exception() in templates
            raise InvalidArgumentError(
                f"{field}: the model's chat template rejected the messages: {exc}"
            ) from exc
        # The template places its own special tokens (BOS...), as apply_chat_template does.
        return self.encode(rendered, add_special_tokens=False)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return list(self.tokenizer.convert_ids_to_tokens(list(ids)))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
