"""The wire schema: every message that crosses a ZeroMQ socket, as a typed class.

A message is a multipart ZeroMQ message::

    [kind, header, *tensor frames]

``kind`` is the class's ``KIND``; ``header`` is an orjson object of the class's fields that always carries ``"v":
VERSION``; tensors (token ids, proposal distributions, KV rows) travel as extra frames sent and received without
copies, described in the header by ``{"f": frame index, "dtype", "shape"}``, except small integer vectors (token
ids), which share one frame per dtype, each a slice ``{"p": dtype, "o": offset, "n": length}`` of the frame the
header's ``"packs"`` names (one send and one view for all of a batch's tokens). ``decode`` turns frames into an
instance of the kind's class, checking every field against the class's annotations (and its ``check``) on the way:
decoding is the validation. Anything else raises ``ProtocolError`` (with a stable ``code``); receivers answer that
with an ``Error`` where there is a sender to answer, count it, and carry on. ``encode`` is the inverse. Unknown
header fields are ignored (a newer peer may send more).

Client <-> broker (client socket, DEALER -> ROUTER): ``Submit``, ``Cancel``, ``Status``, ``Tokenize`` from the client;
``Tokens`` (a stream chunk; several in one ``Chunks``), ``Done``, ``State``, ``Tokenized`` from the broker; ``Error``
either way. Worker <->
broker (worker socket, DEALER -> ROUTER): ``Register``, ``Pull``, ``Result`` (of ``TaskResult`` items), ``Bye`` from
a worker; ``Welcome``, ``Tasks`` (of ``TaskSpec`` items), ``Free`` from the broker; ``Heartbeat`` and ``Error``
either way. Worker <-> worker (KV server, ZeroMQ transport): ``KvPull`` and ``KvData``, defined in
``nebula_flow/kv/messages.py`` (the UCX transport carries the same fields as int64 arrays of sizes both sides know,
see ``nebula_flow/kv/ucx.py``). ``Msg``, every kind's base, is the codec's (``nebula_flow/wire.py``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from nebula_flow.kv.messages import MAX_PULL_ITEMS, KvData, KvPull, KvRows  # noqa: F401 - part of the schema
from nebula_flow.proposal import Proposes
from nebula_flow.round_times import Timing  # noqa: F401 - RESULT's timing: part of the schema
from nebula_flow.tokenize_messages import Tokenize, Tokenized  # noqa: F401 - part of the schema
from nebula_flow.wire import (  # noqa: F401 - the codec's names are part of this module's API
    HEADER_OPTIONS,
    MAX_REQ_ID,
    TOKENS_MISSING,
    Frames,
    Msg,
    ProtocolError,
    Rejected,
    Tensor,
    TokenIds,
    array,
    check_req_id,
    decode_fields,
    lacked_tokens,
    malformed,
    plain,
)

VERSION = 7  # 2: typed messages, runner-ups as "runner_ups"; 3: small integer tensors inline in the header; 4: CHUNKS;
# 5: a message's small integer tensors packed in one frame per dtype; 6: a task's tokens from its ``base`` on; 7: a
# SUBMIT's ``resume_tokens`` (a broker that ignored them, as unknown fields are, would start a resumed stream over)
DRAFTER_CHARS = "A-Za-z0-9._:-"  # what a REGISTER's drafter name may hold (1-64 of them)
DRAFTER_NAME = re.compile(f"[{DRAFTER_CHARS}]{{1,64}}")
DRAFTER_RULE = "1-64 letters, digits or . _ - :"  # (what DRAFTER_NAME takes, for error messages)
MAX_HEADER_BYTES = 1 << 20
MAX_CAPACITY = 4096  # tasks a worker may take in one batch
MAX_ALTERNATIVES = 8  # runner-ups to the first draft token
MAX_FUSED_CHAINS = 4  # fused chains in one round's token tree
MAX_DRAFT = 64  # tokens in a draft, and in a fused chain
AHEAD_GUESSES = 4  # draft-ahead: guesses of the bonus token (one fewer of a correction) a pre-draft may cover
MAX_AHEAD = 1 + (AHEAD_GUESSES - 1) * (MAX_DRAFT + 1)  # outcomes one pre-draft may cover (``ahead.outcome_plan``)
MAX_DECODE_STEPS = 64  # tokens one draft-less verify may decode (multi-step decoding, ``nebula_flow/steps.py``)
MAX_SUPPRESS = 128  # ids a task's min_tokens keeps from ending the output (EOS ids and stop token ids)
TASK_KINDS = ("draft", "verify", "round", "ahead")  # (ahead: pre-drafting the next round, draft-ahead)
KV_SCHEMES = ("tcp://", "ucx://", "shm://", "curve:")  # (curve: the KV server's public key, security.py)
# -- the messages ------------------------------------------------------------------------------
@dataclass
class Submit(Msg):
    """Client -> broker: a request. Exactly one of ``prompt`` (text; ``chat`` applies the tokenizer's chat template to
    it as one user message), ``prompt_tokens`` and ``messages`` (a conversation, ``{"role", "content"}`` objects,
    through the chat template with ``chat_options`` as the template's variables, e.g. ``{"enable_thinking":
    false}``). Idempotent: ``req_id`` is the client's (random, unique); resending a running request re-attaches to
    it, a finished one replays its ``Done`` (another request under its id is no resend: ``broker/intake.submitted``). Only its owner may do either, or cancel it: the client's CURVE key
    where keys are on, else the ``session`` it sends (a secret the client library draws per client). ``prediction``
    (text) or ``prediction_tokens``: what the client expects much of the output to be (OpenAI's Predicted Outputs,
    e.g. a file being edited): rounds look up draft chains in it as in the prompt; the output is the same with or
    without it, only quicker where it matches. ``resume_tokens``: on a resend only, the output the client has had
    so far (a sampled request without a seed, whose draws no resend repeats): a broker that runs the request anew
    (it restarted) continues after them; one that still runs it, or has its result, ignores them."""

    KIND: ClassVar[str] = "SUBMIT"
    req_id: str
    params: dict
    prompt: str | None = None
    prompt_tokens: Tensor | None = None
    chat: bool = False
    session: str | None = None
    messages: list[dict] | None = None
    chat_options: dict | None = None
    prediction: str | None = None
    prediction_tokens: Tensor | None = None
    resume_tokens: Tensor | None = None

    def check(self) -> None:
        check_req_id(self.req_id)
        check_session(self.session)
        if sum(x is not None for x in (self.prompt, self.prompt_tokens, self.messages)) != 1:
            raise malformed("give exactly one of prompt, prompt_tokens and messages")
        for name in ("prompt_tokens", "prediction_tokens", "resume_tokens"):
            ids = getattr(self, name)
            if ids is not None and (ids.ndim != 1 or ids.dtype.kind != "i"):
                raise malformed(f"{name} must be a 1-d integer tensor")
        if self.prediction is not None and self.prediction_tokens is not None:
            raise malformed("give at most one of prediction and prediction_tokens")


@dataclass
class Cancel(Msg):
    """Client -> broker: end a request (its KV is freed); by its owner only (see ``Submit``)."""

    KIND: ClassVar[str] = "CANCEL"
    req_id: str
    session: str | None = None

    def check(self) -> None:
        check_session(self.session)


@dataclass
class Status(Msg):
    """Client -> broker: ask for the broker's state (answered with ``State``)."""

    KIND: ClassVar[str] = "STATUS"


