"""The messages of the broker's tokenizer at work for a client (``/tokenize``, ``/detokenize``).

Part of the wire schema (``nebula_flow/protocol.py``, which lists every kind)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nebula_flow.wire import Msg, Tensor, check_req_id, malformed


@dataclass
class Tokenize(Msg):
    """Client -> broker: the broker's tokenizer at work, nothing run (the HTTP API's ``/tokenize`` and
    ``/detokenize``). Exactly one of: ``prompt``, text, its ids as a SUBMIT's prompt would be with ``special``
    (the tokenizer's special tokens added); ``messages``, a conversation through the chat template as a SUBMIT's
    (``chat_options``: the template's variables and ``tokenizer.RENDER_OPTIONS``), ``special`` added to the
    template's text; ``token_ids``, turned back into text, special tokens kept. ``pieces``: each id's piece of the vocabulary
    too. Answered with ``Tokenized`` (or an ``Error``) under the client's ``req_id``."""

    KIND: ClassVar[str] = "TOKENIZE"
    req_id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    chat_options: dict | None = None
    token_ids: Tensor | None = None
    special: bool = True
    pieces: bool = False

    def check(self) -> None:
        check_req_id(self.req_id)
        if sum(x is not None for x in (self.prompt, self.messages, self.token_ids)) != 1:
            raise malformed("give exactly one of prompt, messages and token_ids")
        if self.token_ids is not None and (self.token_ids.ndim != 1 or self.token_ids.dtype.kind != "i"):
            raise malformed("token_ids must be a 1-d integer tensor")


@dataclass
class Tokenized(Msg):
    """Broker -> client: a ``Tokenize``'s answer: the ``token_ids`` (of a text; or those given), the ``text`` (of
    given ids), each id's vocabulary piece where asked, and the model's context (``max_model_len``)."""

    KIND: ClassVar[str] = "TOKENIZED"
    req_id: str
    token_ids: Tensor
    max_model_len: int
    text: str | None = None
    pieces: list[str] | None = None
