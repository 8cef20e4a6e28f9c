"""What the client library sends again (``nebula_flow/resume.py``): a sampled request without a
seed resumes after the tokens its caller has had; greedy and seeded requests go as they were."""

from __future__ import annotations

from nebula_flow.client import build_submit
from nebula_flow.outputs import Collector
from nebula_flow.protocol import Tokens
from nebula_flow.resume import resend, seeded


def _had(*token_ids: int) -> Collector:
    col = Collector()
    col.chunk(Tokens("r", list(token_ids), "x" * len(token_ids), 0, 0))
    col.chunk(Tokens("r", list(token_ids), "x" * len(token_ids), 0, 0))  # (a re-attach's replay: not had twice)
    return col


def test_only_a_sampled_request_without_a_seed_resumes_after_what_it_had() -> None:
    sampled = build_submit("r", None, [1, 2], False, temperature=0.8, max_new_tokens=9)
    again = resend(sampled, _had(4, 5, 6))
    assert again.resume_tokens.tolist() == [4, 5, 6] and again.prompt_tokens.tolist() == [1, 2]
    assert again.params == sampled.params and sampled.resume_tokens is None  # (the first send is left as it was)
    assert resend(sampled, Collector()) is sampled and resend(sampled, None) is sampled  # (nothing had yet)
    for same in (build_submit("r", None, [1, 2], False, max_new_tokens=9),
                 build_submit("r", None, [1, 2], False, temperature=0.8, seed=3, max_new_tokens=9)):
        assert resend(same, _had(4, 5, 6)) is same  # (greedy and seeded output comes out the same again)


def test_the_client_seeds_only_sampled_requests_that_ask_for_logprobs() -> None:
    """A seed makes the policy plan a request as on any placement (``Request.reproducible``): the
    client draws one only where a resumed run could not give what was asked (the resumed tokens'
    log-probabilities)."""
    assert "seed" not in seeded({"temperature": 0.8})
    assert seeded({"temperature": 0.8, "seed": 4})["seed"] == 4 and "seed" not in seeded({"logprobs": 2})
    assert isinstance(seeded({"temperature": 0.8, "logprobs": 2})["seed"], int)