@dataclass
class Tokens(Msg):
    """Broker -> client: the tokens and text one verify committed (a stream chunk); ``offset`` = tokens committed
    before this chunk, ``text_offset`` = characters of text sent before it (a re-attached client gets everything
    again from 0; a request run again on a restarted broker may cut its rounds elsewhere: the offsets let a client
    pass on only what it has not seen). Asked for, before the first tokens, in messages without tokens: the prompt's
    ``prompt_text`` (``SamplingParams.echo``) and its token count ``prompt_tokens`` (``SamplingParams.prompt_count``),
    and its tokens' ``prompt_logprobs`` (as ``logprobs``, then its rank; position 0's logprob and rank null), the
    first at position ``prompt_offset``."""

    KIND: ClassVar[str] = "TOKENS"
    req_id: str
    token_ids: TokenIds
    text: str
    offset: int = 0
    text_offset: int = 0
    # asked for (``SamplingParams.logprobs``): per token [id, text, logprob, [[id, text, logprob], ...] most likely first]
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    prompt_offset: int = 0
    prompt_text: str | None = None
    prompt_tokens: int | None = None


@dataclass
class Chunks(Msg):
    """Broker -> client: the ``Tokens`` of a client's requests that advanced in one broker step, in
    one message (a client with many requests in flight, such as the HTTP gateway, gets one a step)."""

    KIND: ClassVar[str] = "CHUNKS"
    chunks: list[Tokens] = field(default_factory=list)


