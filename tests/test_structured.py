"""Structured outputs: specs and their errors, the worker's grammar matchers, the masks a verify
row and a draft step get, and the API's and CLI's ways to ask (end to end: test_e2e_lossless.py,
test_api.py)."""

from __future__ import annotations

import json

import click
import llguidance
import numpy as np
import pytest
import torch

from nebula_flow import structured
from nebula_flow.api.errors import ApiError
from nebula_flow.api.request import Served, parse_chat, parse_completion
from nebula_flow.cli.common import structured_option
from nebula_flow.params import InvalidParams, SamplingParams
from nebula_flow.penalties import Penalties
from nebula_flow_workers.draft_rules import DraftRules
from nebula_flow_workers.guides import Guide, Guides
from nebula_flow_workers.runner import Task
from tests.conftest import tiny_config_file

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
EOS = 0  # the tiny pair's


@pytest.mark.parametrize("spec", [{"json": SCHEMA}, {"json": json.dumps(SCHEMA)}, {"json_object": True},
                                  {"regex": "[0-9]{2}-[a-z]+"}, {"choice": ["yes", "no", 'say "hi"']},
                                  {"grammar": 'start: "a" b\nb: "x" | "y"'}])
def test_every_kind_compiles(spec: dict) -> None:
    assert structured.grammar(spec)
    assert SamplingParams(structured=spec).penalized  # (every verify row is masked, like a penalty)


@pytest.mark.parametrize(("spec", "says"), [
    ({"regex": "[a-"}, "unclosed character class"),
    ({"json": {"type": "objectx"}}, "objectx"),
    ({"json": "{not json"}, "JSON schema"),
    ({"json": [1]}, "JSON schema"),
    ({"grammar": "start: foo"}, "unknown name"),
    ({"choice": []}, "choice must be"),
    ({"choice": ["a", 3]}, "choice must be"),
    ({"json_object": False}, "json_object must be true"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"xml": "a"}, "exactly one of"),
    ("json", "exactly one of"),
    ({"regex": "a" * (structured.MAX_SPEC_CHARS + 1)}, "at most"),
])
def test_bad_specs_are_clear_errors(spec: object, says: str) -> None:
    with pytest.raises(structured.InvalidStructure, match=None) as err:
        structured.grammar(spec)
    assert says in str(err.value)
    with pytest.raises(InvalidParams):  # (where a request enters: the broker, the client library)
        SamplingParams.from_wire({"structured": spec})


def test_a_grammar_cannot_ignore_eos() -> None:
    with pytest.raises(InvalidParams, match="cannot ignore EOS"):
        SamplingParams.from_wire({"structured": {"regex": "a+"}, "ignore_eos": True})
    params = SamplingParams.from_wire({"structured": {"regex": "a+"}})
    assert SamplingParams.from_wire(params.to_wire()) == params


@pytest.fixture(scope="module")
def guides(tiny_pair) -> Guides:  # noqa: ANN001
    return Guides.of(tiny_pair / "target", 512)


def _ids(guides: Guides, text: str) -> list[int]:
    return guides._llg_tokenizer().tokenize_str(text)


def _fresh_mask(guides: Guides, spec: dict, output: list[int]) -> torch.Tensor:
    """llguidance's own mask after ``output``, from a new matcher."""
    m = llguidance.LLMatcher(guides._llg_tokenizer(), structured.grammar(spec))
    assert m.consume_tokens(output)
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:512]
    return torch.from_numpy(bits.astype(bool))


def test_a_guide_follows_the_output_as_it_grows_and_is_cut_back(guides) -> None:  # noqa: ANN001
    spec = {"json": SCHEMA}
    params = SamplingParams(structured=spec)
    text = _ids(guides, '{"n":12345}')
    for output in (text[:2], text[:5], text[:3], text[:6], text[:1], text[:4]):  # (grows, is cut back, grows)
        guide = guides.guide(7, params, output)
        assert torch.equal(guide.allowed([]), _fresh_mask(guides, spec, output))
        assert torch.equal(guide.allowed(text[len(output):len(output) + 2]), _fresh_mask(guides, spec, text[:len(output) + 2]))
        assert torch.equal(guide.allowed([]), _fresh_mask(guides, spec, output))  # (a row's path is rolled back)
    done = guides.guide(7, params, text)
    assert done.allowed([]).nonzero().flatten().tolist() == [EOS]  # (complete: only EOS)
    assert done.allowed([EOS, 5]).nonzero().flatten().tolist() == [EOS]  # (past its end: never output)
    with pytest.raises(ValueError, match="breaks the grammar"):
        guides.guide(7, params, text[:1]).allowed(_ids(guides, "x"))
    with pytest.raises(ValueError, match="breaks its grammar"):
        guides.guide(8, params, _ids(guides, "nope"))
    a, b = (guides.guide(9, params, text[:n], own=True) for n in (2, 5))  # (a request's two branches at once)
    assert torch.equal(a.allowed([]), _fresh_mask(guides, spec, text[:2]))
    assert torch.equal(b.allowed([]), _fresh_mask(guides, spec, text[:5]))
    other = guides.guide(7, SamplingParams(structured={"choice": ["ab"]}), [])  # (another grammar: a new matcher)
    assert torch.equal(other.allowed([]), _fresh_mask(guides, {"choice": ["ab"]}, []))


