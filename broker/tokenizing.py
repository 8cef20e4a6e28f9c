"""Long prompts are tokenized off the broker's dispatch thread.

Tokenizing a prompt of a few hundred thousand characters takes the better part of a second
(measured: ~600 ms for 590k characters with the tiny pair's BPE tokenizer), and done on the
dispatch thread it holds every running request's next round that long. Here a prompt longer
than ``INLINE_CHARS`` goes to a thread of its own; the tokenizer's batch call releases the GIL
(its single-text call does not: the dispatch loop stalled for 565 ms beside it, against 4 ms), so
the broker keeps dispatching while it runs. Short prompts stay inline: a thread hop costs more
than tokenizing them. A structured output whose grammar the broker has not compiled yet comes
here too (a large JSON schema took ~70 ms; llguidance releases the GIL while it compiles): its
grammar is compiled, its prompt tokenized, then it is admitted like any other.

A prompt being tokenized is already the submitter's (its id is taken, it counts against the
client's in-flight limit); a retry of it waits for the same result, a cancel drops it when it
comes back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from nebula_flow.protocol import ProtocolError, Submit, Tokenize

INLINE_CHARS = 4096  # prompts (or conversations) up to this many characters are tokenized inline


def prompt_chars(msg: Submit) -> int:
    """How much text a SUBMIT asks the broker to tokenize (0: it brings token ids)."""
    predicted = len(msg.prediction) if msg.prediction is not None else 0
    if msg.messages is not None:
        return predicted + sum(len(str(m.get("content", ""))) for m in msg.messages if isinstance(m, dict))
    return predicted + (len(msg.prompt) if msg.prompt is not None else 0)


@dataclass
class Waiting:
    """A SUBMIT whose prompt is being tokenized: who sent it and when."""

    msg: Submit
    identity: bytes
    owner: str
    submitted: float
    cancelled: bool = False


class PromptTokenizer:
    """One background thread for long prompts; ``fd`` becomes readable when one is done."""

    def __init__(self, tokenize: Callable[[Submit], list[int]]) -> None:
        self.tokenize = tokenize
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.fd, self._wake = os.pipe()
        os.set_blocking(self.fd, False)
        self.waiting: dict[str, Waiting] = {}  # req_id -> its SUBMIT
        self._done: list[tuple[str, Future]] = []
        self._answers: list[tuple[bytes, str, Future]] = []

    def start(self, msg: Submit, identity: bytes, owner: str, now: float) -> None:
        self.waiting[msg.req_id] = Waiting(msg, identity, owner, now)
        future = self.pool.submit(self.tokenize, msg)
        future.add_done_callback(lambda f, req_id=msg.req_id: self._finished(req_id, f))

    def _finished(self, req_id: str, future: Future) -> None:  # (on the tokenizer thread)
        self._done.append((req_id, future))  # (list.append is atomic under the GIL)
        os.write(self._wake, b"x")

    def answer(self, work: Callable[[], Any], identity: bytes, req_id: str) -> None:
        """A client's question that takes long (a TOKENIZE of a long text): ``work`` runs on the
        thread, and its answer comes out of ``answers``."""
        future = self.pool.submit(work)
        future.add_done_callback(lambda f: self._answered(identity, req_id, f))

    def _answered(self, identity: bytes, req_id: str, future: Future) -> None:  # (on the tokenizer thread)
        self._answers.append((identity, req_id, future))
        os.write(self._wake, b"x")

    def answers(self) -> list[tuple[bytes, str, Any]]:
        """The questions answered since the last call (after ``ready``, which reads the wake-up):
        who asked, under which id, and the answer or its refusal."""
        done, self._answers = self._answers, []
        return [(identity, req_id, _outcome(future)) for identity, req_id, future in done]

    def ready(self) -> list[tuple[Waiting, list[int] | ProtocolError]]:
        """The prompts tokenized since the last call, each with its token ids or its refusal."""
        try:
            os.read(self.fd, 4096)
        except BlockingIOError:
            pass
        done, self._done = self._done, []
        return [(self.waiting.pop(req_id), _outcome(future)) for req_id, future in done]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        os.close(self.fd)
        os.close(self._wake)


def _outcome(future: Future) -> Any:  # noqa: ANN401
    """A finished future's result, or its ``ProtocolError`` (a tokenizer bug becomes one: it costs
    that request, never the broker)."""
    try:
        return future.result()
    except ProtocolError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001
        return ProtocolError("internal", f"tokenizing failed: {type(exc).__name__}: {exc}"[:300])


def tokenize_chars(msg: Tokenize) -> int:
    """How much text a TOKENIZE asks the broker to make or read (given ids count 4 characters each)."""
    if msg.messages is not None:
        return sum(len(str(m.get("content", ""))) for m in msg.messages if isinstance(m, dict))
    return len(msg.prompt) if msg.prompt is not None else 4 * len(msg.token_ids)