@dataclass
class Done(Msg):
    """Broker -> client: a finished request: all its tokens, text, finish reason and stats."""

    KIND: ClassVar[str] = "DONE"
    req_id: str
    token_ids: TokenIds
    text: str
    finish_reason: str
    stats: dict


@dataclass
class State(Msg):
    """Broker -> client: the answer to ``Status``, a JSON object of workers and counters."""

    KIND: ClassVar[str] = "STATE"
    state: dict


@dataclass
class Error(Msg):
    """Either way: ``code`` (stable), ``message``, and ``req_id`` when it concerns one request."""

    KIND: ClassVar[str] = "ERROR"
    code: str
    message: str
    req_id: str | None = None


@dataclass
class Register(Msg):
    """Worker -> broker: a worker joins: its role, name, batch capacity, model facts and KV endpoint; a draft worker's
    drafter (the kind of draft model rounds are routed by); its process id and how many times its deployment
    restarted it (both shown by ``status``); an elastic worker's (role ``any``) most tasks in a draft batch, where
    more than ``capacity``."""

    KIND: ClassVar[str] = "REGISTER"
    role: str
    name: str
    capacity: int
    model: dict
    kv_endpoint: str | None = None
    drafter: str | None = None
    pid: int | None = None
    restarts: int = 0
    draft_capacity: int | None = None

    def check(self) -> None:
        if not 1 <= self.capacity <= MAX_CAPACITY or not (self.draft_capacity is None or isinstance(
                self.draft_capacity, int) and 1 <= self.draft_capacity <= MAX_CAPACITY):
            raise ProtocolError("invalid_params", f"capacity and draft_capacity must be in 1..{MAX_CAPACITY}")
        if not (isinstance(self.restarts, int) and 0 <= self.restarts < 2**31) or not (
                self.pid is None or isinstance(self.pid, int) and 0 < self.pid < 2**31):
            raise malformed("pid and restarts must be small non-negative integers")
        if self.kv_endpoint is not None and (len(self.kv_endpoint) > 512 or not all(
                part.startswith(KV_SCHEMES) for part in self.kv_endpoint.split(";"))):
            raise malformed("kv_endpoint must be tcp://, ucx:// or shm:// addresses joined by ';'")
        if self.drafter is not None and not DRAFTER_NAME.fullmatch(self.drafter):
            raise malformed(f"drafter must be {DRAFTER_RULE}")


@dataclass
class Welcome(Msg):
    """Broker -> worker: registered: its id, slot (pair/colocated index), the mode, and settings (``proposal_top_k``,
    ``heartbeat_s``)."""

    KIND: ClassVar[str] = "WELCOME"
    worker_id: int
    slot: int
    mode: str
    settings: dict


@dataclass
class Pull(Msg):
    """Worker -> broker: room for ``credits`` tasks (0 withdraws a waiting pull); ``idle``: nothing is computing now."""

    KIND: ClassVar[str] = "PULL"
    credits: int
    idle: bool


@dataclass
class Holder:
    """Who holds a task's KV for its role: worker id, valid positions, KV endpoint; ``source``: the
    request whose KV there holds this one's first ``valid`` positions, where it is another's (its
    prompt's start: a prefix pull, ``nebula_flow/prefixes.py``), and ``source_prompt`` that request's prompt length
    (0: not known), since a worker that computes prompts in blocks pulls only positions of one form."""

    worker: int = 0
    valid: int = 0
    endpoint: str | None = None
    source: int | None = None
    source_prompt: int = 0


