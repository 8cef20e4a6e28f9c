"""A reasoning model's thinking apart from its answer, in the chat API (vLLM's ``--reasoning-parser``):
the message's ``reasoning_content`` and ``content``, and in a stream ``delta.reasoning_content``
then ``delta.content``. Pure: no sockets, no HTTP.

Formats (``PARSERS``), as vLLM's parsers read them:

- ``qwen3``: ``<think>...</think>`` then the answer. An output that does not begin with ``<think>``
  is all answer (thinking turned off: ``chat_template_kwargs: {"enable_thinking": false}``).
- ``deepseek_r1``: the thinking comes first (its ``<think>`` may be in the prompt) and ends at
  ``</think>``.

Thinking without its ``</think>`` (cut short by ``max_tokens``) is all thinking, streamed or not.

Only the answer is parsed for tool calls (``api/tools.py``). A chat request's structured output
(``response_format``, a forced tool call, ...) binds only the answer: the model thinks freely
first (``SamplingParams.think_first``; the worker finds where thinking ends, ``workers/guides.py``).
"""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def split(text: str, parser: str) -> tuple[str | None, str | None]:
    """A finished output's thinking and answer (None: none)."""
    head = text.lstrip()
    if head.startswith(START):
        body = head[len(START):]
    elif parser == "qwen3":
        return None, text
    else:
        body = text
    if END not in body:
        return body or None, None
    thinking, answer = body.split(END, 1)
    return thinking or None, answer.lstrip("\n") or None


class ThinkingStream:
    """A streamed choice's text as thinking and answer pieces, as they come: a piece that may be
    the start of a tag is held until it shows what it is."""

    def __init__(self, parser: str) -> None:
        self.parser, self.text, self.at = parser, "", 0  # ``at``: the characters handed out or dropped
        self.state = "start"  # start (not yet known whether it thinks), thinking, answer
        self.answered = False  # (the answer's leading newlines, after </think>, are dropped)

    def feed(self, piece: str) -> list[tuple[str, str]]:
        """(``"reasoning"`` or ``"content"``, text) pieces of what is certain now."""
        self.text += piece
        out: list[tuple[str, str]] = []
        if self.state == "start":
            head = self.text.lstrip()
            if head.startswith(START):
                self.state, self.at = "thinking", self.text.find(START) + len(START)
            elif START.startswith(head):
                return out  # (it may yet be the tag)
            else:
                self.state = "thinking" if self.parser == "deepseek_r1" else "answer"
                self.answered = self.state == "answer"  # (an answer from the first character keeps them)
        if self.state == "thinking":
            end = self.text.find(END, self.at)
            if end < 0:
                keep = partial_tail(self.text, END, self.at)
                if len(self.text) - keep > self.at:
                    out.append(("reasoning", self.text[self.at:len(self.text) - keep]))
                    self.at = len(self.text) - keep
                return out
            if end > self.at:
                out.append(("reasoning", self.text[self.at:end]))
            self.state, self.at, self.answered = "answer", end + len(END), False
        if self.state == "answer" and self.at < len(self.text):
            piece, self.at = self.text[self.at:], len(self.text)
            if not self.answered and self._after_thinking():
                piece = piece.lstrip("\n")
            if piece:
                self.answered = True
                out.append(("content", piece))
        return out

    def _after_thinking(self) -> bool:
        """Whether the answer follows a ``</think>`` (its leading newlines go, as ``split``'s)."""
        return END in self.text

    def rest(self) -> list[tuple[str, str]]:
        """At the end: what was held (a tail that was not a tag after all)."""
        if self.at >= len(self.text):
            return []
        kind = "reasoning" if self.state == "thinking" else "content"
        piece, self.at = self.text[self.at:], len(self.text)
        return [(kind, piece)]


def partial_tail(text: str, tag: str, start: int) -> int:
    """How many characters at the end of ``text`` (from ``start``) may begin ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text) - start), 0, -1) if text.endswith(tag[:k])), 0)
