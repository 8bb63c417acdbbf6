"""Chat-template application shared by LLM.chat and `spmdrun generate`."""
from __future__ import annotations

from collections.abc import Sequence


def chat_prompt_ids(tokenizer, messages: str | Sequence[dict], tools: list[dict] | None = None
                    ) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template, ready for the reply;
    `tools` (OpenAI's function definitions) as the template shows them, if it does.

    A bare string is taken as one user message.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send raw prompts instead "
                         "(generate(), or --no-chat-template)")
    text = tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)