@dataclass
class TaskSpec(Proposes):
    """One request's round half. ``tokens``: its committed tokens (prompt + output), int32; ``holder``: who has the KV
    for the task's role; ``k``: draft tokens wanted. A token tree: ``alts`` (draft/round tasks) asks for that many
    runner-ups to the first draft token, ``runner_ups`` (verify tasks) carries them; ``fuse`` (draft/round tasks)
    asks for a prompt-lookup chain of up to that many tokens beside the draft, ``chains`` (verify tasks) carries the
    fused chains. ``draft`` and ``q_*``: a verify task's draft and, for a sampled request, its proposal.
    ``target_holder``: an elastic worker's round task's target KV (``holder``: its draft KV). ``prompt_len``: the
    request's prompt length (penalties count its output's tokens apart, ``nebula_flow/penalties.py``; a
    batch-invariant CPU model without runs computes prompt positions in blocks, ``models/rows.py``).

    ``tokens`` start at position ``base``: the worker was sent the first ``base`` in earlier tasks of the request,
    and ``base_crc`` is their CRC-32 (as int32 bytes), so it finds and checks them in its own book
    (``workers/token_book.py``); base 0: the whole sequence."""

    rid: int
    kind: str
    round: int
    attempt: int
    tokens: Tensor
    k: int
    params: dict
    seed: int
    holder: Holder
    draft: TokenIds = field(default_factory=list)
    q_idx: Tensor | None = None
    q_prob: Tensor | None = None
    q_len: list[int] | None = None
    alts: int = 0
    runner_ups: TokenIds = field(default_factory=list)
    fuse: int = 0
    chains: list[TokenIds] = field(default_factory=list)
    target_holder: Holder | None = None
    ahead: int = 0  # an ahead task (draft-ahead): pre-draft the next round for this many outcomes of draft's verify
    prompt_len: int = 0
    suppress: TokenIds = field(default_factory=list)  # min_tokens: ids the verify must not pick yet
    alone: bool = False  # no other stream of its broker's pool flowed: it prefills whole (``budget.prefills_whole``)
    steps: int = 1  # a draft-less verify (or round): the tokens it decodes, one forward each (``nebula_flow/steps.py``)
    base: int = 0  # the position ``tokens`` start at (the worker has those before from earlier tasks)
    base_crc: int = 0  # CRC-32 of the request's first ``base`` tokens as int32 bytes
    prediction: Tensor | None = None  # the client's prediction of the output (int32), with a task of base 0 only
    score_from: int = 0  # verify / round: the prompt's logprobs are wanted from this position (0: none)

    def check(self) -> None:
        if self.kind not in TASK_KINDS:
            raise malformed(f"unknown task kind {self.kind!r}")
        if self.tokens.ndim != 1 or self.tokens.dtype.kind != "i" or len(self.tokens) + self.base == 0 \
                or len(self.tokens) and self.tokens.min() < 0:
            raise malformed("task tokens must be a non-empty 1-d tensor of token ids")
        if self.base < 0 or not 0 <= self.base_crc < 1 << 32:
            raise malformed("base must be >= 0 and base_crc a CRC-32")
        if not 0 <= self.k <= MAX_DRAFT or len(self.draft) > MAX_DRAFT:
            raise malformed(f"k and draft length must be in 0..{MAX_DRAFT}")
        self.check_proposal()
        if not 0 <= self.alts <= MAX_ALTERNATIVES or len(self.runner_ups) > MAX_ALTERNATIVES:
            raise malformed(f"alts and runner_ups: at most {MAX_ALTERNATIVES} runner-ups")
        if self.runner_ups and (not self.draft or len(set(self.runner_ups) | {self.draft[0]}) != len(self.runner_ups) + 1):
            raise malformed("runner_ups must be distinct token ids other than draft[0], with a draft")
        if not 0 <= self.fuse <= MAX_DRAFT:
            raise malformed(f"fuse must be in 0..{MAX_DRAFT}")
        if len(self.chains) > MAX_FUSED_CHAINS or not all(0 < len(c) <= MAX_DRAFT for c in self.chains):
            raise malformed(f"chains must be at most {MAX_FUSED_CHAINS} lists of 1..{MAX_DRAFT} token ids")
        if not 0 <= self.ahead <= MAX_AHEAD or (self.ahead > 0) != (self.kind == "ahead"):  # (draft-ahead)
            raise malformed(f"ahead (1..{MAX_AHEAD} outcomes) is for ahead tasks, which need it")
        draft_less = not self.draft and not self.k and self.kind in ("verify", "round")
        if not 1 <= self.steps <= MAX_DECODE_STEPS or (self.steps > 1 and not draft_less):
            raise malformed(f"steps (1..{MAX_DECODE_STEPS}) above 1 are for a verify or round without a draft")
        if not 0 <= self.prompt_len <= self.base + len(self.tokens) or len(self.suppress) > MAX_SUPPRESS \
                or not 0 <= self.score_from <= self.prompt_len:
            raise malformed(f"prompt_len must be in 0..len(tokens), score_from in 0..prompt_len, suppress at most "
                            f"{MAX_SUPPRESS} ids")
        if self.prediction is not None and (self.base or self.prediction.ndim != 1 or self.prediction.dtype.kind != "i"
                                            or len(self.prediction) and self.prediction.min() < 0):
            raise malformed("a prediction is a 1-d tensor of token ids, with a task of base 0")


