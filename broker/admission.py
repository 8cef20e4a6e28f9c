"""Admission: a SUBMIT becomes a ``Request`` (validated, tokenized) or a clear refusal; and the
request's text as it grows, with stop strings applied.

The broker's dispatch thread does this work, but for long prompts and structured outputs whose
grammar is new (``slow``), which ``tokenizing`` prepares on a thread of its own; it owns the
target's tokenizer (no torch).
"""

from __future__ import annotations

import secrets
from dataclasses import replace

import numpy as np

from nebula_flow import structured
from nebula_flow.config import ConfigError
from nebula_flow.models.config import ModelConfig
from nebula_flow.models.identity import differences, fingerprint
from nebula_flow.params import InvalidParams, SamplingParams
from nebula_flow.protocol import ProtocolError, Submit, Tokenize, Tokenized
from nebula_flow.request import Request
from nebula_flow.tokenizer import TextCodec, eos_token_ids
from nebula_flow_broker.tokenizing import INLINE_CHARS, prompt_chars


class Admission:
    """What the broker knows of the target model: tokenizer, EOS ids, context, vocabulary."""

    def __init__(self, model: str | None, max_new_tokens_limit: int, priorities: bool = False,
                 max_model_len: int | None = None) -> None:
        """``max_model_len``: the context served (prompt and output), at most the model's; None: the model's."""
        self.model, self.fingerprint = model, fingerprint(model) if model else None
        self.codec = TextCodec(model) if model else None
        self.eos_ids = eos_token_ids(model, self.codec) if model else ()
        facts = ModelConfig.from_dir(model) if model else None
        self.max_model_len = facts.max_position_embeddings if facts else 1 << 30
        if max_model_len is not None and max_model_len > self.max_model_len:
            raise ConfigError(f"max_model_len {max_model_len} exceeds the model's context ({self.max_model_len} "
                              f"positions: max_position_embeddings of {model})")
        self.max_model_len = max_model_len or self.max_model_len
        self.vocab_size = facts.vocab_size if facts else None
        self.max_new_tokens_limit = max_new_tokens_limit
        self.priorities = priorities  # (the policy's priority_scheduling: else a priority other than 0 is refused)
        self._token_texts: dict[int, str] = {}  # (logprobs: each token's text, decoded once)

    def check_verifier(self, role: str, facts: dict, others: list[dict]) -> None:
        """A worker that verifies must run this broker's target, or the output is no longer the
        target's own (``models/identity.py``): else ``ProtocolError`` ``wrong_model``. A worker
        with no fingerprint (an emulated device: no model files) has nothing to compare. And it must
        compute as the other verifiers (``others``: the registered workers' ``served`` facts) do, in
        the same dtype, batch invariance and kind of device, or a request's output would depend on
        which worker verified its rounds: else ``wrong_numerics``."""
        if role == "draft" or "fingerprint" not in facts:
            return
        if self.fingerprint is not None and (differ := differences(self.fingerprint, facts["fingerprint"])):
            raise ProtocolError("wrong_model", f"this worker's target ({str(facts.get('path'))[:200]}) is not the "
                                f"broker's ({self.model}): their {' and '.join(differ)} differ, and its verifies "
                                "would change the output")
        theirs = {other["numerics"] for other in others if "numerics" in other}  # (one, as each was checked so)
        if theirs and (numerics := facts.get("numerics")) not in theirs:
            raise ProtocolError("wrong_numerics", f"this worker verifies in {str(numerics)[:100]}, the deployment's "
                                f"other verifiers in {' and '.join(sorted(theirs))}: a request's output would depend on "
                                "which worker verified it; start it with the others' --dtype, --batch-invariant and "
                                "--device")

    def tokenize(self, msg: Submit, unlocked: bool = False) -> list[int]:
        """A SUBMIT's prompt as token ids, or ``ProtocolError`` saying what is wrong with it.
        ``unlocked``: let other threads run meanwhile (``TextCodec.encode``)."""
        if msg.prompt is not None or msg.messages is not None:
            if self.codec is None:
                raise ProtocolError("no_tokenizer", "this broker has no tokenizer; send prompt_tokens")
            try:
                prompt = (self.codec.encode(msg.prompt, chat=msg.chat, unlocked=unlocked) if msg.messages is None
                          else self.codec.encode_chat(msg.messages, msg.chat_options, unlocked=unlocked))
            except ValueError as exc:
                raise ProtocolError("invalid_prompt", str(exc)) from None
        else:
            prompt = self._known(msg.prompt_tokens).tolist()
        if not prompt:
            raise ProtocolError("invalid_prompt", "the prompt is empty")
        return prompt

    def _known(self, ids: np.ndarray) -> np.ndarray:
        """``ids``, or ``ProtocolError`` where one is outside the vocabulary."""
        if self.vocab_size is not None and len(ids) and not 0 <= ids.min() <= ids.max() < self.vocab_size:
            raise ProtocolError("invalid_prompt", f"token ids must be in [0, {self.vocab_size})")
        return ids

    def answer(self, msg: Tokenize, unlocked: bool = False) -> Tokenized:
        """A TOKENIZE's answer (``ProtocolError`` where it cannot be given): a text's ids, as a
        SUBMIT's prompt would be tokenized, or given ids' text. ``unlocked``: as ``tokenize``."""
        if self.codec is None:
            raise ProtocolError("no_tokenizer", "this broker has no tokenizer")
        text = None
        if msg.token_ids is not None:
            ids = self._known(msg.token_ids).tolist()
            text = self.codec.decode(ids, skip_special=False)
        else:
            try:
                ids = (self.codec.encode(msg.prompt, special=msg.special, unlocked=unlocked) if msg.prompt is not None
                       else self.codec.encode_chat(msg.messages, msg.chat_options, unlocked, msg.special))
            except ValueError as exc:
                raise ProtocolError("invalid_prompt", str(exc)) from None
        pieces = [self.codec.tok.id_to_token(i) or "" for i in ids] if msg.pieces else None
        return Tokenized(msg.req_id, np.asarray(ids, dtype=np.int32), self.max_model_len, text, pieces)

    def params(self, msg: Submit, grammar: bool = True) -> SamplingParams:
        """A SUBMIT's sampling parameters, validated (``ProtocolError`` otherwise); ``grammar``:
        a structured output's grammar compiled too (else its shape checked)."""
        try:
            params = SamplingParams.from_wire(msg.params, grammar)
            params.validate(self.max_new_tokens_limit, grammar)
        except (InvalidParams, TypeError) as exc:
            raise ProtocolError("invalid_params", str(exc)) from None
        if params.priority and not self.priorities:  # (vLLM's answer too: silently ignoring it would mislead)
            raise ProtocolError("invalid_params", "priority must be 0: this broker schedules by arrival "
                                                  "(priority scheduling is off: [policy] priority_scheduling)")
        if params.logit_bias and self.vocab_size is not None and max(params.logit_bias) >= self.vocab_size:
            raise ProtocolError("invalid_params", f"logit_bias's token ids must be below {self.vocab_size}")
        if params.allowed_token_ids and self.vocab_size is not None and max(params.allowed_token_ids) >= self.vocab_size:
            raise ProtocolError("invalid_params", f"allowed_token_ids must be below {self.vocab_size}")
        if params.bad_words:
            params = replace(params, bad_words=(), bad_word_ids=(*params.bad_word_ids, *self.spellings(params.bad_words)))
        return params

    def spellings(self, words: tuple[str, ...]) -> list[tuple[int, ...]]:
        """The token sequences that write each of ``words`` (vLLM's rule): the word as written (its
        leading spaces dropped), and after a space where that is a sequence of the same length whose
        first token differs (the word mid-text, as most BPE vocabularies spell it)."""
        if self.codec is None:
            raise ProtocolError("no_tokenizer", "this broker has no tokenizer; send bad_word_ids")
        out: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(self.codec.encode(word.lstrip(), special=False))
            spaced = tuple(self.codec.encode(" " + word.lstrip(), special=False))
            if bare:  # (a word the vocabulary writes with no token bars nothing)
                out += [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
        return out

    def prediction(self, msg: Submit, unlocked: bool = False) -> np.ndarray | None:
        """A SUBMIT's prediction of its output as int32 token ids (None: it gives none), or
        ``ProtocolError``. Text is tokenized as the output would be: no special tokens added."""
        if msg.prediction is not None:
            if self.codec is None:
                raise ProtocolError("no_tokenizer", "this broker has no tokenizer; send prediction_tokens")
            return np.asarray(self.codec.encode(msg.prediction, chat=False, unlocked=unlocked, special=False),
                              dtype=np.int32)
        ids = msg.prediction_tokens
        if ids is None:
            return None
        if len(ids) and (ids.min() < 0 or self.vocab_size is not None and ids.max() >= self.vocab_size):
            raise ProtocolError("invalid_prediction", f"prediction token ids must be in [0, {self.vocab_size or 'the vocabulary'})")
        return ids.astype(np.int32, copy=False)

    def prepare(self, msg: Submit) -> list[int]:
        """The work a SUBMIT asks of the tokenizer thread (``tokenizing``): its grammar compiled, if
        new, its prompt tokenized, and a prediction given as text turned into ``prediction_tokens``;
        ``ProtocolError`` for any of them."""
        self.params(msg)
        prompt = self.tokenize(msg, unlocked=True)
        if msg.prediction is not None:
            msg.prediction_tokens, msg.prediction = self.prediction(msg, unlocked=True), None
        return prompt

    def slow(self, msg: Submit) -> bool:
        """Whether a SUBMIT's work belongs on the tokenizer thread: a long prompt (to a tokenizer
        this broker has), or a structured output whose grammar it has not compiled yet."""
        spec = msg.params.get("structured") if isinstance(msg.params, dict) else None
        return (prompt_chars(msg) > INLINE_CHARS and self.codec is not None) or (
            spec is not None and not structured.compiled(spec))

    def request(self, rid: int, msg: Submit, owner: bytes, now: float, prompt: list[int] | None = None) -> Request:
        """The request a SUBMIT asks for, or ``ProtocolError`` saying what is wrong with it.
        ``prompt``: its token ids when tokenized already (``tokenize``)."""
        params = self.params(msg)
        prompt = self.tokenize(msg) if prompt is None else prompt
        if params.truncate_prompt_tokens is not None:  # (vLLM's: the prompt's end, what a continuation depends on most)
            prompt = prompt[-params.truncate_prompt_tokens:]
        if params.fit_context and len(prompt) < self.max_model_len:
            params = replace(params, max_new_tokens=min(params.max_new_tokens, self.max_model_len - len(prompt)))
        if len(prompt) + params.max_new_tokens > self.max_model_len:
            raise ProtocolError("too_long", f"prompt ({len(prompt)} tokens) + max_new_tokens "
                                            f"({params.max_new_tokens}) exceeds the context ({self.max_model_len})")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        prediction = self.prediction(msg)
        if prediction is not None and not len(prediction):  # (an empty prediction predicts nothing)
            prediction = None
        if prediction is not None and len(prediction) > self.max_model_len:  # (it guesses an output: one that fits)
            raise ProtocolError("invalid_prediction", f"the prediction ({len(prediction)} tokens) is longer than "
                                                      f"the context ({self.max_model_len})")
        req = Request(rid, msg.req_id, prompt, params, seed, owner=owner, t_submit=now, prediction=prediction)
        if msg.resume_tokens is not None and len(msg.resume_tokens):
            req.output = self.resumed(msg.resume_tokens, params)
        if params.prompt_logprobs is not None:  # (the first token's is null: nothing predicts it)
            req.prompt_logprobs = [[prompt[0], self.token_text(prompt[0]), None, [], None]]
        if params.min_tokens:  # (the ids that would end it early, which its verifies must not pick)
            req.suppress = sorted({*(() if params.ignore_eos else self.eos_ids), *params.stop_token_ids})
            if params.allowed_token_ids is not None and set(params.allowed_token_ids) <= set(req.suppress):
                raise ProtocolError("invalid_params", "allowed_token_ids holds only ids that end the output, "
                                                      "and min_tokens asks for more tokens than that")
        return req

    def resumed(self, ids: np.ndarray, params: SamplingParams) -> list[int]:
        """A resend's ``resume_tokens`` (``Submit``): the output its run continues after, checked."""
        if len(ids) >= params.max_new_tokens:
            raise ProtocolError("invalid_params", f"resume_tokens holds {len(ids)} tokens: a resumed request needs "
                                                  f"fewer than max_new_tokens ({params.max_new_tokens})")
        resumed = ids.tolist()
        if self.vocab_size is not None and not 0 <= min(resumed) <= max(resumed) < self.vocab_size:
            raise ProtocolError("invalid_params", f"resume_tokens holds token ids outside the vocabulary "
                                                  f"[0, {self.vocab_size})")
        return resumed

    def stop_text(self, req: Request) -> bool:
        """Extend ``req.text`` with what its new tokens decode to (only those are decoded), cut
        before its first stop string; says whether one was found. Text ending in a partial UTF-8
        character waits for the next round, but stop strings are looked for in it already. A stop
        string can only begin in the last ``len(stop) - 1`` characters of the text before, or after
        them, so only that window is searched."""
        if self.codec is None:
            return False
        if req.detok is None:
            req.detok = self.codec.incremental(req.params.skip_special_tokens)
        final, pending = req.detok.extend(self.shown(req))
        text = req.text + final
        if req.params.stop and (final or pending) and len(req.output) >= req.params.min_tokens:
            start = max(0, len(req.text) - max(map(len, req.params.stop)) + 1)
            window, hit = apply_stop((text + pending)[start:], req.params.stop, req.params.include_stop_str_in_output)
            if hit:
                req.text = text[:start] + window
                self._end_at_stop(req)
                return True
        req.text = text
        return False

    def _end_at_stop(self, req: Request) -> None:
        """The output ends with the token that completes the stop string, as decoding one token at a
        time ends it (vLLM's too): a round may have committed more, but how many depends on how the
        rounds fell, and the token ids (and their count, in the usage) must not. Only this round's
        tokens can complete it (earlier rounds were searched), and none before ``min_tokens``."""
        p = req.params
        for n in range(max(p.min_tokens, len(req.output) - req.tokens_per_round[-1] + 1), len(req.output)):
            if apply_stop(self.codec.decode(req.output[:n], p.skip_special_tokens), p.stop)[1]:
                req.cut(n)
                return

    def release(self, req: Request) -> tuple[str, int]:
        """The text to stream after a round, and the character it starts at: what is new, less a
        tail that may be the beginning of a stop string (were the string completed next round, the
        text would be cut before it, and what went out could not be taken back; vLLM holds it back
        too). A finished request's text goes out whole."""
        end = len(req.text)
        if req.params.stop and req.finish_reason is None:
            end -= stop_prefix(req.text, req.params.stop)
        at = req.sent
        req.sent = max(at, end)
        return req.text[at:end], at

    def token_text(self, token: int) -> str:
        """One token's text, decoded alone (special tokens too): what logprobs name it by."""
        text = self._token_texts.get(token)
        if text is None:
            text = self.codec.decode([token], skip_special=False) if self.codec else ""
            self._token_texts[token] = text
        return text

    def logprob_entries(self, kept: list[int], lp: np.ndarray, ids: np.ndarray) -> list[list]:
        """``protocol.Tokens.logprobs`` for the ``kept`` tokens of a verify: each one's id, text and
        log-probability, and the top tokens' (rows of ``results.logprobs``)."""
        text = self.token_text
        return [[t, text(t), row[0], [[i, text(i), v] for i, v in zip(top, row[1:])]]
                for t, row, top in zip(kept, lp[:len(kept)].tolist(), ids[:len(kept)].tolist())]

    def prompt_text(self, req: Request) -> str:
        """The prompt's text, special tokens too (``SamplingParams.echo``)."""
        return self.codec.decode(req.prompt, skip_special=False) if self.codec else ""

    def final_text(self, req: Request) -> str:
        p = req.params
        return apply_stop(self.codec.decode(self.shown(req), p.skip_special_tokens), p.stop,
                          p.include_stop_str_in_output)[0] if self.codec else ""

    def shown(self, req: Request) -> list[int]:
        """The output tokens its text shows: all but a stop token id or EOS that ended it (as vLLM:
        the id is in the output, its text is not, unless ``include_stop_str_in_output``; an EOS's
        text only shows where special tokens are not skipped)."""
        out, p = req.output, req.params
        if req.finish_reason == "stop" and out and not p.include_stop_str_in_output and (
                out[-1] in p.stop_token_ids or not p.ignore_eos and out[-1] in self.eos_ids):
            return out[:-1]
        return out


def stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest tail of ``text`` that begins a stop string (0: none). Such a tail
    starts with the string's first character: only those places in the last ``len(s) - 1``
    characters are tried (usually none, one ``find`` per stop string)."""
    longest = 0
    for s in stops:
        window = text[max(0, len(text) - len(s) + 1):] if len(s) > 1 else ""
        at = window.find(s[0])
        while at >= 0 and not s.startswith(window[at:]):
            at = window.find(s[0], at + 1)
        if at >= 0:
            longest = max(longest, len(window) - at)
    return longest


def apply_stop(text: str, stops: tuple[str, ...], include: bool = False) -> tuple[str, bool]:
    """Cut ``text`` before the earliest stop string (after it where ``include``); says whether one was found."""
    cuts = [(at, len(s)) for s, at in ((s, text.find(s)) for s in stops) if at >= 0]
    if not cuts:
        return text, False
    at, n = min(cuts, key=lambda c: c[0])
    return text[:at + n if include else at], True