def test_a_grammar_the_vocabulary_cannot_continue_ends_the_output() -> None:
    class DeadEnd:  # (a matcher whose mask allows nothing)
        def try_consume_tokens(self, path: list[int]) -> int:
            return len(path)

        def is_stopped(self) -> bool:
            return False

        def compute_bitmask(self) -> bytes:
            return bytes(64)

        def rollback(self, n: int) -> bool:
            return True

    assert Guide(DeadEnd(), 512, [EOS]).allowed([3]).nonzero().flatten().tolist() == [EOS]


def test_a_verify_row_is_masked_and_a_complete_grammar_beats_min_tokens(guides) -> None:  # noqa: ANN001
    params = SamplingParams(structured={"choice": ["ab"]}, min_tokens=10)
    text = _ids(guides, "ab")
    logits = torch.randn(512)
    start = Penalties(params, np.array([1, 2, *text[:1]]), 2, [EOS], guides.guide(3, params, text[:1]))
    row = start.row(logits, [])
    allowed = _fresh_mask(guides, params.structured, text[:1])
    assert torch.isinf(row[~allowed]).all() and torch.equal(row[allowed], logits.double()[allowed])
    assert start.row(logits, text[1:]).isfinite().nonzero().flatten().tolist() == [EOS]  # (EOS, though short)


def test_draft_steps_are_masked_per_structured_task(guides) -> None:  # noqa: ANN001
    spec = {"regex": "[0-9]+"}
    free, bound = (Task(rid, "draft", 0, 0, np.array([1, 2, 3]), 3, p, 0, prompt_len=3)
                   for rid, p in ((1, SamplingParams()), (2, SamplingParams(structured=spec))))
    masks = DraftRules.of(guides, [free, bound], None, 512)
    logits = torch.zeros(2, 512)
    masks.apply(logits, [0, 1])
    assert logits[0].isfinite().all() and torch.equal(logits[1].isfinite(), _fresh_mask(guides, spec, []))
    digit = _ids(guides, "7")
    masks.picked(torch.tensor([5, digit[0]]), [0, 1])
    assert masks.paths == {1: digit}
    assert DraftRules.of(guides, [free], None, 512) is None
    unguided = DraftRules.of(None, [bound], None, 512)  # (no tokenizer here: the other rules only)
    logits = torch.zeros(1, 512)
    unguided.apply(logits, [0])
    assert logits.isfinite().all()


def test_draft_steps_follow_the_logit_bias_and_penalties(guides) -> None:  # noqa: ANN001
    """A draft row is made as the verify row at that position: bias, then penalties on the draft so far."""
    params = SamplingParams(logit_bias={5: 3.0}, presence_penalty=2.0)
    task = Task(1, "draft", 0, 0, np.array([1, 2, 3]), 3, params, 0, prompt_len=2)
    rules = DraftRules.of(None, [task], None, 512)
    logits = torch.zeros(1, 512)
    logits[0, 9] = 2.5
    rules.apply(logits, [0])
    assert int(logits[0].argmax()) == 5 and logits[0, 3] == -2.0  # (3 is in the output: presence)
    rules.picked(torch.tensor([5]), [0])
    logits = torch.zeros(1, 512)
    logits[0, 9] = 2.5
    rules.apply(logits, [0])
    assert int(logits[0].argmax()) == 9  # (5 is in the draft's path now: 3 - 2 < 2.5)