@dataclass
class Tasks(Msg):
    """Broker -> worker: a batch of draft / verify / round tasks. A task that fails to decode is
    a ``Rejected`` in its place (the worker fails that request alone)."""

    KIND: ClassVar[str] = "TASKS"
    tasks: list[TaskSpec] = field(default_factory=list, metadata={"isolate": True})


@dataclass
class TaskResult(Proposes):
    """A finished task: ``draft`` (+ its proposal ``q_*``) for a draft task; ``committed`` for a verify or round task
    (a round task's ``draft``: the draft it verified); ``runner_ups`` and ``chains``: the runner-ups and fused
    chains a draft or round task made (or a verify looked up itself); ``prefilled``: instead, the worker computed
    only a chunk of the task's uncached prompt (the policy's ``max_forward_tokens``) and now holds the KV of this
    many positions: the task comes back for the rest; ``error``: the task failed, and why; ``logprobs`` (float32
    [committed, 1 + top]) and ``logprob_ids`` (int32 [committed, top]): asked for, each committed token's log-
    probability and the top tokens' (``workers/logprobs.py``); ``prompt_logprobs`` and ``prompt_logprob_ids``: the
    same for the prompt's tokens the task scored, from position ``scored_from``, each token's rank (int32, 1: the
    most likely) in ``prompt_logprob_ranks``."""

    rid: int
    kind: str
    round: int
    attempt: int
    draft: TokenIds = field(default_factory=list)
    q_idx: Tensor | None = None
    q_prob: Tensor | None = None
    q_len: list[int] | None = None
    runner_ups: TokenIds = field(default_factory=list)
    chains: list[TokenIds] = field(default_factory=list)
    committed: TokenIds | None = None
    prefilled: int | None = None
    error: str | None = None
    assumes: TokenIds = field(default_factory=list)  # an ahead task's: one result per outcome (none: nothing made)
    logprobs: Tensor | None = None
    logprob_ids: Tensor | None = None
    cached: int = 0  # a verify or round task's positions copied from other requests' KV (prefix cache, kv/store.py)
    prompt_logprobs: Tensor | None = None
    prompt_logprob_ids: Tensor | None = None
    prompt_logprob_ranks: Tensor | None = None
    scored_from: int = 0

    def check(self) -> None:
        self.check_proposal()
        if self.cached < 0 or self.scored_from < 0:
            raise malformed("cached and scored_from are position counts >= 0")
        if len(self.assumes) > MAX_DRAFT + 1 or (self.assumes and self.kind != "ahead"):
            raise malformed(f"assumes (1..{MAX_DRAFT + 1} tokens) is for ahead results")
        if self.prefilled is not None and (self.prefilled < 0 or self.draft or self.committed is not None):
            raise malformed("a prefilled result is a position count >= 0 and carries no tokens")


