"""gpt-oss's output in the harmony format, read back into its messages.

After the generation prompt `<|start|>assistant`, the model writes messages such as

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

A header (role, `<|channel|>` name, ` to=` recipient, `<|constrain|>` content type) ends at
`<|message|>`; the content ends at `<|end|>`, `<|call|>` or `<|return|>`. The special tokens
are in the text because the worker decodes gpt-oss output with skip_special_tokens=False.
The format is OpenAI's published one; this reads it without the openai-harmony package, whose
vocabulary is downloaded at first use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                                         "<|constrain|>", "<|return|>", "<|call|>")
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
CONTENT_ENDS = (END, CALL, RETURN)
SPLIT = re.compile("(" + "|".join(re.escape(marker) for marker in MARKERS) + ")")
RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class HarmonyMessage:
    channel: str  # analysis, commentary or final; "" when the header names none
    recipient: str | None  # functions.NAME for a tool call
    content_type: str | None  # <|constrain|>json
    content: str
    is_complete: bool  # its end marker was read


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` may be the start of a marker (held back while
    streaming, since the next delta may complete it)."""
    for length in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(marker.startswith(text[-length:]) for marker in markers):
            return length
    return 0


def _header(parts: list[str]) -> tuple[str, str | None, str | None]:
    """A header's channel, recipient and content type, from its text and markers."""
    channel, content_type, text, after = "", None, "", None
    for part in parts:
        if part in (CHANNEL, CONSTRAIN):
            after = part
            continue
        text += " " + part
        if after == CHANNEL:
            channel = part.split()[0] if part.split() else ""
        elif after == CONSTRAIN:
            content_type = part.strip() or None
        after = None
    recipient = RECIPIENT.search(text)
    return channel, recipient.group(1) if recipient else None, content_type


def parse_harmony(text: str, is_final: bool = True) -> list[HarmonyMessage]:
    """The messages of a harmony output, in order; the last one may be incomplete. While
    streaming (`is_final` False), a trailing partial marker is left unread. Text before any
    header (a model that ignored the format) is one final message."""
    if not is_final:
        text = text[:len(text) - held_back(text, MARKERS)]
    if text and not text.lstrip().startswith("<|"):
        return [HarmonyMessage("final", None, None, text, is_final)]
    messages, header, content, in_content = [], [], "", False
    for part in SPLIT.split(text):
        if not part:
            continue
        if not in_content:
            if part == MESSAGE:
                in_content, content = True, ""
            elif part != START:
                header.append(part)
            continue
        if part in CONTENT_ENDS or part == START:
            messages.append(HarmonyMessage(*_header(header), content, True))
            header, in_content = [], False
        else:
            content += part
    if in_content:
        messages.append(HarmonyMessage(*_header(header), content, is_final))
    return messages