def test_a_reduced_draft_head_takes_a_forced_token_or_ends_the_draft(guides) -> None:  # noqa: ANN001
    """A draft head of a subset of the vocabulary: masked by column; where it holds no token the
    grammar allows, a greedy draft takes the one token the grammar forces, a sampled one ends."""
    choice = {"choice": ["abc"]}  # (one answer: every token forced)
    forced = _ids(guides, "abc")
    columns = torch.tensor([t for t in range(512) if t != forced[0]])  # (the head lacks the first token)
    greedy, sampled = (Task(rid, "draft", 0, 0, np.array([1, 2]), 3, p, 0, prompt_len=2)
                       for rid, p in ((4, SamplingParams(structured=choice)),
                                      (5, SamplingParams(structured=choice, temperature=1.0))))
    masks = DraftRules.of(guides, [greedy, sampled], columns, 512)
    logits = torch.zeros(2, len(columns))
    masks.apply(logits, [0, 1])
    assert logits.isfinite().all()  # (neither row masked: no column allowed)
    picked = torch.tensor([7, 7])
    masks.picked(picked, [0, 1])
    assert picked[0] == forced[0] and masks.paths[0] == forced[:1] and masks.ends == {1: 0}
    assert masks.cut(1, [7, 8], [np.ones(1)] * 2, None) == ([], [], None) and masks.cut(0, [1, 2]) == ([1, 2],)
    if len(forced) > 1:  # (the next token is in the head: masked to it)
        logits = torch.zeros(1, len(columns))
        masks.apply(logits, [0])
        assert logits[0].isfinite().nonzero().flatten().tolist() == [(columns == forced[1]).nonzero().item()]


SERVED = Served("tiny")