@dataclass
class Result(Msg):
    """Worker -> broker: finished tasks and the forward time they took (``busy_s``); ``kv``: KV movement counters;
    ``device``: forwards, numerics, and ``step_costs`` (per role, forward seconds for one sequence by new rows [1,
    2, ...], null where not seen, at most once a second, which adaptive k weighs; malformed ones are counted and
    left out); ``timing``: where the batch's time went on the worker; ``idle``: nothing waits at the worker after
    this batch, so a PULL it left parked while computing now counts as an idle worker's (no second PULL to say so)."""

    KIND: ClassVar[str] = "RESULT"
    results: list[TaskResult] = field(default_factory=list, metadata={"isolate": True})
    busy_s: float = 0.0
    kv: dict | None = None
    device: dict | None = None
    timing: Timing | None = None
    idle: bool = False


@dataclass
class Free(Msg):
    """Broker -> worker: requests whose KV can be dropped (finished or cancelled)."""

    KIND: ClassVar[str] = "FREE"
    rids: list[int]


@dataclass
class Heartbeat(Msg):
    """Either way: liveness when nothing else is said."""

    KIND: ClassVar[str] = "HEARTBEAT"


@dataclass
class Bye(Msg):
    """Worker -> broker: the worker leaves; its in-flight tasks go back to their topic."""

    KIND: ClassVar[str] = "BYE"


KINDS: dict[str, type[Msg]] = {cls.KIND: cls for cls in (
    Submit, Cancel, Status, Tokenize, Tokenized, Tokens, Chunks, Done, State, Error, Register, Welcome, Pull, Tasks,
    Result, Free, Heartbeat, Bye, KvPull, KvData)}
# what only a client sends, and only a worker: either at the other's address is a process given the
# wrong one (``nebula-flow worker --broker`` at the client port), told so instead of answered in riddles
CLIENT_KINDS = frozenset(cls.KIND for cls in (Submit, Cancel, Status, Tokenize))
WORKER_KINDS = frozenset(cls.KIND for cls in (Register, Pull, Result, Heartbeat, Bye))


# -- decoding: the annotations are the schema ---------------------------------------------------
def decode(frames: list[Any]) -> Msg:
    """Parse and validate a multipart message (ROUTER identity frames already removed)."""
    if len(frames) < 2:
        raise malformed(f"expected at least 2 frames, got {len(frames)}")
    raw_kind, raw_header = (bytes(f.buffer if hasattr(f, "buffer") else f) for f in frames[:2])
    kind = raw_kind.decode("ascii", "replace")
    cls = KINDS.get(kind)
    if cls is None:
        raise ProtocolError("unknown_kind", f"unknown message kind {kind[:32]!r}")
    if len(raw_header) > MAX_HEADER_BYTES:
        raise ProtocolError("too_large", f"header of {len(raw_header)} bytes")
    try:
        header = orjson.loads(raw_header)
    except orjson.JSONDecodeError as exc:
        raise malformed(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise malformed("header must be a JSON object")
    if header.get("v") != VERSION:
        raise ProtocolError("bad_version", f"protocol version {header.get('v')!r}, expected {VERSION}")
    return decode_fields(cls, header, kind, Frames.received(header, frames[2:]))


def check_session(session: str | None) -> None:
    if session is not None and not (isinstance(session, str) and 16 <= len(session) <= 128):
        raise malformed("session must be a string of 16 to 128 characters")


# -- encoding ------------------------------------------------------------------------------------
def encode(msg: Msg) -> list[Any]:
    """The frames of ``msg``: kind, header, then each tensor field's array (not copied)."""
    frames = Frames()
    header = plain(msg, frames)
    header["v"] = VERSION
    frames.close(header)
    return [msg.KIND.encode(), orjson.dumps(header, option=HEADER_OPTIONS), *frames]