@pytest.mark.parametrize(("extra", "spec"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
    ({"structured_outputs": {"choice": ["a", "b"], "json": None}}, {"choice": ["a", "b"]}),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
])
def test_the_api_reads_every_way_to_ask(extra: dict, spec: dict | None) -> None:
    chat = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}, SERVED)
    assert chat.params.get("structured") == spec
    completion = parse_completion({"model": "tiny", "prompt": "hi", **extra}, SERVED)
    assert completion.params.get("structured") == spec


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
])
def test_the_api_refuses_bad_structures_by_name(extra: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_completion({"model": "tiny", "prompt": "hi", **extra}, SERVED)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_cli_options(tmp_path) -> None:  # noqa: ANN001
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    assert structured_option(str(schema), False, None, (), None) == {"json": SCHEMA}
    assert structured_option(None, False, None, ("a", "b"), None) == {"choice": ["a", "b"]}
    assert structured_option(None, True, None, (), None) == {"json_object": True}
    assert structured_option(None, False, None, (), None) is None
    with pytest.raises(click.UsageError):
        structured_option(None, True, "a+", (), None)
    schema.write_text("{oops")
    with pytest.raises(click.BadParameter):
        structured_option(str(schema), False, None, (), None)
    from nebula_flow.cli.common import generate_from

    with pytest.raises(click.UsageError, match="think-first"):  # (refused before any connection)
        generate_from("tcp://127.0.0.1:9", "hi", False, json_schema=None, json_object=False, regex=None, choice=(),
                      grammar=None, think_first=True, timeout_s=1.0)


@pytest.mark.slow
def test_bench_runs_json_schema_requests(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """``bench --json-schema``: chat requests for JSON records bound to the schema, in each mode;
    speculation commits several tokens a round; the HF peers are refused (they follow no grammar)."""
    from click.testing import CliRunner

    from nebula_flow.cli import main

    cfg = tiny_config_file(tiny_pair, tmp_path)
    res = CliRunner().invoke(main, ["bench", "--config", str(cfg), "--modes", "pooled,autoregressive", "--json-schema",
                                    "configs/schemas/person.json", "--requests", "2", "--max-new-tokens", "40",
                                    "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    modes = json.loads(res.output.strip().splitlines()[-1])["modes"]
    assert modes["pooled"]["tokens_per_round"] > 1.2 and modes["autoregressive"]["tokens_per_round"] == 1.0
    refused = CliRunner().invoke(main, ["bench", "--modes", "pooled,hf", "--json-schema", "configs/schemas/person.json"])
    assert refused.exit_code != 0 and "cannot follow a JSON schema" in refused.output


def test_a_verify_that_breaks_one_requests_grammar_fails_that_request_alone(tiny_pair, guides) -> None:  # noqa: ANN001
    """A verify batch where one request's committed output breaks its grammar: that task fails
    (an error it carries, its cache back at its committed tokens), and the others in the batch
    commit what they commit verified alone."""
    from nebula_flow.models.loader import load_model
    from nebula_flow_workers.runner import ModelRunner

    model = load_model(tiny_pair / "target")
    prompt = np.arange(1, 12)
    bad_output = _ids(guides, "zz")  # (the grammar allows only digits)

    def tasks() -> list[Task]:
        return [Task(0, "verify", 1, 1, prompt, 2, SamplingParams(max_new_tokens=8), 0, draft=[5, 6]),
                Task(1, "verify", 1, 1, np.concatenate([prompt, bad_output]), 2,
                     SamplingParams(max_new_tokens=8, structured={"regex": "[0-9]+"}), 1, draft=[7, 8],
                     prompt_len=len(prompt))]

    batch = tasks()
    runner = ModelRunner(model, model_dir=str(tiny_pair / "target"))
    got = runner.verify(batch)
    assert got[0] == ModelRunner(model).verify(tasks()[:1])[0] and batch[0].error is None
    assert got[1] is None and batch[1].prefilled is None and "breaks its grammar" in batch[1].error
    assert runner.store.caches[1].length == len(batch[1].tokens)


@pytest.fixture(scope="module")
def thinking_guides(tiny_pair, tmp_path_factory) -> Guides:  # noqa: ANN001
    """The tiny tokenizer with a reasoning model's thinking markers added (ids 512 and 513)."""
    folder = tmp_path_factory.mktemp("thinking")
    spec = json.loads((tiny_pair / "target" / "tokenizer.json").read_text())
    spec["added_tokens"] += [{"id": 512 + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for i, text in enumerate(("<think>", "</think>"))]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return Guides(folder, 514, [EOS])


def test_a_reasoning_models_answer_begins_after_its_thinking(thinking_guides, guides) -> None:  # noqa: ANN001
    START, END, a, b = 512, 513, 40, 41  # noqa: N806
    begins = thinking_guides.answer_begins
    assert begins([7, 8], [START, a, b]) is None  # (thinking, nothing ended yet)
    assert begins([7, 8], []) is None  # (a model that thinks first: nothing bound before its </think>)
    assert begins([7, 8], [START, a, END, b]) == 3
    assert begins([7, START], [a, END, b]) == 2  # (the template opened the thinking)
    assert begins([7, START, END, 9], [a, b]) == 0  # (thinking turned off: the template closed it)
    assert begins([START, a, END, 7, START], [b]) is None  # (only the prompt's last thinking counts)
    assert guides.answer_begins([7], []) == 0  # (a tokenizer without the markers: bound from the start)


def test_a_think_first_grammar_binds_only_the_answer(thinking_guides) -> None:  # noqa: ANN001
    START, END = 512, 513  # noqa: N806
    params = SamplingParams(structured={"regex": "[0-9]+"}, think_first=True)
    digit = _ids(thinking_guides, "7")
    fresh = _fresh_mask(thinking_guides, params.structured, [])
    thinking = thinking_guides.guide(1, params, [START, 40], prompt=[7, 8])
    assert thinking.allowed([]).all() and thinking.allowed([41, 42]).all()  # (while thinking: anything)
    assert torch.equal(thinking.allowed([41, END])[:512], fresh)  # (a path that ends the thinking: bound after it)
    assert torch.equal(thinking.allowed([END, *digit])[:512], _fresh_mask(thinking_guides, params.structured, digit))
    answering = thinking_guides.guide(1, params, [START, 40, END, *digit], prompt=[7, 8])
    assert torch.equal(answering.allowed([])[:512], _fresh_mask(thinking_guides, params.structured, digit))
    plain = thinking_guides.guide(2, SamplingParams(structured={"regex": "[0-9]+"}), [], prompt=[7, 8])
    assert torch.equal(plain.allowed([])[:512], fresh) and not plain.allowed([])[START]  # (without it: bound at once)


def test_the_api_lets_a_reasoning_model_think_before_a_structured_answer() -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}
    assert parse_chat(body, Served("tiny", reasoning_parser="qwen3")).params["think_first"] is True
    assert "think_first" not in parse_chat(body, SERVED).params
    plain = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert "think_first" not in parse_chat(plain, Served("tiny", reasoning_parser="qwen3")).params
    assert SamplingParams.from_wire(SamplingParams(structured={"regex": "a+"}, think_first=True).to_wire()).think_first
    with pytest.raises(InvalidParams):
        SamplingParams.from_wire({"think_first": "yes"}).validate()
